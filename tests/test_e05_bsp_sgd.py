"""E5 BSP-SGD with each collective: helpers, claims' synthetic PASS / FAIL cases, a tiny run."""

import importlib
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from pipecomm.lab import claims
from pipecomm.lab.experiments import e05_bsp_sgd as e5
from pipecomm.lab.networks import cost, netem
from pipecomm.lab.networks.kinds import network_and_link, network_text
from pipecomm.lab.training.pipesgd_training import iteration_rows

MODEL_MS = {"lp": 50.0, "mst": 100.0, "be": 40.0, "ring": 42.0}
PORTS = ("single", "per-neighbor")


def _fake(comm_scale=None, loss_noise=1e-7, lp_ms=None, iterations=6, ranks=2,
          time_noise=0.01, runs=5, other_ms=None):
    """Synthetic E5 data: per port model, algorithm, run, rank and iteration, timings and a
    loss curve; each run draws its own level (relative spread ``time_noise``)."""
    comm_scale = comm_scale or {}
    other_ms = other_ms or {}
    rng = np.random.default_rng(0)
    base = 2.3 * np.exp(-0.1 * np.arange(iterations))
    frames = []
    for ports in PORTS:
        rows = []
        for run in range(runs):
            for alg, model_ms in MODEL_MS.items():
                meas = other_ms.get(alg, model_ms * comm_scale.get(alg, 1.05))
                if alg == "lp" and lp_ms is not None:
                    meas = lp_ms
                level = 1 + time_noise * rng.standard_normal()
                noise = 0.0 if alg == "lp" else loss_noise
                per_rank = []
                for _ in range(ranks):
                    timings = [
                        {
                            "iteration": t,
                            "updates": 1,
                            "compute_s": 0.01,
                            "launch_s": 0.0001,
                            "comm_s": meas / 1e3 * level * (1 + 0.002 * rng.standard_normal()),
                            "compress_s": 0.0,
                            "update_s": 0.001,
                            "iter_s": 0.011 + meas / 1e3,
                        }
                        for t in range(iterations)
                    ]
                    per_rank.append({"timings": timings, "losses": list(base + noise),
                                     "evals": []})
                rows += iteration_rows(per_rank, algorithm=alg, run=run, nbytes=1 << 20,
                                       model_comm_s=model_ms / 1e3)
        frames.append(pd.DataFrame(rows).assign(ports=ports))
    return pd.concat(frames, ignore_index=True).assign(
        backend="gloo", world_size=ranks, network="emulated", skip=2, gamma_s_per_byte=1e-9
    )


# LP fastest: every other algorithm measured above LP's 50 ms
FASTEST = {"mst": 100.0, "be": 60.0, "ring": 62.0}

CLAIM_CASES = {
    # 8 points, 2 may miss (binomial): BE off on both port models passes, BE and MST off fail,
    # BE off and ring at the edge on both cannot be told
    "e5_comm_within_model": (lambda: _fake(comm_scale={"be": 1.4}),
                             lambda: _fake(comm_scale={"be": 1.4, "mst": 0.6}),
                             lambda: _fake(comm_scale={"be": 1.4, "ring": 1.22},
                                           time_noise=0.05)),
    "e5_lp_below_mst": (lambda: _fake(), lambda: _fake(lp_ms=120.0),
                        lambda: _fake(lp_ms=105.0, time_noise=0.1)),
    # the paper's statement: FAIL as soon as BE beats LP (the model's expectation here)
    "e5_lp_fastest": (lambda: _fake(other_ms=FASTEST), lambda: _fake(),
                      lambda: _fake(other_ms={**FASTEST, "be": 51.0}, time_noise=0.1)),
}


def test_comm_times_and_errors():
    ct = e5.comm_times(_fake(comm_scale={"mst": 0.8}))
    assert list(ct["ports"].unique()) == list(PORTS)
    assert (ct["runs"] == 5).all()
    ct = ct[ct["ports"] == "single"].set_index("algorithm")
    assert list(ct.index) == ["lp", "mst", "be", "ring"]
    assert ct.loc["mst", "comm_s"] == pytest.approx(0.080, rel=0.03)
    assert ct.loc["mst", "error"] == pytest.approx(-0.2, abs=0.03)
    assert ct.loc["lp", "model_comm_s"] == pytest.approx(0.050)


def test_loss_differences_against_first_algorithm():
    d = e5.loss_differences(_fake(loss_noise=1e-3))
    assert set(d["algorithm"]) == {"mst", "be", "ring"}
    assert (d["reference"] == "lp").all()
    assert d["abs_diff"].to_numpy() == pytest.approx(1e-3)


def test_checks_are_registered_and_summary_has_one_row_per_algorithm():
    for name in CLAIM_CASES:
        assert name in claims.CHECKS
    s = e5.summary(_fake())
    assert list(s["algorithm"]) == ["lp", "mst", "be", "ring"] * 2
    assert list(s["ports"].unique()) == list(PORTS)
    assert s.loc[s["algorithm"] == "lp", "time / lp"].tolist() == [1.0, 1.0]


def test_one_repeat_per_run_never_per_iteration():
    """A claim's repeats are the runs' medians: 5 runs give 5 values however many iterations
    each run has, and 4 runs cannot decide."""
    samples = e5.comm_samples(_fake(iterations=20))
    assert set(samples) == {(p, a) for p in PORTS for a in MODEL_MS}
    assert all(len(v) == 5 for v in samples.values())
    few = _fake(runs=4, other_ms=FASTEST)
    v = e5.check_lp_fastest(few, 1.0, ["mst", "be", "ring"], list(PORTS), "none")
    assert v.verdict == "INCONCLUSIVE"
    v = e5.check_lp_fastest(_fake(), 1.0, ["mst", "be", "ring"], list(PORTS), "none")
    assert v.verdict == "FAIL" and "per-neighbor: mst/lp" in v.measured
    assert "model 0.8" in v.measured  # be/lp's model ratio 40 / 50 beside the measured one
    assert "single mst 2.00" in e5.predict_lp_fastest(_fake(), ["mst"], ["single"])
    assert e5.predict_lp_below_mst(_fake(), "single") == "model mst/lp = 2.00 (single)"


@pytest.mark.parametrize(
    "bad",
    [
        {"world_size": 1},
        {"algorithms": ["lp"]},
        {"algorithms": ["lp", "torch"]},
        {"skip": 10},
        {"ports": "dual"},
        {"bandwidth_Bps": -1.0},
        {"nope": 1},
        {"iterations": "5"},
        {"backend": "mpi"},
        {"port_models": ["dual"]},
        {"port_models": []},
        {"runs": 0},
    ],
)
def test_bad_parameters_name_the_parameter(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        e5.run(**bad)


#: the tiny run: its notebook executes it once (tests/test_notebooks.py shares the run)
TINY = dict(
    world_size=2,
    algorithms=["lp", "mst", "ring"],
    model="mlp",
    model_kw={"hidden": [16]},
    batch_size=8,
    iterations=3,
    skip=1,
    alpha_s=1e-4,
    bandwidth_Bps=1e9,
    runs=5,
    timeout_s=120.0,
)


def test_tiny_run_two_ranks_identical_losses(notebook_run):
    # p = 2: every algorithm adds the same two numbers, so the sums are bitwise equal.
    df = notebook_run(e5, TINY).df
    assert {"backend", "world_size", "network", "ports", "run"} <= set(df.columns)
    assert df["network"].str.startswith("emulated").all()
    it = df[df["kind"] == "iteration"]
    assert set(it["algorithm"]) == {"lp", "mst", "ring"}
    assert len(it[it["iteration"] >= 0]) == 2 * 5 * 3 * 2 * 3
    # >= 5 independent runs of every (port model, algorithm), interleaved
    assert (it.groupby(["ports", "algorithm"])["run"].nunique() == 5).all()
    assert (it["comm_s"] > 0).all() and (it["model_comm_s"] > 0).all()
    assert e5.loss_differences(df)["abs_diff"].max() == 0.0
    assert len(e5.summary(df)) == 6


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="needs fewer than 2 visible GPUs")
@pytest.mark.parametrize("module", ["e05_bsp_sgd", "e07_pipesgd_convergence",
                                    "e08_pipesgd_breakdown", "e09_layerwise_delayed"])
def test_nccl_without_gpus_is_refused_before_starting_ranks(module):
    E = importlib.import_module(f"pipecomm.lab.experiments.{module}")
    with pytest.raises(ValueError, match="needs 2 visible GPUs"):
        E.run(backend="nccl")


def test_network_and_link_nccl_uses_the_calibrated_link(monkeypatch):
    monkeypatch.delenv("PIPECOMM_CALIBRATION", raising=False)
    net, link = network_and_link(SimpleNamespace(backend="nccl"),
                                 lambda: pytest.fail("no emulation"))
    assert net is None and link == cost.calibrated_link()
    assert network_text(net).startswith("real")
    emulated = netem.Network(1e-3, 50e6)
    net, link = network_and_link(SimpleNamespace(backend="gloo"), lambda: emulated)
    assert net is emulated and link == cost.link_from_network(emulated)
    assert network_text(net) == emulated.describe()
