"""Claims: machine-readable statements of the papers, checked against a run's data.csv.

``artifact/claims.yaml`` lists every claim (id, paper, the paper's statement and number where
known, experiment, what the model predicts, the threshold and why it was chosen before the run,
the check name and its arguments). Thresholds live only there: a check function takes every
threshold as an argument without a default.

A *check* is a function registered here by name that reads an experiment's tidy DataFrame and
returns a :class:`Verdict`: the measured value with its interval, the threshold, and one of PASS,
FAIL or INCONCLUSIVE. Timed quantities are decided on their 95% confidence intervals
(:mod:`pipecomm.lab.measure.stats`): a claim "x <= t" passes only when the whole interval is at or below t,
fails when the whole interval is above it, and is INCONCLUSIVE otherwise (:func:`at_most`,
:func:`at_least`, :func:`within`). A point with fewer than :data:`MIN_REPEATS` repeats cannot be
decided. Claims of several points combine with :func:`combine` (any FAIL fails; all PASS pass).
Entries with ``kind: illustration`` are analytic model statements shown without a verdict.

A check that cannot fail is a defect: tests feed every check synthetic data that must PASS, data
that must FAIL and, for interval checks, data that must be INCONCLUSIVE.

Example::

    from pipecomm.lab import claims
    table = claims.evaluate(claims.load_claims(), "results/cpu")
    print(claims.to_markdown(table))
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.lab import schema
from pipecomm.lab.measure import stats
from pipecomm.lab.results import REPO_ROOT, load_csv

CLAIMS_FILE = REPO_ROOT / "artifact" / "claims.yaml"
PASS, FAIL, INCONCLUSIVE = "PASS", "FAIL", "INCONCLUSIVE"
NOT_RUN, ERROR, MODEL = "NOT RUN", "ERROR", "MODEL (no verdict)"
UNSTABLE = "UNSTABLE"  # independent runs disagree (counted with INCONCLUSIVE: not decided)
VERDICTS = (PASS, FAIL, INCONCLUSIVE, UNSTABLE, ERROR, NOT_RUN, MODEL)
MIN_REPEATS = 5  # fewer repeats than this cannot decide a timed claim
#: The kinds of claim (docs/experiments.md, "Claims"): a paper's own comparison, stated in the
#: paper's terms with its source; a check of pipecomm's own models (emulator against its link,
#: model against measurement, emulator against a shaped network, implementation targets); an
#: analytic model statement shown without a verdict.
PAPER, METHOD, ILLUSTRATION = schema.KINDS
KINDS = tuple(schema.KINDS)
#: Whose number a paper claim's threshold is (claims.yaml ``bar``): the paper's own statement
#: (its direction or number), pipecomm's own model (a PASS is against pipecomm's model, not a
#: number of the paper), or a margin the artifact chose (an accuracy point, a fit tolerance).
BAR_PAPER, BAR_MODEL, BAR_MARGIN = schema.BARS
#: The fields of a claims.yaml entry that define what its verdict decides: the experiment (and
#: so the measurement protocol), the statement, the check and its arguments (thresholds and
#: gates) and the profiles it is decided in. Changing any of them after a run makes a new
#: version of the claim (docs/experiments.md, "Versions"); its kind, prediction, reasons and
#: citations are not part of the definition (a reclassification is recorded in
#: artifact/claims-ledger.yaml, not hidden).
#: What a verdict decides. Where a claim is evaluated (``profiles``) is not in it: that is its
#: regime, recorded per profile in the ledger (a profile added or dropped is an amendment).
DEFINITION_FIELDS = ("experiment", "statement", "check", "args")
_ID = re.compile(r"^(C[0-9]+\.[0-9]+)([b-z]?)$")


class Decision(str):
    """A verdict (PASS, FAIL or INCONCLUSIVE) with the reason its rule gave: it compares, counts
    and prints as the plain verdict, and :class:`Verdict` picks its ``reason`` up.

    Example::

        d = at_most(0.8, 1.3, 1.2)
        d == INCONCLUSIVE, d.reason   # (True, '95% interval [0.8, 1.3] straddles the threshold 1.2')
    """

    reason: str

    def __new__(cls, verdict: str, reason: str = "") -> Decision:
        obj = super().__new__(cls, verdict)
        obj.reason = reason
        return obj

    def __reduce__(self) -> tuple[Any, ...]:
        return Decision, (str(self), self.reason)


def reason_of(verdict: Any) -> str:
    """The reason a :class:`Decision` carries ("" for a plain verdict string or a bool).

    Example::

        reason_of(at_least(1.0, 1.1, 1.2))   # '95% interval [1, 1.1] below the threshold 1.2'
    """
    return getattr(verdict, "reason", "") or ""


@dataclass(frozen=True)
class Verdict:
    """Outcome of one check: what was measured (with its interval), against what, the verdict
    (PASS, FAIL or INCONCLUSIVE; a bool is read as PASS / FAIL) and why (``reason``: the rule
    that decided or did not decide; taken from a :class:`Decision` verdict when not given)."""

    measured: str
    threshold: str
    verdict: str | bool
    reason: str = ""

    def __post_init__(self) -> None:
        v = self.verdict
        if not self.reason:
            object.__setattr__(self, "reason", reason_of(v))
        if isinstance(v, (bool, np.bool_)):
            object.__setattr__(self, "verdict", PASS if v else FAIL)
        elif v not in (PASS, FAIL, INCONCLUSIVE):
            raise ValueError(f"verdict must be PASS, FAIL, INCONCLUSIVE or a bool, got {v!r}")
        else:
            object.__setattr__(self, "verdict", str(v))

    @property
    def passed(self) -> bool:
        return self.verdict == PASS


class NotDecidable(ValueError):
    """Raised by a check whose data lacks the point its claim decides on (a run with
    ``-p world_sizes=[2,4]`` has no p = 16): the claims table shows NOT RUN with the reason
    (:func:`check_failed`), not ERROR, since nothing failed.

    Example::

        >>> check_failed(NotDecidable("no MST broadcast measured at p=16"))["verdict"]
        'NOT RUN'
    """


def check_failed(exc: BaseException) -> dict[str, str]:
    """The ``verdict`` and ``why`` of a claim whose check raised ``exc``: NOT RUN, "not decidable
    on this data", for :class:`NotDecidable`; ERROR with the exception (:func:`error_reason`)
    for anything else, a broken check.

    Example::

        >>> check_failed(KeyError("time_s"))["verdict"]
        'ERROR'
    """
    if isinstance(exc, NotDecidable):
        return {"verdict": NOT_RUN, "why": f"not decidable on this data: {exc}"}
    return {"verdict": ERROR, "why": error_reason(exc)}


def _span(lo: float, hi: float) -> str:
    return f"[{lo:.3g}, {hi:.3g}]"


def _undecided(lo: float, hi: float, bound: str) -> str:
    """Why an interval did not decide: unbounded (too few repeats) or straddling ``bound``."""
    if math.isinf(lo) or math.isinf(hi):
        return (f"95% interval {_span(lo, hi)} is unbounded: fewer than {MIN_REPEATS} repeats "
                f"(a quick configuration cannot decide; the profile's run can)")
    return f"95% interval {_span(lo, hi)} straddles the threshold {bound}"


def at_most(lo: float, hi: float, threshold: float) -> Decision:
    """Decide "x <= threshold" from x's interval ``[lo, hi]`` (with the reason).

    Example::

        at_most(0.93, 0.98, 1.0)   # PASS;  at_most(0.97, 1.04, 1.0) -> INCONCLUSIVE
    """
    t = f"{threshold:.3g}"
    if hi <= threshold:
        return Decision(PASS, f"95% interval {_span(lo, hi)} at or below the threshold {t}")
    if lo > threshold:
        return Decision(FAIL, f"95% interval {_span(lo, hi)} above the threshold {t}")
    return Decision(INCONCLUSIVE, _undecided(lo, hi, t))


def at_least(lo: float, hi: float, threshold: float) -> Decision:
    """Decide "x >= threshold" from x's interval ``[lo, hi]`` (with the reason).

    Example::

        at_least(1.3, 1.5, 1.2)   # PASS
    """
    t = f"{threshold:.3g}"
    if lo >= threshold:
        return Decision(PASS, f"95% interval {_span(lo, hi)} at or above the threshold {t}")
    if hi < threshold:
        return Decision(FAIL, f"95% interval {_span(lo, hi)} below the threshold {t}")
    return Decision(INCONCLUSIVE, _undecided(lo, hi, t))


def within(lo: float, hi: float, tolerance: float) -> Decision:
    """Decide "|x| <= tolerance" from x's interval ``[lo, hi]`` (x a signed error; with the
    reason).

    Example::

        within(-0.05, 0.12, 0.25)   # PASS;  within(0.2, 0.3, 0.25) -> INCONCLUSIVE
    """
    t = f"+-{tolerance:.3g}"
    if -tolerance <= lo and hi <= tolerance:
        return Decision(PASS, f"95% interval {_span(lo, hi)} inside {t}")
    if hi < -tolerance or lo > tolerance:
        return Decision(FAIL, f"95% interval {_span(lo, hi)} outside {t}")
    return Decision(INCONCLUSIVE, _undecided(lo, hi, t))


def combine(verdicts: list[str], may_miss: int = 0) -> Decision:
    """All of several points, of which ``may_miss`` may miss (stated before the run, see
    :func:`allowance`): FAIL when more than ``may_miss`` points fail, PASS when at most
    ``may_miss`` points are not PASS, else INCONCLUSIVE; the reason counts the points and
    quotes the first deciding (or undeciding) point's reason.

    Example::

        combine([PASS, INCONCLUSIVE])   # INCONCLUSIVE
        combine([PASS] * 19 + [FAIL], may_miss=1)   # PASS
    """
    if not verdicts:
        raise NotDecidable("no points to decide")
    if isinstance(may_miss, bool) or not isinstance(may_miss, (int, np.integer)) or may_miss < 0:
        raise ValueError(f"may_miss must be an int >= 0, got {may_miss!r}")
    n, fails = len(verdicts), [v for v in verdicts if v == FAIL]
    others = [v for v in verdicts if v != PASS]
    if n == 1:  # one point: its own verdict and reason
        return Decision(str(verdicts[0]), reason_of(verdicts[0]))
    allowed = f" ({may_miss} may miss)"
    if len(fails) > may_miss:
        first = next((reason_of(v) for v in fails if reason_of(v)), "")
        return Decision(FAIL, f"{len(fails)} of {n} points FAIL{allowed}"
                        + (f"; first: {first}" if first else ""))
    if len(others) <= may_miss:
        return Decision(PASS, f"{n - len(others)} of {n} points PASS{allowed}")
    first = next((reason_of(v) for v in others if v != FAIL and reason_of(v)), "")
    return Decision(INCONCLUSIVE, f"{len(others)} of {n} points not decided PASS{allowed}"
                    + (f"; first undecided: {first}" if first else ""))


#: A many-point claim's allowance: a point whose claim holds still misses its 95% interval with
#: probability up to 1 - CONFIDENCE; the allowance keeps the claim's own false-FAIL rate at or
#: below this (docs/experiments.md, "Claims over many points").
FAMILY_ERROR = 0.05


def allowance(n_points: int, rule: str | int) -> int:
    """How many of ``n_points`` may miss in a claim over many points, fixed by ``rule`` before
    the run: an int is that count; ``"none"`` is 0 (every point must hold); ``"binomial"`` is
    :func:`pipecomm.lab.measure.stats.misses_allowed` at :data:`FAMILY_ERROR`: the smallest m with
    P(Binomial(n_points, 1 - CONFIDENCE) > m) <= 5%, so that a claim true at every point fails
    by chance at most 5% of the time.

    Example::

        allowance(20, "binomial"), allowance(4, "binomial"), allowance(40, "binomial")   # (3, 1, 4)
    """
    if isinstance(rule, bool) or not isinstance(rule, (int, np.integer, str)):
        raise ValueError(f"may_miss must be 'none', 'binomial' or an int >= 0, got {rule!r}")
    if isinstance(rule, (int, np.integer)):
        if rule < 0:
            raise ValueError(f"may_miss must be >= 0, got {rule}")
        return int(rule)
    if rule == "none":
        return 0
    if rule != "binomial":
        raise ValueError(f"may_miss must be 'none', 'binomial' or an int >= 0, got {rule!r}")
    if isinstance(n_points, bool) or not isinstance(n_points, (int, np.integer)):
        raise ValueError(f"n_points must be an int >= 1, got {n_points!r}")
    return stats.misses_allowed(int(n_points), level=FAMILY_ERROR)


def missed(verdicts: list[str], may_miss: int) -> str:
    """The text a many-point claim reports about its allowance.

    Example::

        missed([PASS, FAIL, PASS], 1)   # '1 of 3 points missed (1 may miss)'
    """
    return (f"{sum(v != PASS for v in verdicts)} of {len(verdicts)} points missed "
            f"({may_miss} may miss)")


#: The convergence gate looks back at least this many evaluation intervals (see tail_gain).
GATE_INTERVALS = 3


def tail_gain(curve: pd.Series, tail: float, higher_is_better: bool = False) -> float:
    """How much a training curve (value per step, indexed by step) still improved over the last
    ``tail`` fraction of its steps, and at least over its last :data:`GATE_INTERVALS` evaluation
    intervals (one interval of a noisy curve says nothing): last value against the one at the
    start of that window (positive = better; NaN without an evaluation before the window).

    Example::

        tail_gain(pd.Series([2.0, 1.5, 1.2, 1.19], index=[25, 50, 75, 100]), 0.25)   # 0.81
        # (from step 25: the window spans at least the last 3 evaluation intervals)
    """
    curve = curve.dropna().sort_index()
    if len(curve) < 2:
        return math.nan
    last = curve.index[-1]
    start = curve[curve.index <= last - tail * last]
    if start.empty:
        return math.nan
    first = min(len(start) - 1, max(0, len(curve) - 1 - GATE_INTERVALS))
    gain = float(curve.iloc[-1] - curve.iloc[first])
    return gain if higher_is_better else -gain


def budget_used(curve: pd.Series, tolerance: float, higher_is_better: bool = False) -> float:
    """The fraction of a training run's steps after which its curve (value per step, indexed by
    step) stayed within ``tolerance`` of its final value: how much of the budget the method
    needed (1.0: it was still moving at the end; NaN for an empty curve).

    Example::

        budget_used(pd.Series([2.0, 1.3, 1.21, 1.2], index=[25, 50, 75, 100]), 0.05)   # 0.75
    """
    curve = curve.dropna().sort_index()
    if curve.empty:
        return math.nan
    off = (curve - curve.iloc[-1]) if not higher_is_better else (curve.iloc[-1] - curve)
    outside = curve.index[off.abs().to_numpy() > tolerance]
    last = curve.index[-1]
    if len(outside) == 0:
        return float(curve.index[0] / last)
    later = curve.index[curve.index > outside[-1]]
    return float(later[0] / last) if len(later) else 1.0


def still_improving(curve: pd.Series, tail: float, tolerance: float,
                    higher_is_better: bool = False) -> str | None:
    """The convergence gate of a comparison of training runs: the reason why it cannot be
    decided when the reference run's metric (``curve``: value per step, mean over seeds) still
    improved by more than ``tolerance`` over the last ``tail`` fraction of its steps
    (:func:`tail_gain`) -- a gap within a margin could then open or close with more training.
    None when it has levelled off.

    Example::

        still_improving(pd.Series([2.0, 1.5, 1.2, 1.195, 1.19, 1.19], index=range(1, 7)), 0.1,
                        0.02)   # None: 1.20 -> 1.19 over the last 3 evaluations
    """
    gain = tail_gain(curve, tail, higher_is_better)
    if math.isnan(gain):
        return "the reference has no evaluation before its last steps: convergence unknown"
    if gain > tolerance:
        return (f"not converged: the reference improved by {gain:.4g} over its last "
                f"{tail:.0%} of steps or {GATE_INTERVALS} evaluations (> {tolerance:.4g})")
    return None


def gate(verdict: str, reasons: list[str]) -> str:
    """INCONCLUSIVE when a protocol condition of the claim is not met (``reasons`` non-empty),
    whatever the interval says, with the reason "protocol gate closed: ..."; else ``verdict``.

    Example::

        gate(PASS, ["only 1 learning rate swept"])   # INCONCLUSIVE
    """
    if reasons:
        return Decision(INCONCLUSIVE, "protocol gate closed: " + grouped(reasons))
    return verdict


def grouped(reasons: list[str]) -> str:
    """Reasons of the form ``"<who>: <what>"`` that share ``<what>`` said once, naming each
    ``<who>`` (a gate over many configurations reads as a few lines, not one per configuration).

    Example::

        grouped(["sync: 1 rate swept", "pipe: 1 rate swept", "sync not converged"])
        # '1 rate swept: sync, pipe; sync not converged'
    """
    split = [r.partition(": ") for r in reasons]
    shared = [what for _, sep, what in split if sep and what]
    groups: dict[str, list[str]] = {}
    for r, (who, _, what) in zip(reasons, split):
        if what and shared.count(what) > 1:
            groups.setdefault(what, []).append(who)
        else:
            groups.setdefault(r, [])
    return "; ".join(f"{what}: {', '.join(who)}" if who else what for what, who in groups.items())


def interval(values: list[float]) -> tuple[float, float, float]:
    """Median of a timed point's repeats with its 95% interval; fewer than
    :data:`MIN_REPEATS` repeats give an unbounded interval (cannot decide).

    Example::

        m, lo, hi = interval(stats.repeats(row.times_s))
    """
    m, lo, hi = stats.median_ci(values)
    if len(values) < MIN_REPEATS:
        _few_repeats(len(values))
        return m, -math.inf, math.inf
    return m, lo, hi


_FEW: list[list[int]] = []  # per running check (run_check): repeat counts below MIN_REPEATS


def _few_repeats(n: int) -> None:
    if _FEW:
        _FEW[-1].append(n)


def ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """``median(a) / median(b)`` with its 95% interval (unbounded with too few repeats).

    Example::

        r, lo, hi = ratio(lp_times, builtin_times)
    """
    r, lo, hi = stats.ratio_ci(a, b)
    if min(len(a), len(b)) < MIN_REPEATS:
        _few_repeats(min(len(a), len(b)))
        return r, 0.0, math.inf
    return r, lo, hi


def fmt_ci(x: float, lo: float, hi: float, spec: str = ".3g") -> str:
    """``"1.23 [1.20, 1.27]"``: an estimate with its 95% interval.

    Example::

        fmt_ci(1.234, 1.2, 1.27)   # '1.23 [1.2, 1.27]'
    """
    return f"{x:{spec}} [{lo:{spec}}, {hi:{spec}}]"


CheckFn = Callable[..., Verdict]
CHECKS: dict[str, CheckFn] = {}


def check(name: str) -> Callable[[CheckFn], CheckFn]:
    """Register a claim check under ``name`` (referenced from artifact/claims.yaml).

    Example::

        @claims.check("e0_fit_within")
        def _fit_within(df, min_bytes, tolerance):
            worst = ...
            return claims.Verdict(f"{worst:.1%}", f"<= {tolerance:.0%}", worst <= tolerance)
    """

    def register(fn: CheckFn) -> CheckFn:
        if name in CHECKS and CHECKS[name] is not fn:
            raise ValueError(f"claim check {name!r} registered twice")
        CHECKS[name] = fn
        return fn

    return register


PredictFn = Callable[..., str]
PREDICTIONS: dict[str, PredictFn] = {}


def prediction(name: str) -> Callable[[PredictFn], PredictFn]:
    """Register the model's prediction for the claims of check ``name``, computed from a run's
    own data (its parameters and model columns): the text the claims table and the notebooks
    show in place of claims.yaml's ``prediction``, which states it for the profile's
    configuration. A claim whose prediction does not depend on the configuration registers
    none. The function takes the DataFrame and any of the claim's ``args`` by name.

    Example::

        @claims.prediction("e4_best_block_near_model")
        def _predict_best_block(df, op):
            return f"model optimum {int(df.optimal_block_bytes.iloc[0]) >> 10} KiB"
    """

    def register(fn: PredictFn) -> PredictFn:
        if name in PREDICTIONS and PREDICTIONS[name] is not fn:
            raise ValueError(f"prediction of claim check {name!r} registered twice")
        PREDICTIONS[name] = fn
        return fn

    return register


def predict(entry: dict[str, Any], df: pd.DataFrame | None) -> str:
    """The model's prediction for ``entry`` on the run ``df``: from the parameters that ran
    when the check registered a :func:`prediction`, else claims.yaml's text (a prediction that
    holds for any configuration). When the run's prediction cannot be computed, claims.yaml's
    text says that it is the profile's, and why this run's is missing.

    Example::

        predict(entry, df)   # 'model optimum 341 KiB (k = 6); blocks 2x off cost 9.8% more ...'
    """
    text = entry.get("prediction", "") or ""
    fn = PREDICTIONS.get(entry.get("check", ""))
    if fn is None or df is None:
        return text
    names = list(inspect.signature(fn).parameters)[1:]
    args = entry.get("args", {})
    try:
        return str(fn(df, **{k: args[k] for k in names if k in args}))
    except Exception as exc:  # the verdict still shows; the prediction says whose it is
        return (f"for the profile's configuration: {text} (this run's prediction cannot be "
                f"computed: {type(exc).__name__}: {exc})")


def load_checks() -> dict[str, CheckFn]:
    """Import every experiment module so that all checks are registered."""
    import pipecomm.lab.experiments as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    return CHECKS


def _check_signature(entry: dict[str, Any], fn: CheckFn, path: Any) -> None:
    """Every threshold comes from claims.yaml: the check's parameters (after the DataFrame) have
    no defaults, and ``args`` gives each of them."""
    params = list(inspect.signature(fn).parameters.values())[1:]
    with_default = [q.name for q in params if q.default is not inspect.Parameter.empty]
    if with_default:
        raise schema.ConfigError(f"{path}: claim {entry['id']}: check {entry['check']!r} has "
                                 f"defaults for {with_default}: thresholds and arguments belong "
                                 "in claims.yaml only")
    names = {q.name for q in params}
    missing, unknown = sorted(names - set(entry["args"])), sorted(set(entry["args"]) - names)
    if missing or unknown:
        raise schema.ConfigError(f"{path}: claim {entry['id']}: args lack {missing} / have "
                                 f"unknown {unknown} for check {entry['check']!r}")


def split_id(claim_id: str) -> tuple[str, str]:
    """A claim id as its family and version: ``C9.2b`` is version ``b`` of ``C9.2``; an id
    without a letter is version ``a`` (docs/experiments.md, "Versions").

    Example::

        >>> split_id("C9.2b"), split_id("C13.1")
        (('C9.2', 'b'), ('C13.1', 'a'))
    """
    m = _ID.match(claim_id)
    if m is None:
        raise ValueError(f"claim id {claim_id!r} is not C<experiment>.<n> with an optional "
                         f"version letter b-z (C9.2, C9.2b)")
    return m.group(1), m.group(2) or "a"


def definition(entry: dict[str, Any]) -> str:
    """The hash of what a claim's verdict decides (:data:`DEFINITION_FIELDS` of its claims.yaml
    entry; the statement with its whitespace folded, as YAML may wrap it): 16 hex digits of
    SHA-256 over their canonical JSON. Claims tables record it beside each verdict, and
    artifact/claims-ledger.yaml beside each version, so that a definition changed after a run
    is refused (tests/test_claims_ledger.py) instead of re-deciding the old verdict silently.

    Example::

        >>> e = {"experiment": "E3", "statement": "MST grows  like log p", "check": "c",
        ...      "args": {"tolerance": 0.1}}
        >>> definition(e) == definition({**e, "statement": "MST grows like log p",
        ...                               "prediction": "any text"})
        True
        >>> definition(e) == definition({**e, "args": {"tolerance": 0.15}})
        False
    """
    fields = {k: entry.get(k) for k in DEFINITION_FIELDS}
    fields["statement"] = " ".join(str(fields["statement"] or "").split())
    fields["args"] = fields["args"] or {}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_versions(entries: list[dict[str, Any]], path: Any) -> None:
    """``supersedes`` and ``superseded_by`` name each other, within one family, the new
    version one letter on."""
    by_id = {e["id"]: e for e in entries}
    for e in entries:
        old = e.get("supersedes")
        if old is None and not _ID.match(e["id"]):
            continue  # an id outside the scheme (a test's) has no versions
        try:
            family, version = split_id(e["id"])
        except ValueError as exc:
            raise schema.ConfigError(f"{path}: {exc}") from None
        if old is not None:
            if old not in by_id or by_id[old].get("superseded_by") != e["id"]:
                raise schema.ConfigError(f"{path}: claim {e['id']}: supersedes {old!r}, whose "
                                         f"entry must stay in the file with superseded_by: "
                                         f"{e['id']}")
            try:
                old_family, old_version = split_id(old)
            except ValueError as exc:
                raise schema.ConfigError(f"{path}: {exc}") from None
            if old_family != family or ord(version) != ord(old_version) + 1:
                raise schema.ConfigError(f"{path}: claim {e['id']}: a new version of {old} "
                                         f"is {old_family}{chr(ord(old_version) + 1)}")
        elif version != "a":
            raise schema.ConfigError(f"{path}: claim {e['id']}: version {version} needs "
                                     f"supersedes: (the version it replaces)")
        new = e.get("superseded_by")
        if new is not None and (new not in by_id or by_id[new].get("supersedes") != e["id"]):
            raise schema.ConfigError(f"{path}: claim {e['id']}: superseded_by {new!r}, which "
                                     f"must state supersedes: {e['id']}")


def load_claims(path: str | Path | None = None,
                superseded: bool = False) -> list[dict[str, Any]]:
    """Read artifact/claims.yaml, checked against :data:`pipecomm.lab.schema.CLAIMS` (the keys
    each kind states: a checked claim its ``check``, ``prediction`` and ``threshold_reason`` --
    why this threshold, chosen before the run --, a paper claim its ``source`` and ``bar``; an
    entry with ``kind: illustration`` is an analytic statement shown without a verdict), then:
    ids unique, versions that name each other (``supersedes`` / ``superseded_by``), each check
    known and given every argument of it. An optional ``profiles`` list limits the profiles
    whose claims table lists the claim (for example the real-backend targets, which the
    ``shaped`` profile's network runs do not measure).

    A version that a newer one replaced (``superseded_by``) stays in the file with its
    definition, is never evaluated on a new run, and keeps the verdicts it had (ARTIFACT.md's
    history table); it is returned only with ``superseded=True``.

    Raises:
        pipecomm.lab.schema.ConfigError: one line naming the file, the claim and the key.

    Example::

        [e["id"] for e in load_claims()]
    """
    path = CLAIMS_FILE if path is None else path
    entries = schema.load(path, schema.CLAIMS)
    checks = load_checks()
    seen = set()
    for entry in entries:
        if entry["id"] in seen:
            raise schema.ConfigError(f"{path}: claim {entry['id']} appears twice")
        seen.add(entry["id"])
        if entry.get("args") is None:
            entry["args"] = {}
        entry.setdefault("profiles", None)
        entry.setdefault("paper_value", "")
        entry.setdefault("prediction", "")
        if entry["kind"] != ILLUSTRATION:
            if entry["check"] not in checks:
                if entry.get("superseded_by"):  # never evaluated again: its check may be gone
                    continue
                raise schema.ConfigError(f"{path}: claim {entry['id']}: unknown check "
                                         f"{entry['check']!r}")
            _check_signature(entry, checks[entry["check"]], path)
    _check_versions(entries, path)
    return entries if superseded else [e for e in entries if not e.get("superseded_by")]


def run_check(entry: dict[str, Any], df: pd.DataFrame) -> Verdict:
    """Apply one claim's check to a DataFrame; the verdict always says why
    (:func:`explain`: the rule's reason, the closed gate, too few repeats).

    Example::

        run_check(entry, df).reason   # 'fewer than 5 repeats at 3 points (as few as 2): ...'
    """
    _FEW.append([])
    try:
        v = CHECKS[entry["check"]](df, **entry.get("args", {}))
    finally:
        few = _FEW.pop()
    return Verdict(v.measured, v.threshold, v.verdict, explain(v, few))


def quick_reason(few: list[int]) -> str:
    """Why points with too few repeats cannot decide (``few``: their repeat counts).

    Example::

        quick_reason([2, 2])   # 'fewer than 5 repeats at 2 points (as few as 2): ...'
    """
    points = f"{len(few)} point{'s' if len(few) > 1 else ''}"
    return (f"fewer than {MIN_REPEATS} repeats at {points} (as few as {min(few)}): their 95% "
            f"intervals are unbounded, so the quick configuration cannot decide (the profile's "
            f"run, ./run_all.sh, repeats enough)")


def explain(v: Verdict, few: list[int] | None = None) -> str:
    """The reason of a check's verdict ``v``: too few repeats first when an undecided verdict
    had points with fewer than :data:`MIN_REPEATS` repeats (``few``), then the reason its rule
    gave (:class:`Decision`), else what its measured text says cannot decide, else the generic
    rule (the 95% intervals in measured against the threshold).

    Example::

        explain(Verdict("x 1.3 [0.9, 1.8]", "x <= 1.2", INCONCLUSIVE))
        # 'the 95% interval(s) in measured neither meet nor miss the threshold (x <= 1.2)'
    """
    reason = v.reason
    if not reason and "cannot decide:" in v.measured:
        reason = "cannot decide: " + v.measured.split("cannot decide:", 1)[1].strip()
    if v.verdict == INCONCLUSIVE and few and "unbounded" not in reason:
        return quick_reason(few) + (f"; {reason}" if reason else "")
    if reason:
        return reason
    return {PASS: f"measured meets the threshold ({v.threshold})",
            FAIL: f"measured misses the threshold ({v.threshold})"}.get(
        v.verdict, f"the 95% interval(s) in measured neither meet nor miss the threshold "
                   f"({v.threshold})")


def explain_row(row: Any) -> str:
    """The reason of a row of a claims table that has no ``why`` (a table written before
    reasons were recorded): from its verdict, ``runs``, ``measured`` and ``threshold``.

    Example::

        explain_row({"verdict": "UNSTABLE", "runs": "PASS, FAIL"})
        # 'independent runs disagree: PASS, FAIL'
    """
    get = row.get if hasattr(row, "get") else (lambda k, d="": getattr(row, k, d))
    verdict, measured = str(get("verdict", "")), str(get("measured", "") or "")
    if verdict == UNSTABLE:
        return f"independent runs disagree: {get('runs', '')}"
    if verdict == ERROR:
        return f"the check cannot run on this data: {measured}"
    if verdict == NOT_RUN:
        return "its experiment has no result here"
    if verdict == MODEL:
        return "an analytic model statement: shown without a verdict"
    few = "inf]" in measured
    v = Verdict(measured, str(get("threshold", "") or ""), verdict if verdict in (
        PASS, FAIL, INCONCLUSIVE) else INCONCLUSIVE)
    if few and verdict == INCONCLUSIVE and "cannot decide:" not in measured:
        return (f"an interval in measured is unbounded: fewer than {MIN_REPEATS} repeats (a "
                f"quick configuration cannot decide)")
    return explain(v)


def evaluate(
    entries: list[dict[str, Any]],
    results_dir: str | Path,
    dirs: dict[str, Path] | None = None,
    reference: dict[str, str] | None = None,
    states: dict[str, str] | None = None,
) -> pd.DataFrame:
    """Evaluate every claim whose experiment has a data.csv under ``results_dir/<E>/``.

    ``dirs`` overrides the directory per experiment id; ``reference`` maps claim id to the
    measured value of the reference run (shown beside the new value); ``states`` maps an
    experiment id to how its result stands (``current``, ``stale: <why>``, ``old result: its
    re-run failed``), shown in a ``result`` column beside each verdict decided on it. The
    ``why`` column gives each verdict's reason (:attr:`Verdict.reason`; an ERROR's exception).
    Illustrations get the verdict :data:`MODEL` without running anything. Each row records the
    claim's ``definition`` (:func:`definition`: what its verdict decided, checked against
    artifact/claims-ledger.yaml) and, for a paper claim, whose number its threshold is
    (``bar``, :data:`BAR_MODEL` when it is pipecomm's model's).

    Example::

        evaluate(load_claims(), "results/cpu")[["claim", "measured", "verdict"]]
    """
    rows = []
    for entry in entries:
        exp = entry["experiment"]
        d = Path(dirs[exp]) if dirs and exp in dirs else Path(results_dir) / exp
        row = {
            "claim": entry["id"],
            "kind": entry["kind"],
            "experiment": exp,
            "statement": entry["statement"],
            "source": entry.get("source", ""),
            "paper_value": entry.get("paper_value", ""),
            "prediction": entry.get("prediction", ""),
            "network": "",
            "measured": "",
            "threshold": "",
            "verdict": NOT_RUN,
            "why": f"{exp} has no data.csv here",
            "bar": entry.get("bar", "") or "",
            "definition": definition(entry),
        }
        csv = d / "data.csv"
        if entry["kind"] == ILLUSTRATION:
            row.update(verdict=MODEL, why="")
        elif csv.exists():
            try:
                df = load_csv(csv)
                row["prediction"] = predict(entry, df)
                row["network"] = network_kinds(df)
                verdict = run_check(entry, df)
                row.update(measured=verdict.measured, threshold=verdict.threshold,
                           verdict=verdict.verdict, why=verdict.reason)
            except Exception as exc:  # a broken check must show, not vanish
                row.update(check_failed(exc))
        if reference is not None:
            row["reference"] = reference.get(entry["id"], "")
        if states is not None:
            decided = row["verdict"] not in (NOT_RUN, MODEL)
            row["result"] = states.get(exp, "") if decided else ""
        rows.append(row)
    return pd.DataFrame(rows)


class VerdictTable(pd.DataFrame):
    """A table of verdicts that a notebook shows in full: every cell (a prediction, what was
    measured, an ERROR's reason) whole and wrapped, never cut at pandas' column width; the
    text form (``print``, ``repr``) holds every character too.

    Example::

        VerdictTable({"claim": ["C4.2"], "verdict": ["ERROR"], "measured": [long_reason]})
    """

    # JupyterLab right-aligns table cells (.jp-RenderedHTMLCommon td): left, top, wrapped at
    # spaces; the claim id and the verdict (the column before "why") on one line
    _STYLE = ("<style>table.pipecomm-verdicts td, table.pipecomm-verdicts th "
              "{text-align: left !important; vertical-align: top; white-space: pre-wrap; "
              "overflow-wrap: break-word; max-width: 48em} "
              "table.pipecomm-verdicts td:first-child, table.pipecomm-verdicts td:nth-last-child(2) "
              "{white-space: nowrap}</style>")

    @property
    def _constructor(self) -> type[VerdictTable]:
        return VerdictTable

    def _full(self):
        return pd.option_context("display.max_colwidth", None, "display.max_rows", None,
                                 "display.max_columns", None, "display.width", None)

    def _shown(self) -> pd.DataFrame:
        """The table as shown: what cannot decide is said once, in ``why`` (a measured text's
        "-- cannot decide: ..." tail, which a closed gate repeats there, is left out)."""
        out = pd.DataFrame(self).copy()
        if {"measured", "why"} <= set(out.columns):
            said = out["why"].astype(str).str.startswith(("protocol gate closed:",
                                                          "cannot decide:"))
            out.loc[said, "measured"] = out.loc[said, "measured"].astype(str).str.split(
                " -- cannot decide:", n=1).str[0]
        return out

    def _repr_html_(self) -> str:
        with self._full():
            return self._STYLE + self._shown().to_html(
                index=False, classes="pipecomm-verdicts", justify="left", border=0)

    def __repr__(self) -> str:
        with self._full():
            return self._shown().to_string(index=False, justify="left")


def experiment_verdicts(experiment: str, df: pd.DataFrame,
                        entries: list[dict[str, Any]] | None = None) -> VerdictTable:
    """The claims of one experiment (``"E4"``) evaluated on a run's ``df``, as a notebook shows
    them: the model's prediction for the parameters that ran (:func:`predict`), what was
    measured with its interval, the threshold, PASS / FAIL / INCONCLUSIVE and ``why`` (the
    rule that decided or did not: an interval straddling its threshold, a closed gate, too few
    repeats); an illustration shows no verdict; a check whose point is not in this data (for
    example a quick configuration without the claim's world size) shows NOT RUN with its reason,
    a check that breaks ERROR (:func:`check_failed`).
    Every cell is shown in full (:class:`VerdictTable`).

    Example::

        experiment_verdicts("E4", df)[["claim", "measured", "threshold", "verdict"]]
    """
    rows = []
    for entry in load_claims() if entries is None else entries:
        if entry["experiment"] != experiment:
            continue
        row = {"claim": entry["id"], "prediction": entry.get("prediction", "") or "",
               "measured": "", "threshold": "", "verdict": MODEL, "why": ""}
        if entry["kind"] != ILLUSTRATION:
            row["prediction"] = predict(entry, df)
            try:
                v = run_check(entry, df)
                row.update(measured=v.measured, threshold=v.threshold, verdict=v.verdict,
                           why=v.reason)
            except Exception as exc:  # shown, not hidden: the table says why
                row.update(check_failed(exc))
        rows.append(row)
    return VerdictTable(rows, columns=["claim", "prediction", "measured", "threshold", "verdict",
                                       "why"])


def error_reason(exc: BaseException) -> str:
    """The reason of an ERROR verdict: the check could not run on the data, and its exception.

    Example::

        error_reason(ValueError("no real LP at p = 4"))
        # 'the check cannot run on this data: ValueError: no real LP at p = 4'
    """
    return f"the check cannot run on this data: {type(exc).__name__}: {exc}"


def network_kinds(df: pd.DataFrame) -> str:
    """The kinds of network a data.csv was measured on (``"emulated"``, ``"shaped"``,
    ``"real"``, ...; :func:`pipecomm.lab.results.network_kind`), comma-separated: the claims table
    says which network decided each verdict.

    Example::

        network_kinds(pd.DataFrame({"network": ["real", "shaped: Linux tc tbf, ..."]}))
    """
    from pipecomm.lab.results import NETWORK_COLUMN, network_kind

    if NETWORK_COLUMN not in df:
        return ""
    return ", ".join(sorted({network_kind(n) for n in df[NETWORK_COLUMN].dropna()}))


#: The sections of a claims table, in this order: the papers' claims lead.
SECTIONS = ((PAPER, "The papers' claims"), (METHOD, "Method claims (pipecomm's own models, "
            "emulator and targets)"), (ILLUSTRATION, "Model illustrations (no verdict)"))


def to_markdown(table: pd.DataFrame) -> str:
    """Render a claims table as GitHub markdown: the papers' claims first, then the method
    claims, then the model illustrations (by the ``kind`` column, when there is one), and the
    count of each verdict.

    Example::

        print(to_markdown(evaluate(load_claims(), "results/cpu")))
    """
    cols = ["claim", "experiment", "parameters", "statement", "source", "paper_value",
            "prediction",
            "network", "measured", "runs", "reference", "threshold", "verdict", "why", "result"]
    cols = [c for c in cols if c in table.columns]
    if "kind" not in table.columns:
        parts = [_md_rows(table, cols)]
    else:
        parts = []
        for kind, title in SECTIONS:
            sub = table[table["kind"] == kind]
            if len(sub):
                own = [c for c in cols if kind == PAPER or c not in ("source", "paper_value")]
                parts.append(f"## {title}\n\n{_md_rows(sub, own)}")
    papers = paper_line(table)
    return "\n\n".join(parts) + f"\n\n{count_line(table)}\n" + (f"\n{papers}\n" if papers else "")


#: The columns of the terminal's claims table (claims.md holds every column).
TEXT_COLUMNS = ("claim", "experiment", "parameters", "measured", "runs", "threshold", "verdict",
                "why", "result")


def to_text(table: pd.DataFrame) -> str:
    """The claims table as the terminal shows it: plain text, one line per claim (``| C4.1 | E4
    | measured | threshold | verdict | why |``, cells as they are, no markdown escapes or
    rules), under plain section titles (the papers' claims first), and the count line;
    statements and predictions are in claims.md.

    Example::

        print(to_text(evaluate(load_claims(), "results/cpu")))
    """
    cols = [c for c in TEXT_COLUMNS if c in table.columns]
    if "kind" not in table.columns:
        return _text_rows(table, cols) + f"\n\n{count_line(table)}\n"
    parts = [f"{title}:\n{_text_rows(table[table['kind'] == kind], cols)}"
             for kind, title in SECTIONS if (table["kind"] == kind).any()]
    papers = paper_line(table)
    return "\n\n".join(parts) + f"\n\n{count_line(table)}\n" + (f"{papers}\n" if papers else "")


def _text_rows(table: pd.DataFrame, cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |"]
    for _, row in table.iterrows():
        cells = [" ".join(str(row[c]).split()) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _md_rows(table: pd.DataFrame, cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in table.iterrows():
        cells = [str(row[c]).replace("|", "\\|").replace("\n", " ") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def count_line(table: pd.DataFrame) -> str:
    """How many claims got each verdict (UNSTABLE: not decided, like INCONCLUSIVE).

    Example::

        count_line(table)   # '13 PASS, 6 FAIL, 7 INCONCLUSIVE, 1 UNSTABLE, 0 ERROR, ...'
    """
    line = _counts(table)
    if "result" in table.columns:
        old = int((~table["result"].isin(["", "current"])).sum())
        if old:
            line += f" ({old} decided on results that are not current: see the result column)"
    return line


def _counts(table: pd.DataFrame, leave_out: tuple[str, ...] = ()) -> str:
    """``"13 PASS, 6 FAIL, ..."``: every verdict of :data:`VERDICTS` but ``leave_out``, or, for
    a table of other words only (a rehearsal's REHEARSED, NOT DECIDED), those words."""
    counts = table["verdict"].value_counts().to_dict()
    others = [k for k in counts if k not in VERDICTS]
    shown = [k for k in VERDICTS if k not in leave_out] \
        if not others or set(counts) & set(VERDICTS) else []
    return ", ".join([f"{counts.get(k, 0)} {k}" for k in shown] +
                     [f"{counts[k]} {k}" for k in others])


def paper_line(table: pd.DataFrame) -> str:
    """The papers' claims of a claims table counted on their own (method claims and
    illustrations are not the papers'), naming those whose threshold is pipecomm's own model
    (``bar``: a PASS there is against pipecomm's model, not against a number of the paper);
    "" for a table without paper claims.

    Example::

        >>> t = pd.DataFrame({"claim": ["C2.1", "C7.1", "C2.9"], "kind": ["paper", "paper", "method"],
        ...                   "verdict": ["PASS", "UNSTABLE", "PASS"], "bar": ["paper", "model", ""]})
        >>> paper_line(t)
        "papers' claims: 2 coded checks: 1 PASS, 0 FAIL, 0 INCONCLUSIVE, 1 UNSTABLE, 0 ERROR, 0 NOT RUN; threshold from pipecomm's own model (a PASS is against its model, not the paper's number): C7.1 (UNSTABLE)"
    """
    if "kind" not in table.columns or not (table["kind"] == PAPER).any():
        return ""
    sub = table[table["kind"] == PAPER]
    line = (f"papers' claims: {len(sub)} coded check{'s' if len(sub) != 1 else ''}: "
            + _counts(sub, leave_out=(MODEL,)))
    if "bar" in sub.columns:
        model = [f"{r.claim} ({r.verdict})" for r in sub.itertuples() if r.bar == BAR_MODEL]
        if model and sub["verdict"].isin(VERDICTS).any():  # not for a rehearsal's table
            line += ("; threshold from pipecomm's own model (a PASS is against its model, not "
                     "the paper's number): " + ", ".join(model))
    return line


def combine_runs(tables: list[pd.DataFrame]) -> pd.DataFrame:
    """One claims table from the tables of independent runs of the same profile (the first is
    run 1): a ``runs`` column with each run's verdict (``"3/3 PASS"`` when they agree, else
    ``"PASS, FAIL, PASS"``) and the verdict over the runs -- the runs' common verdict, ERROR
    when a run's check broke, UNSTABLE when decided runs disagree -- with its ``why`` (run 1's
    reason when they agree; each run's verdict and reason when they disagree). ``measured`` is run 1's
    when the runs agree and every run's number (``run 2: ...``) when they do not. A run that
    did not run a claim's experiment (NOT RUN) is left out of that claim's verdict.

    Example::

        combine_runs([run1, run2, run3]).loc[:, ["claim", "runs", "verdict"]]
    """
    if not tables:
        raise ValueError("tables is empty: need the claims table of at least one run")
    ids = [list(t["claim"]) for t in tables]
    if any(i != ids[0] for i in ids[1:]):
        raise ValueError("the runs' claims tables list different claims: evaluate every run "
                         "against the same claims.yaml")
    out = tables[0].copy()
    runs_col, verdicts, measured, whys = [], [], [], []
    for k in range(len(out)):
        vs = [str(t["verdict"].iloc[k]) for t in tables]
        ms = [str(t["measured"].iloc[k]) for t in tables]
        ws = [str(t["why"].iloc[k]) if "why" in t.columns else "" for t in tables]
        ran = [i for i, v in enumerate(vs) if v != NOT_RUN]
        if set(vs) == {MODEL}:  # an illustration: nothing was decided in any run
            runs_col.append("")
            verdicts.append(MODEL)
            measured.append(ms[0])
            whys.append(ws[0])
            continue
        if not ran:
            runs_col.append(f"0/{len(vs)} run")
            verdicts.append(NOT_RUN)
            measured.append(ms[0])
            whys.append(ws[0])
            continue
        got = [vs[i] for i in ran]
        skipped = f" ({len(vs) - len(ran)} not run)" if len(ran) < len(vs) else ""
        if len(set(got)) == 1:
            runs_col.append(f"{len(got)}/{len(got)} {got[0]}{skipped}")
            verdicts.append(got[0])
            measured.append(ms[ran[0]])
            whys.append(ws[ran[0]])
        else:
            runs_col.append(", ".join(got) + skipped)
            broke = [i for i in ran if vs[i] == ERROR]
            verdicts.append(ERROR if broke else UNSTABLE)
            measured.append("; ".join(f"run {i + 1} ({vs[i]}): {ms[i]}" for i in ran))
            whys.append(f"run {broke[0] + 1}: {ws[broke[0]]}" if broke else
                        "independent runs disagree: " + "; ".join(
                            f"run {i + 1} {vs[i]}" + (f" ({ws[i]})" if ws[i] else "")
                            for i in ran))
    out["runs"] = runs_col
    out["verdict"] = verdicts
    out["measured"] = measured
    out["why"] = whys
    if all("result" in t.columns for t in tables):
        out["result"] = [_runs_result([str(t["result"].iloc[k]) for t in tables])
                         for k in range(len(out))]
    return out


def _runs_result(states: list[str]) -> str:
    """The ``result`` cell over independent runs: ``current`` when every decided run's result
    is, else the runs whose result is not."""
    odd = [f"run {i + 1}: {s}" for i, s in enumerate(states) if s not in ("", "current")]
    return "; ".join(odd) if odd else ("current" if "current" in states else "")


# --------------------------------------------------------------------------- generic helpers


def require_columns(df: pd.DataFrame, *cols: str) -> None:
    """Raise a clear error when a check's data lacks columns it needs."""
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"data.csv lacks columns {missing}; has {list(df.columns)}")


def model_points(
    samples: list[list[float]],
    models: list[float],
    labels: list[str],
    tolerance: float,
    abs_tolerance_s: float = 0.0,
    may_miss: str | int = "none",
) -> Verdict:
    """The one model-error claim: every point's signed error ``(measured - model) / model``
    (:func:`pipecomm.lab.measure.stats.model_error`) lies within ``tolerance`` (or within
    ``abs_tolerance_s`` seconds, when that is the larger bound for the point), decided on the
    interval of the measured median, except for the :func:`allowance` of ``may_miss`` points.
    Reports the worst error with its interval, the mean signed bias, how many errors share the
    bias' sign, and the count of each point verdict.

    Example::

        model_points([[0.11, 0.12, 0.11, 0.12, 0.11]], [0.1], ["lp 1 MiB"], tolerance=0.25)
    """
    if not (len(samples) == len(models) == len(labels)) or not samples:
        raise ValueError("need one sample, model value and label per point (and >= 1 point)")
    errs, verdicts, spans = [], [], []
    for xs, model in zip(samples, models):
        m, lo, hi = interval(xs)
        tol = max(tolerance, abs_tolerance_s / model)
        e, elo, ehi = (stats.model_error(v, model) for v in (m, lo, hi))
        errs.append(e)
        spans.append((elo, ehi))
        verdicts.append(within(elo, ehi, tol))
    bound = f"|error| <= {tolerance:.0%}"
    if abs_tolerance_s:
        bound += f" or <= {abs_tolerance_s * 1e3:g} ms"
    allowed = allowance(len(verdicts), may_miss)
    where = ("at every point" if not allowed
             else f"at all but {allowed} of {len(verdicts)} points")
    report = error_report(errs, spans, labels, verdicts)
    if allowed:
        report += f"; {missed(verdicts, allowed)}"
    return Verdict(report, f"{bound} {where} (95% interval)", combine(verdicts, allowed))


def error_report(errors: list[float], spans: list[tuple[float, float]], labels: list[str],
                 verdicts: list[str]) -> str:
    """What a many-point error claim measured: the worst signed error with its interval and
    label, the mean signed bias, how many errors share the bias' sign, and the count of each
    point verdict.

    Example::

        error_report([0.05, -0.2], [(0.0, 0.1), (-0.3, -0.1)], ["a", "b"], [PASS, FAIL])
    """
    summ = stats.error_summary(errors)
    i = int(np.argmax(np.abs(errors)))
    counts = ", ".join(f"{verdicts.count(v)} {v}" for v in (PASS, INCONCLUSIVE, FAIL)
                       if verdicts.count(v))
    lo, hi = spans[i]
    return (f"worst {errors[i]:+.1%} [{lo:+.1%}, {hi:+.1%}] ({labels[i]}); bias "
            f"{summ['bias']:+.1%}, {round(summ['same_sign'] * len(errors))}/{len(errors)} same "
            f"sign; points: {counts}")
