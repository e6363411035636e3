"""E11 (runtime model vs measurement): the timing workload, calibration summary, prediction,
sweep cases, claims, one tiny run."""

import time

import numpy as np
import pandas as pd
import pytest
import torch
from claimdata import repeats_around

from pipecomm.lab import claims
from pipecomm.lab.experiments import e11_runtime_model as e11
from pipecomm.lab.measure.calibration import summarize_buckets
from pipecomm.lab.networks import netem
from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, link_models, make_network
from pipecomm.lab.training import dadam_runtime_model as runtime_model
from pipecomm.lab.training.dadam_timing import (
    OverlappedRing,
    _factors,
    method_name,
    predict_training,
)
from pipecomm.lab.workloads.tasks import (
    EmulatedCompute,
    bucket_bytes_forward,
    bucket_layout,
    build_timing_net,
    timing_bucket_mb,
    timing_spec,
)


def _rows(error=0.1, spread=0.01, runs=5):
    """One row per configuration, method and run: run r's time scaled by 1 + spread (r - 2)."""
    rows = []
    for factor, scale in (("base", 1.0), ("overlap", 0.5), ("overlap", 2.0)):
        for kind, ms in (("allreduce", 150.0), ("decentralized", 70.0)):
            for r in range(runs):
                t = ms * (1 + error) * (1 + spread * (r - (runs - 1) / 2)) / 1e3
                rows.append(
                    {
                        "factor": factor,
                        "network_name": "two-level",
                        "compute_scale": scale,
                        "compute_cv": 0.0,
                        "kind": kind,
                        "method": method_name(kind, "alternating-exp-ring"),
                        "run": r,
                        "measured_s": t,
                        "times_s": repeats_around(t, 0.001, 2),
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


#: the configurations of C11.2-C11.4 (artifact/claims.yaml): (network, compute x, cv)
SWEEP = [("two-level", 1.0, 0.0), ("two-level", 0.5, 0.0), ("two-level", 2.0, 0.0),
         ("two-level", 1.0, 0.5), ("flat", 1.0, 0.0)]


def _speedups(grow=1.5, spread=0.01, runs=5):
    """Every configuration of the three sweeps, DAdam's speed-up over AllReduce chosen so that
    each claim's 'when' configuration has ``grow`` times the speed-up of its 'against' one
    (x0.5 over x2, two-level over flat, cv 0.5 over cv 0); AllReduce's runs spread by
    ``spread``, so the per-run speed-ups differ."""
    speed = {("two-level", 0.5, 0.0): 2 * grow, ("two-level", 2.0, 0.0): 2.0,
             ("two-level", 1.0, 0.0): 2 * grow, ("flat", 1.0, 0.0): 2.0,
             ("two-level", 1.0, 0.5): 2 * grow * grow}
    rows = []
    for net, scale, cv in SWEEP:
        for kind in ("allreduce", "decentralized"):
            for r in range(runs):
                noise = 1 + spread * (r - (runs - 1) / 2)
                t = 0.07 * speed[(net, scale, cv)] * noise if kind == "allreduce" else 0.07
                rows.append({"factor": "x", "network_name": net, "compute_scale": scale,
                             "compute_cv": cv, "kind": kind, "run": r,
                             "method": method_name(kind, "alternating-exp-ring"),
                             "measured_s": t, "times_s": repeats_around(t, 0.001, 2),
                             "predicted_s": 0.07 * (2.5 if kind == "allreduce" else 1.0)})
    return pd.DataFrame(rows)


#: the overlap ablation's model times (cpu profile, ms per iteration): (kind, overlap) -> ms
ABLATION_MS = {("allreduce", True): 197.0, ("allreduce", False): 219.0,
               ("decentralized", True): 71.0, ("decentralized", False): 102.0}


def _ablation(ar=1.11, de=1.44, spread=0.01, runs=10):
    """The overlap ablation's rows (E11's columns): each method's non-overlapped arm ``ar`` /
    ``de`` times its overlapped one, runs spread by ``spread`` around the median (the
    overlapped arm's in the opposite order); the model's times are ABLATION_MS."""
    ratio = {"allreduce": ar, "decentralized": de}
    rows = []
    for (kind, overlap), ms in ABLATION_MS.items():
        on = ABLATION_MS[(kind, True)]
        t0 = on if overlap else on * ratio[kind]
        for r in range(runs):
            k = r - (runs - 1) / 2
            t = t0 * (1 + spread * (k if overlap else -k) / ((runs - 1) / 2)) / 1e3
            rows.append({"factor": e11.ABLATION, "network_name": "two-level",
                         "compute_scale": 1.0, "compute_cv": 0.0, "kind": kind,
                         "overlap": overlap, "run": r,
                         "method": e11.ablation_method(kind, "alternating-exp-ring", overlap),
                         "measured_s": t, "times_s": repeats_around(t, 0.001, 2),
                         "predicted_s": ms / 1e3})
    return pd.DataFrame(rows)


CLAIM_CASES = {
    "e11_prediction_within": (lambda: _rows(0.1), lambda: _rows(-0.3),
                              lambda: _rows(0.19, spread=0.1)),
    "e11_speedup_grows": (lambda: _speedups(1.5), lambda: _speedups(1 / 1.5),
                          lambda: _speedups(1.0, spread=0.2)),
    # C11.2b: both arms at least 1.05; AllReduce's at 0.98 fails, at 1.05 +- 10% straddles
    "e11_overlap_hides": (lambda: _ablation(), lambda: _ablation(ar=0.98),
                          lambda: _ablation(ar=1.05, spread=0.1)),
}


def test_overlap_ablation_decides_each_method():
    entry = {e["id"]: e for e in claims.load_claims()}["C11.2b"]
    assert entry["args"] == {"kinds": ["allreduce", "decentralized"], "min_ratio": 1.05}
    v = claims.run_check(entry, _ablation())
    assert v.verdict == claims.PASS
    assert "AllReduce: 218.7 ms after backward vs 197.0 overlapped, x1.11" in v.measured
    assert "DAdam: 102.2 ms waited vs 71.0 overlapped, x1.44" in v.measured
    assert "saves 21.7 ms" in v.measured and "(10 and 10 runs)" in v.measured
    assert claims.predict(entry, _ablation()) == (
        "model AllReduce 219 ms after backward vs 197 overlapped: x1.11; "
        "DAdam 102 ms waited vs 71 overlapped: x1.44")
    # one method failing fails the claim, whatever the other does
    assert claims.run_check(entry, _ablation(de=0.9)).verdict == claims.FAIL
    assert claims.run_check(entry, _ablation(de=1.05, spread=0.1)).verdict == \
        claims.INCONCLUSIVE
    # a repeat is one run: fewer than MIN_REPEATS runs cannot decide
    few = _ablation(runs=claims.MIN_REPEATS - 1)
    assert claims.run_check(entry, few).verdict == claims.INCONCLUSIVE
    # read back from data.csv, the overlap column may be text
    text = _ablation().assign(overlap=lambda d: d.overlap.astype(str))
    assert claims.run_check(entry, text).verdict == claims.PASS
    with pytest.raises(ValueError, match="ablation"):
        e11.check_overlap_hides(_rows(), ["allreduce"], 1.05)
    with pytest.raises(ValueError, match="kinds"):
        e11.check_overlap_hides(_ablation(), ["ring"], 1.05)


def test_the_sweeps_claims_leave_the_ablation_out():
    """C11.1-C11.4 decide on the sweeps only: the ablation's rows (at the base configuration,
    the configuration of C11.3's and C11.4's comparisons) change none of their numbers."""
    entries = {e["id"]: e for e in claims.load_claims()}
    for cid, make in (("C11.1", lambda: _rows(0.1)), ("C11.3", _speedups),
                      ("C11.4", _speedups)):
        alone = claims.run_check(entries[cid], make())
        both = claims.run_check(entries[cid], pd.concat([make(), _ablation(ar=3.0, de=0.5)]))
        assert (both.verdict, both.measured) == (alone.verdict, alone.measured), cid
    assert len(e11.sweeps(pd.concat([_rows(), _ablation()]))) == len(_rows())


def test_the_model_of_the_ablation():
    """``simulate(overlap=False)``: AllReduce's buckets wait for the end of backward, DAdam's
    iteration for its own gossip."""
    net = make_network(DEFAULT_NETWORK)
    intra, inter = link_models(net)
    kw = dict(fwd_s=0.01, bwd_s=0.02, p=8, ranks_per_node=2, intra=intra, inter=inter,
              iterations=6, warmup=2)
    one = dict(kw, bucket_bytes=[1 << 20])  # one bucket: nothing to overlap with backward
    ar = [runtime_model.simulate("allreduce", overlap=o, **one)["mean_iteration_s"]
          for o in (True, False)]
    assert ar[0] == pytest.approx(ar[1])
    two = dict(kw, bucket_bytes=[1 << 20] * 2)
    ar = [runtime_model.simulate("allreduce", overlap=o, **two)["mean_iteration_s"]
          for o in (True, False)]
    assert ar[1] == pytest.approx(ar[0] + 0.02)  # the second layer's backward no longer hides
    comm = runtime_model.step_comm_times([tuple(range(8))], [1 << 20], ranks_per_node=2,
                                         intra=intra, inter=inter)[0][0]
    de = [runtime_model.simulate("decentralized", topology="complete", overlap=o,
                                 **one)["mean_iteration_s"] for o in (True, False)]
    assert de[1] == pytest.approx(0.03 + comm)  # compute, then the whole gossip
    assert de[0] == pytest.approx(max(0.03, comm))  # the gossip overlaps the next forward
    with pytest.raises(TypeError, match="overlap"):
        runtime_model.simulate("allreduce", overlap="no", **one)


def test_speedup_grows_compares_per_run_speedups():
    df = _speedups(1.5, spread=0.0)
    when = {"network_name": "two-level", "compute_scale": 0.5, "compute_cv": 0.0}
    against = {"network_name": "two-level", "compute_scale": 2.0, "compute_cv": 0.0}
    assert e11.speedups(df, when) == pytest.approx({r: 3.0 for r in range(5)})
    v = e11.check_speedup_grows(df, when, against, 1.0)
    assert v.verdict == claims.PASS and "ratio 1.5" in v.measured and "5 and 5 runs" in v.measured
    assert e11.check_speedup_grows(df, against, when, 1.0).verdict == claims.FAIL
    assert "ratio 1.00" in e11.predict_speedup_grows(df, when, against)  # the model's, flat
    few = df[df.run < claims.MIN_REPEATS - 1]
    assert e11.check_speedup_grows(few, when, against, 1.0).verdict == claims.INCONCLUSIVE
    with pytest.raises(ValueError, match="when"):
        e11.check_speedup_grows(df, {"compute_scale": 9.0}, against, 1.0)


def test_a_repeat_is_one_run():
    """Independent repeats: one per run (each run's median over its blocks), not per block."""
    t = e11.points(_rows(0.0, spread=0.02, runs=6))
    assert (t.runs == 6).all()
    few = _rows(0.0)[lambda d: d.run < claims.MIN_REPEATS - 1]
    assert e11.check_prediction_within(few, 0.2, "none").verdict == claims.INCONCLUSIVE


def test_cases_change_one_factor_at_a_time():
    cs = e11.cases(
        e11.Params.make(
            compute_scales=[0.5, 1.0, 2.0],
            compute_cvs=[0.0, 0.5],
            networks=["two-level", "flat"],
        )
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
    kw = dict(bucket_bytes=calib["bucket_bytes"], fwd_s=0.01, bwd_s=0.02, step_s=0.001, p=8,
              ranks_per_node=2, compute_cv=0.5, iterations=3 + 12, seed=0, warmup=3)
    r = runtime_model.simulate("allreduce", intra=intra, inter=inter, **kw)
    blocks = np.asarray(r["iteration_s"]).reshape(3, 4).sum(axis=1)
    assert pred["lockstep_iteration_s"] == pytest.approx(np.median(blocks) / 4)
    ring = OverlappedRing(net, 2, 8, [[tuple(range(8))]], calib["bucket_bytes"], "ring")
    r = runtime_model.simulate("allreduce", intra=ring.intra, inter=ring.inter,
                               collective_time_fn=ring, **kw)
    blocks = np.asarray(r["iteration_s"]).reshape(3, 4).sum(axis=1)
    assert pred["iteration_s"] == pytest.approx(np.median(blocks) / 4)
    # the ring over 4 nodes alternates intra- and inter-node edges: below lock-step
    assert pred["iteration_s"] < 0.85 * pred["lockstep_iteration_s"]
    factors = _factors(spec, 15)
    assert factors.shape == (15, 8)
    assert np.array_equal(
        factors, runtime_model.lognormal_factors(0.5, (15, 8), np.random.default_rng(0))
    )


def test_claim_names_the_worst_case():
    df = _rows(0.1, spread=0.0)
    sel = (df.compute_scale == 2.0) & (df.kind == "decentralized")
    df.loc[sel, "predicted_s"] = df.loc[sel, "measured_s"] * 2  # measured half the model
    v = e11.check_prediction_within(df, tolerance=0.2, may_miss="none")
    assert v.verdict == "FAIL" and "worst -50.0%" in v.measured and "5 PASS, 1 FAIL" in v.measured
    v = e11.check_prediction_within(df, tolerance=0.2, may_miss=1)
    assert v.verdict == "PASS" and "1 of 6 points missed (1 may miss)" in v.measured


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"world_size": 3}, "world_size"),
        ({"compute_scales": []}, "compute_scales"),
        ({"compute_cvs": [-0.1]}, "compute_cvs"),
        ({"networks": ["infiniband"]}, "networks"),
        ({"algorithm": "torch"}, "algorithm"),
        ({"blocks": 0}, "blocks"),
        ({"runs": 0}, "runs"),
        ({"fwd_ms": -1.0}, "fwd_ms"),
    ],
)
def test_bad_parameters_name_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        e11.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares it)
TINY = dict(world_size=2, ranks_per_node=1, compute_scales=[1.0], compute_cvs=[0.5],
            networks=["two-level"], width=64, layers=2, fwd_ms=2.0, bwd_ms=4.0, warmup=1,
            blocks=1, block_iters=2, calib_iters=2, runs=2, ablation_runs=2)


@pytest.mark.timeout(240)
def test_tiny_end_to_end_run(notebook_run):
    df = notebook_run(e11, TINY).df
    assert {"backend", "world_size", "network", "run", "lockstep_s", "overlap"} <= set(df.columns)
    ablation = df[df.factor == e11.ABLATION]
    df = df[df.factor != e11.ABLATION]
    assert sorted(df.run.unique()) == [0, 1] and len(df) == 8
    # interleaved rounds: run 0 starts with the base AllReduce, run 1 one place later
    assert list(df.kind[:2]) == ["allreduce", "decentralized"]
    assert list(df.factor[df.run == 1][:1]) == ["base"] and df.kind[4] == "decentralized"
    assert set(df.factor) == {"base", "varying compute"}
    assert set(df.kind) == {"allreduce", "decentralized"}
    assert (df.measured_s > 0.012).all()  # at least the emulated compute of 2 x (2 + 4) ms
    assert (df.predicted_s > 0.012).all()
    assert len(e11.summary(df)) == 4
    # the overlap ablation, after the sweeps: 2 rounds of its 4 arms, the second rotated by one
    assert len(ablation) == 8 and ablation.index.min() > df.index.max()
    arms = list(zip(ablation.kind, ablation.overlap.astype(bool)))
    assert arms[:4] == e11.ABLATION_ARMS and arms[4:] == e11.ABLATION_ARMS[1:] + e11.ABLATION_ARMS[:1]
    assert set(ablation.method) == {"AllReduce", "AllReduce, after backward", "DAdam (AER)",
                                    "DAdam (AER), waited"}
    assert (ablation.measured_s > 0.012).all() and (ablation.predicted_s > 0.012).all()
    off = ablation[~ablation.overlap.astype(bool)].groupby("kind").predicted_s.median()
    on = ablation[ablation.overlap.astype(bool)].groupby("kind").predicted_s.median()
    assert (off >= on - 1e-9).all()  # the model: no overlap is never faster
    both = pd.concat([df, ablation])
    assert len(e11.summary(both)) == 8
    assert "model AllReduce" in e11.predict_overlap_hides(both, ["allreduce", "decentralized"])
    e11.check_overlap_hides(both, ["allreduce", "decentralized"], 1.05)  # 2 runs: undecided
    e11.plot(both)
