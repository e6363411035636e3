"""DecentralizedDataParallel against a float64 single-process simulation of docs/update_rules.md.

Every rank returns its parameter trajectory; ``rankfns_ddp.simulate`` computes all ranks from
``y_i^k = sum_j (W_k)_ij x_j^k`` (``W_k = topology.mixing_matrix(k)``) and a local optimizer step
from ``y_i^k`` with the gradient at ``x_i^k`` (zero for parameters without one).
"""

from __future__ import annotations

import numpy as np
import pytest
import rankfns_ddp as fns

from pipecomm.lab.networks import netem

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


def check_against_rule(c, results, ranks_per_node=None, tol=None):
    results = [r for r in results if r is not None]  # ranks outside the process group
    sim = fns.simulate(c, ranks_per_node=ranks_per_node, buckets=results[0]["buckets"])
    if tol is None:
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
    # buckets: identical on every rank, all parameters; one optimizer for all of them
    buckets = results[0]["buckets"]
    assert all(r["buckets"] == buckets for r in results)
    assert sorted(n for b in buckets for n in b) == sorted(names)
    expected = n_params(c) if c["bucket_mb"] < 1e-3 else 1
    assert len(buckets) == expected and results[0]["n_optimizers"] == 1
    # each bucket's parameters live in one block (one copy to and from the gossip buffer)
    assert all(r["storages"] == [1] * len(buckets) and r["same_objects"] for r in results)
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
        "optim_fn": ("TypeError", "optimizer"),
        "model": ("TypeError", "model"),
        "optim_fn result": ("TypeError", "Optimizer"),
        "optim_fn params": ("ValueError", "exactly the model's parameters"),
        "optimizer missing params": ("ValueError", "exactly the model's parameters"),
        "max_grad_norm zero": ("ValueError", "max_grad_norm"),
        "max_grad_norm inf": ("ValueError", "max_grad_norm"),
        "max_grad_norm str": ("TypeError", "max_grad_norm"),
        "grad_norm_scope": ("ValueError", "grad_norm_scope"),
        "grad_scaler": ("TypeError", "GradScaler"),
        "grad_scaler float16 parameters": ("ValueError", "float16"),
        "process_group": ("TypeError", "process_group"),
        "init_sync": ("TypeError", "init_sync"),
        "wrapped twice": ("ValueError", "close()"),
    }
    assert set(out) == set(expect)
    for case, (etype, word) in expect.items():
        assert out[case].startswith(etype + ":"), (case, out[case])
        assert word in out[case], (case, out[case])


def test_no_sync_and_checkpoint_misuse(pool):
    out = pool(2).run(fns.misuse, timeout_s=TIMEOUT)[0]
    expect = {
        "global_average inside no_sync": ("RuntimeError", "no_sync()"),
        "global_average with accumulated gradients": ("RuntimeError", "not been applied"),
        "require_backward_grad_sync not a bool": ("TypeError", "require_backward_grad_sync"),
        "optimizer state of another rank": ("ValueError", "rank 7"),
        "optimizer state of an older iteration": ("RuntimeError", "new wrapper"),
        "no_sync after close": ("RuntimeError", "closed"),
    }
    assert set(out) == set(expect)
    for case, (etype, word) in expect.items():
        assert out[case].startswith(etype + ":"), (case, out[case])
        assert word in out[case], (case, out[case])


# ------------------------------------------------------------------ training-loop features

LOOP_CASES = [
    # accumulation (no_sync and require_backward_grad_sync), StepLR on two param groups,
    # per-bucket clipping with one parameter per bucket, an optimizer instance
    cfg(
        accum=3,
        sched=(2, 0.5),
        optim=("adamw-groups", 0.05),
        clip=(0.05, "bucket"),
        topology="ring",
        algorithm="lp",
        iters=5,
    ),
    # global clipping (steps deferred to the end of backward), optim_fn, one bucket
    cfg(
        accum=2,
        clip=(0.05, "global"),
        optim=("sgd", 0.2, 0.9),
        optim_fn=True,
        bucket_mb=25.0,
        topology="ring",
        algorithm="ring",
        iters=5,
    ),
    # 3 ranks: global clipping with tiny buckets, scheduler, a branch unused at times
    cfg(
        world=3,
        accum=2,
        sched=(1, 0.7),
        clip=(0.05, "global"),
        optim=("adam", 0.05),
        topology=("random-matching", 5),
        algorithm="lp",
        branch=0,
        iters=5,
    ),
]


def _loop_id(c):
    return f"{c['world']}r-{c['optim'][0]}-clip-{c['clip'][1]}-accum{c['accum']}"


@pytest.mark.parametrize("c", LOOP_CASES, ids=_loop_id)
def test_training_loop_features_match_rule(pool, c):
    results = pool(c["world"]).run(fns.train, c, timeout_s=TIMEOUT)
    check_against_rule(c, results)
    for r in results:
        assert r["grad_norm"] > c["clip"][0]  # clipping was active
        if c.get("sched"):  # the schedule changed the lr the steps used, in every group
            step, gamma = c["sched"]
            lr0 = c["optim"][1]
            for k, lrs in enumerate(r["lrs"]):
                assert lrs == pytest.approx([lr0 * gamma ** (k // step)] * len(lrs))


def test_grad_scaler_skips_non_finite_steps(pool):
    c = cfg(
        scaler=2.0**10,
        inf_at={(0, 2), (1, 4)},
        optim=("adam", 0.05),
        topology="ring",
        algorithm="lp",
        accum=2,
        iters=6,
    )
    results = pool(2).run(fns.train, c, timeout_s=TIMEOUT)
    check_against_rule(c, results)  # power-of-two scale: exact in float64
    for rank, r in enumerate(results):
        for k in range(1, c["iters"]):
            if (rank, k) in c["inf_at"]:
                assert r["scales"][k] == r["scales"][k - 1] / 2
            else:
                assert r["scales"][k] >= r["scales"][k - 1]


@pytest.mark.parametrize("autocast", ["bf16", "fp16"])
def test_autocast(pool, autocast):
    c = cfg(
        dtype="float32",
        autocast=autocast,
        optim=("adam", 0.01),
        topology="ring",
        algorithm="lp",
        iters=4,
        scaler=2.0**8 if autocast == "fp16" else None,
    )
    results = pool(2).run(fns.train, c, timeout_s=TIMEOUT)
    # the oracle runs the same autocast forward (without a scaler); fp16 gradients of the scaled
    # loss are rounded differently, hence the loose tolerance
    check_against_rule(c, results, tol=dict(rtol=2e-2, atol=2e-3))


@pytest.mark.parametrize(
    "c",
    [
        cfg(
            world=2,
            topology="one-peer-exp",
            algorithm="lp",
            optim=("adamw-groups", 0.05),
            sched=(2, 0.5),
            accum=2,
            clip=(0.05, "bucket"),
            iters=6,
            checkpoint_at=3,
        ),
        cfg(
            world=3,
            topology=("random-matching", 5),
            algorithm="torch",
            optim=("adam", 0.05),
            accum=2,
            clip=(0.05, "global"),
            iters=6,
            checkpoint_at=2,
            resume_style="before-wrap",
        ),
        cfg(
            world=3,
            topology="complete",
            algorithm="ring",
            optim=("sgd", 0.1, 0.9),
            bucket_mb=25.0,
            scaler=2.0**6,
            inf_at={(1, 1)},
            iters=5,
            checkpoint_at=3,
        ),
    ],
    ids=["2r-lp-bucketclip", "3r-torch-globalclip-before-wrap", "3r-complete-ring-scaler"],
)
def test_save_load_continue_equals_uninterrupted(pool, c):
    plain = dict(c, checkpoint_at=None)
    results = pool(c["world"]).run(fns.train_many, [plain, c], timeout_s=TIMEOUT)
    for a, b in results:
        for k in range(c["iters"]):
            for n, v in a["traj"][k].items():
                np.testing.assert_array_equal(v, b["traj"][k][n], err_msg=f"iteration {k}, {n}")
        assert a["lrs"] == b["lrs"] and a["scales"] == b["scales"]
    check_against_rule(plain, [a for a, _ in results])  # and both follow the rule


@pytest.mark.parametrize("members, algorithm", [([0, 2], "lp"), ([1, 2], "torch")])
def test_process_group_trains_a_subset(pool, members, algorithm):
    c = cfg(
        world=2, group=members, topology="ring", algorithm=algorithm, optim=("adam", 0.05), iters=4
    )
    results = pool(3).run(fns.train, c, timeout_s=TIMEOUT)
    assert [r is None for r in results] == [r not in members for r in range(3)]
    check_against_rule(c, results)


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
