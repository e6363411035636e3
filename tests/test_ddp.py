"""DecentralizedDataParallel against a float64 single-process simulation of docs/update_rules.md.

Every rank returns its parameter trajectory; ``rankfns_ddp.simulate`` computes all ranks from
``y_i^k = sum_j (W_k)_ij x_j^k`` (``W_k = topology.mixing_matrix(k)``) and a local optimizer step
from ``y_i^k`` with the gradient at ``x_i^k`` (zero for parameters without one).
"""

from __future__ import annotations

import numpy as np
import pytest
import rankfns_ddp as fns

from pipecomm import netem

TIMEOUT = 90


def cfg(**kw):
    base = dict(
        world=2,
        topology="complete",
        optim=("sgd", 0.1, 0.9),
        bucket_mb=1e-6,
        algorithm="torch",
        iters=6,
        dtype="float64",
        branch=None,
        seed=0,
    )
    base.update(kw)
    return base


def n_params(c) -> int:
    return 5 + 2 * (c["branch"] is not None) + 2 * c.get("tied", False)


def check_against_rule(c, results, ranks_per_node=None):
    sim = fns.simulate(c, ranks_per_node=ranks_per_node)
    tol = dict(rtol=1e-9, atol=1e-11) if c["dtype"] == "float64" else dict(rtol=2e-4, atol=2e-5)
    names = list(sim["start"])
    for i, res in enumerate(results):
        for n in names:  # rank 0's parameters were broadcast at construction
            np.testing.assert_array_equal(res["initial"][n], sim["start"][n], err_msg=n)
        assert len(res["traj"]) == c["iters"]
        for k in range(c["iters"]):
            for n in names:
                np.testing.assert_allclose(
                    res["traj"][k][n],
                    sim["traj"][i][k][n],
                    **tol,
                    err_msg=f"rank {i}, iteration {k}, {n}",
                )
    # the run is not trivial: the replicas disagree at some point unless mixing is exact
    if c["world"] > 1 and c["topology"] != "complete":
        spread = max(
            np.abs(results[0]["traj"][k][n] - results[-1]["traj"][k][n]).max()
            for k in range(c["iters"])
            for n in names
        )
        assert spread > 1e-4
    # buckets: identical on every rank, all parameters, one optimizer each
    buckets = results[0]["buckets"]
    assert all(r["buckets"] == buckets for r in results)
    assert sorted(n for b in buckets for n in b) == sorted(names)
    expected = n_params(c) if c["bucket_mb"] < 1e-3 else 1
    assert len(buckets) == expected and results[0]["n_optimizers"] == expected
    topo = fns.sim_topology(c["topology"], c["world"], ranks_per_node)
    for i, r in enumerate(results):
        assert r["timing"]["iterations"] == c["iters"]
        talks = any(len(topo.group_of(i, s)) > 1 for s in range(1, c["iters"] + 1))
        assert (r["timing"]["gossip_bytes"] > 0) == talks
    return sim


CASES_2 = [
    cfg(topology="complete", algorithm="torch", optim=("sgd", 0.1, 0.9)),
    cfg(topology="ring", algorithm="lp", optim=("adam", 0.05), bucket_mb=25.0),
    cfg(topology=("random-matching", 3), algorithm="ring", optim=("sgd", 0.2, 0.0)),
    cfg(topology="one-peer-exp", algorithm="lp", optim=("adam", 0.05), dtype="float32"),
    cfg(topology="ring", algorithm="torch", optim=("sgd", 0.1, 0.9), tied=True),
]

CASES_4 = [
    cfg(world=4, topology="ring", algorithm="torch", optim=("sgd", 0.1, 0.9)),
    cfg(world=4, topology="one-peer-exp", algorithm="lp", optim=("adam", 0.05)),
    cfg(world=4, topology=("aer", 2), algorithm="ring", optim=("adam", 0.05), bucket_mb=25.0),
    cfg(world=4, topology=("random-matching", 5), algorithm="torch", bucket_mb=25.0),
    cfg(world=4, topology="complete", algorithm="lp", optim=("adam", 0.05)),
    cfg(world=4, topology=("singletons",), algorithm="lp", optim=("sgd", 0.1, 0.9)),
    cfg(world=4, topology="ring", algorithm="ring", optim=("sgd", 0.1, 0.5), dtype="float32"),
]


def _id(c):
    t = c["topology"] if isinstance(c["topology"], str) else "-".join(map(str, c["topology"]))
    big = "big" if c["bucket_mb"] > 1 else "tiny"
    tied = "-tied" if c.get("tied") else ""
    return f"{c['world']}r-{t}-{c['algorithm']}-{c['optim'][0]}-{big}-{c['dtype']}{tied}"


@pytest.mark.parametrize("c", CASES_2 + CASES_4, ids=_id)
def test_matches_rule(pool, c):
    results = pool(c["world"]).run(fns.train, c, timeout_s=TIMEOUT)
    check_against_rule(c, results)


def test_matches_rule_8_ranks_aer_by_name(pool):
    # alternating-exp-ring by name: ranks_per_node=2 from the launcher -> 4 nodes, period 4
    c = cfg(
        world=8,
        topology="alternating-exp-ring",
        algorithm="lp",
        optim=("adam", 0.05),
        iters=9,
        branch=1,
    )
    results = pool(8, ranks_per_node=2).run(fns.train, c, timeout_s=TIMEOUT)
    check_against_rule(c, results, ranks_per_node=2)


@pytest.mark.parametrize(
    "c",
    [
        # rank 0 uses the branch in iteration 0, rank 1 does not (rank 0's order wins)
        cfg(world=4, topology="ring", algorithm="lp", optim=("sgd", 0.1, 0.9), branch=0),
        # rank 0 does not use it in iteration 0: its parameters join the buckets at the end
        cfg(world=4, topology="one-peer-exp", algorithm="torch", optim=("adam", 0.05), branch=2),
        cfg(
            world=2,
            topology="ring",
            algorithm="ring",
            optim=("adam", 0.05),
            branch=1,
            bucket_mb=25.0,
        ),
    ],
    ids=["4r-sgd-tiny", "4r-adam-tiny", "2r-adam-big"],
)
def test_unused_parameters_step_with_zero_gradient(pool, c):
    results = pool(c["world"]).run(fns.train, c, timeout_s=TIMEOUT)
    sim = check_against_rule(c, results)
    # the branch really was unused in some iterations and still moved (momentum / moments)
    used = [(k + i + c["branch"]) % 3 == 0 for i in range(c["world"]) for k in range(c["iters"])]
    assert any(used) and not all(used)
    # on rank 0, in some iteration without the branch, its parameters still changed
    assert any(
        (k + c["branch"]) % 3 != 0
        and not np.array_equal(
            sim["traj"][0][k - 1]["extra.weight"], sim["traj"][0][k]["extra.weight"]
        )
        for k in range(1, c["iters"])
    )


def test_global_average_does_not_disturb(pool):
    base = cfg(world=4, topology="ring", algorithm="lp", optim=("sgd", 0.1, 0.9), iters=7)
    with_avg = dict(base, averages={2: "copy", 4: "context", 5: "copy"})
    results = pool(4).run(fns.train_many, [base, with_avg], timeout_s=TIMEOUT)
    plain = [r[0] for r in results]
    averaged = [r[1] for r in results]
    # bit-for-bit the same trajectory as without the calls, and the rule's
    for a, b in zip(plain, averaged):
        for k in range(base["iters"]):
            for n, v in a["traj"][k].items():
                np.testing.assert_array_equal(v, b["traj"][k][n])
    sim = check_against_rule(with_avg, averaged)
    # the averages are the mean over ranks of x^k, the same on every rank
    for k in (2, 4, 5):
        for r in averaged:
            for n, v in sim["averages"][k].items():
                np.testing.assert_allclose(r["averages"][k][n], v, rtol=1e-12, atol=1e-14)
    # ... and not a trivial one: the ranks disagreed there
    assert not np.allclose(plain[0]["traj"][3]["fc1.weight"], plain[1]["traj"][3]["fc1.weight"])


def test_global_average_inplace_restarts_from_the_mean(pool):
    c = cfg(
        world=4,
        topology="one-peer-exp",
        algorithm="ring",
        optim=("adam", 0.05),
        averages={3: "inplace"},
    )
    results = pool(4).run(fns.train, c, timeout_s=TIMEOUT)
    check_against_rule(c, results)


def test_state_dict_has_no_wrapper_prefix(pool):
    out = pool(2).run(fns.state_dict_keys, timeout_s=TIMEOUT)[0]
    assert out["ddp_keys"] == out["model_keys"]
    assert "extra.weight" in out["ddp_keys"] and "calls" in out["ddp_keys"]
    assert out["ddp_params"] == out["model_params"]
    assert out["ddp_buffers"] == out["model_buffers"]
    assert out["same_objects"] and out["restored"]
    assert "assign=True" in out["assign"]


@pytest.mark.parametrize(
    "kind, words",
    [
        ("shape", ["fc1.weight", "shape", "rank 1"]),
        ("missing", ["extra.weight", "not on rank 0"]),
        ("dtype", ["dtype", "torch.float64", "rank 1"]),
    ],
)
def test_models_that_differ_across_ranks_fail_clearly(pool, kind, words):
    messages = pool(2).run(fns.mismatch, kind, timeout_s=TIMEOUT)
    for m in messages:  # every rank raises (none hangs)
        assert "differ across ranks" in m
        for w in words:
            assert w in m, m


def test_bad_arguments(pool):
    out = pool(2).run(fns.bad_arguments, timeout_s=TIMEOUT)[0]
    expect = {
        "unknown topology": ("ValueError", "torus"),
        "topology type": ("TypeError", "topology"),
        "topology world size": ("ValueError", "world_size"),
        "bucket_mb zero": ("ValueError", "bucket_mb"),
        "bucket_mb negative": ("ValueError", "bucket_mb"),
        "bucket_mb nan": ("ValueError", "bucket_mb"),
        "bucket_mb str": ("TypeError", "bucket_mb"),
        "bucket_mb bool": ("TypeError", "bucket_mb"),
        "algorithm": ("ValueError", "algorithm"),
        "optim_fn": ("TypeError", "optim_fn"),
        "model": ("TypeError", "model"),
        "optim_fn result": ("TypeError", "Optimizer"),
        "optim_fn params": ("ValueError", "exactly the parameters"),
        "wrapped twice": ("ValueError", "close()"),
    }
    assert set(out) == set(expect)
    for case, (etype, word) in expect.items():
        assert out[case].startswith(etype + ":"), (case, out[case])
        assert word in out[case], (case, out[case])


def test_emulated_network(pool):
    ranks = pool(2, network=netem.Network(1e-3, 400e6))
    for m in ranks.run(fns.torch_under_emulation, timeout_s=TIMEOUT):
        assert "cannot run on the emulated network" in m and "'lp'" in m
    c = cfg(topology="ring", algorithm="lp", optim=("adam", 0.05), iters=4)
    results = ranks.run(fns.train_emulated, c, timeout_s=TIMEOUT)
    check_against_rule(c, results)
    for r in results:  # the gossip went through pipecomm's point-to-point layer
        assert r["stats"]["bytes_sent"] >= r["timing"]["gossip_bytes"] / 2 > 0


def test_backward_that_failed_midway_is_reported(pool):
    for m in pool(2).run(fns.interrupted_backward, timeout_s=TIMEOUT):
        assert "stopped before its end" in m, m
