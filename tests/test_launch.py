"""pipecomm.lab.networks.launch: results in rank order, failures surface fast, nothing left running."""

import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import rankfns_launch as fns
import torch
from test_run import GLOO_EXIT_ABORT

from pipecomm.lab.measure import bench
from pipecomm.lab.networks import launch


@pytest.fixture(scope="module")
def ranks2():
    with launch.Ranks(2) as r:
        yield r


def test_results_in_rank_order_with_tensors(pool):
    out = pool(3).run(fns.identity_and_tensor, "hello")
    assert [o["rank"] for o in out] == [0, 1, 2]
    assert all(o["x"] == "hello" for o in out)
    for o in out:
        assert torch.equal(o["sum"], torch.full((3,), 3.0))
    assert all(o["threads"] == max(1, (os.cpu_count() or 1) // 3) for o in out)
    assert all(o["device"] == "cpu" for o in out)  # gloo ranks compute on the CPU


def test_pool_reuses_processes(pool):
    ranks = pool(3)
    first = [o["pid"] for o in ranks.run(fns.identity_and_tensor, 1)]
    second = [o["pid"] for o in ranks.run(fns.identity_and_tensor, 2)]
    assert first == second


def test_ranks_per_node_sets_local_env():
    out = launch.spawn(fns.identity_and_tensor, 4, 0, ranks_per_node=2)
    assert [o["local_rank"] for o in out] == ["0", "1", "0", "1"]
    assert {o["local_world_size"] for o in out} == {"2"}


def test_rank_error_carries_rank_and_traceback(ranks2):
    start = time.monotonic()
    with pytest.raises(launch.RankError) as info:
        ranks2.run(fns.raise_on, 1, timeout_s=60)
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    assert "deliberate failure on rank 1" in str(info.value)
    assert "rankfns_launch.py" in info.value.remote_traceback
    assert not ranks2.alive  # all ranks were stopped
    # the pool restarts by itself
    assert [o["rank"] for o in ranks2.run(fns.identity_and_tensor, 0)] == [0, 1]


def test_dead_rank_is_reported(ranks2):
    start = time.monotonic()
    with pytest.raises(launch.RankError, match=r"rank 0: died \((exit code 7|its connection)"):
        ranks2.run(fns.die_on, 0, timeout_s=60)
    assert time.monotonic() - start < 15


def test_timeout_names_running_ranks(ranks2):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[1\] still running"):
        ranks2.run(fns.sleep_on, 1, 60, timeout_s=2)
    assert time.monotonic() - start < 10
    assert not ranks2.alive


def test_ranks_start_with_the_environment_directory_and_output_of_that_moment(
        monkeypatch, tmp_path):
    """Ranks fork from a server started earlier (Linux): yet, as with spawn, each gets what its
    starting process has when the pool starts, not what the server had."""
    launch.spawn(fns.identity_and_tensor, 1, 0)  # a fork server, if any, runs from here on
    monkeypatch.setenv("PIPECOMM_TEST_MARK", "set later")
    monkeypatch.chdir(tmp_path)
    omp_before = os.environ.get("OMP_NUM_THREADS")
    saved = [os.dup(1), os.dup(2)]
    try:  # stdout and stderr of this process go to new files for the start of the pool
        for fd, name in ((1, "out.txt"), (2, "err.txt")):
            with open(tmp_path / name, "w") as f:
                os.dup2(f.fileno(), fd)
        out = launch.spawn(fns.start_state, 2, "PIPECOMM_TEST_MARK")
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    assert [o[:3] for o in out] == [("set later", str(tmp_path), threads)] * 2
    assert os.environ.get("OMP_NUM_THREADS") == omp_before
    if sys.platform.startswith("linux"):
        assert all(o[3] != os.getpid() for o in out)  # forked by the server, not by us
    text = (tmp_path / "out.txt").read_text()
    assert "stdout of rank 0" in text and "stdout of rank 1" in text
    assert "stderr of rank 1" in (tmp_path / "err.txt").read_text()


def test_spawn_leaves_nothing_running():
    before = set(mp.active_children())  # other tests' pools stay alive on purpose
    with pytest.raises(launch.RankError):
        launch.spawn(fns.raise_on, 2, 0, timeout_s=60)
    assert set(mp.active_children()) <= before


def test_not_importable_functions_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="lambda or nested"):
        launch.spawn(lambda: 1, 2)

    def notebook_fn():
        return 1

    notebook_fn.__module__ = "__main__"
    notebook_fn.__qualname__ = "notebook_fn"
    monkeypatch.delattr(sys.modules["__main__"], "__file__", raising=False)
    with pytest.raises(ValueError, match="defined in a notebook"):
        launch.spawn(notebook_fn, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"world_size": 0}, "world_size"),
        ({"world_size": 3, "ranks_per_node": 2}, "ranks_per_node"),
        ({"world_size": 2, "backend": "mpi"}, "backend"),
        ({"world_size": 2, "backend": "nccl", "network": object()}, "refused with NCCL"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch.Ranks(**kwargs)


@pytest.mark.skipif(torch.cuda.device_count() >= 3, reason="needs fewer than 3 visible GPUs")
def test_nccl_needs_one_gpu_per_rank():
    with pytest.raises(ValueError, match="needs 3 visible GPUs"):
        launch.Ranks(3, backend="nccl")


def test_device_without_process_group_is_cpu():
    assert launch.device() == torch.device("cpu")


def test_bad_timeout(pool):
    with pytest.raises(ValueError, match="timeout_s"):
        pool(3).run(fns.identity_and_tensor, 0, timeout_s=0)


def test_bench_reports_max_over_ranks(pool):
    out = pool(3).run(fns.timed_sleep, [0.0, 0.05, 0.0])
    assert len({stats["median_s"] for stats in out}) == 1  # one value, agreed by every rank
    for stats in out:  # every rank sees the slowest rank's time (the others' own is ~0 s)
        # last end minus last start: a rank that wakes late for the common start shortens it
        # by its lateness, a few ms on a loaded machine
        assert stats["median_s"] >= 0.04
        assert len(stats["times_s"]) == 3


def test_bench_cpu_is_summed_over_ranks(pool):
    """time_fn(cpu=True): each repeat's CPU time is the sum of every rank's (here a busy loop of
    0.05 + 0.1 + 0 s), the same on every rank; busy is that over cores x wall time."""
    out = pool(3).run(fns.timed_burn, [0.05, 0.1, 0.0])
    assert len({tuple(r["cpu_s"]) for r in out}) == 1
    for c, t in zip(out[0]["cpu_s"], out[0]["times_s"]):
        assert 0.15 <= c < 0.15 + 0.1  # the loops, plus a little of the call's own
        assert bench.host_busy(c, t, cores=2) == pytest.approx(c / (2 * t))


def test_bench_cpu_locally_and_its_columns():
    r = bench.time_fn(lambda: sum(range(20000)), warmup=0, repeats=3, cpu=True)
    assert len(r["cpu_s"]) == 3 and all(c >= 0 for c in r["cpu_s"])
    assert bench.columns(r)["cpu_times_s"].count(";") == 2
    assert "cpu_times_s" not in bench.columns(bench.time_fn(lambda: None, repeats=2))
    with pytest.raises(ValueError, match="one value per repeat"):
        bench.result_of([0.1, 0.2], cpu=[0.1])
    assert bench.host_busy(0.1, 0.05, cores=2) == pytest.approx(1.0)
    assert bench.host_cores() >= 1
    for bad in ((0.1, 0.0, 2), (-0.1, 0.1, 2), (0.1, 0.1, 0)):
        with pytest.raises(ValueError, match="cores >= 1"):
            bench.host_busy(*bad)


def test_init_from_env_without_torchrun(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(RuntimeError, match="torchrun"):
        launch.init_from_env()


def test_init_from_env_under_torchrun(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "from pipecomm.lab.networks import launch\n"
        "info = launch.init_from_env()\n"
        "t = torch.ones(2); dist.all_reduce(t)\n"
        f"open(f'{tmp_path}/rank{{info.rank}}.txt', 'w').write(\n"
        "    f'RESULT {info.rank} {info.world_size} {info.backend} {int(t[0])}')\n"
        "dist.destroy_process_group()\n"
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    for _ in range(3):  # this torch build sometimes aborts a gloo job's rank at exit (test_run)
        proc = subprocess.run(
            [str(torchrun), "--standalone", "--nproc-per-node", "2", str(script)],
            capture_output=True, text=True, timeout=120,
        )
        if proc.returncode == 0 or not (GLOO_EXIT_ABORT in proc.stderr
                                        or "exitcode: -6" in proc.stderr):
            break
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(p.read_text() for p in tmp_path.glob("rank*.txt"))
    assert lines == ["RESULT 0 2 gloo 2", "RESULT 1 2 gloo 2"]


def test_pool_is_a_local_pool_outside_torchrun(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    ranks = launch.pool(2)
    try:
        assert isinstance(ranks, launch.Ranks) and ranks.world_size == 2
    finally:
        ranks.close()


def test_torchrun_job_refuses_the_emulated_network():
    with pytest.raises(ValueError, match="network=None"):
        launch.TorchrunJob(2, "gloo", network=object())


def test_a_new_world_never_reuses_the_destroyed_worlds_comm_group():
    """pipecomm caches its communication thread's group per process; after
    destroy_process_group and a new init_process_group the old (destroyed) group must not carry
    the new world's messages."""
    import torch.distributed as dist

    from pipecomm.lab.networks import launch

    def one_rank_world():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())

    one_rank_world()
    try:
        first = launch.comm_group()
        assert launch.has_comm_group()
    finally:
        dist.destroy_process_group()
    assert not launch.has_comm_group()
    one_rank_world()
    try:
        second = launch.comm_group()
        assert second is not first
        t = torch.ones(3)
        dist.all_reduce(t, group=second)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


def test_every_rank_pool_offers_the_one_interface():
    """The local pool, torchrun jobs, the virtual cluster, its jobs and an experiment's
    NetworkRanks: ``run(fn, *args, timeout_s=...)`` -> results in rank order (launch.RankPool)."""
    import inspect

    from pipecomm.lab.networks import cluster
    from pipecomm.lab.networks import kinds as network

    pools = [launch.Ranks, launch.TorchrunJob, cluster.VirtualCluster, cluster.job.ClusterJob,
             network.NetworkRanks]
    for cls in pools:
        assert issubclass(cls, launch.RankPool), cls
        params = inspect.signature(cls.run).parameters
        assert list(params)[:3] == ["self", "fn", "args"], (cls, list(params))
        assert params["timeout_s"].kind is inspect.Parameter.KEYWORD_ONLY, cls
    assert not issubclass(int, launch.RankPool)
