"""Analysis of the Pipe-SGD-family training data (E5-E9): steady-state iteration times and the
accuracy claims.

The iteration decomposition is the Pipe-SGD timing model's (Li et al. 2018): per step ``T`` is
the max over ranks of the iteration time, ``C`` the max over ranks of the compute-thread time and
``M = T - C`` the communication on the critical path (:func:`per_iteration`). The accuracy
comparisons of E7 and E9 (:func:`accuracy_within`, :func:`stale_hurts`) are paired by seed, with
a 95% Student-t interval (:func:`pipecomm.lab.measure.stats.paired_diff_ci`), and gated on the reference's
convergence (:func:`pipecomm.lab.claims.still_improving`).

Example::

    median_times(steady(df, 5), ["method"])
    accuracy_within(df, 1.0, ["pipe", "pipe+int8"], 0.1, 3)
"""

from __future__ import annotations

import pandas as pd

from pipecomm.lab import claims
from pipecomm.lab.measure import stats
from pipecomm.lab.training import tuning

__all__ = [
    "accuracy_rise",
    "accuracy_within",
    "convergence_gap",
    "final_accuracy",
    "first_reach",
    "is_true",
    "median_times",
    "paired_accuracy",
    "per_iteration",
    "run_medians",
    "run_samples",
    "selection_gaps",
    "stale_hurts",
    "steady",
    "timing_kind",
]


def steady(df: pd.DataFrame, skip: int, kind: str = "iteration") -> pd.DataFrame:
    """Rows of ``kind`` (``"iteration"``: training runs; ``"timing"``: separate timing runs) in
    the steady state: iterations ``>= skip`` (the pipeline filled, caches warm); the
    ``finish()`` record (iteration -1) is dropped.

    Example::

        steady(df[df.kind == "iteration"], skip=5)
    """
    return df[(df["kind"] == kind) & (df["iteration"] >= skip)]


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


def timing_kind(df: pd.DataFrame) -> str:
    """The rows that time the methods: ``"timing"`` when the data has separate timing runs
    (E7, E9), else ``"iteration"`` (the training runs themselves, one repeat per run).

    Example::

        steady(df, 5, timing_kind(df))
    """
    return "timing" if (df["kind"] == "timing").any() else "iteration"


def run_medians(df: pd.DataFrame, keys: list[str], kind: str | None = None) -> pd.DataFrame:
    """Per ``keys`` and independent run (column ``run``): the median over the run's steady
    iterations of :func:`per_iteration`'s columns (``T``, ``C``, ``M``, ...). One row per run:
    the repeats of a timed claim (consecutive iterations of one run are not independent).
    ``kind`` defaults to :func:`timing_kind`.

    Example::

        run_medians(df, ["method"]).groupby("method")["T"].median()
    """
    claims.require_columns(df, "kind", "iteration", "run", "skip", *keys)
    kind = timing_kind(df) if kind is None else kind
    st = steady(df, int(df["skip"].iloc[0]), kind)
    cols = ["T", "C", "M", "compute_s", "launch_s", "comm_s", "compress_s", "update_s"]
    return per_iteration(st, [*keys, "run"]).groupby([*keys, "run"], as_index=False,
                                                     sort=False)[cols].median()


def run_samples(df: pd.DataFrame, method: str, column: str = "T", key: str = "method"
                ) -> list[float]:
    """The repeats of ``method`` for a timed claim: one value per independent run, the run's
    median over its steady iterations of ``column`` (:func:`run_medians`; separate timing runs
    where the data has them, else the training runs, e.g. one per seed).

    Example::

        claims.ratio(run_samples(df, "sync"), run_samples(df, "pipe"))   # speedup
    """
    med = run_medians(df, [key])
    med = med[med[key] == method]
    if med.empty:
        raise claims.NotDecidable(f"no steady iterations of {method!r} in the data")
    return med[column].tolist()


def median_times(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    """Median over steady iterations of :func:`per_iteration`'s columns, per ``keys``."""
    cols = ["T", "C", "M", "compute_s", "launch_s", "comm_s", "compress_s", "update_s"]
    return per_iteration(df, keys).groupby(keys, as_index=False)[cols].median()


def first_reach(evals: pd.DataFrame, target: float) -> tuple[float, float]:
    """(iteration, wall_s) of the first snapshot with accuracy >= ``target``; NaNs if never.

    Example::

        first_reach(df[(df.kind == "eval") & (df.method == "sync")], 80.0)
    """
    hit = evals[evals["accuracy"] >= target].sort_values("iteration")
    if hit.empty:
        return float("nan"), float("nan")
    return float(hit["iteration"].iloc[0]), float(hit["wall_s"].iloc[0])


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
        raise claims.NotDecidable(f"no paired seeds with both {reference!r} and {method!r}")
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
    ``tail`` fraction of its steps (see :func:`pipecomm.lab.claims.still_improving`), or it
    never learned (its final accuracy is not above its first evaluation's: a diverged reference
    is level, but says nothing about the method compared with it)."""
    ev = df[(df["kind"] == "eval") & (df["method"] == reference)]
    curve = ev.groupby("iteration")["accuracy"].mean().sort_index()
    if len(curve) >= 2 and not curve.iloc[-1] > curve.iloc[0]:
        return [f"{reference} did not learn: its mean accuracy went from {curve.iloc[0]:.1f}% "
                f"at its first evaluation to {curve.iloc[-1]:.1f}%"]
    gap = claims.still_improving(curve, tail, tolerance, higher_is_better=True)
    return [f"{reference} {gap}"] if gap else []


def selection_gaps(df: pd.DataFrame, methods: list[str], min_lrs: int) -> list[str]:
    """Why the learning rates of ``methods`` do not make a fair comparison: a method's rate was
    not selected from >= ``min_lrs`` rates on the selection seeds (rows ``kind="sweep"``), or
    the one selected sits at an edge of the rates tried (:func:`pipecomm.lab.training.tuning.sweep_gaps`).
    """
    sweep = df[df["kind"] == "sweep"] if "kind" in df else df.iloc[:0]
    reasons = []
    for m in methods:
        ev = df[(df["kind"] == "eval") & (df["method"] == m)]
        chosen = float(ev["lr_peak"].iloc[0]) if len(ev) and "lr_peak" in ev else float("nan")
        rates = sweep.loc[sweep["method"] == m, "lr_peak"] if len(sweep) else []
        reasons += tuning.sweep_gaps(m, list(rates), chosen, min_lrs)
    return reasons


def accuracy_within(df: pd.DataFrame, max_points: float, methods: list[str],
                    tail: float, min_lrs: int) -> claims.Verdict:
    """For each method: the mean paired difference (same seed) of final accuracy to sync, with
    its 95% Student-t interval, lies within ``+- max_points`` (PASS), entirely outside (FAIL),
    or straddles the bound (INCONCLUSIVE: the seeds cannot tell). Gated on convergence: when
    sync's accuracy still rose by more than ``max_points / 2`` over the last ``tail`` of its
    steps the comparison is INCONCLUSIVE whatever the interval says; with ``min_lrs`` > 0 also
    on each method's own learning rate (:func:`selection_gaps`).

    Example::

        accuracy_within(df, 1.0, ["pipe", "pipe+fp16", "pipe+int8"], 0.1, 3)
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
    if min_lrs:
        reasons += selection_gaps(df, ["sync", *methods], min_lrs)
    measured = f"paired over {len(sync)} seeds, points vs sync ({sync.mean():.1f}%): "
    measured += ", ".join(parts) + (f" -- cannot decide: {'; '.join(reasons)}" if reasons else "")
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
