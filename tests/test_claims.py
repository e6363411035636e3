"""Every claim's check must be able to FAIL as well as PASS, and a timed check must say
INCONCLUSIVE when its interval straddles the threshold (a check that cannot fail is a defect).
Synthetic cases live beside each experiment's tests as ``CLAIM_CASES = {check: (make passing
DataFrame, make failing DataFrame[, make inconclusive DataFrame])}`` in tests/test_e*.py; only
the checks in ``EXACT`` (no timed quantity, nothing to be uncertain about) may omit the third."""

import importlib
import math
from pathlib import Path

import pandas as pd
import pytest
import yaml

from pipecomm.lab import claims

HERE = Path(__file__).resolve().parent
EXACT: set[str] = set()


def _cases():
    cases = {}
    for path in sorted(HERE.glob("test_e[0-9]*.py")):
        module = importlib.import_module(path.stem)
        cases.update(getattr(module, "CLAIM_CASES", {}))
    return cases


CASES = _cases()
ENTRIES = claims.load_claims()
CHECKED = [e for e in ENTRIES if e["kind"] != "illustration"]


def test_claims_file_is_valid():
    assert ENTRIES, "artifact/claims.yaml lists no claims"
    assert len({e["id"] for e in ENTRIES}) == len(ENTRIES)
    for e in CHECKED:
        assert e["prediction"].strip() and e["threshold_reason"].strip(), e["id"]


@pytest.mark.parametrize("entry", CHECKED, ids=lambda e: e["id"])
def test_every_claim_can_pass_fail_and_be_undecided(entry):
    assert entry["check"] in CASES, f"no synthetic PASS/FAIL case for check {entry['check']!r}"
    makers = CASES[entry["check"]]
    good = claims.run_check(entry, makers[0]())
    bad = claims.run_check(entry, makers[1]())
    assert good.verdict == claims.PASS, f"{entry['id']} should PASS on its passing case: {good}"
    assert bad.verdict == claims.FAIL, f"{entry['id']} should FAIL on its failing case: {bad}"
    assert good.measured and good.threshold
    if entry["check"] in EXACT:
        return
    assert len(makers) == 3, f"{entry['check']}: no synthetic INCONCLUSIVE case"
    unsure = claims.run_check(entry, makers[2]())
    assert unsure.verdict == claims.INCONCLUSIVE, f"{entry['id']}: {unsure}"
    assert unsure.reason and good.reason and bad.reason, f"{entry['id']}: a verdict without why"


def test_markdown_table_counts_verdicts(tmp_path):
    table = claims.evaluate(ENTRIES, tmp_path)  # nothing has run
    n_model = sum(e["kind"] == "illustration" for e in ENTRIES)
    assert set(table.verdict) <= {claims.NOT_RUN, claims.MODEL}
    text = claims.to_markdown(table)
    assert f"{len(CHECKED)} NOT RUN" in text and f"{n_model} {claims.MODEL}" in text


@pytest.mark.parametrize(
    "fn, lo, hi, t, want",
    [
        (claims.at_most, 0.9, 0.99, 1.0, claims.PASS),
        (claims.at_most, 1.01, 1.2, 1.0, claims.FAIL),
        (claims.at_most, 0.95, 1.05, 1.0, claims.INCONCLUSIVE),
        (claims.at_least, 1.3, 1.6, 1.2, claims.PASS),
        (claims.at_least, 1.0, 1.1, 1.2, claims.FAIL),
        (claims.at_least, 1.1, 1.3, 1.2, claims.INCONCLUSIVE),
        (claims.within, -0.1, 0.2, 0.25, claims.PASS),
        (claims.within, 0.3, 0.4, 0.25, claims.FAIL),
        (claims.within, -0.5, -0.3, 0.25, claims.FAIL),
        (claims.within, 0.2, 0.3, 0.25, claims.INCONCLUSIVE),
    ],
)
def test_interval_decisions(fn, lo, hi, t, want):
    assert fn(lo, hi, t) == want


def test_combine_and_few_repeats():
    assert claims.combine([claims.PASS, claims.PASS]) == claims.PASS
    assert claims.combine([claims.PASS, claims.INCONCLUSIVE]) == claims.INCONCLUSIVE
    assert claims.combine([claims.INCONCLUSIVE, claims.FAIL]) == claims.FAIL
    with pytest.raises(ValueError):
        claims.combine([])
    m, lo, hi = claims.interval([1.0, 1.1, 0.9])  # 3 repeats: too few to decide
    assert m == 1.0 and lo == -math.inf and hi == math.inf
    assert claims.model_points([[1.5] * 3], [1.0], ["x"], 0.1).verdict == claims.INCONCLUSIVE
    assert claims.model_points([[1.5] * 5], [1.0], ["x"], 0.1).verdict == claims.FAIL


def test_model_points_reports_signed_bias():
    v = claims.model_points([[1.2] * 5, [1.1] * 5, [0.95] * 5], [1.0] * 3, ["a", "b", "c"], 0.25)
    assert v.verdict == claims.PASS
    assert "worst +20.0%" in v.measured and "bias +8.3%" in v.measured
    assert "2/3 same sign" in v.measured


def test_verdict_refuses_unknown_outcome():
    with pytest.raises(ValueError, match="verdict"):
        claims.Verdict("1", "<= 2", "MAYBE")
    assert claims.Verdict("1", "<= 2", True).verdict == claims.PASS


def test_thresholds_live_only_in_claims_yaml(tmp_path):
    """A check with a default threshold, or an entry that omits an argument, is refused."""
    @claims.check("test_only_with_default")
    def _with_default(df: pd.DataFrame, tolerance: float = 0.2) -> claims.Verdict:
        return claims.Verdict("", "", True)

    entry = {"id": "X", "kind": "method", "paper": "p", "experiment": "E0", "statement": "s",
             "prediction": "p",
             "threshold_reason": "r", "check": "test_only_with_default",
             "args": {"tolerance": 0.2}}
    path = tmp_path / "claims.yaml"
    path.write_text(yaml.safe_dump([entry]))
    try:
        with pytest.raises(ValueError, match="defaults"):
            claims.load_claims(path)
        good = dict(entry, check="e0_emulated_within", args={"min_bytes": 1})
        path.write_text(yaml.safe_dump([good]))
        with pytest.raises(ValueError, match="args lack"):
            claims.load_claims(path)
    finally:
        del claims.CHECKS["test_only_with_default"]


def test_convergence_gate():
    loss = pd.Series([2.0, 1.5, 1.2, 1.19], index=[25, 50, 75, 100])
    assert claims.tail_gain(loss, 0.25) == pytest.approx(0.81)  # >= 3 intervals: from step 25
    longer = pd.Series([3.0, 2.0, 1.5, 1.2, 1.19, 1.19], index=range(10, 70, 10))
    assert claims.tail_gain(longer, 0.1) == pytest.approx(0.31)  # from step 30 (3 intervals)
    assert claims.tail_gain(longer, 0.7) == pytest.approx(1.81)  # from step 10 (70% of 60)
    assert claims.tail_gain(loss.iloc[:1], 0.25) != claims.tail_gain(loss.iloc[:1], 0.25)  # NaN
    flat = pd.Series([2.0, 1.5, 1.2, 1.195, 1.19, 1.19], index=range(1, 7))
    assert claims.still_improving(flat, 0.1, 0.02) is None
    assert "not converged" in claims.still_improving(loss, 0.1, 0.02)
    acc = pd.Series([40.0, 50.0, 80.0, 90.0], index=[10, 20, 30, 40])
    assert claims.tail_gain(acc, 0.1, higher_is_better=True) == pytest.approx(50.0)
    assert "unknown" in claims.still_improving(acc.iloc[-1:], 0.1, 1.0, higher_is_better=True)
    assert claims.gate(claims.PASS, []) == claims.PASS
    assert claims.gate(claims.FAIL, ["why"]) == claims.INCONCLUSIVE


def test_kind_and_source_are_required(tmp_path):
    """Every entry says its kind; a paper claim says where the paper says it and whose number
    its threshold is (the paper's, pipecomm's model's or the artifact's margin)."""
    base = {"id": "X", "paper": "p", "experiment": "E0", "statement": "s", "prediction": "p",
            "threshold_reason": "r", "check": "e0_emulated_within",
            "args": {"min_bytes": 1, "tolerance": 0.1, "abs_tolerance_s": 0.0,
                     "world_sizes": [2], "may_miss": "none"}}
    path = tmp_path / "claims.yaml"
    for entry, match in ((base, "claim X: 'kind' is required"),
                         (dict(base, kind="claim"), "claim X.kind: 'claim' is not allowed"),
                         (dict(base, kind="paper", bar="paper"), "claim X: 'source' is required"),
                         (dict(base, kind="paper", source="abstract"), "claim X: 'bar' is required"),
                         (dict(base, kind="paper", source="abstract", bar="mine"),
                          "claim X.bar: 'mine' is not allowed")):
        path.write_text(yaml.safe_dump([entry]))
        with pytest.raises(ValueError, match=match):
            claims.load_claims(path)
    path.write_text(yaml.safe_dump([dict(base, kind="paper", source="abstract", bar="model")]))
    assert claims.load_claims(path)[0]["source"] == "abstract"


def test_every_paper_claim_has_a_source():
    papers = [e for e in ENTRIES if e["kind"] == claims.PAPER]
    assert papers and all(e["source"].strip() for e in papers)


@pytest.mark.parametrize(("n", "expected"), [(1, 0), (4, 1), (20, 3), (40, 4)])
def test_binomial_allowance(n, expected):
    """The allowance keeps a claim true at every point from failing by chance more than 5%."""
    from scipy.stats import binom

    m = claims.allowance(n, "binomial")
    assert m == expected
    assert binom.sf(m, n, 0.05) <= 0.05 + 1e-12
    assert m == 0 or binom.sf(m - 1, n, 0.05) > 0.05


def test_combine_with_an_allowance():
    P, F, U = claims.PASS, claims.FAIL, claims.INCONCLUSIVE
    assert claims.combine([P, P, F], may_miss=1) == P
    assert claims.combine([P, F, F], may_miss=1) == F
    assert claims.combine([P, U, F], may_miss=1) == U
    assert claims.combine([P, U], may_miss=0) == U
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="may_miss"):
            claims.combine([P], may_miss=bad)
    with pytest.raises(ValueError, match="may_miss"):
        claims.allowance(3, "holm")
    v = claims.model_points([[1.0] * 5, [2.0] * 5, [1.05] * 5], [1.0] * 3, list("abc"), 0.25,
                            may_miss=1)
    assert v.verdict == P and "1 of 3 points missed (1 may miss)" in v.measured
    assert "all but 1 of 3 points" in v.threshold


def test_combine_runs_marks_disagreement_unstable():
    def table(*verdicts):
        return pd.DataFrame({"claim": ["A", "B", "C", "D"], "measured": [f"{v} x" for v in
                                                                         verdicts],
                             "verdict": list(verdicts)})

    runs = [table("PASS", "PASS", "NOT RUN", "ERROR"), table("PASS", "FAIL", "NOT RUN", "PASS"),
            table("PASS", "PASS", "FAIL", "PASS")]
    out = claims.combine_runs(runs).set_index("claim")
    assert out.loc["A", "runs"] == "3/3 PASS" and out.loc["A", "verdict"] == "PASS"
    assert out.loc["A", "measured"] == "PASS x"
    assert out.loc["B", "runs"] == "PASS, FAIL, PASS" and out.loc["B", "verdict"] == "UNSTABLE"
    assert "run 2 (FAIL): FAIL x" in out.loc["B", "measured"]
    assert out.loc["C", "runs"] == "1/1 FAIL (2 not run)" and out.loc["C", "verdict"] == "FAIL"
    assert out.loc["D", "verdict"] == "ERROR"
    assert "1 UNSTABLE" in claims.count_line(out.reset_index())
    with pytest.raises(ValueError, match="different claims"):
        claims.combine_runs([table("PASS", "PASS", "PASS", "PASS"),
                             table("PASS", "PASS", "PASS", "PASS").iloc[:3]])
    with pytest.raises(ValueError, match="at least one run"):
        claims.combine_runs([])


def test_a_single_point_claim_can_still_fail():
    """One point at 95% may not miss: the allowance never makes a claim unfalsifiable."""
    assert claims.allowance(1, "binomial") == 0
    assert claims.combine([claims.FAIL], claims.allowance(1, "binomial")) == claims.FAIL


def test_an_undecided_interval_says_which_rule_did_not_decide():
    d = claims.at_most(0.8, 1.3, 1.2)
    assert d == claims.INCONCLUSIVE and d.reason == \
        "95% interval [0.8, 1.3] straddles the threshold 1.2"
    assert "below the threshold 1.2" in claims.at_least(1.0, 1.1, 1.2).reason
    assert "outside +-0.25" in claims.within(0.3, 0.4, 0.25).reason
    assert "unbounded: fewer than 5 repeats" in claims.at_least(0.0, math.inf, 1.2).reason
    v = claims.Verdict("x", "t", claims.combine([claims.PASS, claims.at_most(0.8, 1.3, 1.2)]))
    assert v.verdict == "INCONCLUSIVE" and type(v.verdict) is str
    assert v.reason.startswith("1 of 2 points not decided PASS (0 may miss); first undecided: "
                               "95% interval [0.8, 1.3] straddles")
    gated = claims.Verdict("x", "t", claims.gate(claims.PASS, ["sync not converged"]))
    assert gated.reason == "protocol gate closed: sync not converged"


def test_too_few_repeats_say_the_quick_configuration_cannot_decide():
    """The notebooks' quick defaults (iters=2) give unbounded intervals: the reason says so,
    whatever the check's own rule is (run_check counts the points with too few repeats)."""
    entry = next(e for e in CHECKED if e["id"] == "C4.1")
    fast = CASES[entry["check"]][0]()
    fast["times_s"] = [";".join(t.split(";")[:2]) for t in fast["times_s"]]
    v = claims.run_check(entry, fast)
    assert v.verdict == claims.INCONCLUSIVE
    assert v.reason.startswith("fewer than 5 repeats at ") and "quick configuration" in v.reason


def test_every_table_has_a_why_for_unstable_and_error():
    def run(verdicts, whys):
        return pd.DataFrame({"claim": ["A", "B"], "measured": ["m", "m"], "verdict": verdicts,
                             "why": whys})

    out = claims.combine_runs([run([claims.PASS, claims.PASS], ["ok", "ok"]),
                               run([claims.INCONCLUSIVE, claims.ERROR], ["straddles", "boom"])])
    out = out.set_index("claim")
    assert out.loc["A", "why"] == "independent runs disagree: run 1 PASS (ok); run 2 " \
        "INCONCLUSIVE (straddles)"
    assert out.loc["B", "verdict"] == claims.ERROR and out.loc["B", "why"] == "run 2: boom"
    assert "| why |" in claims.to_markdown(out.reset_index()).replace(" why ", " why ")
    # a table written before reasons were recorded (a reference's claims.csv) is explained
    assert claims.explain_row({"verdict": "UNSTABLE", "runs": "PASS, FAIL"}) == \
        "independent runs disagree: PASS, FAIL"
    assert "fewer than 5 repeats" in claims.explain_row(
        {"verdict": "INCONCLUSIVE", "measured": "x 1 [0, inf]", "threshold": "x >= 1"})


def test_the_terminal_table_is_plain_text():
    table = pd.DataFrame({"claim": ["C7.2"], "kind": ["paper"], "experiment": ["E7"],
                          "statement": ["s"], "measured": ["+0.2 [-0.6,\n +1.0]"],
                          "threshold": ["|difference| <= 1 point"], "verdict": ["PASS"],
                          "why": ["inside +-1"]})
    text = claims.to_text(table)
    assert "| C7.2 | E7 | +0.2 [-0.6, +1.0] | |difference| <= 1 point | PASS | inside +-1 |" in text
    assert "\\|" not in text and "|---|" not in text and "## " not in text
    assert text.startswith("The papers' claims:\n")


def test_a_point_the_run_lacks_is_not_run_and_a_broken_check_an_error(monkeypatch, tmp_path):
    """A run whose parameters leave out the claim's point (``-p world_sizes=[2,4]``) reads NOT
    RUN, "not decidable on this data", in both tables; any other exception is a broken check:
    ERROR with the exception."""
    def lacks(df):
        raise claims.NotDecidable("no mst broadcast measured at p=16")

    def broken(df):
        return df["no such column"]

    monkeypatch.setitem(claims.CHECKS, "t_lacks", lacks)
    monkeypatch.setitem(claims.CHECKS, "t_broken", broken)
    entries = [{"id": cid, "kind": "method", "experiment": "E3", "statement": "s", "check": chk}
               for cid, chk in (("C3.8", "t_lacks"), ("C3.9", "t_broken"))]
    (tmp_path / "E3").mkdir()
    pd.DataFrame({"x": [1]}).to_csv(tmp_path / "E3" / "data.csv", index=False)
    for table in (claims.evaluate(entries, tmp_path),
                  claims.experiment_verdicts("E3", pd.DataFrame({"x": [1]}), entries)):
        t = pd.DataFrame(table).set_index("claim")
        assert t.loc["C3.8", "verdict"] == claims.NOT_RUN
        assert t.loc["C3.8", "why"] == "not decidable on this data: no mst broadcast measured " \
                                       "at p=16"
        assert t.loc["C3.9", "verdict"] == claims.ERROR and "KeyError" in t.loc["C3.9", "why"]
