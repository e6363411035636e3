"""Compute calibration: a rank's compute timed alone, with no communication -- the models' inputs.

Every prediction the experiments test against a measurement takes its compute times from a
separate run of this module, never from the run it predicts. All ranks of the pool run it at once
(so the contention for the cores is that of training), and the statistic is a median over
iterations. Two granularities, one per model:

* :func:`rank_calibrate_step` (E6-E9): ``C`` (zero_grad, batch, forward, backward, packing the
  gradients into one flat buffer) and ``U`` (the optimizer step) of a training configuration --
  the inputs of the Pipe-SGD timing model (Li et al. 2018, ``T_sync = C + M + U``,
  ``T_pipe = max(C + U, M)``; :mod:`pipecomm.lab.training.pipesgd_timing_model`), with
  :func:`pipecomm.lab.measure.bench.time_fn`'s conventions (barrier, max over ranks, median over iterations),
  summarised by :func:`summarize_step`;
* :func:`rank_calibrate_buckets` (E11, E12): per gradient bucket, the forward, backward and update
  time of the timing workload -- the inputs of the DAdam runtime model's event simulation
  (:func:`pipecomm.lab.training.dadam_runtime_model.simulate`), per-rank medians averaged over the ranks
  by :func:`summarize_buckets`.

The two are not one measurement: the timing model needs whole-step C and U of a real model under
the GIL switch interval of training, the runtime model needs each bucket's share of forward,
backward and update (taken from hooks) of the emulated-compute workload.

Example::

    cal = summarize_step(ranks.run(rank_calibrate_step, cfg, 10, 3, timeout_s=120))
    calib = summarize_buckets(ranks.run(rank_calibrate_buckets, spec, timeout_s=120))
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipecomm.lab.measure import bench
from pipecomm.lab.networks import launch
from pipecomm.lab.training.pipesgd_config import TrainConfig
from pipecomm.lab.training.trainers import gil_switch_interval, rank_world
from pipecomm.lab.workloads.tasks import (
    batch_stream,
    bucket_layout,
    build_model,
    build_timing_net,
    check_world,
    timing_bucket_mb,
)

__all__ = [
    "rank_calibrate_buckets",
    "rank_calibrate_step",
    "summarize_buckets",
    "summarize_step",
]

# --------------------------------------------------------------------------- whole step (E6-E9)


def rank_calibrate_step(cfg: TrainConfig, iters: int = 10, warmup: int = 3) -> dict[str, Any]:
    """On every rank: time ``C`` (zero_grad, batch, forward, backward, packing the gradients
    into one flat buffer) and ``U`` (the optimizer step) of a training configuration without
    communication.

    :func:`pipecomm.lab.measure.bench.time_fn` conventions (barrier, max over ranks, median over iterations);
    under the configuration's GIL switch interval, like training.

    Example::

        ranks.run(rank_calibrate_step, cfg, 10, 3, timeout_s=120)[0]   # {'compute_s': ..., ...}
    """
    with gil_switch_interval(cfg.switch_interval_s):
        return _time_step(cfg, iters, warmup)


def _time_step(cfg: TrainConfig, iters: int, warmup: int) -> dict[str, Any]:
    rank, world = rank_world()
    device = launch.device()
    model = build_model(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    stream = batch_stream(cfg, rank, world)
    params = [p for p in model.parameters() if p.requires_grad]

    def compute() -> None:
        xb, yb = (b.to(device) for b in next(stream))
        model.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        torch.cat([p.grad.reshape(-1) for p in params])

    def update() -> None:
        opt.step()

    c = bench.time_fn(compute, warmup=warmup, repeats=iters, device=device)
    u = bench.time_fn(update, warmup=1, repeats=iters, device=device)
    return {
        "compute_s": c["median_s"],
        "update_s": u["median_s"],
        "compute_times_s": c["times_s"],
        "update_times_s": u["times_s"],
    }


def summarize_step(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """``compute_s``/``update_s`` of a :func:`rank_calibrate_step` run (max over ranks is
    already applied by the harness; the ranks agree).

    Example::

        >>> per_rank = [{"compute_s": 0.016, "update_s": 0.0005}] * 2   # ranks.run(rank_calibrate_step, cfg, 8, 3, timeout_s=120)
        >>> summarize_step(per_rank)
        {'compute_s': 0.016, 'update_s': 0.0005}
    """
    first = per_rank[0]
    return {"compute_s": float(first["compute_s"]), "update_s": float(first["update_s"])}


# --------------------------------------------------------------------------- per bucket (E11, E12)


def rank_calibrate_buckets(spec: dict[str, Any]) -> dict[str, Any]:
    """On every rank: time the workload's compute without communication (a separate run).

    ``calib_iters`` local iterations (the first is dropped); per bucket (forward order) the
    forward time, the backward time (between consecutive buckets' gradients being ready) and
    the update time (copy into the model, Adam step, copy out: what a bucket update costs in
    DecentralizedDataParallel). All ranks run at once, so contention for the cores is included.
    Returns per-bucket medians over iterations.
    """
    check_world(spec)
    model = build_timing_net(spec)
    params = list(model.parameters())
    layout = bucket_layout(params, timing_bucket_mb(spec))  # backward order
    nb = len(layout)
    opts = [torch.optim.Adam([params[i] for i in idx], lr=spec["lr"]) for idx in layout]
    flats = [torch.zeros(sum(params[i].numel() for i in idx)) for idx in layout]
    bucket_of = {i: b for b, idx in enumerate(layout) for i in idx}
    x = torch.randn(
        spec["batch"],
        spec["width"],
        generator=torch.Generator().manual_seed(1000 + dist.get_rank()),
    )
    stamps: dict[str, Any] = {}

    def fwd_pre(j, *_):
        stamps.setdefault("fwd", {})[j] = [time.perf_counter(), None]

    def fwd_post(j, *_):
        stamps["fwd"][j][1] = time.perf_counter()

    def ready(i, *_):
        b = bucket_of[i]
        left = stamps["left"]
        left[b] -= 1
        if left[b] == 0:
            stamps["ready"][b] = time.perf_counter()

    hooks = []
    for j, blk in enumerate(model.blocks):
        hooks.append(blk.register_forward_pre_hook(functools.partial(fwd_pre, j)))
        hooks.append(blk.register_forward_hook(functools.partial(fwd_post, j)))
    for i, p in enumerate(params):
        hooks.append(p.register_post_accumulate_grad_hook(functools.partial(ready, i)))
    rows = []
    for it in range(spec["calib_iters"]):
        stamps.update(left=[len(idx) for idx in layout], ready=[0.0] * nb, fwd={})
        dist.barrier()
        loss = model(x).pow(2).mean()
        t_bwd = time.perf_counter()
        loss.backward()
        upd = []
        with torch.no_grad():
            for b, idx in enumerate(layout):
                ps = [params[i] for i in idx]
                views = list(torch.split(flats[b], [q.numel() for q in ps]))
                t0 = time.perf_counter()
                torch._foreach_copy_(
                    [q.detach() for q in ps], [v.view_as(q) for v, q in zip(views, ps)]
                )
                opts[b].step()
                torch._foreach_copy_(
                    [v.view_as(q) for v, q in zip(views, ps)], [q.detach() for q in ps]
                )
                upd.append(time.perf_counter() - t0)
                opts[b].zero_grad(set_to_none=True)
        if it == 0:
            continue
        # forward time per bucket: sum over the blocks whose parameter is in the bucket
        fwd_b = [0.0] * nb
        for blk_j, (t0, t1) in stamps["fwd"].items():
            w = model.blocks[blk_j][0].weight
            i = next(k for k, q in enumerate(params) if q is w)
            fwd_b[bucket_of[i]] += t1 - t0
        prev, bwd_b = t_bwd, []
        for b in range(nb):
            bwd_b.append(stamps["ready"][b] - prev)
            prev = stamps["ready"][b]
        rows.append((fwd_b, bwd_b, upd))
    for h in hooks:
        h.remove()
    # per bucket, median over iterations; reversed to forward order
    fwd = [statistics.median(r[0][b] for r in rows) for b in range(nb)][::-1]
    bwd = [statistics.median(r[1][b] for r in rows) for b in range(nb)][::-1]
    upd = [statistics.median(r[2][b] for r in rows) for b in range(nb)][::-1]
    nbytes = [sum(params[i].numel() * params[i].element_size() for i in idx) for idx in layout][
        ::-1
    ]
    return {
        "rank": dist.get_rank(),
        "fwd_s": fwd,
        "bwd_s": bwd,
        "step_s": upd,
        "bucket_bytes": nbytes,
    }


def summarize_buckets(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Per bucket, the mean over ranks of :func:`rank_calibrate_buckets`'s medians.

    Example::

        >>> per_rank = [{"bucket_bytes": [1 << 20], "fwd_s": [0.010], "bwd_s": [0.020], "step_s": [0.002]},
        ...             {"bucket_bytes": [1 << 20], "fwd_s": [0.012], "bwd_s": [0.020], "step_s": [0.002]}]
        >>> calib = summarize_buckets(per_rank)   # ranks.run(rank_calibrate_buckets, spec, timeout_s=60)
        >>> calib["fwd_s"], calib["bwd_s"], calib["step_s"], calib["bucket_bytes"]
        ([0.011], [0.02], [0.002], [1048576])
    """
    if not per_rank:
        raise ValueError("per_rank is empty: no calibration results")
    out: dict[str, Any] = {"bucket_bytes": list(per_rank[0]["bucket_bytes"])}
    for key in ("fwd_s", "bwd_s", "step_s"):
        out[key] = [
            float(np.mean([r[key][b] for r in per_rank])) for b in range(len(out["bucket_bytes"]))
        ]
    out["compute_s"] = float(sum(out["fwd_s"]) + sum(out["bwd_s"]) + sum(out["step_s"]))
    return out
