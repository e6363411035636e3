"""E6 Pipe-SGD timing model: predictions, claims' synthetic PASS / FAIL cases, a tiny run."""

import pandas as pd
import pytest
from claimdata import repeats_around

from pipecomm.lab.experiments import e06_pipesgd_timing_model as e6
from pipecomm.lab.measure import stats
from pipecomm.lab.networks import cost
from pipecomm.lab.training import pipesgd_timing_model as timing_model


def _points(errors, spread=0.01):
    """Synthetic point rows: ``errors`` maps (p, mode) to (measured - model) / model."""
    rows = []
    for (p, mode), err in errors.items():
        measured = 0.05 if mode == "sync" else 0.03
        rows.append(
            {
                "kind": "point",
                "world_size": p,
                "mode": mode,
                "bandwidth_Bps": 60e6,
                "batch_size": 64,
                "nbytes": 830_000,
                "compute_s": 0.02,
                "update_s": 0.001,
                "measured_s": measured * (1 + err),
                "times_s": repeats_around(measured * (1 + err), spread),
                "predicted_s": measured,
            }
        )
        rows.append(
            {
                "kind": "calibration",
                "world_size": p,
                "bandwidth_Bps": 60e6,
                "batch_size": 64,
                "nbytes": 830_000,
                "compute_s": 0.02,
                "update_s": 0.001,
            }
        )
    return pd.DataFrame(rows).assign(
        backend="gloo",
        network="emulated",
        alpha_s=1e-3,
        ports="single",
        algorithm="ring",
        gamma_s_per_byte=1e-9,
    )


GOOD = {
    (2, "sync"): 0.05,
    (2, "pipe"): -0.10,
    (4, "sync"): 0.2,
    (4, "pipe"): -0.2,
    (8, "pipe"): 0.9,
}  # p = 8 is outside the claim
BAD = {**GOOD, (4, "pipe"): -0.3, (2, "sync"): 0.26}

UNSURE = {**GOOD, (4, "pipe"): -0.24}
CLAIM_CASES = {"e6_model_within": (lambda: _points(GOOD), lambda: _points(BAD),
                                   lambda: _points(UNSURE, spread=0.1))}


def test_claim_ignores_points_beyond_max_p():
    assert e6.check_model_within(_points(GOOD), 0.25, 4, "none").passed
    assert not e6.check_model_within(_points(GOOD), 0.25, 8, "none").passed
    assert e6.check_model_within(_points(GOOD), 0.25, 8, 1).passed  # p = 8 may miss
    v = e6.check_model_within(_points(BAD), 0.25, 4, "none")
    assert "p=4" in v.measured and "-30.0%" in v.measured
    v2 = e6.check_model_within(_points(BAD), 0.25, 2, "none")  # only the p = 2 points count
    assert not v2.passed and "+26.0%" in v2.measured and "2 FAIL" not in v2.measured


def test_predict_is_the_timing_model():
    link = cost.LinkModel.from_bandwidth(1e-3, 60e6, gamma=1e-9)
    n, c, u = 830_000, 0.02, 0.001
    m = cost.allreduce_time("ring", n, 2, link)
    assert e6.predict("sync", c, u, n, 2, link, "ring") == pytest.approx(c + m + u)
    assert e6.predict("pipe", c, u, n, 2, link, "ring") == pytest.approx(max(c + u, m))
    assert e6.predict("pipe", c, u, n, 4, link, "lp") == pytest.approx(
        timing_model.iteration_time(
            "pipe", compute_s=c, update_s=u, nbytes=n, p=4, link=link, algorithm="lp"
        )
    )


def test_summary_and_plot_from_synthetic_points():
    df = _points(GOOD)
    s = e6.summary(df)
    assert len(s) == 5 and set(s["mode"]) == {"sync", "pipe"}
    fig = e6.plot(df)
    assert len(fig.axes) >= 4


@pytest.mark.parametrize(
    "bad",
    [
        {"pools": [[1, 60e6]]},
        {"pools": [[2]]},
        {"pools": []},
        {"batch_sizes": [0]},
        {"modes": ["async"]},
        {"skip": 50},
        {"algorithm": "torch"},
        {"calib_iters": 0},
        {"runs": 0},
    ],
)
def test_bad_parameters_name_the_parameter(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        e6.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(
    pools=[[2, 1e9]],
    batch_sizes=[8],
    model="mlp",
    model_kw={"hidden": [16]},
    iterations=4,
    skip=1,
    calib_iters=2,
    alpha_s=1e-4,
    timeout_s=120.0,
)
TINY_ENV = {"PIPECOMM_SKIP_HOST_CHECK": "1"}  # fast links: plumbing, not timing


def test_tiny_run(notebook_run):
    df = notebook_run(e6, TINY, TINY_ENV).df
    assert {"backend", "world_size", "network"} <= set(df.columns)
    pts = e6.points(df)
    assert sorted(pts["mode"]) == ["pipe", "sync"]
    # one repeat per independent run (5 by default), interleaved across the modes
    assert (pts["runs"] == 5).all()
    assert [len(stats.repeats(c)) for c in pts["times_s"]] == [5, 5]
    it = df[df["kind"] == "iteration"]
    assert (it.groupby("mode")["run"].nunique() == 5).all()
    assert (pts["measured_s"] > 0).all() and (pts["predicted_s"] > 0).all()
    cal = df[df["kind"] == "calibration"]
    assert len(cal) == 1 and cal["compute_s"].iloc[0] > 0
    # the prediction uses the calibration run, not the measured run
    row = pts[pts["mode"] == "sync"].iloc[0]
    assert row["compute_s"] == cal["compute_s"].iloc[0]
