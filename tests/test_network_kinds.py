"""Where the network experiments measure (experiments._network.ranks_on): the emulator or a real
shaped network (a virtual cluster), the same rank functions on both.

Oracles: the emulated run of the same configuration (identical losses for the same update rule
and seed; the same rows and columns), the shaped link's configured rate (the calibrated link the
models use), and the host's list of namespaces (nothing left behind). Tests that build
namespaces need root, iproute2 and tc tbf; without them they skip with the reason.
"""

from __future__ import annotations

import importlib

import pytest

from pipecomm.lab import results
from pipecomm.lab.experiments import e02_collectives_vs_size as e2
from pipecomm.lab.experiments import e05_bsp_sgd as e5
from pipecomm.lab.experiments import e10_topology_comm_time as e10
from pipecomm.lab.measure import sweep
from pipecomm.lab.networks import cluster, netem
from pipecomm.lab.networks import kinds as network

OK, REASON = cluster.available()
needs_ns = pytest.mark.skipif(not OK, reason=f"no virtual cluster: {REASON}")
NETWORK_EXPERIMENTS = ["e00_calibrate", "e02_collectives_vs_size", "e03_collectives_vs_ranks",
                       "e04_lp_block_size", "e05_bsp_sgd", "e07_pipesgd_convergence",
                       "e08_pipesgd_breakdown", "e09_layerwise_delayed",
                       "e10_topology_comm_time", "e11_runtime_model", "e12_dadam_scaling"]


@pytest.mark.parametrize("name", NETWORK_EXPERIMENTS)
def test_every_network_experiment_takes_the_network_kind(name):
    mod = importlib.import_module(f"pipecomm.lab.experiments.{name}")
    assert mod.DEFAULTS["network"] == "emulated"
    assert mod.Params.make(network="shaped").network == "shaped"
    with pytest.raises(ValueError, match="network"):
        mod.Params.make(network="netem")


def test_shaped_training_needs_gloo():
    with pytest.raises(ValueError, match="network"):
        e5.Params.make(network="shaped", backend="nccl")


@pytest.mark.parametrize(("text", "kind"), [
    ("real", "real"),
    ("emulated, single-port, 1.0 ms / 50 MB/s", "emulated"),
    ("shaped: Linux tc tbf, real TCP; 2 nodes x 1 rank, 50 MB/s per node link each way", "shaped"),
    ("analytic model (no network): alpha 10 us", "analytic"),
])
def test_network_kind_of_a_network_column(text, kind):
    assert results.network_kind(text) == kind
    assert results.describe_runs(__import__("pandas").DataFrame({"network": [text]}))[
        "network_kinds"] == [kind]


def test_network_kind_refuses_unknown_text():
    with pytest.raises(ValueError, match="none of"):
        results.network_kind("wifi")


def test_without_the_cluster_shaped_says_why_and_names_the_fallback(monkeypatch):
    monkeypatch.setenv("PIPECOMM_NO_CLUSTER", "1")
    with pytest.raises(RuntimeError, match="network='emulated'"), network.ranks_on(
            "shaped", 2, netem.Network(1e-3, 50e6), 1 << 20):
        pass
    with pytest.raises(RuntimeError, match="PIPECOMM_NO_CLUSTER"):
        e2.run(network="shaped", real_world_sizes=[])


def test_bad_network_kind_and_shapes_are_refused():
    with pytest.raises(ValueError, match="network"), network.ranks_on(
            "tc", 2, netem.Network(1e-3, 50e6), 1 << 20):
        pass
    if OK:
        with pytest.raises(ValueError, match="ranks_per_node"), network.ranks_on(
                "shaped", 3, netem.Network(1e-3, 50e6), None, ranks_per_node=2):
            pass


# --------------------------------------------------------------------------- on a real network


@needs_ns
@pytest.mark.timeout(180)
def test_collectives_on_a_shaped_cluster_use_its_calibrated_link():
    rate = 40e6  # well inside what a loaded host forwards (100 MB/s once calibrated at < 80)
    df = e2.run(network="shaped", world_size=2, emu_bandwidth_Bps=rate, sizes_min=1 << 20,
                sizes_max=1 << 20, iters=3, warmup=1,
                emu_cases={"single/broadcast": ["lp", "ring"]}, real_world_sizes=[],
                timeout_s=120.0)
    assert set(df.section) == {"shaped"}
    assert df.network.str.startswith("shaped: Linux tc tbf").all()
    # the model's link is the cluster's calibration, not the configured (unaddable) latency
    assert df.emu_bandwidth_Bps.between(0.75 * rate, 1.15 * rate).all()
    assert df.emu_alpha_s.nunique() == 1
    assert df.emu_alpha_s.iloc[0] != e2.DEFAULTS["emu_alpha_s"]
    # a 1 MiB broadcast at p = 2 is one message on a 40 MB/s link: about 26 ms; the order of
    # magnitude only (LP's small blocks pay a per-message cost on TCP that the model lacks)
    assert df.time_s.between(0.5 * df.model_s, 4.0 * df.model_s).all(), df[["time_s", "model_s"]]
    lp = df[df.algorithm == "lp"]
    assert (lp.block_bytes > 0).all()  # LP's blocks planned on the calibrated link
    assert len(e2.summary(df)) and e2.plot(df) is not None
    assert not cluster.cleanup_stale()


@needs_ns
@pytest.mark.timeout(180)
def test_training_on_a_shaped_cluster_matches_the_emulated_run():
    kw = dict(world_size=2, algorithms=["lp", "ring"], model="mlp", model_kw={"hidden": [16]},
              batch_size=8, iterations=4, skip=1, alpha_s=1e-4, bandwidth_Bps=50e6,
              timeout_s=120.0)
    shaped = e5.run(network="shaped", **kw)
    emulated = e5.run(**kw)
    assert set(shaped.network_kind) == {"shaped"} and set(emulated.network_kind) == {"emulated"}
    # the same update rule from the same seed: the network changes times, never the numbers
    it = [d[d.kind == "iteration"].sort_values(["algorithm", "rank", "iteration"])
          for d in (shaped, emulated)]
    assert it[0].loss.tolist() == it[1].loss.tolist()
    assert (it[0].comm_s > 0).all()


@needs_ns
@pytest.mark.timeout(240)
def test_two_level_cluster_gossip_time():
    """E10 on a shaped two-node cluster: the inter-node step is modelled dearer than the
    intra-node one. The timing workload (two 1 MiB buckets) makes the bandwidth term decide (about
    40 ms a step over the 50 MB/s inter-node link): with the MLP's 19 KB the latency did, and one
    spike in the calibration of the unshaped intra-node link on a loaded host (its fitted latency
    5.3 ms) once put the intra-node step above the inter-node one (2.5 ms)."""
    df = e10.run(network="shaped", world_sizes=[4], ranks_per_node=2, models=["timing"],
                 topologies=["alternating-exp-ring"], warmup=0, iters=2,
                 inter_bandwidth_Bps=50e6, runs=1)
    assert set(df.network_kind) == {"shaped"}
    assert df.network.str.contains("2 nodes x 2 ranks").all()
    aer = df.set_index("step")
    assert len(aer) == 2 and (aer.time_s > 0).all()
    assert aer.model_s[1] > aer.model_s[0] > 0  # inter-node step costs more than intra-node
    assert not cluster.cleanup_stale()


def assert_calibrated_within_the_shaper(link: dict, rate: float, burst: int) -> None:
    """A calibrated shaped link (cluster.calibrate's ``inter``) is what tc tbf can deliver:
    every transfer at most :func:`cluster.tbf_max_rate` (the bucket lets ``burst`` bytes
    through above the rate), the fitted bandwidth at most that bound at the smallest
    bandwidth-bound size once the fit's alpha is taken off (a noisy latency point raises alpha
    and with it the fitted rate: 92.5 MB/s on an 80 MB/s link at alpha 2-3 ms), and neither
    far below the configured rate."""
    sizes = sorted(r["nbytes"] for r in link["rows"])
    bound_n = next(n for n in sizes if n > 4 * burst)
    for r in link["rows"]:
        assert r["bandwidth_Bps"] <= cluster.tbf_max_rate(rate, burst, r["nbytes"]), r
    fit_bound = cluster.tbf_max_rate(rate, burst, bound_n, link["alpha_s"])
    assert 0.75 * rate < link["bandwidth_Bps"] <= fit_bound, (link["bandwidth_Bps"], fit_bound)
    assert max(r["bandwidth_Bps"] for r in link["rows"]) > 0.75 * rate


def _tbf_link(rate: float, burst: int, latency_s: float, sizes=(4 << 10, 1 << 20, 4 << 20),
              latency_noise_s: float = 0.0) -> dict:
    """What cluster.calibrate records for an ideal tbf link (the bucket full at each start)."""
    from pipecomm.lab.networks import cost

    times = [latency_s + max(0, n - burst) / rate for n in sizes]
    times[0] += latency_noise_s
    a, b = cost.fit_alpha_beta(list(sizes), times)
    return {"alpha_s": a, "bandwidth_Bps": 1 / b,
            "rows": [{"nbytes": n, "time_s": t, "bandwidth_Bps": n / t}
                     for n, t in zip(sizes, times)]}


@pytest.mark.parametrize("noise_s", [0.0, 1e-3, 3e-3])
def test_a_shaped_links_bound_allows_the_buckets_burst(noise_s):
    """The bound of a calibrated 80 MB/s link: an ideal tbf link with the cluster's default
    bucket (1 ms of traffic) fits above the configured rate (the burst; more with a noisy
    latency point) and still passes; a link faster than any bucket allows does not."""
    rate, burst = 80e6, 80_000
    link = _tbf_link(rate, burst, 2e-4, latency_noise_s=noise_s)
    assert link["bandwidth_Bps"] > rate  # the configured rate alone would refuse it
    assert_calibrated_within_the_shaper(link, rate, burst)
    with pytest.raises(AssertionError):
        assert_calibrated_within_the_shaper(_tbf_link(1.3 * rate, burst, 2e-4), rate, burst)
    assert cluster.tbf_max_rate(rate, burst, 4 << 10) == float("inf")
    assert cluster.tbf_max_rate(rate, burst, 1 << 20) == pytest.approx(
        (1 << 20) / (((1 << 20) - burst) / rate))


@needs_ns
@pytest.mark.timeout(120)
def test_shaped_ranks_run_the_same_rank_functions_as_the_emulator():
    pts = [{"op": "allreduce", "algorithm": "ring", "nbytes": 1 << 18, "p": 4, "warmup": 0,
            "iters": 2}]
    with network.ranks_on("shaped", 4, netem.Network(3e-3, 400e6, inter_alpha_s=5e-3,
                                                      inter_bandwidth_Bps=80e6), None,
                           ranks_per_node=2, timeout_s=60) as ranks:
        cal = ranks.calibration
        assert cal["intra"]["bandwidth_Bps"] > 2 * cal["inter"]["bandwidth_Bps"]
        assert_calibrated_within_the_shaper(cal["inter"], 80e6, ranks.runner.cluster.burst_bytes)
        assert ranks.net.inter_bandwidth == cal["inter"]["bandwidth_Bps"]
        assert ranks.net.ports == "single"
        rows = ranks.run(sweep.measure_points, pts, timeout_s=60)[0]
        rows2 = ranks.run(sweep.measure_points, pts, timeout_s=60)[0]  # the same job again
    assert rows[0]["time_s"] > 0 and rows2[0]["time_s"] > 0
    assert ranks.kind == "shaped" and ranks.text.startswith("shaped:")
