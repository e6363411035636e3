"""Shared training loop of the BSP-SGD / Pipe-SGD / layer-wise experiments (E5-E9).

No paper equation of its own: it drives :class:`pipecomm.pipesgd.PipeSGD` (BSP-SGD of the LP
paper, Pipe-SGD of Li et al. 2018, layer-wise and delayed GD of Daily et al. 2017) on the offline
digits images, and measures

* a **compute-timing run** (:func:`compute_timing_rank`) - forward + backward + packing of the
  gradients (``C``) and the optimizer step (``U``) with no communication, on every rank of the
  pool at once (so CPU contention is that of training), timed with :func:`pipecomm.bench.time_fn`.
  These are the timing model's inputs; they never come from the run the model predicts;
* a **training run** (:func:`train_rank`) - ``iterations`` steps of one method, with PipeSGD's
  per-iteration timings (compute, launch, communication blocked, compression, update, iteration),
  the local loss, and snapshots of the parameters every ``eval_every`` iterations that rank 0
  evaluates on the held-out split *after* training (evaluation never sits inside a timed
  iteration; the snapshot copy does and is negligible).

Devices: every rank trains on :func:`pipecomm.launch.device` -- the CPU under gloo, its own GPU
under NCCL (``backend="nccl"`` of E5 and E7-E9, gpu profile: no emulated network, the real
interconnect; the cost model then uses E0's calibrated link). With CUDA every timing point first
synchronises the device (:func:`pipecomm.bench.synchronize`), so timings are GPU work, not kernel
launches. The NCCL path has not been run on a GPU yet (artifact/ARTIFACT.md, "GPU").

Methods (``method`` names used by the experiments): ``"nocomm"`` (local steps, no AllReduce: the
no-communication bound of Daily et al.'s Figure 1), ``"sync"``, ``"layerwise"``, ``"pipe"``
(staleness 1), ``"delayed-1"``/``"delayed-2"`` (pipe with staleness 1 / 2), each optionally with
``"+fp16"``, ``"+bf16"`` or ``"+int8"`` compression inside the AllReduce, and optionally with
``"@4x"``: the configuration's learning rate times 4 (a stress configuration: staleness is known
to hurt at large steps). The learning rate follows ``schedule`` (:mod:`pipecomm.schedules`:
constant, or linear warm-up then cosine decay); every eval row records the rate in force.

Example (inside ``launch.Ranks(2)``)::

    cfg = dict(DEFAULT_CONFIG, method="pipe+int8", iterations=20)
    per_rank = ranks.run(_training.train_rank, cfg, timeout_s=120)
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipecomm import bench, claims, cost, data, launch, models, schedules, stats, vocab

#: Training configuration keys and their defaults (experiments override some).
DEFAULT_CONFIG: dict[str, Any] = {
    "model": "cnn",
    "model_kw": {"channels": [64, 128], "hidden": 256},
    "dataset": "digits",
    "data_root": None,
    "batch_size": 64,
    "lr": 0.01,
    "momentum": 0.0,
    "schedule": "constant",
    "warmup_steps": 0,
    "min_lr_ratio": 0.0,
    "seed": 0,
    "data_seed": 0,
    "iterations": 20,
    "method": "sync",
    "algorithm": "ring",
    "bucket_mb": 25.0,
    "eval_every": 0,
    "evaluate": True,
    "barrier_before_step": False,
    "switch_interval_s": 0.005,
}

COMPRESSIONS = vocab.CODECS
BASE_METHODS = ("nocomm", "sync", "layerwise", "pipe", "delayed-1", "delayed-2")
TIMING_COLUMNS = ("compute_s", "launch_s", "comm_s", "compress_s", "update_s", "iter_s")


def parse_method(method: str) -> tuple[str, int | None, str | None]:
    """``"pipe+int8"`` -> ``("pipe", 1, "int8")``: PipeSGD mode, staleness, compression.

    ``"nocomm"`` gives mode ``"nocomm"`` (no PipeSGD at all).

    Example::

        >>> parse_method("delayed-2"), parse_method("sync+fp16")
        (('pipe', 2, None), ('sync', None, 'fp16'))
    """
    if not isinstance(method, str):
        raise ValueError(f"method must be a string like 'pipe+int8', got {method!r}")
    lr_scale(method)
    base, _, codec = method.partition("@")[0].partition("+")
    if base not in BASE_METHODS:
        raise ValueError(f"method {method!r}: the part before '+' must be one of {BASE_METHODS}")
    if codec and codec not in COMPRESSIONS:
        raise ValueError(f"method {method!r}: compression after '+' must be one of {COMPRESSIONS}")
    if base == "nocomm" and codec:
        raise ValueError(f"method {method!r}: 'nocomm' does not communicate, so cannot compress")
    compression = codec or None
    if base == "nocomm":
        return "nocomm", None, None
    if base == "pipe":
        return "pipe", 1, compression
    if base.startswith("delayed-"):
        return "pipe", int(base.split("-")[1]), compression
    return base, None, compression


def lr_scale(method: str) -> float:
    """The learning-rate multiplier of a method name: ``"pipe@4x"`` -> 4.0, ``"pipe"`` -> 1.0.

    Example::

        >>> lr_scale("pipe+int8@0.5x"), lr_scale("sync")
        (0.5, 1.0)
    """
    _, at, scale = method.partition("@")
    if not at:
        return 1.0
    try:
        value = float(scale.removesuffix("x")) if scale.endswith("x") else math.nan
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"method {method!r}: the part after '@' must be a positive factor like '4x'")
    return value


def config(params: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """A training configuration: :data:`DEFAULT_CONFIG`, then the experiment's parameters of the
    same names, then ``overrides`` (the per-run choices: method, seed, ...).

    Example::

        cfg = config(p, seed=1, method="pipe")
    """
    cfg = dict(DEFAULT_CONFIG)
    cfg.update({k: params[k] for k in DEFAULT_CONFIG if k in params})
    cfg["model_kw"] = dict(cfg["model_kw"])
    cfg.update(overrides)
    return cfg


def check_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Validate a training configuration (unknown keys and bad values are ValueErrors).

    Example::

        cfg = check_config(dict(DEFAULT_CONFIG, method="pipe", iterations=5))
    """
    unknown = sorted(set(cfg) - set(DEFAULT_CONFIG))
    if unknown:
        raise ValueError(f"unknown training setting(s) {unknown}; known: {sorted(DEFAULT_CONFIG)}")
    cfg = {**DEFAULT_CONFIG, **cfg}
    parse_method(cfg["method"])
    for key in ("evaluate", "barrier_before_step"):
        if not isinstance(cfg[key], bool):
            raise ValueError(f"{key} must be True or False, got {cfg[key]!r}")
    for key in ("batch_size", "iterations"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be a positive int, got {v!r}")
    if (
        isinstance(cfg["eval_every"], bool)
        or not isinstance(cfg["eval_every"], int)
        or cfg["eval_every"] < 0
    ):
        raise ValueError(
            f"eval_every must be an int >= 0 (0: final only), got {cfg['eval_every']!r}"
        )
    v = cfg["switch_interval_s"]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
        raise ValueError(f"switch_interval_s must be in (0, 1] seconds, got {v!r}")
    for key in ("lr", "momentum"):
        v = cfg[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{key} must be a finite number >= 0, got {v!r}")
    schedules.check(cfg["schedule"], cfg["iterations"], cfg["warmup_steps"], cfg["min_lr_ratio"])
    if cfg["model"] not in models.MODELS:
        raise ValueError(f"model must be one of {tuple(models.MODELS)}, got {cfg['model']!r}")
    if not isinstance(cfg["model_kw"], dict):
        raise ValueError(
            f"model_kw must be a dict of constructor arguments, got {cfg['model_kw']!r}"
        )
    if cfg["dataset"] not in data.DATASETS:
        raise ValueError(f"dataset must be one of {data.DATASETS}, got {cfg['dataset']!r}")
    if cfg["dataset"] != "digits" and not isinstance(cfg["data_root"], str):
        raise ValueError(
            f"dataset={cfg['dataset']!r} needs data_root, the folder for the official files "
            "(fetched there once, checksums verified; 'digits' ships with scikit-learn)"
        )
    return cfg


# --------------------------------------------------------------------------- on the ranks


@functools.lru_cache(maxsize=4)
def _dataset(
    name: str, split: str, seed: int, root: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    return data.load_dataset(name, split=split, seed=seed, root=root)


# Official training-split sizes and image shapes (channels, side), known without the files.
_TRAIN_SIZES = {"mnist": 60_000, "cifar10": 50_000}
_IMAGE_SHAPES = {"mnist": (1, 28), "cifar10": (3, 32)}


def build_model(cfg: dict[str, Any]) -> torch.nn.Module:
    """The configuration's model, initialised from ``torch.manual_seed(cfg["seed"])``.

    Example::

        model = build_model(dict(DEFAULT_CONFIG, model="mlp", model_kw={"hidden": [64]}))
    """
    torch.manual_seed(cfg["seed"])
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg["model_kw"].items()}
    if cfg["dataset"] in _IMAGE_SHAPES:
        channels, size = _IMAGE_SHAPES[cfg["dataset"]]
    else:
        x, _ = _dataset(cfg["dataset"], "train", cfg["data_seed"], cfg["data_root"])
        channels, size = x.shape[1], x.shape[2]
    return models.get_model(cfg["model"], in_channels=channels, image_size=size, **kw)


def gradient_bytes(cfg: dict[str, Any]) -> int:
    """Bytes of one rank's flattened gradient (what every AllReduce of the run moves).

    Example::

        gradient_bytes(dict(DEFAULT_CONFIG))      # about 0.83 MB for the default CNN
    """
    return models.param_bytes(build_model(check_config(cfg)))


def batch_stream(cfg: dict[str, Any], rank: int, world: int) -> Iterator[tuple]:
    """Endless minibatches of this rank's shard, epoch after epoch (deterministic per seed)."""
    X, y = _dataset(cfg["dataset"], "train", cfg["data_seed"], cfg["data_root"])
    epoch = 0
    while True:
        idx = data.shard(len(X), rank, world, cfg["seed"], epoch)
        if len(idx) < cfg["batch_size"]:
            raise ValueError(
                f"batch_size={cfg['batch_size']} exceeds the {len(idx)} samples of a rank's shard"
            )
        yield from data.batches(X, y, idx, cfg["batch_size"], cfg["seed"], epoch)
        epoch += 1


@contextlib.contextmanager
def gil_switch_interval(seconds: float) -> Iterator[None]:
    """Set Python's GIL switch interval (``sys.setswitchinterval``) for a block, then restore it.

    PipeSGD's AllReduce runs on a communication thread. Each time it wakes (a transfer done, an
    emulated deadline reached) it needs the GIL; while the compute thread runs Python (module
    calls, hooks, the optimizer loop) it may wait up to the switch interval -- 5 ms by default --
    per wake-up, which delays the reduction it should overlap. The experiments E6-E9 set
    ``switch_interval_s`` (recorded with their data); 0.005 is Python's default.

    Example::

        with gil_switch_interval(1e-4):
            train()
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def compute_timing_rank(cfg: dict[str, Any], iters: int = 10, warmup: int = 3) -> dict[str, Any]:
    """On every rank: time ``C`` (zero_grad, batch, forward, backward, packing the gradients
    into one flat buffer) and ``U`` (the optimizer step) without communication.

    :func:`pipecomm.bench.time_fn` conventions (barrier, max over ranks, median over iterations);
    under the configuration's GIL switch interval, like training.

    Example::

        ranks.run(compute_timing_rank, cfg, 10, 3, timeout_s=120)[0]   # {'compute_s': ..., ...}
    """
    cfg = check_config(cfg)
    with gil_switch_interval(cfg["switch_interval_s"]):
        return _compute_timing(cfg, iters, warmup)


def _compute_timing(cfg: dict[str, Any], iters: int, warmup: int) -> dict[str, Any]:
    rank, world = _rank_world()
    device = launch.device()
    model = build_model(cfg).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
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


def _evaluate(model: torch.nn.Module, cfg: dict[str, Any]) -> tuple[float, float]:
    Xt, yt = _dataset(cfg["dataset"], "test", cfg["data_seed"], cfg["data_root"])
    device = next(model.parameters()).device
    Xt, yt = Xt.to(device), yt.to(device)
    with torch.no_grad():
        out = model(Xt)
        loss = F.cross_entropy(out, yt).item()
        acc = (out.argmax(1) == yt).double().mean().item() * 100.0
    return acc, loss


def train_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """On every rank: train ``cfg["iterations"]`` steps of ``cfg["method"]``; return timings,
    losses and (rank 0) held-out accuracy at the snapshots.

    Returns ``{"timings": [per-iteration dicts], "losses": [...], "evals": [...]}``; ``evals``
    (rank 0 only; none when ``cfg["evaluate"]`` is False) has ``iteration``, ``wall_s`` (this
    rank's elapsed training time at the snapshot, from the timings), ``accuracy`` (percent) and
    ``test_loss``; the last entry is the model after ``finish()`` (all in-flight gradients
    applied).

    Example::

        out = ranks.run(train_rank, dict(DEFAULT_CONFIG, method="pipe"), timeout_s=300)
    """
    cfg = check_config(cfg)
    with gil_switch_interval(cfg["switch_interval_s"]):
        return _train(cfg)


def _train(cfg: dict[str, Any]) -> dict[str, Any]:
    from pipecomm.pipesgd import PipeSGD

    mode, staleness, compression = parse_method(cfg["method"])
    rank, world = _rank_world()
    device = launch.device()
    model = build_model(cfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg["lr"] * lr_scale(cfg["method"]), momentum=cfg["momentum"])
    sched = schedules.build(
        opt,
        cfg["schedule"],
        total_steps=cfg["iterations"],
        warmup_steps=cfg["warmup_steps"],
        min_ratio=cfg["min_lr_ratio"],
    )
    trainer = None
    if mode != "nocomm":
        trainer = PipeSGD(
            model,
            opt,
            mode=mode,
            staleness=staleness,
            algorithm=cfg["algorithm"],
            compression=compression,
            bucket_mb=float(cfg["bucket_mb"]),
            timing=True,
        )
    stream = batch_stream(cfg, rank, world)
    every = cfg["eval_every"]
    snapshots: list[tuple[int, list[torch.Tensor]]] = []
    losses: list[float] = []
    lrs: list[float] = []
    local_timings: list[dict[str, Any]] = []
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    if trainer is not None:
        trainer.reset_timings()
    mark = time.perf_counter()
    for t in range(cfg["iterations"]):
        xb, yb = (b.to(device) for b in next(stream))
        model.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        if cfg["barrier_before_step"] and world > 1:
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
            and cfg["evaluate"]
            and every
            and (t + 1) % every == 0
            and t + 1 < cfg["iterations"]
        ):
            snapshots.append((t + 1, [p.detach().clone() for p in params]))
    if trainer is not None:
        trainer.finish()
        timings = [dict(r) for r in trainer.timings]
        trainer.remove_hooks()
    else:
        timings = local_timings
    evals = []
    if rank == 0 and cfg["evaluate"]:
        elapsed = np.cumsum([r["iter_s"] for r in timings])
        by_iter = {}
        for r, e in zip(timings, elapsed):
            if r["iteration"] is not None:
                by_iter[r["iteration"] + 1] = float(e)
        final = [p.detach().clone() for p in params]
        items = [*snapshots, (cfg["iterations"], final)]
        for i, (it, snap) in enumerate(items):
            with torch.no_grad():
                for p, s in zip(params, snap):
                    p.copy_(s)
            acc, tl = _evaluate(model, cfg)
            last = i == len(items) - 1
            evals.append(
                {
                    "iteration": it,
                    "lr": lrs[it - 1],
                    "lr_peak": cfg["lr"] * lr_scale(cfg["method"]),
                    "wall_s": float(elapsed[-1]) if last else by_iter[it],
                    "accuracy": acc,
                    "test_loss": tl,
                    "final": last,
                }
            )
    return {"timings": timings, "losses": losses, "evals": evals}


# --------------------------------------------------------------------------- in the parent


def iteration_rows(per_rank: list[dict[str, Any]], **meta: Any) -> list[dict[str, Any]]:
    """Tidy rows (``kind="iteration"``), one per rank and step, from :func:`train_rank` results.

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


def steady(df: pd.DataFrame, skip: int) -> pd.DataFrame:
    """Iteration rows of the steady state: iterations ``>= skip`` (the pipeline filled, caches
    warm); the ``finish()`` record (iteration -1) is dropped.

    Example::

        steady(df[df.kind == "iteration"], skip=5)
    """
    return df[(df["kind"] == "iteration") & (df["iteration"] >= skip)]


def per_iteration(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Per step (``keys`` + iteration): ``T`` = max over ranks of ``iter_s``, ``C`` = max over
    ranks of the compute-thread time (``iter_s - comm_s``), ``M = T - C`` (the communication on
    the critical path of the slowest computer), and the other timings' max over ranks.

    Example::

        per_iteration(steady(df, 5), ["method", "seed"])
    """
    d = df.assign(work_s=df["iter_s"] - df["comm_s"])
    agg = d.groupby([*keys, "iteration"], as_index=False).agg(
        T=("iter_s", "max"),
        C=("work_s", "max"),
        compute_s=("compute_s", "max"),
        launch_s=("launch_s", "max"),
        comm_s=("comm_s", "max"),
        compress_s=("compress_s", "max"),
        update_s=("update_s", "max"),
        loss=("loss", "mean"),
    )
    agg["M"] = (agg["T"] - agg["C"]).clip(lower=0.0)
    return agg


def step_samples(df: pd.DataFrame, method: str) -> list[float]:
    """Every steady iteration time ``T`` of ``method`` (all seeds pooled): the repeats behind a
    per-iteration median, for :func:`pipecomm.claims.ratio`.

    Example::

        claims.ratio(step_samples(df, "sync"), step_samples(df, "pipe"))   # speedup
    """
    skip = int(df["skip"].iloc[0]) if "skip" in df else 0
    st = steady(df, skip)
    st = st[st["method"] == method]
    if st.empty:
        raise ValueError(f"no steady iterations of {method!r} in the data")
    keys = ["method", "seed"] if "seed" in st else ["method"]
    return per_iteration(st, keys)["T"].tolist()


def median_times(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Median over steady iterations of :func:`per_iteration`'s columns, per ``keys``."""
    cols = ["T", "C", "M", "compute_s", "launch_s", "comm_s", "compress_s", "update_s"]
    return per_iteration(df, keys).groupby(keys, as_index=False)[cols].median()


def choose_bandwidth(
    target_s: float,
    nbytes: int,
    p: int,
    alpha_s: float,
    *,
    algorithm: str = "ring",
    ports: str = "single",
    gamma: float | None = None,
) -> float:
    """The emulated bandwidth (bytes/s) at which the cost model's AllReduce of ``nbytes`` over
    ``p`` ranks takes ``target_s`` seconds (bisection; the model is decreasing in bandwidth).

    ``gamma`` defaults to the calibrated reduction cost (:func:`pipecomm.cost.calibrated_link`).
    A target at or below the latency-and-reduction floor is a ValueError. ``algorithm`` defaults
    to ``"ring"`` rather than pipecomm's ``"lp"``: the Pipe-SGD experiments train with a ring
    AllReduce, as the Pipe-SGD paper does (their ``DEFAULTS``).

    Example::

        choose_bandwidth(0.02, 830_000, 2, 1e-3)      # about 45e6 (ring, p = 2)
    """
    if gamma is None:
        gamma = cost.calibrated_link().gamma

    def model(bw: float) -> float:
        link = cost.LinkModel.from_bandwidth(alpha_s, bw, gamma=gamma, ports=ports)
        return cost.allreduce_time(algorithm, nbytes, p, link)

    lo, hi = 1e4, 1e12
    if not target_s > model(hi):
        raise ValueError(
            f"an AllReduce of {nbytes} bytes over p={p} costs at least {model(hi) * 1e3:.2f} ms "
            f"(latency alpha_s={alpha_s} and reductions) on any bandwidth; the target "
            f"{target_s * 1e3:.2f} ms (comm_ratio x compute) is unreachable: raise comm_ratio or "
            "lower alpha_s"
        )
    if model(lo) < target_s:
        return lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if model(mid) > target_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


def calibration_summary(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """``compute_s``/``update_s`` of a :func:`compute_timing_rank` run (max over ranks is
    already applied by the harness; the ranks agree)."""
    first = per_rank[0]
    return {"compute_s": float(first["compute_s"]), "update_s": float(first["update_s"])}


def first_reach(evals: pd.DataFrame, target: float) -> tuple[float, float]:
    """(iteration, wall_s) of the first snapshot with accuracy >= ``target``; NaNs if never.

    Example::

        first_reach(df[(df.kind == "eval") & (df.method == "sync")], 80.0)
    """
    hit = evals[evals["accuracy"] >= target].sort_values("iteration")
    if hit.empty:
        return float("nan"), float("nan")
    return float(hit["iteration"].iloc[0]), float(hit["wall_s"].iloc[0])


# --------------------------------------------------------------------------- parameter checks


def merge_checked(defaults: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` updated with ``params``; unknown names and wrong types are ValueErrors that
    name the parameter (the checks of :mod:`pipecomm.experiments._cli`).

    Example::

        p = merge_checked(DEFAULTS, {"iterations": 5})
    """
    from pipecomm.experiments._cli import check_type, merge_params

    p = merge_params(defaults, params, " for this experiment")
    for name, value in p.items():
        check_type(name, value, defaults[name])
    return p


def require(cond: bool, name: str, value: Any, what: str) -> None:
    """Raise ``ValueError("parameter NAME=VALUE: WHAT")`` unless ``cond``."""
    if not cond:
        raise ValueError(f"parameter {name}={value!r}: {what}")


def positive_int(p: dict[str, Any], *names: str) -> None:
    """Each named parameter must be an int >= 1."""
    for n in names:
        v = p[n]
        require(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1, n, v, "must be an int >= 1"
        )


def positive_float(p: dict[str, Any], *names: str) -> None:
    """Each named parameter must be a finite number > 0."""
    for n in names:
        v = p[n]
        require(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
            n,
            v,
            "must be a finite number > 0",
        )


# --------------------------------------------------------------------------- calibrated runs


def network_for(p: dict[str, Any], cal: dict[str, float] | None, nbytes: int):
    """The emulated network of E7-E9: ``p["bandwidth_Bps"]`` when given, else the bandwidth at
    which the cost model's AllReduce takes ``p["comm_ratio"] * (C + U)`` of the compute-timing
    run ``cal`` (:func:`choose_bandwidth`).

    Example::

        network_for({"bandwidth_Bps": None, "comm_ratio": 1.0, "world_size": 2, "alpha_s": 1e-3,
                     "algorithm": "ring", "ports": "single"},
                    {"compute_s": 0.016, "update_s": 0.0005}, 830_000)
    """
    from pipecomm import netem

    bw = p["bandwidth_Bps"]
    if bw is None:
        if cal is None:
            raise ValueError("bandwidth_Bps=None needs a compute-timing run to choose it from")
        target = p["comm_ratio"] * (cal["compute_s"] + cal["update_s"])
        bw = choose_bandwidth(
            target,
            nbytes,
            p["world_size"],
            p["alpha_s"],
            algorithm=p["algorithm"],
            ports=p["ports"],
        )
    return netem.Network(alpha_s=p["alpha_s"], bandwidth_Bps=float(bw), ports=p["ports"])


def calibrate_and_train(
    p: dict[str, Any],
    config,
    methods: list[str],
    seeds: list[int],
    iterations: dict[str, int] | None = None,
) -> pd.DataFrame:
    """Compute-timing run, network choice, then every (seed, method) training run (E7-E9).

    ``p`` holds ``backend``, ``world_size``, ``bandwidth_Bps`` (None: choose from
    ``comm_ratio``), ``alpha_s``, ``ports``, ``algorithm``, ``calib_iters``, ``skip``,
    ``timeout_s``; with ``backend="nccl"`` there is no emulated network (the network parameters
    are unused) and the model's link is E0's calibration (:func:`pipecomm.cost.calibrated_link`);
    ``config(p, seed, method)`` gives a training configuration; ``iterations`` overrides the
    number of steps per method (e.g. fewer for "nocomm", which only times). With
    ``bandwidth_Bps=None`` the compute timing runs in a pool without a network, which is then
    closed; otherwise it runs in the network's pool, before any training. Returns one
    ``calibration`` row (C, U, bandwidth, the modelled AllReduce/compute ratio and model
    iteration times) and the iteration and eval rows of every run, in the order run (for each
    seed, every method: side by side).
    """
    from pipecomm import launch, results, timing_model

    world = p["world_size"]
    fetch_data(p)
    cfg0 = config(p, seeds[0], "sync")
    nbytes = gradient_bytes(cfg0)
    # resumable run by run (results.Runs): the calibration, then every training run
    runs = results.Runs(1 + len(seeds) * len(methods), desc="training runs")

    def calibrate(ranks) -> dict[str, float]:
        return calibration_summary(
            ranks.run(compute_timing_rank, cfg0, p["calib_iters"], 3, timeout_s=p["timeout_s"])
        )

    nccl = p["backend"] == "nccl"
    cal = None
    key = {"calibration": cfg0, "world_size": world, "backend": p["backend"]}
    if p["bandwidth_Bps"] is None and not nccl:
        with launch.Ranks(world) as ranks:
            cal = runs(key, calibrate, ranks)
    net, link = network_and_link(p, lambda: network_for(p, cal, nbytes))
    rows: list[dict[str, Any]] = []
    with launch.pool(world, backend=p["backend"], network=net) as ranks:
        if cal is None:
            cal = runs({**key, "network": network_text(net)}, calibrate, ranks)
        kw = dict(
            compute_s=cal["compute_s"],
            update_s=cal["update_s"],
            nbytes=nbytes,
            p=world,
            link=link,
            algorithm=p["algorithm"],
        )
        model_comm = cost.allreduce_time(p["algorithm"], nbytes, world, link)
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
            }
        )
        for seed in seeds:
            for method in methods:
                cfg = config(p, seed, method)
                if iterations and method in iterations:
                    cfg["iterations"] = iterations[method]
                res = runs({"train": cfg, "network": network_text(net)}, ranks.run, train_rank,
                           cfg, timeout_s=p["timeout_s"])
                rows += iteration_rows(res, method=method, seed=seed)
                rows += eval_rows(res, method=method, seed=seed)
    runs.close()
    return pd.DataFrame(rows).assign(
        backend=p["backend"],
        world_size=world,
        schedule=schedules.describe(cfg0["schedule"], cfg0["warmup_steps"], cfg0["min_lr_ratio"]),
        network=network_text(net),
        bandwidth_Bps=1.0 / link.beta,
        skip=p["skip"],
        algorithm=p["algorithm"],
    )


def check_backend(p: dict[str, Any]) -> None:
    """The ``backend`` parameter of E5 and E7-E9: ``"gloo"`` (emulated network on CPU ranks) or
    ``"nccl"`` (one GPU per rank, the real interconnect; ``alpha_s``, ``bandwidth_Bps``,
    ``ports`` and ``comm_ratio`` are then unused).

    Example::

        check_backend({"backend": "gloo", "world_size": 2})
    """
    from pipecomm.experiments._cli import check_backend as check

    check(p["backend"], p["world_size"], emulated=False)
    if launch.under_torchrun() and p["backend"] != "nccl":
        raise ValueError(
            "under torchrun this experiment runs with backend='nccl' (the real network); its "
            "gloo design needs the emulated network of local ranks: run it without torchrun"
        )


def network_and_link(p: dict[str, Any], emulated: Any) -> tuple[Any, cost.LinkModel]:
    """``(network, link)`` of a training experiment: ``(None, E0's calibrated link)`` under
    NCCL, else ``(emulated(), that network's link)``.

    Example::

        net, link = network_and_link(p, lambda: netem.Network(1e-3, 50e6))
    """
    if p["backend"] == "nccl":
        return None, cost.calibrated_link()
    net = emulated()
    return net, cost.link_from_network(net)


def network_text(net: Any) -> str:
    """The ``network`` column: the emulated network's ``describe()``, or the real one's name."""
    return "real interconnect (not emulated)" if net is None else net.describe()




def fetch_data(p: dict[str, Any]) -> None:
    """Before any rank starts: fetch ``p["dataset"]`` into ``p["data_root"]`` unless it is there
    with the right checksums (:func:`pipecomm.data.fetch`; network needed once). Nothing for
    "digits", which ships with scikit-learn.

    Example::

        fetch_data({"dataset": "cifar10", "data_root": "data"})   # gpu profile
    """
    if p.get("dataset", "digits") != "digits":
        data.fetch(p["dataset"], p["data_root"])


def check_batch_size(
    batch_size: int, world_size: int, dataset: str = "digits", name: str = "batch_size"
) -> None:
    """A rank's shard (``len(train) // world_size`` samples) must hold at least one batch.

    Example::

        check_batch_size(64, 4)        # digits: 1438 // 4 = 359 samples per rank: fine
    """
    n = _TRAIN_SIZES.get(dataset) or len(_dataset(dataset, "train", 0)[0])
    per_rank = n // world_size
    require(
        batch_size <= per_rank,
        name,
        batch_size,
        f"exceeds the {per_rank} training samples of each of {world_size} ranks",
    )


def is_true(values: pd.Series) -> pd.Series:
    """Booleans of a column that went through data.csv (True/False, "True"/"False", 1/0, NaN).

    Example::

        df[is_true(df["final"])]
    """
    return values.astype(str).str.strip().str.lower().isin(["true", "1", "1.0"])


# --------------------------------------------------------------------------- accuracy claims (E7, E9)


def final_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    """Accuracy after ``finish()`` per method and seed."""
    ev = df[(df["kind"] == "eval") & (is_true(df["final"]))]
    return ev[["method", "seed", "accuracy", "wall_s"]].reset_index(drop=True)


def paired_accuracy(df: pd.DataFrame, method: str, reference: str = "sync"
                    ) -> tuple[float, float, float, int]:
    """Mean paired (same seed) difference of final accuracy ``method - reference`` in points,
    with its 95% Student-t interval, and the number of pairs."""
    fin = final_accuracy(df)
    ref = fin[fin["method"] == reference].set_index("seed")["accuracy"]
    other = fin[fin["method"] == method].set_index("seed")["accuracy"]
    seeds = sorted(set(ref.index) & set(other.index))
    if not seeds:
        raise ValueError(f"no paired seeds with both {reference!r} and {method!r}")
    d, lo, hi = stats.paired_diff_ci(other.loc[seeds].to_numpy(), ref.loc[seeds].to_numpy())
    return d, lo, hi, len(seeds)


def accuracy_rise(df: pd.DataFrame, method: str, tail: float) -> float:
    """Points of held-out accuracy (mean over seeds) ``method`` still gained over the last
    ``tail`` fraction of its steps: how close to converged the run ended."""
    ev = df[(df["kind"] == "eval") & (df["method"] == method)]
    return claims.tail_gain(ev.groupby("iteration")["accuracy"].mean(), tail,
                            higher_is_better=True)


def convergence_gap(df: pd.DataFrame, reference: str, tail: float, tolerance: float) -> list[str]:
    """Why an accuracy comparison against ``reference`` cannot be decided: its held-out
    accuracy (mean over seeds) still rose by more than ``tolerance`` points over the last
    ``tail`` fraction of its steps (see :func:`pipecomm.claims.still_improving`)."""
    ev = df[(df["kind"] == "eval") & (df["method"] == reference)]
    gap = claims.still_improving(ev.groupby("iteration")["accuracy"].mean(), tail, tolerance,
                                 higher_is_better=True)
    return [f"{reference} {gap}"] if gap else []


def accuracy_within(df: pd.DataFrame, max_points: float, methods: list[str],
                          tail: float) -> claims.Verdict:
    """For each method: the mean paired difference (same seed) of final accuracy to sync, with
    its 95% Student-t interval, lies within ``+- max_points`` (PASS), entirely outside (FAIL),
    or straddles the bound (INCONCLUSIVE: the seeds cannot tell). Gated on convergence: when
    sync's accuracy still rose by more than ``max_points / 2`` over the last ``tail`` of its
    steps the comparison is INCONCLUSIVE whatever the interval says.

    Example::

        accuracy_within(df, 1.0, ["pipe", "pipe+fp16", "pipe+int8"], 0.1)
    """
    claims.require_columns(df, "kind", "method", "seed", "accuracy", "final", "iteration")
    fin = final_accuracy(df)
    sync = fin[fin["method"] == "sync"]["accuracy"]
    parts, verdicts = [], []
    for m in methods:
        d, lo, hi, _ = paired_accuracy(df, m)
        verdicts.append(claims.within(lo, hi, max_points))
        parts.append(f"{m} {d:+.2f} [{lo:+.2f}, {hi:+.2f}]")
    reasons = convergence_gap(df, "sync", tail, max_points / 2)
    measured = f"paired over {len(sync)} seeds, points vs sync ({sync.mean():.1f}%): "
    measured += ", ".join(parts) + (f" -- cannot decide: {reasons[0]}" if reasons else "")
    return claims.Verdict(
        measured,
        f"|difference| <= {max_points:g} point (95% interval), sync converged",
        claims.gate(claims.combine(verdicts), reasons),
    )


def stale_hurts(df: pd.DataFrame, method: str, reference: str, min_points: float,
                      tail: float) -> claims.Verdict:
    """The negative control: ``method`` (a stale method at a stress learning rate, e.g.
    ``"pipe@4x"``) ends more than ``min_points`` below ``reference`` (the same rate without
    staleness): the paired difference's 95% interval lies entirely below ``-min_points`` (PASS),
    entirely above it (FAIL: staleness did not hurt), or straddles it. Gated on the reference's
    convergence as :func:`accuracy_within`.

    Example::

        stale_hurts(df, "pipe@4x", "sync@4x", 1.0, 0.1)
    """
    claims.require_columns(df, "kind", "method", "seed", "accuracy", "final", "iteration")
    d, lo, hi, n = paired_accuracy(df, method, reference)
    reasons = convergence_gap(df, reference, tail, min_points / 2)
    fin = final_accuracy(df)
    ref = fin[fin["method"] == reference]["accuracy"].mean()
    measured = (f"{method} - {reference} ({ref:.1f}%): {d:+.2f} [{lo:+.2f}, {hi:+.2f}] points, "
                f"{n} paired seeds" + (f" -- cannot decide: {reasons[0]}" if reasons else ""))
    return claims.Verdict(
        measured,
        f"difference < -{min_points:g} point (95% interval), reference converged",
        claims.gate(claims.at_most(lo, hi, -min_points), reasons),
    )
