"""Bidirectional-exchange (BE) collectives: recursive halving and doubling (Rabenseifner).

Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH"
(2005), the BE baseline of the LP paper (arXiv 1611.04255). Schedules exactly as in
``docs/algorithms.md`` ("BE"): ``p'`` = the largest power of two <= p, ``r = p - p'``.

* allreduce: of the first ``2r`` group ranks each even one sends its vector to the next odd one,
  which combines (pre-step); the ``p'`` remaining "core" ranks run a recursive-halving
  reduce-scatter (partner distance ``p'/2, p'/4, ..., 1``) and a recursive-doubling allgather
  (distance ``1, 2, ..., p'/2``); the odd ranks send the result back (post-step).
  ``T = 2 log2 p' alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma + [r>0](2 alpha + 2 n beta + n gamma)``.
* broadcast: relative to the root, core = relative ranks ``0..p'-1``: binomial scatter over the
  core, recursive-doubling allgather, then core rank ``i`` sends everything to extra ``p' + i``.
* reduce: relative to the root, extra ``p' + i`` first sends its vector to core rank ``i`` (the
  fold), recursive-halving reduce-scatter over the core, binomial gather to the root.

On the progress engine (:mod:`._engine`): each exchange posts its receive before its send and
waits only for the receive; sends complete in the background until their buffer is written
again or the collective ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipecomm.collectives._chunks import even_offsets, span
from pipecomm.collectives._engine import Engine, scratch
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish
from pipecomm.collectives._trees import binomial_gather, binomial_scatter, rooted


def _split(p: int) -> tuple[int, int]:
    core = 1 << (p.bit_length() - 1)
    return core, p - core


def _fold_in(flat: torch.Tensor, eng: Engine, peer: int, op: str) -> None:
    """Receive ``peer``'s whole vector and combine it into ``flat``."""
    incoming = scratch(flat.numel(), flat)
    eng.recv(incoming, peer).wait()
    combine(op, flat, incoming)


def recursive_halving_reduce_scatter(flat: torch.Tensor, eng: Engine, offsets: list[int], v: int,
                                     m: int, to_group: Callable[[int], int], op: str) -> None:
    """Over ``m`` (a power of two) virtual ranks: afterwards ``v`` holds chunk ``v`` reduced.

    Step with distance ``d`` (``m/2`` down to 1): keep the half of the current chunk range on
    ``v``'s side of ``d``, send the other half to ``v ^ d`` and combine what comes back.

    Example::

        recursive_halving_reduce_scatter(flat, eng, even_offsets(n, 4), v, 4, core_rank, "sum")
    """
    lo, hi = 0, m
    buf = None
    d = m // 2
    while d >= 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if v & d == 0 else ((mid, hi), (lo, mid))
        kept = span(flat, offsets, *keep)
        if buf is None:
            buf = scratch(kept.numel(), flat)
        incoming = buf[: kept.numel()]
        got = eng.recv(incoming, to_group(v ^ d))
        eng.send(span(flat, offsets, *give), to_group(v ^ d))
        if got is not None:
            got.wait()
            combine(op, kept, incoming)
        lo, hi = keep
        d //= 2


def recursive_doubling_allgather(flat: torch.Tensor, eng: Engine, offsets: list[int], v: int,
                                 m: int, to_group: Callable[[int], int]) -> None:
    """Over ``m`` (a power of two) virtual ranks: ``v`` holds chunk ``v``; afterwards all chunks.

    Example::

        recursive_doubling_allgather(flat, eng, even_offsets(n, 4), v, 4, core_rank)
    """
    lo, hi = v, v + 1
    d = 1
    while d < m:
        theirs = (lo - d, lo) if v & d else (hi, hi + d)
        got = eng.recv(span(flat, offsets, *theirs), to_group(v ^ d))
        eng.send(span(flat, offsets, lo, hi), to_group(v ^ d))
        if got is not None:
            got.wait()
        lo, hi = min(lo, theirs[0]), max(hi, theirs[1])
        d *= 2


def allreduce(flat: torch.Tensor, comm: Comm, op: str) -> None:
    """Rabenseifner allreduce in group order (folding non-powers of two).

    Example::

        allreduce(flat, comm, op="sum")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    m, r = _split(p)
    g = comm.index
    eng = Engine(comm)
    if g < 2 * r and g % 2 == 0:  # extra: fold into g + 1, get the result back
        eng.send(flat, g + 1)
        eng.recv(flat, g + 1).wait()
        eng.finish()
        return
    if g < 2 * r:
        _fold_in(flat, eng, g - 1, op)
    v = g // 2 if g < 2 * r else g - r

    def to_group(u: int) -> int:
        return 2 * u + 1 if u < r else u + r

    offsets = even_offsets(n, m)
    recursive_halving_reduce_scatter(flat, eng, offsets, v, m, to_group, op)
    finish(op, span(flat, offsets, v, v + 1), p)
    recursive_doubling_allgather(flat, eng, offsets, v, m, to_group)
    if g < 2 * r:
        eng.send(flat, g - 1)
    eng.finish()


def broadcast(flat: torch.Tensor, comm: Comm, root: int) -> None:
    """Scatter-allgather broadcast from group index ``root``.

    Example::

        broadcast(flat, comm, root=3)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    m, r = _split(p)
    v, to_group = rooted(comm.index, root, p)
    eng = Engine(comm)
    if v >= m:
        eng.recv(flat, to_group(v - m)).wait()
        return
    offsets = even_offsets(n, m)
    binomial_scatter(flat, eng, offsets, v, m, to_group)
    recursive_doubling_allgather(flat, eng, offsets, v, m, to_group)
    if v < r:
        eng.send(flat, to_group(v + m))
    eng.finish()


def reduce(flat: torch.Tensor, comm: Comm, root: int, op: str) -> None:
    """Reduce-scatter-gather reduce to group index ``root``; other buffers are overwritten.

    Example::

        reduce(flat, comm, root=1, op="min")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    m, r = _split(p)
    v, to_group = rooted(comm.index, root, p)
    eng = Engine(comm)
    if v >= m:
        eng.send(flat, to_group(v - m))
        eng.finish()
        return
    if v < r:
        _fold_in(flat, eng, to_group(v + m), op)
    offsets = even_offsets(n, m)
    recursive_halving_reduce_scatter(flat, eng, offsets, v, m, to_group, op)
    binomial_gather(flat, eng, offsets, v, m, to_group)
    eng.finish()
    if v == 0:
        finish(op, flat, p)
