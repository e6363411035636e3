"""Timing harness for collectives and training steps (nccl-tests conventions).

Every timed number of the artifact comes from :func:`time_fn`: ``warmup`` untimed calls, then
``repeats`` timed calls (more when ``min_time_s`` asks for it). Each repeat starts on every rank
at one common instant: the ranks agree on a start a little in the future (the maximum of their
clocks plus ``margin_s``, one small allreduce) and sleep until it, so the ranks really start
together; the repeat's time is the last rank's end minus the last rank's start, so the
barrier-exit skew of 8 processes on 2 cores is not measured. This needs one clock for all ranks:
``CLOCK_MONOTONIC`` is shared by every process of one host (checked once per group by comparing
the kernel's boot id, which also holds for ranks in network namespaces of one host). Ranks on
several hosts fall back to a barrier and the maximum of per-rank durations (``clock`` says which).

The result carries every repeat and the median with a bootstrap 95% interval
(:func:`pipecomm.lab.measure.stats.median_ci`). Bandwidths as nccl-tests defines them:
``algbw = bytes / time`` and ``busbw = algbw * factor`` with factor ``2(p-1)/p`` for allreduce and
``1`` for broadcast and reduce.

Example (inside a rank)::

    >>> from pipecomm import collectives
    >>> from pipecomm.lab.measure import bench
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> t = torch.ones(1 << 20)
    >>> r = bench.time_fn(lambda: collectives.allreduce(t), warmup=2, repeats=10)
    >>> r["ci_lo_s"] <= r["median_s"] <= r["ci_hi_s"], len(r["times_s"])
    (True, 10)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipecomm.lab.measure import stats
from pipecomm.lab.networks.launch import synchronize

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


def link_limit_s(op: str, n: int, p: int, bandwidth_Bps: float, ranks_per_node: int = 1) -> float:
    """The least time ``op`` of ``n`` bytes can take on nodes with one link of
    ``bandwidth_Bps`` each way (single-port): every byte must cross some node's link once for a
    broadcast or reduce (``n / B``); an allreduce over ``N = p / ranks_per_node`` nodes must
    send and receive ``2 (N - 1) / N * n`` bytes per node (the reduce-scatter + allgather bound).
    Ranks of one node share its link and talk to each other for free.

    Example::

        >>> round(link_limit_s("allreduce", 16 << 20, 8, 15e6), 2)
        1.96
    """
    nodes = max(1, p // ranks_per_node)
    if nodes == 1:
        return 0.0
    share = 2 * (nodes - 1) / nodes if op == "allreduce" else 1.0
    return share * n / bandwidth_Bps


def algbw(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: message size over time."""
    return nbytes / seconds if seconds > 0 else float("nan")


def busbw(op: str, nbytes: int, seconds: float, p: int) -> float:
    """Bus bandwidth in bytes/s (nccl-tests): algbw times :func:`busbw_factor`.

    Example::

        >>> busbw("allreduce", 1 << 26, 0.05, 8) / 1e9   # 2*7/8 * 64 MiB / 50 ms, GB/s
        2.34881024
    """
    return algbw(nbytes, seconds) * busbw_factor(op, p)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux: no way to prove a shared clock
        return ""


_SHARED: dict[int, bool] = {}


def shared_clock(group: dist.ProcessGroup | None = None) -> bool:
    """True when every rank of ``group`` runs on this host's kernel (one ``CLOCK_MONOTONIC``).

    Computed once per group (an ``all_gather_object`` of the kernel boot id).

    Example::

        >>> from pipecomm.lab.measure import bench
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> bench.shared_clock()   # True for a local pool and for the virtual cluster
        True
        >>> dist.destroy_process_group()
    """
    if not (dist.is_available() and dist.is_initialized()):
        return True
    key = id(group) if group is not None else 0
    if key not in _SHARED:
        ids: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(ids, _boot_id(), group=group)
        _SHARED[key] = bool(ids[0]) and all(i == ids[0] for i in ids)
    return _SHARED[key]


def _over_ranks(values: list[float], group, device, op=dist.ReduceOp.MAX) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend(group) == "nccl":
        t = t.to(device if device is not None else torch.device("cuda"))
    dist.all_reduce(t, op=op, group=group)
    return t.cpu().tolist()


def _sleep_until(deadline: float) -> None:
    now = time.monotonic()
    while now < deadline:
        time.sleep(deadline - now)
        now = time.monotonic()


def time_fn(
    fn: Callable[[], Any],
    *,
    warmup: int = 2,
    repeats: int = 10,
    min_time_s: float = 0.0,
    max_repeats: int = 1000,
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    margin_s: float = 0.002,
    cpu: bool = False,
) -> dict[str, Any]:
    """Time ``fn()`` on every rank of ``group`` from a common start instant (module docstring).

    Call it on every rank of ``group``. ``repeats`` timed calls follow ``warmup`` untimed ones;
    when ``min_time_s`` > 0 the count grows to cover about that much time (judged from the
    slowest rank's warm-up, so all ranks agree; at most ``max_repeats``). Without
    torch.distributed initialised it times locally.

    Returns ``median_s``, ``ci_lo_s``, ``ci_hi_s`` (bootstrap 95% interval of the median),
    ``min_s``, ``max_s``, ``times_s`` (every repeat) and ``clock`` (``"common-start"`` or
    ``"per-rank"``).

    ``cpu``: also ``cpu_s``, each repeat's CPU time (``time.process_time``: every thread of the
    process, the backend's included) summed over the ranks of ``group``: the core-seconds the
    call cost. Next to the repeat's wall time it says how busy the call kept the host's cores
    (:func:`host_busy`): on a host with fewer cores than ranks, whether a slower call spent more
    core-seconds or left cores idle.

    Example::

        >>> from pipecomm import collectives
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> t = torch.ones(1024)
        >>> r = time_fn(lambda: collectives.broadcast(t, 0), warmup=1, repeats=10)
        >>> len(r["times_s"]), r["min_s"] <= r["median_s"] <= r["max_s"]
        (10, True)
        >>> dist.destroy_process_group()
    """
    if repeats < 1 or warmup < 0 or max_repeats < repeats:
        raise ValueError(f"need repeats >= 1, warmup >= 0 and max_repeats >= repeats, got "
                         f"repeats={repeats}, warmup={warmup}, max_repeats={max_repeats}")
    if min_time_s < 0 or margin_s < 0:
        raise ValueError(f"min_time_s and margin_s must be >= 0, got {min_time_s}, {margin_s}")
    distributed = dist.is_available() and dist.is_initialized()
    shared = shared_clock(group) if distributed else True
    t0 = time.monotonic()
    for _ in range(warmup):
        fn()
    synchronize(device)
    n = repeats
    if min_time_s > 0:
        per_call = (time.monotonic() - t0) / warmup if warmup else 0.0
        if distributed:
            per_call = _over_ranks([per_call], group, device)[0]
        if per_call > 0:
            n = min(max_repeats, max(repeats, math.ceil(min_time_s / per_call)))
    starts, ends, cpus = [], [], []
    for _ in range(n):
        if distributed and shared:
            at = _over_ranks([time.monotonic() + margin_s], group, device)[0]
            _sleep_until(at)
        elif distributed:
            dist.barrier(group=group)
        cpu0 = time.process_time() if cpu else 0.0
        start = time.monotonic()
        fn()
        synchronize(device)
        starts.append(start)
        ends.append(time.monotonic())
        if cpu:
            cpus.append(time.process_time() - cpu0)
    if distributed and shared:  # last end minus last start, on the one clock
        last = _over_ranks(starts + ends, group, device)
        times = [e - s for s, e in zip(last[:n], last[n:])]
    elif distributed:
        times = _over_ranks([e - s for s, e in zip(starts, ends)], group, device)
    else:
        times = [e - s for s, e in zip(starts, ends)]
    if cpu and distributed:
        cpus = _over_ranks(cpus, group, device, dist.ReduceOp.SUM)
    return result_of(times, "common-start" if shared or not distributed else "per-rank",
                     cpus if cpu else None)


def result_of(times: list[float], clock: str = "common-start",
              cpu: list[float] | None = None) -> dict[str, Any]:
    """A :func:`time_fn` result from repeat times gathered elsewhere (e.g. interleaved calls of
    ``time_fn(..., repeats=1)``): median with its bootstrap 95% interval, min, max, every repeat;
    with ``cpu`` (per repeat, summed over ranks) also ``cpu_s``.

    Example::

        >>> from pipecomm.lab.measure import bench
        >>> bench.columns(bench.result_of([0.011, 0.010, 0.012]))["time_s"]
        0.011
    """
    if cpu is not None and len(cpu) != len(times):
        raise ValueError(f"cpu must hold one value per repeat: {len(cpu)} for {len(times)} times")
    med, lo, hi = stats.median_ci(times)
    out = {"median_s": med, "ci_lo_s": lo, "ci_hi_s": hi, "min_s": min(times),
           "max_s": max(times), "times_s": list(times), "clock": clock}
    if cpu is not None:
        out["cpu_s"] = list(cpu)
    return out


def columns(result: dict[str, Any]) -> dict[str, Any]:
    """The data.csv columns of one timed point from a :func:`time_fn` result: ``time_s``
    (median), ``ci_lo_s``, ``ci_hi_s``, ``min_s``, ``max_s``, ``repeats`` and ``times_s`` (every
    repeat, ``"t1;t2;..."``, read back with :func:`pipecomm.lab.measure.stats.repeats`); for a result timed
    with ``cpu=True`` also ``cpu_times_s`` (every repeat's CPU seconds summed over the ranks).

    Example::

        >>> from pipecomm.lab.measure import bench
        >>> rows, n = [], 1 << 20
        >>> rows.append({"algorithm": "lp", "nbytes": n, **bench.columns(result_of([0.011, 0.010, 0.012]))})   # time_fn(call)
        >>> rows[0]["time_s"], rows[0]["repeats"], rows[0]["times_s"]
        (0.011, 3, '0.011;0.01;0.012')
    """
    out = {"time_s": result["median_s"], "ci_lo_s": result["ci_lo_s"],
           "ci_hi_s": result["ci_hi_s"], "min_s": result["min_s"], "max_s": result["max_s"],
           "repeats": len(result["times_s"]), "times_s": stats.join_repeats(result["times_s"])}
    if "cpu_s" in result:
        out["cpu_times_s"] = stats.join_repeats(result["cpu_s"])
    return out


def host_cores() -> int:
    """The cores this process may run on (``os.sched_getaffinity``; ``os.cpu_count`` where the
    platform has no affinity)."""
    import os

    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_busy(cpu_s: float, wall_s: float, cores: int | None = None) -> float:
    """The share of the host's core-seconds a call used: ``cpu_s / (cores * wall_s)``, with
    ``cpu_s`` summed over every rank on the host (:func:`time_fn` with ``cpu=True``). Near 1 the
    call was bound by the host's cores: its time is its CPU divided by the cores, and a faster
    algorithm is one that costs fewer core-seconds.

    Example::

        >>> from pipecomm.lab.measure import bench
        >>> round(bench.host_busy(0.100, 0.055, cores=2), 2)   # core-bound
        0.91
    """
    cores = host_cores() if cores is None else cores
    if cores < 1 or wall_s <= 0 or cpu_s < 0:
        raise ValueError(f"need cores >= 1, wall_s > 0 and cpu_s >= 0, got {cores}, {wall_s}, "
                         f"{cpu_s}")
    return cpu_s / (cores * wall_s)
