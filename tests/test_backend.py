"""pipecomm.backend: a torch.distributed process group on pipecomm's collectives.

Oracles: the same operation on the world's gloo group in the same process (every ReduceOp,
dtype, size and root), and DDP over gloo for DDP over a pipecomm group.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import rankfns_backend as fns

from pipecomm import backend

TIMEOUT = 120
ALGORITHMS = ("lp", "mst", "be", "ring")


def test_options_checked_without_communication():
    assert backend.Options() == backend.Options("auto", None, None)
    with pytest.raises(ValueError, match="algorithm"):
        backend.Options("fancy")
    with pytest.raises(ValueError, match="compression"):
        backend.Options("be", compression="int8")
    with pytest.raises(ValueError, match="block_bytes"):
        backend.Options("lp", block_bytes=-1)
    env = {backend.ENV_ALGORITHM: "ring", backend.ENV_COMPRESSION: "bf16"}
    assert backend.options_from_env(env) == backend.Options("ring", "bf16")
    assert backend.options_from_env({}) == backend.Options("auto")
    assert backend.options_from_env({backend.ENV_BLOCK_BYTES: "4096"}).block_bytes == 4096
    with pytest.raises(ValueError, match="PIPECOMM_BLOCK_BYTES"):
        backend.options_from_env({backend.ENV_BLOCK_BYTES: "big"})


def test_backend_name_registered():
    import torch.distributed as dist

    assert backend.BACKEND_NAME.upper() in dist.Backend._plugins


@pytest.mark.parametrize(
    "world, algorithm",
    [(2, "lp"), (3, "lp"), (3, "mst"), (3, "be"), (3, "ring"), (3, "torch")],
)
def test_every_reduce_op_dtype_and_root_matches_gloo(pool, world, algorithm):
    results = pool(world).run(fns.ops_and_dtypes, algorithm, timeout_s=TIMEOUT)
    for rank, bad in enumerate(results):
        assert bad == [], f"rank {rank}: {bad}"


@pytest.mark.parametrize("world, algorithm", [(2, "lp"), (3, "ring"), (3, "torch")])
def test_other_operations_run_on_the_inner_group(pool, world, algorithm):
    results = pool(world).run(fns.other_ops, algorithm, timeout_s=TIMEOUT)
    for rank, res in enumerate(results):
        assert res.pop("backend_name") == "pipecomm"
        assert f"algorithm={algorithm!r}" in res.pop("repr")
        assert all(v is True for v in res.values()), f"rank {rank}: {res}"
    assert "send_recv" in results[1]


@pytest.mark.parametrize("algorithm", ["ring", "torch"])
def test_send_recv_then_collectives_do_not_hang(pool, algorithm):
    # 30 rounds of send/recv (rank 0 -> 1) then collectives on the same pipecomm group: before
    # the fix of the GIL / gloo work-queue deadlock every such run hung one rank (see
    # rankfns_backend.p2p_then_collectives); the pool's timeout turns a hang into a failure
    results = pool(3).run(fns.p2p_then_collectives, algorithm, 30, timeout_s=TIMEOUT)
    assert results == [[], [], []]


@pytest.mark.parametrize("algorithm", ["lp", "be", "torch"])
def test_async_work_and_future(pool, algorithm):
    for res in pool(3).run(fns.async_work, algorithm, timeout_s=TIMEOUT):
        assert res["completed_alone"] and res["wait"] and res["success"] and res["broadcast"]
        assert res["values"] == res["expected"]
        assert res["chained"] == 2 * res["expected"][-1]
        if algorithm != "torch":  # pipecomm's futures resolve on the completion thread
            assert res["callback_thread"] == "pipecomm-futures"


def test_subgroups(pool):
    results = pool(3).run(fns.subgroups, "ring", timeout_s=TIMEOUT)
    assert results[1] == {"member": False, "non_member": True}
    for res in (results[0], results[2]):
        assert res["algorithms"] == ["ring", "ring"]
        assert res["a_sum"] == res["b_sum"] == res["expected_sum"] == 4.0
        assert res["a_bcast"] == res["b_bcast"] == 2.0


@pytest.mark.parametrize("algorithm", ["lp", "mst", "be", "ring"])
def test_ranks_that_disagree_all_raise(pool, algorithm):
    p = 3
    for res in pool(p).run(fns.mismatched, algorithm, timeout_s=TIMEOUT):
        assert all(f"numel={1000 + 100 * r}" in res["size"] for r in range(p)), res["size"]
        assert "float64" in res["dtype"] and "float32" in res["dtype"], res["dtype"]
        assert res["size_untouched"] and res["dtype_untouched"] and res["after"] == p


def test_bad_inputs_raise_before_communication(pool):
    res = pool(2).run(fns.bad_inputs, timeout_s=TIMEOUT)[0]
    expected = {
        "algorithm": "algorithm must be one of",
        "compression": "compression='fp16' needs algorithm 'lp' or 'ring'",
        "codec": "compression must be one of",
        "block_bytes": "block_bytes must be a positive int",
        "ranks": "ranks must be distinct",
        "ranks_outside": "outside the world",
        "int_avg": "ReduceOp.AVG needs a floating-point",
        "complex_max": "ReduceOp.MAX is not defined for complex",
    }
    for key, words in expected.items():
        assert words in res[key], (key, res[key])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ddp_over_pipecomm_trains_like_ddp_over_gloo(pool, world, algorithm):
    results = pool(world).run(fns.ddp_matches_gloo, algorithm, 5, timeout_s=TIMEOUT)
    for res in results:
        for a, b in zip(res["got"], res["ref"]):
            np.testing.assert_allclose(a.double().numpy(), b.double().numpy(), rtol=1e-6, atol=1e-7)
    n_params = 8  # then BatchNorm's buffers, which hold each rank's last local batch statistics
    for a, b in zip(results[0]["got"][:n_params], results[-1]["got"][:n_params]):
        np.testing.assert_array_equal(a.numpy(), b.numpy())  # the replicas agree


def test_ddp_with_a_codec_stays_close(pool):
    for res in pool(3).run(fns.ddp_matches_gloo, "ring", 5, "bf16", timeout_s=TIMEOUT):
        assert 0 < res["max_abs"] < 1e-2


@pytest.mark.timeout(240)
def test_init_process_group_under_torchrun(tmp_path):
    env = dict(os.environ, PIPECOMM_ALGORITHM="ring", OMP_NUM_THREADS="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    script = os.path.join(os.path.dirname(__file__), "rankfns_backend.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        script,
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for res in results:
        assert res["backend"] == "pipecomm"
        assert res["type"] == "PipecommProcessGroup" and res["algorithm"] == "ring"
        assert res["avg"] == 1.5 and res["max"] == 1 and res["all_gather"] == [0.0, 1.0]
        assert res["ddp_max_abs"] < 1e-6
        assert res["subgroup_sum"] == 2.0
    p = 2
    for rank, res in enumerate(results):  # subgroups before any world operation: as on gloo
        assert res["comm_group_before_world_op"] is False
        assert res["early_subgroup"] == [p * (p + 1) / 2, p - 1.0, 2.0 * p if rank == 0 else None,
                                         1.0]
