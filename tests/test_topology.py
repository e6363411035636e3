"""Tests of pipecomm.decentralized.topology against independent definitions of each schedule."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pipecomm.decentralized import topology as T
from pipecomm.decentralized.topology import get_topology

SIZES = (2, 4, 6, 8, 16)


def _all_cases():
    """(name, world_size, ranks_per_node) for every topology and every size it accepts."""
    cases = []
    for p in (1, *SIZES):
        cases.append(("complete", p, None))
        cases.append(("random-matching", p, None))
        if p == 1 or p % 2 == 0:
            cases.append(("ring", p, None))
        if p & (p - 1) == 0:
            cases.append(("one-peer-exp", p, None))
    for p, rpn in (
        (2, 1),
        (2, 2),
        (4, 1),
        (4, 2),
        (4, 4),
        (6, 6),
        (8, 2),
        (8, 4),
        (16, 4),
        (16, 2),
        (16, 1),
        (32, 4),
    ):
        cases.append(("alternating-exp-ring", p, rpn))
    return cases


CASES = _all_cases()


def _steps(topo):
    return range(2 * (topo.period or 5) + 1)


# --- structure ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,rpn", CASES)
def test_groups_partition_sorted(name, p, rpn):
    topo = get_topology(name, p, ranks_per_node=rpn)
    for s in _steps(topo):
        groups = topo.groups(s)
        assert groups == sorted(groups)
        assert all(g == tuple(sorted(g)) and len(g) >= 1 for g in groups)
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(p))  # a partition: every rank exactly once
        for r in range(p):
            assert r in topo.group_of(r, s)


@pytest.mark.parametrize("name,p,rpn", CASES)
def test_mixing_matrix_doubly_stochastic_and_from_groups(name, p, rpn):
    topo = get_topology(name, p, ranks_per_node=rpn)
    for s in _steps(topo):
        w = topo.mixing_matrix(s)
        assert w.shape == (p, p) and w.dtype == np.float64
        np.testing.assert_allclose(w.sum(axis=0), 1.0, rtol=0, atol=1e-12)
        np.testing.assert_allclose(w.sum(axis=1), 1.0, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(w, w.T)
        assert (w >= 0).all()
        for i in range(p):
            g = topo.group_of(i, s)
            for j in range(p):
                assert w[i, j] == (1.0 / len(g) if j in g else 0.0)


@pytest.mark.parametrize("name,p,rpn", [c for c in CASES if c[0] != "random-matching"])
def test_period_repeats(name, p, rpn):
    topo = get_topology(name, p, ranks_per_node=rpn)
    per = topo.period
    assert isinstance(per, int) and per >= 1
    for s in range(per):
        assert topo.groups(s) == topo.groups(s + per) == topo.groups(s + 7 * per)
    assert set(topo.distinct_groups()) == {g for s in range(per) for g in topo.groups(s)}


# --- definitions, written independently -----------------------------------------------------------


@pytest.mark.parametrize("p", (1, *SIZES, 7))
def test_complete(p):
    topo = get_topology("complete", p)
    assert topo.period == 1
    for s in range(3):
        assert topo.groups(s) == [tuple(range(p))]
    np.testing.assert_allclose(topo.mixing_matrix(5), np.full((p, p), 1 / p))


@pytest.mark.parametrize("p", SIZES)
def test_ring_alternates_the_two_matchings(p):
    topo = get_topology("ring", p)
    assert topo.period == 2
    for s in range(6):
        w = topo.mixing_matrix(s)
        for i in range(p):
            # even steps: 2i <-> 2i+1; odd steps: 2i+1 <-> 2i+2 (mod p)
            partner = (i ^ 1) if s % 2 == 0 else ((i + 1) % p if i % 2 else (i - 1) % p)
            expected = np.zeros(p)
            expected[[i, partner]] = 0.5
            np.testing.assert_array_equal(w[i], expected)
    # over the period every ring edge (i, i+1) is used
    edges = {g for s in range(2) for g in topo.groups(s)}
    assert edges == {tuple(sorted((i, (i + 1) % p))) for i in range(p)}


@pytest.mark.parametrize("p", (2, 4, 8, 16))
def test_one_peer_exp_xor(p):
    topo = get_topology("one-peer-exp", p)
    rounds = int(math.log2(p))
    assert topo.period == rounds
    for s in range(2 * rounds + 1):
        r = s % rounds
        for j in range(p):
            assert topo.group_of(j, s) == tuple(sorted((j, j ^ (1 << r))))


def _aer_reference(p, rpn, step):
    """AER written from its definition with Python sets (independent of the implementation)."""
    n_nodes = p // rpn

    def node(a):
        return list(range(a * rpn, (a + 1) * rpn))

    if n_nodes == 1:
        return [tuple(node(0))]
    rounds = int(round(math.log2(n_nodes)))
    r = (step // 2) % rounds
    phase = step % 2
    pairs = sorted({tuple(sorted((a, a ^ (1 << r)))) for a in range(n_nodes)})
    out = []
    for q, (a, b) in enumerate(pairs):
        inter = phase != q % 2
        out += [tuple(node(a) + node(b))] if inter else [tuple(node(a)), tuple(node(b))]
    return sorted(out)


@pytest.mark.parametrize("p,rpn", [(2, 1), (4, 2), (8, 2), (8, 4), (16, 4), (16, 2), (32, 4)])
def test_aer_matches_definition(p, rpn):
    topo = get_topology("alternating-exp-ring", p, ranks_per_node=rpn)
    n_nodes = p // rpn
    assert topo.period == 2 * int(math.log2(n_nodes))
    for s in range(2 * topo.period):
        assert topo.groups(s) == _aer_reference(p, rpn, s)


@pytest.mark.parametrize("p,rpn", [(8, 2), (16, 4), (16, 2), (32, 4), (16, 1)])
def test_aer_staggering_half_the_nodes_cross(p, rpn):
    """With >= 4 nodes exactly half of the nodes are in a cross-node group at every step."""
    topo = get_topology("aer", p, ranks_per_node=rpn)
    n_nodes = p // rpn
    assert n_nodes >= 4
    for s in range(2 * topo.period):
        crossing = set()
        for g in topo.groups(s):
            nodes = {r // rpn for r in g}
            assert len(nodes) in (1, 2)  # a node alone or a node pair
            if len(nodes) == 1:
                assert len(g) == rpn  # intra-node step: the whole node
            else:
                assert len(g) == 2 * rpn  # inter-node step: both whole nodes
                crossing |= nodes
        assert len(crossing) == n_nodes // 2
        assert topo.inter_node_nodes(s) == sorted(crossing)
    # every node crosses in exactly one of the two phases of a round, each round
    for start in range(0, topo.period, 2):
        both = topo.inter_node_nodes(start) + topo.inter_node_nodes(start + 1)
        assert sorted(both) == list(range(n_nodes))


def test_aer_two_nodes_and_one_node():
    topo = get_topology("aer", 8, ranks_per_node=4)  # 2 nodes: intra, then inter
    assert topo.period == 2
    assert topo.groups(0) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert topo.groups(1) == [tuple(range(8))]
    one = get_topology("aer", 6, ranks_per_node=6)  # 1 node: intra only, any node size
    assert one.period == 1 and one.groups(0) == one.groups(3) == [tuple(range(6))]


def test_aer_alias_and_env_default(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    topo = get_topology("aer", 8)
    assert topo.ranks_per_node == 2 and type(topo) is T.AlternatingExpRingTopology
    assert topo.groups(0) == get_topology("alternating-exp-ring", 8, ranks_per_node=2).groups(0)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="ranks_per_node"):
        get_topology("aer", 8)


# --- random matching ----------------------------------------------------------------------------


@pytest.mark.parametrize("p", (2, 5, 8, 16))
def test_random_matching_deterministic_and_fresh(p):
    a = get_topology("random-matching", p, seed=11)
    b = get_topology("random-matching", p, seed=11)
    c = get_topology("random-matching", p, seed=12)
    assert a.period is None
    seq_a = [a.groups(s) for s in range(40)]
    assert seq_a == [b.groups(s) for s in range(40)]  # same seed: same on every rank
    assert seq_a == [a.groups(s) for s in range(40)]  # repeatable
    for groups in seq_a:
        sizes = sorted(len(g) for g in groups)
        assert sizes == [1] * (p % 2) + [2] * (p // 2)  # a perfect matching (+1 alone if odd)
    if p >= 5:
        assert len({tuple(g) for g in map(tuple, seq_a)}) > 5  # fresh matchings
        assert seq_a != [c.groups(s) for s in range(40)]  # another seed: another sequence
    # matches the documented derivation
    for s in (0, 3, 39):
        perm = np.random.default_rng([11, s]).permutation(p).tolist()
        expected = sorted(tuple(sorted(perm[i : i + 2])) for i in range(0, p, 2))
        assert a.groups(s) == expected


def test_random_matching_distinct_groups():
    assert get_topology("random-matching", 4).distinct_groups() == [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 2),
        (1, 3),
        (2, 3),
    ]


# --- spectral gap -------------------------------------------------------------------------------


@pytest.mark.parametrize("name,p,rpn", [c for c in CASES if c[0] != "random-matching"])
def test_spectral_gap_connected_over_a_period(name, p, rpn):
    topo = get_topology(name, p, ranks_per_node=rpn)
    gap = topo.spectral_gap()
    assert 0.0 < gap <= 1.0
    # definition: 1 - second largest singular value of the period product
    prod = np.eye(p)
    for s in range(topo.period):
        prod = topo.mixing_matrix(s) @ prod
    sv = np.linalg.svd(prod, compute_uv=False)
    expected = 1.0 - (sv[1] if p > 1 else 0.0)
    assert gap == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize(
    "name,p,rpn",
    [("complete", 8, None), ("one-peer-exp", 16, None), ("aer", 16, 4), ("aer", 32, 2)],
)
def test_exact_averaging_over_a_period(name, p, rpn):
    topo = get_topology(name, p, ranks_per_node=rpn)
    np.testing.assert_allclose(topo.product_matrix(), np.full((p, p), 1 / p), atol=1e-12)
    assert topo.spectral_gap() == pytest.approx(1.0)


def test_ring_gap_closed_form():
    # after the first matching every pair holds one value; the second matching averages
    # neighbouring pairs: a p/2-cycle with weights 1/2, whose second singular value is cos(2 pi / p)
    for p in (4, 6, 8, 16):
        assert get_topology("ring", p).spectral_gap() == pytest.approx(
            1 - math.cos(2 * math.pi / p), abs=1e-9
        )
    assert get_topology("ring", 2).spectral_gap() == pytest.approx(1.0)


def test_disconnected_gap_is_zero():
    @T.register_topology("test-fixed-pairs")
    class FixedPairs(T.Topology):
        period = 1

        def _partition(self, step):
            return [(i, i + 1) for i in range(0, self.world_size, 2)]

    try:
        topo = get_topology("test-fixed-pairs", 4)
        assert topo.name == "test-fixed-pairs"
        assert topo.spectral_gap() == pytest.approx(0.0, abs=1e-12)
        assert "test-fixed-pairs" in T.available_topologies()
    finally:
        T._REGISTRY.pop("test-fixed-pairs")


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,p,rpn,match",
    [
        ("ring", 3, None, r"even world_size \(2, 4, 6"),
        ("ring", 7, None, "even"),
        ("one-peer-exp", 6, None, r"power-of-two world_size \(1, 2, 4, 8"),
        ("one-peer-exp", 12, None, "power-of-two"),
        ("alternating-exp-ring", 12, 4, r"power-of-two number of nodes.*4, 8, 16, 32"),
        ("alternating-exp-ring", 10, 4, r"multiple of ranks_per_node=4"),
        ("aer", 4, 8, "multiple of ranks_per_node=8"),
        ("nope", 4, None, "unknown topology 'nope'; available: aer, alternating-exp-ring"),
    ],
)
def test_bad_world_sizes(name, p, rpn, match):
    with pytest.raises(ValueError, match=match):
        get_topology(name, p, ranks_per_node=rpn)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        get_topology("complete", 0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        get_topology("complete", 4.0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        get_topology("complete", True)
    with pytest.raises(ValueError, match="ranks_per_node must be >= 1"):
        get_topology("aer", 4, ranks_per_node=0)
    topo = get_topology("ring", 4)
    with pytest.raises(ValueError, match="step must be >= 0"):
        topo.groups(-1)
    with pytest.raises(ValueError, match="rank must be < world_size=4"):
        topo.group_of(4, 0)
    with pytest.raises(ValueError, match="world_size=4, not 8"):
        get_topology(topo, 8)
    assert get_topology(topo, 4) is topo
    with pytest.raises(TypeError, match="topology name or a Topology"):
        get_topology(3, 4)
    with pytest.raises(ValueError, match="already registered"):
        T.register_topology("ring")
    with pytest.raises(TypeError, match="Topology subclass"):
        T.register_topology("test-not-a-topology")(int)
    assert "test-not-a-topology" not in T.available_topologies()


def test_broken_custom_topology_detected():
    class Broken(T.Topology):
        def _partition(self, step):
            return [(0, 1), (1, 2)]

    with pytest.raises(RuntimeError, match="not a partition"):
        Broken(3).groups(0)


def test_available_topologies():
    names = T.available_topologies()
    for n in ("complete", "ring", "one-peer-exp", "alternating-exp-ring", "aer", "random-matching"):
        assert n in names
    assert names == sorted(names)


def test_group_dataclass():
    g = T.Group((4, 5, 6, 7))
    assert g.weight == 0.25 and g.nodes(2) == (2, 3) and g.nodes(8) == (0,)


def test_random_matching_gap_over_documented_window():
    topo = get_topology("random-matching", 16, seed=2)
    assert topo.default_window() == 4
    prod = np.eye(16)
    for s in range(4):
        prod = topo.mixing_matrix(s) @ prod
    sv = np.linalg.svd(prod, compute_uv=False)
    assert topo.spectral_gap() == pytest.approx(1 - sv[1], abs=1e-9)
    assert 0.0 <= topo.spectral_gap() <= 1.0


def test_package_surface():
    import pipecomm.decentralized as dec
    from pipecomm.decentralized import AccumAdam, AccumAdamW, optim, topology
    from pipecomm.lab.training import dadam_runtime_model as runtime_model

    assert topology is T and dec.get_topology is T.get_topology
    assert AccumAdam is optim.AccumAdam and AccumAdamW is optim.AccumAdamW
    assert callable(runtime_model.simulate)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        dec.nothing_here  # noqa: B018
