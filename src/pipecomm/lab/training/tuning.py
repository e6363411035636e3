"""Learning-rate selection of the convergence experiments (E7, E13): every method its own rate.

A method's peak learning rate is chosen on *selection seeds* -- seeds that never count in a
claim -- as the rate of a geometric grid whose score (mean validation loss over the selection
seeds) is lowest. When the best rate sits at an edge of the grid the grid is extended by its own
ratio in that direction, up to ``extend`` times, so that the chosen rate has a worse rate on each
side (docs/experiments.md, "Learning rates"). A comparison whose rates were not selected this way
is undecided (:func:`sweep_gaps`).

Round two (issue 45) also chooses each method's momentum, jointly with its rate
(:func:`select_rate_momentum`), by a rule robust to divergence (:data:`SELECTION_RULES`): a
selection run *diverged* when its final validation loss is not finite or not below the loss of
a uniform guess (:func:`diverged`).

Example::

    >>> rate, scores, gap = select_rate(lambda lr: (lr - 0.04) ** 2, [0.005, 0.01, 0.02])
    >>> rate, sorted(scores), gap
    (0.04, [0.005, 0.01, 0.02, 0.04, 0.08], None)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd

__all__ = [
    "SELECTION_RULES",
    "Selection",
    "check_grid",
    "diverged",
    "rule_score",
    "select_rate",
    "select_rate_momentum",
    "sweep_gaps",
    "sweep_table",
]

#: How a rate is chosen from the selection runs' final validation losses (one per selection
#: seed): ``"mean"`` the lowest mean loss (round one; a NaN loss counts as worse than any);
#: ``"median"`` the lowest median loss, a diverged run counting as an infinite loss (one seed in
#: three may diverge without moving it); ``"stable"`` the largest rate that diverges on no
#: selection seed. Between momenta (:func:`select_rate_momentum`): the lower mean loss
#: (``"mean"``) or median loss (the others) at each momentum's rate.
SELECTION_RULES = ("mean", "median", "stable")


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


def diverged(loss: float, limit: float) -> bool:
    """Whether a selection run diverged: its final validation loss is NaN, infinite or at least
    ``limit`` (the loss of a uniform guess, ``log(classes)``: the run learned nothing).

    Example::

        >>> import math
        >>> diverged(float("nan"), math.log(10)), diverged(2.31, math.log(10)), diverged(1.1, 2.3)
        (True, True, False)
    """
    return not math.isfinite(loss) or loss >= limit


def rule_score(losses: Sequence[float], rule: str, limit: float) -> float:
    """The score (lower is better) of one rate's selection losses (one per selection seed)
    under ``rule`` (:data:`SELECTION_RULES`), ``limit`` the divergence threshold
    (:func:`diverged`): ``"mean"`` the mean (NaN -> inf); ``"median"`` the median with a diverged
    run as inf; ``"stable"`` 0 when no run diverged, else inf (the rate is then compared by
    size, :func:`select_rate_momentum`).

    Example::

        >>> rule_score([1.0, 1.2, float("nan")], "median", 2.3), rule_score([1.0, 3.0], "stable", 2.3)
        (1.2, inf)
    """
    if rule not in SELECTION_RULES:
        raise ValueError(f"rule must be one of {SELECTION_RULES}, got {rule!r}")
    if not len(losses):
        raise ValueError("no selection losses to score")
    if rule == "mean":
        m = float(np.mean(losses))
        return math.inf if math.isnan(m) else m
    marked = [math.inf if diverged(v, limit) else float(v) for v in losses]
    if rule == "median":
        return float(np.median(marked))
    return 0.0 if all(math.isfinite(v) for v in marked) else math.inf


@dataclass(frozen=True)
class Selection:
    """What :func:`select_rate_momentum` chose: ``rate`` and ``momentum``, the selection losses
    of every (momentum, rate) tried (``losses[(momentum, rate)]``: one per selection seed), and
    ``gap``: why the choice is not a fair one (None when it is)."""

    rate: float
    momentum: float
    losses: dict[tuple[float, float], list[float]]
    gap: str | None


def select_rate_momentum(run: Callable[[float, float], Sequence[float]], grid: Sequence[float],
                         momenta: Sequence[float], rule: str, extend: int = 3,
                         limit: float = math.inf) -> Selection:
    """Each momentum's rate by ``rule`` (:data:`SELECTION_RULES`) over ``grid`` -- extended past
    an edge that holds the choice, as :func:`select_rate` -- then the momentum whose rate scores
    best: the lower mean (``"mean"``) or median (else) of its losses, a diverged run as inf;
    ties go to the smaller momentum, then the smaller rate. ``run(rate, momentum)`` trains the
    selection seeds and returns their final validation losses; ``limit`` is the divergence
    threshold (:func:`diverged`). ``"stable"`` takes each momentum's largest rate that diverged
    on no seed (none: the smallest, with a gap).

    Example::

        >>> table = {(0.0, 0.1): [1.0, 1.1], (0.0, 0.2): [0.9, 0.8], (0.0, 0.4): [0.7, 9.0],
        ...          (0.0, 0.8): [9.0, 9.0], (0.0, 0.05): [1.5, 1.6]}
        >>> sel = select_rate_momentum(lambda lr, m: table[(m, lr)], [0.1, 0.2, 0.4], [0.0],
        ...                            "stable", limit=2.3)
        >>> sel.rate, sel.momentum, sel.gap
        (0.2, 0.0, None)
    """
    if rule not in SELECTION_RULES:
        raise ValueError(f"rule must be one of {SELECTION_RULES}, got {rule!r}")
    moms = list(momenta)
    if not moms or len(set(moms)) != len(moms):
        raise ValueError(f"momenta must be a non-empty list of distinct values, got {momenta!r}")
    losses: dict[tuple[float, float], list[float]] = {}
    chosen: list[tuple[float, float, float, str | None]] = []  # (score, momentum, rate, gap)
    for m in sorted(float(v) for v in moms):
        def score(lr: float, m: float = m) -> float:
            losses[(m, lr)] = [float(v) for v in run(lr, m)]
            s = rule_score(losses[(m, lr)], rule, limit)
            return -lr if rule == "stable" and s == 0.0 else s

        rate, scores, gap = select_rate(score, grid, extend)
        if rule == "stable" and math.isinf(scores.get(rate, 0.0)):
            gap = f"momentum {m:g}: every rate tried diverged on a selection seed"
        summary = "mean" if rule == "mean" else "median"
        got = losses.get((m, rate))
        between = (rule_score(got, summary, limit) if got is not None else math.inf)
        chosen.append((between, m, rate, gap))
    best = min(chosen, key=lambda c: (c[0], c[1], c[2]))
    return Selection(rate=best[2], momentum=best[1], losses=losses, gap=best[3])


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
