"""pipecomm.hooks: DDP communication hooks against DDP's own averaging and against PipeSGD."""

from __future__ import annotations

import numpy as np
import pytest
import rankfns_hooks as fns

from pipecomm import hooks

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
    assert hooks.PipelinedState().staleness == 1 and hooks.PipelinedState().algorithm == "ring"
    assert hooks.CollectiveState().algorithm == "lp"
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
