"""E13 — AllReduce Adam vs DAdam vs AccumAdam on complete and AER (DAdam paper, Tables 2-3, Fig. 7).

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025): decentralized Adam (DAdam: each rank's own Adam step from the gossiped
parameters) loses a little accuracy against AllReduce Adam (Table 3, ResNet-50: 76.01 vs 75.31 AER
/ 75.27 complete); AccumAdam -- Adam whose moments see gradients averaged over a window of K
iterations -- closes the gap or beats AllReduce (76.54 AER, 76.34 complete; Table 2, WMT14 BLEU
27.71/27.80 vs 27.79 +- 0.16). Claim reproduced (C13.1, threshold in artifact/claims.yaml):
AccumAdam's final loss is not worse than AllReduce Adam's beyond a small margin, over paired seeds.

Methods (betas (0.9, 0.999), no weight decay). Learning rates follow the paper's protocols
(docs/papers.md): for the image classifier AccumAdam gets 1.5 times AllReduce's (ResNet-50: 1.5e-3
vs 1e-3, ``digits_accum_lr_scale``), for the language model the same (Transformer: only the betas
differ there, and ours are equal, ``lm_accum_lr_scale``); DAdam uses AllReduce's:

* ``allreduce-adam``: gradients averaged over all ranks every iteration
  (``pipecomm.pipesgd.PipeSGD``, layer-wise mode), then torch Adam -- every replica identical;
* ``dadam-complete`` / ``dadam-aer``: ``DecentralizedDataParallel`` with torch Adam on the
  complete / alternating-exp-ring topology;
* ``accumadam-complete`` / ``accumadam-aer``: the same with ``AccumAdam(accum_iter=K)``.

Tasks, chosen (from a single-process pilot) so that AllReduce Adam is still improving at the end
of the run:

* ``digits``: scikit-learn's 8x8 digits, an MLP 64-64-10 (4.8 K parameters), 16 images per rank
  per iteration (disjoint shards per epoch); metric: test loss and accuracy;
* ``lm``: a character-level transformer (2 layers, 4 heads, 48 wide, context 32; 68 K parameters)
  on CPython's pydoc topics text (offline), 8 windows of 32 characters per rank; metric:
  validation loss (nats per character) on 64 fixed windows.

p = 4 ranks, 2 per node (AER: two nodes alternating an intra- and an inter-node average). At least
3 paired seeds: a seed fixes the initialisation and the data order, the same for every method.
Final metrics are those of the parameters averaged over the ranks (``global_average``); curves
show the ranks' mean training loss against iterations and against wall-clock time.

Network: by default the real gloo backend (no emulation, ``algorithm="torch"``): the final loss
does not depend on the network, and real communication keeps 30 training runs within the budget;
the wall-clock axis then shows loopback on a 2-core machine, not the paper's cluster (E12 covers
per-iteration time on the emulated network). ``emulated=True`` runs on the two-level emulated
network with pipecomm's ``ring`` instead. ``backend="nccl"`` (gpu profile) trains on one GPU per
rank over NCCL (real interconnect; emulation refused); every timed iteration then ends with a
device synchronisation so the wall-clock axis measures GPU work, not kernel launches.

The time budget of each profile is in ``artifact/profiles/<profile>.yaml``; a run's wall time
is in its ``env.json``.

Run::

    python -m pipecomm.experiments.e13_dadam_convergence --out results/manual/E13
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.nn.functional as F

from pipecomm import bench, claims, launch, stats
from pipecomm.decentralized import AccumAdam, topology
from pipecomm.experiments import _decentralized as D
from pipecomm.experiments import base
from pipecomm.experiments._cli import check_backend, main

ID = "E13"
NOTEBOOK = "13_dadam_convergence"
METHODS = ["allreduce-adam", "dadam-complete", "dadam-aer", "accumadam-complete", "accumadam-aer"]
LABELS = {
    "allreduce-adam": "AllReduce Adam",
    "dadam-complete": "DAdam (complete)",
    "dadam-aer": "DAdam (AER)",
    "accumadam-complete": "AccumAdam (complete)",
    "accumadam-aer": "AccumAdam (AER)",
}
TASKS = {"digits": "mlp", "lm": "char_transformer"}


@dataclass(frozen=True)
class Params(base.Params):
    """E13's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_size: int = 4
    ranks_per_node: int = 2
    tasks: list[str] = field(default_factory=lambda: ["digits", "lm"])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    digits_iterations: int = 30
    lm_iterations: int = 30
    eval_every: int = 10
    digits_batch: int = 16
    lm_batch: int = 8
    seq_len: int = 32
    digits_lr: float = 1e-3
    lm_lr: float = 3e-3
    accum_iter: int = 4
    digits_accum_lr_scale: float = 1.5
    lm_accum_lr_scale: float = 1.0
    emulated: bool = False
    backend: str = "gloo"
    timeout_s: float = 300.0

    def validate(self) -> None:
        p = self
        rpn = D.check_positive_int("ranks_per_node", p["ranks_per_node"])
        D.check_world_sizes("world_size", [p["world_size"]], rpn)
        for key, allowed in (("tasks", list(TASKS)), ("methods", METHODS)):
            v = p[key]
            if not isinstance(v, (list, tuple)) or not v or any(x not in allowed for x in v):
                raise ValueError(f"parameter {key} must be a non-empty list from {allowed}, got {v!r}")
        if not isinstance(p["seeds"], (list, tuple)) or not p["seeds"]:
            raise ValueError(f"parameter seeds must be a non-empty list of ints, got {p['seeds']!r}")
        for s in p["seeds"]:
            D.check_positive_int("seeds", s, 0)
        for key in (
            "digits_iterations",
            "lm_iterations",
            "eval_every",
            "digits_batch",
            "lm_batch",
            "seq_len",
            "accum_iter",
        ):
            D.check_positive_int(key, p[key])
        for key in ("digits_lr", "lm_lr", "digits_accum_lr_scale", "lm_accum_lr_scale"):
            if isinstance(p[key], bool) or not isinstance(p[key], (int, float)) or not p[key] > 0:
                raise ValueError(f"parameter {key} must be a number > 0, got {p[key]!r}")
        if not isinstance(p["emulated"], bool):
            raise ValueError(f"parameter emulated must be True or False, got {p['emulated']!r}")
        check_backend(p["backend"], p["world_size"], emulated=p["emulated"])


DEFAULTS = Params.defaults()


# --------------------------------------------------------------------------- one training run


def _split(method: str) -> tuple[str, str | None]:
    opt, _, topo = method.partition("-")
    if method == "allreduce-adam":
        return "adam", None
    return ("accumadam" if opt == "accumadam" else "adam"), (
        "alternating-exp-ring" if topo == "aer" else topo
    )


def _optim(named: list, lr: float, accum: int, kind: str) -> torch.optim.Optimizer:
    params = [p for _, p in named]
    if kind == "accumadam":
        return AccumAdam(params, lr=lr, accum_iter=accum)
    return torch.optim.Adam(params, lr=lr)


@functools.lru_cache(maxsize=4)
def _digits(split: str, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    from pipecomm import data

    X, y = data.load_dataset("digits", split=split, seed=0)
    return X.to(device), y.to(device)


@functools.lru_cache(maxsize=2)
def _lm_eval(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    x, y = D.corpus().batch(64, 32, torch.Generator().manual_seed(12345), split="val")
    return x.to(device), y.to(device)


def _evaluate(model: torch.nn.Module, task: str) -> tuple[float, float]:
    device = str(next(model.parameters()).device)
    with torch.no_grad():
        if task == "digits":
            X, y = _digits("test", device)
            out = model(X)
            return float(F.cross_entropy(out, y)), float((out.argmax(1) == y).float().mean())
        x, y = _lm_eval(device)
        out = model(x)
        return float(F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))), math.nan


def _batches(task: str, cfg: dict[str, Any], rank: int, world: int):
    """Endless minibatches for this rank: disjoint digits shards per epoch, or LM windows."""
    from pipecomm import data

    seed = cfg["seed"]
    if task == "digits":
        X, y = _digits("train")
        epoch = 0
        while True:
            idx = data.shard(len(X), rank, world, seed, epoch)
            yield from data.batches(X, y, idx, cfg["digits_batch"], seed, epoch)
            epoch += 1
    g = torch.Generator().manual_seed(1_000_003 * seed + rank)
    while True:
        yield D.corpus().batch(cfg["lm_batch"], cfg["seq_len"], g)


def rank_train(cfg: dict[str, Any]) -> dict[str, Any]:
    """On every rank: one training run of ``cfg["method"]`` on ``cfg["task"]``.

    Returns the local training loss and the elapsed training time (evaluation excluded) of every
    iteration, the local model's evaluation every ``eval_every`` iterations and, on every rank,
    the evaluation of the parameters averaged over all ranks at the end.
    """
    from pipecomm.decentralized import DecentralizedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    task, method = cfg["task"], cfg["method"]
    opt_kind, topo_name = _split(method)
    lr = cfg["digits_lr"] if task == "digits" else cfg["lm_lr"]
    if opt_kind == "accumadam":
        lr *= cfg["digits_accum_lr_scale"] if task == "digits" else cfg["lm_accum_lr_scale"]
    iterations = cfg["digits_iterations"] if task == "digits" else cfg["lm_iterations"]
    device = launch.device()
    model = D.build_task_model(TASKS[task], cfg["seed"]).to(device)
    ar = ddp = None
    if topo_name is None:
        ar = D.AllReduceTrainer(
            model,
            torch.optim.Adam(model.parameters(), lr=lr),
            bucket_mb=D.TASK_BUCKET_MB,
            algorithm=cfg["algorithm"],
        )
        net = model
    else:
        topo = topology.get_topology(topo_name, world, ranks_per_node=cfg["ranks_per_node"])
        ddp = DecentralizedDataParallel(
            model,
            functools.partial(_optim, lr=lr, accum=cfg["accum_iter"], kind=opt_kind),
            topology=topo,
            bucket_mb=D.TASK_BUCKET_MB,
            algorithm=cfg["algorithm"],
        )
        net = ddp
    batches = _batches(task, cfg, rank, world)
    losses, walls, evals = [], [], []
    elapsed = 0.0
    dist.barrier()
    try:
        for it in range(1, iterations + 1):
            x, y = (b.to(device) for b in next(batches))
            t0 = time.perf_counter()
            if ar is not None:
                ar.zero_grad()
            out = net(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            if ar is not None:
                ar.step()
            bench.synchronize(device)
            elapsed += time.perf_counter() - t0
            losses.append(float(loss.detach()))
            walls.append(elapsed)
            if it % cfg["eval_every"] == 0 or it == iterations:
                evals.append((it, elapsed, *_evaluate(model, task)))
        if ddp is not None:
            with ddp.averaged() as avg:
                final = _evaluate(avg, task)
        else:
            final = _evaluate(model, task)
    finally:
        if ddp is not None:
            ddp.close()
        if ar is not None:
            ar.close()
    return {"rank": rank, "loss": losses, "wall_s": walls, "evals": evals, "final": final}


# --------------------------------------------------------------------------- the experiment


def run(**params: Any) -> pd.DataFrame:
    """Train every (task, seed, method) on one pool; tidy rows of curves and final metrics."""
    p = Params.make(**params)
    rpn, world = p["ranks_per_node"], p["world_size"]
    net = D.make_network(D.DEFAULT_NETWORK) if p["emulated"] else None
    algorithm = "ring" if p["emulated"] else "torch"
    netname = D.network_text(net, rpn)
    rows = []
    with launch.pool(world, backend=p["backend"], network=net, ranks_per_node=rpn) as ranks:
        for task in p["tasks"]:
            for seed in p["seeds"]:
                for method in p["methods"]:
                    cfg = {
                        **p,
                        "task": task,
                        "method": method,
                        "seed": int(seed),
                        "algorithm": algorithm,
                    }
                    res = ranks.run(rank_train, cfg, timeout_s=p["timeout_s"])
                    opt_kind, topo = _split(method)
                    common = {
                        "task": task,
                        "model": TASKS[task],
                        "method": method,
                        "label": LABELS[method],
                        "optimizer": opt_kind,
                        "topology": topo or "allreduce",
                        "seed": int(seed),
                        "world_size": world,
                        "backend": p["backend"],
                        "network": netname,
                        "algorithm": algorithm,
                    }
                    loss = np.mean([r["loss"] for r in res], axis=0)
                    wall = np.max([r["wall_s"] for r in res], axis=0)
                    for i, (lv, wv) in enumerate(zip(loss, wall), start=1):
                        rows.append(
                            {
                                **common,
                                "record": "train",
                                "iteration": i,
                                "wall_s": float(wv),
                                "loss": float(lv),
                                "accuracy": math.nan,
                            }
                        )
                    for j, (it, _el, _l, _a) in enumerate(res[0]["evals"]):
                        ev = [r["evals"][j] for r in res]
                        rows.append(
                            {
                                **common,
                                "record": "eval",
                                "iteration": it,
                                "wall_s": float(max(e[1] for e in ev)),
                                "loss": float(np.mean([e[2] for e in ev])),
                                "accuracy": float(np.mean([e[3] for e in ev])),
                            }
                        )
                    final_loss, final_acc = res[0]["final"]
                    rows.append(
                        {
                            **common,
                            "record": "final",
                            "iteration": len(loss),
                            "wall_s": float(wall[-1]),
                            "loss": float(final_loss),
                            "accuracy": float(final_acc),
                        }
                    )
    return pd.DataFrame(rows)


def finals(df: pd.DataFrame) -> pd.DataFrame:
    """The final metrics: one row per (task, method, seed)."""
    claims.require_columns(df, "record", "task", "method", "seed", "loss")
    return df[df.record == "final"]


def _mean_2s(v: pd.Series) -> str:
    v = v.dropna()
    if v.empty:
        return ""
    s = float(v.std(ddof=1)) if len(v) > 1 else float("nan")
    return f"{v.mean():.4f} +- {2 * s:.4f}"


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per task and method: final loss and accuracy (mean +- 2 sigma over seeds) and the paired
    difference to AllReduce Adam (mean +- 2 sigma of the per-seed differences)."""
    f = finals(df)
    out = []
    for task, ft in f.groupby("task", sort=False):
        base = ft[ft.method == "allreduce-adam"].set_index("seed").loss
        for method, g in ft.groupby("method", sort=False):
            d = g.set_index("seed").loss - base
            d = d.dropna()
            out.append(
                {
                    "task": task,
                    "method": LABELS.get(method, method),
                    "seeds": len(g),
                    "final loss (mean +- 2 sigma)": _mean_2s(g.loss),
                    "accuracy (mean +- 2 sigma)": _mean_2s(g.accuracy),
                    "loss - AllReduce (paired)": ""
                    if method == "allreduce-adam" or d.empty
                    else _mean_2s(d),
                    "wall s": round(float(g.wall_s.mean()), 2),
                }
            )
    return pd.DataFrame(out)


def plot(df: pd.DataFrame, **params: Any):
    """Per task: training loss (mean over ranks and seeds, smoothed) vs iterations and vs wall
    time; the final averaged-model loss per seed as points at the end."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    tasks = list(dict.fromkeys(df.task))
    fig, axes = plt.subplots(len(tasks), 2, figsize=(11, 3.6 * len(tasks)), squeeze=False)
    methods = [m for m in METHODS if m in set(df.method)]
    palette = dict(zip(methods, sns.color_palette("deep", len(methods))))
    styles = {
        "allreduce-adam": "-",
        "dadam-complete": ":",
        "dadam-aer": "--",
        "accumadam-complete": "-.",
        "accumadam-aer": "-",
    }
    for row, task in enumerate(tasks):
        tr = df[(df.task == task) & (df.record == "train")]
        for m in methods:
            g = tr[tr.method == m]
            if g.empty:
                continue
            curve = g.groupby("iteration").agg(loss=("loss", "mean"), wall=("wall_s", "mean"))
            window = max(1, len(curve) // 15)
            smooth = curve.loss.rolling(window, min_periods=1).mean()
            for col, x in ((0, curve.index), (1, curve.wall)):
                axes[row, col].plot(
                    x,
                    smooth,
                    styles[m],
                    color=palette[m],
                    label=LABELS[m],
                    lw=2 if m.startswith("accum") or m.startswith("all") else 1.3,
                )
        fin = df[(df.task == task) & (df.record == "final")]
        for m in methods:
            g = fin[fin.method == m]
            axes[row, 0].plot(g.iteration, g.loss, "o", color=palette[m], ms=4, alpha=0.7)
        metric = "test" if task == "digits" else "validation"
        axes[row, 0].set(
            xlabel="iteration",
            ylabel="training loss (smoothed)",
            title=f"{task}: loss vs iterations (dots: final {metric} loss, averaged model)",
        )
        axes[row, 1].set(
            xlabel="wall-clock training time (s)",
            ylabel="training loss (smoothed)",
            title=f"{task}: loss vs wall time",
        )
        axes[row, 0].legend(fontsize=7)
    net, backend = df.network.iloc[0], df.backend.iloc[0]
    if net != "real":
        where = f"emulated: {net}"
    elif backend == "nccl":
        where = "real NCCL interconnect, not emulated"
    else:
        where = "real network (loopback, not emulated)"
    fig.suptitle(
        f"E13: AllReduce Adam vs DAdam vs AccumAdam ({backend}, p={int(df.world_size.iloc[0])}, "
        f"{df.algorithm.iloc[0]} allreduce; {where}; {df.seed.nunique()} seeds)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


@claims.check("e13_accumadam_within")
def check_accumadam_within(df: pd.DataFrame, max_rel_gap: float,
                           min_seeds: int) -> claims.Verdict:
    """For every task and both topologies, AccumAdam is not worse than AllReduce Adam by more
    than ``max_rel_gap`` of AllReduce's mean final loss: the mean paired (same seed) difference
    AccumAdam - AllReduce, with its 95% Student-t interval, lies at or below the margin (PASS),
    entirely above it (FAIL), or straddles it (INCONCLUSIVE: too few or too noisy seeds).

    Example::

        check_accumadam_within(df, 0.02, 3)
    """
    f = finals(df)
    parts, verdicts = [], []
    for task, ft in f.groupby("task", sort=False):
        base = ft[ft.method == "allreduce-adam"].set_index("seed").loss
        if len(base) < min_seeds:
            raise ValueError(
                f"task {task}: AllReduce Adam has {len(base)} seeds, need >= {min_seeds}"
            )
        margin = max_rel_gap * float(base.mean())
        for method in ("accumadam-complete", "accumadam-aer"):
            g = ft[ft.method == method].set_index("seed").loss
            if g.empty:
                continue
            if set(g.index) != set(base.index):
                raise ValueError(
                    f"task {task}: {method} and AllReduce Adam ran different seeds "
                    f"({sorted(g.index)} vs {sorted(base.index)}); pairs needed"
                )
            seeds = sorted(base.index)
            d, lo, hi = stats.paired_diff_ci(g.loc[seeds].to_numpy(), base.loc[seeds].to_numpy())
            verdicts.append(claims.at_most(lo, hi, margin))
            parts.append(f"{task} {LABELS[method]}: {g.mean():.4f} vs {base.mean():.4f}, paired "
                         f"diff {d:+.4f} [{lo:+.4f}, {hi:+.4f}] (margin {margin:.4f})")
    if not verdicts:
        raise ValueError("no AccumAdam runs to compare with AllReduce Adam")
    return claims.Verdict(
        "; ".join(parts),
        f"AccumAdam - AllReduce <= {max_rel_gap:.0%} of AllReduce's loss, every task/topology "
        f"(95% interval)",
        claims.combine(verdicts),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
