"""LP as pipecomm's progress engine runs it: the overlapped model (a block's latency is in
flight while the port sends the next one), its optimal block, and :func:`overlapped_time`, the
model of every algorithm as the engine runs it (docs/algorithms.md, "LP as the engine runs it").

Example::

    >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
    >>> round(lp_overlapped_time("broadcast", 4 << 20, 8, link, 1 << 18) * 1e3, 2)   # ms
    129.34
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any

import numpy as np

from pipecomm.lab.networks.cost.link import (
    DEFAULT_MIN_BLOCK_BYTES,
    LinkModel,
    _check_algorithm,
    _check_link,
    _check_op,
    _round_up8,
    as_count,
)
from pipecomm.lab.networks.cost.lockstep import collective_time, lp_optimal_block_bytes

#: The two models of LP's time: the paper's lock-step steps (every step pays ``alpha``) and the
#: progress engine's overlapped pipeline (a block's latency is in flight while the port sends
#: the next one; docs/algorithms.md, "LP as the engine runs it").
LP_MODELS: tuple[str, ...] = ("lock-step", "overlapped")


def _check_host_block(host_block_s: Any) -> float:
    if isinstance(host_block_s, bool) or not isinstance(host_block_s, numbers.Real):
        raise TypeError(f"host_block_s must be a real number of seconds, got {host_block_s!r}")
    if not (math.isfinite(host_block_s) and host_block_s >= 0):
        raise ValueError(f"host_block_s must be finite and >= 0, got {host_block_s!r}")
    return float(host_block_s)


def _lp_overlapped_vec(op: str, n: int, p: int, b: np.ndarray, link: LinkModel,
                       h: float) -> np.ndarray:
    """The overlapped LP time for block sizes ``b`` (``n >= 1``, ``p >= 2``)."""
    b = np.minimum(np.asarray(b).astype(np.int64), n)
    k = (n + b - 1) // b
    bl = n - (k - 1) * b
    a, be, g = link.alpha, link.beta, link.gamma
    if op == "broadcast":
        return (p - 1) * a + (n + (p - 2) * b) * be + k * h
    if op == "reduce":
        return (p - 1) * a + (n + (p - 2) * b) * be + ((p - 2) * b + bl) * g + k * h
    return np.array([_lp_replay(op, n, p, int(x), link) for x in b]) + k * h


@functools.lru_cache(maxsize=4096)
def _lp_replay(op: str, n: int, p: int, b: int, link: LinkModel) -> float:
    """LP ``op`` replayed on ``link``'s ports: each rank runs the engine's order of waits,
    combines and sends (:mod:`pipecomm.collectives.lp`), every send is reserved on the ports
    (:class:`pipecomm.lab.networks.netem.LinkSchedule`: ``alpha`` in flight, ``b beta`` on the sender's
    out-port and, single port, the receiver's in-port, earliest fit in posting order) when its
    rank posts it, and a receive completes at its delivery. Returns the time the last rank is
    done."""
    from pipecomm.lab.networks import netem

    bw = math.inf if link.beta == 0 else 1.0 / link.beta
    sched = netem.LinkSchedule(netem.Network(alpha_s=link.alpha, bandwidth_Bps=bw,
                                             ports=link.ports), p)
    table = sched.new_table()
    k = -(-n // b)
    size = [b] * (k - 1) + [n - (k - 1) * b]

    def program(i: int):  # ("send", peer, block, stream) | ("recv", ...) | ("cpu", seconds)
        if op != "allreduce":
            if i == 0:
                yield from (("send", 1, j, 0) for j in range(k))
                return
            for j in range(k):
                yield "recv", i - 1, j, 0
                if op == "reduce":
                    yield "cpu", link.gamma * size[j]
                if i < p - 1:
                    yield "send", i + 1, j, 0
            return
        if i == 0:
            yield from (("send", 1, j, 0) for j in range(k))
        for s in range(k + 2 * p - 3):
            up, down = s - i + 1, s - (2 * p - 3 - i)
            if i > 0 and 0 <= up < k:
                yield "recv", i - 1, up, 0
                yield "cpu", link.gamma * size[up]
                yield ("send", i + 1, up, 0) if i < p - 1 else ("send", i - 1, up, 1)
            if i < p - 1 and 0 <= down < k:
                yield "recv", i + 1, down, 1
                if i > 0:
                    yield "send", i - 1, down, 1

    ranks = [program(i) for i in range(p)]
    clock = [0.0] * p
    todo = [next(r, None) for r in ranks]
    delivered: dict[tuple[int, int, int, int], float] = {}
    end = 0.0
    while True:  # the ready action that happens first (a post is final once made)
        best, who = math.inf, -1
        for i, act in enumerate(todo):
            if act is None:
                continue
            t = clock[i]
            if act[0] == "recv":
                key = (act[1], i, act[2], act[3])
                if key not in delivered:
                    continue
                t = max(t, delivered[key])
            if t < best:
                best, who = t, i
        if who < 0:
            break
        act = todo[who]
        if act[0] == "send":
            due = sched.post(table, who, act[1], size[act[2]], now=best, prune_before=-1.0)
            delivered[(who, act[1], act[2], act[3])] = due
            end = max(end, due)
        elif act[0] == "cpu":
            best += act[1]
        clock[who] = best
        end = max(end, best)
        todo[who] = next(ranks[who], None)
    if any(act is not None for act in todo):
        raise RuntimeError("LP replay stalled: a rank waits for a message never sent")
    return end


def lp_overlapped_time(op: str, nbytes: int, p: int, link: LinkModel, block_bytes: int,
                       host_block_s: float = 0.0) -> float:
    """Predicted LP time as the progress engine runs it (the overlapped model).

    The engine forwards a block the moment it has arrived (and been combined), and a link's
    latency does not occupy its port, so a block's ``alpha`` is in flight while the port sends
    the next block: latency is paid once per hop of the chain, not once per pipeline step.
    Closed forms (Wang et al., arXiv 1611.04255, schedule; derivation in docs/algorithms.md,
    "LP as the engine runs it"), ``k = ceil(n / b)``, last block ``bl = n - (k - 1) b``:

    * broadcast: ``(p - 1) alpha + (n + (p - 2) b) beta + k h``;
    * reduce: ``(p - 1) alpha + (n + (p - 2) b) beta + ((p - 2) b + bl) gamma + k h``;
    * allreduce: no closed form (the engine's one loop per rank couples the two streams, and a
      single port carries both): the engine's order of posts replayed on the link's ports, plus
      ``k h``.

    ``h = host_block_s``: host seconds each block adds to the critical path (the block's share
    of the ranks' posting and wake-ups on a host with fewer cores than ranks); the lab takes
    E0's per-message latency of the real backend (``calibrated_link().alpha``). It is what
    keeps the optimum block finite: without it smaller blocks are always faster.

    Example::

        >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
        >>> round(lp_overlapped_time("broadcast", 4 << 20, 8, link, 1 << 18) * 1e3, 2)   # ms
        129.34
    """
    _check_op(op)
    link = _check_link(link)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    b = min(as_count(block_bytes, "block_bytes", 1), max(n, 1))
    h = _check_host_block(host_block_s)
    if n == 0 or p == 1:
        return 0.0
    return float(_lp_overlapped_vec(op, n, p, np.array([b]), link, h)[0])


def lp_overlapped_block_bytes(op: str, nbytes: int, p: int, link: LinkModel,
                              host_block_s: float, *,
                              min_bytes: int = DEFAULT_MIN_BLOCK_BYTES) -> int:
    """The LP block size (bytes, a multiple of 8, or the whole message) minimising
    :func:`lp_overlapped_time`.

    For broadcast the optimum is the paper's form with the host's per-block cost in place of
    the latency: ``b* = sqrt(n h / ((p - 2) beta))``, ``k* = sqrt((p - 2) n beta / h)``
    (reduce: ``beta + gamma`` for ``beta``); with ``h = 0`` it is ``min_bytes`` (as small as the
    host allows). Broadcast and reduce are minimised exactly over the two ends of every block
    count's interval (as :func:`lp_optimal_block_bytes`); allreduce over a geometric grid (8
    points per doubling, at most 512 blocks) and ``ceil(n / k)`` for ``k`` up to 16. Ties go to
    the larger block.

    Example::

        >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
        >>> lp_overlapped_block_bytes("broadcast", 4 << 20, 8, link, 124e-6) >> 10   # KiB
        64
    """
    _check_op(op)
    link = _check_link(link)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    lo = as_count(min_bytes, "min_bytes", 1)
    h = _check_host_block(host_block_s)
    if n <= lo or p == 1 or (p == 2 and op != "allreduce"):
        return n if n > 0 else 8
    return _lp_overlapped_block_bytes(op, n, p, link, h, lo)


@functools.lru_cache(maxsize=4096)
def _lp_overlapped_block_bytes(op: str, n: int, p: int, link: LinkModel, h: float,
                               lo: int) -> int:
    lo8 = _round_up8(lo)
    if op == "allreduce":  # each candidate is a replay: at most 512 blocks
        lo8 = max(lo8, _round_up8(-(-n // 512)))
        if lo8 >= n:
            return n
        ks = np.arange(1, min(n // lo8, 16) + 1)
        grid = np.r_[np.geomspace(lo8, n, max(2, int(8 * math.log2(n / lo8)) + 1)), -(-n // ks)]
        cands = np.unique(np.maximum(lo8, _round_up8(grid.astype(np.int64))))
    else:
        ks = np.arange(1, -(-n // lo8) + 1, dtype=np.int64)
        small = np.maximum(_round_up8(-(-n // ks)), lo8)
        large = np.where(ks > 1, ((n - 1) // np.maximum(ks - 1, 1) // 8) * 8, n)
        cands = np.unique(np.r_[small, large[large >= lo8]])
    cands = np.r_[cands[(cands >= lo8) & (cands < n)], n][::-1]  # descending: ties go large
    times = _lp_overlapped_vec(op, n, p, cands, link, h)
    return int(cands[int(np.argmin(times))])


def overlapped_time(op: str, algorithm: str, nbytes: int, p: int, link: LinkModel,
                    block_bytes: int | None = None, *, host_block_s: float = 0.0) -> float:
    """Predicted time of a collective as pipecomm's progress engine runs it: LP by the
    overlapped model (:func:`lp_overlapped_time`; ``block_bytes=None``: the block LP uses by
    default, :func:`lp_optimal_block_bytes`), MST, BE and ring by :func:`collective_time`
    (their steps wait for whole messages, so the lock-step model is theirs).

    Example::

        >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
        >>> round(overlapped_time("broadcast", "mst", 1 << 20, 8, link), 4)
        0.0689
    """
    _check_op(op)
    _check_algorithm(algorithm)
    if algorithm != "lp":
        return collective_time(op, algorithm, nbytes, p, link, block_bytes)
    if block_bytes is None:
        n = as_count(nbytes, "nbytes", 0)
        block_bytes = lp_optimal_block_bytes(op, n, as_count(p, "p", 1), _check_link(link)) \
            if n > 0 else 8
    return lp_overlapped_time(op, nbytes, p, link, block_bytes, host_block_s)
