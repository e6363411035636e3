"""Learning-rate selection (pipecomm.lab.training.tuning) and the budget a run used (claims.budget_used)."""

import doctest
import math

import pandas as pd
import pytest

from pipecomm.lab import claims
from pipecomm.lab.training import tuning


def test_doctests():
    assert doctest.testmod(tuning).failed == 0


def test_best_inside_the_grid_needs_no_extension():
    calls = []
    rate, scores, gap = tuning.select_rate(lambda lr: calls.append(lr) or abs(lr - 0.02),
                                           [0.01, 0.02, 0.04])
    assert (rate, gap) == (0.02, None) and calls == [0.01, 0.02, 0.04]


def test_extends_downwards_and_gives_up_after_extend():
    rate, scores, gap = tuning.select_rate(lambda lr: lr, [0.01, 0.02], extend=2)
    assert rate == pytest.approx(0.0025) and len(scores) == 4 and "edge" in gap


def test_nan_score_counts_as_worst():
    rate, _, gap = tuning.select_rate(lambda lr: math.nan if lr > 0.03 else -lr,
                                      [0.01, 0.02, 0.04])
    assert rate == 0.02 and gap is None


@pytest.mark.parametrize("grid", [[], [0.01, 0.01], [0.01, -0.02], [0.01, 0.02, 0.08], [True]])
def test_bad_grid_is_refused(grid):
    with pytest.raises(ValueError, match="grid"):
        tuning.select_rate(lambda lr: 0.0, grid)


def test_sweep_gaps():
    assert tuning.sweep_gaps("sync", [0.01, 0.02, 0.04], 0.02, 3) == []
    assert "1 learning rate" in tuning.sweep_gaps("sync", [0.01], 0.01, 3)[0]
    assert "edge" in tuning.sweep_gaps("sync", [0.01, 0.02, 0.04], 0.01, 3)[0]


def test_budget_used():
    curve = pd.Series([2.0, 1.3, 1.21, 1.2], index=[25, 50, 75, 100])
    assert claims.budget_used(curve, 0.05) == 0.75
    assert claims.budget_used(curve, 1.0) == 0.25
    assert claims.budget_used(pd.Series([90.0, 99.0, 97.0], index=[1, 2, 3]), 0.5, True) == 1.0
    assert math.isnan(claims.budget_used(pd.Series(dtype=float), 0.1))
