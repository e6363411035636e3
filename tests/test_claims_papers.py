"""The papers' 36 claims in categories (pipecomm.lab.paper_claims; artifact/paper-claims.yaml):
every category is computed from verdicts, every paper claim of claims.yaml decides one of them,
and the summary of a run counts the papers' claims only."""

from __future__ import annotations

import pandas as pd
import pytest
import yaml

from pipecomm.lab import claims, paper_claims, schema

ITEMS = paper_claims.load()
ENTRIES = {e["id"]: e for e in claims.load_claims(superseded=True)}


def test_the_list_holds_the_papers_claims_with_one_primary_each():
    assert len(ITEMS) == 36
    assert {p["paper"] for p in ITEMS} == set(paper_claims.PAPERS)
    primaries = {p["paper"]: p["id"] for p in ITEMS if p.get("primary")}
    assert sorted(primaries) == sorted(paper_claims.PAPERS)


def test_every_paper_claim_of_claims_yaml_decides_one_of_the_36():
    deciding = [cid for p in ITEMS for cid in p["claims"]]
    current = [e["id"] for e in claims.load_claims() if e["kind"] == claims.PAPER]
    assert sorted(set(current) - set(deciding)) == []
    assert len(deciding) == len(set(deciding)), "a claim decides two of the papers' claims"
    assert "C2.9" not in deciding and ENTRIES["C2.9"]["kind"] == claims.METHOD
    for p in ITEMS:  # a check of pipecomm's own model is never the paper's comparison
        if any(ENTRIES[c]["kind"] == claims.METHOD for c in p["claims"]):
            assert not p["comparison"].startswith("paper"), p["id"]


def _item(**kw):
    return {"claims": ["C9.1"], "decided_in": ["cpu", "shaped"], "timed": True,
            "comparison": "paper", "regime": "paper", **kw}


def _v(cpu, shaped=None, cid="C9.1"):
    out = {"cpu": {cid: {"verdict": cpu, "runs": ""}}}
    if shaped is not None:
        out["shaped"] = {cid: {"verdict": shaped, "runs": ""}}
    return out


@pytest.mark.parametrize(("item", "verdicts", "category", "why"), [
    (_item(), _v("PASS", "PASS"), paper_claims.REPRODUCED, ""),
    (_item(), _v("PASS"), paper_claims.EMULATOR_ONLY, "emulated network only"),
    (_item(), _v("PASS", "INCONCLUSIVE"), paper_claims.EMULATOR_ONLY, "shaped C9.1 INCONCLUSIVE"),
    (_item(timed=False, decided_in=["cpu"]), _v("PASS"), paper_claims.REPRODUCED, ""),
    (_item(comparison="a proxy"), _v("PASS", "PASS"), paper_claims.WEAK, "a proxy"),
    (_item(comparison="a proxy"), _v("PASS", "UNSTABLE"), paper_claims.WEAK, "not decided on"),
    (_item(regime="not the paper's: 1 MB"), _v("FAIL", "PASS"), paper_claims.CONTRADICTED,
     "FAIL in cpu; the regime tested is not the paper's: 1 MB"),
    (_item(), _v("PASS", "FAIL"), paper_claims.CONTRADICTED, "the regime tested is the paper's"),
    (_item(), _v("UNSTABLE", "PASS"), paper_claims.UNDECIDED, "runs disagree"),
    (_item(), _v("INCONCLUSIVE", "INCONCLUSIVE"), paper_claims.UNDECIDED, "cpu C9.1 INCONCLUSIVE"),
    (_item(), _v("NOT RUN"), paper_claims.NOT_TESTED, "not run in cpu, shaped"),
    (_item(claims=[], why="scale"), {}, paper_claims.NOT_TESTED, "scale"),
    (_item(claims=["C3.2b"]), _v("PASS", cid="C3.2"), paper_claims.NOT_TESTED,
     "C3.2b (a new version, history table) has not run yet"),
])
def test_categories_come_from_the_verdicts(item, verdicts, category, why):
    got = paper_claims.categorize(item, verdicts, ENTRIES)
    assert got["category"] == category and why in got["why"], got


def test_two_deciding_claims_must_both_pass():
    item = _item(claims=["C2.1", "C5.3"])
    both = {p: {"C2.1": {"verdict": "PASS"}, "C5.3": {"verdict": "PASS"}}
            for p in ("cpu", "shaped")}
    assert paper_claims.categorize(item, both, ENTRIES)["category"] == paper_claims.REPRODUCED
    both["shaped"]["C5.3"] = {"verdict": "NOT RUN"}
    assert paper_claims.categorize(item, both, ENTRIES)["category"] == paper_claims.REPRODUCED
    both["cpu"]["C5.3"] = {"verdict": "INCONCLUSIVE"}
    assert paper_claims.categorize(item, both, ENTRIES)["category"] == paper_claims.UNDECIDED


def test_a_deciding_claim_that_has_not_run_yet_is_named():
    """LP-1: C3.1 decided on the emulator, C3.4 (shaped only) stated but not run yet: the
    category is C3.1's until C3.4 runs, and the reason says that C3.4 is to come."""
    item = _item(claims=["C3.1", "C3.4"])
    got = paper_claims.categorize(item, _v("PASS", cid="C3.1"), ENTRIES)
    assert got["category"] == paper_claims.EMULATOR_ONLY
    assert got["why"] == ("decided on the emulated network only; C3.4 has not run yet in shaped: "
                          "its first run is the next reference")
    v = _v("PASS", cid="C3.1")
    v["shaped"] = {"C3.4": {"verdict": "FAIL", "runs": "2/2 FAIL"}}
    assert paper_claims.categorize(item, v, ENTRIES)["category"] == paper_claims.CONTRADICTED


def test_the_reference_table_lists_every_claim_once_with_its_bar():
    rows = paper_claims.table()
    assert [r["id"] for r in rows] == [p["id"] for p in ITEMS]
    assert all(r["category"] in paper_claims.CATEGORIES for r in rows)
    by = {r["id"]: r for r in rows}
    assert by["PS-2"]["bar"] == "C7.1" and "C7.1 (bar: pipecomm's model)" in by["PS-2"]["claims"]
    text = paper_claims.to_markdown(rows)
    assert text.count("\n| ") == 36 and text.endswith(f"{paper_claims.tally(rows)}.")
    assert "(primary)" in text


def test_a_runs_summary_counts_the_papers_claims_only():
    table = pd.DataFrame({"claim": ["C2.9", "C9.1", "C7.1", "C5.4"],
                          "verdict": ["PASS", "PASS", "UNSTABLE", "FAIL"],
                          "runs": ["", "", "PASS, INCONCLUSIVE", ""]})
    text = paper_claims.run_summary(table, "cpu")
    assert "C2.9" not in text
    assert "reproduced on the emulator only (1): DG-1* (C9.1)" in text
    assert "not decidable here (1): PS-2* (C7.1 (bar: pipecomm's model))" in text
    assert "contradicted in the regime tested (1): LP-5* (C5.4)" in text
    assert "not decided by profile cpu (4;" in text and "PS-3 (cpu-full)" in text
    assert "36 claims of the four papers:" in text


def test_the_paper_line_of_a_claims_table_names_the_model_bars(tmp_path):
    table = claims.evaluate(claims.load_claims(), tmp_path)
    line = claims.paper_line(table)
    assert line.startswith(f"papers' claims: {(table.kind == claims.PAPER).sum()} coded checks")
    assert "threshold from pipecomm's own model" in line and "C7.1 (NOT RUN)" in line
    assert "C2.9" not in line and "C5.4" not in line.split("model")[-1]


def _write(tmp_path, items):
    path = tmp_path / "paper-claims.yaml"
    path.write_text(yaml.safe_dump(items, sort_keys=False))
    return path


@pytest.mark.parametrize(("change", "message"), [
    (lambda it: it[5].pop("why"), "claim LP-6: 'why' is required"),
    (lambda it: it[0].update(primary=True), "LP has 2 primary claims"),
    (lambda it: it[1].update(claims=["C3.2"]), "C3.2 is superseded by C3.2b"),
    (lambda it: it[1].update(claims=["C99.1"]), "C99.1 is not in artifact/claims.yaml"),
    (lambda it: it[0].pop("regime"), "claim LP-1: 'regime' is required"),
])
def test_the_list_is_checked(tmp_path, change, message):
    items = yaml.safe_load(paper_claims.PAPER_CLAIMS_FILE.read_text())
    change(items)
    with pytest.raises(schema.ConfigError, match=message):
        paper_claims.load(_write(tmp_path, items))
