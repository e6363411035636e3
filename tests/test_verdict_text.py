"""A notebook's verdicts say what ran: each claim's prediction comes from the run's own
parameters (not the profile's configuration that claims.yaml states it for), and the table
shows every verdict with its reason in full (issue 29, item 6)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from pipecomm.lab import claims
from pipecomm.lab.experiments import e04_lp_block_size as e4
from pipecomm.lab.measure import stats

REASON = "the block grid lacks b*/8, b* or 8 b*: use block_range >= 8"


def e4_run(block_range: float, nbytes: int) -> pd.DataFrame:
    """A synthetic E4 data.csv of the notebook's parameters: the model's times as measured."""
    params = dict(e4.DEFAULTS, block_range=block_range, nbytes=nbytes, emu_alpha_s=1e-3)
    plan = e4.plan(**params)
    return plan.assign(
        times_s=[stats.join_repeats([t * (1 + 0.001 * i) for i in range(5)]) for t in plan.model_s],
        time_s=plan.model_s, nbytes=nbytes, world_size=params["world_size"], ports="single",
        emu_alpha_s=params["emu_alpha_s"], emu_bandwidth_Bps=params["emu_bandwidth_Bps"],
        model_gamma_s_per_byte=0.0)


def test_prediction_is_the_runs_not_the_profiles():
    """papermill -p block_range 4 -p nbytes 2097152: the overlapped model's optimum of that run
    (128 KiB at p = 4 without a host cost, what the figure shows), not claims.yaml's 64 KiB of
    the cpu profile."""
    df = e4_run(4.0, 2 << 20)
    table = claims.experiment_verdicts("E4", df)
    row = table.set_index("claim").loc["C4.1"]
    assert "overlapped model optimum 128 KiB (k = 16)" in row.prediction
    assert "64 KiB" not in row.prediction
    assert f"model's {int(df.optimal_block_bytes.iloc[0]) >> 10} KiB" in row.measured
    # C4.2 cannot be decided on this grid: NOT RUN with its reason, and still the run's prediction
    c42 = table.set_index("claim").loc["C4.2"]
    assert c42.verdict == claims.NOT_RUN and "not decidable on this data: " + REASON in c42.why
    assert "optimum 128 KiB" in c42.prediction and "1.43x" not in c42.prediction


def test_profile_configuration_reproduces_claims_yaml():
    """On the cpu profile's parameters (and the reference E0's 124 us per block) the run's
    prediction is claims.yaml's."""
    from pipecomm.lab.networks import cost

    entries = {e["id"]: e for e in claims.load_claims()}
    params = e4.Params.make(**dict(e4.DEFAULTS, world_size=8, nbytes=4 << 20, emu_alpha_s=2e-3,
                                   emu_bandwidth_Bps=50e6))
    df = e4._plan(params, cost.link_from_network(e4.network(params)), 124e-6).assign(
        nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3, emu_bandwidth_Bps=50e6, ports="single",
        model_host_block_s=124e-6)
    c41 = claims.predict(entries["C4.1"], df)
    assert c41.startswith("overlapped model optimum 64 KiB (k = 64)") and "3.5% more" in c41
    assert entries["C4.1"]["prediction"].startswith("overlapped model optimum 64 KiB (k = 64;")
    assert "3.5% more" in entries["C4.1"]["prediction"]
    numbers = "8x smaller 1.43x, 8x larger 1.42x the optimum's time"
    assert numbers in claims.predict(entries["C4.2"], df) and numbers in entries["C4.2"]["prediction"]


def test_a_prediction_that_cannot_be_computed_says_whose_it_is():
    entry = next(e for e in claims.load_claims() if e["id"] == "C4.1")
    text = claims.predict(entry, pd.DataFrame({"op": ["broadcast"]}))
    assert text.startswith("for the profile's configuration: " + entry["prediction"])
    assert "cannot be computed: ValueError" in text
    # a claim without a registered prediction keeps claims.yaml's (configuration-free) text
    c02 = next(e for e in claims.load_claims() if e["id"] == "C0.2")
    assert claims.predict(c02, pd.DataFrame()) == c02["prediction"]


def test_evaluate_shows_the_runs_prediction(tmp_path):
    (tmp_path / "E4").mkdir()
    e4_run(4.0, 2 << 20).to_csv(tmp_path / "E4" / "data.csv", index=False)
    entries = [e for e in claims.load_claims() if e["experiment"] == "E4"]
    table = claims.evaluate(entries, tmp_path).set_index("claim")
    assert "optimum 128 KiB" in table.loc["C4.1", "prediction"]


@pytest.mark.parametrize("render", ["html", "text"])
def test_verdict_table_shows_every_reason_in_full(render):
    long_reason = "ValueError: " + " ".join(f"word{i}" for i in range(80)) + " END"
    table = claims.VerdictTable({"claim": ["C9.9"], "prediction": ["p" * 300],
                                 "measured": [long_reason], "threshold": [""],
                                 "verdict": [claims.ERROR]})
    assert len(long_reason) > pd.get_option("display.max_colwidth")
    out = table._repr_html_() if render == "html" else repr(table)
    assert long_reason in out and "p" * 300 in out and "..." not in out
    assert isinstance(table[["claim", "verdict"]], claims.VerdictTable)  # selections too
    if render == "html":
        assert "white-space: pre-wrap" in out  # wrapped in the notebook, not one long line


REFERENCE = Path(__file__).resolve().parents[1] / "artifact" / "reference" / "cpu"


@pytest.mark.parametrize("entry", [e for e in claims.load_claims()
                                   if e.get("check") in claims.PREDICTIONS],
                         ids=lambda e: e["id"])
def test_every_registered_prediction_runs_on_the_reference_run(entry):
    """On the cpu profile's reference run each registered prediction is computed (not the
    fallback) and names the model -- except for a claim the reference has never run whose
    arms its data predates (C11.2b: E11's overlap ablation), until the next reference."""
    df = pd.read_csv(REFERENCE / entry["experiment"] / "data.csv.gz")
    text = claims.predict(entry, df)
    if text.startswith("for the profile's configuration"):
        table = pd.read_csv(REFERENCE / "claims.csv", dtype=str, keep_default_na=False)
        ran = table[(table.claim == entry["id"]) & ~table.verdict.isin(["", claims.NOT_RUN])]
        if ran.empty:
            pytest.skip(f"{entry['id']} has not run in the cpu reference, whose data predates "
                        f"it: {text}")
    assert "model" in text and not text.startswith("for the profile's configuration")


def test_a_run_without_the_claims_world_size_says_the_prediction_is_the_profiles():
    """C10.2b is stated at p = 8: a quick run at p = 4 shows claims.yaml's text as the
    profile's, with the reason."""
    entry = next(e for e in claims.load_claims() if e["id"] == "C10.2b")
    df = pd.read_csv(REFERENCE / "E10" / "data.csv.gz")
    assert claims.predict(entry, df).startswith("model AER/one-peer-exp at p = 8: ")
    text = claims.predict(entry, df[df.world_size == 4])
    assert text.startswith("for the profile's configuration: ") and \
        "no AER and one-peer-exp" in text


def test_a_closed_gate_is_said_once_in_why():
    """The notebook's verdict table: the gate's reasons in why, not again in measured."""
    table = claims.VerdictTable({
        "claim": ["C7.2"], "prediction": ["p"], "threshold": ["t"], "verdict": ["INCONCLUSIVE"],
        "measured": ["pipe +0.19 [-0.61, +0.98] -- cannot decide: sync: 0 rates swept"],
        "why": ["protocol gate closed: sync: 0 rates swept"]})
    for out in (repr(table), table._repr_html_()):
        assert out.count("0 rates swept") == 1 and "pipe +0.19 [-0.61, +0.98]" in out
    assert "cannot decide" in table.measured.iloc[0]  # the data keeps it
