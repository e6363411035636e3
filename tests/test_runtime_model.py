"""Tests of pipecomm.lab.training.dadam_runtime_model: closed-form limits, the three factors, errors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from pipecomm.decentralized.topology import get_topology
from pipecomm.lab.training import dadam_runtime_model as rm


@dataclass(frozen=True)
class Link:
    """Stand-in for pipecomm.lab.networks.cost.LinkModel (the model only reads alpha, beta, gamma, ports)."""

    alpha: float
    beta: float
    gamma: float = 0.0
    ports: str = "single"


def ring_time(algorithm, nbytes, p, link, block_bytes=None):
    """Ring allreduce, Patarasuk & Yuan: 2(p-1)(alpha + n/p beta)."""
    if p == 1 or nbytes == 0:
        return 0.0
    return 2 * (p - 1) * (link.alpha + nbytes / p * link.beta)


def const_time(c):
    def fn(algorithm, nbytes, p, link, block_bytes=None):
        return 0.0 if p == 1 or nbytes == 0 else c

    return fn


INTRA = Link(alpha=1e-5, beta=1e-10)
INTER = Link(alpha=1e-4, beta=1e-9)


def base(**kw):
    args = dict(
        bucket_bytes=[1e6, 2e6, 3e6],
        fwd_s=[0.001, 0.002, 0.003],
        bwd_s=0.004,
        p=8,
        ranks_per_node=4,
        intra=INTRA,
        inter=INTER,
        iterations=30,
        collective_time_fn=ring_time,
    )
    args.update(kw)
    return args


# --- closed-form limits ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,topo",
    [
        ("allreduce", None),
        ("decentralized", "complete"),
        ("decentralized", "aer"),
        ("decentralized", "ring"),
        ("decentralized", "one-peer-exp"),
        ("decentralized", "random-matching"),
    ],
)
def test_zero_communication_gives_compute_time(kind, topo):
    r = rm.simulate(kind, topology=topo, **base(bucket_bytes=[0, 0, 0], step_s=0.0005))
    compute = 0.006 + 3 * 0.004 + 3 * 0.0005
    assert r["compute_s"] == pytest.approx(compute)
    assert r["mean_iteration_s"] == pytest.approx(compute, rel=1e-12)
    assert all(t == pytest.approx(compute) for t in r["iteration_s"])
    assert r["comm_s"] == 0.0 and r["exposed_s"] == pytest.approx(0.0, abs=1e-12)


def test_allreduce_closed_form_one_bucket():
    """One bucket: nothing to overlap; iteration = compute + allreduce."""
    r = rm.simulate(
        "allreduce",
        **base(bucket_bytes=[8e6], fwd_s=0.01, bwd_s=0.02, collective_time_fn=const_time(0.05)),
    )
    assert r["mean_iteration_s"] == pytest.approx(0.08, rel=1e-12)
    assert r["comm_s"] == pytest.approx(0.05)


def test_allreduce_overlaps_rest_of_backward():
    """Backward order 2, 1, 0 (bwd 4 ms each); comm 1 ms per bucket hides behind later
    buckets' backward except the last (bucket 0): iteration = 6 + 12 + 1 ms."""
    r = rm.simulate("allreduce", **base(collective_time_fn=const_time(0.001)))
    assert r["mean_iteration_s"] == pytest.approx(0.019, rel=1e-12)


def test_allreduce_communication_bound():
    """Huge allreduces serialise after the first bucket is ready: fwd + bwd[last] + sum C."""
    c = [10.0, 20.0, 30.0]

    def fn(algorithm, nbytes, p, link, block_bytes=None):
        return c[[1_000_000, 2_000_000, 3_000_000].index(nbytes)]

    r = rm.simulate("allreduce", **base(collective_time_fn=fn))
    assert r["mean_iteration_s"] == pytest.approx(0.006 + 0.004 + 60.0, rel=1e-12)


@pytest.mark.parametrize("topo", ["complete", "aer", "ring", "one-peer-exp"])
def test_decentralized_communication_bound(topo):
    """With huge gossip the communication stream never idles: iteration = its busy time."""
    r = rm.simulate("decentralized", topology=topo, **base(collective_time_fn=const_time(5.0)))
    assert r["mean_iteration_s"] == pytest.approx(15.0, rel=1e-9)
    assert r["comm_s"] == pytest.approx(15.0)


@pytest.mark.parametrize("compute,comm", [(0.02, 0.05), (0.05, 0.02), (0.03, 0.03)])
def test_decentralized_overlaps_a_whole_iteration(compute, comm):
    """One bucket, complete topology: allreduce = compute + C, gossip = max(compute, C)."""
    kw = base(
        bucket_bytes=[1e6],
        fwd_s=compute / 2,
        bwd_s=compute / 2,
        collective_time_fn=const_time(comm),
    )
    ar = rm.simulate("allreduce", **kw)["mean_iteration_s"]
    de = rm.simulate("decentralized", topology="complete", **kw)["mean_iteration_s"]
    assert ar == pytest.approx(compute + comm, rel=1e-12)
    assert de == pytest.approx(max(compute, comm), rel=1e-12)


def test_complete_without_overlap_opportunity_equals_allreduce():
    """No compute to hide behind: decentralized complete == AllReduce == sum of allreduces."""
    kw = base(fwd_s=0.0, bwd_s=0.0)
    ar = rm.simulate("allreduce", **kw)["mean_iteration_s"]
    de = rm.simulate("decentralized", topology="complete", **kw)["mean_iteration_s"]
    expected = sum(ring_time("ring", n, 8, INTER) for n in (1e6, 2e6, 3e6))
    assert ar == pytest.approx(expected, rel=1e-12)
    assert de == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_decentralized_complete_never_slower_than_allreduce(seed):
    rng = np.random.default_rng(seed)
    nb = int(rng.integers(1, 6))
    kw = base(
        bucket_bytes=rng.uniform(1e5, 2e7, nb).tolist(),
        fwd_s=rng.uniform(0, 0.01, nb).tolist(),
        bwd_s=rng.uniform(0, 0.02, nb).tolist(),
        p=int(rng.choice([2, 4, 8, 16])),
        ranks_per_node=2,
    )
    ar = rm.simulate("allreduce", **kw)["mean_iteration_s"]
    de = rm.simulate("decentralized", topology="complete", **kw)["mean_iteration_s"]
    assert de <= ar * (1 + 1e-12)
    assert de >= (sum(kw["fwd_s"]) + sum(kw["bwd_s"])) * (1 - 1e-12)  # never beats compute


# --- factor 2: heterogeneous links ------------------------------------------------------------


def test_group_time_closed_form():
    n = 8e6
    # inside one node: intra link
    assert rm.group_allreduce_time(
        (0, 1, 2, 3), n, ranks_per_node=4, intra=INTRA, inter=INTER, collective_time_fn=ring_time
    ) == ring_time("ring", n, 4, INTRA)
    # an AER node pair: one ring edge leaves each node -> the plain inter link
    g = tuple(range(8))
    assert rm.group_allreduce_time(
        g, n, ranks_per_node=4, intra=INTRA, inter=INTER, collective_time_fn=ring_time
    ) == ring_time("ring", n, 8, INTER)
    # sharing="all": the 4 ranks of each node share its uplink -> beta x 4
    t_all = rm.group_allreduce_time(
        g,
        n,
        ranks_per_node=4,
        intra=INTRA,
        inter=INTER,
        sharing="all",
        collective_time_fn=ring_time,
    )
    assert t_all == pytest.approx(ring_time("ring", n, 8, Link(INTER.alpha, 4 * INTER.beta)))
    # singleton and empty message cost nothing
    assert (
        rm.group_allreduce_time(
            (3,), n, ranks_per_node=4, intra=INTRA, inter=INTER, collective_time_fn=ring_time
        )
        == 0.0
    )
    assert (
        rm.group_allreduce_time(
            g, 0, ranks_per_node=4, intra=INTRA, inter=INTER, collective_time_fn=ring_time
        )
        == 0.0
    )


def test_uplink_streams():
    assert rm.uplink_streams([tuple(range(8))], 4) == {0: 1, 1: 1}
    assert rm.uplink_streams([tuple(range(8))], 4, "be") == {0: 4, 1: 4}
    assert rm.uplink_streams([tuple(range(8))], 4, "ring", "all") == {0: 4, 1: 4}
    assert rm.uplink_streams([tuple(range(12))], 4, "lp") == {0: 1, 1: 2, 2: 1}
    assert rm.uplink_streams([tuple(range(12))], 4, "ring") == {0: 1, 1: 1, 2: 1}
    # one-peer-exp round XOR 4 with 4 ranks per node: four pairs share each uplink
    pairs = get_topology("one-peer-exp", 8).groups(2)
    assert rm.uplink_streams(pairs, 4) == {0: 4, 1: 4}
    assert rm.uplink_streams(get_topology("one-peer-exp", 8).groups(0), 4) == {}
    # ring with two nodes of 4, odd step: pairs (0, 7) and (3, 4) both cross between the nodes
    assert rm.uplink_streams(get_topology("ring", 8).groups(1), 4) == {0: 2, 1: 2}
    assert rm.uplink_streams(get_topology("ring", 8).groups(0), 4) == {}


def test_concurrent_groups_share_the_uplink():
    times = rm.step_comm_times(
        get_topology("one-peer-exp", 8).groups(2),
        [4e6],
        ranks_per_node=4,
        intra=INTRA,
        inter=INTER,
        collective_time_fn=ring_time,
    )
    expected = ring_time("ring", 4e6, 2, Link(INTER.alpha, 4 * INTER.beta))
    assert all(row == [pytest.approx(expected)] for row in times)


def test_aer_beats_allreduce_when_inter_node_link_is_slow():
    kw = base(
        bucket_bytes=[20e6] * 4,
        fwd_s=0.005,
        bwd_s=0.01,
        p=16,
        ranks_per_node=4,
        inter=Link(alpha=1e-4, beta=1 / 1e9),
        intra=Link(alpha=1e-5, beta=1 / 100e9),
    )
    ar = rm.simulate("allreduce", **kw)["mean_iteration_s"]
    aer = rm.simulate("decentralized", topology="aer", **kw)["mean_iteration_s"]
    assert aer < 0.8 * ar


def test_slower_inter_link_hurts_cross_node_topologies_only():
    slow = Link(alpha=1e-4, beta=1e-8)
    fast_kw = base(p=8, ranks_per_node=8)  # one node: inter link unused
    slow_kw = base(p=8, ranks_per_node=8, inter=slow)
    for kind, topo in (("allreduce", None), ("decentralized", "ring")):
        a = rm.simulate(kind, topology=topo, **fast_kw)["mean_iteration_s"]
        b = rm.simulate(kind, topology=topo, **slow_kw)["mean_iteration_s"]
        assert a == b
    a = rm.simulate("allreduce", **base())["mean_iteration_s"]
    b = rm.simulate("allreduce", **base(inter=slow))["mean_iteration_s"]
    assert b > a


# --- factor 3: varying compute -----------------------------------------------------------------


def test_allreduce_with_compute_noise_is_gated_by_slowest_rank():
    """Zero communication: each iteration lasts the slowest rank's compute (same samples)."""
    cv, iters, seed, p = 0.3, 40, 5, 8
    r = rm.simulate(
        "allreduce",
        **base(bucket_bytes=[0, 0, 0], compute_cv=cv, iterations=iters, seed=seed, warmup=0),
    )
    factors = rm.lognormal_factors(cv, (iters, p), np.random.default_rng(seed))
    expected = factors.max(axis=1) * 0.018
    np.testing.assert_allclose(r["iteration_s"], expected, rtol=1e-12)


def test_lognormal_factors_mean_and_cv():
    f = rm.lognormal_factors(0.25, 200_000, np.random.default_rng(0))
    assert f.mean() == pytest.approx(1.0, rel=5e-3)
    assert f.std() / f.mean() == pytest.approx(0.25, rel=2e-2)
    assert (rm.lognormal_factors(0.0, (3, 2), np.random.default_rng(0)) == 1).all()


@pytest.mark.parametrize("topo", ["ring", "aer", "one-peer-exp"])
def test_compute_variance_hurts_allreduce_more_than_gossip(topo):
    kw = base(bucket_bytes=[1e5] * 3, p=16, ranks_per_node=4, iterations=200)
    slowdown = {}
    for kind, t in (("allreduce", None), ("decentralized", topo)):
        calm = rm.simulate(kind, topology=t, compute_cv=0.0, **kw)["mean_iteration_s"]
        noisy = rm.simulate(kind, topology=t, compute_cv=0.4, **kw)["mean_iteration_s"]
        assert noisy > calm
        slowdown[kind] = noisy / calm
    assert slowdown["decentralized"] < slowdown["allreduce"] - 0.1


# --- monotonicity, determinism -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,topo", [("allreduce", None), ("decentralized", "aer"), ("decentralized", "one-peer-exp")]
)
def test_monotone_in_bytes_bandwidth_and_compute(kind, topo):
    def t(**kw):
        return rm.simulate(kind, topology=topo, **base(compute_cv=0.1, **kw))["mean_iteration_s"]

    sizes = [t(bucket_bytes=[s * 1e6] * 3) for s in (0, 1, 4, 16, 64)]
    assert sizes == sorted(sizes) and sizes[-1] > sizes[0]
    bws = [t(inter=Link(1e-4, 1 / bw)) for bw in (1e11, 1e10, 1e9, 1e8)]
    assert bws == sorted(bws) and bws[-1] > bws[0]
    comp = [t(bwd_s=b) for b in (0.0, 0.004, 0.02, 0.1)]
    assert comp == sorted(comp) and comp[-1] > comp[0]


def test_deterministic_for_a_seed():
    kw = base(compute_cv=0.2)
    a = rm.simulate("decentralized", topology="ring", seed=3, **kw)
    b = rm.simulate("decentralized", topology="ring", seed=3, **kw)
    c = rm.simulate("decentralized", topology="ring", seed=4, **kw)
    assert a == b and a["iteration_s"] != c["iteration_s"]


def test_result_fields_and_topology_object():
    topo = get_topology("aer", 8, ranks_per_node=4)
    r = rm.simulate("decentralized", topology=topo, **base(iterations=20, warmup=5))
    assert len(r["iteration_s"]) == 15
    assert r["topology"] == "alternating-exp-ring" and r["kind"] == "decentralized"
    assert r["p"] == 8 and r["ranks_per_node"] == 4 and r["algorithm"] == "ring"
    assert r["mean_iteration_s"] == pytest.approx(np.mean(r["iteration_s"]))
    assert r["exposed_s"] == pytest.approx(r["mean_iteration_s"] - r["compute_s"])


def test_with_pipecomm_cost():
    cost = pytest.importorskip("pipecomm.lab.networks.cost")
    intra = cost.LinkModel(alpha=5e-6, beta=1 / 100e9)
    inter = cost.LinkModel(alpha=20e-6, beta=1 / 1e9)
    kw = dict(
        bucket_bytes=[25e6] * 4,
        fwd_s=0.01,
        bwd_s=0.02,
        p=16,
        ranks_per_node=4,
        intra=intra,
        inter=inter,
        iterations=20,
    )
    for alg in ("ring", "lp", "be", "mst"):
        ar = rm.simulate("allreduce", algorithm=alg, **kw)
        de = rm.simulate("decentralized", topology="aer", algorithm=alg, **kw)
        assert ar["mean_iteration_s"] > ar["compute_s"]
        assert de["mean_iteration_s"] < ar["mean_iteration_s"]
    # an AER node pair with the ring algorithm: 2(m-1)(alpha + n/m beta) on the inter link
    t = rm.group_allreduce_time(tuple(range(8)), 8e6, ranks_per_node=4, intra=intra, inter=inter)
    assert t == pytest.approx(cost.allreduce_time("ring", 8_000_000, 8, inter))
    # the default collective_time_fn is cost.allreduce_time
    t2 = rm.group_allreduce_time((0, 4), 8e6, ranks_per_node=4, intra=intra, inter=inter, streams=3)
    assert t2 == pytest.approx(
        cost.allreduce_time("ring", 8_000_000, 2, cost.LinkModel(alpha=20e-6, beta=3 / 1e9))
    )


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(kind="gossip"), ValueError, "kind must be one of"),
        (dict(kind="decentralized"), ValueError, "needs topology="),
        (
            dict(kind="decentralized", topology="one-peer-exp", p=12, ranks_per_node=4),
            ValueError,
            "power-of-two",
        ),
        (
            dict(kind="decentralized", topology=get_topology("ring", 4)),
            ValueError,
            "world_size=4, not 8",
        ),
        (dict(p=0), ValueError, "p must be >= 1"),
        (dict(p=8.0), TypeError, "p must be an int"),
        (dict(ranks_per_node=3), ValueError, "ranks_per_node=3 must divide p=8"),
        (dict(bucket_bytes=[]), ValueError, "at least one bucket"),
        (dict(bucket_bytes=5e6), TypeError, "bucket_bytes must be a sequence"),
        (dict(bucket_bytes=[1e6, -1]), ValueError, "bucket_bytes must be finite and >= 0"),
        (dict(fwd_s=[0.1, 0.2]), ValueError, "fwd_s has 2 entries; bucket_bytes has 3"),
        (dict(bwd_s=-0.1), ValueError, "bwd_s must be finite and >= 0"),
        (dict(bwd_s="fast"), TypeError, "bwd_s must be a number or a sequence"),
        (dict(compute_cv=-0.1), ValueError, "compute_cv must be finite and >= 0"),
        (dict(iterations=1), ValueError, "iterations must be >= 2"),
        (dict(iterations=10, warmup=10), ValueError, "warmup=10 must be < iterations=10"),
        (dict(sharing="some"), ValueError, "sharing must be one of"),
        (dict(algorithm=3), TypeError, "algorithm must be a string"),
    ],
)
def test_bad_arguments(kw, exc, match):
    args = base()
    kind = kw.pop("kind", "allreduce")
    args.update(kw)
    with pytest.raises(exc, match=match):
        rm.simulate(kind, **args)


def test_bad_algorithm_reaches_cost():
    cost = pytest.importorskip("pipecomm.lab.networks.cost")
    args = base(intra=cost.LinkModel(1e-5, 1e-10), inter=cost.LinkModel(1e-4, 1e-9))
    args.pop("collective_time_fn")
    with pytest.raises(ValueError, match="algorithm"):
        rm.simulate("allreduce", algorithm="carrier-pigeon", **args)


def test_overlapped_ring_is_a_collective_time_fn_of_the_runtime_model():
    """E11/E12's overlapped model: simulate's schedule with each group allreduce replayed on
    the emulator's port arithmetic (pipecomm.lab.training.dadam_timing.OverlappedRing)."""
    import pytest as _pytest

    from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network
    from pipecomm.lab.training.dadam_timing import OverlappedRing, overlapped_gossip_time

    net = make_network(DEFAULT_NETWORK)
    n = 1 << 20
    ring = OverlappedRing(net, 2, 4, [[(0, 1), (2, 3)], [(0, 1, 2, 3)]], [n], "ring")
    inside = rm.group_allreduce_time((0, 1), n, ranks_per_node=2, intra=ring.intra,
                                                inter=ring.inter, collective_time_fn=ring)
    assert inside == _pytest.approx(overlapped_gossip_time([(0, 1), (2, 3)], [n], 2, net,
                                                           "ring"))
    across = rm.group_allreduce_time((0, 1, 2, 3), n, ranks_per_node=2,
                                                intra=ring.intra, inter=ring.inter,
                                                collective_time_fn=ring)
    assert across == _pytest.approx(overlapped_gossip_time([(0, 1, 2, 3)], [n], 2, net, "ring"))
    with _pytest.raises(KeyError, match="no replay"):
        ring("ring", 2 * n, 4, ring.inter)
    with _pytest.raises(ValueError, match="algorithm"):
        OverlappedRing(net, 2, 4, [[(0, 1)]], [n], "be")
