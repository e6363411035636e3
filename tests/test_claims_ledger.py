"""The pre-registration ledger: a claim's definition (protocol, regime, threshold, gates) does not
change after a run without a new version, and each version was committed before the run that
decided it (pipecomm.lab.ledger; artifact/claims-ledger.yaml; docs/experiments.md, "Versions")."""

from __future__ import annotations

import copy

import pytest
import yaml

from pipecomm.lab import claims, ledger, schema


@pytest.fixture(scope="module")
def state():
    entries = claims.load_claims(superseded=True)
    return {"entries": entries, "ledger": ledger.load_ledger(),
            "tables": ledger.reference_tables(), "regimes": ledger.regimes(entries)}


def _problems(state, git=False, **changes):
    """problems() on the repository's state with some parts replaced (deep copies)."""
    parts = {k: copy.deepcopy(v) for k, v in state.items()}
    parts.update(changes)
    return ledger.problems(parts["entries"], parts["ledger"], parts["tables"], parts["regimes"],
                           git=git)


def _entry(entries, cid):
    return next(e for e in entries if e["id"] == cid)


def test_claims_yaml_the_ledger_and_the_references_agree(state):
    """The repository's own state, with git where there is one: every definition as recorded
    beside its reference verdicts, every version stated before the run that decided it."""
    found = ledger.problems(state["entries"], state["ledger"], state["tables"],
                            state["regimes"])
    assert not found, "\n".join(found)


def test_a_definition_changed_after_a_run_is_refused_naming_the_claim(state):
    entries = copy.deepcopy(state["entries"])
    e = _entry(entries, "C5.4")
    e["args"] = {**e["args"], "min_ratio": 0.9}   # a threshold moved after the cpu reference ran
    found = _problems(state, entries=entries)
    assert any(p.startswith("C5.4: its definition changed after a run (cpu, shaped)")
               for p in found), found
    assert any(p.startswith("C5.4: the cpu reference decided definition") for p in found), found
    assert all("\n" not in p for p in found)


def test_a_reworded_statement_or_prediction(state):
    """Folding the statement's whitespace is no change; rewording it is; the prediction and the
    threshold's reason are not part of the definition."""
    entries = copy.deepcopy(state["entries"])
    e = _entry(entries, "C9.1")
    e["statement"] = "  " + e["statement"].replace(" ", "  ") + "\n"
    e["prediction"] = "another text"
    e["threshold_reason"] = "another reason"
    assert _problems(state, entries=entries) == []
    e["statement"] += " (reworded)"
    assert any(p.startswith("C9.1: its definition changed after a run") for p in
               _problems(state, entries=entries))


def test_a_definition_changed_before_its_first_run_is_restated(state):
    entries, book = copy.deepcopy(state["entries"]), copy.deepcopy(state["ledger"])
    new = {**_entry(entries, "C15.3"), "id": "C15.99", "args": {}}   # no reference holds it
    entries.append(new)
    book["C15.99"] = {**book["C15.3"], "definition": "0" * 16, "commit": None}
    regimes = {**state["regimes"], "C15.99": state["regimes"]["C15.3"]}
    found = _problems(state, entries=entries, ledger=book, regimes=regimes)
    assert found == ["C15.99: its definition changed since it was stated, before any run: record "
                     "it again with tools/claims_ledger.py update"]
    del book["C15.99"]
    found = _problems(state, entries=entries, ledger=book, regimes=regimes)
    assert found and found[0].startswith("C15.99: no record in artifact/claims-ledger.yaml")


def test_a_regime_or_kind_change_needs_an_amendment(state):
    regimes = copy.deepcopy(state["regimes"])
    regimes["C5.4"]["cpu"] = "f" * 16   # E5's parameters in the cpu profile moved
    found = _problems(state, regimes=regimes)
    assert found == ["C5.4: E5's parameters in profile cpu changed since it was stated: state a "
                     "new version, or record why the regime is the same with "
                     "tools/claims_ledger.py amend C5.4 --reason TEXT"]
    entries = copy.deepcopy(state["entries"])
    _entry(entries, "C12.1")["kind"] = "method"
    found = _problems(state, entries=entries)
    assert len(found) == 1 and found[0].startswith("C12.1: kind method in claims.yaml, paper in")


def test_a_superseded_version_keeps_its_verdicts(state):
    entries, book = copy.deepcopy(state["entries"]), copy.deepcopy(state["ledger"])
    old = _entry(entries, "C5.3")
    if old.get("superseded_by"):
        pytest.skip("C5.3 is superseded already")
    new = {**old, "id": "C5.3b", "supersedes": "C5.3", "change": "a test"}
    old["superseded_by"] = "C5.3b"
    entries.append(new)
    book["C5.3b"] = {**book["C5.3"]}
    regimes = {**state["regimes"], "C5.3b": state["regimes"]["C5.3"]}
    found = _problems(state, entries=entries, ledger=book, regimes=regimes)
    assert any(p.startswith("C5.3: superseded by C5.3b, but its cpu verdict is not frozen")
               for p in found), found
    book["C5.3"]["verdicts"] = {"cpu": {"verdict": "FAIL"}, "shaped": {"verdict": "PASS"}}
    found = _problems(state, entries=entries, ledger=book, regimes=regimes)
    assert "C5.3: the ledger's frozen cpu verdict FAIL is not the reference's PASS" in found


def test_a_reference_without_definitions_or_a_deleted_claim(state):
    tables = copy.deepcopy(state["tables"])
    tables["cpu"] = tables["cpu"].drop(columns="definition")
    found = _problems(state, tables=tables)
    assert found == ["artifact/reference/cpu/claims.csv has no definition column: "
                     "tools/claims_ledger.py backfill"]
    entries = [e for e in state["entries"] if e["id"] != "C15.5"]
    found = _problems(state, entries=entries)
    assert found == ["C15.5: in the ledger but not in claims.yaml: a version is superseded "
                     "(superseded_by), never deleted"]


def test_every_claims_table_records_each_verdicts_definition(tmp_path):
    table = claims.evaluate(claims.load_claims(), tmp_path)
    assert list(table["definition"]) == [claims.definition(e) for e in claims.load_claims()]
    paper = table[table["kind"] == claims.PAPER]
    assert set(paper["bar"]) <= set(schema.BARS) and "" not in set(paper["bar"])


def _write(tmp_path, entries):
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump(entries, sort_keys=False))
    return path


@pytest.mark.parametrize(("change", "message"), [
    ({"new": {"supersedes": "C9.1"}}, "claim C9.1b: supersedes 'C9.1', whose entry must stay"),
    ({"old": {"superseded_by": "C9.1b"}, "new": {"supersedes": "C9.1", "id": "C9.1c"}},
     "superseded_by 'C9.1b', which must state supersedes"),
    ({"old": {"superseded_by": "C9.1c"}, "new": {"supersedes": "C9.1", "id": "C9.1c"}},
     "claim C9.1c: a new version of C9.1 is C9.1b"),
    ({"new": {}}, "claim C9.1b: version b needs supersedes"),
    ({"old": {"superseded_by": "C9.1b"}, "new": {"supersedes": "C9.1", "change": None}},
     "claim C9.1b: 'change' is required"),
])
def test_versions_name_each_other(tmp_path, change, message):
    entries = [dict(e) for e in yaml.safe_load(claims.CLAIMS_FILE.read_text())]
    old = next(e for e in entries if e["id"] == "C9.1")
    new = {**old, "id": "C9.1b", "change": "a test of the versions"}
    old.update(change.get("old", {}))
    new.update(change.get("new", {}))
    new = {k: v for k, v in new.items() if v is not None}
    entries.append(new)
    with pytest.raises(schema.ConfigError, match=message):
        claims.load_claims(_write(tmp_path, entries))


def test_a_superseded_version_is_not_evaluated(tmp_path):
    entries = [dict(e) for e in yaml.safe_load(claims.CLAIMS_FILE.read_text())]
    old = next(e for e in entries if e["id"] == "C9.1")
    entries.append({**old, "id": "C9.1b", "supersedes": "C9.1", "change": "a test",
                    "superseded_by": None})
    entries[-1].pop("superseded_by")
    old["superseded_by"] = "C9.1b"
    old["check"] = "a_check_since_removed"   # never run again: it may be gone
    path = _write(tmp_path, entries)
    ids = [e["id"] for e in claims.load_claims(path)]
    assert "C9.1b" in ids and "C9.1" not in ids
    assert "C9.1" in [e["id"] for e in claims.load_claims(path, superseded=True)]


def test_amend_needs_a_reason_and_a_change(tmp_path):
    path = tmp_path / "ledger.yaml"
    ledger.write_ledger(ledger.load_ledger(), path)
    with pytest.raises(ValueError, match="needs its reason"):
        ledger.amend("C5.4", "  ", path=path)
    with pytest.raises(ValueError, match="C5.4: its kind and regime are as recorded"):
        ledger.amend("C5.4", "nothing moved", path=path)
    book = ledger.load_ledger(path)
    book["C5.4"]["kind"] = "method"
    book["C5.4"]["regime"]["cpu"] = "0" * 16
    book["C5.4"]["regime"]["gpu"] = "0" * 16  # stated for a profile it is no longer run in
    ledger.write_ledger(book, path)
    amended = ledger.amend("C5.4", "a test", today="2026-12-02", path=path)["C5.4"]
    assert amended["kind"] == "paper" and "gpu" not in amended["regime"]
    assert amended["amendments"][-1] == {
        "date": "2026-12-02", "reason": "a test",
        "changed": "kind method -> paper; regime in cpu; no longer evaluated in gpu"}


def test_backfill_reads_the_definitions_of_the_commit_that_wrote_a_table():
    if not ledger.has_git():
        pytest.skip("not a git checkout")
    tables = ledger.reference_tables()
    for label, table in tables.items():
        assert "definition" in table.columns, label
    cpu = tables["cpu"].set_index("claim")
    assert cpu.loc["C5.4", "definition"] == claims.definition(
        _entry(claims.load_claims(superseded=True), "C5.4"))
