"""Tests of pipecomm.lab.networks.cost: hand-computed cases, a lock-step schedule simulator as oracle, limits,
the LP optimum against a brute-force scan, fits on synthetic data, and the E1 claims' shapes."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecomm.lab.networks import cost
from pipecomm.lab.networks.cost import LinkModel

ALPHA, BETA, GAMMA = 1e-3, 1e-6, 1e-7
LINK = LinkModel(ALPHA, BETA, GAMMA)
LINK_PN = LINK.with_ports("per-neighbor")


# ------------------------------------------------------------------------------------------
# Oracle: explicit schedules of docs/algorithms.md, costed step by step in lock-step.
# A message is (src, dst, nbytes, reduced_at_dst). A step costs alpha + beta V + gamma R with
# V = most bytes through one port of one rank (single: max(out sum, in sum); per-neighbor:
# largest message) and R = most bytes reduced by one rank in that step.
# ------------------------------------------------------------------------------------------


def _blocks(n, b):
    k = -(-n // b)
    return [b] * (k - 1) + [n - (k - 1) * b]


def sched_lp(op, n, b, p):
    bl = _blocks(n, min(b, n))
    k = len(bl)
    steps = []
    if op in ("broadcast", "reduce"):
        for s in range(k + p - 2):
            # position i sends block s - i to position i + 1
            steps.append(
                [(i, i + 1, bl[s - i], op == "reduce") for i in range(p - 1) if 0 <= s - i < k]
            )
        return steps
    for s in range(k + 2 * p - 3):
        msgs = [(i, i + 1, bl[s - i], True) for i in range(p - 1) if 0 <= s - i < k]
        # block j leaves rank p-1 at step j + p - 1 and reaches rank i - 1 one step per hop
        for i in range(1, p):
            j = s - (2 * p - 2 - i)
            if 0 <= j < k:
                msgs.append((i, i - 1, bl[j], False))
        steps.append(msgs)
    return steps


def sched_be_allreduce(n, p):
    pp = 1 << (p.bit_length() - 1)
    r = p - pp
    steps = []
    if r:
        steps.append([(2 * i, 2 * i + 1, n, True) for i in range(r)])
    core = [2 * i + 1 for i in range(r)] + list(range(2 * r, p))
    lg = pp.bit_length() - 1
    for j in range(lg):  # recursive halving, partner at distance pp / 2^(j+1)
        d, m = pp >> (j + 1), n / 2 ** (j + 1)
        steps.append([(core[c], core[c ^ d], m, True) for c in range(pp)])
    for j in range(lg):  # recursive doubling
        d, m = 1 << j, n / pp * 2**j
        steps.append([(core[c], core[c ^ d], m, False) for c in range(pp)])
    if r:
        steps.append([(2 * i + 1, 2 * i, n, False) for i in range(r)])
    return steps


def sched_ring_allreduce(n, p):
    rs = [[(i, (i + 1) % p, n / p, True) for i in range(p)] for _ in range(p - 1)]
    ag = [[(i, (i + 1) % p, n / p, False) for i in range(p)] for _ in range(p - 1)]
    return rs + ag


def sched_mst_broadcast(n, p):
    steps, j = [], 0
    while (1 << j) < p:
        steps.append([(r, r + (1 << j), n, False) for r in range(1 << j) if r + (1 << j) < p])
        j += 1
    return steps


def simulate(steps, link):
    total = 0.0
    for msgs in steps:
        if not msgs:
            continue
        out, inn, red = {}, {}, {}
        for s, d, m, r in msgs:
            out[s] = out.get(s, 0) + m
            inn[d] = inn.get(d, 0) + m
            if r:
                red[d] = red.get(d, 0) + m
        if link.ports == "single":
            v = max(max(out.values()), max(inn.values()))
        else:
            v = max(m for _, _, m, _ in msgs)
        total += link.alpha + link.beta * v + link.gamma * max(red.values(), default=0)
    return total


# ------------------------------------------------------------------------------------------
# Hand-computed cases (alpha = 1 ms, beta = 1 us/B, gamma = 0.1 us/B)
# ------------------------------------------------------------------------------------------


def test_lp_broadcast_hand():
    # n = 4000, b = 1000 -> k = 4; p = 4 -> k + p - 2 = 6 steps of (1 ms + 1000 * 1 us) = 12 ms
    assert cost.broadcast_time("lp", 4000, 4, LINK, 1000) == pytest.approx(6 * (1e-3 + 1e-3))
    # last block partial: n = 3500 -> k = 4, blocks 1000,1000,1000,500; the final step carries
    # only the 500-byte block: 6 alpha + (5 * 1000 + 500) beta = 6 ms + 5.5 ms
    assert cost.broadcast_time("lp", 3500, 4, LINK, 1000) == pytest.approx(11.5e-3)
    # per-neighbor ports change nothing for broadcast
    assert cost.broadcast_time("lp", 3500, 4, LINK_PN, 1000) == pytest.approx(11.5e-3)


def test_lp_reduce_hand():
    # 6 steps, each adds the block it received: 6 alpha + 5500 (beta + gamma)
    expect = 6e-3 + 5500 * (1e-6 + 1e-7)
    assert cost.reduce_time("lp", 3500, 4, LINK, 1000) == pytest.approx(expect)


def test_lp_allreduce_hand():
    # n = 4000, b = 1000, k = 4, p = 4: S = k + 2p - 3 = 9 steps, k + p - 2 = 6 reduce steps.
    # per-neighbor: every step moves one block per link: 9 alpha + 9000 beta + 6000 gamma
    pn = 9e-3 + 9000e-6 + 6000e-7
    assert cost.allreduce_time("lp", 4000, 4, LINK_PN, 1000) == pytest.approx(pn)
    # single port: in k - 1 = 3 steps a rank sends (receives) in both directions: +3000 beta
    single = 9e-3 + 12000e-6 + 6000e-7
    assert cost.allreduce_time("lp", 4000, 4, LINK, 1000) == pytest.approx(single)
    # p = 2: no rank has two neighbours; steps k + 1 = 5: 5 alpha + 5000 beta + 4000 gamma
    assert cost.allreduce_time("lp", 4000, 2, LINK, 1000) == pytest.approx(5e-3 + 5000e-6 + 4000e-7)


def test_mst_hand():
    n = 1000
    # p = 5: ceil(log2 5) = 3 rounds of the whole message
    assert cost.broadcast_time("mst", n, 5, LINK) == pytest.approx(3 * (1e-3 + 1e-3))
    assert cost.reduce_time("mst", n, 5, LINK) == pytest.approx(3 * (1e-3 + 1e-3 + 1e-4))
    # allreduce = reduce + broadcast
    assert cost.allreduce_time("mst", n, 5, LINK) == pytest.approx(3 * (2e-3 + 2e-3 + 1e-4))


def test_be_hand():
    n = 4000
    # p = 8 (power of two, log2 = 3): allreduce 6 alpha + 2 (7/8) n beta + (7/8) n gamma
    assert cost.allreduce_time("be", n, 8, LINK) == pytest.approx(6e-3 + 7e-3 + 3500e-7)
    # p = 6: p' = 4, r = 2: 4 alpha + 2 (3/4) n beta + (3/4) n gamma  + fold 2 alpha + 2 n beta
    # + n gamma = 4 ms + 6 ms + 0.3 ms + 2 ms + 8 ms + 0.4 ms
    assert cost.allreduce_time("be", n, 6, LINK) == pytest.approx(20.7e-3)
    # broadcast p = 5: p' = 4: 4 alpha + 1.5 n beta + (alpha + n beta) = 5 ms + 10 ms
    assert cost.broadcast_time("be", n, 5, LINK) == pytest.approx(15e-3)
    # reduce p = 5: (alpha + n beta + n gamma) + 4 alpha + (3/4) n (2 beta + gamma)
    # = 1 + 4 + 0.4 ms + 4 ms + 6 ms + 0.3 ms
    assert cost.reduce_time("be", n, 5, LINK) == pytest.approx(15.7e-3)


def test_ring_hand():
    n = 4000
    # allreduce p = 4: 2 * 3 (alpha + 1000 beta) + 3 * 1000 gamma = 12 ms + 0.3 ms
    assert cost.allreduce_time("ring", n, 4, LINK) == pytest.approx(12.3e-3)
    # broadcast p = 4: binomial scatter 2 alpha + 3000 beta, ring allgather 3 (alpha + 1000 beta)
    assert cost.broadcast_time("ring", n, 4, LINK) == pytest.approx(5e-3 + 6e-3)
    # reduce p = 4: 3 (alpha + 1000 (beta + gamma)) + 2 alpha + 3000 beta
    assert cost.reduce_time("ring", n, 4, LINK) == pytest.approx(3e-3 + 3.3e-3 + 2e-3 + 3e-3)


def test_compression_hand():
    n, p = 4000, 4
    # ring: beta / 2 on the wire, gamma + codec on every reduced byte:
    # 6 alpha + 2 * 3000 * beta / 2 + 3000 (gamma + 1e-8)
    expect = 6e-3 + 3000e-6 + 3000 * (1e-7 + 1e-8)
    got = cost.allreduce_time("ring", n, p, LINK, compression_ratio=2.0, codec_s_per_byte=1e-8)
    assert got == pytest.approx(expect)
    # lp per-neighbor: 9 alpha + 9000 beta / 4 + 6000 (gamma + 1e-8)
    got = cost.allreduce_time(
        "lp", n, p, LINK_PN, 1000, compression_ratio=4.0, codec_s_per_byte=1e-8
    )
    assert got == pytest.approx(9e-3 + 2250e-6 + 6000 * 1.1e-7)


# ------------------------------------------------------------------------------------------
# Closed forms against the schedule simulator
# ------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 4000),
    b=st.integers(1, 600),
    p=st.integers(2, 9),
    op=st.sampled_from(cost.OPS),
    ports=st.sampled_from(cost.PORTS),
)
def test_lp_matches_schedule(n, b, p, op, ports):
    b = max(b, -(-n // 60))  # at most 60 blocks keeps the oracle fast
    link = LinkModel(1e-4, 3e-7, 1.3e-7, ports)
    assert cost.collective_time(op, "lp", n, p, link, b) == pytest.approx(
        simulate(sched_lp(op, n, b, p), link), rel=1e-12
    )


@pytest.mark.parametrize("ports", cost.PORTS)
def test_lp_allreduce_small_k_exhaustive(ports):
    # every k in 1..8 (including the k = 3 special case) with a tiny last block
    link = LinkModel(1e-4, 3e-7, 1.3e-7, ports)
    for p in range(2, 8):
        for k in range(1, 9):
            for last in (1, 37, 100):
                n = (k - 1) * 100 + last
                assert cost.allreduce_time("lp", n, p, link, 100) == pytest.approx(
                    simulate(sched_lp("allreduce", n, 100, p), link), rel=1e-12
                ), (p, k, last)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 7, 8, 12, 16])
@pytest.mark.parametrize("ports", cost.PORTS)
def test_be_ring_mst_match_schedule(p, ports):
    link = LinkModel(1e-4, 3e-7, 1.3e-7, ports)
    n = 2**10 * 3 * 5 * 7 * 11  # divisible by every p above
    assert cost.allreduce_time("be", n, p, link) == pytest.approx(
        simulate(sched_be_allreduce(n, p), link)
    )
    assert cost.allreduce_time("ring", n, p, link) == pytest.approx(
        simulate(sched_ring_allreduce(n, p), link)
    )
    assert cost.broadcast_time("mst", n, p, link) == pytest.approx(
        simulate(sched_mst_broadcast(n, p), link)
    )


# ------------------------------------------------------------------------------------------
# Limits
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", cost.OPS)
@pytest.mark.parametrize("alg", cost.ALGORITHMS)
def test_limits_p1_and_empty(op, alg):
    assert cost.collective_time(op, alg, 10**6, 1, LINK) == 0.0
    assert cost.collective_time(op, alg, 0, 8, LINK) == 0.0


def test_lp_single_block():
    n, p = 5000, 5
    # k = 1: store-and-forward along the chain, p - 1 hops of the whole message
    assert cost.broadcast_time("lp", n, p, LINK, n) == pytest.approx(4 * (1e-3 + 5e-3))
    # a block larger than the message is one block too
    assert cost.broadcast_time("lp", n, p, LINK, 10 * n) == cost.broadcast_time("lp", n, p, LINK, n)
    # allreduce with k = 1: 2p - 2 hops, p - 1 of them add; no step has both directions busy
    expect = 8 * (1e-3 + 5e-3) + 4 * 5000e-7
    assert cost.allreduce_time("lp", n, p, LINK, n) == pytest.approx(expect)
    assert cost.allreduce_time("lp", n, p, LINK_PN, n) == pytest.approx(expect)
    # p = 2 broadcast: k alpha + n beta, so one block is optimal
    assert cost.broadcast_time("lp", n, 2, LINK, 1000) == pytest.approx(5e-3 + 5e-3)
    assert cost.lp_optimal_block_bytes("broadcast", 10**6, 2, LINK) == 10**6


def test_lp_invariant_to_p_for_large_messages():
    # LP's claim: with n beta >> p alpha the cost hardly depends on p
    link = LinkModel(1e-6, 1e-9)
    n = 2**26
    t2, t64 = (cost.broadcast_time("lp", n, p, link) for p in (2, 64))
    assert t64 / t2 < 1.1


# ------------------------------------------------------------------------------------------
# LP optimum
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", cost.OPS)
@pytest.mark.parametrize("ports", cost.PORTS)
@pytest.mark.parametrize("p", [2, 3, 4, 7, 16])
def test_lp_optimum_beats_brute_force(op, ports, p):
    link = LinkModel(2e-5, 1e-8, 3e-9, ports)
    n = 5_000 * 8 + 3  # n beta / alpha = 20: optimum k* = sqrt(20 (p - 2)) ~ 3..17 blocks
    best = cost.lp_optimal_block_bytes(op, n, p, link, min_bytes=64)
    assert best == n or (best % 8 == 0 and 64 <= best < n)
    t_best = cost.collective_time(op, "lp", n, p, link, best)
    scan = list(range(64, n, 8)) + [n]
    t_scan = [cost.collective_time(op, "lp", n, p, link, b) for b in scan]
    assert t_best <= min(t_scan) * (1 + 1e-12)
    assert t_best == pytest.approx(min(t_scan), rel=1e-12)


def test_lp_optimum_clamps():
    link = LinkModel(1e-3, 1e-10)
    # latency-dominated: wants a single block, but max_bytes caps it
    assert cost.lp_optimal_block_bytes("broadcast", 10**6, 8, link) == 10**6
    b = cost.lp_optimal_block_bytes("broadcast", 10**6, 8, link, max_bytes=100_000)
    assert b <= 100_000 and b % 8 == 0
    # bandwidth-dominated: wants tiny blocks, but min_bytes floors it
    link = LinkModel(1e-9, 1e-6)
    assert cost.lp_optimal_block_bytes("broadcast", 10**6, 8, link) == 4096
    assert cost.lp_optimal_block_bytes("broadcast", 10**6, 8, link, min_bytes=1000) == 1000
    # tiny / empty messages
    assert cost.lp_optimal_block_bytes("allreduce", 1000, 8, link) == 1000
    assert cost.lp_optimal_block_bytes("allreduce", 0, 8, link) == 8
    with pytest.raises(ValueError, match="max_bytes"):
        cost.lp_optimal_block_bytes("broadcast", 10**6, 8, link, min_bytes=4096, max_bytes=10)


def test_lp_optimum_near_analytic():
    link = LinkModel(10e-6, 1e-10, 1e-10)
    n = 2**28
    for op in cost.OPS:
        for ports in cost.PORTS:
            lk = link.with_ports(ports)
            b = cost.lp_optimal_block_bytes(op, n, 64, lk)
            b_star = cost.lp_analytic_block_bytes(op, n, 64, lk)
            assert b == pytest.approx(b_star, rel=0.02), (op, ports)
    # the paper's formula k* = sqrt((p - 2) n beta / alpha) for broadcast
    k_star = n / cost.lp_analytic_block_bytes("broadcast", n, 64, link)
    assert k_star == pytest.approx(math.sqrt(62 * n * 1e-10 / 10e-6))


def test_default_block_is_optimal():
    link = LinkModel(1e-4, 1e-8, 1e-9)
    n, p = 300_000, 6
    b = cost.lp_optimal_block_bytes("allreduce", n, p, link)
    assert cost.allreduce_time("lp", n, p, link) == cost.allreduce_time("lp", n, p, link, b)


# ------------------------------------------------------------------------------------------
# E1 claims (alpha = 10 us, 10 GB/s, 256 MiB)
# ------------------------------------------------------------------------------------------


def test_e1_claims():
    link = LinkModel.from_bandwidth(10e-6, 10e9)
    n = 256 * 2**20
    lp2, lp64 = (cost.broadcast_time("lp", n, p, link) for p in (2, 64))
    mst2, mst64 = (cost.broadcast_time("mst", n, p, link) for p in (2, 64))
    be64 = cost.broadcast_time("be", n, 64, link)
    # recorded: lp 1.327x, mst 6.0x, be/lp 1.487
    assert lp64 / lp2 <= 1.5
    assert mst64 / mst2 >= 5.0
    assert be64 / lp64 >= 1.4


# ------------------------------------------------------------------------------------------
# Fits
# ------------------------------------------------------------------------------------------


def test_fit_alpha_beta_recovers():
    rng = np.random.default_rng(0)
    alpha, beta = 160e-6, 1 / 2.5e9
    n = np.repeat(2.0 ** np.arange(2, 27), 5)  # 4 B .. 64 MiB, 5 repeats
    t = (alpha + beta * n) * rng.lognormal(0.0, 0.03, n.size)
    a, b = cost.fit_alpha_beta(n, t)
    assert a == pytest.approx(alpha, rel=0.03)
    assert b == pytest.approx(beta, rel=0.03)
    # an absolute fit also gets beta but not alpha as well (dominated by large sizes)
    a2, b2 = cost.fit_alpha_beta(n, t, relative=False)
    assert b2 == pytest.approx(beta, rel=0.03)
    # min_bytes drops small sizes
    a3, b3 = cost.fit_alpha_beta(n, t, min_bytes=2**20)
    assert b3 == pytest.approx(beta, rel=0.05)


def test_fit_nonnegative():
    n = np.array([1e3, 1e4, 1e5, 1e6])
    # times that would give a negative intercept in an unconstrained fit
    t = 2e-9 * n - 1e-6
    a, b = cost.fit_alpha_beta(n, t)
    assert a == 0.0 and b > 0
    # decreasing times: slope pinned at zero
    a, b = cost.fit_alpha_beta(n, [4e-3, 3e-3, 2e-3, 1e-3])
    assert b == 0.0 and a > 0


def test_fit_gamma_recovers():
    rng = np.random.default_rng(1)
    gamma = 1 / 1.2e9
    n = np.repeat(2.0 ** np.arange(10, 26), 3)
    t = (3e-6 + gamma * n) * rng.lognormal(0.0, 0.03, n.size)
    assert cost.fit_gamma(n, t) == pytest.approx(gamma, rel=0.03)


def test_fit_bad_arguments():
    with pytest.raises(ValueError, match="same length"):
        cost.fit_alpha_beta([1, 2, 3], [1.0, 2.0])
    with pytest.raises(ValueError, match="distinct sizes"):
        cost.fit_alpha_beta([8, 8, 8], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="distinct sizes"):
        cost.fit_alpha_beta([8, 16, 32], [1.0, 1.0, 1.0], min_bytes=20)
    with pytest.raises(ValueError, match="times_s > 0"):
        cost.fit_alpha_beta([8, 16], [0.0, 1.0])
    with pytest.raises(ValueError, match=">= 0"):
        cost.fit_gamma([-8, 16], [1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        cost.fit_gamma([8, 16], [math.nan, 1.0])


# ------------------------------------------------------------------------------------------
# Links: calibration and emulated networks
# ------------------------------------------------------------------------------------------


def test_calibrated_link(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPECOMM_CALIBRATION", raising=False)
    d = cost.calibrated_link()
    assert d.alpha == cost.DEFAULT_ALPHA_S
    assert d.bandwidth_Bps == pytest.approx(cost.DEFAULT_BANDWIDTH_BPS)
    assert d.gamma == cost.DEFAULT_GAMMA_S_PER_BYTE
    f = tmp_path / "cal.json"
    f.write_text(json.dumps({"alpha_s": 2e-4, "beta_s_per_byte": 5e-10, "gamma_s_per_byte": 7e-10}))
    assert cost.calibrated_link(f) == LinkModel(2e-4, 5e-10, 7e-10)
    monkeypatch.setenv("PIPECOMM_CALIBRATION", str(f))
    assert cost.calibrated_link().alpha == 2e-4
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"alpha_s": 1e-4}))
    with pytest.raises(ValueError, match="beta_s_per_byte"):
        cost.calibrated_link(bad)
    with pytest.raises(ValueError, match="cannot read"):
        cost.calibrated_link(tmp_path / "missing.json")


def test_link_from_network(monkeypatch):
    monkeypatch.delenv("PIPECOMM_CALIBRATION", raising=False)
    net = SimpleNamespace(
        alpha_s=1e-3,
        bandwidth_Bps=400e6,
        ports="per-neighbor",
        ranks_per_node=4,
        inter_alpha_s=2e-3,
        inter_bandwidth_Bps=50e6,
    )
    intra = cost.link_from_network(net)
    assert intra == LinkModel(1e-3, 1 / 400e6, cost.DEFAULT_GAMMA_S_PER_BYTE, "per-neighbor")
    inter = cost.link_from_network(net, level="inter", gamma=0.0)
    assert inter == LinkModel(2e-3, 1 / 50e6, 0.0, "single")
    # an inter-node message runs at the slower of its hops (cut-through); unset -> intra values
    fast_up = SimpleNamespace(**{**vars(net), "inter_bandwidth_Bps": 1e12})
    assert cost.link_from_network(fast_up, level="inter").beta == pytest.approx(1 / 400e6)
    flat = SimpleNamespace(**{**vars(net), "inter_alpha_s": None, "inter_bandwidth_Bps": None})
    assert cost.link_from_network(flat, level="inter", gamma=0.0) == LinkModel(
        1e-3, 1 / 400e6, 0.0, "single"
    )
    # netem allows infinite bandwidth: beta = 0
    inf = SimpleNamespace(**{**vars(net), "bandwidth_Bps": math.inf})
    assert cost.link_from_network(inf).beta == 0.0
    with pytest.raises(ValueError, match="level"):
        cost.link_from_network(net, level="node")
    with pytest.raises(TypeError, match="alpha_s"):
        cost.link_from_network(object())


# ------------------------------------------------------------------------------------------
# Table and bad arguments
# ------------------------------------------------------------------------------------------


def test_model_table():
    link = LinkModel(10e-6, 1e-10, 1e-10)
    sizes, ps = [0, 4, 2**20, 2**28], [1, 2, 5, 64]
    df = cost.model_table(cost.OPS, cost.ALGORITHMS, sizes, ps, link, cost.PORTS)
    assert list(df.columns) == ["op", "algorithm", "nbytes", "p", "ports", "time_s", "block_bytes"]
    assert len(df) == 3 * 4 * 4 * 4 * 2
    assert df["block_bytes"].isna().sum() == 3 * 3 * 4 * 4 * 2  # not LP
    for row in df.sample(20, random_state=0).itertuples():
        t = cost.collective_time(
            row.op,
            row.algorithm,
            row.nbytes,
            row.p,
            link.with_ports(row.ports),
            None if row.algorithm != "lp" else int(row.block_bytes),
        )
        assert row.time_s == pytest.approx(t)
    fixed = cost.model_table(["broadcast"], ["lp"], [2**20], [8], link, block_bytes=2**16)
    assert fixed["block_bytes"].iloc[0] == 2**16
    assert fixed["time_s"].iloc[0] == cost.broadcast_time("lp", 2**20, 8, link, 2**16)


def test_bad_arguments():
    with pytest.raises(ValueError, match="torch"):
        cost.allreduce_time("torch", 100, 4, LINK)
    with pytest.raises(ValueError, match="algorithm"):
        cost.broadcast_time("tree", 100, 4, LINK)
    with pytest.raises(ValueError, match="op"):
        cost.collective_time("gather", "lp", 100, 4, LINK)
    with pytest.raises(ValueError, match="p must be >= 1"):
        cost.reduce_time("lp", 100, 0, LINK)
    with pytest.raises(ValueError, match="nbytes"):
        cost.reduce_time("lp", -1, 4, LINK)
    with pytest.raises(TypeError, match="nbytes"):
        cost.reduce_time("lp", 1.5, 4, LINK)
    with pytest.raises(ValueError, match="block_bytes"):
        cost.broadcast_time("lp", 100, 4, LINK, 0)
    with pytest.raises(TypeError, match="LinkModel"):
        cost.broadcast_time("lp", 100, 4, (1e-3, 1e-9))
    with pytest.raises(ValueError, match="compression"):
        cost.allreduce_time("be", 100, 4, LINK, compression_ratio=2.0)
    with pytest.raises(ValueError, match="compression_ratio"):
        cost.allreduce_time("ring", 100, 4, LINK, compression_ratio=0.5)
    with pytest.raises(ValueError, match="allreduce"):
        cost.collective_time("broadcast", "lp", 100, 4, LINK, compression_ratio=2.0)
    with pytest.raises(ValueError, match="alpha"):
        LinkModel(-1.0, 1e-9)
    with pytest.raises(ValueError, match="beta"):
        LinkModel(1e-3, math.inf)
    with pytest.raises(TypeError, match="gamma"):
        LinkModel(1e-3, 1e-9, "fast")
    with pytest.raises(ValueError, match="ports"):
        LinkModel(1e-3, 1e-9, ports="dual")
    with pytest.raises(ValueError, match="bandwidth"):
        LinkModel.from_bandwidth(1e-3, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 2**24),
    p=st.integers(2, 64),
    op=st.sampled_from(cost.OPS),
    alg=st.sampled_from(cost.ALGORITHMS),
)
def test_monotone_in_size_and_link(n, p, op, alg):
    slow = LinkModel(2e-5, 2e-9, 1e-9)
    fast = LinkModel(1e-5, 1e-9, 5e-10)
    b = 4096
    t = cost.collective_time(op, alg, n, p, slow, b)
    assert cost.collective_time(op, alg, n, p, fast, b) <= t
    assert cost.collective_time(op, alg, 2 * n, p, slow, b) >= t
    assert t > 0


# --------------------------------------------------------------------------- real backend, one host


def test_host_link_table_interpolation_and_checks():
    link = cost.HostLink(((1000, 1e-3), (3000, 2e-3)), host_links=2.0, gamma=0.0)
    assert link.time(2000) == pytest.approx(1.5e-3)
    assert link.time(500) == pytest.approx(1e-3)  # below the table: its first time
    assert link.time(5000) == pytest.approx(3e-3)  # beyond: the last segment's slope
    assert np.allclose(link.time(np.array([1000, 3000])), [1e-3, 2e-3])
    for bad in (((1000, 1e-3),), ((2000, 1e-3), (1000, 2e-3)), ((1000, 0.0), (2000, 1e-3))):
        with pytest.raises(ValueError, match="table"):
            cost.HostLink(bad)
    with pytest.raises(ValueError, match="host_links"):
        cost.HostLink(cost.DEFAULT_LINK_TABLE, host_links=0)


def _steps_of_lp(op, k, p):
    """Oracle: (messages, combined messages) per step of LP's schedule, by listing every
    message: block j crosses link i (1..p-1) of the first chain at step j + i, and for
    allreduce the broadcast chain's link i at step j + (p - 1) + i."""
    last = k + (2 * p - 3 if op == "allreduce" else p - 2)
    messages, combined = [0] * last, [0] * last
    for j in range(k):
        for i in range(1, p):
            messages[j + i - 1] += 1
            combined[j + i - 1] += op != "broadcast"
            if op == "allreduce":
                messages[j + p - 1 + i - 1] += 1
    return messages, combined


def _lp_on_host_oracle(op, n, p, link, b):
    k = -(-n // b)
    lone = float(link.time(b)) + (op != "broadcast") * link.gamma * b \
        + 2 * link.message_latency_s
    total = 0.0
    for a, r in zip(*_steps_of_lp(op, k, p)):
        shared = a * b / (min(link.host_links, a) * link.rate_Bps) \
            + (2 * a * link.message_overhead_s + r * link.gamma * b) / link.cores
        total += max(lone, shared)
    return total


def test_lp_on_host_model():
    link = cost.HostLink(cost.DEFAULT_LINK_TABLE, host_links=2.0, gamma=1e-9,
                         message_overhead_s=0, message_latency_s=0, cores=2.0)
    n, b = 1 << 26, 1 << 21  # k = 32 blocks
    t = float(link.time(b))
    rate = cost.DEFAULT_LINK_TABLE[-1][0] / cost.DEFAULT_LINK_TABLE[-1][1]
    assert link.rate_Bps == pytest.approx(rate)
    # every step the longer of a lone block and its share of the host, against the oracle
    busy = dataclasses.replace(link, message_overhead_s=1e-4, message_latency_s=3e-4)
    for lk in (link, busy, dataclasses.replace(link, host_links=1.3)):
        for op in ("broadcast", "reduce", "allreduce"):
            for p, bb in ((2, b), (3, b), (5, 3 << 20), (8, b), (8, n // 3 + 8), (8, n)):
                assert cost.lp_time_on_host(op, n, p, lk, bb) == pytest.approx(
                    _lp_on_host_oracle(op, n, p, lk, bb)), (op, p, bb)
    # p = 3: two links, each step's share (at most 2 blocks at 2 lone links' rate) is below a
    # lone block's time: the critical path, k + p - 2 = 33 steps
    assert cost.lp_time_on_host("broadcast", n, 3, link, b) == pytest.approx(33 * t)
    # p = 8 with many blocks: the host's work (7 n bytes at 2 lone links' rate) plus at most the
    # fill and drain steps (p - 2 at each end) at a lone block's time
    work = 7 * n / (2 * rate)
    assert work < cost.lp_time_on_host("broadcast", n, 8, link, b) <= work + 2 * 6 * t
    assert cost.lp_time_on_host("reduce", 0, 8, link, b) == 0.0
    assert cost.lp_time_on_host("reduce", n, 1, link, b) == 0.0
    # the chosen block is the grid's best and no worse than neighbours far off
    for op in ("broadcast", "reduce", "allreduce"):
        for p in (3, 4, 8):
            best = cost.lp_block_bytes_on_host(op, n, p, link)
            assert best % 8 == 0 and 65536 <= best <= n
            t_best = cost.lp_time_on_host(op, n, p, link, best)
            for other in (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24, n):
                assert t_best <= cost.lp_time_on_host(op, n, p, link, other) * (1 + 1e-12)
    assert cost.lp_block_bytes_on_host("broadcast", n, 2, link) == n  # no chain to pipeline
    assert cost.lp_block_bytes_on_host("allreduce", 1000, 8, link) == 1000
    with pytest.raises(TypeError, match="HostLink"):
        cost.lp_time_on_host("broadcast", n, 8, cost.calibrated_link(), b)
    # per message: two latencies per lone step, two overheads per message of a step's share on
    # the cores
    assert cost.lp_time_on_host("broadcast", n, 3, busy, b) == pytest.approx(33 * (t + 6e-4))
    assert cost.lp_block_bytes_on_host("allreduce", n, 8, busy) >= cost.lp_block_bytes_on_host(
        "allreduce", n, 8, link
    )
    with pytest.raises(ValueError, match="message_overhead_s"):
        cost.HostLink(cost.DEFAULT_LINK_TABLE, message_overhead_s=-1.0)
    with pytest.raises(ValueError, match="message_latency_s"):
        cost.HostLink(cost.DEFAULT_LINK_TABLE, message_latency_s=-1.0)


def test_host_link_from_calibration(tmp_path, monkeypatch):
    monkeypatch.delenv("PIPECOMM_CALIBRATION", raising=False)
    assert cost.host_link().table == cost.DEFAULT_LINK_TABLE
    cal = {"alpha_s": 1e-4, "beta_s_per_byte": 1e-9, "gamma_s_per_byte": 2e-10}
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(cal))
    assert cost.host_link(path).table == cost.DEFAULT_LINK_TABLE  # no table anywhere
    (tmp_path / "data.csv").write_text(
        "pair,nbytes,time_s,section\n0-1,65536,2e-4,real\n0-1,65536,4e-4,real\n"
        "0-1,1048576,1e-3,real\n0-2,1048576,9.0,real\n0-1,1048576,7.0,emulated\n"
    )
    link = cost.host_link(path)
    assert np.allclose(link.table, ((65536, 3e-4), (1048576, 1e-3))) and link.gamma == 2e-10
    assert not link.host_links_measured and link.host_links == cost.HostLink((
        (1, 1.0), (2, 2.0))).host_links  # no host section in E0's record: the default
    path.write_text(
        json.dumps(
            {**cal, "link_table": {"nbytes": [10, 20], "time_s": [1.0, 2.0]}, "host_links": 3}
        )
    )
    monkeypatch.setenv("PIPECOMM_CALIBRATION", str(path))
    link = cost.host_link()
    assert link.table == ((10, 1.0), (20, 2.0)) and link.host_links == 3.0
    assert link.host_links_measured
    monkeypatch.delenv("PIPECOMM_CALIBRATION")
    assert not cost.host_link().host_links_measured  # the fallback table and core count


def test_lp_overlap_check_tool_on_the_reference():
    """tools/lp_overlap_check.py reads E2's reference data and prints both LP forms per size."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tools/lp_overlap_check.py"),
                          str(root / "artifact/reference/cpu/E2/data.csv.gz")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = [line.split() for line in out.splitlines()[1:]]
    assert len(rows) >= 5 and all(line.count("ms") == 3 for line in out.splitlines()[1:])
    assert int(rows[-1][0]) == 64 << 20


# --------------------------------------------------------------------------- the overlapped model

REFERENCE = Path(__file__).resolve().parents[1] / "artifact" / "reference" / "cpu"
E0_ALPHA = 0.00012428841988898522  # an E0's per-message latency (124 us): a host cost per block


def test_overlapped_broadcast_and_reduce_by_hand():
    """Closed forms against a float64 hand computation (docs/algorithms.md)."""
    link = cost.LinkModel(alpha=2e-3, beta=1 / 50e6, gamma=1e-9)
    n, p, b, h = 1_000_000, 5, 300_000, 1e-4  # k = 4 blocks, the last of 100 000 bytes
    want = 4 * 2e-3 + (1_000_000 + 3 * 300_000) / 50e6 + 4 * 1e-4
    assert cost.lp_overlapped_time("broadcast", n, p, link, b, h) == pytest.approx(want, rel=1e-12)
    want_r = want + (3 * 300_000 + 100_000) * 1e-9
    assert cost.lp_overlapped_time("reduce", n, p, link, b, h) == pytest.approx(want_r, rel=1e-12)
    # one block: the p - 1 hops of the whole message, latency and bytes each time
    assert cost.lp_overlapped_time("broadcast", n, p, link, n, 0.0) == pytest.approx(
        4 * (2e-3 + n / 50e6), rel=1e-12)
    assert cost.lp_overlapped_time("broadcast", 0, p, link, b, h) == 0.0
    assert cost.lp_overlapped_time("allreduce", n, 1, link, b, h) == 0.0


def test_overlapped_allreduce_by_hand():
    """The replay against hand-derived cases: per-neighbor with one block is a reduce and a
    broadcast of the whole message back to back (2 (p - 1) hops, p - 1 combines); with two
    ranks the two directions never share a port, so single and per-neighbor agree."""
    n = 1 << 20
    pn = cost.LinkModel(alpha=1e-3, beta=1e-8, gamma=1e-9, ports="per-neighbor")
    want = 2 * 3 * (1e-3 + n * 1e-8) + 3 * n * 1e-9
    assert cost.lp_overlapped_time("allreduce", n, 4, pn, n, 0.0) == pytest.approx(want, rel=1e-12)
    single = pn.with_ports("single")
    for b in (n, n // 4, 3000):
        assert cost.lp_overlapped_time("allreduce", n, 2, single, b, 0.0) == pytest.approx(
            cost.lp_overlapped_time("allreduce", n, 2, pn, b, 0.0), rel=1e-12)
    # k blocks at p = 2 per-neighbor: the last block's partial sum arrives after alpha + n beta,
    # is combined, and goes back: alpha + b beta (the link back is idle)
    b = n // 4
    want2 = (1e-3 + n * 1e-8) + b * 1e-9 + (1e-3 + b * 1e-8)
    assert cost.lp_overlapped_time("allreduce", n, 2, pn, b, 0.0) == pytest.approx(want2, rel=1e-9)


def test_overlapped_never_above_lock_step_for_broadcast():
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6)
    for p in (3, 8, 16):
        for b in (4096, 65536, 1 << 20):
            assert cost.lp_overlapped_time("broadcast", 64 << 20, p, link, b) <= \
                cost.broadcast_time("lp", 64 << 20, p, link, b)


def test_overlapped_block_optimum():
    """k* = sqrt((p - 2) n beta / h): the paper's form with the host's cost per block for
    alpha; with h = 0 every smaller block is faster (the smallest allowed wins)."""
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6)
    n, p, h = 4 << 20, 8, 124e-6
    b = cost.lp_overlapped_block_bytes("broadcast", n, p, link, h)
    assert b == 65536
    analytic = math.sqrt(n * h / ((p - 2) * link.beta))
    assert 0.7 < b / analytic < 1.4
    assert cost.lp_overlapped_block_bytes("broadcast", n, p, link, 0.0) == 4096
    assert cost.lp_overlapped_block_bytes("broadcast", n, 2, link, h) == n
    with pytest.raises(ValueError, match="host_block_s"):
        cost.lp_overlapped_time("broadcast", n, p, link, b, -1.0)


def test_overlapped_time_dispatch():
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6)
    for alg in ("mst", "be", "ring"):
        assert cost.overlapped_time("broadcast", alg, 1 << 20, 8, link) == \
            cost.broadcast_time(alg, 1 << 20, 8, link)
    b = cost.lp_optimal_block_bytes("broadcast", 1 << 20, 8, link)
    assert cost.overlapped_time("broadcast", "lp", 1 << 20, 8, link, host_block_s=1e-4) == \
        cost.lp_overlapped_time("broadcast", 1 << 20, 8, link, b, 1e-4)


def _model_errors(rows, h):
    errs = []
    for r in rows.itertuples():
        link = cost.LinkModel.from_bandwidth(r.emu_alpha_s, r.emu_bandwidth_Bps,
                                             gamma=r.model_gamma_s_per_byte, ports=r.ports)
        m = cost.lp_overlapped_time(r.op, int(r.nbytes), int(r.world_size), link,
                                    int(r.block_bytes), h)
        errs.append((r.time_s - m) / m)
    return errs


def _reference_host_block_s() -> float:
    """The host cost per block the reference run's models used: its E0's per-message latency."""
    import json

    return json.loads((REFERENCE / "E0" / "calibration.json").read_text())["alpha_s"]


def test_overlapped_model_on_the_e2_reference():
    """Every emulated LP point >= 1 MiB of the reference E2 run (broadcast; allreduce single and
    per-neighbor) within 10% of the overlapped model (the accuracy C4.2 assumes), the lock-step
    model's worst point above 25%. Below 1 MiB, where a few blocks' host costs and the fill
    dominate, the model is known to under-price LP by up to about 20% (docs/algorithms.md)."""
    df = pd.read_csv(REFERENCE / "E2" / "data.csv.gz")
    lp = df[(df.section == "emulated") & (df.algorithm == "lp")]
    assert len(lp) == 21
    big = lp[lp.nbytes >= 1 << 20]
    errs = _model_errors(big, _reference_host_block_s())
    assert len(errs) == 12 and max(abs(e) for e in errs) < 0.10, errs
    lock = []
    for r in big.itertuples():  # the paper's lock-step model on the same points, for contrast
        link = cost.LinkModel.from_bandwidth(r.emu_alpha_s, r.emu_bandwidth_Bps,
                                             gamma=r.model_gamma_s_per_byte, ports=r.ports)
        m = cost.collective_time(r.op, "lp", int(r.nbytes), int(r.world_size), link,
                                 int(r.block_bytes))
        lock.append(abs(r.time_s - m) / m)
    assert max(lock) > 0.25


def test_overlapped_model_on_the_e4_reference():
    """Every block >= 16 KiB of the reference E4 grid (4 MiB broadcast, p = 8) within 10% of the
    overlapped model, and the measured best block within a factor 2 of its optimum (C4.1's
    rule). Blocks below 16 KiB (k > 256) cost more than ``k h`` says: the model's first-order
    host term is known to miss there (C4.2's 8x-smaller point)."""
    df = pd.read_csv(REFERENCE / "E4" / "data.csv.gz").assign(ports="single")
    h = _reference_host_block_s()
    errs = _model_errors(df[df.block_bytes >= 16 << 10], h)
    assert len(errs) >= 8 and max(abs(e) for e in errs) < 0.10, errs
    small = _model_errors(df[df.block_bytes < 16 << 10], h)
    assert small and min(small) > 0  # the known miss has one sign: slower than modelled
    link = cost.LinkModel.from_bandwidth(2e-3, 50e6)
    best = int(df.loc[df.time_s.idxmin(), "block_bytes"])
    model = cost.lp_overlapped_block_bytes("broadcast", 4 << 20, 8, link, h)
    assert model / 2 <= best <= 2 * model, (best, model)
