"""E13 — AllReduce Adam vs DAdam vs AccumAdam on complete and AER (DAdam paper, Tables 2-3, Fig. 7).

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025): decentralized Adam (DAdam: each rank's own Adam step from the gossiped
parameters) loses a little accuracy against AllReduce Adam (Table 3, ResNet-50: 76.01 vs 75.31 AER
/ 75.27 complete); AccumAdam -- Adam whose moments see gradients averaged over a window of K
iterations (docs/update_rules.md) -- closes the gap or beats AllReduce (76.54 AER, 76.34
complete; Table 2, WMT14 BLEU 27.71/27.80 vs 27.79 +- 0.16). Claim reproduced (C13.1, threshold
in artifact/claims.yaml): AccumAdam's final test loss is not worse than AllReduce Adam's beyond a
small margin, over paired seeds, after a fair protocol.

The protocol, the paper's scaled down (docs/experiments.md, "E13"):

* methods (betas (0.9, 0.999), no weight decay): ``allreduce-adam`` (gradients averaged over all
  ranks every iteration -- ``pipecomm.pipesgd.PipeSGD`` in layer-wise mode -- then torch Adam);
  ``dadam-complete`` / ``dadam-aer`` (``DecentralizedDataParallel`` with torch Adam, i.e.
  AccumAdam with K = 1, on the complete / alternating-exp-ring topology);
  ``accumadam-complete`` / ``accumadam-aer`` with every K of ``accum_iters`` (the paper's K/p is
  1/4 to 1/2; at p = 4 that is K = 1 or 2);
* the paper's schedule for every method: linear warm-up over ``warmup_fraction`` of the steps,
  then cosine decay to ``min_lr_ratio`` x the peak (:mod:`pipecomm.lab.schedules`);
* learning rates chosen fairly: every configuration (method, K) trains at every rate of the
  task's grid (``digits_lrs``, ``lm_lrs``) on the first seed; the rate with the lowest validation
  loss of the averaged model is carried to the other seeds (the first seed's final is that sweep
  run). The paper scales AccumAdam's rate (1.5x for ResNet-50); the sweep tests that rule: the
  summary reports each configuration's selected rate over AllReduce's;
* metrics on two disjoint halves of the held-out data: ``val`` (selection) and ``test`` (the
  claim): for digits the held-out 20% of scikit-learn's 8x8 digits, for the LM the validation
  10% of CPython's pydoc text, every non-overlapping window of ``seq_len`` characters.

Tasks: ``digits``, an MLP 64-64-10 (4.8 K parameters), ``digits_batch`` images per rank per
iteration (disjoint shards per epoch); ``lm``, a character-level transformer (2 layers, 4 heads,
48 wide, context 32; 68 K parameters), ``lm_batch`` random windows per rank. The summary states
the data each run saw in samples (tokens) and epochs. p = 4 ranks, 2 per node (AER alternates an
intra- and an inter-node average). A seed fixes the initialisation and the data order, the same
for every method. data.csv holds every run's curve every ``eval_every`` steps (mean training
loss of the window, validation loss of the ranks' local models, learning rate, wall time) and its
final metrics (the parameters averaged over the ranks), with the seed, rate, K and schedule.

Network: by default the real gloo backend (no emulation, ``algorithm="torch"``): the losses do not
depend on the network, and the wall-clock axis shows loopback on a 2-core machine, not the
paper's cluster (E12 covers per-iteration time on the emulated network). ``emulated=True`` runs on
the two-level emulated network with pipecomm's ``ring`` instead. ``backend="nccl"`` (gpu profile)
trains on one GPU per rank over NCCL (emulation refused); every timed iteration then ends with a
device synchronisation.

The quick configuration (the notebook's defaults, the cpu profile) trains one learning rate for
a few hundred steps: C13.1 is then INCONCLUSIVE by construction (no sweep); the ``cpu-full``
profile carries the full protocol. Runs are resumable one by one (``pipecomm.lab.results.Runs``).

Run::

    python -m pipecomm.lab.experiments.e13_dadam_convergence --out results/manual/E13
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

from pipecomm import launch
from pipecomm.decentralized import AccumAdam, topology
from pipecomm.lab import bench, claims, experiment, results, schedules, stats
from pipecomm.lab.checks import check_int, check_world_sizes
from pipecomm.lab.cli import check_backend, main
from pipecomm.lab.network import DEFAULT_NETWORK, make_network, network_text
from pipecomm.lab.trainers import make_trainer
from pipecomm.lab.workloads import (
    TASK_BUCKET_MB,
    batch_stream,
    build_task_model,
    corpus,
    dataset,
)

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
class Params(experiment.Params):
    """E13's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_size: int = 4
    ranks_per_node: int = 2
    tasks: list[str] = field(default_factory=lambda: ["digits", "lm"])
    methods: list[str] = field(default_factory=lambda: list(METHODS))
    accum_iters: list[int] = field(default_factory=lambda: [2])
    seeds: list[int] = field(default_factory=lambda: [0, 1])  # the profiles run 3 or more
    digits_iterations: int = 20
    lm_iterations: int = 20
    eval_every: int = 10
    digits_batch: int = 16
    lm_batch: int = 8
    seq_len: int = 32
    digits_lrs: list[float] = field(default_factory=lambda: [3e-3])
    lm_lrs: list[float] = field(default_factory=lambda: [3e-3])
    schedule: str = "warmup-cosine"
    warmup_fraction: float = 0.05
    min_lr_ratio: float = 0.1
    emulated: bool = False
    backend: str = "gloo"
    timeout_s: float = 300.0

    def validate(self) -> None:
        p = self
        rpn = check_int("ranks_per_node", p["ranks_per_node"])
        check_world_sizes("world_size", [p["world_size"]], rpn)
        for key, allowed in (("tasks", list(TASKS)), ("methods", METHODS)):
            v = p[key]
            if not isinstance(v, (list, tuple)) or not v or any(x not in allowed for x in v):
                raise ValueError(f"parameter {key} must be a non-empty list from {allowed}, got {v!r}")
        if "allreduce-adam" not in p["methods"]:
            raise ValueError("parameter methods must include 'allreduce-adam' (the reference)")
        for key in ("seeds", "accum_iters", "digits_lrs", "lm_lrs"):
            v = p[key]
            if not isinstance(v, (list, tuple)) or not v or len(set(v)) != len(v):
                raise ValueError(f"parameter {key} must be a non-empty list of distinct values, "
                                 f"got {v!r}")
        for s in p["seeds"]:
            check_int("seeds", s, 0)
        for k in p["accum_iters"]:
            check_int("accum_iters", k, 2)
        for key in ("digits_iterations", "lm_iterations", "eval_every", "digits_batch",
                    "lm_batch", "seq_len"):
            check_int(key, p[key])
        for key in ("digits_lrs", "lm_lrs"):
            for lr in p[key]:
                if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
                    raise ValueError(f"parameter {key} must hold numbers > 0, got {p[key]!r}")
        wf = p["warmup_fraction"]
        if isinstance(wf, bool) or not isinstance(wf, (int, float)) or not 0 <= wf <= 1:
            raise ValueError(f"parameter warmup_fraction must be a number in [0, 1], got {wf!r}")
        for task in p["tasks"]:
            iters = p[f"{task}_iterations"]
            try:
                schedules.check(p["schedule"], iters, _warmup(p, iters), p["min_lr_ratio"])
            except ValueError as exc:
                raise ValueError(f"parameter schedule/min_lr_ratio: {exc}") from None
        if not isinstance(p["emulated"], bool):
            raise ValueError(f"parameter emulated must be True or False, got {p['emulated']!r}")
        check_backend(p["backend"], p["world_size"], emulated=p["emulated"])


DEFAULTS = Params.defaults()


def _warmup(p: dict[str, Any], iterations: int) -> int:
    return round(p["warmup_fraction"] * iterations)


def configurations(p: dict[str, Any]) -> list[tuple[str, int]]:
    """(method, K) of every configuration: K = 1 for AllReduce and DAdam, each of
    ``accum_iters`` for AccumAdam.

    Example::

        configurations({"methods": ["allreduce-adam", "accumadam-aer"], "accum_iters": [2, 4]})
        # [("allreduce-adam", 1), ("accumadam-aer", 2), ("accumadam-aer", 4)]
    """
    return [(m, k) for m in p["methods"]
            for k in (p["accum_iters"] if m.startswith("accumadam") else [1])]


def config_label(method: str, k: int) -> str:
    """``"AccumAdam K=2 (AER)"`` for AccumAdam, else the method's label."""
    label = LABELS.get(method, method)
    return label.replace("AccumAdam", f"AccumAdam K={k}") if method.startswith("accum") else label


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


def _digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    return dataset("digits", split, 0)


@functools.lru_cache(maxsize=4)
def eval_split(task: str, part: str, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out data of ``task`` for ``part`` "val" (learning-rate selection) or "test" (the
    claim): two disjoint halves -- of the digits' held-out split (a fixed permutation), or of the
    corpus' validation text, cut into every non-overlapping window of ``seq_len`` characters.

    Example::

        x, y = eval_split("lm", "test")      # [n, 32] windows and their next characters
    """
    if part not in ("val", "test"):
        raise ValueError(f"part must be 'val' or 'test', got {part!r}")
    if task == "digits":
        X, y = _digits("test")
        idx = torch.randperm(len(X), generator=torch.Generator().manual_seed(7))
        half = idx[: len(X) // 2] if part == "val" else idx[len(X) // 2 :]
        return X[half], y[half]
    ids = corpus().val
    half = len(ids) // 2
    ids = ids[:half] if part == "val" else ids[half:]
    n = (len(ids) - 1) // seq_len
    return ids[: n * seq_len].view(n, seq_len), ids[1 : n * seq_len + 1].view(n, seq_len)


def _evaluate(model: torch.nn.Module, task: str, part: str, seq_len: int) -> tuple[float, float]:
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in eval_split(task, part, seq_len))
    with torch.no_grad():
        out = model(x)
        loss = float(F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)))
        acc = float((out.argmax(-1) == y).float().mean())
    return loss, acc


def _batches(task: str, cfg: dict[str, Any], rank: int, world: int):
    """Endless minibatches for this rank: disjoint digits shards per epoch
    (:func:`~pipecomm.lab.workloads.batch_stream`), or LM windows."""
    seed = cfg["seed"]
    if task == "digits":
        yield from batch_stream({"dataset": "digits", "data_seed": 0, "data_root": None,
                                 "seed": seed, "batch_size": cfg["digits_batch"]}, rank, world)
    g = torch.Generator().manual_seed(1_000_003 * seed + rank)
    while True:
        yield corpus().batch(cfg["lm_batch"], cfg["seq_len"], g)


def rank_train(cfg: dict[str, Any]) -> dict[str, Any]:
    """On every rank: one training run of ``cfg["method"]`` (AccumAdam window ``cfg["k"]``) on
    ``cfg["task"]`` at peak rate ``cfg["lr"]`` with the configured schedule.

    Returns, every ``eval_every`` iterations, the elapsed training time (evaluation excluded),
    the mean training loss of the window, the local model's validation loss and the rate; and
    the evaluation of the parameters averaged over all ranks at the end (val and test).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    task, method, lr = cfg["task"], cfg["method"], cfg["lr"]
    opt_kind, topo_name = _split(method)
    iterations = cfg[f"{task}_iterations"]
    device = launch.device()
    model = build_task_model(TASKS[task], cfg["seed"]).to(device)
    topo = None if topo_name is None else topology.get_topology(
        topo_name, world, ranks_per_node=cfg["ranks_per_node"])
    trainer = make_trainer(model, functools.partial(_optim, lr=lr, accum=cfg["k"], kind=opt_kind),
                           topology=topo, bucket_mb=TASK_BUCKET_MB, algorithm=cfg["algorithm"])
    opt = trainer.optimizer
    sched = schedules.build(opt, cfg["schedule"], total_steps=iterations,
                            warmup_steps=_warmup(cfg, iterations), min_ratio=cfg["min_lr_ratio"])
    batches = _batches(task, cfg, rank, world)
    window, evals = [], []
    elapsed = 0.0
    dist.barrier()
    try:
        for it in range(1, iterations + 1):
            x, y = (b.to(device) for b in next(batches))
            rate = opt.param_groups[0]["lr"]
            t0 = time.perf_counter()
            trainer.zero_grad()
            out = trainer.module(x)
            loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            loss.backward()
            trainer.step()
            bench.synchronize(device)
            elapsed += time.perf_counter() - t0
            schedules.step(sched)
            window.append(float(loss.detach()))
            if it % cfg["eval_every"] == 0 or it == iterations:
                val = _evaluate(model, task, "val", cfg["seq_len"])[0]
                evals.append((it, elapsed, float(np.mean(window)), val, rate))
                window = []
        with trainer.averaged() as avg:
            final = (*_evaluate(avg, task, "val", cfg["seq_len"]),
                     *_evaluate(avg, task, "test", cfg["seq_len"]))
    finally:
        trainer.close()
    return {"rank": rank, "evals": evals, "final": final}


# --------------------------------------------------------------------------- the experiment


def data_seen(p: dict[str, Any], task: str) -> tuple[int, float]:
    """Samples (digits images, LM tokens) one run trains on, over all ranks, and the epochs of
    the training split that makes."""
    iters, world = p[f"{task}_iterations"], p["world_size"]
    if task == "digits":
        n, size = iters * world * p["digits_batch"], len(_digits("train")[0])
    else:
        n, size = iters * world * p["lm_batch"] * p["seq_len"], len(corpus().train)
    return n, n / size


def _rows(res: list[dict[str, Any]], common: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for j, (it, _el, _tr, _va, rate) in enumerate(res[0]["evals"]):
        ev = [r["evals"][j] for r in res]
        rows.append({**common, "record": "eval", "iteration": it,
                     "wall_s": float(max(e[1] for e in ev)),
                     "train_loss": float(np.mean([e[2] for e in ev])),
                     "val_loss": float(np.mean([e[3] for e in ev])), "lr_now": rate})
    val_loss, val_acc, test_loss, test_acc = res[0]["final"]
    rows.append({**common, "record": "final", "iteration": rows[-1]["iteration"],
                 "wall_s": rows[-1]["wall_s"], "val_loss": val_loss, "val_accuracy": val_acc,
                 "loss": test_loss, "accuracy": test_acc})
    return rows


def run(**params: Any) -> pd.DataFrame:
    """For every task and configuration: the learning-rate sweep on the first seed, then the
    selected rate on the other seeds; tidy rows of curves and final metrics."""
    p = Params.make(**params)
    rpn, world = p["ranks_per_node"], p["world_size"]
    net = make_network(DEFAULT_NETWORK) if p["emulated"] else None
    algorithm = "ring" if p["emulated"] else "torch"
    netname = network_text(net, rpn)
    confs = configurations(p)
    seeds = [int(s) for s in p["seeds"]]
    total = sum(len(confs) * (len(p[f"{t}_lrs"]) + len(seeds) - 1) for t in p["tasks"])
    runs = results.Runs(total, desc="E13 runs")
    rows: list[dict[str, Any]] = []
    with launch.pool(world, backend=p["backend"], network=net, ranks_per_node=rpn) as ranks:

        def one(task: str, method: str, k: int, seed: int, lr: float, phase: str) -> list[dict]:
            cfg = {**p, "task": task, "method": method, "k": k, "seed": seed, "lr": float(lr),
                   "algorithm": algorithm}
            res = runs(cfg, ranks.run, rank_train, cfg, timeout_s=p["timeout_s"])
            iters = p[f"{task}_iterations"]
            opt_kind, topo = _split(method)
            samples, epochs = data_seen(p, task)
            common = {
                "task": task, "model": TASKS[task], "method": method, "accum_iter": k,
                "config": config_label(method, k), "optimizer": opt_kind,
                "topology": topo or "allreduce", "seed": seed, "lr": float(lr), "phase": phase,
                "schedule": schedules.describe(p["schedule"], _warmup(p, iters),
                                               p["min_lr_ratio"]),
                "iterations": iters, "samples_seen": samples, "epochs": epochs,
                "world_size": world, "backend": p["backend"], "network": netname,
                "algorithm": algorithm,
            }
            return _rows(res, common)

        for task in p["tasks"]:
            for method, k in confs:
                sweep = [one(task, method, k, seeds[0], lr, "sweep") for lr in p[f"{task}_lrs"]]
                best = min(sweep, key=lambda r: r[-1]["val_loss"])
                for r in sweep:
                    for row in r:
                        row["selected"] = r is best
                    rows += r
                for seed in seeds[1:]:
                    rows += [{**row, "selected": True}
                             for row in one(task, method, k, seed, best[-1]["lr"], "final")]
    runs.close()
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- analysis


def finals(df: pd.DataFrame) -> pd.DataFrame:
    """The final metrics at each configuration's selected rate: one row per (task, method, K,
    seed); ``loss`` and ``accuracy`` are on the test half."""
    claims.require_columns(df, "record", "task", "method", "accum_iter", "seed", "loss",
                           "selected")
    return df[(df.record == "final") & df.selected.astype(bool)]


def _ci(v: pd.Series, spec: str = ".4f") -> str:
    v = v.dropna()
    if v.empty:
        return ""
    if len(v) == 1:
        return f"{v.iloc[0]:{spec}} (1 seed)"
    m, lo, hi = stats.paired_diff_ci(v.to_numpy(), np.zeros(len(v)))
    return f"{m:{spec}} [{lo:{spec}}, {hi:{spec}}]"


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per task and configuration: selected rate (and its ratio to AllReduce's), final test loss
    and accuracy (mean with 95% t-interval over seeds), the paired difference to AllReduce Adam,
    the data seen and the mean wall time of a run."""
    f = finals(df)
    out = []
    for task, ft in f.groupby("task", sort=False):
        ref = ft[ft.method == "allreduce-adam"]
        base, base_lr = ref.set_index("seed").loss, float(ref.lr.iloc[0])
        for (method, k), g in ft.groupby(["method", "accum_iter"], sort=False):
            d = (g.set_index("seed").loss - base).dropna()
            out.append({
                "task": task,
                "configuration": config_label(method, int(k)),
                "seeds": len(g),
                "lr": float(g.lr.iloc[0]),
                "lr / AllReduce's": float(g.lr.iloc[0]) / base_lr,
                "test loss [95% CI]": _ci(g.loss),
                "test accuracy [95% CI]": _ci(g.accuracy, ".3f"),
                "loss - AllReduce, paired [95% CI]": "" if method == "allreduce-adam" else _ci(d),
                "samples seen (epochs)": f"{int(g.samples_seen.iloc[0]):,} "
                                         f"({g.epochs.iloc[0]:.2f})",
                "wall s per run": round(float(g.wall_s.mean()), 1),
            })
    return pd.DataFrame(out)


def sweep_table(df: pd.DataFrame) -> pd.DataFrame:
    """The learning-rate sweep: final validation loss (averaged model, first seed) per task,
    configuration and rate; ``*`` marks the rate selected."""
    sw = df[(df.record == "final") & (df.phase == "sweep")].copy()
    sw["cell"] = sw.val_loss.map("{:.4f}".format) + np.where(sw.selected.astype(bool), " *", "")
    sw["configuration"] = [config_label(m, int(k)) for m, k in zip(sw.method, sw.accum_iter)]
    return sw.pivot_table(index=["task", "configuration"], columns="lr", values="cell",
                          aggfunc="first", sort=False)


def plot(df: pd.DataFrame, **params: Any):
    """Per task: validation loss (local models, mean over seeds) vs steps and vs wall time at
    each configuration's selected rate, and the final test loss per configuration with its 95%
    interval over seeds."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    tasks = list(dict.fromkeys(df.task))
    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 3.8 * len(tasks)), squeeze=False)
    sel = df[df.selected.astype(bool)]
    confs = list(dict.fromkeys(sel.config))
    palette = dict(zip(confs, sns.color_palette("deep", len(confs))))
    for row, task in enumerate(tasks):
        ev = sel[(sel.task == task) & (sel.record == "eval")]
        for c in confs:
            g = ev[ev.config == c]
            if g.empty:
                continue
            curve = g.groupby("iteration").agg(loss=("val_loss", "mean"), wall=("wall_s", "mean"))
            style = "-" if c.startswith(("AllReduce", "AccumAdam")) else ":"
            for col, x in ((0, curve.index), (1, curve.wall)):
                axes[row, col].plot(x, curve.loss, style, color=palette[c], label=c, lw=1.6)
        fin = finals(df[df.task == task])
        labels = [config_label(m, int(k)) for m, k in zip(fin.method, fin.accum_iter)]
        fin = fin.assign(configuration=labels)
        order = [c for c in confs if c in set(labels)]
        for i, c in enumerate(order):
            v = fin[fin.configuration == c].loss
            m, lo, hi = (stats.paired_diff_ci(v.to_numpy(), np.zeros(len(v))) if len(v) > 1
                         else (float(v.mean()), np.nan, np.nan))
            axes[row, 2].errorbar([i], [m], yerr=[[m - lo], [hi - m]] if len(v) > 1 else None,
                                  fmt="o", color=palette[c], capsize=4)
            axes[row, 2].plot([i] * len(v), v, ".", color=palette[c], alpha=0.5)
        axes[row, 2].set_xticks(range(len(order)), order, rotation=30, ha="right", fontsize=7)
        epochs = float(fin.epochs.iloc[0]) if len(fin) else math.nan
        axes[row, 0].set(xlabel="step", ylabel="validation loss",
                         title=f"{task}: validation loss vs steps ({epochs:.2f} epochs)")
        axes[row, 1].set(xlabel="measured wall-clock training time (s)",
                         ylabel="validation loss", title=f"{task}: vs wall time")
        axes[row, 2].set(ylabel="final test loss (averaged model)",
                         title=f"{task}: final test loss, mean and 95% interval over seeds")
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
        f"{df.algorithm.iloc[0]} allreduce; {where}; {df.seed.nunique()} seeds; "
        f"{df.schedule.iloc[0]}; rate selected per configuration on seed {int(df.seed.min())})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def protocol_gaps(df: pd.DataFrame, task: str, methods: list[tuple[str, int]], min_lrs: int,
                  tail: float, tolerance: float) -> list[str]:
    """Why a comparison of ``methods`` on ``task`` cannot be decided: a configuration swept
    fewer than ``min_lrs`` learning rates, or AllReduce Adam's validation loss (mean over seeds,
    selected rate) still improving by more than ``tolerance`` over the last ``tail`` of steps."""
    d = df[df.task == task]
    reasons = []
    for method, k in [("allreduce-adam", 1), *methods]:
        g = d[(d.method == method) & (d.accum_iter == k) & (d.record == "final")
              & (d.phase == "sweep")]
        if g.lr.nunique() < min_lrs:
            reasons.append(f"{task} {config_label(method, k)}: {g.lr.nunique()} learning rate(s) "
                           f"swept, need >= {min_lrs}")
    ref = d[(d.method == "allreduce-adam") & (d.record == "eval") & d.selected.astype(bool)]
    gap = claims.still_improving(ref.groupby("iteration").val_loss.mean(), tail, tolerance)
    if gap:
        reasons.append(f"{task} AllReduce Adam {gap}")
    return reasons


@claims.check("e13_accumadam_within")
def check_accumadam_within(df: pd.DataFrame, max_rel_gap: float, min_seeds: int,
                           accum_iter: int, min_lrs: int, tail: float) -> claims.Verdict:
    """For every task and both topologies, AccumAdam with window ``accum_iter`` is not worse
    than AllReduce Adam by more than ``max_rel_gap`` of AllReduce's mean final test loss: the
    mean paired (same seed) difference AccumAdam - AllReduce, with its 95% Student-t interval,
    lies at or below the margin (PASS), entirely above it (FAIL), or straddles it
    (INCONCLUSIVE). The protocol gates the verdict (INCONCLUSIVE, with the reason): each
    configuration swept >= ``min_lrs`` learning rates, and AllReduce Adam's validation loss
    improved by at most half the margin over the last ``tail`` fraction of its steps.

    Example::

        check_accumadam_within(df, 0.02, 3, 2, 3, 0.1)
    """
    f = finals(df)
    parts, verdicts, reasons = [], [], []
    for task, ft in f.groupby("task", sort=False):
        base = ft[ft.method == "allreduce-adam"].set_index("seed").loss
        if len(base) < min_seeds:
            raise ValueError(
                f"task {task}: AllReduce Adam has {len(base)} seeds, need >= {min_seeds}"
            )
        margin = max_rel_gap * float(base.mean())
        compared = []
        for method in ("accumadam-complete", "accumadam-aer"):
            g = ft[(ft.method == method) & (ft.accum_iter == accum_iter)].set_index("seed").loss
            if g.empty:
                continue
            if set(g.index) != set(base.index):
                raise ValueError(
                    f"task {task}: {method} and AllReduce Adam ran different seeds "
                    f"({sorted(g.index)} vs {sorted(base.index)}); pairs needed"
                )
            compared.append((method, accum_iter))
            seeds = sorted(base.index)
            d, lo, hi = stats.paired_diff_ci(g.loc[seeds].to_numpy(), base.loc[seeds].to_numpy())
            verdicts.append(claims.at_most(lo, hi, margin))
            parts.append(f"{task} {config_label(method, accum_iter)}: {g.mean():.4f} vs "
                         f"{base.mean():.4f}, paired diff {d:+.4f} [{lo:+.4f}, {hi:+.4f}] "
                         f"(margin {margin:.4f})")
        reasons += protocol_gaps(df, task, compared, min_lrs, tail, margin / 2)
    if not verdicts:
        raise ValueError(f"no AccumAdam runs with K={accum_iter} to compare with AllReduce Adam")
    measured = "; ".join(parts)
    if reasons:
        measured += " -- cannot decide: " + "; ".join(reasons)
    return claims.Verdict(
        measured,
        f"AccumAdam K={accum_iter} - AllReduce <= {max_rel_gap:.0%} of AllReduce's test loss, "
        f"every task/topology (95% interval), after a sweep of >= {min_lrs} rates and converged "
        f"references",
        claims.gate(claims.combine(verdicts), reasons),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
