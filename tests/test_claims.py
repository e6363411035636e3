"""Every claim's check must be able to FAIL as well as PASS (a check that cannot fail is a
defect). Synthetic cases live beside each experiment's tests as ``CLAIM_CASES = {check: (make
passing DataFrame, make failing DataFrame, args)}`` in tests/test_e*.py; this module collects them."""

import importlib
from pathlib import Path

import pytest

from pipecomm import claims

HERE = Path(__file__).resolve().parent


def _cases():
    cases = {}
    for path in sorted(HERE.glob("test_e[0-9]*.py")):
        module = importlib.import_module(path.stem)
        cases.update(getattr(module, "CLAIM_CASES", {}))
    return cases


CASES = _cases()
ENTRIES = claims.load_claims()


def test_claims_file_is_valid():
    assert ENTRIES, "artifact/claims.yaml lists no claims"
    assert len({e["id"] for e in ENTRIES}) == len(ENTRIES)


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda e: e["id"])
def test_every_claim_can_pass_and_fail(entry):
    assert entry["check"] in CASES, f"no synthetic PASS/FAIL case for check {entry['check']!r}"
    make_pass, make_fail = CASES[entry["check"]]
    good = claims.run_check(entry, make_pass())
    bad = claims.run_check(entry, make_fail())
    assert good.passed, f"{entry['id']} should PASS on its passing case: {good}"
    assert not bad.passed, f"{entry['id']} should FAIL on its failing case: {bad}"
    assert good.measured and good.threshold


def test_markdown_table_counts_verdicts(tmp_path):
    table = claims.evaluate(ENTRIES, tmp_path)  # nothing has run
    assert set(table.verdict) == {claims.NOT_RUN}
    text = claims.to_markdown(table)
    assert f"{len(ENTRIES)} NOT RUN" in text
