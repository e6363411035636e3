"""The papers' 36 claims in categories, computed from the verdicts of the claims that decide them.

``artifact/paper-claims.yaml`` lists every claim the four papers make (:func:`load`), with the
claims of ``artifact/claims.yaml`` that decide each, the profiles whose reference decides it, and
two judgements stated once in that file: whether the check is the paper's own comparison and
whether the regime tested is the paper's. The category is never written there: :func:`categorize`
computes it from the verdicts (:data:`CATEGORIES`):

* **reproduced** -- every deciding verdict PASS, in every run, on the paper's comparison (and, for
  a claim about time, on a real network too);
* **reproduced on the emulator only** -- the same, but a timed claim was decided on the emulated
  network only (the shaped network did not run it or did not decide it);
* **weakly checked** -- it passes, but the check is not the paper's comparison (the file says why);
* **contradicted in the regime tested** -- a deciding verdict is FAIL in every run of a profile;
  the row says whether that regime is the paper's;
* **not decidable here** -- INCONCLUSIVE, or independent runs that disagree (UNSTABLE);
* **not tested** -- no claim decides it (the file says why), or its current version has not run yet.

ARTIFACT.md's first table and docs/papers.md's list (:func:`to_markdown`) use the reference
verdicts (:func:`reference_verdicts`); the summary of ``./run_all.sh`` (:func:`run_summary`) the
run's own. A claim whose threshold is pipecomm's own model says so (its ``bar``).

Example::

    from pipecomm.lab import paper_claims
    rows = paper_claims.table()
    print(paper_claims.tally(rows))   # '36 claims of the four papers: 4 reproduced, ...'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from pipecomm.lab import claims, schema
from pipecomm.lab.results import REPO_ROOT

PAPER_CLAIMS_FILE = REPO_ROOT / "artifact" / "paper-claims.yaml"
REPRODUCED = "reproduced"
EMULATOR_ONLY = "reproduced on the emulator only"
WEAK = "weakly checked"
CONTRADICTED = "contradicted in the regime tested"
UNDECIDED = "not decidable here"
NOT_TESTED = "not tested"
#: The categories, in the order the tables list them.
CATEGORIES = (REPRODUCED, EMULATOR_ONLY, WEAK, CONTRADICTED, UNDECIDED, NOT_TESTED)
#: Profiles whose network is emulated (a timed PASS there alone is "on the emulator only").
EMULATED = ("cpu", "cpu-full")
PAPERS = ("LP", "Pipe-SGD", "LW/DGD", "DAdam")
_NOT_DECIDED = (claims.NOT_RUN, claims.MODEL, "")

Verdicts = dict[str, dict[str, dict[str, str]]]  # profile -> claim id -> verdict, runs, measured


def load(path: str | Path | None = None) -> list[dict[str, Any]]:
    """artifact/paper-claims.yaml, checked against :data:`pipecomm.lab.schema.PAPER_CLAIMS`,
    with unique ids, one primary claim per paper, and every claim id it names in claims.yaml.

    Raises:
        pipecomm.lab.schema.ConfigError: one line naming the file, the paper claim and the key.

    Example::

        [p["id"] for p in load() if p.get("primary")]   # ['LP-5', 'PS-2', 'DG-1', 'DA-5']
    """
    path = PAPER_CLAIMS_FILE if path is None else Path(path)
    items = schema.load(path, schema.PAPER_CLAIMS)
    ids = [p["id"] for p in items]
    if len(set(ids)) != len(ids):
        raise schema.ConfigError(f"{path}: a paper claim id appears twice")
    stated = {e["id"]: e for e in claims.load_claims(superseded=True)}
    for p in items:
        for cid in [*p["claims"], *p["related"]]:
            if cid not in stated:
                raise schema.ConfigError(f"{path}: claim {p['id']}: {cid} is not in "
                                         f"artifact/claims.yaml")
        for cid in p["claims"]:
            if stated[cid].get("superseded_by"):
                raise schema.ConfigError(f"{path}: claim {p['id']}: {cid} is superseded by "
                                         f"{stated[cid]['superseded_by']}: list the current "
                                         f"version in claims, the old one in related")
    for paper in PAPERS:
        primaries = [p["id"] for p in items if p["paper"] == paper and p.get("primary")]
        if len(primaries) != 1:
            raise schema.ConfigError(f"{path}: {paper} has {len(primaries)} primary claims "
                                     f"({primaries}); each paper has one")
    return items


def verdicts_of(table: pd.DataFrame, profile: str) -> Verdicts:
    """A claims table (one profile's, over its runs) as :data:`Verdicts`.

    Example::

        >>> t = pd.DataFrame({"claim": ["C9.1"], "verdict": ["PASS"], "runs": ["3/3 PASS"]})
        >>> verdicts_of(t, "cpu")
        {'cpu': {'C9.1': {'verdict': 'PASS', 'runs': '3/3 PASS', 'measured': ''}}}
    """
    out = {}
    for r in table.fillna("").to_dict("records"):
        out[str(r["claim"])] = {"verdict": str(r["verdict"]), "runs": str(r.get("runs", "")),
                                "measured": str(r.get("measured", ""))}
    return {profile: out}


def reference_verdicts(root: Path | None = None) -> Verdicts:
    """The verdicts of the reference runs (``artifact/reference/<profile>/claims.csv``, the
    table over each profile's independent runs).

    Example::

        reference_verdicts()["cpu"]["C5.4"]["verdict"]   # 'FAIL'
    """
    from pipecomm.lab import ledger

    tables = ledger.reference_tables(root or ledger.REFERENCE)
    out: Verdicts = {}
    for label, table in tables.items():
        if "/" not in label:
            out.update(verdicts_of(table, label))
    return out


def _runs(v: dict[str, str]) -> str:
    return v["runs"] if v.get("runs") else v["verdict"]


def _is_paper(text: str | None) -> bool:
    return str(text or "").startswith("paper")


def categorize(item: dict[str, Any], verdicts: Verdicts,
               entries: dict[str, dict[str, Any]]) -> dict[str, str]:
    """One paper claim's category and why, from the verdicts of its deciding claims in the
    profiles that decide it (``item["decided_in"]``); ``entries`` are claims.yaml's entries
    by id (current and superseded). Returns ``category``, ``why`` (the verdicts behind it and
    the file's judgement that applies) and ``verdicts`` (each profile's, compactly).

    Example::

        >>> item = {"claims": ["C9.1"], "decided_in": ["cpu", "shaped"], "timed": True,
        ...         "comparison": "paper", "regime": "paper"}
        >>> v = {"cpu": {"C9.1": {"verdict": "PASS", "runs": "3/3 PASS"}},
        ...      "shaped": {"C9.1": {"verdict": "PASS", "runs": "2/2 PASS"}}}
        >>> categorize(item, v, {})["category"]
        'reproduced'
        >>> v["shaped"]["C9.1"] = {"verdict": "INCONCLUSIVE", "runs": "2/2 INCONCLUSIVE"}
        >>> categorize(item, v, {})["category"]
        'reproduced on the emulator only'
        >>> v["cpu"]["C9.1"] = {"verdict": "FAIL", "runs": "3/3 FAIL"}
        >>> categorize(item, v, {})["category"]
        'contradicted in the regime tested'
    """
    ids = item["claims"]
    if not ids:
        return {"category": NOT_TESTED, "why": item["why"], "verdicts": ""}
    rows = [(prof, cid, verdicts[prof][cid]) for prof in item["decided_in"] for cid in ids
            if cid in verdicts.get(prof, {})
            and verdicts[prof][cid]["verdict"] not in _NOT_DECIDED]
    shown = "; ".join(f"{prof} {cid} {_runs(v)}" if len(ids) > 1 else f"{prof} {_runs(v)}"
                      for prof, cid, v in rows)
    if not rows:
        stated = [cid for cid in ids if entries.get(cid, {}).get("supersedes")]
        if stated:
            why = (f"{', '.join(stated)} (a new version, history table) has not run yet in "
                   f"{', '.join(item['decided_in'])}: its first run is the next reference")
        else:
            why = f"not run in {', '.join(item['decided_in'])}"
        return {"category": NOT_TESTED, "why": why, "verdicts": ""}
    # a deciding claim that has not run yet (a new claim beside decided ones) is said, and the
    # category is the decided ones' until it runs
    unrun = [cid for cid in ids if all(c != cid for _, c, _ in rows)]
    ids = [cid for cid in ids if cid not in unrun]
    where = [prof for prof in item["decided_in"]
             if any(entries.get(cid, {}).get("profiles") in (None, [])
                    or prof in entries[cid]["profiles"] for cid in unrun)]
    pending = (f"{', '.join(unrun)} has not run yet in {', '.join(where)}: its first run is "
               f"the next reference") if unrun else ""
    c = _categorize_rows(item, ids, rows, shown)
    if pending:
        c["why"] = f"{c['why']}; {pending}" if c["why"] else pending
    return c


def _categorize_rows(item: dict[str, Any], ids: list[str],
                     rows: list[tuple[str, str, dict[str, str]]], shown: str) -> dict[str, str]:
    """:func:`categorize` from the decided verdicts ``rows`` of the claims ``ids``."""
    fails = [(prof, cid, v) for prof, cid, v in rows if v["verdict"] == claims.FAIL]
    if fails:
        where = ", ".join(sorted({prof for prof, _, _ in fails}))
        regime = item["regime"]
        said = ("the regime tested is the paper's" if _is_paper(regime)
                else f"the regime tested is {regime}")
        return {"category": CONTRADICTED, "why": f"FAIL in {where}; {said}", "verdicts": shown}
    passed = {(prof, cid) for prof, cid, v in rows if v["verdict"] == claims.PASS}
    comparison = item["comparison"]
    emulated_pass = all(v["verdict"] == claims.PASS for prof, _, v in rows if prof in EMULATED)
    every_id = all(any((prof, cid) in passed for prof in item["decided_in"]) for cid in ids)
    real = [(prof, cid, v) for prof, cid, v in rows if prof not in EMULATED]
    if every_id and len(passed) == len(rows):
        if not _is_paper(comparison):
            return {"category": WEAK, "why": comparison, "verdicts": shown}
        if item["timed"] and not real:
            return {"category": EMULATOR_ONLY, "why": "decided on the emulated network only",
                    "verdicts": shown}
        return {"category": REPRODUCED, "why": comparison if comparison != "paper" else "",
                "verdicts": shown}
    emulated_ids = all(any((prof, cid) in passed for prof in EMULATED) for cid in ids)
    if emulated_pass and emulated_ids and item["timed"]:
        undecided = "; ".join(f"{prof} {cid} {_runs(v)}" for prof, cid, v in real
                              if v["verdict"] != claims.PASS)
        if not _is_paper(comparison):
            return {"category": WEAK, "why": f"{comparison}; not decided on the real network "
                    f"({undecided})", "verdicts": shown}
        return {"category": EMULATOR_ONLY, "why": f"not decided on the real network "
                f"({undecided})", "verdicts": shown}
    undecided = "; ".join(f"{prof} {cid} {v['verdict']}"
                          + (f" ({v['runs']})" if v["verdict"] == claims.UNSTABLE else "")
                          for prof, cid, v in rows if v["verdict"] != claims.PASS)
    if any(v["verdict"] == claims.UNSTABLE for _, _, v in rows):
        undecided += " -- UNSTABLE: its independent runs disagree"
    return {"category": UNDECIDED, "why": undecided, "verdicts": shown}


def _model_bars(ids: list[str], entries: dict[str, dict[str, Any]]) -> list[str]:
    """The claims among ``ids`` whose threshold is pipecomm's own model."""
    return [cid for cid in ids if entries.get(cid, {}).get("bar") == claims.BAR_MODEL]


def _decided_by(ids: list[str], entries: dict[str, dict[str, Any]]) -> str:
    model = _model_bars(ids, entries)
    return ", ".join(f"{cid} (bar: pipecomm's model)" if cid in model else cid
                     for cid in ids) or "none"


def table(verdicts: Verdicts | None = None,
          items: list[dict[str, Any]] | None = None) -> list[dict[str, str]]:
    """One row per paper claim (in the file's order): id, paper, the paper's claim, what it
    means, the claims that decide it, whose threshold (``bar``: pipecomm's model where it is),
    the verdicts, the category and why. Verdicts default to the references'.

    Example::

        [r["category"] for r in table()][:3]   # ['reproduced on the emulator only', ...]
    """
    items = load() if items is None else items
    verdicts = reference_verdicts() if verdicts is None else verdicts
    entries = {e["id"]: e for e in claims.load_claims(superseded=True)}
    out = []
    for item in items:
        c = categorize(item, verdicts, entries)
        out.append({"id": item["id"], "paper": item["paper"], "claim": item["claim"],
                    "source": item["source"], "meaning": item["meaning"],
                    "claims": _decided_by(item["claims"], entries),
                    "related": ", ".join(item["related"]),
                    "bar": ", ".join(_model_bars(item["claims"], entries)),
                    "primary": "primary" if item.get("primary") else "",
                    "regime": item.get("regime", ""), **c})
    return out


def tally(rows: list[dict[str, str]]) -> str:
    """How many of the papers' claims fall in each category.

    Example::

        >>> tally([{"category": "reproduced"}, {"category": "not tested"}])
        '2 claims of the four papers: 1 reproduced, 0 reproduced on the emulator only, 0 weakly checked, 0 contradicted in the regime tested, 0 not decidable here, 1 not tested'
    """
    counts = {c: sum(r["category"] == c for r in rows) for c in CATEGORIES}
    return (f"{len(rows)} claims of the four papers: "
            + ", ".join(f"{n} {c}" for c, n in counts.items()))


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def to_markdown(rows: list[dict[str, str]], brief: bool = False) -> str:
    """The papers' claims as a markdown table grouped by category (the primary claim of each
    paper marked), then the tally. ``brief`` leaves out the source and the verdicts (the list in
    docs/papers.md).

    Example::

        print(to_markdown(table()))
    """
    cols = ["category", "id", "the paper's claim (source)", "what it means",
            "decided by", "verdicts", "why"]
    if brief:
        cols = ["category", "id", "the paper's claim", "decided by", "why"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for cat in CATEGORIES:
        for r in (r for r in rows if r["category"] == cat):
            ident = r["id"] + (" (primary)" if r["primary"] else "")
            by = r["claims"]
            if brief:
                cells = [cat, ident, r["claim"], by, r["why"]]
            else:
                cells = [cat, ident, f"{r['claim']} ({r['source']})", r["meaning"], by,
                         r["verdicts"] or "-", r["why"]]
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return "\n".join(lines) + f"\n\n{tally(rows)}."


def run_summary(table_: pd.DataFrame, profile: str) -> str:
    """What a run says about the papers' 36 claims: each category with its claims, decided on
    this run's verdicts alone, the claims this profile does not decide (and the profiles that
    do), and the tally; the primary claims and the thresholds that are pipecomm's model are
    named. The summary ``./run_all.sh`` prints after the claims table.

    Example::

        print(run_summary(claims_table, "cpu"))
    """
    items = load()
    mine = verdicts_of(table_, profile)
    entries = {e["id"]: e for e in claims.load_claims(superseded=True)}
    rows, elsewhere = [], []
    for item in items:
        if item["claims"] and profile not in item.get("decided_in", []):
            elsewhere.append(f"{item['id']} ({', '.join(item['decided_in'])})")
            continue
        c = categorize({**item, "decided_in": [profile]} if item["claims"] else item, mine,
                       entries)
        rows.append({"id": item["id"], "primary": item.get("primary", False),
                     "claims": item["claims"], **c})
    lines = [f"the papers' 36 claims on this run (profile {profile}; artifact/paper-claims.yaml; "
             f"the references' in ARTIFACT.md):"]
    for cat in CATEGORIES:
        got = [r for r in rows if r["category"] == cat]
        if not got:
            continue
        if cat == NOT_TESTED:
            names = ", ".join(r["id"] + ("*" if r["primary"] else "") for r in got)
        else:
            names = ", ".join(
                f"{r['id']}{'*' if r['primary'] else ''} ({_decided_by(r['claims'], entries)})"
                for r in got)
        lines.append(f"  {cat} ({len(got)}): {names}")
    if elsewhere:
        lines.append(f"  not decided by profile {profile} ({len(elsewhere)}; the profiles that "
                     f"decide them): {', '.join(elsewhere)}")
    counts = ", ".join(f"{sum(r['category'] == c for r in rows)} {c}" for c in CATEGORIES)
    lines.append(f"  {len(items)} claims of the four papers: {counts}"
                 + (f", {len(elsewhere)} decided by other profiles" if elsewhere else "")
                 + "; * the primary claim of its paper (docs/papers.md, \"Primary claims\")")
    return "\n".join(lines)
