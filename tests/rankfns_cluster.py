"""Functions run on the ranks of a virtual cluster by tests/test_cluster.py (importable)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipecomm.lab.networks import cluster


def where(n: int = 0) -> dict:
    """Where this rank runs: its rank, node address, gloo interface and network namespace; and
    the allreduce of ``rank + arange(n)`` (built-in, gloo) as a list."""
    return {
        "allreduce": allreduce_sum(n),
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "node_addr": os.environ.get("NODE_ADDR"),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "netns": os.readlink("/proc/self/ns/net"),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "cluster": cluster.current(),
    }


def allreduce_sum(n: int) -> list[float]:
    """Allreduce (built-in, gloo) of ``rank + arange(n)``; the result as a list."""
    t = torch.arange(n, dtype=torch.float64) + dist.get_rank()
    dist.all_reduce(t)
    return t.tolist()


def fail_on(rank: int) -> int:
    """Raise on ``rank``; the others return their rank."""
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} fails on purpose")
    return dist.get_rank()


_CALLS = 0


def count_calls() -> int:
    """How many times this rank process has run this function (state kept across a job's
    calls)."""
    global _CALLS
    _CALLS += 1
    return _CALLS


def sleep_s(seconds: float) -> int:
    """Sleep, then return the rank."""
    import time

    time.sleep(seconds)
    return dist.get_rank()
