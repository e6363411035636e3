"""The training runs of the BSP-SGD / Pipe-SGD / layer-wise experiments (E5-E9).

No paper equation of its own: it drives :class:`pipecomm.pipesgd.PipeSGD` (BSP-SGD of the LP
paper, Pipe-SGD of Li et al. 2018, layer-wise and delayed GD of Daily et al. 2017) on the
image-classification workload (:mod:`pipecomm.lab.workloads.tasks`) and measures

* a **training run** (:func:`train_rank`) - ``iterations`` steps of one method
  (:func:`pipecomm.lab.training.pipesgd_config.parse_method`), with PipeSGD's per-iteration
  timings (compute, launch, communication blocked, compression, update, iteration), the local
  loss, and snapshots of the parameters every ``eval_every`` iterations that rank 0 evaluates on
  the held-out split *after* training (evaluation never sits inside a timed iteration; the
  snapshot copy does and is negligible);
* **calibrated runs** (:func:`calibrate_and_train`, E7-E9) - the compute-timing run
  (:func:`pipecomm.lab.measure.calibration.rank_calibrate_step`), the network chosen from it
  (:func:`pipecomm.lab.networks.kinds.network_for`), then every (seed, method) training run, and
  optionally separate short **timing runs** (rows of ``kind="timing"``).

Every configuration is trained in several separate runs (:func:`rounds`), one repeat each.
Independent repeats, why the loop is PipeSGD's own and devices: docs/experiments.md,
"pipesgd_config and pipesgd_training: the Pipe-SGD family in detail".

Example (inside ``launch.Ranks(2)``)::

    cfg = TrainConfig(method="pipe+int8", iterations=20)
    per_rank = ranks.run(pipesgd_training.train_rank, cfg, timeout_s=120)
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipecomm.lab import results
from pipecomm.lab.measure import bench
from pipecomm.lab.measure.calibration import rank_calibrate_step, summarize_step
from pipecomm.lab.networks import cost, launch
from pipecomm.lab.networks.kinds import network_and_link, network_for, ranks_on
from pipecomm.lab.training import pipesgd_timing_model as timing_model
from pipecomm.lab.training.pipesgd_config import (
    CalibratedPoolParams,
    TrainConfig,
    lr_scale,
    parse_method,
)
from pipecomm.lab.training.trainers import gil_switch_interval, rank_world
from pipecomm.lab.workloads import schedules
from pipecomm.lab.workloads.tasks import (
    batch_stream,
    build_model,
    evaluate,
    fetch_data,
    gradient_bytes,
)

__all__ = [
    "TIMING_COLUMNS",
    "calibrate_and_train",
    "eval_rows",
    "iteration_rows",
    "rounds",
    "train_rank",
]

TIMING_COLUMNS = ("compute_s", "launch_s", "comm_s", "compress_s", "update_s", "iter_s")


def train_rank(cfg: TrainConfig) -> dict[str, Any]:
    """On every rank: train ``cfg.iterations`` steps of ``cfg.method``; return timings,
    losses and (rank 0) held-out accuracy at the snapshots.

    Returns ``{"timings": [per-iteration dicts], "losses": [...], "evals": [...]}``; ``evals``
    (rank 0 only; none when ``cfg.evaluate`` is False) has ``iteration``, ``wall_s`` (this
    rank's elapsed training time at the snapshot, from the timings), ``accuracy`` (percent) and
    ``test_loss``; the last entry is the model after ``finish()`` (all in-flight gradients
    applied).

    Example::

        out = ranks.run(train_rank, TrainConfig(method="pipe"), timeout_s=300)
    """
    with gil_switch_interval(cfg.switch_interval_s):
        return _train(cfg)


def _train(cfg: TrainConfig) -> dict[str, Any]:
    from pipecomm.pipesgd import PipeSGD

    mode, staleness, compression = parse_method(cfg.method)
    rank, world = rank_world()
    device = launch.device()
    model = build_model(cfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.lr * lr_scale(cfg.method), momentum=cfg.momentum)
    sched = schedules.build(
        opt,
        cfg.schedule,
        total_steps=cfg.iterations,
        warmup_steps=cfg.warmup_steps,
        min_ratio=cfg.min_lr_ratio,
    )
    trainer = None
    if mode != "nocomm":
        trainer = PipeSGD(
            model,
            opt,
            mode=mode,
            staleness=staleness,
            algorithm=cfg.algorithm,
            compression=compression,
            bucket_mb=float(cfg.bucket_mb),
            timing=True,
        )
    stream = batch_stream(cfg, rank, world)
    every = cfg.eval_every
    snapshots: list[tuple[int, list[torch.Tensor]]] = []
    losses: list[float] = []
    lrs: list[float] = []
    local_timings: list[dict[str, Any]] = []
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if trainer is not None:
        trainer.reset_timings()
    mark = time.perf_counter()
    for t in range(cfg.iterations):
        xb, yb = (b.to(device) for b in next(stream))
        model.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if cfg.barrier_before_step and world > 1:
            dist.barrier()
        if trainer is None:
            bench.synchronize(device)
            start = time.perf_counter()
            opt.step()
            bench.synchronize(device)
            now = time.perf_counter()
            local_timings.append(
                {
                    "iteration": t,
                    "applied": True,
                    "updates": 1,
                    "compute_s": start - mark,
                    "launch_s": 0.0,
                    "comm_s": 0.0,
                    "compress_s": 0.0,
                    "update_s": now - start,
                    "iter_s": now - mark,
                }
            )
            mark = now
        else:
            trainer.step()
        lrs.append(opt.param_groups[0]["lr"])
        schedules.step(sched)
        losses.append(float(loss.item()))
        if (
            rank == 0
            and cfg.evaluate
            and every
            and (t + 1) % every == 0
            and t + 1 < cfg.iterations
        ):
            snapshots.append((t + 1, [p.detach().clone() for p in params]))
    if trainer is not None:
        trainer.finish()
        timings = [dict(r) for r in trainer.timings]
        trainer.remove_hooks()
    else:
        timings = local_timings
    evals = []
    if rank == 0 and cfg.evaluate:
        elapsed = np.cumsum([r["iter_s"] for r in timings])
        by_iter = {}
        for r, e in zip(timings, elapsed):
            if r["iteration"] is not None:
                by_iter[r["iteration"] + 1] = float(e)
        final = [p.detach().clone() for p in params]
        items = [*snapshots, (cfg.iterations, final)]
        for i, (it, snap) in enumerate(items):
            with torch.no_grad():
                for p, s in zip(params, snap):
                    p.copy_(s)
            acc, tl = evaluate(model, cfg)
            last = i == len(items) - 1
            evals.append(
                {
                    "iteration": it,
                    "lr": lrs[it - 1],
                    "lr_peak": cfg.lr * lr_scale(cfg.method),
                    "wall_s": float(elapsed[-1]) if last else by_iter[it],
                    "accuracy": acc,
                    "test_loss": tl,
                    "final": last,
                }
            )
    return {"timings": timings, "losses": losses, "evals": evals}


# --------------------------------------------------------------------------- in the parent


def rounds(items: list[Any], runs: int) -> list[tuple[int, Any]]:
    """``(run, item)`` pairs of ``runs`` rounds over ``items``: every item once per round, the
    order rotated by one each round (each item takes every place equally often), so that the
    runs of all items are interleaved in time.

    Example::

        >>> rounds(["sync", "pipe"], 3)
        [(0, 'sync'), (0, 'pipe'), (1, 'pipe'), (1, 'sync'), (2, 'sync'), (2, 'pipe')]
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(f"runs must be an int >= 1, got {runs!r}")
    items = list(items)
    out = []
    for r in range(runs):
        k = r % len(items) if items else 0
        out += [(r, item) for item in items[k:] + items[:k]]
    return out


def iteration_rows(per_rank: list[dict[str, Any]], **meta: Any) -> list[dict[str, Any]]:
    """Tidy rows (``kind="iteration"``, or ``meta``'s ``kind``), one per rank and step, from
    :func:`train_rank` results.

    The record of ``finish()`` (no iteration number) is kept with ``iteration = -1``.
    """
    rows = []
    for rank, res in enumerate(per_rank):
        losses = res["losses"]
        for rec in res["timings"]:
            it = rec["iteration"]
            row = {
                "kind": "iteration",
                **meta,
                "rank": rank,
                "iteration": -1 if it is None else int(it),
                "updates": int(rec["updates"]),
                "loss": losses[it] if it is not None and it < len(losses) else float("nan"),
            }
            row.update({k: float(rec[k]) for k in TIMING_COLUMNS})
            rows.append(row)
    return rows


def eval_rows(per_rank: list[dict[str, Any]], **meta: Any) -> list[dict[str, Any]]:
    """Tidy rows (``kind="eval"``) of rank 0's held-out accuracy at each snapshot, with the
    ranks' mean training loss of that step."""
    losses = np.mean([r["losses"] for r in per_rank], axis=0)
    return [
        {"kind": "eval", **meta, **e, "train_loss": float(losses[e["iteration"] - 1])}
        for e in per_rank[0]["evals"]
    ]



def calibrate_and_train(
    params: CalibratedPoolParams,
    config: Callable[[CalibratedPoolParams, int, str], TrainConfig],
    methods: list[str],
    seeds: list[int],
    iterations: dict[str, int] | None = None,
    repeats: int = 1,
    timing: tuple[list[str], int, int] | None = None,
    runs_seed: Callable[[int, str], bool] | None = None,
) -> pd.DataFrame:
    """Compute-timing run, network choice, then every (seed, method) training run (E7-E9).

    ``params`` holds ``backend``, ``world_size``, ``bandwidth_Bps`` (None: choose from
    ``comm_ratio``), ``alpha_s``, ``ports``, ``algorithm``, ``calib_iters``, ``skip``,
    ``timeout_s``; with ``backend="nccl"`` there is no emulated network (the network parameters
    are unused) and the model's link is E0's calibration (:func:`pipecomm.lab.networks.cost.calibrated_link`);
    ``config(params, seed, method)`` gives a training configuration; ``iterations`` overrides the
    number of steps per method (e.g. fewer for "nocomm", which only times); ``repeats`` trains
    every (seed, method) that many times (:func:`rounds`, interleaved). ``timing = (methods,
    iterations, runs)`` adds separate short timing runs (no evaluation) of those methods from the
    first seed, ``runs`` rounds of them (rows ``kind="timing"``), before the training runs. With
    ``bandwidth_Bps=None`` the compute timing runs in a pool without a network, which is then
    closed; otherwise it runs in the network's pool, before any training. Returns one
    ``calibration`` row (C, U, bandwidth, the modelled AllReduce/compute ratio and model
    iteration times, pipelined with fp16 / int8 compression too where the algorithm compresses)
    and the iteration and eval rows of every run, in the order run (for each seed, every method:
    side by side; ``runs_seed(i, method)`` False leaves out the training of ``method`` from the
    ``i``-th seed). ``run`` numbers the independent runs of a method: ``seed index * repeats +
    round`` for the training runs, the round for the timing runs.
    """
    runs_seed = runs_seed or (lambda i, method: True)
    trained = sum(runs_seed(i, m) for i in range(len(seeds)) for m in methods)
    p = params.world_size
    fetch_data(params)
    cfg0 = config(params, seeds[0], "sync")
    nbytes = gradient_bytes(cfg0)
    # resumable run by run (results.Runs): the calibration, then every training run
    t_methods, t_iters, t_runs = timing if timing else ([], 0, 0)
    runs = results.Runs(1 + trained * repeats + len(t_methods) * t_runs,
                        desc="training runs")

    def calibrate(ranks) -> dict[str, float]:
        return summarize_step(
            ranks.run(rank_calibrate_step, cfg0, params.calib_iters, 3, timeout_s=params.timeout_s)
        )

    nccl = params.backend == "nccl"
    cal = None
    key = {"calibration": cfg0.asdict(), "world_size": p, "backend": params.backend}
    if params.bandwidth_Bps is None and not nccl:
        with launch.Ranks(p) as ranks:
            cal = runs(key, calibrate, ranks)
    net, link = network_and_link(params, lambda: network_for(params, cal, nbytes))
    rows: list[dict[str, Any]] = []
    with ranks_on(params.network, p, net, backend=params.backend,
                  timeout_s=params.timeout_s) as ranks:
        if ranks.net is not None:  # a shaped network: the model's link is its calibration
            link = cost.link_from_network(ranks.net)
        if cal is None:
            cal = runs({**key, "network": ranks.text}, calibrate, ranks)
        kw = dict(
            compute_s=cal["compute_s"],
            update_s=cal["update_s"],
            nbytes=nbytes,
            p=p,
            link=link,
            algorithm=params.algorithm,
        )
        model_comm = cost.allreduce_time(params.algorithm, nbytes, p, link)
        rows.append(
            {
                "kind": "calibration",
                **cal,
                "nbytes": nbytes,
                "comm_ratio_model": model_comm / (cal["compute_s"] + cal["update_s"]),
                "model_comm_s": model_comm,
                **{
                    f"model_{m}_s": timing_model.iteration_time(m, **kw)
                    for m in ("nocomm", "sync", "layerwise", "pipe")
                },
                **{
                    f"model_pipe_{codec}_s": timing_model.iteration_time(
                        "pipe", compression=codec, **kw)
                    if params.algorithm in ("lp", "ring") else float("nan")
                    for codec in ("fp16", "int8")
                },
            }
        )
        for r, method in rounds(t_methods, t_runs) if t_runs else []:
            # a timing run times iterations: no evaluation, and a constant rate (a warm-up
            # longer than the short run would be refused; the rate does not change the time)
            cfg = dataclasses.replace(config(params, seeds[0], method), iterations=t_iters,
                                      evaluate=False, eval_every=0, schedule="constant",
                                      warmup_steps=0)
            res = runs({"timing": cfg.asdict(), "network": ranks.text, "run": r}, ranks.run,
                       train_rank, cfg, timeout_s=params.timeout_s)
            rows += iteration_rows(res, kind="timing", method=method, seed=seeds[0], run=r)
        for i, seed in enumerate(seeds):
            for r, method in rounds([m for m in methods if runs_seed(i, m)], repeats):
                cfg = config(params, seed, method)
                if iterations and method in iterations:
                    cfg = dataclasses.replace(cfg, iterations=iterations[method])
                key = {"train": cfg.asdict(), "network": ranks.text}
                if repeats > 1:
                    key["run"] = r
                res = runs(key, ranks.run, train_rank, cfg, timeout_s=params.timeout_s)
                run = i * repeats + r
                rows += iteration_rows(res, method=method, seed=seed, run=run)
                rows += eval_rows(res, method=method, seed=seed, run=run)
    runs.close()
    return pd.DataFrame(rows).assign(
        backend=params.backend,
        world_size=p,
        schedule=schedules.describe(cfg0.schedule, cfg0.warmup_steps, cfg0.min_lr_ratio),
        network=ranks.text,
        network_kind=ranks.kind,
        bandwidth_Bps=1.0 / link.beta,
        skip=params.skip,
        algorithm=params.algorithm,
    )
