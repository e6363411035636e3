"""Learning-rate selection of the convergence experiments (E7, E13): every method its own rate.

A method's peak learning rate is chosen on *selection seeds* -- seeds that never count in a
claim -- as the rate of a geometric grid whose score (mean validation loss over the selection
seeds) is lowest. When the best rate sits at an edge of the grid the grid is extended by its own
ratio in that direction, up to ``extend`` times, so that the chosen rate has a worse rate on each
side (docs/experiments.md, "Learning rates"). A comparison whose rates were not selected this way
is undecided (:func:`sweep_gaps`).

Example::

    >>> rate, scores, gap = select_rate(lambda lr: (lr - 0.04) ** 2, [0.005, 0.01, 0.02])
    >>> rate, sorted(scores), gap
    (0.04, [0.005, 0.01, 0.02, 0.04, 0.08], None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd

__all__ = ["check_grid", "select_rate", "sweep_gaps", "sweep_table"]


def check_grid(name: str, grid: Sequence[float]) -> list[float]:
    """``grid`` sorted, after checking it: one or more distinct numbers > 0, geometric when it has more than
    two (one ratio between neighbours, within 1%), so that an extension continues it.

    Example::

        >>> check_grid("lrs", [0.02, 0.01, 0.04])
        [0.01, 0.02, 0.04]
    """
    if not isinstance(grid, (list, tuple)) or not grid or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
        for v in grid
    ) or len(set(grid)) != len(grid):
        raise ValueError(f"parameter {name} must be a list of distinct rates > 0, got {grid!r}")
    rates = sorted(float(v) for v in grid)
    ratios = [b / a for a, b in zip(rates, rates[1:])]
    if ratios and max(ratios) > 1.01 * min(ratios):
        raise ValueError(f"parameter {name} must be a geometric grid (one ratio between "
                         f"neighbouring rates, e.g. [0.01, 0.02, 0.04]), got {grid!r}")
    return rates


def select_rate(score: Callable[[float], float], grid: Sequence[float],
                extend: int = 3) -> tuple[float, dict[float, float], str | None]:
    """The rate of ``grid`` with the lowest ``score(rate)`` (a selection run's validation loss),
    the grid extended by its ratio past whichever edge holds the best, at most ``extend`` times.

    Returns ``(rate, {rate: score} of every rate scored, gap)``; ``gap`` says why the selection
    is not a fair one (a single rate: nothing was swept and ``score`` is never called; the best
    still at an edge after ``extend`` extensions), else None. A NaN score (a diverged run) counts
    as worse than any number.

    Example::

        >>> select_rate(lambda lr: 1.0, [0.003])
        (0.003, {}, '1 rate: no sweep')
    """
    rates = check_grid("grid", list(grid))
    if len(rates) == 1:
        return rates[0], {}, "1 rate: no sweep"
    ratio = rates[1] / rates[0]
    scores: dict[float, float] = {}

    def key(lr: float) -> float:
        s = scores[lr]
        return math.inf if math.isnan(s) else s

    for lr in rates:
        scores[lr] = float(score(lr))
    for _ in range(extend + 1):
        ordered = sorted(scores)
        best = min(ordered, key=key)
        if ordered[0] < best < ordered[-1]:
            return best, scores, None
        if _ == extend:
            break
        new = best * ratio if best == ordered[-1] else best / ratio
        scores[new] = float(score(new))
    return best, scores, (f"best rate {best:g} at the edge of the grid after {extend} "
                          f"extension(s)")


def sweep_gaps(what: str, rates: Sequence[float], chosen: float, min_rates: int) -> list[str]:
    """Why ``what``'s rate (``chosen`` out of the ``rates`` swept) does not make a fair
    comparison: fewer than ``min_rates`` rates swept, or the chosen one at an edge.

    Example::

        >>> sweep_gaps("pipe", [0.01, 0.02, 0.04], 0.04, 3)
        ['pipe: best rate 0.04 at the edge of the 3 rates swept']
    """
    rates = sorted(set(rates))
    if len(rates) < min_rates:
        return [f"{what}: {len(rates)} learning rate(s) swept, need >= {min_rates}"]
    if rates and chosen in (rates[0], rates[-1]):
        return [f"{what}: best rate {chosen:g} at the edge of the {len(rates)} rates swept"]
    return []


def sweep_table(runs: pd.DataFrame, index: list[str], rate: str, score: str) -> pd.DataFrame:
    """The selection as a table: one row per ``index`` group, one column per rate tried, each
    cell the mean ``score`` over the selection seeds, ``*`` on the rate chosen (a run's boolean
    ``selected``).

    Example::

        >>> runs = pd.DataFrame({"method": ["sync"] * 4, "lr": [0.01, 0.01, 0.02, 0.02],
        ...                      "loss": [0.3, 0.5, 0.2, 0.2], "selected": [False, False, True, True]})
        >>> sweep_table(runs, ["method"], "lr", "loss").loc["sync"].tolist()
        ['0.4000', '0.2000 *']
    """
    g = runs.assign(selected=runs["selected"].astype(bool)).groupby(
        [*index, rate], sort=False).agg(mean=(score, "mean"), chosen=("selected", "any"))
    g = g.reset_index()
    g["cell"] = g["mean"].map("{:.4f}".format) + np.where(g["chosen"], " *", "")
    return g.pivot_table(index=index, columns=rate, values="cell", aggfunc="first", sort=False)
