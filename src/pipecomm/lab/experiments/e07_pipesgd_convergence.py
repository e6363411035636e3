"""E7 — Pipe-SGD convergence: accuracy vs iterations and vs wall time, with compression.

Paper: Pipe-SGD — Li, Yu, Li, Avestimehr, Kim, Schwing, NeurIPS 2018 (arXiv 1811.03619):
"a pipelined training with a width of two combines the best of both synchronous and
asynchronous training" -- one stale step hides the AllReduce behind compute without hurting
convergence, and light compression (16-bit truncation, 8-bit scalar quantization) inside the
AllReduce does not hurt it either; wall-clock gains "up to 5.4x" on four nodes (overlap alone
gives at most 2x; the rest came from compression and baselines we do not reproduce).

Measures ``sync``, ``pipe``, ``pipe+fp16`` and ``pipe+int8`` (``PipeSGD`` with a ring AllReduce
on p gloo ranks over the emulated network, bandwidth chosen before measuring so that the
AllReduce takes ``comm_ratio`` x compute + update), trained over paired seeds, each at its own
selected learning rate; per-iteration time from separate timing runs; accuracy against
iterations and wall time; ``sync@4x`` / ``pipe@4x`` as the negative control. Claims C7.1-C7.5
(artifact/claims.yaml).

Round two (issue 45; claims C7.2b, C7.3b) adds parameters whose defaults keep round one's
protocol: ``momenta`` (each method's momentum selected with its rate), ``selection_sets``
(``selection_seeds`` cut into that many disjoint sets, each making its own selection and the
evaluation seeds trained under each), ``selection_rule`` (:data:`pipecomm.lab.training.tuning.SELECTION_RULES`)
and ``control_lr`` (the negative control at a fixed stress rate stated beforehand, not a
multiple of a selected one). The rank test beside the paired interval:
:func:`accuracy_within_ranked`, :func:`stale_hurts_ranked`.

Protocol in detail (network choice, timing repeats, learning rates, GIL switch interval, what
each claim predicts): docs/experiments.md, "E7: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e07_pipesgd_convergence --out results/manual/E7
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from pipecomm.lab import claims, results
from pipecomm.lab.checks import require
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats
from pipecomm.lab.networks import launch
from pipecomm.lab.training import tuning
from pipecomm.lab.training.pipesgd_analysis import (
    accuracy_rise,
    accuracy_within,
    convergence_gap,
    final_accuracy,
    first_reach,
    median_times,
    run_samples,
    stale_hurts,
    steady,
    timing_kind,
)
from pipecomm.lab.training.pipesgd_config import (
    ConvergenceParams,
    TrainConfig,
    config,
    lr_scale,
    parse_methods,
)
from pipecomm.lab.training.pipesgd_training import calibrate_and_train, train_rank
from pipecomm.lab.workloads.tasks import fetch_data

ID = "E7"
NOTEBOOK = "07_pipesgd_convergence"


@dataclass(frozen=True)
class Params(ConvergenceParams):
    """E7's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them. The fields E7 and E9 share are
    :class:`~pipecomm.lab.training.pipesgd_config.ConvergenceParams`'."""

    ALGORITHMS: ClassVar[tuple[str, ...]] = ("lp", "ring")
    ALGORITHMS_WHY: ClassVar[str] = " (the algorithms that compress)"

    methods: list[str] = field(default_factory=lambda: ["sync", "pipe", "pipe+fp16", "pipe+int8"])
    timing_methods: list[str] = field(default_factory=lambda:
        ["sync", "pipe", "pipe+fp16", "pipe+int8"])
    timing_runs: int = 5
    timing_iterations: int = 12
    iterations: int = 30
    batch_size: int = 128
    target_fraction: float = 0.95
    lrs: list[float] = field(default_factory=list)
    selection_seeds: list[int] = field(default_factory=lambda: [100, 101])
    max_extend: int = 3
    control_seeds: int = 0
    momenta: list[float] = field(default_factory=list)
    selection_sets: int = 1
    selection_rule: str = "mean"
    control_lr: float = 0.0

    def validate(self) -> None:
        super().validate()
        methods = list(self.methods)
        require(
            len(methods) >= 2 and methods[0] == "sync" and len(set(methods)) == len(methods),
            "methods",
            methods,
            "must start with 'sync' (the baseline) and list >= 2 distinct",
        )
        parse_methods(methods)
        tm = list(self.timing_methods)
        require(len(set(tm)) == len(tm) and (not tm or "sync" in tm), "timing_methods", tm,
                "must list distinct methods including 'sync' (the baseline)")
        parse_methods(tm)
        require(isinstance(self.timing_runs, int) and not isinstance(self.timing_runs, bool)
                and self.timing_runs >= 0, "timing_runs", self.timing_runs,
                f"must be an int >= 0 (0: the seeds are the repeats; claims need "
                f">= {claims.MIN_REPEATS})")
        require(isinstance(self.timing_iterations, int)
                and self.skip < self.timing_iterations, "timing_iterations",
                self.timing_iterations, f"must be an int > skip={self.skip}")
        require(
            not any(m.startswith("nocomm") for m in [*methods, *tm]),
            "methods",
            methods,
            "'nocomm' does not train a data-parallel model; use E9 for the no-communication bound",
        )
        require(
            0 < self.target_fraction <= 1,
            "target_fraction",
            self.target_fraction,
            "must be in (0, 1]",
        )
        if self.lrs:
            tuning.check_grid("lrs", self.lrs)
        sel = self.selection_seeds
        require(isinstance(sel, list) and sel and len(set(sel)) == len(sel)
                and all(isinstance(s, int) and not isinstance(s, bool) for s in sel)
                and not set(sel) & set(self.seeds), "selection_seeds", sel,
                f"must be distinct ints, none of them an evaluation seed (seeds={self.seeds})")
        require(isinstance(self.max_extend, int) and not isinstance(self.max_extend, bool)
                and self.max_extend >= 0, "max_extend", self.max_extend, "must be an int >= 0")
        require(isinstance(self.control_seeds, int) and not isinstance(self.control_seeds, bool)
                and self.control_seeds >= 0, "control_seeds", self.control_seeds,
                "must be an int >= 0 (0: every seed)")
        m = self.momenta
        require(isinstance(m, list) and len(set(m)) == len(m) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < 1 for v in m),
            "momenta", m, "must be a list of distinct momenta in [0, 1) (empty: every method "
            "trains at momentum)")
        k = self.selection_sets
        require(isinstance(k, int) and not isinstance(k, bool) and k >= 1
                and len(sel) % k == 0, "selection_sets", k,
                f"must be an int >= 1 that divides the {len(sel)} selection_seeds into "
                f"disjoint sets of one size")
        require(self.selection_rule in tuning.SELECTION_RULES, "selection_rule",
                self.selection_rule, f"must be one of {tuning.SELECTION_RULES}")
        c = self.control_lr
        require(isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c)
                and c >= 0, "control_lr", c,
                "must be a finite rate >= 0 (0: a control trains at its factor x the rate "
                "selected for its method)")
        config(self, seed=self.seeds[0], method="sync", eval_part="test")  # a valid one

DEFAULTS = Params.defaults()


def base_method(method: str) -> str:
    """The method whose learning rate ``method`` uses: ``"pipe@4x"`` -> ``"pipe"`` (4x its rate).

    Example::

        >>> base_method("pipe+int8@4x"), base_method("sync")
        ('pipe+int8', 'sync')
    """
    return method.partition("@")[0]


def selection_sets(params: Params) -> list[list[int]]:
    """The disjoint sets of selection seeds: ``selection_seeds`` cut in order into
    ``selection_sets`` sets of one size.

    Example::

        >>> selection_sets(Params.make(selection_seeds=[100, 101, 102, 103, 104, 105],
        ...                            selection_sets=3))
        [[100, 101], [102, 103], [104, 105]]
    """
    sel, k = list(params.selection_seeds), params.selection_sets
    size = len(sel) // k
    return [sel[i * size:(i + 1) * size] for i in range(k)]


def is_control(method: str, params: Params) -> bool:
    """Whether ``method`` trains at the fixed stress rate (``control_lr`` > 0 and an ``@``
    factor): it is then selected by nobody, and trained once whatever the selection.

    Example::

        >>> is_control("pipe@1x", Params.make(control_lr=0.2)), is_control("pipe@4x", Params.make())
        (True, False)
    """
    return "@" in method and params.control_lr > 0


def n_classes(params: Params) -> int:
    """The number of classes of ``params.dataset`` (known without loading it: the gpu
    profile's CIFAR-10 is fetched only when the training pool starts).

    Example:
        >>> n_classes(Params.make(dataset="teacher"))
        10
    """
    from pipecomm.lab.workloads.data import CLASSES

    return CLASSES[params.dataset]


def select_rates(params: Params) -> tuple[dict[tuple[str, int], tuple[float, float]], pd.DataFrame]:
    """Each base method's peak learning rate and momentum, chosen on each set of selection seeds
    (:func:`selection_sets`): every rate of ``lrs`` (extended while the choice is at an edge)
    at every momentum of ``momenta`` (empty: ``momentum`` only) trained from each seed of the
    set, scored by the final loss on the held-out split's "val" half under ``selection_rule``
    (:func:`pipecomm.lab.training.tuning.select_rate_momentum`; ``"mean"`` with one momentum and
    one set is round one's :func:`pipecomm.lab.training.tuning.select_rate`). The runs take place in
    a pool without an emulated network (a run's accuracy does not depend on the network's
    speed). Without a grid of >= 2 rates every method trains at ``lr`` and nothing runs.
    Returns ``{(method, set index): (rate, momentum)}`` and the selection runs' rows
    (``kind="sweep"``: method, selection, seed, lr_peak, momentum, val_loss, val_accuracy,
    diverged, selected, sweep_gap)."""
    bases = list(dict.fromkeys(base_method(m) for m in [*params.methods, *params.timing_methods]))
    sets = selection_sets(params)
    moms = [float(v) for v in params.momenta] or [float(params.momentum)]
    if len(params.lrs) < 2:
        rate = float(params.lrs[0]) if params.lrs else float(params.lr)
        return {(b, k): (rate, moms[0]) for b in bases for k in range(len(sets))}, pd.DataFrame()
    limit = math.log(n_classes(params))
    n = len(bases) * len(params.lrs) * len(moms) * len(params.selection_seeds)
    runs = results.Runs(n, desc="E7 rate selection")
    rows: list[dict[str, Any]] = []
    chosen: dict[tuple[str, int], tuple[float, float]] = {}
    with launch.Ranks(params.world_size, backend=params.backend) as ranks:
        for method in bases:
            for k, sel in enumerate(sets):
                scored: list[dict[str, Any]] = []

                def train(lr: float, m: float, method: str = method, sel: list = sel,
                          scored: list = scored, k: int = k) -> list[float]:
                    losses = []
                    for seed in sel:
                        cfg = config(params, seed=seed, method=method, lr=lr, momentum=m,
                                     eval_part="val", eval_every=0)
                        res = runs({"select": cfg.asdict()}, ranks.run, train_rank, cfg,
                                   timeout_s=params.timeout_s)
                        final = res[0]["evals"][-1]
                        scored.append({"kind": "sweep", "method": method, "selection": k,
                                       "seed": seed, "lr_peak": lr, "momentum": m,
                                       "val_loss": final["test_loss"],
                                       "val_accuracy": final["accuracy"],
                                       "diverged": tuning.diverged(final["test_loss"], limit)})
                        losses.append(final["test_loss"])
                    return losses

                if params.selection_rule == "mean" and len(moms) == 1:  # round one's rule
                    rate, _, gap = tuning.select_rate(
                        lambda lr, train=train: float(np.mean(train(lr, moms[0]))),
                        params.lrs, params.max_extend)
                    mom = moms[0]
                else:
                    got = tuning.select_rate_momentum(train, params.lrs, moms,
                                                      params.selection_rule, params.max_extend,
                                                      limit)
                    rate, mom, gap = got.rate, got.momentum, got.gap
                chosen[(method, k)] = (rate, mom)
                rows += [{**r, "selected": r["lr_peak"] == rate and r["momentum"] == mom,
                          "sweep_gap": gap or ""} for r in scored]
    runs.close()
    return chosen, pd.DataFrame(rows)


def arms(params: Params, chosen: dict[tuple[str, int], tuple[float, float]]
         ) -> dict[str, tuple[str, float, float, list[int]]]:
    """The distinct training configurations of the evaluation seeds: label -> (method, peak
    rate, momentum, the selections that chose it). One selection set: the labels are the
    method names; several: ``"pipe|0.05|0.9"`` (trained once, however many selections chose
    it). A control at the fixed stress rate (:func:`is_control`) trains at ``factor x
    control_lr`` with ``momentum``, selected by none (``[]``).

    Example::

        >>> p = Params.make(methods=["sync", "pipe", "pipe@1x"], control_lr=0.2, momentum=0.9,
        ...                 selection_seeds=[100, 101], selection_sets=2)
        >>> arms(p, {("sync", 0): (0.1, 0.5), ("sync", 1): (0.1, 0.5),
        ...          ("pipe", 0): (0.1, 0.5), ("pipe", 1): (0.05, 0.9)})
        ... # doctest: +NORMALIZE_WHITESPACE
        {'sync|0.1|0.5': ('sync', 0.1, 0.5, [0, 1]), 'pipe|0.1|0.5': ('pipe', 0.1, 0.5, [0]),
         'pipe|0.05|0.9': ('pipe', 0.05, 0.9, [1]), 'pipe@1x|0.2|0.9': ('pipe@1x', 0.2, 0.9, [])}
    """
    out: dict[str, tuple[str, float, float, list[int]]] = {}
    n_sets = params.selection_sets
    for method in params.methods:
        for k in range(n_sets):
            if is_control(method, params):
                rate, mom, sels = float(params.control_lr), float(params.momentum), []
            else:
                (rate, mom), sels = chosen[(base_method(method), k)], [k]
            label = method if n_sets == 1 else f"{method}|{rate:g}|{mom:g}"
            if label in out:
                if sels and k not in out[label][3]:
                    out[label][3].append(k)
            else:
                out[label] = (method, rate, mom, sels)
    return out


def run(**params: Any) -> pd.DataFrame:
    """Choose each method's learning rate (and momentum) on each set of selection seeds
    (:func:`select_rates`), then train every method for every evaluation seed at what each
    selection chose (:func:`arms`; a configuration several selections chose is trained once) on
    the chosen emulated network (accuracy on the held-out split's "test" half; the controls,
    methods with ``@``, from the first ``control_seeds`` seeds only); tidy rows, each training
    run's rows once per selection that chose it (column ``selection``; NaN for a control at the
    fixed stress rate and for the calibration and timing runs). A data set to download
    (``dataset="cifar10"``) is fetched first, checksums verified
    (:func:`pipecomm.lab.workloads.tasks.fetch_data`)."""
    params = Params.make(**params)
    fetch_data(params)  # before the rate selection's ranks read the data set (cifar10: fetched)
    chosen, sweep = select_rates(params)
    plan = arms(params, chosen)

    def cfg_of(params: Params, seed: int, label: str) -> TrainConfig:
        if label not in plan:  # the calibration's and the timing runs' methods: selection 0
            rate, mom = chosen[(base_method(label), 0)]
            return config(params, seed=seed, method=label, lr=rate, momentum=mom,
                          eval_part="test")
        method, rate, mom, _ = plan[label]
        if not is_control(method, params):
            return config(params, seed=seed, method=method, lr=rate, momentum=mom,
                          eval_part="test")
        return config(params, seed=seed, method=method, lr=rate, eval_part="test")

    timing = (list(params.timing_methods), params.timing_iterations, params.timing_runs)
    n_control = params.control_seeds or len(params.seeds)
    df = calibrate_and_train(params, cfg_of, list(plan), list(params.seeds),
                             timing=(timing if params.timing_runs and params.timing_methods
                                     else None),
                             runs_seed=lambda i, m: "@" not in m or i < n_control)
    df = _per_selection(df, plan, params.selection_sets)
    if len(sweep):
        df = pd.concat([df, sweep.assign(world_size=params.world_size)], ignore_index=True)
    return df.assign(target_fraction=params.target_fraction)


def _per_selection(df: pd.DataFrame, plan: dict[str, tuple[str, float, float, list[int]]],
                   n_sets: int) -> pd.DataFrame:
    """The training rows under their method names, once per selection that chose them
    (``selection``), with the momentum they trained at; other rows' selection NaN."""
    trained = df["kind"].isin(["iteration", "eval"]) & df["method"].isin(list(plan))
    if n_sets == 1:  # the rows in the order run (round one's data, two more columns)
        labels = df["method"].where(trained)
        return df.assign(
            momentum=labels.map({k: v[2] for k, v in plan.items()}),
            selection=labels.map({k: 0 if v[3] else np.nan for k, v in plan.items()}))
    parts = [df[~trained].assign(selection=np.nan)]
    for label, (method, _, mom, sels) in plan.items():
        rows = df[trained & (df["method"] == label)].assign(method=method, momentum=mom)
        parts += [rows.assign(selection=k) for k in sels] or [rows.assign(selection=np.nan)]
    return pd.concat(parts, ignore_index=True)


# --------------------------------------------------------------------------- analysis


def _order(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df.loc[~df["kind"].isin(["calibration", "sweep"]), "method"]))


def iteration_times(df: pd.DataFrame) -> pd.DataFrame:
    """Per method and seed: median steady per-iteration time T and its parts C, M."""
    skip = int(df["skip"].iloc[0])
    return median_times(steady(df, skip), ["method", "seed"])


final_accuracy = final_accuracy


def time_to_accuracy(df: pd.DataFrame) -> pd.DataFrame:
    """Per method and seed: first iteration and wall time at which the held-out accuracy
    reaches ``target_fraction`` x sync's final accuracy of that seed."""
    frac = float(df["target_fraction"].iloc[0]) if "target_fraction" in df else 0.95
    ev = df[df["kind"] == "eval"]
    fin = final_accuracy(df)
    rows = []
    for seed, g in ev.groupby("seed"):
        sync_final = fin[(fin["method"] == "sync") & (fin["seed"] == seed)]["accuracy"]
        if sync_final.empty:
            continue
        target = frac * float(sync_final.iloc[0])
        for method, gm in g.groupby("method"):
            it, wall = first_reach(gm, target)
            rows.append(
                {"method": method, "seed": seed, "target": target, "iterations": it, "wall_s": wall}
            )
    return pd.DataFrame(rows)


def sweep_table(df: pd.DataFrame) -> pd.DataFrame:
    """The learning-rate selection: per method and rate tried, the final validation loss (the
    held-out split's "val" half) averaged over the selection seeds; ``*`` marks the rate chosen.
    Empty when no rates were swept."""
    sw = df[df["kind"] == "sweep"] if "kind" in df else df.iloc[:0]
    if sw.empty:
        return pd.DataFrame()
    index = ["method"] + [c for c in ("selection", "momentum")
                          if c in sw and sw[c].nunique() > 1]
    return tuning.sweep_table(sw, index, "lr_peak", "val_loss")


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per evaluation seed: every method's final held-out accuracy (the "test" half) and, for
    every method but sync, its paired difference to sync in points -- the units of C7.2 (with
    several selections: the first one's; :func:`accuracy_within_ranked` reports each)."""
    df = under_selection(df, selections(df)[0])
    fin = final_accuracy(df)
    acc = fin.pivot_table(index="seed", columns="method", values="accuracy")[
        [m for m in _order(df) if m in set(fin["method"])]]
    out = acc.copy()
    for m in acc.columns:
        if m != "sync" and "sync" in acc:
            out[f"{m} - sync"] = acc[m] - acc["sync"]
    return out.round(2)


def comm_ratio_measured(df: pd.DataFrame) -> float:
    """M / C of the sync runs (median over steps and seeds): the AllReduce on the critical path
    over the compute thread's work."""
    it = iteration_times(df)
    s = it[it["method"] == "sync"]
    return float((s["M"] / s["C"]).median()) if len(s) else float("nan")


def summary(df: pd.DataFrame, budget_tolerance: float = 0.5) -> pd.DataFrame:
    """The time-to-accuracy table: per method, its peak learning rate, final accuracy, the
    fraction of the steps after which its mean accuracy stayed within ``budget_tolerance``
    points of its final value (:func:`pipecomm.lab.claims.budget_used`), per-iteration time and
    speedup, iterations and wall time to the target accuracy and the wall-time speedup (means
    over seeds of the per-seed values)."""
    df = under_selection(df, selections(df)[0])  # several selections: the first one's runs
    it = iteration_times(df)
    fin = final_accuracy(df)
    tta = time_to_accuracy(df)
    sync_t = it[it["method"] == "sync"].set_index("seed")["T"]
    sync_wall = tta[tta["method"] == "sync"].set_index("seed")["wall_s"] if len(tta) else None
    rows = []
    for m in _order(df):
        im = it[it["method"] == m].set_index("seed")
        fm = fin[fin["method"] == m].set_index("seed")["accuracy"]
        tm = tta[tta["method"] == m].set_index("seed") if len(tta) else None
        speed = (sync_t / im["T"]).dropna()
        ev = df[(df["kind"] == "eval") & (df["method"] == m)]
        curve = ev.groupby("iteration")["accuracy"].mean()
        row = {
            "method": m,
            "lr": float(ev["lr_peak"].iloc[0]) if len(ev) else np.nan,
            "seeds": len(fm),
            "final_acc_%": fm.mean(),
            "budget_used": claims.budget_used(curve, budget_tolerance, higher_is_better=True),
            "rise_last_10%_points": accuracy_rise(df, m, 0.1),
            "vs_sync_points": (
                fm - fin[fin["method"] == "sync"].set_index("seed")["accuracy"]
            ).mean(),
            "ms_per_iter": im["T"].mean() * 1e3,
            "iter_speedup": speed.mean(),
        }
        if tm is not None and len(tm):
            wall_speed = (sync_wall / tm["wall_s"]).dropna()
            row.update(
                {
                    "target_acc_%": tm["target"].mean(),
                    "iters_to_target": tm["iterations"].mean(),
                    "s_to_target": tm["wall_s"].mean(),
                    "time_to_acc_speedup": wall_speed.mean() if len(wall_speed) else np.nan,
                    "reached": f"{int(tm['iterations'].notna().sum())}/{len(tm)}",
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


def _title(df: pd.DataFrame, what: str) -> str:
    cal = df[df["kind"] == "calibration"].iloc[0]
    seeds = sorted(set(df.loc[df["kind"] == "eval", "seed"]))
    return (
        f"{what}: gloo, p={int(df['world_size'].iloc[0])}, {df['algorithm'].iloc[0]} "
        f"AllReduce, {df['network'].iloc[0]}; AllReduce/compute = "
        f"{cal['comm_ratio_model']:.2f} (model), {comm_ratio_measured(df):.2f} (measured "
        f"in sync); {len(seeds)} seed(s)"
    )


def plot(df: pd.DataFrame, **params: Any):
    """Accuracy vs iterations and vs wall time (mean over seeds), and time per iteration."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    df = under_selection(df, selections(df)[0])  # several selections: the first one's runs
    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.3))
    ev = df[df["kind"] == "eval"].copy()
    order = _order(df)
    sns.lineplot(
        data=ev,
        x="iteration",
        y="accuracy",
        hue="method",
        hue_order=order,
        style="method",
        ax=axes[0],
        errorbar=("pi", 100),
        markers=True,
        dashes=False,
    )
    axes[0].set(
        title="held-out accuracy vs iterations (band: range over seeds)", ylabel="accuracy (%)"
    )
    mean = ev.groupby(["method", "iteration"], as_index=False)[["accuracy", "wall_s"]].mean()
    for m in order:
        g = mean[mean["method"] == m]
        axes[1].plot(g["wall_s"], g["accuracy"], marker="o", ms=3, label=m)
    axes[1].set(
        title="held-out accuracy vs wall time (mean over seeds)",
        xlabel="seconds",
        ylabel="accuracy (%)",
    )
    axes[1].legend()
    it = iteration_times(df)
    sns.barplot(
        data=it.assign(ms=it["T"] * 1e3),
        x="method",
        y="ms",
        order=order,
        ax=axes[2],
        errorbar=("pi", 100),
    )
    cal = df[df["kind"] == "calibration"].iloc[0]
    axes[2].axhline(cal["model_sync_s"] * 1e3, color="k", ls="--", lw=1, label="model sync")
    axes[2].axhline(cal["model_pipe_s"] * 1e3, color="k", ls=":", lw=1, label="model pipe")
    axes[2].set(title="time per iteration (median of steady steps)", ylabel="ms")
    axes[2].legend()
    fig.suptitle(_title(df, "E7 Pipe-SGD convergence"), fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


#: The calibration row's timing-model column of each method a speed claim may name.
MODEL_OF = {"pipe": "model_pipe_s", "pipe+fp16": "model_pipe_fp16_s",
            "pipe+int8": "model_pipe_int8_s"}


def _model_speedup(df: pd.DataFrame, method: str) -> tuple[float, pd.DataFrame]:
    if method not in MODEL_OF:
        raise ValueError(f"method must be one of {tuple(MODEL_OF)} (a modelled pipeline), "
                         f"got {method!r}")
    claims.require_columns(df, "kind", "model_sync_s", MODEL_OF[method])
    cal = df[df["kind"] == "calibration"]
    if cal.empty:
        raise ValueError("no calibration rows")
    return float((cal["model_sync_s"] / cal[MODEL_OF[method]]).median()), cal


@claims.prediction("e7_pipe_speedup")
def predict_pipe_speedup(df: pd.DataFrame, method: str) -> str:
    """The prediction of C7.1 (C7.4, C7.5) for the run: the timing model's speedup of
    ``method`` over uncompressed sync from the run's calibrated compute, communication and
    update times (compression shrinks the bytes on the wire; its codec time is not calibrated).

    Example::

        predict_pipe_speedup(df, "pipe")   # 'model speedup 2.00x (sync C + A + U vs ...'
    """
    model, cal = _model_speedup(df, method)
    return (f"model speedup {model:.2f}x (sync C + A + U vs {method} max(C + U, A), with this "
            f"run's calibrated C, A and U: sync {cal['model_sync_s'].median() * 1e3:.3g} ms, "
            f"{method} {cal[MODEL_OF[method]].median() * 1e3:.3g} ms per iteration)")


@claims.check("e7_pipe_speedup")
def check_pipe_speedup(df: pd.DataFrame, method: str, tolerance: float) -> claims.Verdict:
    """sync's / ``method``'s per-iteration time (medians over the independent runs -- the
    timing runs, else one per seed -- with a bootstrap interval) is at least the timing model's
    speedup discounted by the model's accuracy ``tolerance``: ``model * (1 - tolerance) /
    (1 + tolerance)``.

    Example::

        check_pipe_speedup(df, "pipe", 0.25)
    """
    claims.require_columns(df, "kind", "method", "seed", "iteration", "iter_s", "comm_s", "run")
    model, _ = _model_speedup(df, method)
    sync, other = run_samples(df, "sync"), run_samples(df, method)
    r, lo, hi = claims.ratio(sync, other)
    bound = model * (1 - tolerance) / (1 + tolerance)
    what = "timing runs" if timing_kind(df) == "timing" else "training runs (seeds)"
    return claims.Verdict(
        f"{claims.fmt_ci(r, lo, hi)}x (model {model:.2f}x, bound {bound:.2f}x; sync "
        f"{np.median(sync) * 1e3:.1f} ms, {method} {np.median(other) * 1e3:.1f} ms; "
        f"{min(len(sync), len(other))} {what})",
        f">= model x (1 - {tolerance:g}) / (1 + {tolerance:g})",
        claims.at_least(lo, hi, bound),
    )


# C7.2 and C7.3: the paired accuracy comparisons E7 and E9 share (pipecomm.lab.training.pipesgd_analysis)
check_accuracy_within = claims.check("e7_accuracy_within")(accuracy_within)
check_stale_hurts = claims.check("e7_stale_hurts")(stale_hurts)


# --------------------------------------------------------------------------- round two (C7.2b, C7.3b)

#: The rank test's level: each one-sided Wilcoxon test at 2.5%, the tails of a 95% interval.
RANK_LEVEL = 0.025


def selections(df: pd.DataFrame) -> list[int]:
    """The selections the evaluation rows were trained under (round one's data: ``[0]``)."""
    if "selection" not in df:
        return [0]
    sel = pd.to_numeric(df.loc[df["kind"] == "eval", "selection"], errors="coerce").dropna()
    return sorted({int(v) for v in sel}) or [0]


def under_selection(df: pd.DataFrame, k: int) -> pd.DataFrame:
    """The rows of selection ``k``: its training and sweep rows and the shared ones (calibration,
    timing runs, controls at the fixed stress rate: selection NaN); round one's data as it is."""
    if "selection" not in df:
        return df
    sel = pd.to_numeric(df["selection"], errors="coerce")
    return df[sel.isna() | (sel == k)]


def choice_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per method and selection: the peak rate and momentum its evaluation seeds trained at
    (the notebook's "what each selection chose"). Empty without a ``selection`` column.

    Example::

        choice_table(df)   # rows (method, selection), columns lr_peak, momentum
    """
    if "selection" not in df or "momentum" not in df:
        return pd.DataFrame()
    ev = df[df["kind"] == "eval"]
    return ev.groupby(["method", "selection"], dropna=False, sort=False)[
        ["lr_peak", "momentum"]].first()


def _rank_within(d: np.ndarray, bound: float) -> tuple[str, float, float]:
    """The rank test's decision of ``|median difference| <= bound``: PASS when the differences
    lie above ``-bound`` and below ``+bound`` (each one-sided signed-rank test at
    :data:`RANK_LEVEL`), FAIL when they lie below ``-bound`` or above ``+bound``; the two
    one-sided p-values of the PASS direction."""
    p_above = stats.signed_rank_p(d, -bound, "greater")
    p_below = stats.signed_rank_p(d, bound, "less")
    if p_above < RANK_LEVEL and p_below < RANK_LEVEL:
        return claims.PASS, p_above, p_below
    if (stats.signed_rank_p(d, -bound, "less") < RANK_LEVEL
            or stats.signed_rank_p(d, bound, "greater") < RANK_LEVEL):
        return claims.FAIL, p_above, p_below
    return claims.INCONCLUSIVE, p_above, p_below


def _agree(interval: str, rank: str, what: str) -> claims.Decision:
    """The interval's and the rank test's verdicts where they agree; INCONCLUSIVE, saying so,
    where they do not."""
    if str(interval) == str(rank):
        return claims.Decision(str(interval), claims.reason_of(interval)
                               or f"{what}: interval and rank test agree")
    return claims.Decision(claims.INCONCLUSIVE, f"{what}: the interval says {interval}, the "
                           f"rank test {rank}")


def _paired(df: pd.DataFrame, method: str, reference: str) -> tuple[np.ndarray, list[int]]:
    fin = final_accuracy(df).drop_duplicates(["method", "seed"])
    ref = fin[fin["method"] == reference].set_index("seed")["accuracy"]
    other = fin[fin["method"] == method].set_index("seed")["accuracy"]
    seeds = sorted(set(ref.index) & set(other.index))
    return (other.loc[seeds] - ref.loc[seeds]).to_numpy(dtype=float), seeds


def _momentum_gaps(df: pd.DataFrame, methods: list[str], min_lrs: int,
                   min_momenta: int) -> list[str]:
    """Why one selection's choice of each method is not fair: fewer than ``min_momenta``
    momenta or ``min_lrs`` rates (at the chosen momentum) tried, or the rate chosen at an edge."""
    sweep = df[df["kind"] == "sweep"] if "kind" in df else df.iloc[:0]
    out = []
    for m in methods:
        ev = df[(df["kind"] == "eval") & (df["method"] == m)]
        sw = sweep[sweep["method"] == m] if len(sweep) else sweep
        moms = sorted(set(pd.to_numeric(sw["momentum"], errors="coerce").dropna())) \
            if "momentum" in sw else []
        if len(moms) < min_momenta:
            out.append(f"{m}: {len(moms)} momentum value(s) tried, need >= {min_momenta}")
        if ev.empty:
            continue
        lr = float(ev["lr_peak"].iloc[0])
        mom = float(ev["momentum"].iloc[0]) if "momentum" in ev else math.nan
        at = sw[pd.to_numeric(sw["momentum"], errors="coerce") == mom] if "momentum" in sw \
            else sw
        out += tuning.sweep_gaps(m, list(at["lr_peak"]) if len(at) else [], lr, min_lrs)
    return out


@claims.check("e7_accuracy_within_ranked")
def accuracy_within_ranked(df: pd.DataFrame, max_points: float, methods: list[str],
                           tail: float, min_lrs: int, min_momenta: int, min_selections: int,
                           min_seeds: int) -> claims.Verdict:
    """Round two's C7.2b: under each selection (:func:`selections`), for each method, the mean
    paired difference to sync's final accuracy with its 95% t-interval and Wilcoxon's
    signed-rank test of the same pairs against ``+-max_points`` (:func:`_rank_within`); a
    method is PASS (FAIL) under a selection when both say PASS (FAIL), else INCONCLUSIVE; a
    selection combines its methods (:func:`pipecomm.lab.claims.combine`); the claim is the
    verdict every selection gives, INCONCLUSIVE when they disagree. Gates (INCONCLUSIVE
    whatever the tests say): fewer than ``min_selections`` selections or ``min_seeds``
    evaluation seeds; under a selection, a method's rate not chosen from >= ``min_lrs`` rates
    with the one chosen inside them, or its momentum from fewer than ``min_momenta`` values;
    sync not levelled off (:func:`pipecomm.lab.training.pipesgd_analysis.convergence_gap`).

    Example::

        accuracy_within_ranked(df, 1.0, ["pipe", "pipe+fp16", "pipe+int8"], 0.1, 3, 3, 3, 10)
    """
    claims.require_columns(df, "kind", "method", "seed", "accuracy", "final", "iteration")
    sels = selections(df)
    gates: list[str] = []
    if len(sels) < min_selections:
        gates.append(f"{len(sels)} selection(s) of rate and momentum, need >= {min_selections}")
    parts, verdicts = [], []
    n_seeds = 0
    for k in sels:
        sub = under_selection(df, k)
        per, said = [], []
        for m in methods:
            d, seeds = _paired(sub, m, "sync")
            if len(seeds) == 0:
                said.append(claims.Decision(claims.INCONCLUSIVE, f"{m}: no paired seeds"))
                per.append(f"{m}: no runs")
                continue
            n_seeds = max(n_seeds, len(seeds))
            mean, lo, hi = stats.paired_diff_ci(d, np.zeros_like(d))
            rank, p_above, p_below = _rank_within(d, max_points)
            said.append(_agree(claims.within(lo, hi, max_points), rank, m))
            per.append(f"{m} {mean:+.2f} [{lo:+.2f}, {hi:+.2f}] (signed-rank p {p_above:.3g} "
                       f"above -{max_points:g}, {p_below:.3g} below +{max_points:g}; "
                       f"{int((d < 0).sum())} of {len(d)} seeds below sync)")
        reasons = convergence_gap(sub, "sync", tail, max_points / 2)
        reasons += _momentum_gaps(sub, ["sync", *methods], min_lrs, min_momenta)
        v = claims.gate(claims.combine(said), reasons)
        verdicts.append(v)
        fin = final_accuracy(sub)
        sync = fin[fin["method"] == "sync"]["accuracy"].mean()
        parts.append(f"selection {k} (sync {sync:.1f}%): " + ", ".join(per) + f" -> {v}"
                     + (f" ({claims.grouped(reasons)})" if reasons else ""))
    if n_seeds < min_seeds:
        gates.append(f"{n_seeds} paired evaluation seed(s), need >= {min_seeds}")
    if len({str(v) for v in verdicts}) == 1:
        overall = claims.Decision(str(verdicts[0]), f"every selection: {verdicts[0]}")
    else:
        overall = claims.Decision(claims.INCONCLUSIVE, "the selections disagree: "
                                  + ", ".join(f"{k}: {v}" for k, v in zip(sels, verdicts)))
    return claims.Verdict(
        "points vs sync, paired; " + "; ".join(parts)
        + (f" -- cannot decide: {'; '.join(gates)}" if gates else ""),
        f"|difference| <= {max_points:g} point (95% interval and signed-rank test agree) "
        f"under each of >= {min_selections} selections, sync converged",
        claims.gate(overall, gates),
    )


@claims.check("e7_stale_hurts_ranked")
def stale_hurts_ranked(df: pd.DataFrame, method: str, reference: str, min_points: float,
                       tail: float, stress_lr: float, momentum: float,
                       min_seeds: int) -> claims.Verdict:
    """Round two's C7.3b, the negative control at a fixed stress rate: ``method`` (stale) ends
    more than ``min_points`` below ``reference`` (not stale), both trained at ``stress_lr``
    (times the method's ``@`` factor) with ``momentum``, as stated before the run: PASS when the
    paired difference's 95% t-interval lies below ``-min_points`` and the signed-rank test says
    the differences lie below it (at :data:`RANK_LEVEL`), FAIL when both say they lie above it,
    else INCONCLUSIVE. Gates: either arm missing or trained at another rate or momentum, fewer
    than ``min_seeds`` paired seeds, the reference not learned or not levelled off.

    Example::

        stale_hurts_ranked(df, "pipe@1x", "sync@1x", 1.0, 0.1, 0.2, 0.9, 10)
    """
    claims.require_columns(df, "kind", "method", "seed", "accuracy", "final", "iteration")
    ev = df[df["kind"] == "eval"]
    gates = []
    for m in (method, reference):
        rows = ev[ev["method"] == m]
        if rows.empty:
            gates.append(f"{m}: not trained in this run (its controls: "
                         f"{sorted({x for x in ev['method'] if '@' in x}) or 'none'})")
            continue
        want = stress_lr * lr_scale(m)
        lr = float(rows["lr_peak"].iloc[0])
        mom = float(rows["momentum"].iloc[0]) if "momentum" in rows else math.nan
        if not math.isclose(lr, want, rel_tol=1e-9) or not math.isclose(mom, momentum):
            gates.append(f"{m}: trained at rate {lr:g}, momentum {mom:g}; the claim states "
                         f"{want:g}, {momentum:g}")
    if gates:
        return claims.Verdict(f"{method} - {reference}: -- cannot decide: {'; '.join(gates)}",
                              f"difference < -{min_points:g} point (95% interval and signed-rank "
                              f"test agree), reference converged",
                              claims.gate(claims.INCONCLUSIVE, gates))
    d, seeds = _paired(df, method, reference)
    mean, lo, hi = stats.paired_diff_ci(d, np.zeros_like(d))
    p_below = stats.signed_rank_p(d, -min_points, "less")
    p_above = stats.signed_rank_p(d, -min_points, "greater")
    rank = (claims.PASS if p_below < RANK_LEVEL else claims.FAIL if p_above < RANK_LEVEL
            else claims.INCONCLUSIVE)
    reasons = convergence_gap(df, reference, tail, min_points / 2)
    if len(seeds) < min_seeds:
        reasons.append(f"{len(seeds)} paired seed(s), need >= {min_seeds}")
    fin = final_accuracy(df).drop_duplicates(["method", "seed"])
    ref = fin[fin["method"] == reference]["accuracy"].mean()
    return claims.Verdict(
        f"{method} - {reference} ({ref:.1f}%) at rate {stress_lr:g}, momentum {momentum:g}: "
        f"{mean:+.2f} [{lo:+.2f}, {hi:+.2f}] points, signed-rank p {p_below:.3g} below "
        f"-{min_points:g}, {len(seeds)} paired seeds"
        + (f" -- cannot decide: {'; '.join(reasons)}" if reasons else ""),
        f"difference < -{min_points:g} point (95% interval and signed-rank test agree), "
        f"reference converged",
        claims.gate(_agree(claims.at_most(lo, hi, -min_points), rank, method), reasons),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
