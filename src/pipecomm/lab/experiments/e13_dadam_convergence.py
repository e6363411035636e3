"""E13 — AllReduce Adam vs DAdam vs AccumAdam on complete and AER (DAdam paper, Tables 2-3, Fig. 7).

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025): decentralized Adam (DAdam: each rank's own Adam step from the gossiped
parameters) loses a little accuracy against AllReduce Adam (Table 3, ResNet-50: 76.01 vs 75.31 AER
/ 75.27 complete); AccumAdam -- Adam whose moments see gradients averaged over a window of K
iterations (docs/update_rules.md) -- closes the gap or beats AllReduce (76.54 AER, 76.34
complete; Table 2, WMT14 BLEU 27.71/27.80 vs 27.79 +- 0.16). Claims reproduced (thresholds in
artifact/claims.yaml): C13.1, AccumAdam is not worse than AllReduce Adam beyond a small margin;
C13.2, AccumAdam improves on DAdam -- each over paired evaluation seeds, in the paper's metrics
(accuracy for digits, loss for the LM), after a fair protocol.

Measures ``allreduce-adam``, ``dadam-complete`` / ``dadam-aer`` and ``accumadam-complete`` /
``accumadam-aer`` (every K of ``accum_iters``) on a digits MLP and a character-level LM, p = 4
ranks, 2 per node, with the paper's warm-up + cosine schedule and a learning rate selected per
configuration on selection seeds; data.csv holds every run's curve and final metrics.

The protocol, the paper's scaled down (methods, tasks, rates, metrics, network, profiles):
docs/experiments.md, "E13 -- DAdam convergence" and "E13: protocol in detail".

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

from pipecomm.decentralized import AccumAdam, topology
from pipecomm.lab import claims, experiment, results
from pipecomm.lab.checks import check_int, check_world_sizes
from pipecomm.lab.cli import check_backend, main
from pipecomm.lab.measure import bench, stats
from pipecomm.lab.networks import launch
from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network, network_text
from pipecomm.lab.training import tuning
from pipecomm.lab.training.pipesgd_config import TrainConfig
from pipecomm.lab.training.trainers import make_trainer
from pipecomm.lab.workloads import schedules
from pipecomm.lab.workloads.tasks import (
    TASK_BUCKET_MB,
    batch_stream,
    build_task_model,
    corpus,
    dataset,
    heldout,
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
    digits_seeds: list[int] = field(default_factory=lambda: [0, 1])  # evaluation seeds
    lm_seeds: list[int] = field(default_factory=lambda: [0, 1])
    selection_seeds: list[int] = field(default_factory=lambda: [100])  # choose the rates
    max_extend: int = 3
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
        rpn = check_int("ranks_per_node", self.ranks_per_node)
        check_world_sizes("world_size", [self.world_size], rpn)
        for key, allowed in (("tasks", list(TASKS)), ("methods", METHODS)):
            v = getattr(self, key)
            if not isinstance(v, (list, tuple)) or not v or any(x not in allowed for x in v):
                raise ValueError(f"parameter {key} must be a non-empty list from {allowed}, got {v!r}")
        if "allreduce-adam" not in self.methods:
            raise ValueError("parameter methods must include 'allreduce-adam' (the reference)")
        seed_keys = ("digits_seeds", "lm_seeds", "selection_seeds")
        for key in (*seed_keys, "accum_iters"):
            v = getattr(self, key)
            if not isinstance(v, (list, tuple)) or not v or len(set(v)) != len(v):
                raise ValueError(f"parameter {key} must be a non-empty list of distinct values, "
                                 f"got {v!r}")
        for key in seed_keys:
            for s in getattr(self, key):
                check_int(key, s, 0)
        common = sorted(set(self.selection_seeds)
                        & (set(self.digits_seeds) | set(self.lm_seeds)))
        if common:
            raise ValueError(f"parameter selection_seeds must be disjoint from the evaluation "
                             f"seeds (digits_seeds, lm_seeds), got {common} in both")
        for k in self.accum_iters:
            check_int("accum_iters", k, 2)
        check_int("max_extend", self.max_extend, 0)
        for key in ("digits_lrs", "lm_lrs"):
            tuning.check_grid(key, getattr(self, key))
        for key in ("digits_iterations", "lm_iterations", "eval_every", "digits_batch",
                    "lm_batch", "seq_len"):
            check_int(key, getattr(self, key))
        wf = self.warmup_fraction
        if isinstance(wf, bool) or not isinstance(wf, (int, float)) or not 0 <= wf <= 1:
            raise ValueError(f"parameter warmup_fraction must be a number in [0, 1], got {wf!r}")
        for task in self.tasks:
            iters = getattr(self, f"{task}_iterations")
            try:
                schedules.check(self.schedule, iters, _warmup(self.warmup_fraction, iters),
                                self.min_lr_ratio)
            except ValueError as exc:
                raise ValueError(f"parameter schedule/min_lr_ratio: {exc}") from None
        if not isinstance(self.emulated, bool):
            raise ValueError(f"parameter emulated must be True or False, got {self.emulated!r}")
        check_backend(self.backend, self.world_size, emulated=self.emulated)


DEFAULTS = Params.defaults()


def _warmup(warmup_fraction: float, iterations: int) -> int:
    return round(warmup_fraction * iterations)


def configurations(params: Params) -> list[tuple[str, int]]:
    """(method, K) of every configuration: K = 1 for AllReduce and DAdam, each of
    ``accum_iters`` for AccumAdam.

    Example::

        configurations(Params.make(methods=["allreduce-adam", "accumadam-aer"], accum_iters=[2, 4]))
        # [("allreduce-adam", 1), ("accumadam-aer", 2), ("accumadam-aer", 4)]
    """
    return [(m, k) for m in params.methods
            for k in (params.accum_iters if m.startswith("accumadam") else [1])]


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
        return heldout("digits", part)
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
    (:func:`~pipecomm.lab.workloads.tasks.batch_stream`), or LM windows."""
    seed = cfg["seed"]
    if task == "digits":
        yield from batch_stream(TrainConfig(dataset="digits", seed=seed,
                                            batch_size=cfg["digits_batch"]), rank, world)
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
                            warmup_steps=_warmup(cfg["warmup_fraction"], iterations),
                            min_ratio=cfg["min_lr_ratio"])
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


def data_seen(params: Params, task: str) -> tuple[int, float]:
    """Samples (digits images, LM tokens) one run trains on, over all ranks, and the epochs of
    the training split that makes."""
    iters, p = getattr(params, f"{task}_iterations"), params.world_size
    if task == "digits":
        n, size = iters * p * params.digits_batch, len(_digits("train")[0])
    else:
        n, size = iters * p * params.lm_batch * params.seq_len, len(corpus().train)
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


def eval_seeds(params: Params, task: str) -> list[int]:
    """The evaluation seeds of ``task`` (``digits_seeds`` or ``lm_seeds``): those the claims
    count, never used to choose a rate."""
    return [int(s) for s in getattr(params, f"{task}_seeds")]


def run(**params: Any) -> pd.DataFrame:
    """For every task and configuration: the learning rate chosen on the selection seeds
    (:func:`pipecomm.lab.training.tuning.select_rate` over the task's grid, extended up to ``max_extend``
    times; phase "sweep"; no selection runs for a single-rate grid), then every evaluation seed
    of the task at that rate (phase "final"); tidy rows of curves and final metrics."""
    params = Params.make(**params)
    rpn, p = params.ranks_per_node, params.world_size
    net = make_network(DEFAULT_NETWORK) if params.emulated else None
    algorithm = "ring" if params.emulated else "torch"
    netname = network_text(net, rpn)
    confs = configurations(params)
    selection = [int(s) for s in params.selection_seeds]
    total = 0
    for t in params.tasks:
        n_grid = len(getattr(params, f"{t}_lrs"))
        total += len(confs) * ((n_grid * len(selection) if n_grid > 1 else 0)
                               + len(eval_seeds(params, t)))
    runs = results.Runs(total, desc="E13 runs")  # an estimate: extensions add runs
    rows: list[dict[str, Any]] = []
    with launch.pool(p, backend=params.backend, network=net, ranks_per_node=rpn) as ranks:

        def one(task: str, method: str, k: int, seed: int, lr: float, phase: str) -> list[dict]:
            cfg = {**params.asdict(), "task": task, "method": method, "k": k, "seed": seed,
                   "lr": float(lr), "algorithm": algorithm}
            res = runs(cfg, ranks.run, rank_train, cfg, timeout_s=params.timeout_s)
            iters = getattr(params, f"{task}_iterations")
            opt_kind, topo = _split(method)
            samples, epochs = data_seen(params, task)
            common = {
                "task": task, "model": TASKS[task], "method": method, "accum_iter": k,
                "config": config_label(method, k), "optimizer": opt_kind,
                "topology": topo or "allreduce", "seed": seed, "lr": float(lr), "phase": phase,
                "schedule": schedules.describe(params.schedule,
                                               _warmup(params.warmup_fraction, iters),
                                               params.min_lr_ratio),
                "iterations": iters, "samples_seen": samples, "epochs": epochs,
                "world_size": p, "backend": params.backend, "network": netname,
                "algorithm": algorithm,
            }
            return _rows(res, common)

        for task in params.tasks:
            for method, k in confs:
                swept: dict[float, list[list[dict]]] = {}

                def score(lr: float, task=task, method=method, k=k, swept=swept) -> float:
                    swept[lr] = [one(task, method, k, s, lr, "sweep") for s in selection]
                    return float(np.mean([r[-1]["val_loss"] for r in swept[lr]]))

                chosen, _scores, gap = tuning.select_rate(score, getattr(params, f"{task}_lrs"),
                                                          params.max_extend)
                for lr, rs in swept.items():
                    rows += [{**row, "selected": lr == chosen, "sweep_gap": ""}
                             for r in rs for row in r]
                for seed in eval_seeds(params, task):
                    rows += [{**row, "selected": True, "sweep_gap": gap or ""}
                             for row in one(task, method, k, seed, chosen, "final")]
    runs.close()
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- analysis


def finals(df: pd.DataFrame) -> pd.DataFrame:
    """The final metrics of the evaluation runs (phase "final", each configuration's chosen
    rate): one row per (task, method, K, seed); ``loss`` and ``accuracy`` are on the test half.

    Example::

        finals(df).groupby(["task", "config"]).loss.mean()
    """
    claims.require_columns(df, "record", "phase", "task", "method", "accum_iter", "seed",
                           "loss")
    return df[(df.record == "final") & (df.phase == "final")]


def _ci(v: pd.Series, spec: str = ".4f") -> str:
    v = v.dropna()
    if v.empty:
        return ""
    if len(v) == 1:
        return f"{v.iloc[0]:{spec}} (1 seed)"
    m, lo, hi = stats.paired_diff_ci(v.to_numpy(), np.zeros(len(v)))
    return f"{m:{spec}} [{lo:{spec}}, {hi:{spec}}]"


#: "Budget used" counts the steps after which a configuration's mean validation curve stayed
#: within this fraction of its final value (half of C13.1's 1% LM margin).
BUDGET_TOLERANCE = 0.005


def _curve(df: pd.DataFrame, task: str, method: str, k: int) -> pd.Series:
    """Mean validation loss (local models) over the evaluation seeds, per step."""
    ev = df[(df.task == task) & (df.method == method) & (df.accum_iter == k)
            & (df.record == "eval") & (df.phase == "final")]
    return ev.groupby("iteration").val_loss.mean()


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per task and configuration: chosen rate (and its ratio to AllReduce's) with the sweep's
    gap (why the choice is not a fair one, else empty), final test loss and accuracy (mean with
    95% t-interval over the evaluation seeds), the paired difference to AllReduce Adam, the
    budget used (fraction of steps after which the mean validation curve stayed within 0.5% of
    its final value), the data seen and the mean wall time of a run.

    Example::

        summary(df)[["task", "configuration", "lr", "budget used"]]
    """
    f = finals(df)
    out = []
    for task, ft in f.groupby("task", sort=False):
        ref = ft[ft.method == "allreduce-adam"]
        base, base_lr = ref.set_index("seed").loss, float(ref.lr.iloc[0])
        for (method, k), g in ft.groupby(["method", "accum_iter"], sort=False):
            d = (g.set_index("seed").loss - base).dropna()
            curve = _curve(df, task, method, int(k))
            gap = g.sweep_gap.iloc[0] if "sweep_gap" in g else ""
            out.append({
                "task": task,
                "configuration": config_label(method, int(k)),
                "seeds": len(g),
                "lr": float(g.lr.iloc[0]),
                "lr / AllReduce's": float(g.lr.iloc[0]) / base_lr,
                "sweep gap": "" if pd.isna(gap) else str(gap),
                "test loss [95% CI]": _ci(g.loss),
                "test accuracy [95% CI]": _ci(g.accuracy, ".3f"),
                "loss - AllReduce, paired [95% CI]": "" if method == "allreduce-adam" else _ci(d),
                "budget used": claims.budget_used(
                    curve, BUDGET_TOLERANCE * float(curve.iloc[-1])) if len(curve) else math.nan,
                "samples seen (epochs)": f"{int(g.samples_seen.iloc[0]):,} "
                                         f"({g.epochs.iloc[0]:.2f})",
                "wall s per run": round(float(g.wall_s.mean()), 1),
            })
    return pd.DataFrame(out)


def sweep_table(df: pd.DataFrame) -> pd.DataFrame:
    """The learning-rate selection: per task, configuration and rate scored, the final
    validation loss of the averaged model, mean over the selection seeds; ``*`` marks the rate
    chosen (empty when every grid held a single rate: nothing was swept).

    Example::

        sweep_table(df)   # rows (task, configuration), columns the rates scored
    """
    sw = df[(df.record == "final") & (df.phase == "sweep")].copy()
    if sw.empty:
        return pd.DataFrame(index=pd.MultiIndex.from_tuples([], names=["task", "configuration"]))
    sw["configuration"] = [config_label(m, int(k)) for m, k in zip(sw.method, sw.accum_iter)]
    return tuning.sweep_table(sw, ["task", "configuration"], "lr", "val_loss")


def _metric(task: str, g: pd.DataFrame) -> pd.Series:
    """The claims' test metric of ``task``: accuracy in points for digits, loss for the LM."""
    return 100 * g.accuracy if task == "digits" else g.loss


def _worse(task: str, a: pd.Series, b: pd.Series) -> pd.Series:
    """How much worse ``a`` is than ``b`` in ``task``'s metric (positive = worse): accuracy
    points b - a for digits, loss a - b for the LM."""
    return b - a if task == "digits" else a - b


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per task and evaluation seed: each configuration's test metric (digits: accuracy in
    points; LM: loss in nats), and the paired differences the claims decide, positive when the
    first configuration is worse: every configuration against AllReduce Adam (C13.1) and each
    AccumAdam against DAdam on its topology (C13.2).

    Example::

        paired_table(df).loc["lm"]   # one row per seed
    """
    f = finals(df)
    parts = []
    for task, ft in f.groupby("task", sort=False):
        ft = ft.assign(configuration=[config_label(m, int(k))
                                      for m, k in zip(ft.method, ft.accum_iter)])
        unit = "accuracy %" if task == "digits" else "loss"
        wide = pd.DataFrame({c: _metric(task, g).set_axis(g.seed.to_numpy())
                             for c, g in ft.groupby("configuration", sort=False)})
        table = wide.rename(columns={c: f"{c}: test {unit}" for c in wide})
        labels = dict(zip(ft.configuration, zip(ft.method, ft.accum_iter)))
        ref = LABELS["allreduce-adam"]
        for c, (method, _k) in labels.items():
            if ref in wide and c != ref:
                table[f"{c} - {ref} (worse +)"] = _worse(task, wide[c], wide[ref])
            topo = method.partition("-")[2]
            dadam = LABELS.get(f"dadam-{topo}")
            if method.startswith("accumadam") and dadam in wide:
                table[f"{c} - {dadam} (worse +)"] = _worse(task, wide[c], wide[dadam])
        table.index = pd.MultiIndex.from_product([[task], table.index], names=["task", "seed"])
        parts.append(table)
    return pd.concat(parts) if parts else pd.DataFrame()


def plot(df: pd.DataFrame, **params: Any):
    """Per task: validation loss (local models, mean over the evaluation seeds) vs steps and vs
    wall time at each configuration's chosen rate, and the final test loss per configuration with its 95%
    interval over seeds."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    tasks = list(dict.fromkeys(df.task))
    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 3.8 * len(tasks)), squeeze=False)
    sel = df[df.phase == "final"]
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
        f"{df.algorithm.iloc[0]} allreduce; {where}; {sel.seed.nunique()} evaluation seeds; "
        f"{df.schedule.iloc[0]}; rate chosen per configuration on selection seeds "
        f"{sorted(set(df.seed) - set(sel.seed)) or '(none: one rate)'})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def _conf(method: str, accum_iter: int) -> tuple[str, int]:
    return method, (accum_iter if method.startswith("accumadam") else 1)


def protocol_gaps(df: pd.DataFrame, task: str, confs: list[tuple[str, int]],
                  references: list[tuple[str, int]], min_lrs: int, tail: float,
                  level_frac: float) -> list[str]:
    """Why a comparison of ``confs`` on ``task`` cannot be decided: a configuration's rate was
    not chosen fairly (fewer than ``min_lrs`` rates swept on the selection seeds, or the chosen
    one at an edge of them: :func:`pipecomm.lab.training.tuning.sweep_gaps`), or a reference's mean
    validation curve had not levelled off -- over the last ``tail`` of its steps (and at least
    its last 3 evaluations, :func:`pipecomm.lab.claims.still_improving`) it still improved by
    more than ``level_frac`` of its improvement from its first evaluation to its last.

    Example::

        protocol_gaps(df, "lm", [("accumadam-aer", 2), ("allreduce-adam", 1)],
                      [("allreduce-adam", 1)], 3, 0.1, 0.05)   # [] when decidable
    """
    d = df[df.task == task]
    reasons = []
    for method, k in dict.fromkeys(confs):
        g = d[(d.method == method) & (d.accum_iter == k) & (d.record == "final")]
        chosen = g[g.phase == "final"].lr
        reasons += tuning.sweep_gaps(f"{task} {config_label(method, k)}",
                                     list(g[g.phase == "sweep"].lr.unique()),
                                     float(chosen.iloc[0]) if len(chosen) else math.nan, min_lrs)
    for method, k in dict.fromkeys(references):
        what = f"{task} {config_label(method, k)}"
        curve = _curve(df, task, method, k).dropna()
        if len(curve) < 2:
            reasons.append(f"{what}: fewer than 2 evaluations, convergence unknown")
            continue
        gained = float(curve.iloc[0] - curve.iloc[-1])
        if not gained > 0:
            reasons.append(f"{what}: validation loss did not improve ({gained:+.4g} from its first "
                           f"evaluation to its last)")
            continue
        gap = claims.still_improving(curve, tail, level_frac * gained)
        if gap:
            reasons.append(f"{what} {gap} = {level_frac:.0%} of its total improvement "
                           f"{gained:.4g}")
    return reasons


@claims.check("e13_paired")
def check_paired(df: pd.DataFrame, pairs: list[list[str]], accum_iter: int,
                 digits_points: float, lm_rel: float, min_lrs: int, tail: float,
                 level_frac: float, may_miss: str | int) -> claims.Verdict:
    """For every task and every ``[method, reference]`` of ``pairs`` (AccumAdam with window
    ``accum_iter``; K = 1 otherwise): ``method`` is not worse than ``reference`` beyond a margin,
    over the evaluation seeds paired by seed, in the paper's metrics -- digits: test accuracy in
    points, reference - method, margin ``digits_points``; LM: test loss in nats, method -
    reference, margin ``lm_rel`` x the reference's mean test loss. Each point is decided on the
    95% Student-t interval of the mean paired difference (positive = method worse): PASS at or
    below the margin, FAIL above it, else INCONCLUSIVE (with margin 0: PASS when the method is
    better, FAIL when worse); the points combine with ``may_miss`` allowed to miss
    (:func:`pipecomm.lab.claims.allowance`). The protocol gates the verdict (INCONCLUSIVE with
    the reason, :func:`protocol_gaps`): every configuration compared swept >= ``min_lrs`` rates
    with the chosen one inside them, and every reference levelled off (over its last ``tail``
    of steps it improved by at most ``level_frac`` of its whole improvement). DAdam paper,
    Tables 2-3.

    Example::

        check_paired(df, [["accumadam-aer", "allreduce-adam"]], 2, 0.5, 0.01, 3, 0.1, 0.05,
                     "none")
    """
    for pair in pairs:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or any(m not in METHODS for m in pair)):
            raise ValueError(f"pairs must hold [method, reference] from {METHODS}, got {pair!r}")
    f = finals(df)
    parts, verdicts, reasons = [], [], []
    for task, ft in f.groupby("task", sort=False):
        confs, refs = [], []
        for method, reference in pairs:
            a, b = _conf(method, accum_iter), _conf(reference, accum_iter)
            ga, gb = (ft[(ft.method == m) & (ft.accum_iter == k)].set_index("seed")
                      for m, k in (a, b))
            if ga.empty or gb.empty:
                continue
            if set(ga.index) != set(gb.index):
                raise ValueError(
                    f"task {task}: {config_label(*a)} and {config_label(*b)} ran different seeds "
                    f"({sorted(ga.index)} vs {sorted(gb.index)}); pairs needed")
            seeds = sorted(gb.index)
            ma, mb = _metric(task, ga.loc[seeds]), _metric(task, gb.loc[seeds])
            worse = _worse(task, ma, mb).to_numpy()
            if task == "digits":
                margin, unit, spec = float(digits_points), "accuracy points", ".2f"
            else:
                margin, unit, spec = lm_rel * float(mb.mean()), "nats", ".4f"
            d, lo, hi = stats.paired_diff_ci(worse, np.zeros(len(worse)))
            verdicts.append(claims.at_most(lo, hi, margin))
            parts.append(
                f"{task} {config_label(*a)} vs {config_label(*b)} ({len(seeds)} seeds, rates "
                f"{float(ga.lr.iloc[0]):g} / {float(gb.lr.iloc[0]):g}): test "
                f"{'accuracy %' if task == 'digits' else 'loss'} {ma.mean():{spec}} vs "
                f"{mb.mean():{spec}}, worse by {d:+{spec}} [{lo:+{spec}}, {hi:+{spec}}] {unit} "
                f"({d / float(mb.mean()):+.2%} of the reference; margin {margin:{spec}})")
            confs += [a, b]
            refs.append(b)
        if confs:
            reasons += protocol_gaps(df, task, confs, refs, min_lrs, tail, level_frac)
    if not verdicts:
        raise claims.NotDecidable(f"none of the pairs {pairs} ran (AccumAdam K={accum_iter})")
    allowed = claims.allowance(len(verdicts), may_miss)
    measured = "; ".join(parts) + f" -- {claims.missed(verdicts, allowed)}"
    if reasons:
        measured += " -- cannot decide: " + "; ".join(reasons)
    return claims.Verdict(
        measured,
        f"paired difference (method worse = positive) <= {digits_points:g} accuracy points "
        f"(digits) / {lm_rel:.1%} of the reference's test loss (LM), 95% t-interval, at every "
        f"task and pair but {allowed}; after a sweep of >= {min_lrs} rates with the chosen one "
        f"inside, per configuration, and references levelled off (last {tail:.0%} of steps: "
        f"<= {level_frac:.0%} of their improvement)",
        claims.gate(claims.combine(verdicts, allowed), reasons),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
