"""E10 (gossip time per topology): cost-model helper, aggregation, validation, claims, one tiny run."""

import math

import pandas as pd
import pytest
from claimdata import repeats_around

from pipecomm import cost
from pipecomm.decentralized import topology
from pipecomm.lab.dadam_timing import model_gossip_time
from pipecomm.lab.experiments import e10_topology_comm_time as e10
from pipecomm.lab.network import DEFAULT_NETWORK, link_models, make_network
from pipecomm.lab.workloads import workload_bucket_bytes


def _table(error=0.1, aer_factor=0.6, spread=0.01):
    """Per-step rows for p=4 and p=8, one model: measured = model * (1 + error)."""
    rows = []
    for world in (4, 8):
        for topo, model_ms in (
            ("complete", 100.0),
            ("ring", 50.0),
            ("alternating-exp-ring", 100.0 * aer_factor),
        ):
            for step in range(2):
                rows.append(
                    {
                        "world_size": world,
                        "model": "timing",
                        "topology": topo,
                        "step": step,
                        "time_s": model_ms * (1 + error) / 1e3,
                        "times_s": repeats_around(model_ms * (1 + error) / 1e3, spread),
                        "model_s": model_ms / 1e3,
                        "spectral_gap": 1.0,
                        "model_bytes": 2 << 20,
                        "n_buckets": 2,
                        "algorithm": "ring",
                        "backend": "gloo",
                        "network": "emulated",
                    }
                )
    return pd.DataFrame(rows)


CLAIM_CASES = {
    "e10_within_model": (lambda: _table(error=0.1), lambda: _table(error=0.4),
                         lambda: _table(error=0.24, spread=0.1)),
    "e10_aer_below_complete": (lambda: _table(aer_factor=0.6), lambda: _table(aer_factor=1.2),
                               lambda: _table(aer_factor=1.0, spread=0.2)),
}


def test_model_gossip_time_is_the_ring_formula_on_each_level():
    net = make_network(DEFAULT_NETWORK)
    intra, inter = link_models(net)
    n = 1 << 20
    # a group inside one node (2 ranks per node): ring on the intra-node link
    t = model_gossip_time([(0, 1), (2, 3)], [n], 2, net, "ring")
    assert t == pytest.approx(2 * (intra.alpha + n / 2 * intra.beta) + n / 2 * intra.gamma)
    # one group over two nodes: one stream per uplink, inter-node link
    t = model_gossip_time([(0, 1, 2, 3)], [n, n], 2, net, "ring")
    one = 6 * (inter.alpha + n / 4 * inter.beta) + 3 / 4 * n * inter.gamma
    assert t == pytest.approx(2 * one)
    # two pairs crossing nodes at once: both streams of a node share its uplink (beta x 2)
    t = model_gossip_time([(0, 2), (1, 3)], [n], 2, net, "ring")
    shared = cost.LinkModel(inter.alpha, 2 * inter.beta, inter.gamma)
    assert t == pytest.approx(cost.allreduce_time("ring", n, 2, shared))


def test_aer_model_is_below_complete_for_the_models_in_use():
    """The parameters were chosen from the model: AER's mean gossip time < complete's."""
    net = make_network(DEFAULT_NETWORK)
    for model in ("timing", "mlp", "char_transformer"):
        sizes = workload_bucket_bytes(model)
        for world in (4, 8):
            mean = {}
            for name in ("complete", "alternating-exp-ring"):
                topo = topology.get_topology(name, world, ranks_per_node=2)
                mean[name] = (
                    sum(
                        model_gossip_time(topo.groups(s), sizes, 2, net, "ring")
                        for s in range(topo.period)
                    )
                    / topo.period
                )
            assert mean["alternating-exp-ring"] < 0.8 * mean["complete"], (model, world, mean)


def test_per_iteration_averages_the_steps_of_a_period():
    df = _table(error=0.0)
    df.loc[(df.topology == "ring") & (df.step == 1), "time_s"] = 0.07
    t = e10.per_iteration(df)
    ring4 = t[(t.topology == "ring") & (t.world_size == 4)].iloc[0]
    assert ring4.measured_s == pytest.approx((0.05 + 0.07) / 2)
    assert ring4.steps == 2
    assert ring4.error == pytest.approx(0.2)
    assert set(e10.summary(df).topology) == {"complete", "ring", "AER"}


def test_claims_report_the_worst_case():
    v = e10.check_within_model(_table(error=-0.3), tolerance=0.25)
    assert not v.passed and "-30.0%" in v.measured and "bias -30.0%" in v.measured
    with pytest.raises(ValueError, match="complete"):
        e10.check_aer_below_complete(_table()[lambda d: d.topology == "ring"], 8, 1.0)


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"world_sizes": [6]}, "world_sizes"),
        ({"world_sizes": []}, "world_sizes"),
        ({"models": ["resnet"]}, "models"),
        ({"topologies": ["star"]}, "topologies"),
        ({"algorithm": "torch"}, "algorithm"),
        ({"iters": 0}, "iters"),
        ({"inter_bandwidth_Bps": -1.0}, "bandwidth"),
    ],
)
def test_bad_parameters_name_the_parameter(bad, match):
    with pytest.raises(ValueError, match=match):
        e10.run(**bad)


@pytest.mark.timeout(240)
def test_tiny_end_to_end_run():
    """Two ranks on two one-rank nodes, the small MLP: groups of one and of two."""
    df = e10.run(
        world_sizes=[2],
        ranks_per_node=1,
        models=["mlp"],
        topologies=["complete", "alternating-exp-ring"],
        warmup=0,
        iters=1,
    )
    assert {"backend", "world_size", "network"} <= set(df.columns)
    assert df.network.str.startswith("emulated").all()
    assert set(df.topology) == {"complete", "alternating-exp-ring"}
    assert len(df[df.topology == "alternating-exp-ring"]) == 2  # period 2: intra, inter
    aer = df[df.topology == "alternating-exp-ring"].set_index("step")
    assert aer.model_s[0] == 0.0  # groups of one rank do not communicate
    assert aer.time_s[1] > aer.time_s[0]
    assert (df.time_s > 0).all() and all(math.isfinite(x) for x in df.model_s)
    assert len(e10.summary(df)) == 2
    e10.plot(df)
