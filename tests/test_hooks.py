"""pipecomm.hooks: DDP communication hooks against DDP's own averaging and against PipeSGD."""

from __future__ import annotations

import numpy as np
import pytest
import rankfns_hooks as fns
import torch

from pipecomm import compress, hooks

TIMEOUT = 120
SGD = ("sgd", 0.1, 0.0, 0.0)
MOMENTUM = ("sgd", 0.1, 0.9, 0.0)
MOMENTUM_WD = ("sgd", 0.1, 0.9, 0.01)
ADAM = ("adam", 0.01)


def close(a, b, exact: bool) -> None:
    for x, y in zip(a, b):
        if exact:
            np.testing.assert_array_equal(x.numpy(), y.numpy())
        else:
            np.testing.assert_allclose(x.double().numpy(), y.double().numpy(), rtol=1e-6, atol=1e-7)


def test_states_check_their_arguments():
    assert hooks.PipelinedState().staleness == 1 and hooks.PipelinedState().algorithm == "auto"
    assert hooks.CollectiveState().algorithm == "auto"
    with pytest.raises(ValueError, match="algorithm"):
        hooks.CollectiveState(algorithm="fancy")
    with pytest.raises(ValueError, match="compression"):
        hooks.CollectiveState("mst", "fp16")
    with pytest.raises(ValueError, match="compression"):
        hooks.PipelinedState(1, "be", "int8")
    for k in (-1, 1.5, True):
        with pytest.raises(ValueError, match="staleness"):
            hooks.PipelinedState(k)
    with pytest.raises(ValueError, match="block_bytes"):
        hooks.CollectiveState(block_bytes=0)
    with pytest.raises(ValueError, match="timeout_s"):
        hooks.PipelinedState(timeout_s=float("inf"))
    state = hooks.PipelinedState(2)
    assert not state.filling and state.in_flight == 0
    with pytest.raises(TypeError, match="PipelinedState"):
        hooks.pipelined_hook(hooks.CollectiveState(), None)


@pytest.mark.parametrize(
    "world, algorithm, compression",
    [
        (2, "lp", None),
        (3, "lp", None),
        (3, "mst", None),
        (3, "be", None),
        (3, "ring", None),
        (3, "torch", None),
    ],
)
def test_allreduce_hook_trains_like_ddp(pool, world, algorithm, compression):
    for res in pool(world).run(
        fns.allreduce_hook_vs_ddp, algorithm, compression, timeout_s=TIMEOUT
    ):
        close(res["hook"], res["plain"], exact=False)


def test_allreduce_hook_with_a_codec_stays_close(pool):
    for res in pool(3).run(fns.allreduce_hook_vs_ddp, "ring", "bf16", timeout_s=TIMEOUT):
        diff = max(float((a - b).abs().max()) for a, b in zip(res["hook"], res["plain"]))
        assert 0 < diff < 1e-2


@pytest.mark.parametrize(
    "world, k, algorithm, optim, skip, group_kind",
    [
        (2, 1, "ring", SGD, False, "world"),  # p = 2: bitwise equal
        (3, 1, "ring", SGD, False, "world"),
        (3, 2, "lp", MOMENTUM, False, "world"),  # zero gradients are a no-op with momentum
        (2, 0, "lp", MOMENTUM, False, "world"),
        (3, 1, "ring", MOMENTUM_WD, True, "world"),  # weight decay: skip the filling steps
        (3, 2, "mst", ADAM, True, "world"),
        (3, 1, "lp", MOMENTUM, False, "pipecomm"),  # DDP and the state on a pipecomm group
    ],
)
def test_pipelined_hook_equals_pipesgd(pool, world, k, algorithm, optim, skip, group_kind):
    results = pool(world).run(
        fns.pipelined_vs_pipesgd, k, algorithm, optim, skip, 6, None, group_kind, timeout_s=TIMEOUT
    )
    for res in results:
        assert res["filling"] == [True] * k + [False] * (6 - k)
        assert res["iteration"] == 6
        close(res["hook"], res["pipesgd"], exact=world == 2)


def test_zero_gradients_while_filling_are_not_a_no_op_with_weight_decay(pool):
    """The documented difference: stepping on the zeros of the k filling iterations applies
    weight decay k times, w_k = w_0 (1 - lr wd)^k, where PipeSGD keeps w_k = w_0."""
    k, lr, wd = 2, 0.1, 0.05
    for res in pool(2).run(
        fns.pipelined_vs_pipesgd, k, "ring", ("sgd", lr, 0.0, wd), False, k, timeout_s=TIMEOUT
    ):
        for h, p in zip(res["hook"], res["pipesgd"]):
            np.testing.assert_allclose(h.numpy(), p.numpy() * (1 - lr * wd) ** k, rtol=1e-6)
            assert not np.array_equal(h.numpy(), p.numpy())


@pytest.mark.parametrize("k", [1, 2])
def test_pipelined_hook_follows_parameters_across_bucket_rebuilds(pool, k):
    for res in pool(3).run(fns.rebuilt_buckets, k, timeout_s=TIMEOUT):
        assert res["bad"] == [] and res["iteration"] == 5


def test_state_of_another_process_group_is_refused(pool):
    results = pool(2).run(fns.wrong_group, timeout_s=TIMEOUT)
    for res in results:
        assert "bound to another process group" in res["register"]
        assert "must be a CollectiveState" in res["not_a_state"]
    for key in ("hook", "pipelined_hook"):
        assert "bound to another process group" in results[1][key]
        assert "not a member" in results[1][key]


# --------------------------------------------------------------------------- error feedback


def test_error_feedback_needs_a_compression():
    for make in (
        lambda: hooks.CollectiveState(error_feedback=True),
        lambda: hooks.PipelinedState(1, "ring", None, error_feedback=True),
    ):
        with pytest.raises(ValueError, match=r"error_feedback=True.*compression"):
            make()
    with pytest.raises(TypeError, match="error_feedback"):
        hooks.CollectiveState("lp", "int8", error_feedback="yes")
    assert hooks.CollectiveState("lp", "int8", error_feedback=True).error_feedback
    with pytest.raises(RuntimeError, match="register"):
        hooks.PipelinedState().state_dict()


def ef_oracle(world: int, compression: str) -> tuple[list, list]:
    """The update rule in one process: per step, every rank's x = g_t + e_t (per parameter) and
    e_{t+1} = x - D(C(x)) of each bucket of that step's layout (e_0 = 0)."""
    codec = compress.get_codec(compression)
    sizes = fns.EF_SIZES
    e = [[torch.zeros(n) for n in sizes] for _ in range(world)]
    xs, es = [], []
    for t, layout in enumerate(fns.EF_LAYOUTS):
        x_t = [[None] * len(sizes) for _ in range(world)]
        for r in range(world):
            for idx in layout:
                g = torch.cat([fns.ef_gradient(r, t, i) for i in idx])
                x = g + torch.cat([e[r][i] for i in idx]) if t else g
                approx = codec.decode(codec.encode(x), x.numel(), x.dtype)
                off = 0
                for i in idx:
                    x_t[r][i] = x[off : off + sizes[i]]
                    e[r][i] = (x - approx)[off : off + sizes[i]].clone()
                    off += sizes[i]
        xs.append(x_t)
        es.append([[t.clone() for t in per_rank] for per_rank in e])
    return xs, es


@pytest.mark.parametrize(
    "kind, world, algorithm, compression, k",
    [
        ("allreduce", 3, "ring", "int8", 0),
        ("allreduce", 2, "lp", "fp16", 0),
        ("pipelined", 3, "lp", "int8", 1),
        ("pipelined", 2, "ring", "bf16", 2),
    ],
)
def test_error_feedback_follows_the_update_rule(pool, kind, world, algorithm, compression, k):
    """Residuals bit for bit as the single-process rule (with buckets rebuilt between steps);
    outputs the average of x = g + e (k steps late), up to the AllReduce's own compression."""
    xs, es = ef_oracle(world, compression)
    results = pool(world).run(
        fns.error_feedback_hook, kind, algorithm, compression, k, timeout_s=TIMEOUT
    )
    for rank, res in enumerate(results):
        for t, residual in enumerate(res["residuals"]):
            assert sorted(residual) == list(range(len(fns.EF_SIZES)))
            for i, e in residual.items():
                assert torch.equal(e, es[t][rank][i]), (t, rank, i)
        for t, out in enumerate(res["outputs"]):
            src = t - (k if kind == "pipelined" else 0)
            for i, got in enumerate(out):
                if src < 0:
                    assert torch.equal(got, torch.zeros_like(got))
                    continue
                mean = sum(xs[src][r][i] for r in range(world)) / world
                scale = max(float(xs[src][r][i].abs().max()) for r in range(world))
                assert float((got - mean).abs().max()) <= 4 * scale / 127, (t, i)


def test_pipelined_hook_with_error_feedback_equals_pipesgd(pool):
    """fp16 is element-wise and LP adds in rank order whatever the layout, so DDP's buckets and
    PipeSGD's single unit compress alike: at p = 2 the two implementations of error feedback give
    the same parameters, bit for bit. (The ring is not layout-free: an element's sum is
    ``D(C(a)) + b`` or ``a + D(C(b))`` depending on which rank owns its chunk.)"""
    for res in pool(2).run(
        fns.pipelined_vs_pipesgd, 1, "lp", MOMENTUM, False, 6, "fp16", "world", True,
        timeout_s=TIMEOUT,
    ):  # fmt: skip
        close(res["hook"], res["pipesgd"], exact=True)


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    "kind, world, algorithm, compression, k",
    [("allreduce", 3, "ring", "int8", 0), ("pipelined", 2, "ring", "int8", 2)],
)
def test_state_dict_resumes_the_hook_exactly(pool, kind, world, algorithm, compression, k):
    """Saved before step 2 and loaded into a fresh state, the hook (same bucket layouts)
    returns what the uninterrupted one returns, bit for bit: the averages in flight and the
    residuals are the whole state."""
    whole = pool(world).run(
        fns.error_feedback_hook, kind, algorithm, compression, k, None, timeout_s=TIMEOUT
    )
    resumed = pool(world).run(
        fns.error_feedback_hook, kind, algorithm, compression, k, 2, timeout_s=TIMEOUT
    )
    for a, b in zip(whole, resumed):
        for key in ("outputs", "residuals"):
            for x, y in zip(a[key], b[key]):
                xs = x.values() if isinstance(x, dict) else x
                ys = y.values() if isinstance(y, dict) else y
                assert all(torch.equal(u, v) for u, v in zip(xs, ys))


@pytest.mark.parametrize(
    "world, k, algorithm, compression, ef",
    [
        (2, 1, "ring", None, False),
        (2, 2, "lp", "fp16", True),
        (3, 1, "lp", None, False),
        (3, 2, "lp", "fp16", True),
    ],
)
def test_pipelined_state_resumes_exactly(pool, world, k, algorithm, compression, ef):
    """Stopped after 3 of 7 iterations, checkpointed (model, Adam, hook state) and resumed in a
    fresh DDP: the parameters equal the uninterrupted run's bit for bit; a fresh hook state (the
    old behaviour) refills the pipeline and differs. (Exact where the average does not depend on
    DDP's bucket layout, which a fresh DDP rebuilds after its first iteration: LP at any p, the
    ring at p = 2, element-wise codecs. int8's scales span a bucket's chunk, so there the first
    resumed average differs by round-off; see test_state_dict_resumes_the_hook_exactly.)"""
    for res in pool(world).run(
        fns.pipelined_resume, k, algorithm, compression, ef, 3, timeout_s=TIMEOUT
    ):
        assert res["in_flight"] == k
        assert res["residuals"] == (6 if ef else 0)
        close(res["resumed"], res["whole"], exact=True)
        assert any(not torch.equal(a, b) for a, b in zip(res["refilled"], res["whole"]))


def test_load_state_dict_refuses_what_does_not_fit():
    def registered(state):
        state._params = [torch.zeros(3), torch.zeros(2)]  # what hooks.register records
        return state

    saved = registered(hooks.PipelinedState(1, "lp", "int8", error_feedback=True)).state_dict()
    assert saved["in_flight"] == [] and saved["residuals"] == {} and saved["rank"] == 0
    with pytest.raises(ValueError, match="staleness=1"):
        registered(hooks.PipelinedState(2, "lp", "int8", error_feedback=True)).load_state_dict(
            saved
        )
    with pytest.raises(ValueError, match="error_feedback"):
        registered(hooks.PipelinedState(1, "lp", "int8")).load_state_dict(saved)
    with pytest.raises(TypeError, match="got PipelinedState's"):
        registered(hooks.CollectiveState("lp", "int8", error_feedback=True)).load_state_dict(saved)
    other = dict(saved, rank=1, residuals={0: torch.ones(3)})
    with pytest.raises(ValueError, match="residuals of rank 1"):
        registered(hooks.PipelinedState(1, "lp", "int8", error_feedback=True)).load_state_dict(
            other
        )
    wrong = dict(saved, residuals={0: torch.ones(4)})
    with pytest.raises(ValueError, match="parameter 0"):
        registered(hooks.PipelinedState(1, "lp", "int8", error_feedback=True)).load_state_dict(
            wrong
        )
    with pytest.raises(RuntimeError, match="register"):
        hooks.PipelinedState(1, "lp", "int8", error_feedback=True).load_state_dict(saved)


# --------------------------------------------------------------------------- gossip


def test_gossip_state_checks_its_arguments():
    assert (hooks.GossipState().topology, hooks.GossipState().mix) == ("one-peer-exp", "parameters")
    for kwargs, name in ((dict(topology="fancy"), "topology"), (dict(topology=4), "topology"),
                         (dict(mix="both"), "mix"), (dict(algorithm="fancy"), "algorithm"),
                         (dict(timeout_s=0), "timeout_s"), (dict(block_bytes=-1), "block_bytes")):
        with pytest.raises(ValueError, match=name):
            hooks.GossipState(**kwargs)
    with pytest.raises(TypeError, match="GossipState"):
        hooks.gossip_hook(hooks.PipelinedState(), None)
    saved = hooks.GossipState("ring", "gradients").state_dict()
    assert saved == {"kind": "GossipState", "iteration": 0, "mix": "gradients", "topology": "ring"}
    for other, name in ((hooks.GossipState("ring"), "mix"),
                        (hooks.GossipState("complete", "gradients"), "topology")):
        with pytest.raises(ValueError, match=name):
            other.load_state_dict(saved)
    with pytest.raises(TypeError, match="GossipState.state_dict"):
        hooks.GossipState().load_state_dict(hooks.PipelinedState().__dict__)


GOSSIP_CASES = [  # (topology, mix, algorithm, optimizer, micro-batches, register_comm_hook itself)
    ("one-peer-exp", "parameters", "lp", MOMENTUM, 1, False),
    (("aer", 2), "parameters", "ring", ADAM, 1, True),
    ("ring", "parameters", "lp", SGD, 2, False),
    ("complete", "parameters", "torch", ADAM, 1, False),
    ("one-peer-exp", "gradients", "lp", ADAM, 2, True),
    (("aer", 2), "gradients", "ring", MOMENTUM, 1, False),
    ("ring", "gradients", "mst", SGD, 1, False),
    ("complete", "gradients", "lp", MOMENTUM, 1, False),
]


def test_gossip_hook_follows_the_simulated_mixing(pool):
    """DDP + gossip_hook on 4 ranks against all ranks simulated in one process with the mixing
    matrix W_t of each step (float64): the parameters after every step, every rank, every
    topology, both mixes; ``no_sync`` micro-batches do not advance the topology's step. With
    ``mix="parameters"`` it is DecentralizedDataParallel's rule: the two agree too."""
    world = 4
    results = pool(world).run(fns.gossip_vs_simulation, GOSSIP_CASES, timeout_s=TIMEOUT)
    for c, (topology, mix, _, optim, accum, _) in enumerate(GOSSIP_CASES):
        sim = fns.gossip_simulation(topology, mix, optim, accum, world)
        for rank, res in enumerate(r[c] for r in results):
            assert res["iteration"] == fns.GOSSIP_STEPS
            for t, params in enumerate(res["traj"]):
                for a, b in zip(params, sim[rank][t]):
                    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12,
                                               err_msg=f"{topology} {mix} rank {rank} step {t}")
            for t, params in enumerate(res.get("decentralized", [])):
                for a, b in zip(params, res["traj"][t]):
                    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-9, atol=1e-12)
        last = [torch.cat([p.reshape(-1) for p in sim[r][-1]]) for r in range(world)]
        spread = max(float((x - last[0]).abs().max()) for x in last)
        # the replicas differ, except where every rank steps with the exact average (complete,
        # gradients: one model); mixed parameters step with the rank's own gradient afterwards
        assert (spread > 1e-4) == (topology != "complete" or mix == "parameters"), (c, spread)


@pytest.mark.parametrize("topology, mix", [("one-peer-exp", "parameters"), ("ring", "gradients")])
def test_gossip_state_resumes_exactly(pool, topology, mix):
    """Stopped after 3 of 6 steps, every rank's model, Adam and hook state saved and loaded into
    a fresh DDP (no broadcast): the uninterrupted run's parameters; with a fresh hook state the
    topology's step restarts at 0 and the run differs."""
    for res in pool(4).run(fns.gossip_resume, topology, mix, 3, timeout_s=TIMEOUT):
        assert res["saved_iteration"] == 3
        close(res["resumed"], res["whole"], exact=False)
        assert any(not torch.allclose(a, b) for a, b in zip(res["fresh_state"], res["whole"]))


def test_gossip_hook_refuses_a_topology_that_does_not_fit(pool):
    for res in pool(3).run(fns.gossip_refusals, timeout_s=TIMEOUT):
        assert "topology 'ring' needs an even world_size" in res["ring"]
        assert "power-of-two world_size" in res["one-peer-exp"]
        assert "must be a GossipState" in res["not_a_state"]
