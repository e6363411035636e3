"""Shared code of experiments E10-E13 (DAdam paper: Wang, Zhang, Wu, Johansson, ICLR 2025).

One concept: the *workloads and measurements* the decentralized-training experiments share.

* The two-level emulated network of the cpu profile (:func:`make_network`) and its link models
  (:func:`link_models`, via :func:`pipecomm.cost.link_from_network`).
* The timing workload: :class:`TimingNet`, bias-free ``width x width`` linear layers on synthetic
  inputs, each followed by :class:`EmulatedCompute`, which sleeps a configured time in forward and
  in backward. Eight ranks on two cores cannot compute in parallel, so the cpu profile emulates the
  compute of an accelerator the way it emulates the network: the sleeps release the core, every
  rank "computes" at once, and a per-rank, per-iteration factor injects varying compute times
  (the DAdam paper's third factor).
* :class:`AllReduceTrainer`: the AllReduce baseline, :class:`pipecomm.pipesgd.PipeSGD` in
  ``"layerwise"`` mode -- gradient buckets all-reduced asynchronously as soon as backward has
  produced them (PyTorch-DDP style), overlapped with the rest of backward, then one optimizer step:
  the schedule ``runtime_model.simulate("allreduce")`` models. On pipecomm's collectives, so it
  runs on the emulated network.
* Rank functions (module level, so the rank processes can import them): compute calibration
  (:func:`rank_calibrate_compute`, no communication), training-iteration timing
  (:func:`rank_time_training`), isolated gossip timing (:func:`rank_gossip_times`).
* :func:`predict_training`: the runtime model's prediction of what :func:`rank_time_training`
  measures, from the calibration, the network's link parameters and the injected factors.

Example::

    from pipecomm import launch
    from pipecomm.experiments import _decentralized as D
    net = D.make_network(D.DEFAULT_NETWORK)
    spec = D.timing_spec(p=8)
    with launch.Ranks(8, network=net, ranks_per_node=2) as ranks:
        calib = D.summarize_calibration(ranks.run(D.rank_calibrate_compute, spec, timeout_s=120))
        spec["kind"], spec["topology"] = "decentralized", "alternating-exp-ring"
        measured = ranks.run(D.rank_time_training, spec, timeout_s=300)[0]["iteration_s"]
    predicted = D.predict_training(spec, calib, net)["iteration_s"]
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipecomm import bench, collectives, cost, netem
from pipecomm.bucketing import bucket_indices, bucket_nbytes
from pipecomm.decentralized import runtime_model, topology
from pipecomm.stats import join_repeats

__all__ = [
    "DEFAULT_NETWORK",
    "FLAT_NETWORK",
    "AllReduceTrainer",
    "EmulatedCompute",
    "TimingNet",
    "bucket_layout",
    "link_models",
    "make_network",
    "method_name",
    "network_text",
    "predict_training",
    "rank_calibrate_compute",
    "rank_gossip_times",
    "rank_time_training",
    "summarize_calibration",
    "timing_spec",
]

#: The cpu profile's two-level network (docs/network_model.md): nodes of 2 ranks, intra-node links
#: of 1 ms / 400 MB/s, one inter-node uplink/downlink per node of 2 ms / 50 MB/s, single port.
DEFAULT_NETWORK: dict[str, Any] = {
    "intra_alpha_s": 1e-3,
    "intra_bandwidth_Bps": 400e6,
    "inter_alpha_s": 2e-3,
    "inter_bandwidth_Bps": 50e6,
    "ports": "single",
}
#: The same network with homogeneous links (inter-node = intra-node), for the link-factor sweep.
FLAT_NETWORK: dict[str, Any] = {
    **DEFAULT_NETWORK,
    "inter_alpha_s": 1e-3,
    "inter_bandwidth_Bps": 400e6,
}

NETWORK_KEYS = tuple(DEFAULT_NETWORK)


# ------------------------------------------------------------------------------------ network


def make_network(cfg: dict[str, Any]) -> netem.Network:
    """The two-level :class:`pipecomm.netem.Network` described by ``cfg`` (keys of
    :data:`DEFAULT_NETWORK`); ranks per node come from the launcher.

    Example::

        net = make_network(DEFAULT_NETWORK)   # 1 ms / 400 MB/s inside, 2 ms / 50 MB/s between
    """
    missing = [k for k in NETWORK_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"network parameters {missing} are missing; expected {NETWORK_KEYS}")
    return netem.Network(
        alpha_s=cfg["intra_alpha_s"],
        bandwidth_Bps=cfg["intra_bandwidth_Bps"],
        ports=cfg["ports"],
        inter_alpha_s=cfg["inter_alpha_s"],
        inter_bandwidth_Bps=cfg["inter_bandwidth_Bps"],
    )


def link_models(net: netem.Network) -> tuple[cost.LinkModel, cost.LinkModel]:
    """``(intra, inter)`` link models of an emulated network (gamma from E0's calibration).

    Example::

        intra, inter = link_models(make_network(DEFAULT_NETWORK))
        inter.bandwidth_Bps      # 50e6
    """
    return cost.link_from_network(net, "intra"), cost.link_from_network(net, "inter")


def network_text(net: netem.Network | None, ranks_per_node: int | None) -> str:
    """The ``network`` column: ``"real"`` or the emulated network's ``describe()`` text."""
    return "real" if net is None else net.describe(ranks_per_node=ranks_per_node)


# ------------------------------------------------------------------------------ the workload


class _SleepFn(torch.autograd.Function):
    """Identity that sleeps ``fwd_s`` in forward and ``bwd_s`` in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        if fwd_s > 0:
            time.sleep(fwd_s)
        ctx.bwd_s = bwd_s
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.bwd_s > 0:
            time.sleep(ctx.bwd_s)
        return grad, None, None


class EmulatedCompute(nn.Module):
    """Emulated accelerator compute: sleeps ``fwd_s * factor`` in forward and ``bwd_s * factor``
    in backward (the core is free meanwhile); the identity on its input.

    Example::

        layer = nn.Sequential(nn.Linear(512, 512, bias=False), EmulatedCompute(0.01, 0.02))
    """

    def __init__(self, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        if fwd_s < 0 or bwd_s < 0:
            raise ValueError(f"fwd_s and bwd_s must be >= 0 seconds, got {fwd_s}, {bwd_s}")
        self.fwd_s, self.bwd_s, self.factor = float(fwd_s), float(bwd_s), 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepFn.apply(x, self.fwd_s * self.factor, self.bwd_s * self.factor)


class TimingNet(nn.Module):
    """Timing workload: ``layers`` blocks of ``Linear(width, width, bias=False)`` followed by
    :class:`EmulatedCompute` (``fwd_s`` / ``bwd_s`` seconds per block), on synthetic inputs.

    Each block has exactly one parameter of ``4 width^2`` bytes, so with ``bucket_mb`` equal to
    that size every block is one communication bucket.

    Example::

        net = TimingNet(width=512, layers=2, fwd_s=0.01, bwd_s=0.02)   # 2 buckets of 1 MiB
        net.set_factor(1.3)                                            # a slow iteration
    """

    def __init__(self, width: int, layers: int, fwd_s: float, bwd_s: float) -> None:
        super().__init__()
        if width < 1 or layers < 1:
            raise ValueError(f"width and layers must be >= 1, got {width}, {layers}")
        self.blocks = nn.Sequential(
            *[
                nn.Sequential(nn.Linear(width, width, bias=False), EmulatedCompute(fwd_s, bwd_s))
                for _ in range(layers)
            ]
        )
        for blk in self.blocks:  # keep activations O(1) through the stack
            nn.init.orthogonal_(blk[0].weight)

    def set_factor(self, factor: float) -> None:
        """Scale every emulated compute time of the next iterations by ``factor``."""
        for m in self.modules():
            if isinstance(m, EmulatedCompute):
                m.factor = float(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def timing_spec(p: int, **overrides: Any) -> dict[str, Any]:
    """A complete timing specification (the workload of E11/E12) with defaults.

    Keys: ``width``, ``layers``, ``batch``, ``fwd_ms``/``bwd_ms`` (emulated compute per layer),
    ``compute_scale`` (multiplies both), ``compute_cv`` (log-normal factor per rank and
    iteration, mean 1), ``seed``, ``kind`` (``"allreduce"`` or ``"decentralized"``),
    ``topology``, ``algorithm``, ``warmup``, ``blocks``, ``block_iters``, ``calib_iters``,
    ``ranks_per_node``, ``p``.

    Example::

        spec = timing_spec(8, compute_scale=0.5, kind="allreduce")
    """
    spec = {
        "p": p,
        "ranks_per_node": 2,
        "width": 512,
        "layers": 2,
        "batch": 8,
        "fwd_ms": 10.0,
        "bwd_ms": 20.0,
        "compute_scale": 1.0,
        "compute_cv": 0.0,
        "seed": 0,
        "kind": "allreduce",
        "topology": "alternating-exp-ring",
        "algorithm": "ring",
        "warmup": 3,
        "blocks": 3,
        "block_iters": 5,
        "calib_iters": 6,
        "lr": 1e-4,
    }
    unknown = sorted(set(overrides) - set(spec))
    if unknown:
        raise ValueError(f"unknown timing parameters {unknown}; known: {sorted(spec)}")
    spec.update(overrides)
    return spec


def _bucket_mb(spec: dict[str, Any]) -> float:
    """Bucket size that puts every TimingNet layer in a bucket of its own."""
    return 4 * spec["width"] ** 2 / 2**20


def _build_timing_net(spec: dict[str, Any]) -> TimingNet:
    s = spec["compute_scale"]
    torch.manual_seed(spec["seed"])
    return TimingNet(
        spec["width"], spec["layers"], spec["fwd_ms"] * s / 1e3, spec["bwd_ms"] * s / 1e3
    )


def bucket_layout(params: Sequence[torch.Tensor], bucket_mb: float) -> list[list[int]]:
    """Buckets of parameter indices, in backward order (parameters reversed), closed once they
    reach ``bucket_mb`` MiB -- the rule of :class:`~pipecomm.decentralized.DecentralizedDataParallel`
    for a model whose gradients become ready in reverse registration order.

    Example::

        bucket_layout([torch.zeros(3), torch.zeros(5)], bucket_mb=1e-6)   # [[1], [0]]
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    return bucket_indices(params, bucket_mb * 2**20, order="reverse")


def bucket_bytes_forward(params: Sequence[torch.Tensor], bucket_mb: float) -> list[int]:
    """Bytes of every bucket of :func:`bucket_layout`, in *forward* order (the runtime model's).

    Example::

        bucket_bytes_forward(list(TimingNet(512, 2, 0, 0).parameters()), 1.0)   # [1 MiB, 1 MiB]
    """
    return bucket_nbytes(params, bucket_layout(params, bucket_mb))[::-1]


#: The models E13 trains (and E10 times the gossip of): name -> (pipecomm.models name, keywords).
#: ``char_transformer`` also gets ``vocab_size`` from the pydoc corpus.
TASK_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mlp": ("mlp", {"in_channels": 1, "image_size": 8, "hidden": (64,)}),
    "char_transformer": (
        "char_transformer",
        {"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 48},
    ),
}
#: Bucket size (MiB) of DecentralizedDataParallel in E13 (its default).
TASK_BUCKET_MB = 25.0


@functools.lru_cache(maxsize=1)
def corpus() -> Any:
    """The pydoc character corpus (built once per process)."""
    from pipecomm import data

    return data.CharCorpus.from_name("pydoc")


def build_task_model(name: str, seed: int) -> nn.Module:
    """E13's model ``name`` (a key of :data:`TASK_MODELS`), initialised from ``seed``.

    Example::

        lm = build_task_model("char_transformer", seed=0)
    """
    from pipecomm import models

    if name not in TASK_MODELS:
        raise ValueError(f"unknown task model {name!r}; choose one of {sorted(TASK_MODELS)}")
    arch, kw = TASK_MODELS[name]
    if arch == "char_transformer":
        kw = {**kw, "vocab_size": corpus().vocab_size}
    torch.manual_seed(seed)
    return models.get_model(arch, **kw)


def workload_bucket_bytes(name: str) -> list[int]:
    """Bucket sizes (bytes, forward order) of a workload: ``"timing"`` (E11/E12's TimingNet,
    one bucket per layer) or a key of :data:`TASK_MODELS` (buckets of :data:`TASK_BUCKET_MB`).

    Example::

        workload_bucket_bytes("timing")   # [1048576, 1048576]
    """
    if name == "timing":
        spec = timing_spec(2)
        return bucket_bytes_forward(list(_build_timing_net(spec).parameters()), _bucket_mb(spec))
    model = build_task_model(name, 0)
    return bucket_bytes_forward([p for p in model.parameters() if p.requires_grad], TASK_BUCKET_MB)


# -------------------------------------------------------------------- the AllReduce baseline


class AllReduceTrainer:
    """The AllReduce baseline: :class:`pipecomm.pipesgd.PipeSGD` in ``"layerwise"`` mode.

    Gradient buckets (reverse registration order, closed at ``bucket_mb`` MiB, as DDP) are
    all-reduced (average) asynchronously from backward hooks as soon as backward has produced
    them, overlapped with the rest of backward; ``step()`` waits for all of them and takes the
    optimizer's step (zero staleness) -- the schedule ``runtime_model.simulate("allreduce")``
    models, and the best overlapped AllReduce of this library.

    Example::

        ar = AllReduceTrainer(model, torch.optim.Adam(model.parameters()), 1.0, "ring")
        ar.zero_grad(); loss_fn(model(x), y).backward(); ar.step()
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, bucket_mb: float, algorithm: str
    ) -> None:
        from pipecomm.pipesgd import PipeSGD

        self.model = model
        self.trainer = PipeSGD(
            model, optimizer, mode="layerwise", algorithm=algorithm, bucket_mb=bucket_mb
        )

    def zero_grad(self) -> None:
        """Clear the gradients before the next backward."""
        self.model.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Wait for the bucket allreduces and step."""
        self.trainer.step()

    def close(self) -> None:
        """Apply anything in flight and detach the hooks."""
        self.trainer.finish()
        self.trainer.remove_hooks()


# ------------------------------------------------------------------------ rank functions


def _factors(spec: dict[str, Any], iterations: int) -> np.ndarray:
    """Compute factors ``[iteration, rank]``: exactly the draws of ``runtime_model.simulate``."""
    rng = np.random.default_rng(spec["seed"])
    return runtime_model.lognormal_factors(spec["compute_cv"], (iterations, spec["p"]), rng)


def _check_world(spec: dict[str, Any]) -> int:
    p = dist.get_world_size()
    if p != spec["p"]:
        raise ValueError(f"spec is for p={spec['p']} ranks but the pool has {p}")
    return p


def rank_calibrate_compute(spec: dict[str, Any]) -> dict[str, Any]:
    """On every rank: time the workload's compute without communication (a separate run).

    ``calib_iters`` local iterations (the first is dropped); per bucket (forward order) the
    forward time, the backward time (between consecutive buckets' gradients being ready) and
    the update time (copy into the model, Adam step, copy out: what a bucket update costs in
    DecentralizedDataParallel). All ranks run at once, so contention for the cores is included.
    Returns per-bucket medians over iterations.
    """
    _check_world(spec)
    model = _build_timing_net(spec)
    params = list(model.parameters())
    layout = bucket_layout(params, _bucket_mb(spec))  # backward order
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


def summarize_calibration(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per bucket, the mean over ranks of :func:`rank_calibrate_compute`'s medians.

    Example::

        calib = summarize_calibration(ranks.run(rank_calibrate_compute, spec, timeout_s=60))
        calib["fwd_s"], calib["bwd_s"], calib["step_s"], calib["bucket_bytes"]
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


def _adam_fn(lr: float) -> Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]:
    return functools.partial(_make_adam, lr=lr)


def _make_adam(named: list[tuple[str, nn.Parameter]], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for _, p in named], lr=lr)


def rank_time_training(spec: dict[str, Any]) -> dict[str, Any]:
    """On every rank: train the timing workload and time its iterations.

    ``spec["kind"]`` ``"allreduce"`` (:class:`AllReduceTrainer` + Adam) or
    ``"decentralized"`` (:class:`~pipecomm.decentralized.DecentralizedDataParallel` + Adam on
    ``spec["topology"]``), gossip/allreduce ``spec["algorithm"]``. Iteration ``k`` of rank ``r``
    scales its emulated compute by ``factors[k, r]`` (:func:`_factors`, the same draws as the
    runtime model's). ``warmup`` iterations (iteration 0 included), then ``blocks`` blocks of
    ``block_iters`` iterations timed with :func:`pipecomm.bench.time_fn` (a barrier before each
    block, max over ranks). Returns ``iteration_s`` = median block time / block_iters, the block
    times and, for decentralized runs, the wrapper's cumulative wait/update/launch times.
    """
    from pipecomm.decentralized import DecentralizedDataParallel

    p = _check_world(spec)
    rank = dist.get_rank()
    model = _build_timing_net(spec)
    total = spec["warmup"] + spec["blocks"] * spec["block_iters"]
    factors = _factors(spec, total)
    x = torch.randn(
        spec["batch"], spec["width"], generator=torch.Generator().manual_seed(1000 + rank)
    )
    ar = ddp = None
    if spec["kind"] == "allreduce":
        ar = AllReduceTrainer(
            model,
            torch.optim.Adam(model.parameters(), lr=spec["lr"]),
            bucket_mb=_bucket_mb(spec),
            algorithm=spec["algorithm"],
        )
        fwd = model
    elif spec["kind"] == "decentralized":
        topo = topology.get_topology(spec["topology"], p, ranks_per_node=spec["ranks_per_node"])
        ddp = DecentralizedDataParallel(
            model,
            _adam_fn(spec["lr"]),
            topology=topo,
            bucket_mb=_bucket_mb(spec),
            algorithm=spec["algorithm"],
        )
        fwd = ddp
    else:
        raise ValueError(f"kind must be 'allreduce' or 'decentralized', got {spec['kind']!r}")
    k = 0

    def one() -> None:
        nonlocal k
        model.set_factor(float(factors[k, rank]))
        k += 1
        if ar is not None:
            ar.zero_grad()
        fwd(x).pow(2).mean().backward()
        if ar is not None:
            ar.step()

    def block() -> None:
        for _ in range(spec["block_iters"]):
            one()

    try:
        for _ in range(spec["warmup"]):
            one()
        if ddp is not None:
            ddp.reset_timing()
        stats = bench.time_fn(block, warmup=0, repeats=spec["blocks"])
    finally:
        if ddp is not None:
            ddp.close()
        if ar is not None:
            ar.close()
    out = {
        "rank": rank,
        "iteration_s": stats["median_s"] / spec["block_iters"],
        "iteration_ci_lo_s": stats["ci_lo_s"] / spec["block_iters"],
        "iteration_ci_hi_s": stats["ci_hi_s"] / spec["block_iters"],
        "block_s": stats["times_s"],
        # per-iteration time of each block: the repeats behind iteration_s
        "times_s": join_repeats(
            [b / spec["block_iters"] for b in stats["times_s"]]),
        "iterations": k,
    }
    if ddp is not None:
        out.update({key: float(v) for key, v in ddp.timing.items()})
    return out


def predict_training(
    spec: dict[str, Any], calib: dict[str, Any], net: netem.Network
) -> dict[str, Any]:
    """The runtime model's prediction of :func:`rank_time_training`'s ``iteration_s``.

    Inputs: the per-bucket compute of ``calib`` (a separate compute-only run), the link
    parameters of ``net`` (:func:`link_models`), the topology, and the same compute factors that
    the measured run injects. The statistic mirrors the measurement: iterations after
    ``warmup``, cut into ``blocks`` blocks, median block time / ``block_iters``.

    Example::

        predict_training(spec, calib, net)["iteration_s"]
    """
    intra, inter = link_models(net)
    total = spec["warmup"] + spec["blocks"] * spec["block_iters"]
    kw = dict(
        bucket_bytes=calib["bucket_bytes"],
        fwd_s=calib["fwd_s"],
        bwd_s=calib["bwd_s"],
        step_s=calib["step_s"],
        p=spec["p"],
        ranks_per_node=spec["ranks_per_node"],
        intra=intra,
        inter=inter,
        compute_cv=spec["compute_cv"],
        iterations=total,
        seed=spec["seed"],
        algorithm=spec["algorithm"],
        warmup=spec["warmup"],
    )
    if spec["kind"] == "allreduce":
        r = runtime_model.simulate("allreduce", **kw)
    else:
        r = runtime_model.simulate("decentralized", topology=spec["topology"], **kw)
    its = np.asarray(r["iteration_s"]).reshape(spec["blocks"], spec["block_iters"])
    return {
        "iteration_s": float(np.median(its.sum(axis=1))) / spec["block_iters"],
        "mean_iteration_s": r["mean_iteration_s"],
        "comm_s": r["comm_s"],
        "compute_s": r["compute_s"],
    }


# ------------------------------------------------------------------------ gossip timing (E10)

_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _group(ranks: tuple[int, ...]) -> Any:
    """Process group of ``ranks`` (created on first use; all ranks call in the same order)."""
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks))
    return _GROUPS[key]


def rank_gossip_times(
    bucket_bytes: Sequence[int],
    topology_name: str,
    ranks_per_node: int,
    algorithm: str,
    warmup: int,
    iters: int,
) -> list[dict[str, Any]]:
    """On every rank: for each step of one period of the topology, time the gossip of all
    buckets (float32 buffers of ``bucket_bytes``) over that step's groups, every group at once.

    The buckets are all-reduced (``op="avg"``) asynchronously, back to back on the
    communication thread, as DecentralizedDataParallel launches them; the time of a step is
    :func:`pipecomm.bench.time_fn`'s (barrier, max over ranks, median over ``iters``).
    Returns one row per step (identical on every rank).
    """
    p, rank = dist.get_world_size(), dist.get_rank()
    topo = topology.get_topology(topology_name, p, ranks_per_node=ranks_per_node)
    for g in topo.distinct_groups():  # every rank creates the same groups in the same order
        if len(g) > 1:
            _group(g)
    bufs = [torch.ones(max(1, int(n) // 4)) for n in bucket_bytes]
    rows = []
    for step in range(topo.period or 1):
        g = topo.group_of(rank, step)
        pg = _group(g) if len(g) > 1 else None

        def gossip(pg: Any = pg) -> None:
            if pg is None:
                return
            hs = [
                collectives.allreduce(b, algorithm=algorithm, op="avg", group=pg, async_op=True)
                for b in bufs
            ]
            for h in hs:
                h.wait()

        st = bench.time_fn(gossip, warmup=warmup, repeats=iters)
        rows.append(
            {
                "step": step,
                **bench.columns(st),
                "groups": " ".join("(" + ",".join(map(str, g)) + ")" for g in topo.groups(step)),
            }
        )
    return rows


def method_name(kind: str, topology: str | None) -> str:
    """Display name: ``AllReduce`` or ``DAdam (<topology>)`` (AER for the alternating ring).

    Example::

        method_name("decentralized", "alternating-exp-ring")   # 'DAdam (AER)'
    """
    if kind == "allreduce":
        return "AllReduce"
    return f"DAdam ({'AER' if topology == 'alternating-exp-ring' else topology})"


def model_gossip_time(
    groups: Sequence[Sequence[int]],
    bucket_bytes: Sequence[int],
    ranks_per_node: int,
    net: netem.Network,
    algorithm: str,
) -> float:
    """Cost-model time of one gossip step: the slowest group's allreduces of every bucket, back
    to back, with concurrent groups sharing the inter-node uplinks
    (:func:`pipecomm.decentralized.runtime_model.step_comm_times`).

    Example::

        model_gossip_time([(0, 1, 2, 3)], [1 << 20], 2, make_network(DEFAULT_NETWORK), "ring")
    """
    intra, inter = link_models(net)
    times = runtime_model.step_comm_times(
        groups,
        list(bucket_bytes),
        ranks_per_node=ranks_per_node,
        intra=intra,
        inter=inter,
        algorithm=algorithm,
    )
    return float(max(sum(row) for row in times))


def check_positive_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``, else a ValueError naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"parameter {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def bars_with_markers(ax: Any, data: Any, *, x: str, y: str, hue: str, order: list,
                      hue_order: list, marker: str, label: str) -> None:
    """Seaborn bars of ``y`` (measured) with a black dash per bar at ``marker`` (the model).

    Example::

        bars_with_markers(ax, df, x="topology", y="measured_ms", hue="world_size",
                          order=["complete", "AER"], hue_order=[4, 8], marker="model_ms",
                          label="model")
    """
    import seaborn as sns

    sns.barplot(data=data, x=x, y=y, hue=hue, order=order, hue_order=hue_order, ax=ax,
                palette="deep")
    width = 0.8 / len(hue_order)
    for j, h in enumerate(hue_order):
        for i, xv in enumerate(order):
            sel = data[(data[hue] == h) & (data[x] == xv)]
            if len(sel):
                ax.plot([i - 0.4 + width * (j + 0.5)], [sel[marker].iloc[0]], "k_",
                        markersize=14, mew=2, label=label if i == 0 and j == 0 else None)


def check_timing_workload(p: dict[str, Any], *nonnegative: str) -> None:
    """Validate the timing workload shared by E11 and E12: the gossip/AllReduce algorithm
    (pipecomm's own), the layer and iteration counts, and ``fwd_ms``, ``bwd_ms`` and any other
    ``nonnegative`` numbers."""
    if p["algorithm"] not in ("lp", "ring", "be", "mst"):
        raise ValueError(
            f"parameter algorithm must be one of lp, ring, be, mst (pipecomm's own; "
            f"'torch' cannot run on the emulated network), got {p['algorithm']!r}"
        )
    for key, lo in (
        ("width", 1),
        ("layers", 1),
        ("blocks", 1),
        ("block_iters", 1),
        ("warmup", 1),
        ("calib_iters", 2),
        ("seed", 0),
    ):
        check_positive_int(key, p[key], lo)
    for key in ("fwd_ms", "bwd_ms", *nonnegative):
        if isinstance(p[key], bool) or not isinstance(p[key], (int, float)) or p[key] < 0:
            raise ValueError(f"parameter {key} must be a number >= 0, got {p[key]!r}")


def check_world_sizes(name: str, values: Any, ranks_per_node: int) -> list[int]:
    """World sizes: a non-empty list of multiples of ``ranks_per_node`` with a power-of-two
    number of nodes (what every topology here accepts)."""
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(
            f"parameter {name} must be a non-empty list of world sizes, got {values!r}"
        )
    out = []
    for v in values:
        v = check_positive_int(name, v, 2)
        nodes = v // ranks_per_node
        if v % ranks_per_node or nodes & (nodes - 1):
            raise ValueError(
                f"parameter {name}: world size {v} must be {ranks_per_node} ranks per node times "
                f"a power-of-two number of nodes (e.g. {2 * ranks_per_node}, {4 * ranks_per_node})"
            )
        out.append(v)
    return out
