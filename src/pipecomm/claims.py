"""Claims: machine-readable statements of the papers, checked against a run's data.csv.

``artifact/claims.yaml`` lists every claim (id, paper, the paper's statement and number where
known, experiment, check name and arguments). A *check* is a function registered here by name
(experiment modules register theirs with :func:`check`) that reads an experiment's tidy DataFrame
and returns a :class:`Verdict`: the measured value, the threshold, PASS or FAIL. A check that
cannot fail is a defect: tests feed every check synthetic data that must make it FAIL and PASS.

Example::

    from pipecomm import claims
    table = claims.evaluate(claims.load_claims(), "results/cpu")
    print(claims.to_markdown(table))
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from pipecomm.results import REPO_ROOT

CLAIMS_FILE = REPO_ROOT / "artifact" / "claims.yaml"
PASS, FAIL, NOT_RUN, ERROR = "PASS", "FAIL", "NOT RUN", "ERROR"


@dataclass(frozen=True)
class Verdict:
    """Outcome of one check: what was measured, against what, and whether it holds."""

    measured: str
    threshold: str
    passed: bool


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


def load_checks() -> dict[str, CheckFn]:
    """Import every experiment module so that all checks are registered."""
    import pipecomm.experiments as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("_"):
            importlib.import_module(f"{pkg.__name__}.{info.name}")
    return CHECKS


def load_claims(path: str | Path = CLAIMS_FILE) -> list[dict[str, Any]]:
    """Read artifact/claims.yaml and validate each entry (ids unique, checks known)."""
    entries = yaml.safe_load(Path(path).read_text()) or []
    checks = load_checks()
    required = {"id", "paper", "experiment", "statement", "check"}
    seen = set()
    for entry in entries:
        missing = required - set(entry)
        if missing:
            raise ValueError(f"claim {entry.get('id', '?')} in {path} lacks {sorted(missing)}")
        if entry["id"] in seen:
            raise ValueError(f"claim id {entry['id']} appears twice in {path}")
        seen.add(entry["id"])
        if entry["check"] not in checks:
            raise ValueError(f"claim {entry['id']}: unknown check {entry['check']!r}")
        entry.setdefault("args", {})
        entry.setdefault("paper_value", "")
    return entries


def run_check(entry: dict[str, Any], df: pd.DataFrame) -> Verdict:
    """Apply one claim's check to a DataFrame."""
    return CHECKS[entry["check"]](df, **entry.get("args", {}))


def evaluate(
    entries: list[dict[str, Any]],
    results_dir: str | Path,
    dirs: dict[str, Path] | None = None,
    reference: dict[str, str] | None = None,
) -> pd.DataFrame:
    """Evaluate every claim whose experiment has a data.csv under ``results_dir/<E>/``.

    ``dirs`` overrides the directory per experiment id; ``reference`` maps claim id to the
    measured value of the reference run (shown beside the new value).
    """
    rows = []
    for entry in entries:
        exp = entry["experiment"]
        d = Path(dirs[exp]) if dirs and exp in dirs else Path(results_dir) / exp
        row = {
            "claim": entry["id"],
            "experiment": exp,
            "statement": entry["statement"],
            "paper_value": entry.get("paper_value", ""),
            "measured": "",
            "threshold": "",
            "verdict": NOT_RUN,
        }
        csv = d / "data.csv"
        if csv.exists():
            try:
                verdict = run_check(entry, pd.read_csv(csv))
                row.update(measured=verdict.measured, threshold=verdict.threshold,
                           verdict=PASS if verdict.passed else FAIL)
            except Exception as exc:  # a broken check must show, not vanish
                row.update(measured=f"{type(exc).__name__}: {exc}", verdict=ERROR)
        if reference is not None:
            row["reference"] = reference.get(entry["id"], "")
        rows.append(row)
    return pd.DataFrame(rows)


def to_markdown(table: pd.DataFrame) -> str:
    """Render a claims table as GitHub markdown."""
    cols = ["claim", "experiment", "statement", "paper_value", "measured"]
    if "reference" in table.columns:
        cols.append("reference")
    cols += ["threshold", "verdict"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, row in table.iterrows():
        cells = [str(row[c]).replace("|", "\\|").replace("\n", " ") for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    counts = table["verdict"].value_counts().to_dict()
    summary = ", ".join(f"{counts.get(k, 0)} {k}" for k in (PASS, FAIL, ERROR, NOT_RUN))
    return "\n".join(lines) + f"\n\n{summary}\n"


# --------------------------------------------------------------------------- generic helpers


def fmt(x: float, unit: str = "") -> str:
    """Compact number formatting for verdict cells."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "nan"
    return f"{x:.3g}{unit}"


def require_columns(df: pd.DataFrame, *cols: str) -> None:
    """Raise a clear error when a check's data lacks columns it needs."""
    missing = [c for c in cols if c not in df.columns]
    if missing:
        raise ValueError(f"data.csv lacks columns {missing}; has {list(df.columns)}")
