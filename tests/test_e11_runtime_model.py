"""E11 (runtime model vs measurement): the timing workload, calibration summary, prediction,
sweep cases, claims, one tiny run."""

import time

import numpy as np
import pandas as pd
import pytest
import torch
from claimdata import repeats_around

from pipecomm import netem
from pipecomm.decentralized import runtime_model
from pipecomm.lab.calibration import summarize_buckets
from pipecomm.lab.dadam_timing import _factors, method_name, predict_training
from pipecomm.lab.experiments import e11_runtime_model as e11
from pipecomm.lab.network import DEFAULT_NETWORK, link_models, make_network
from pipecomm.lab.workloads import (
    EmulatedCompute,
    bucket_bytes_forward,
    bucket_layout,
    build_timing_net,
    timing_bucket_mb,
    timing_spec,
)


def _rows(error=0.1, spread=0.01):
    rows = []
    for factor, scale in (("base", 1.0), ("overlap", 0.5), ("overlap", 2.0)):
        for kind, ms in (("allreduce", 150.0), ("decentralized", 70.0)):
            rows.append(
                {
                    "factor": factor,
                    "network_name": "two-level",
                    "compute_scale": scale,
                    "compute_cv": 0.0,
                    "kind": kind,
                    "method": method_name(kind, "alternating-exp-ring"),
                    "measured_s": ms * (1 + error) / 1e3,
                    "times_s": repeats_around(ms * (1 + error) / 1e3, spread),
                    "predicted_s": ms / 1e3,
                    "calibrated_compute_s": 0.06,
                    "world_size": 8,
                    "ranks_per_node": 2,
                    "algorithm": "ring",
                    "backend": "gloo",
                    "network": "emulated",
                }
            )
    return pd.DataFrame(rows)


CLAIM_CASES = {
    "e11_prediction_within": (lambda: _rows(0.1), lambda: _rows(-0.3),
                              lambda: _rows(0.19, spread=0.1)),
}


def test_cases_change_one_factor_at_a_time():
    cs = e11.cases(
        {
            "compute_scales": [0.5, 1.0, 2.0],
            "compute_cvs": [0.0, 0.5],
            "networks": ["two-level", "flat"],
        }
    )
    assert [c["factor"] for c in cs] == ["base", "overlap", "overlap", "varying compute", "links"]
    base = cs[0]
    for c in cs[1:]:
        changed = [k for k in ("compute_scale", "compute_cv", "net") if c[k] != base[k]]
        assert len(changed) == 1, c


def test_emulated_compute_sleeps_in_forward_and_backward():
    layer = EmulatedCompute(0.02, 0.04)
    x = torch.ones(3, requires_grad=True)
    t0 = time.perf_counter()
    y = layer(x)
    t1 = time.perf_counter()
    y.sum().backward()
    t2 = time.perf_counter()
    assert t1 - t0 >= 0.02 and t2 - t1 >= 0.04
    assert torch.equal(x.grad, torch.ones(3))
    layer.factor = 0.0
    t0 = time.perf_counter()
    layer(x).sum().backward()
    assert time.perf_counter() - t0 < 0.02
    with pytest.raises(ValueError):
        EmulatedCompute(-1.0, 0.0)


def test_timing_net_has_one_bucket_per_layer():
    spec = timing_spec(2, width=64, layers=3)
    net = build_timing_net(spec)
    params = list(net.parameters())
    assert bucket_layout(params, timing_bucket_mb(spec)) == [[2], [1], [0]]
    assert bucket_bytes_forward(params, timing_bucket_mb(spec)) == [64 * 64 * 4] * 3
    with pytest.raises(ValueError, match="unknown timing"):
        timing_spec(2, widht=3)


def test_bucket_layout_follows_decentralized_data_parallel():
    ps = [torch.zeros(1), torch.zeros(2), torch.zeros(1 << 18), torch.zeros(1 << 18)]
    assert bucket_layout(ps, 1.0) == [[3], [2], [1, 0]]  # closes once it reaches 1 MiB
    assert bucket_layout(ps, 100.0) == [[3, 2, 1, 0]]
    with pytest.raises(ValueError):
        bucket_layout(ps, 0.0)


def test_summarize_calibration_means_over_ranks():
    per_rank = [
        {"fwd_s": [1.0, 2.0], "bwd_s": [3.0, 4.0], "step_s": [0.5, 0.5], "bucket_bytes": [8, 8]},
        {"fwd_s": [3.0, 2.0], "bwd_s": [5.0, 4.0], "step_s": [0.5, 0.5], "bucket_bytes": [8, 8]},
    ]
    c = summarize_buckets(per_rank)
    assert c["fwd_s"] == [2.0, 2.0] and c["bwd_s"] == [4.0, 4.0]
    assert c["compute_s"] == pytest.approx(2 + 2 + 4 + 4 + 1)
    with pytest.raises(ValueError):
        summarize_buckets([])


def test_prediction_without_communication_cost_is_the_compute_time():
    """Closed-form limit: free links -> both schedules take forward + backward + updates."""
    net = netem.Network(0.0, float("inf"), inter_alpha_s=0.0, inter_bandwidth_Bps=float("inf"))
    calib = {
        "bucket_bytes": [0, 0],
        "fwd_s": [0.01, 0.01],
        "bwd_s": [0.02, 0.02],
        "step_s": [0.001, 0.001],
    }
    for kind in ("allreduce", "decentralized"):
        spec = timing_spec(4, kind=kind)
        assert predict_training(spec, calib, net)["iteration_s"] == pytest.approx(0.062)


def test_prediction_uses_the_injected_factors_and_the_block_median():
    net = make_network(DEFAULT_NETWORK)
    calib = {
        "bucket_bytes": [1 << 20, 1 << 20],
        "fwd_s": [0.01, 0.01],
        "bwd_s": [0.02, 0.02],
        "step_s": [0.001, 0.001],
    }
    spec = timing_spec(8, kind="allreduce", compute_cv=0.5, blocks=3, block_iters=4)
    pred = predict_training(spec, calib, net)
    intra, inter = link_models(net)
    r = runtime_model.simulate(
        "allreduce",
        bucket_bytes=calib["bucket_bytes"],
        fwd_s=0.01,
        bwd_s=0.02,
        step_s=0.001,
        p=8,
        ranks_per_node=2,
        intra=intra,
        inter=inter,
        compute_cv=0.5,
        iterations=3 + 12,
        seed=0,
        warmup=3,
    )
    blocks = np.asarray(r["iteration_s"]).reshape(3, 4).sum(axis=1)
    assert pred["iteration_s"] == pytest.approx(np.median(blocks) / 4)
    factors = _factors(spec, 15)
    assert factors.shape == (15, 8)
    assert np.array_equal(
        factors, runtime_model.lognormal_factors(0.5, (15, 8), np.random.default_rng(0))
    )


def test_claim_names_the_worst_case():
    df = _rows(0.1)
    df.loc[3, "predicted_s"] = df.loc[3, "measured_s"] * 2  # measured half the model
    v = e11.check_prediction_within(df, tolerance=0.2)
    assert v.verdict == "FAIL" and "worst -50.0%" in v.measured and "5 PASS, 1 FAIL" in v.measured


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"world_size": 3}, "world_size"),
        ({"compute_scales": []}, "compute_scales"),
        ({"compute_cvs": [-0.1]}, "compute_cvs"),
        ({"networks": ["infiniband"]}, "networks"),
        ({"algorithm": "torch"}, "algorithm"),
        ({"blocks": 0}, "blocks"),
        ({"fwd_ms": -1.0}, "fwd_ms"),
    ],
)
def test_bad_parameters_name_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        e11.run(**bad)


@pytest.mark.timeout(240)
def test_tiny_end_to_end_run():
    df = e11.run(
        world_size=2,
        ranks_per_node=1,
        compute_scales=[1.0],
        compute_cvs=[0.5],
        networks=["two-level"],
        width=64,
        layers=2,
        fwd_ms=2.0,
        bwd_ms=4.0,
        warmup=1,
        blocks=1,
        block_iters=2,
        calib_iters=2,
    )
    assert {"backend", "world_size", "network"} <= set(df.columns)
    assert list(df.factor) == ["base", "base", "varying compute", "varying compute"]
    assert set(df.kind) == {"allreduce", "decentralized"}
    assert (df.measured_s > 0.012).all()  # at least the emulated compute of 2 x (2 + 4) ms
    assert (df.predicted_s > 0.012).all()
    assert len(e11.summary(df)) == 4
    e11.plot(df)
