"""Statistics behind every timed number and every verdict: medians with bootstrap intervals,
ratios of medians, paired differences over seeds, and the one model-error metric.

No paper equation: this is the measurement protocol of the artifact (docs/experiments.md).

* A timed point is a sample of repeats; it is reported as its median with a percentile-bootstrap
  95% confidence interval (:func:`median_ci`).
* "A is at most x times B" compares the ratio of the two medians, with an interval from
  resampling both samples independently (:func:`ratio_ci`).
* Seeds are paired (same seed, same data order for both methods): :func:`paired_diff_ci` gives the
  mean paired difference with a Student-t interval.
* Beside the interval, a rank test of the same pairs that assumes no normal distribution:
  Wilcoxon's signed-rank test of the differences against a shift (:func:`signed_rank_p`).
* A model is scored by the signed relative error ``(measured - model) / model``
  (:func:`model_error`): negative means faster than the model. Summaries report the worst |error|
  (with its sign) and the mean signed bias (:func:`error_summary`).

Repeats travel in data.csv as one text cell per point (``"0.0121;0.0119;..."``, seconds):
:func:`join_repeats` writes it and :func:`repeats` reads it back.

Example::

    >>> from pipecomm.lab.measure import stats
    >>> m, lo, hi = stats.median_ci([0.101, 0.099, 0.100, 0.105, 0.098, 0.102, 0.100, 0.101, 0.103, 0.1])
    >>> round(m, 4), round(lo, 4), round(hi, 4)
    (0.1005, 0.0995, 0.102)
    >>> lp_times, builtin_times = [0.012, 0.013, 0.012], [0.010, 0.010, 0.011]
    >>> r, rlo, rhi = stats.ratio_ci(lp_times, builtin_times)     # LP / built-in
    >>> round(r, 2)
    1.2
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

CONFIDENCE = 0.95
N_BOOT = 2000
BOOTSTRAP_SEED = 20261125  # fixed: the same data always gives the same interval


def _sample(x: Iterable[float], name: str) -> np.ndarray:
    a = np.asarray([float(v) for v in x], dtype=np.float64)
    if a.size == 0:
        raise ValueError(f"{name} is empty: need at least one repeat")
    if not np.all(np.isfinite(a)):
        raise ValueError(f"{name} holds a non-finite value: {a.tolist()}")
    return a


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")


def median_ci(x: Iterable[float], confidence: float = CONFIDENCE,
              n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """Median of ``x`` and its percentile-bootstrap interval: ``(median, lo, hi)``.

    One repeat gives the degenerate interval ``(x, x, x)``; callers that decide claims should ask
    for enough repeats (the profiles ask for >= 10).

    Example::

        >>> median_ci([3.0, 1.0, 2.0])
        (2.0, 1.0, 3.0)
    """
    _check_confidence(confidence)
    a = _sample(x, "x")
    med = float(np.median(a))
    if a.size == 1:
        return med, med, med
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    boots = np.median(a[rng.integers(0, a.size, size=(n_boot, a.size))], axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(boots, [tail, 1.0 - tail])
    return med, float(lo), float(hi)


def ratio_ci(a: Iterable[float], b: Iterable[float], confidence: float = CONFIDENCE,
             n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """``median(a) / median(b)`` with a bootstrap interval resampling ``a`` and ``b``
    independently (the repeats of two algorithms are not paired).

    Example::

        >>> [round(v, 2) for v in ratio_ci([2.0, 2.1, 1.9], [1.0, 1.0, 1.1])]
        [2.0, 1.73, 2.1]
    """
    _check_confidence(confidence)
    xa, xb = _sample(a, "a"), _sample(b, "b")
    if np.any(xb <= 0):
        raise ValueError("b must be positive (it is a divisor)")
    est = float(np.median(xa) / np.median(xb))
    if xa.size == 1 and xb.size == 1:
        return est, est, est
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    ma = np.median(xa[rng.integers(0, xa.size, size=(n_boot, xa.size))], axis=1)
    mb = np.median(xb[rng.integers(0, xb.size, size=(n_boot, xb.size))], axis=1)
    tail = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(ma / mb, [tail, 1.0 - tail])
    return est, float(lo), float(hi)


def paired_ratio_ci(a: Sequence[float], b: Sequence[float], confidence: float = CONFIDENCE,
                    n_boot: int = N_BOOT) -> tuple[float, float, float]:
    """Median of the paired ratios ``a[i] / b[i]`` with a percentile-bootstrap interval over the
    pairs: for repeats timed side by side (repeat ``i`` of both in one round,
    :func:`pipecomm.lab.measure.sweep.measure_points` with ``interleave``), so that a drift of the host
    between rounds, which :func:`ratio_ci` counts as noise, cancels within each pair.

    Example::

        >>> paired_ratio_ci([2.0, 4.1, 3.0], [1.0, 2.0, 1.5])   # drift cancels
        (2.0, 2.0, 2.05)
    """
    _check_confidence(confidence)
    xa, xb = _sample(a, "a"), _sample(b, "b")
    if xa.size != xb.size:
        raise ValueError(f"a and b must pair up: {xa.size} vs {xb.size} values")
    if np.any(xb <= 0):
        raise ValueError("b must be positive (it is a divisor)")
    return median_ci(xa / xb, confidence, n_boot)


def misses_allowed(n: int, confidence: float = CONFIDENCE, level: float = 0.025) -> int:
    """How many of ``n`` independent ``confidence`` intervals of a true null (an A/A comparison)
    may exclude it before a method is rejected: the smallest ``k`` with
    ``P(Binomial(n, 1 - confidence) > k) <= level``. With 12 intervals at 95%, 2 (3 or more
    misses come with probability 2.0%); a check of "every interval contains 1" would reject a
    sound method in 46% of such runs.

    Example::

        >>> misses_allowed(12)
        2
    """
    _check_confidence(confidence)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive number of intervals, got {n!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    q = 1.0 - confidence
    tail = 1.0  # P(X > k - 1) = P(X >= k), for k = 0, 1, ...
    for k in range(n + 1):
        tail -= math.comb(n, k) * q**k * (1.0 - q) ** (n - k)
        if tail <= level * (1 + 1e-9):  # P(X > 0) for n = 1 is exactly 1 - confidence
            return k
    return n


def paired_diff_ci(a: Sequence[float], b: Sequence[float],
                   confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """Mean of the paired differences ``a[i] - b[i]`` with a Student-t interval.

    Pairs share a seed (same initialisation and data order). With one pair the interval is
    unbounded (``-inf, inf``): one seed cannot decide anything.

    Example::

        >>> [round(v, 3) for v in paired_diff_ci([2.10, 2.12, 2.08], [2.05, 2.06, 2.04])]
        [0.05, 0.025, 0.075]
    """
    _check_confidence(confidence)
    xa, xb = _sample(a, "a"), _sample(b, "b")
    if xa.size != xb.size:
        raise ValueError(f"a and b must pair up: {xa.size} vs {xb.size} values")
    d = xa - xb
    mean = float(d.mean())
    if d.size == 1:
        return mean, -math.inf, math.inf
    half = _t_quantile(1.0 - (1.0 - confidence) / 2.0, d.size - 1) * float(d.std(ddof=1)) / math.sqrt(d.size)
    return mean, mean - half, mean + half


def signed_rank_p(d: Sequence[float], shift: float = 0.0, alternative: str = "greater") -> float:
    """One-sided p-value of Wilcoxon's signed-rank test on the paired differences ``d``
    against ``shift``: ``"greater"`` tests that they lie above it (H1: median > shift),
    ``"less"`` below. Exact for small samples without ties (scipy's ``method="auto"``);
    differences equal to ``shift`` are split between the signs (``zero_method="zsplit"``).
    With every difference equal to ``shift`` (no evidence either way) the p-value is 1.

    Example::

        >>> round(signed_rank_p([0.2, 0.4, 0.1, 0.3, 0.5, 0.6], 0.0), 4)   # 6 of 6 above: 1 / 64
        0.0156
        >>> signed_rank_p([0.2, -0.1, 0.3], 0.0, "less") > 0.5
        True
    """
    if alternative not in ("greater", "less"):
        raise ValueError(f"alternative must be 'greater' or 'less', got {alternative!r}")
    x = _sample(d, "d") - float(shift)
    if not np.any(x):
        return 1.0
    from scipy.stats import wilcoxon

    p = float(wilcoxon(x, zero_method="zsplit", alternative=alternative).pvalue)
    return 1.0 if math.isnan(p) else p


def _t_quantile(q: float, df: int) -> float:
    """Student-t quantile (scipy when present; else a Cornish-Fisher expansion, accurate to
    about 1e-3 for df >= 2)."""
    try:
        from scipy.stats import t

        return float(t.ppf(q, df))
    except ImportError:  # pragma: no cover - scipy ships with scikit-learn here
        from statistics import NormalDist

        z = NormalDist().inv_cdf(q)
        g1 = (z**3 + z) / 4
        g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
        g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
        return z + g1 / df + g2 / df**2 + g3 / df**3


def model_error(measured: float | np.ndarray, model: float | np.ndarray) -> float | np.ndarray:
    """Signed relative error of a model, ``(measured - model) / model``: the one error metric of
    every model claim (negative: faster than the model).

    Example::

        >>> round(model_error(1.2, 1.0), 6)
        0.2
    """
    m = np.asarray(model, dtype=np.float64)
    if np.any(m <= 0):
        raise ValueError("model must be positive to score a relative error")
    out = (np.asarray(measured, dtype=np.float64) - m) / m
    return float(out) if out.ndim == 0 else out


def error_summary(errors: Iterable[float]) -> dict[str, float]:
    """``worst`` (the signed error of largest magnitude), ``bias`` (mean signed error),
    ``same_sign`` (fraction of errors with the sign of the bias) and ``n``.

    Example::

        >>> s = error_summary([0.1, -0.3, 0.05])
        >>> s["worst"], round(s["bias"], 6)
        (-0.3, -0.05)
    """
    e = _sample(errors, "errors")
    worst = float(e[int(np.argmax(np.abs(e)))])
    bias = float(e.mean())
    sign = np.sign(bias) if bias != 0 else 1.0
    return {"worst": worst, "bias": bias, "same_sign": float(np.mean(np.sign(e) == sign)),
            "n": int(e.size)}


def join_repeats(times: Iterable[float]) -> str:
    """The repeats of one point as a data.csv cell: ``"t1;t2;..."`` (seconds, 6 significant
    digits).

    Example::

        >>> join_repeats([0.0121, 0.0119])
        '0.0121;0.0119'
    """
    return ";".join(f"{float(t):.6g}" for t in times)


def repeats(cell: str | float) -> list[float]:
    """Parse a data.csv repeats cell written by :func:`join_repeats` (a bare number is one
    repeat).

    Example::

        >>> repeats("0.0121;0.0119")
        [0.0121, 0.0119]
    """
    if isinstance(cell, (int, float)) and not isinstance(cell, bool):
        if math.isnan(float(cell)):
            raise ValueError("repeats cell is empty (NaN)")
        return [float(cell)]
    text = str(cell).strip()
    if not text:
        raise ValueError("repeats cell is empty")
    return [float(v) for v in text.split(";")]


def summarise(times: Iterable[float], confidence: float = CONFIDENCE) -> dict[str, float | str | int]:
    """The columns a timed point carries in data.csv: ``time_s`` (median), ``ci_lo_s``,
    ``ci_hi_s``, ``repeats`` (count) and ``times_s`` (every repeat, :func:`join_repeats`).

    Example::

        >>> row = {"algorithm": "lp", "nbytes": 1024, **summarise([0.10, 0.12, 0.11])}
        >>> row["time_s"], row["repeats"], row["times_s"]
        (0.11, 3, '0.1;0.12;0.11')
    """
    t = _sample(times, "times")
    med, lo, hi = median_ci(t, confidence)
    return {"time_s": med, "ci_lo_s": lo, "ci_hi_s": hi, "repeats": int(t.size),
            "times_s": join_repeats(t)}
