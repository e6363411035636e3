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

Protocol in detail (network choice, timing repeats, learning rates, GIL switch interval, what
each claim predicts): docs/experiments.md, "E7: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e07_pipesgd_convergence --out results/manual/E7
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from pipecomm.lab import claims, results
from pipecomm.lab.checks import require
from pipecomm.lab.cli import main
from pipecomm.lab.networks import launch
from pipecomm.lab.training import tuning
from pipecomm.lab.training.pipesgd_analysis import (
    accuracy_rise,
    accuracy_within,
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
        config(self, seed=self.seeds[0], method="sync", eval_part="test")  # a valid one

DEFAULTS = Params.defaults()


def base_method(method: str) -> str:
    """The method whose learning rate ``method`` uses: ``"pipe@4x"`` -> ``"pipe"`` (4x its rate).

    Example::

        >>> base_method("pipe+int8@4x"), base_method("sync")
        ('pipe+int8', 'sync')
    """
    return method.partition("@")[0]


def select_rates(params: Params) -> tuple[dict[str, float], pd.DataFrame]:
    """Each base method's peak learning rate, chosen on the selection seeds: every rate of
    ``lrs`` (extended while the best is at an edge, :func:`pipecomm.lab.training.tuning.select_rate`)
    trained from each of ``selection_seeds``, scored by the final loss on the held-out split's
    "val" half, mean over the selection seeds. The runs take place in a pool without an emulated
    network (the accuracy of a run does not depend on the network's speed). Without a grid of
    >= 2 rates every method trains at ``lr`` and nothing runs. Returns the rates and the
    selection runs' rows (``kind="sweep"``: method, seed, lr_peak, val_loss, val_accuracy,
    selected, sweep_gap)."""
    bases = list(dict.fromkeys(base_method(m) for m in [*params.methods, *params.timing_methods]))
    if len(params.lrs) < 2:
        rate = float(params.lrs[0]) if params.lrs else float(params.lr)
        return dict.fromkeys(bases, rate), pd.DataFrame()
    sel = list(params.selection_seeds)
    runs = results.Runs(len(bases) * len(params.lrs) * len(sel), desc="E7 rate selection")
    rows: list[dict[str, Any]] = []
    chosen: dict[str, float] = {}
    with launch.Ranks(params.world_size, backend=params.backend) as ranks:
        for method in bases:
            scored: list[dict[str, Any]] = []

            def score(lr: float, method: str = method, scored: list = scored) -> float:
                losses = []
                for seed in sel:
                    cfg = config(params, seed=seed, method=method, lr=lr, eval_part="val",
                                 eval_every=0)
                    res = runs({"select": cfg.asdict()}, ranks.run, train_rank, cfg,
                               timeout_s=params.timeout_s)
                    final = res[0]["evals"][-1]
                    scored.append({"kind": "sweep", "method": method, "seed": seed,
                                   "lr_peak": lr, "val_loss": final["test_loss"],
                                   "val_accuracy": final["accuracy"]})
                    losses.append(final["test_loss"])
                return float(np.mean(losses))

            rate, _, gap = tuning.select_rate(score, params.lrs, params.max_extend)
            chosen[method] = rate
            rows += [{**r, "selected": r["lr_peak"] == rate, "sweep_gap": gap or ""}
                     for r in scored]
    runs.close()
    return chosen, pd.DataFrame(rows)


def run(**params: Any) -> pd.DataFrame:
    """Choose each method's learning rate on the selection seeds (:func:`select_rates`), then
    train every method for every evaluation seed at its rate on the chosen emulated network
    (accuracy on the held-out split's "test" half; the controls, methods with ``@``, from the
    first ``control_seeds`` seeds only); tidy rows. A data set to download (``dataset="cifar10"``)
    is fetched first, checksums verified (:func:`pipecomm.lab.workloads.tasks.fetch_data`)."""
    params = Params.make(**params)
    fetch_data(params)  # before the rate selection's ranks read the data set (cifar10: fetched)
    rates, sweep = select_rates(params)

    def cfg_of(params: Params, seed: int, method: str) -> TrainConfig:
        return config(params, seed=seed, method=method, lr=rates[base_method(method)],
                      eval_part="test")

    timing = (list(params.timing_methods), params.timing_iterations, params.timing_runs)
    n_control = params.control_seeds or len(params.seeds)
    df = calibrate_and_train(params, cfg_of, list(params.methods), list(params.seeds),
                             timing=(timing if params.timing_runs and params.timing_methods
                                     else None),
                             runs_seed=lambda i, m: "@" not in m or i < n_control)
    if len(sweep):
        df = pd.concat([df, sweep.assign(world_size=params.world_size)], ignore_index=True)
    return df.assign(target_fraction=params.target_fraction)


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
    return tuning.sweep_table(sw, ["method"], "lr_peak", "val_loss")


def paired_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per evaluation seed: every method's final held-out accuracy (the "test" half) and, for
    every method but sync, its paired difference to sync in points -- the units of C7.2."""
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


if __name__ == "__main__":
    main(sys.modules[__name__])
