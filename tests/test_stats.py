"""pipecomm.lab.measure.stats: the intervals that decide timed claims and benchmark targets."""

import numpy as np
import pytest

from pipecomm.lab.measure import stats


def _drifting(ratio: float, n: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two algorithms timed side by side while the host slows down 2x over the run, with 3%
    noise per call: ``a`` takes ``ratio`` times ``b`` in every round."""
    rng = np.random.default_rng(seed)
    speed = np.linspace(1.0, 2.0, n)
    b = 0.010 * speed * (1 + 0.03 * rng.standard_normal(n))
    a = ratio * 0.010 * speed * (1 + 0.03 * rng.standard_normal(n))
    return a, b


def test_paired_ratio_cancels_drift_that_the_unpaired_ratio_counts_as_noise():
    a, b = _drifting(1.10)
    med, lo, hi = stats.paired_ratio_ci(a, b)
    assert lo <= 1.10 <= hi and hi - lo < 0.05
    _, ulo, uhi = stats.ratio_ci(a, b)
    assert uhi - ulo > 3 * (hi - lo)  # the drift, not the algorithms, sets the unpaired width
    assert ulo < 1.0 < 1.15 < uhi  # unpaired: undecided either way; paired: 1.10 located


def test_paired_ratio_of_identical_runs_centres_on_one():
    a, b = _drifting(1.0, seed=3)
    _, lo, hi = stats.paired_ratio_ci(a, b)
    assert lo < 1.0 < hi


def test_paired_ratio_checks_its_arguments():
    with pytest.raises(ValueError, match="pair up"):
        stats.paired_ratio_ci([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        stats.paired_ratio_ci([1.0, 2.0], [1.0, 0.0])
    with pytest.raises(ValueError):
        stats.paired_ratio_ci([], [])
    assert stats.paired_ratio_ci([2.0], [1.0]) == (2.0, 2.0, 2.0)  # one pair: no interval


def test_misses_allowed_is_the_binomial_tail():
    """misses_allowed(n): the smallest k with P(Binomial(n, 0.05) > k) <= 2.5%, checked against
    the tail summed here; 12 intervals allow 2 (3 misses: 2.0%), one interval cannot be rejected;
    bad arguments are refused with their name."""
    import math

    def tail(n, k):  # P(X > k)
        return sum(math.comb(n, j) * 0.05**j * 0.95 ** (n - j) for j in range(k + 1, n + 1))

    assert stats.misses_allowed(12) == 2 and tail(12, 2) == pytest.approx(0.0196, abs=1e-4)
    for n in (1, 2, 5, 12, 24, 48, 100):
        k = stats.misses_allowed(n)
        assert tail(n, k) <= 0.025 and (k == 0 or tail(n, k - 1) > 0.025)
    assert stats.misses_allowed(12, confidence=0.99) < stats.misses_allowed(12)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="n must be"):
            stats.misses_allowed(bad)
    with pytest.raises(ValueError, match="level"):
        stats.misses_allowed(12, level=0.0)
