"""E9 — layer-wise and delayed gradient descent: time per batch and iterations to an accuracy.

Paper: Daily, Vishnu, Siegel, "Leveraging Asynchronicity in Gradient Descent for Scalable Deep
Learning" (ICLR 2017 submission): synchronous GD (one AllReduce of all gradients), layer-wise GD
(each layer's AllReduce starts in a background thread as soon as backprop produces it, zero
staleness), and delayed GD -- "AGD (1 comm)" / "AGD (2 comm)", gradients applied 1 or 2
iterations late -- on a communication-heavy AlexNet. Figure 1: time per batch against a
no-communication bound; the best asynchronous method is "up to 1.7x faster than the synchronous
approach", layer-wise "did not perform as well as expected". Table 1: iterations to reach a
fixed (early) accuracy grow with the delay (sync < 2000, AGD-1 < 3000, AGD-2 5000).

Measures ``nocomm``, ``sync``, ``layerwise``, ``delayed-1`` and ``delayed-2`` on p gloo ranks
over the emulated network (ring AllReduce, bandwidth chosen before measuring so that the
AllReduce takes ``comm_ratio`` x the compute) with an AlexNet-like net: time per batch from
separate timing runs, parallel efficiency against the no-communication bound, and iterations to
``target_acc``. Claims C9.1-C9.4 (artifact/claims.yaml).

Protocol in detail (the net, the buckets, timing repeats, GIL switch interval, the parameters
chosen from the model): docs/experiments.md, "E9: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e09_layerwise_delayed --out results/manual/E9
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from pipecomm.lab import claims
from pipecomm.lab.checks import positive_float, positive_int, require
from pipecomm.lab.cli import main
from pipecomm.lab.training.pipesgd_analysis import (
    accuracy_rise,
    first_reach,
    is_true,
    run_medians,
    run_samples,
    stale_hurts,
    timing_kind,
)
from pipecomm.lab.training.pipesgd_config import (
    ConvergenceParams,
    TrainConfig,
    config,
    parse_methods,
)
from pipecomm.lab.training.pipesgd_training import calibrate_and_train

ID = "E9"
NOTEBOOK = "09_layerwise_delayed"


@dataclass(frozen=True)
class Params(ConvergenceParams):
    """E9's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them. The fields E7 and E9 share are
    :class:`~pipecomm.lab.training.pipesgd_config.ConvergenceParams`'."""

    ALGORITHMS: ClassVar[tuple[str, ...]] = ("lp", "mst", "be", "ring")
    ALGORITHMS_WHY: ClassVar[str] = " (emulated algorithms)"

    methods: list[str] = field(default_factory=lambda:
        ["nocomm", "sync", "layerwise", "delayed-1", "delayed-2"]
    )
    nocomm_iterations: int = 10
    timing_runs: int = 5
    timing_iterations: int = 8
    eval_every: int = 5
    skip: int = 4
    model: str = "alexnet_like"
    model_kw: dict[str, Any] = field(default_factory=lambda:
        {"conv_channels": [64, 256], "fc_width": 1024}
    )
    lr: float = 0.005
    momentum: float = 0.9
    comm_ratio: float = 2.0
    bucket_mb: float = 4.0
    target_acc: float = 70.0
    calib_iters: int = 6

    def validate(self) -> None:
        super().validate()
        positive_int(self, "nocomm_iterations")
        methods = list(self.methods)
        require(
            "sync" in methods and len(set(methods)) == len(methods),
            "methods",
            methods,
            "must list distinct methods including 'sync' (the baseline)",
        )
        parse_methods(methods)
        require(
            0 <= self.skip < self.nocomm_iterations,
            "skip",
            self.skip,
            f"must be below nocomm_iterations={self.nocomm_iterations}",
        )
        require(isinstance(self.timing_runs, int) and not isinstance(self.timing_runs, bool)
                and self.timing_runs >= 0, "timing_runs", self.timing_runs,
                f"must be an int >= 0 (0: the seeds are the repeats; claims need "
                f">= {claims.MIN_REPEATS})")
        require(isinstance(self.timing_iterations, int)
                and self.skip < self.timing_iterations, "timing_iterations",
                self.timing_iterations, f"must be an int > skip={self.skip}")
        positive_float(self, "bucket_mb")
        require(
            0 < self.target_acc <= 100,
            "target_acc",
            self.target_acc,
            "must be a percentage in (0, 100]",
        )
        _config(self, self.seeds[0], "sync")  # a valid training configuration

DEFAULTS = Params.defaults()
# Timing-model predictions shown beside the measurements (layer-wise has none: its time depends
# on when each bucket's gradients are ready in backward, which the calibration does not measure).
MODEL_OF = {
    "nocomm": "model_nocomm_s",
    "sync": "model_sync_s",
    "delayed-1": "model_pipe_s",
    "delayed-2": "model_pipe_s",
}


def _config(params: Params, seed: int, method: str) -> TrainConfig:
    return config(params, seed=seed, method=method, evaluate=method != "nocomm")


def run(**params: Any) -> pd.DataFrame:
    """Compute timing, network choice, the timing runs, then every (seed, method) training run
    in one pool (no ``nocomm`` training run when there are timing runs: it only times)."""
    params = Params.make(**params)
    methods = list(params.methods)
    timing = None
    if params.timing_runs:
        timing = (methods, params.timing_iterations, params.timing_runs)
        methods = [m for m in methods if m != "nocomm"]
    df = calibrate_and_train(
        params,
        _config,
        methods,
        list(params.seeds),
        iterations={"nocomm": params.nocomm_iterations},
        timing=timing,
    )
    return df.assign(target_acc=params.target_acc)


# --------------------------------------------------------------------------- analysis


def _order(df: pd.DataFrame) -> list[str]:
    return list(dict.fromkeys(df.loc[df["kind"] == timing_kind(df), "method"]))


def batch_times(df: pd.DataFrame) -> pd.DataFrame:
    """Per method and independent run (the timing runs, else the training runs): the run's
    median steady time per batch T (and its parts C, M)."""
    return run_medians(df, ["method"])


def iterations_to_target(df: pd.DataFrame) -> pd.DataFrame:
    """Per method and seed: first snapshot iteration with accuracy >= ``target_acc``."""
    target = float(df["target_acc"].iloc[0])
    ev = df[df["kind"] == "eval"]
    rows = []
    for (m, seed), g in ev.groupby(["method", "seed"], sort=False):
        if m == "nocomm":
            continue
        it, wall = first_reach(g, target)
        rows.append(
            {
                "method": m,
                "seed": seed,
                "target": target,
                "iterations": it,
                "wall_s": wall,
                "max_iteration": int(g["iteration"].max()),
                "final_acc": float(g.loc[is_true(g["final"]), "accuracy"].iloc[0]),
            }
        )
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Figure 1 and Table 1 in one table: per method, ms per batch (mean over seeds), speedup
    over sync, efficiency against the no-communication bound, iterations and seconds to the
    target accuracy, final accuracy."""
    bt = batch_times(df)
    tt = iterations_to_target(df)
    cal = df[df["kind"] == "calibration"].iloc[0]
    med = bt.groupby("method")["T"].median()
    sync = med.get("sync", np.nan)
    nocomm = med.get("nocomm", np.nan)
    rows = []
    for m in _order(df):
        row = {
            "method": m,
            "runs": int(bt.loc[bt["method"] == m, "run"].nunique()),
            "ms_per_batch": med[m] * 1e3,
            "model_ms": cal[MODEL_OF[m.split("+")[0]]] * 1e3
            if m.split("+")[0] in MODEL_OF
            else np.nan,
            "speedup_vs_sync": sync / med[m],
            "efficiency_vs_nocomm": nocomm / med[m],
        }
        g = tt[tt["method"] == m] if len(tt) else tt
        if len(g):
            reached = g["iterations"].notna()
            row.update(
                {
                    "target_acc_%": g["target"].iloc[0],
                    "iters_to_target": g.loc[reached, "iterations"].mean()
                    if reached.any()
                    else np.nan,
                    "reached": f"{int(reached.sum())}/{len(g)} (of {g['max_iteration'].max()})",
                    "s_to_target": g.loc[reached, "wall_s"].mean() if reached.any() else np.nan,
                    "final_acc_%": g["final_acc"].mean(),
                    "rise_last_10%_points": accuracy_rise(df, m, 0.1),
                }
            )
        rows.append(row)
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, **params: Any):
    """Time per batch with the no-communication bound and the model; accuracy vs iterations;
    iterations to the target accuracy."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.3))
    order = _order(df)
    bt = batch_times(df)
    cal = df[df["kind"] == "calibration"].iloc[0]
    sns.barplot(
        data=bt.assign(ms=bt["T"] * 1e3),
        x="method",
        y="ms",
        order=order,
        ax=axes[0],
        errorbar=("pi", 100),
    )
    xs = np.arange(len(order))
    model = [cal[MODEL_OF[m]] * 1e3 if m in MODEL_OF else np.nan for m in order]
    axes[0].plot(xs, model, "kD", label="timing model")
    if "nocomm" in order:
        axes[0].axhline(
            bt[bt["method"] == "nocomm"]["T"].mean() * 1e3,
            color="k",
            ls="--",
            lw=1,
            label="no-communication bound",
        )
    axes[0].set(title="time per batch (per run: median of steady steps; bars over runs)",
                ylabel="ms")
    axes[0].legend(fontsize=8)
    ev = df[(df["kind"] == "eval") & (df["method"] != "nocomm")]
    train_order = [m for m in order if m != "nocomm"]
    if len(ev):
        sns.lineplot(
            data=ev,
            x="iteration",
            y="accuracy",
            hue="method",
            hue_order=train_order,
            ax=axes[1],
            errorbar=("pi", 100),
            marker="o",
        )
        axes[1].axhline(float(df["target_acc"].iloc[0]), color="k", ls=":", lw=1, label="target")
    axes[1].set(title="held-out accuracy vs iterations", ylabel="accuracy (%)")
    tt = iterations_to_target(df)
    if len(tt):
        sns.barplot(
            data=tt, x="method", y="iterations", order=train_order, ax=axes[2], errorbar=("pi", 100)
        )
        for i, m in enumerate(train_order):
            g = tt[tt["method"] == m]
            missed = int(g["iterations"].isna().sum())
            if missed:
                axes[2].annotate(
                    f"{missed} seed(s)\nnot reached", (i, 0), ha="center", va="bottom", fontsize=7
                )
    axes[2].set(
        title=f"iterations to {float(df['target_acc'].iloc[0]):g}% held-out accuracy",
        ylabel="iterations",
    )
    seeds = sorted(set(df.loc[df["kind"] == "iteration", "seed"].dropna()))
    fig.suptitle(
        f"E9 layer-wise and delayed GD: gloo, p={int(df['world_size'].iloc[0])}, "
        f"{df['algorithm'].iloc[0]} AllReduce, {df['network'].iloc[0]}; AllReduce/"
        f"compute = {cal['comm_ratio_model']:.2f} (model); {len(seeds)} seed(s)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def example_run(layerwise_s: float = 0.032) -> pd.DataFrame:
    """A synthetic run for the claims' examples: five runs of three iterations of each method at
    a fixed time per batch (sync 36 ms, delayed-1/-2 24 ms, layer-wise ``layerwise_s``, nocomm
    20 ms; run r 1% slower per r) and the calibration row of the timing model (layer-wise 32 ms).

    Example::

        >>> sorted(example_run().method.dropna().unique())
        ['delayed-1', 'delayed-2', 'layerwise', 'nocomm', 'sync']
    """
    times = {"sync": 0.036, "delayed-1": 0.024, "delayed-2": 0.024, "layerwise": layerwise_s,
             "nocomm": 0.020}
    rows = [{"kind": "iteration", "method": m, "seed": r, "run": r, "iteration": i, "skip": 1,
             "compute_s": 0.02, "launch_s": 0.0, "comm_s": t - 0.02, "compress_s": 0.0,
             "update_s": 0.0, "iter_s": t * (1 + 0.01 * r), "loss": 1.0}
            for m, t in times.items() for r in range(5) for i in range(3)]
    cal = {"kind": "calibration", "model_sync_s": 0.036, "model_pipe_s": 0.024,
           "model_layerwise_s": 0.032, "model_nocomm_s": 0.020}
    return pd.DataFrame(rows + [cal])


def _calibrated_model(df: pd.DataFrame, column: str) -> float:
    """The timing model's time per batch ``column`` over sync's, from the run's calibration."""
    claims.require_columns(df, "kind", "model_sync_s", column)
    cal = df[df["kind"] == "calibration"]
    if cal.empty:
        raise ValueError("no calibration rows")
    return float(cal[column].iloc[0] / cal["model_sync_s"].iloc[0])


@claims.prediction("e9_delayed_faster")
def predict_delayed_faster(df: pd.DataFrame) -> str:
    """C9.1's prediction for the run: the timing model's delayed / sync time per batch from the
    run's calibrated compute and AllReduce.

    Example::

        >>> df = example_run()
        >>> predict_delayed_faster(df)
        "model ratio 0.67 (1.50x faster) from this run's calibrated compute and AllReduce"
    """
    r = _calibrated_model(df, "model_pipe_s")
    return f"model ratio {r:.2f} ({1 / r:.2f}x faster) from this run's calibrated compute and AllReduce"


@claims.prediction("e9_layerwise_not_slower")
def predict_layerwise_not_slower(df: pd.DataFrame) -> str:
    """C9.2's (superseded by C9.2b) prediction for the run: the bucket-schedule model's
    layer-wise / sync time.

    Example::

        >>> df = example_run()
        >>> predict_layerwise_not_slower(df)                   # doctest: +ELLIPSIS
        "bucket-schedule model ratio 0.89 (communication hidden behind the backward pass only), ..."
    """
    r = _calibrated_model(df, "model_layerwise_s")
    return (f"bucket-schedule model ratio {r:.2f} (communication hidden behind the backward pass "
            f"only), from this run's calibration")


def _runs_text(df: pd.DataFrame, n: int) -> str:
    return f"{n} {'timing runs' if timing_kind(df) == 'timing' else 'training runs (seeds)'}"


@claims.check("e9_delayed_faster")
def check_delayed_faster(df: pd.DataFrame, methods: list[str], max_ratio: float,
                         may_miss: str | int) -> claims.Verdict:
    """Each method's time per batch / sync's (medians over the independent runs) has its
    interval below ``max_ratio``, except for the allowance of ``may_miss`` methods.

    Example::

        >>> df = example_run()
        >>> check_delayed_faster(df, ["delayed-1", "delayed-2"], 1.0, "none").verdict
        'PASS'
    """
    claims.require_columns(df, "kind", "method", "seed", "iteration", "iter_s", "comm_s", "run")
    sync = run_samples(df, "sync")
    parts, verdicts = [], []
    for m in methods:
        r, lo, hi = claims.ratio(run_samples(df, m), sync)
        verdicts.append(claims.at_most(lo, hi, max_ratio))
        parts.append(f"{m} {claims.fmt_ci(r, lo, hi)}x sync")
    allowed = claims.allowance(len(verdicts), may_miss)
    return claims.Verdict(
        "; ".join(parts) + f" (sync {np.median(sync) * 1e3:.1f} ms; {_runs_text(df, len(sync))})",
        f"time / sync < {max_ratio:g} (95% interval), {allowed} may miss",
        claims.combine(verdicts, allowed),
    )


@claims.prediction("e9_efficiency")
def predict_efficiency(df: pd.DataFrame, methods: list[str]) -> str:
    """C9.4's prediction for the run: the timing model's parallel efficiency (no-communication
    time per batch / the method's) from the run's calibrated compute and AllReduce.

    Example::

        >>> df = example_run()
        >>> predict_efficiency(df, ["delayed-1"])
        "model efficiency 0.83 for delayed-1 (sync 0.56) from this run's calibrated compute and AllReduce"
    """
    e = _calibrated_model(df, "model_nocomm_s") / _calibrated_model(df, "model_pipe_s")
    s = _calibrated_model(df, "model_nocomm_s")
    return (f"model efficiency {e:.2f} for {', '.join(methods)} (sync {s:.2f}) from this run's "
            f"calibrated compute and AllReduce")


@claims.check("e9_efficiency")
def check_efficiency(df: pd.DataFrame, methods: list[str], tolerance: float,
                     may_miss: str | int) -> claims.Verdict:
    """Parallel efficiency against the no-communication bound (Daily et al.): for each method,
    no-communication time per batch / the method's (medians over the independent runs, with a
    bootstrap interval) is at least the timing model's efficiency (``model_nocomm_s /
    model_pipe_s`` of the calibration) discounted by ``tolerance``: ``model * (1 - tolerance) /
    (1 + tolerance)``, except for the allowance of ``may_miss`` methods.

    Example::

        >>> df = example_run()
        >>> check_efficiency(df, ["delayed-1", "delayed-2"], 0.25, "none").verdict
        'PASS'
    """
    claims.require_columns(df, "kind", "method", "seed", "iteration", "iter_s", "comm_s", "run")
    model = _calibrated_model(df, "model_nocomm_s") / _calibrated_model(df, "model_pipe_s")
    bound = model * (1 - tolerance) / (1 + tolerance)
    nocomm = run_samples(df, "nocomm")
    parts, verdicts = [], []
    for m in methods:
        e, lo, hi = claims.ratio(nocomm, run_samples(df, m))
        verdicts.append(claims.at_least(lo, hi, bound))
        parts.append(f"{m} {claims.fmt_ci(e, lo, hi)}")
    allowed = claims.allowance(len(verdicts), may_miss)
    sync_e = float(np.median(nocomm) / np.median(run_samples(df, "sync")))
    return claims.Verdict(
        "efficiency " + "; ".join(parts) + f" (model {model:.2f}, bound {bound:.2f}; sync "
        f"{sync_e:.2f}; no communication {np.median(nocomm) * 1e3:.1f} ms; "
        f"{_runs_text(df, len(nocomm))})",
        f">= model x (1 - {tolerance:g}) / (1 + {tolerance:g}) (95% interval), {allowed} may miss",
        claims.combine(verdicts, allowed),
    )


@claims.check("e9_layerwise_not_slower")
def check_layerwise_not_slower(df: pd.DataFrame, max_ratio: float) -> claims.Verdict:
    """Layer-wise time per batch / sync's has its interval at or below ``max_ratio``.

    Example::

        >>> df = example_run()
        >>> check_layerwise_not_slower(df, 1.0)                  # doctest: +ELLIPSIS
        Verdict(measured='layerwise / sync 0.889 [0.863, 0.915]x (5 training runs (seeds))', threshold='<= 1x (95% interval)', verdict='PASS', reason='95% interval [0.863, 0.915] at or below the threshold 1')
    """
    claims.require_columns(df, "kind", "method", "seed", "iteration", "iter_s", "comm_s", "run")
    sync = run_samples(df, "sync")
    r, lo, hi = claims.ratio(run_samples(df, "layerwise"), sync)
    return claims.Verdict(f"layerwise / sync {claims.fmt_ci(r, lo, hi)}x "
                          f"({_runs_text(df, len(sync))})",
                          f"<= {max_ratio:g}x (95% interval)", claims.at_most(lo, hi, max_ratio))


@claims.prediction("e9_layerwise_short")
def predict_layerwise_short(df: pd.DataFrame, against: str) -> str:
    """C9.2b's prediction for the run: the bucket-schedule model's layer-wise / sync time and
    the timing model's ``against`` (a delayed method) / layer-wise time, from the run's
    calibration -- what layer-wise would reach if it performed as its model expects.

    Example::

        >>> print(predict_layerwise_short(example_run(), "delayed-1"))  # doctest: +ELLIPSIS
        bucket-schedule model: layer-wise / sync 0.89, so a layer-wise that met it would fail ...
    """
    lw = _calibrated_model(df, "model_layerwise_s")
    d = _calibrated_model(df, "model_pipe_s")
    return (f"bucket-schedule model: layer-wise / sync {lw:.2f}, so a layer-wise that met it "
            f"would fail the shortfall part; timing model layer-wise / {against} {lw / d:.2f} "
            f"(slower than {against} even as modelled), from this run's calibration")


@claims.check("e9_layerwise_short")
def check_layerwise_short(df: pd.DataFrame, tolerance: float, against: str,
                          min_ratio: float) -> claims.Verdict:
    """Layer-wise GD does not perform as well as expected (Daily et al.): (a) its time per
    batch / sync's exceeds the bucket-schedule model's ratio (``model_layerwise_s /
    model_sync_s`` of the calibration) by more than ``tolerance``: the signed error ``measured
    / model - 1`` of the ratio has its interval at or above ``tolerance`` (below it: layer-wise
    performed as its model expects, FAIL); and (b) it is slower than ``against`` (a delayed
    method): layer-wise / ``against`` time per batch has its interval at or above
    ``min_ratio``. Both must hold; either failing fails (medians over the independent runs).

    Example::

        >>> df = example_run(layerwise_s=0.038)
        >>> check_layerwise_short(df, 0.1, "delayed-1", 1.0).measured
        'layerwise / sync 1.06 [1.03, 1.09]x against the model 0.889x: +19% [+15%, +22%]; layerwise / delayed-1 1.58 [1.54, 1.63]x (5 training runs (seeds))'
    """
    claims.require_columns(df, "kind", "method", "seed", "iteration", "iter_s", "comm_s", "run")
    sync, lw = run_samples(df, "sync"), run_samples(df, "layerwise")
    model = _calibrated_model(df, "model_layerwise_s")
    r, lo, hi = claims.ratio(lw, sync)
    e = [v / model - 1 for v in (r, lo, hi)]
    short = claims.at_least(e[1], e[2], tolerance)
    q, qlo, qhi = claims.ratio(lw, run_samples(df, against))
    slower = claims.at_least(qlo, qhi, min_ratio)
    return claims.Verdict(
        f"layerwise / sync {claims.fmt_ci(r, lo, hi)}x against the model {model:.3g}x: "
        f"{e[0]:+.0%} [{e[1]:+.0%}, {e[2]:+.0%}]; layerwise / {against} "
        f"{claims.fmt_ci(q, qlo, qhi)}x ({_runs_text(df, len(sync))})",
        f"layerwise / sync >= model x (1 + {tolerance:g}) and layerwise / {against} >= "
        f"{min_ratio:g} (95% intervals)", claims.combine([short, slower]))


# C9.3: a delay of 2 costs accuracy at a fixed step budget (the paired comparison of E7's C7.3)
check_stale_hurts = claims.check("e9_stale_hurts")(stale_hurts)


if __name__ == "__main__":
    main(sys.modules[__name__])
