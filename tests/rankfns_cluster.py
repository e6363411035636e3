"""Functions run on the ranks of a virtual cluster by tests/test_cluster.py (importable)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from pipecomm import cluster


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


def fan_out(nbytes: int, iters: int = 3) -> float | None:
    """Rank 0 sends ``nbytes`` to every other rank at once (gloo isend), each answers with one
    byte; rank 0 returns the median time of the whole fan-out, the others None."""
    import statistics
    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.uint8)
    times = []
    for i in range(iters + 1):  # the first opens the connections
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            for w in [dist.isend(buf, r) for r in range(1, world)]:
                w.wait()
            for r in range(1, world):
                dist.recv(ack, r)
        else:
            dist.recv(buf, 0)
            dist.send(ack, 0)
        if i:
            times.append(time.perf_counter() - start)
    dist.barrier()
    return statistics.median(times) if rank == 0 else None
