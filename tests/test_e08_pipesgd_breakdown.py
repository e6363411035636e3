"""E8 Pipe-SGD breakdown: breakdown arithmetic, the overlap bound, claims' synthetic PASS / FAIL
cases, a tiny run with the bandwidth chosen from the model."""

import pandas as pd
import pytest
from test_e07_pipesgd_convergence import fake_training

from pipecomm.lab.experiments import e08_pipesgd_breakdown as e8


def _e8(pipe_ms=23.0, noise=0.02):
    # sync: 40 ms per iteration, half of it blocked on the AllReduce: C = M = 20 ms, bound 25 ms
    ms = {"sync": 40.0, "sync+int8": 35.0, "layerwise": 36.0, "pipe": pipe_ms, "pipe+int8": 22.0}
    return fake_training(
        ms,
        {},
        seeds=(0,),
        comm_frac={"sync": 0.5, "sync+int8": 0.35, "layerwise": 0.4, "pipe": 0.05},
        noise=noise,
        repeats=5,
    )


CLAIM_CASES = {"e8_overlap_bound": (lambda: _e8(), lambda: _e8(pipe_ms=30.0),
                                    lambda: _e8(pipe_ms=25.0, noise=0.15))}


def test_overlap_bound_from_the_sync_run():
    ob = e8.overlap_bound(_e8())
    assert ob["C"] == pytest.approx(0.020, rel=0.05)
    assert ob["M"] == pytest.approx(0.020, rel=0.1)
    assert ob["bound"] == pytest.approx(max(ob["C"], ob["M"]) + 0.25 * min(ob["C"], ob["M"]))
    assert ob["T"] == pytest.approx(0.023, rel=0.05)
    with pytest.raises(ValueError, match="pipe"):
        e8.overlap_bound(_e8()[lambda d: d["method"] != "pipe"])


def test_five_independent_runs_per_method_decide_the_claim():
    df = _e8()
    it = df[df["kind"] == "iteration"]
    assert (it.groupby("method")["run"].nunique() == 5).all()
    v = e8.check_overlap_bound(df, 0.25, "pipe")
    assert v.passed and "(5 runs)" in v.measured
    few = df[~((df["kind"] == "iteration") & (df["run"] >= 4))]  # 4 runs cannot decide
    assert e8.check_overlap_bound(few, 0.25, "pipe").verdict == "INCONCLUSIVE"


def test_summary_is_the_breakdown_table_sync_vs_pipe():
    """The reviewers' table: compute, AllReduce, wait, update per method, from the run."""
    s = e8.summary(_e8()).set_index("method")
    for col in ("compute_ms", "allreduce_ms", "wait_ms", "update_ms", "total_ms", "runs"):
        assert col in s.columns
    # sync blocks on its AllReduce (half of 40 ms), pipe only waits for the one in flight
    assert s.loc["sync", "allreduce_ms"] == pytest.approx(20.0, rel=0.05)
    assert s.loc["sync", "wait_ms"] == 0.0
    assert s.loc["pipe", "allreduce_ms"] == 0.0
    assert s.loc["pipe", "wait_ms"] == pytest.approx(0.05 * 23.0, rel=0.1)
    assert s.loc["pipe", "update_ms"] == pytest.approx(0.8, rel=0.01)
    assert (s["runs"] == 5).all()


def test_breakdown_parts_add_up_and_codec_placement():
    df = _e8()
    # give the compressed runs codec time: inline for sync, on the comm thread for pipe
    df.loc[df["method"] == "sync+int8", "compress_s"] = 0.002
    df.loc[df["method"] == "pipe+int8", "compress_s"] = 0.002
    b = e8.breakdown(df).set_index("method")
    parts = b[list(e8.PARTS)].sum(axis=1)
    assert parts.to_numpy() == pytest.approx(b["total"].to_numpy(), rel=1e-9)
    assert b.loc["sync+int8", "compression"] == pytest.approx(0.002)
    assert b.loc["sync+int8", "compression_background"] == 0.0
    assert b.loc["pipe+int8", "compression"] == 0.0
    assert b.loc["pipe+int8", "compression_background"] == pytest.approx(0.002)
    s = e8.summary(df).set_index("method")
    assert s.loc["pipe", "speedup_vs_sync"] == pytest.approx(40 / 23, rel=0.05)
    assert len(e8.plot(df).axes) == 1


@pytest.mark.parametrize(
    "bad",
    [
        {"methods": ["sync", "layerwise"]},
        {"methods": ["sync", "pipe", "nocomm"]},
        {"methods": ["sync", "pipe", "pipe"]},
        {"skip": 99},
        {"bucket_mb": 0.0},
        {"algorithm": "be"},
        {"world_size": 0},
        {"backend": "mpi"},
        {"runs": 0},
    ],
)
def test_bad_parameters_name_the_parameter(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        e8.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(
    methods=["sync", "pipe", "pipe+fp16"],
    iterations=4,
    skip=1,
    model="mlp",
    model_kw={"hidden": [16]},
    batch_size=8,
    alpha_s=1e-4,
    comm_ratio=4.0,
    calib_iters=2,
    runs=2,
    timeout_s=120.0,
)


def test_tiny_run_bandwidth_from_the_model(notebook_run):
    df = notebook_run(e8, TINY).df
    assert {"backend", "world_size", "network"} <= set(df.columns)
    it = df[df["kind"] == "iteration"]
    assert it.groupby("method")["run"].nunique().to_dict() == {"sync": 2, "pipe": 2,
                                                               "pipe+fp16": 2}
    cal = df[df["kind"] == "calibration"].iloc[0]
    # the bandwidth was chosen so that the modelled AllReduce is comm_ratio x (C + U)
    assert cal["comm_ratio_model"] == pytest.approx(4.0, rel=1e-3)
    assert df["network"].iloc[0].startswith("emulated")
    b = e8.breakdown(df)
    assert list(b["method"]) == ["sync", "pipe", "pipe+fp16"]
    assert (b["total"] > 0).all()
    assert b.set_index("method").loc["pipe+fp16", "compression_background"] > 0
    assert e8.check_overlap_bound(df, tolerance=0.25, method="pipe").measured
    assert isinstance(e8.summary(df), pd.DataFrame)
