"""Sweeps of collectives over message sizes, algorithms and world sizes on a rank pool, and
their analysis: the measurement loop that E0-E4 and the collectives benchmark share.

No paper equation of its own: it times the schedules of :mod:`pipecomm.collectives` with
:func:`pipecomm.lab.measure.bench.time_fn` (common start instant, every repeat kept) on the emulated network
(:mod:`pipecomm.lab.networks.netem`) or the real backend, and locates where LP overtakes another algorithm,
measured and in the alpha-beta model of :mod:`pipecomm.lab.networks.cost` (the LP paper's argument, Wang et
al., arXiv 1611.04255, Section 3).

Example::

    from pipecomm.lab.networks import launch
    from pipecomm.lab.measure import sweep
    pts = [{"op": "broadcast", "algorithm": a, "nbytes": 1 << 20, "p": 4, "warmup": 1,
            "iters": 10} for a in ("lp", "mst")]
    params = e03_collectives_vs_ranks.Params.make(emu_alpha_s=1e-3, emu_bandwidth_Bps=1e8)
    with launch.Ranks(4, network=sweep.network(params, "single")) as r:
        rows = r.run(sweep.measure_points, pts)[0]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from pipecomm import collectives
from pipecomm.collectives import agreement
from pipecomm.lab.experiment import Params
from pipecomm.lab.measure import bench
from pipecomm.lab.networks import cost, launch

T = TypeVar("T")

__all__ = [
    "ALG_COLORS",
    "TORCH_DETAIL",
    "check_link_params",
    "collective_call",
    "detail_group",
    "measure_points",
    "measured_crossover_bytes",
    "message_sizes",
    "model_crossover_bytes",
    "network",
]

ALG_COLORS = {"lp": "C0", "mst": "C1", "be": "C2", "ring": "C3", "torch": "C4"}  # every figure


def message_sizes(lo: int, hi: int, factor: int) -> list[int]:
    """Geometric message sizes from ``lo`` to ``hi`` bytes (``hi`` always included).

    Example::

        >>> message_sizes(4, 100, 4)
        [4, 16, 64, 100]
    """
    if lo < 1 or hi < lo or factor < 2:
        raise ValueError(f"need 1 <= sizes_min <= sizes_max and size_factor >= 2, got "
                         f"{lo}, {hi}, {factor}")
    sizes, n = [], lo
    while n < hi:
        sizes.append(n)
        n *= factor
    return sizes + [hi]


def check_link_params(params: Params) -> None:
    """Validate the emulated link parameters of a sweep's ``Params`` (``emu_alpha_s``,
    ``emu_bandwidth_Bps``, ``ports`` if it has one) and its ``timeout_s``; errors name the
    parameter.

    Example::

        >>> import types
        >>> self = types.SimpleNamespace(emu_alpha_s=1e-3, emu_bandwidth_Bps=0, timeout_s=60.0)
        >>> check_link_params(self)     # in E3's and E4's Params.validate()
        Traceback (most recent call last):
        ValueError: parameter emu_bandwidth_Bps must be a positive number, got 0
    """
    if hasattr(params, "ports") and params.ports not in ("single", "per-neighbor"):
        raise ValueError(
            f"parameter ports must be 'single' or 'per-neighbor', got {params.ports!r}")
    for name in ("emu_alpha_s", "emu_bandwidth_Bps", "timeout_s"):
        v = getattr(params, name)
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or v < 0
            or (name != "emu_alpha_s" and v == 0)
        ):
            raise ValueError(f"parameter {name} must be a positive number, got {v!r}")


def network(params: Params, ports: str | None = None):
    """The emulated :class:`pipecomm.lab.networks.netem.Network` of a sweep's ``Params`` (``emu_alpha_s``,
    ``emu_bandwidth_Bps``), with ``ports`` (default: the parameter ``ports``).

    Example::

        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks
        >>> network(e03_collectives_vs_ranks.Params.make(), "single").describe()
        'emulated, single-port, 2.0 ms / 100 MB/s'
    """
    from pipecomm.lab.networks import netem

    return netem.Network(
        alpha_s=params.emu_alpha_s,
        bandwidth_Bps=params.emu_bandwidth_Bps,
        ports=ports if ports is not None else params.ports,
    )


#: A sweep point's algorithm for the built-in behind torch's own agreement check: the group is
#: made with ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch wraps it in a ``ProcessGroupWrapper``
#: that compares every rank's call before each collective and raises on every rank where they
#: differ): the check pipecomm's own is compared with (``bench_collectives.py --check-cost``).
TORCH_DETAIL = "torch:detail"


def detail_group(ranks: list[int]) -> dist.ProcessGroup:
    """A new group of global ``ranks`` whose collectives go through torch's own agreement check
    (debug level DETAIL while it is made, restored after); collective like ``dist.new_group``.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> g = detail_group([0])
        >>> dist.all_reduce(torch.ones(2), group=g)
        >>> dist.get_debug_level() == dist.DebugLevel.DETAIL
        False
        >>> dist.destroy_process_group()
    """
    before = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        return dist.new_group(ranks, timeout=launch.group_timeout())
    finally:
        dist.set_debug_level(before)


def collective_call(op: str, alg: str, t: torch.Tensor, group: Any = None,
                    block_bytes: int | None = None) -> Callable[[], Any]:
    """A call of ``op`` (sum; root 0) with algorithm ``alg`` on ``t`` over ``group``: what a
    sweep point times. ``alg="check"``: only the check that the ranks agree on the call, which
    every pipecomm algorithm makes first (:func:`pipecomm.collectives.agreement.check_alone`);
    ``"unchecked:ALG"``: ``ALG``'s call without it (:func:`~pipecomm.collectives.agreement.
    skipped`).

    Example::

        >>> import torch.distributed as dist
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> collective_call("allreduce", "ring", torch.ones(1024))().sum()
        tensor(1024.)
        >>> dist.destroy_process_group()
    """
    if alg == "check":  # the ranks' agreement check of a pipecomm call, alone
        return lambda: agreement.check_alone(op, t, group=group)
    if alg.startswith("unchecked:"):  # the call without that check
        call = collective_call(op, alg.removeprefix("unchecked:"), t, group, block_bytes)

        def unchecked() -> Any:
            with agreement.skipped():
                return call()

        return unchecked
    kw = {"algorithm": alg, "group": group, "block_bytes": block_bytes}
    if op == "broadcast":
        return lambda: collectives.broadcast(t, 0, **kw)
    if op == "reduce":
        return lambda: collectives.reduce(t, 0, **kw)
    return lambda: collectives.allreduce(t, **kw)


def rotated(items: Sequence[T], i: int) -> list[T]:
    """Round ``i``'s order of contenders timed side by side: ``items`` starting at ``i mod k``
    and going round, so that over ``k`` rounds every contender takes every place once.

    Example::

        >>> rotated(["lp", "ring", "torch"], 4)
        ['ring', 'torch', 'lp']
    """
    j = i % len(items) if items else 0
    return [*items[j:], *items[:j]]


def _row(pt: dict[str, Any], q: int, result: dict[str, Any], block: int | None,
         chose: str | None = None) -> dict:
    return {
        **{k: pt[k] for k in ("op", "algorithm", "nbytes", "warmup", "iters")},
        "world_size": q,
        **bench.columns(result),
        "block_bytes": block,
        "chose": chose,
    }


def _runs(points: list[dict[str, Any]], interleave: bool) -> list[list[dict[str, Any]]]:
    """Points cut into runs timed together: consecutive points with the same ``p``, ``op`` and
    ``nbytes`` when ``interleave``, else one point each."""
    runs: list[list[dict[str, Any]]] = []
    for pt in points:
        key = (pt["p"], pt["op"], pt["nbytes"])
        if interleave and runs and (runs[-1][0]["p"], runs[-1][0]["op"],
                                    runs[-1][0]["nbytes"]) == key:
            runs[-1].append(pt)
        else:
            runs.append([pt])
    return runs


def measure_points(
    points: list[dict[str, Any]], device: str | None = None, interleave: bool = False,
    cpu: bool = False,
) -> list[dict]:
    """On every rank: time each point ``{op, algorithm, nbytes, p, warmup, iters}``, with an
    optional ``block_bytes`` for LP (default: ``lp.default_block_bytes``). Algorithm
    :data:`TORCH_DETAIL`: the built-in on a :func:`detail_group` of the same ranks.

    Points run in the given order; a point with ``p`` < world size runs on the subgroup of global
    ranks ``0..p-1`` (the other ranks wait at a world barrier after each run of points with the
    same ``p``). Rank 0 returns one row per point (median, min, max over iterations of the max
    over ranks, the LP block size used and, for ``auto``, what it ran: ``chose``); the others
    return ``[]``.

    ``interleave``: consecutive points with the same ``p``, ``op`` and ``nbytes`` (the algorithms
    of one comparison) are timed round-robin -- each takes its warm-up calls, then repeat ``i``
    times one call of every point, starting at point ``i mod k`` of the ``k`` and going round
    (they must share ``iters``) -- so a passing disturbance of the host hits all of them alike
    instead of whichever is timed first, and every point takes every place in the round equally
    often (``iters`` a multiple of ``k``): a call's place in a round can have an effect of its
    own, which a fixed order would hand to the same point every round and the rotation
    (:func:`rotated`) spreads evenly. Times stay in repeat order, so repeat ``i`` of two points
    is a pair (:func:`pipecomm.lab.measure.stats.paired_ratio_ci`). Every call has its own common start
    (:func:`pipecomm.lab.measure.bench.time_fn`). ``cpu``: rows also carry ``cpu_times_s``, every repeat's
    CPU seconds summed over the ranks (``time_fn(..., cpu=True)``).

    Example::

        pt = {"op": "broadcast", "algorithm": "lp", "nbytes": 1 << 20, "p": 4,
              "warmup": 1, "iters": 3}
        rows = ranks.run(measure_points, [pt])[0]
    """
    from pipecomm import vocab
    from pipecomm.collectives import api, lp

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device) if device else torch.device("cpu")
    sync = dev if dev.type == "cuda" else None
    sizes_p = sorted({pt["p"] for pt in points})
    timeout = launch.group_timeout()
    groups = {q: (None if q == world else dist.new_group(list(range(q)), timeout=timeout))
              for q in sizes_p}
    detail = ({q: detail_group(list(range(q))) for q in sizes_p}
              if any(pt["algorithm"] == TORCH_DETAIL for pt in points) else {})
    rows: list[dict] = []
    warmed: set = set()
    buf: dict = {}
    prev_p = None
    for run in _runs(points, interleave):
        q, n, op = run[0]["p"], run[0]["nbytes"], run[0]["op"]
        if len({pt["iters"] for pt in run}) > 1:
            raise ValueError(f"interleaved points of p={q}, {op}, {n} B must share iters, got "
                             f"{[pt['iters'] for pt in run]}")
        if prev_p is not None and q != prev_p:
            dist.barrier()
        prev_p = q
        if rank >= q:
            continue
        g = groups[q]
        if (q, n) not in buf:
            buf.clear()
            buf[(q, n)] = torch.zeros(max(1, n // 4), dtype=torch.float32, device=dev)
        t = buf[(q, n)]
        calls = []
        for pt in run:
            alg = pt["algorithm"]
            block = pt.get("block_bytes") if alg == "lp" else None
            on = (detail[q], "torch") if alg == TORCH_DETAIL else (g, alg)  # group, algorithm
            if (q, op, alg) not in warmed and pt.get("first_warmup", False):
                small = torch.zeros(1024, dtype=torch.float32, device=dev)
                collective_call(op, on[1], small, on[0])()
            warmed.add((q, op, alg))
            calls.append(collective_call(op, on[1], t, on[0], block))
        if len(run) == 1:
            results = [bench.time_fn(calls[0], warmup=run[0]["warmup"], repeats=run[0]["iters"],
                                     group=g, device=sync, cpu=cpu)]
        else:
            for pt, fn in zip(run, calls):
                for _ in range(pt["warmup"]):
                    fn()
            times: list[list[float]] = [[] for _ in run]
            cpus: list[list[float]] = [[] for _ in run]
            for i in range(run[0]["iters"]):
                for j in rotated(range(len(run)), i):  # repeat i starts at point i mod k
                    r = bench.time_fn(calls[j], warmup=0, repeats=1, group=g, device=sync,
                                      cpu=cpu)
                    times[j] += r["times_s"]
                    cpus[j] += r.get("cpu_s", [])
            results = [bench.result_of(ts, cpu=cs if cpu else None)
                       for ts, cs in zip(times, cpus)]
        if rank == 0:
            for pt, res in zip(run, results):
                block = pt.get("block_bytes")
                if pt["algorithm"] == "lp" and block is None:
                    block = lp.default_block_bytes(op, t.numel() * 4, q)
                chose = api.auto_choice(op, t, group=g) if pt["algorithm"] == vocab.AUTO else None
                rows.append(_row(pt, q, res, block if pt["algorithm"] == "lp" else None, chose))
    dist.barrier()
    return rows


def measured_crossover_bytes(nbytes: Any, t_lp: Any, t_other: Any) -> float:
    """Smallest message size from which LP stays faster than the other algorithm.

    ``log(t_other / t_lp)`` is interpolated linearly in ``log(nbytes)`` between the last size
    where LP is not faster and the next one. Returns the smallest size if LP is faster at every
    size, ``inf`` if it is not faster at the largest.

    Example::

        >>> measured_crossover_bytes([1, 4, 16], [2.0, 1.0, 1.0], [1.0, 1.0, 2.0])
        4.0
    """
    n = np.asarray(nbytes, dtype=float)
    r = np.log(np.asarray(t_other, dtype=float) / np.asarray(t_lp, dtype=float))
    order = np.argsort(n)
    n, r = n[order], r[order]
    if r[-1] <= 0:
        return math.inf
    slower = np.nonzero(r <= 0)[0]
    if slower.size == 0:
        return float(n[0])
    i = int(slower[-1])
    if r[i] == 0:
        return float(n[i])
    x0, x1 = np.log(n[i]), np.log(n[i + 1])
    x = x0 + (x1 - x0) * (0 - r[i]) / (r[i + 1] - r[i])
    return float(np.exp(x))


def model_crossover_bytes(
    op: str,
    other: str,
    p: int,
    link: cost.LinkModel,
    lo: float,
    hi: float,
    points_per_octave: int = 16,
    host_block_s: float | None = None,
) -> float:
    """Smallest size in ``[lo, hi]`` from which modelled LP stays faster than ``other``.

    Evaluated on a geometric grid (``points_per_octave``) with LP's default (lock-step optimal)
    block sizes and refined like :func:`measured_crossover_bytes`; ``inf`` if LP is not faster
    at ``hi``. ``host_block_s=None``: LP by the paper's lock-step model; a number: by the
    overlapped model of the progress engine with that host cost per block
    (:func:`pipecomm.lab.networks.cost.overlapped_time`).

    Example::

        >>> link = cost.LinkModel.from_bandwidth(2e-3, 50e6, gamma=1e-9)
        >>> round(model_crossover_bytes("broadcast", "be", 8, link, 1 << 14, 1 << 26) / 2**20, 1)
        4.1
        >>> round(model_crossover_bytes("broadcast", "be", 8, link, 1 << 14, 1 << 26,
        ...                             host_block_s=124e-6) / 2**20, 1)          # MiB
        1.4
    """
    num = max(2, int(round(np.log2(hi / lo) * points_per_octave)) + 1)
    sizes = np.unique(np.geomspace(lo, hi, num).astype(np.int64))
    if host_block_s is None:
        t_lp = [cost.collective_time(op, "lp", int(n), p, link) for n in sizes]
    else:
        t_lp = [cost.overlapped_time(op, "lp", int(n), p, link, host_block_s=host_block_s)
                for n in sizes]
    t_o = [cost.collective_time(op, other, int(n), p, link) for n in sizes]
    return measured_crossover_bytes(sizes, t_lp, t_o)
