"""Timing harness for collectives and training steps (nccl-tests conventions).

Each measurement: ``warmup`` untimed calls, then ``iters`` timed calls, each started after a
barrier; a call's time is the maximum over ranks (the collective is done when the slowest rank is);
the reported time is the median over iterations. Bandwidths as nccl-tests defines them:
``algbw = bytes / time`` and ``busbw = algbw * factor`` with factor ``2(p-1)/p`` for allreduce and
``1`` for broadcast and reduce.

Example (inside a rank)::

    from pipecomm import bench, collectives
    t = torch.ones(1 << 20)
    stats = bench.time_fn(lambda: collectives.allreduce(t), warmup=2, iters=10)
    stats["median_s"], bench.busbw("allreduce", t.nbytes, stats["median_s"], world_size)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

BUSBW_FACTOR = {
    "allreduce": lambda p: 2.0 * (p - 1) / p if p > 1 else 1.0,
    "broadcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def busbw_factor(op: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: 2(p-1)/p for allreduce, 1 for broadcast and reduce."""
    if op not in BUSBW_FACTOR:
        raise ValueError(f"op must be one of {sorted(BUSBW_FACTOR)}, got {op!r}")
    return BUSBW_FACTOR[op](p)


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: message size over time."""
    return nbytes / seconds if seconds > 0 else float("nan")


def busbw(op: str, nbytes: int, seconds: float, p: int) -> float:
    """Bus bandwidth in bytes/s (nccl-tests): algbw times :func:`busbw_factor`.

    Example::

        busbw("allreduce", 1 << 26, 0.05, 8)   # 2*7/8 * 64 MiB / 50 ms
    """
    return algbw(nbytes, seconds) * busbw_factor(op, p)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for ``device``'s queued kernels when it is a GPU (CUDA kernels run asynchronously, so
    a host clock read without this measures launches, not work); nothing for the CPU or None.

    Example::

        bench.synchronize(launch.device()); t0 = time.perf_counter()
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    iters: int = 10,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    barrier: bool = True,
) -> dict[str, Any]:
    """Time ``fn()`` on every rank of ``group``: median over iterations of the max over ranks.

    Call it on every rank of ``group`` (it uses barriers and an allreduce of the times).
    Without torch.distributed initialised it times locally. Returns ``median_s``, ``min_s``,
    ``max_s`` and the per-iteration ``times_s`` (each the max over ranks).

    Example::

        stats = time_fn(lambda: collectives.broadcast(t, 0), warmup=1, iters=5)
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got iters={iters}, warmup={warmup}")
    distributed = dist.is_available() and dist.is_initialized()
    for _ in range(warmup):
        fn()
    synchronize(device)
    local = []
    for _ in range(iters):
        if distributed and barrier:
            dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        synchronize(device)
        local.append(time.perf_counter() - start)
    times = torch.tensor(local, dtype=torch.float64)
    if distributed and dist.get_backend(group) == "nccl":
        times = times.to(device if device is not None else torch.device("cuda"))
    if distributed:
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    per_iter = times.tolist()
    return {
        "median_s": statistics.median(per_iter),
        "min_s": min(per_iter),
        "max_s": max(per_iter),
        "times_s": per_iter,
    }
