"""E2 (collectives vs message size): planning, crossover helpers, the rank function on a pool
(subgroups), one tiny end-to-end run, and the claims' synthetic PASS / FAIL cases."""

import math

import numpy as np
import pandas as pd
import pytest
from claimdata import with_repeats

from pipecomm.lab import claims
from pipecomm.lab.experiments import e02_collectives_vs_size as e2
from pipecomm.lab.networks import cost

PROFILE = {  # the cpu profile's emulated configuration (the claims' synthetic data use it)
    "world_size": 8,
    "emu_alpha_s": 2e-3,
    "emu_bandwidth_Bps": 50e6,
    "sizes_min": 16384,
    "sizes_max": 64 << 20,
    "emu_cases": {
        "single/broadcast": ["lp", "mst", "be", "ring"],
        "single/allreduce": ["lp", "mst", "be", "ring"],
        "per-neighbor/allreduce": ["lp", "be"],
    },
    "real_world_sizes": [2, 4, 8],
    "real_sizes_max": 64 << 20,
}
CLAIM_ARGS = {
    "e2_lp_fastest_broadcast": {"ports": "single", "algorithms": ["lp", "mst", "be", "ring"]},
    "e2_ratio_vs_model": {"op": "broadcast", "ports": "single", "other": "be", "tolerance": 0.15},
    "e2_ratio_above": {"op": "broadcast", "ports": "single", "other": "be", "min_ratio": 1.0},
    "e2_ratio_below": {"op": "allreduce", "ports": "single", "other": "be", "max_ratio": 1.0},
    "e2_crossover_vs_model": {"ports": "single", "other": "be", "factor": 2.0},
    "e2_allreduce_port_model": {"min_ratio": 1.0},
    "e2_model_within": {"min_bytes": 1 << 20, "tolerance": 0.25, "may_miss": "binomial"},
    "e2_real_host_model": {"op": "broadcast", "world_size": 8, "tolerance": 0.25},
}
GAMMA = 1e-9
HOST = 124e-6  # host seconds per LP block (the reference E0's per-message latency)


def _synthetic(
    lp_bcast=1.0, lp_bcast_top=1.0, pn_lp=1.0, sp_lp=1.0, one_off=1.0, all_off=1.0,
    spread=0.01, real_host_err=1.05,
) -> pd.DataFrame:
    """The model (LP overlapped) as 'measurement' (x 1.05), with factors applied to chosen
    points; every point has 10 repeats within ``+- spread`` of its median."""
    pl = e2.plan(**PROFILE)
    rows = []
    top = pl.nbytes.max()
    for r in pl[pl.measure].itertuples():
        link = cost.LinkModel.from_bandwidth(2e-3, 50e6, gamma=GAMMA, ports=r.ports)
        block = (
            cost.lp_optimal_block_bytes(r.op, r.nbytes, 8, link) if r.algorithm == "lp" else None
        )
        model = cost.overlapped_time(r.op, r.algorithm, r.nbytes, 8, link, block,
                                     host_block_s=HOST)
        t = model * 1.05 * all_off
        if r.op == "broadcast" and r.algorithm == "lp":
            t *= lp_bcast * (lp_bcast_top if r.nbytes == top else 1.0)
        if r.ports == "per-neighbor" and r.algorithm == "lp":
            t *= pn_lp
        if r.ports == "single" and r.op == "allreduce" and r.algorithm == "lp":
            t *= sp_lp
        if r.op == "allreduce" and r.algorithm == "ring" and r.nbytes == 1 << 20:
            t *= one_off
        rows.append(
            {
                "section": "emulated",
                "ports": r.ports,
                "op": r.op,
                "algorithm": r.algorithm,
                "nbytes": r.nbytes,
                "world_size": 8,
                "time_s": t,
                "model_s": model,
                "model_lockstep_s": cost.collective_time(r.op, r.algorithm, r.nbytes, 8, link,
                                                         block),
                "model_host_block_s": HOST,
                "block_bytes": block,
                "emu_alpha_s": 2e-3,
                "emu_bandwidth_Bps": 50e6,
                "model_gamma_s_per_byte": GAMMA,
                "backend": "gloo",
                "network": "emulated, single-port, 2.0 ms / 50 MB/s",
            }
        )
    factor = {
        ("broadcast", "lp"): 0.8,
        ("allreduce", "lp"): 1.1,
    }
    for q in (2, 4, 8):
        for op in ("broadcast", "allreduce"):
            for alg in ("lp", "mst", "be", "ring", "torch"):
                for n in (1 << 20, 4 << 20, 16 << 20, 64 << 20):
                    t = n / 1e9 * factor.get((op, alg), 1.0)
                    rows.append(
                        {
                            "section": "real",
                            "op": op,
                            "algorithm": alg,
                            "nbytes": n,
                            "world_size": q,
                            "backend": "gloo",
                            "network": "real",
                            "time_s": t,
                            "block_bytes": n // 4 if alg == "lp" else None,
                            "model_s": t / real_host_err if alg == "lp" else float("nan"),
                        }
                    )
    return with_repeats(pd.DataFrame(rows), spread)


CLAIM_CASES = {
    # BE/LP and ring/LP 1.58 in the model: LP 1.7x slower at the top fails, 1.58x is a tie
    "e2_lp_fastest_broadcast": (_synthetic, lambda: _synthetic(lp_bcast_top=1.7),
                                lambda: _synthetic(lp_bcast_top=1.58, spread=0.1)),
    "e2_ratio_vs_model": (_synthetic, lambda: _synthetic(lp_bcast_top=1.3),
                          lambda: _synthetic(lp_bcast_top=1.15, spread=0.1)),
    "e2_ratio_above": (_synthetic, lambda: _synthetic(lp_bcast_top=1.7),
                       lambda: _synthetic(lp_bcast_top=1.58, spread=0.1)),
    # single-port BE/LP 0.60 in the model: LP allreduce 2x faster makes it 1.2
    "e2_ratio_below": (_synthetic, lambda: _synthetic(sp_lp=0.5),
                       lambda: _synthetic(sp_lp=0.6, spread=0.1)),
    "e2_crossover_vs_model": (_synthetic, lambda: _synthetic(lp_bcast=1.3),
                              lambda: _synthetic(lp_bcast=1.12, spread=0.3)),
    "e2_allreduce_port_model": (_synthetic, lambda: _synthetic(pn_lp=1.6),
                                lambda: _synthetic(pn_lp=1.33, spread=0.2)),
    # 39 points, 4 may miss: every point off fails; every point on the edge cannot decide
    "e2_model_within": (_synthetic, lambda: _synthetic(all_off=1.6),
                        lambda: _synthetic(all_off=1.25 / 1.05, spread=0.1)),
    "e2_real_host_model": (_synthetic, lambda: _synthetic(real_host_err=1.6),
                           lambda: _synthetic(real_host_err=1.25, spread=0.1)),
}


def test_claim_cases_pass_fail_inconclusive():
    want = (claims.PASS, claims.FAIL, claims.INCONCLUSIVE)
    for name, makers in CLAIM_CASES.items():
        for make, verdict in zip(makers, want):
            v = claims.CHECKS[name](make(), **CLAIM_ARGS[name])
            assert v.verdict == verdict, (name, verdict, v)


def test_claim_values_on_the_model():
    v = e2.check_lp_fastest_broadcast(_synthetic(), **CLAIM_ARGS["e2_lp_fastest_broadcast"])
    assert "BE/LP 1.58" in v.measured
    v = e2.check_allreduce_ports(_synthetic(), **CLAIM_ARGS["e2_allreduce_port_model"])
    assert "per-neighbor BE/LP 1.44" in v.measured
    v = e2.check_ratio_below(_synthetic(), **CLAIM_ARGS["e2_ratio_below"])
    assert "BE/LP 0.611" in v.measured  # gamma 1 ns/B here
    assert "model BE/LP 1.58" in e2.predict_ratio_vs_model(_synthetic(), "broadcast", "single",
                                                            "be")


def test_model_within_allowance():
    """One point far off: PASS with the binomial allowance (4 of 39), FAIL when none may miss."""
    args = CLAIM_ARGS["e2_model_within"]
    df = _synthetic(one_off=1.6)
    assert e2.check_model_within(df, **args).verdict == claims.PASS
    assert e2.check_model_within(df, **{**args, "may_miss": "none"}).verdict == claims.FAIL


def test_crossover_on_the_overlapped_model():
    """C2.2's model crossover comes from the overlapped LP model (about 1.4 MiB at 2 ms,
    50 MB/s, p = 8 with 124 us per block), not the lock-step one (about 4.1 MiB)."""
    text = e2.predict_crossover(_synthetic(), "single", "be")
    assert "model crossover 1.4" in text, text
    lock = e2.predict_crossover(_synthetic().drop(columns="model_host_block_s"), "single", "be")
    assert "model crossover 1.19" in lock  # no host column: the engine with h = 0


def test_claims_need_their_data():
    df = _synthetic()
    with pytest.raises(ValueError, match="no measurement"):
        e2.check_lp_fastest_broadcast(df[~((df.algorithm == "mst") & (df.op == "broadcast"))],
                                      **CLAIM_ARGS["e2_lp_fastest_broadcast"])
    with pytest.raises(ValueError, match="per-neighbor"):
        e2.check_allreduce_ports(df[df.ports != "per-neighbor"],
                                 **CLAIM_ARGS["e2_allreduce_port_model"])
    with pytest.raises(ValueError, match="host model"):
        e2.check_real_host_model(df.assign(model_s=float("nan")),
                                 **CLAIM_ARGS["e2_real_host_model"])
    v = e2.check_real_host_model(df, **CLAIM_ARGS["e2_real_host_model"])
    assert "p=8, 64 MiB, block 16 MiB" in v.measured and "+5.0%" in v.measured


def test_host_model_claim_needs_e0s_host_links():
    """A model on the default host_links (E2 run without E0 in its results folder) decides
    nothing: INCONCLUSIVE with the reason, even where the default happens to fit or not."""
    args = CLAIM_ARGS["e2_real_host_model"]
    for err in (1.05, 1.6):
        df = _synthetic(real_host_err=err)
        measured = e2.check_real_host_model(df.assign(host_links=1.4, host_links_measured=True),
                                            **args)
        assert measured.verdict == (claims.PASS if err < 1.25 else claims.FAIL)
        v = e2.check_real_host_model(df.assign(host_links=2.0, host_links_measured=False), **args)
        assert v.verdict == claims.INCONCLUSIVE
        assert "default host_links (2" in v.measured and "run E0" in v.measured


def test_host_model_of_real_lp_rows():
    real = pd.DataFrame({"op": ["broadcast", "allreduce", "broadcast"],
                         "algorithm": ["lp", "lp", "torch"], "nbytes": [1 << 24] * 3,
                         "world_size": [8, 4, 8], "block_bytes": [1 << 22, 1 << 21, None]})
    link = cost.host_link()
    got = e2._host_model(real, link)
    assert got[0] == cost.lp_time_on_host("broadcast", 1 << 24, 8, link, 1 << 22)
    assert got[1] == cost.lp_time_on_host("allreduce", 1 << 24, 4, link, 1 << 21)
    assert math.isnan(got[2])


def test_measured_crossover():
    assert e2.measured_crossover_bytes([1, 4, 16], [2.0, 1.0, 1.0], [1.0, 1.0, 2.0]) == 4.0
    # log-linear interpolation between 4 (ratio 1/2) and 16 (ratio 2): the middle, 8
    assert e2.measured_crossover_bytes([16, 4, 1], [1, 2, 4], [2, 1, 1]) == pytest.approx(8.0)
    assert e2.measured_crossover_bytes([1, 4], [1.0, 1.0], [2.0, 2.0]) == 1.0
    assert e2.measured_crossover_bytes([1, 4], [2.0, 2.0], [1.0, 1.0]) == math.inf
    # LP faster, slower, then faster for good: the last crossing counts
    assert e2.measured_crossover_bytes([1, 2, 4, 8], [1, 2, 2, 1], [2, 1, 2, 2]) == pytest.approx(
        4.0
    )


def test_model_crossover_matches_a_brute_force_scan():
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6, gamma=GAMMA)
    x = e2.model_crossover_bytes("broadcast", "be", 8, link, 16384, 64 << 20)
    assert 3.5 * 2**20 < x < 4.5 * 2**20
    for n in (int(x * 1.1), int(x * 2), 64 << 20):
        assert cost.broadcast_time("lp", n, 8, link) < cost.broadcast_time("be", n, 8, link)
    n = int(x * 0.9)
    assert cost.broadcast_time("lp", n, 8, link) >= cost.broadcast_time("be", n, 8, link)


def test_plan_and_expected_runtime():
    pl = e2.plan(**PROFILE)
    assert len(pl) == (4 + 4 + 2) * 7
    skipped = pl[~pl.measure]
    assert list(zip(skipped.op, skipped.algorithm, skipped.nbytes)) == [
        ("allreduce", "mst", 64 << 20)
    ]  # 8.3 s > max_point_s
    big = pl[pl.nbytes >= 16 << 20]
    assert (big.iters == 2).all() and (big.warmup == 0).all()
    est = e2.expected_runtime_s(**PROFILE)
    assert 70 < est["emulated_s"] < 85
    assert est["total_s"] < 140


@pytest.mark.parametrize(
    "bad",
    [
        {"emu_cases": {"single/gather": ["lp"]}},
        {"emu_cases": {"both/broadcast": ["lp"]}},
        {"emu_cases": {"single/broadcast": ["torch"]}},
        {"emu_cases": ["single/broadcast"]},
        {"world_size": 1},
        {"iters": 0},
        {"real_world_sizes": [1]},
        {"real_algorithms": ["nccl"]},
        {"backend": "mpi"},
        {"emu_bandwidth_Bps": 0},
        {"backend": "nccl"},  # emulation with NCCL is refused
        {"unknown_parameter": 3},
    ],
)
def test_bad_parameters(bad):
    with pytest.raises(ValueError):
        e2.plan(**bad)


def test_measure_points_on_subgroups(pool):
    points = [
        {
            "op": op,
            "algorithm": alg,
            "nbytes": 4096,
            "p": q,
            "warmup": 0,
            "iters": 1,
            "first_warmup": True,
        }
        for q in (2, 4)
        for op in ("broadcast", "allreduce", "reduce")
        for alg in ("lp", "be", "torch")
    ]
    out = pool(4).run(e2.measure_points, points, timeout_s=120)
    assert out[1:] == [[], [], []]
    rows = pd.DataFrame(out[0])
    assert len(rows) == len(points)
    assert list(rows.world_size) == [pt["p"] for pt in points]
    assert (rows.time_s > 0).all()
    assert rows.block_bytes[rows.algorithm == "lp"].notna().all()
    assert rows.block_bytes[rows.algorithm != "lp"].isna().all()


def test_measure_points_interleaved(pool):
    import rankfns_collectives as fns

    points = [
        {"op": "allreduce", "algorithm": alg, "nbytes": n, "p": 2, "warmup": 1, "iters": 3}
        for n in (8192, 16384)
        for alg in ("lp", "ring", "torch")
    ]
    out = pool(4).run(fns.interleaved_order, points, timeout_s=120)
    rows = pd.DataFrame(out[0]["rows"])
    assert [out[r]["rows"] for r in (1, 2, 3)] == [[], [], []]
    assert list(zip(rows.algorithm, rows.nbytes)) == [(p["algorithm"], p["nbytes"]) for p in points]
    assert (rows.repeats == 3).all() and (rows.time_s > 0).all()
    # per size: each algorithm's warm-up, then three rounds, each starting one place further on
    one = ["lp", "ring", "torch"] + ["lp", "ring", "torch", "ring", "torch", "lp",
                                     "torch", "lp", "ring"]
    assert out[0]["calls"] == one * 2
    bad = [dict(points[0]), dict(points[1], iters=2)]
    with pytest.raises(Exception, match="share iters"):
        pool(4).run(e2.measure_points, bad, timeout_s=60, interleave=True)


def test_rotated_round_order():
    """sweep.rotated: round i starts at contender i mod k; over k rounds every contender takes
    every place once (what measure_points and bench_decentdp time in); no contenders, no order."""
    from pipecomm.lab.measure import sweep

    names = ["lp", "ring", "torch"]
    assert sweep.rotated(names, 0) == names and sweep.rotated(names, 4) == ["ring", "torch", "lp"]
    rounds = [sweep.rotated(names, i) for i in range(3)]
    assert all(sorted(r[place] for r in rounds) == sorted(names) for place in range(3))
    assert sweep.rotated(range(3), 2) == [2, 0, 1] and sweep.rotated([], 5) == []


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(
    world_size=3,
    emu_alpha_s=2e-4,
    emu_bandwidth_Bps=1e9,
    sizes_min=4096,
    sizes_max=16384,
    iters=1,
    warmup=0,
    emu_cases={"per-neighbor/allreduce": ["lp", "be"]},
    real_world_sizes=[2],
    real_algorithms=["lp", "torch"],
    real_ops=["broadcast"],
    real_sizes_min=4096,
    real_sizes_max=4096,
    real_iters=1,
    real_warmup=0,
    timeout_s=120.0,
)
TINY_ENV = {"PIPECOMM_SKIP_HOST_CHECK": "1"}  # fast links: plumbing, not timing


def test_run_tiny_end_to_end(notebook_run):
    df = notebook_run(e2, TINY, TINY_ENV).df
    for col in ("backend", "world_size", "network", "section", "time_s", "busbw_Bps"):
        assert col in df.columns
    emu, real = df[df.section == "emulated"], df[df.section == "real"]
    assert len(emu) == 2 * 2 and len(real) == 2
    assert emu.network.str.startswith("emulated, per-neighbor").all()
    assert (real.network == "real").all() and set(real.world_size) == {2}
    # the emulated time cannot beat the emulated link: at least the model's bandwidth term
    assert (emu.time_s >= 0.5 * emu.model_s).all()
    assert np.isfinite(df.busbw_Bps).all()
    s = e2.summary(df)
    assert {"section", "metric", "lp"} <= set(s.columns)
    fig = e2.plot(df)
    import matplotlib.pyplot as plt

    plt.close(fig)
