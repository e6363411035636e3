"""Linear Pipelining (LP) collectives: a chain of ranks, the message cut into blocks.

Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural Networks"
(arXiv 1611.04255). The schedules are exactly those of ``docs/algorithms.md`` ("LP"), with
``k = ceil(n / b)`` blocks of ``b`` bytes:

* broadcast: chain ``c_i = src + i (mod p)``; in step ``s`` position ``i`` sends block ``s - i``
  to ``c_{i+1}`` and receives block ``s - i + 1`` from ``c_{i-1}``.
  ``T = (k + p - 2)(alpha + b beta)``.
* reduce: chain ending at ``dst`` (``c_0 = dst + 1``, ..., ``c_{p-1} = dst``); a received partial
  block is combined with the rank's own and forwarded in the next step.
  ``T = (k + p - 2)(alpha + b beta + b gamma)``.
* allreduce: chain in group order; a pipelined reduce towards ``c_{p-1}`` and, at the same time, a
  pipelined broadcast of finished blocks back to ``c_0`` (both directions of every link busy);
  ``k + 2p - 3`` steps.

With a codec (Pipe-SGD's light compression, allreduce only) a block travels encoded: each hop
decodes the received partial sum, adds its own block and re-encodes it; the finished blocks
travel back encoded once and are decoded once by each rank (the last rank of the chain keeps
``decode(encode(block))`` too, so every rank holds identical bits).

The steps above are the dependency structure; they run on the progress engine
(:mod:`._engine`): receives posted two blocks ahead, each block forwarded the moment it has
arrived and been combined, sends waited for only before their buffer is written again or at the
end. The combines happen in the order of the steps, so the bits are those of the lock-step
schedule. Broadcast and allreduce without a codec post straight to the backend where
:meth:`._group.Comm.direct` allows it (:func:`_broadcast_direct`, :func:`_allreduce_direct`: the
same schedule, the buffer waits read off it, the same bits).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pipecomm.collectives._chunks import block, num_blocks
from pipecomm.collectives._engine import DEPTH, Engine, scratch_slots
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish

#: The link LP plans its default blocks on until :func:`set_link` is called: ``(alpha_s,
#: bandwidth_Bps)`` of gloo over loopback as measured once on a 2-core development machine
#: (160 us, 2.5 GB/s; the lab sets E0's calibration, the emulated or the shaped network's link).
DEFAULT_LINK: tuple[float, float] = (160e-6, 2.5e9)
#: The smallest default block (bytes): below it a block's latency outweighs any overlap.
MIN_BLOCK_BYTES = 4096

_LINK: tuple[float, float] = DEFAULT_LINK


def set_link(alpha_s: float, bandwidth_Bps: float) -> None:
    """Plan LP's default blocks (:func:`default_block_bytes`) on a link of latency ``alpha_s``
    seconds and ``bandwidth_Bps`` bytes per second; ``set_link(*DEFAULT_LINK)`` restores the
    default. Call it with the same values on every rank: the ranks must cut a message alike.

    Example::

        >>> set_link(1e-3, 50e6); link()
        (0.001, 50000000.0)
        >>> set_link(*DEFAULT_LINK)
    """
    alpha_s, bandwidth_Bps = float(alpha_s), float(bandwidth_Bps)
    if not (math.isfinite(alpha_s) and alpha_s >= 0):
        raise ValueError(f"alpha_s must be a finite number of seconds >= 0, got {alpha_s!r}")
    if not (math.isfinite(bandwidth_Bps) and bandwidth_Bps > 0):
        raise ValueError(f"bandwidth_Bps must be a finite positive number, got {bandwidth_Bps!r}")
    global _LINK
    _LINK = (alpha_s, bandwidth_Bps)


def link() -> tuple[float, float]:
    """The ``(alpha_s, bandwidth_Bps)`` LP's default blocks are planned on (:func:`set_link`)."""
    return _LINK


def default_block_bytes(kind: str, nbytes: int, p: int, compression_ratio: float = 1.0) -> int:
    """LP's block size (bytes) for ``kind`` of ``nbytes`` over ``p`` ranks: the alpha-beta
    optimum on :func:`link`, in closed form.

    A schedule of ``k + m`` steps of ``alpha + b beta / r`` each (``m = p - 2`` for broadcast and
    reduce, ``2p - 3`` for allreduce; ``r = compression_ratio``, uncompressed over wire bytes,
    when blocks travel encoded) is shortest at ``b* = sqrt(n alpha r / (m beta))``; it is rounded
    up to a multiple of 8 and kept within ``[MIN_BLOCK_BYTES, nbytes]`` (the whole message when
    pipelining cannot pay, ``m <= 0``). A deterministic function of its arguments and the link,
    so ranks that set the same link cut a message alike.

    Example::

        >>> default_block_bytes("allreduce", 1 << 24, 8)     # on DEFAULT_LINK
        718488
    """
    n = max(0, int(nbytes))
    m = p - 2 if kind in ("broadcast", "reduce") else 2 * p - 3
    alpha, bandwidth = _LINK
    if n <= MIN_BLOCK_BYTES or m <= 0:
        return max(n, 8)
    best = math.sqrt(n * alpha * bandwidth * float(compression_ratio) / m)
    return min(n, max(MIN_BLOCK_BYTES, -(-math.ceil(best) // 8) * 8))


def broadcast(flat: torch.Tensor, comm: Comm, root: int, *, block_elems: int) -> None:
    """Pipelined chain broadcast from group index ``root`` (``flat`` is 1-D, contiguous).

    Example::

        broadcast(flat, comm, root=0, block_elems=1024)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    k = num_blocks(n, block_elems)
    i = (comm.index - root) % p
    nxt, prev = (root + i + 1) % p, (root + i - 1) % p
    blocks = [block(flat, j, block_elems) for j in range(k)]
    send = comm.direct(nxt, True, flat) if i < p - 1 else None
    recv = comm.direct(prev, False, flat) if i > 0 else None
    if (send is not None or i == p - 1) and (recv is not None or i == 0):
        _broadcast_direct(blocks, send, recv)
        return
    eng = Engine(comm)
    q = eng.queue(prev, k, blocks.__getitem__, k) if i > 0 else None  # into place: all posted
    for j in range(k):
        if q is not None:
            q.wait(j)
        if i < p - 1:
            eng.send(blocks[j], nxt)
    eng.finish()


def _broadcast_direct(blocks: list[torch.Tensor], send: Any, recv: Any) -> None:
    """:func:`broadcast`'s chain posted straight to the backend
    (:class:`pipecomm.collectives.p2p.Direct`; ``None``: the root has no receives, the last
    rank no sends): every block's receive posted into place up front, each block forwarded the
    moment it has arrived, the sends waited at the end (a broadcast never writes a block it
    forwarded)."""
    works = [recv(b) for b in blocks] if recv is not None else None
    sends = []
    for j, b in enumerate(blocks):
        if works is not None:
            works[j].wait()
        if send is not None:
            sends.append(send(b))
    for work in sends:
        work.wait()
    for poster in (send, recv):
        if poster is not None:
            poster.record()


def reduce(flat: torch.Tensor, comm: Comm, root: int, op: str, *, block_elems: int) -> None:
    """Pipelined chain reduce to group index ``root``; other ranks' buffers are overwritten.

    Example::

        reduce(flat, comm, root=2, op="sum", block_elems=1024)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    k = num_blocks(n, block_elems)
    i = (comm.index - root - 1) % p  # c_i = root + 1 + i, c_{p-1} = root
    nxt, prev = (root + i + 2) % p, (root + i) % p
    eng = Engine(comm)
    blocks = [block(flat, j, block_elems) for j in range(k)]
    q = None
    if i > 0:
        q = eng.scratch_queue(prev, k, min(block_elems, n), flat, lambda j: blocks[j].numel())
    for j in range(k):
        if q is not None:
            combine(op, blocks[j], q.wait(j))
        if i < p - 1:
            eng.send(blocks[j], nxt)
    eng.finish()
    if i == p - 1:
        finish(op, flat, p)


def allreduce(
    flat: torch.Tensor, comm: Comm, op: str, *, block_elems: int, codec: Any = None
) -> None:
    """Bidirectional pipelined chain allreduce in group order (``k + 2p - 3`` steps).

    Example::

        allreduce(flat, comm, op="avg", block_elems=1024)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    if codec is not None:
        _allreduce_encoded(flat, comm, op, block_elems, codec)
        return
    k = num_blocks(n, block_elems)
    i = comm.index
    blocks = [block(flat, j, block_elems) for j in range(k)]
    left = (comm.direct(i - 1, True, flat), comm.direct(i - 1, False, flat)) if i > 0 else ()
    right = (comm.direct(i + 1, True, flat), comm.direct(i + 1, False, flat)) if i < p - 1 else ()
    if None not in (*left, *right):
        _allreduce_direct(blocks, flat, min(block_elems, n), op, i, p, left, right)
        return
    eng = Engine(comm)
    up = down = None
    if i > 0:  # partial sums from the left
        up = eng.scratch_queue(i - 1, k, min(block_elems, n), flat, lambda j: blocks[j].numel())
    if i < p - 1:  # finished blocks from the right, into blocks already sent right
        down = eng.queue(i + 1, k, blocks.__getitem__, _down_depth(p, i), lazy=True)
    if i == 0:
        for j in range(k):
            eng.send(blocks[j], 1)
    for s in range(k + 2 * p - 3):
        b = s - i + 1  # partial block received from the left, forwarded right at once
        c = s - (2 * p - 3 - i)  # finished block received from the right, forwarded left
        if up is not None and 0 <= b < k:
            combine(op, blocks[b], up.wait(b))
            if i < p - 1:
                eng.send(blocks[b], i + 1)
            else:
                finish(op, blocks[b], p)
                eng.send(blocks[b], i - 1)
        if down is not None and 0 <= c < k:
            down.wait(c)
            if i > 0:
                eng.send(blocks[c], i - 1)
    eng.finish()


def _allreduce_direct(blocks: list[torch.Tensor], flat: torch.Tensor, elems: int, op: str,
                      i: int, p: int, left: tuple, right: tuple) -> None:
    """:func:`allreduce`'s schedule (the same messages, combines and bits as on the engine)
    posted straight to the backend (:class:`pipecomm.collectives.p2p.Direct`; ``left`` and
    ``right``: (send, receive) posters to the neighbours, empty at the chain's ends). Which send
    a buffer waits for is known from the schedule: a finished block's receive goes into the
    block whose partial sum went right, so that send is waited just before the receive is posted
    (``_down_depth`` of them ahead, from the first finished block's step on); partial sums from
    the left land in scratch slots (:func:`._engine.scratch_slots`)."""
    k = len(blocks)
    to_left, from_left = left if left else (None, None)
    to_right, from_right = right if right else (None, None)
    by_right: list[Any] = [None] * k  # sends of blocks to the right, until their buffer is reused
    others: list[Any] = []  # sends to the left: never written again
    up: list[tuple[torch.Tensor, Any]] = []
    m = ahead = 0
    if from_left is not None:
        slots, ahead = scratch_slots(k, elems, flat)
        m = len(slots)
        for j in range(ahead):
            t = slots[j % m][: blocks[j].numel()]
            up.append((t, from_left(t)))
    down: list[Any] = []
    depth = _down_depth(p, i)
    if i == 0:
        by_right = [to_right(b) for b in blocks]
    for s in range(k + 2 * p - 3):
        b = s - i + 1  # partial block received from the left, forwarded right at once
        c = s - (2 * p - 3 - i)  # finished block received from the right, forwarded left
        if from_left is not None and 0 <= b < k:
            if b + ahead < k:  # its slot's previous message was combined a step ago
                t = slots[(b + ahead) % m][: blocks[b + ahead].numel()]
                up.append((t, from_left(t)))
            got, work = up[b]
            work.wait()
            combine(op, blocks[b], got)
            if to_right is not None:
                by_right[b] = to_right(blocks[b])
            else:
                finish(op, blocks[b], p)
                others.append(to_left(blocks[b]))
        if from_right is not None and 0 <= c < k:
            while len(down) < min(c + 1 + depth, k):  # into blocks whose partial sum went right
                x = len(down)
                if by_right[x] is not None:
                    by_right[x].wait()
                    by_right[x] = None
                down.append(from_right(blocks[x]))
            down[c].wait()
            if to_left is not None:
                others.append(to_left(blocks[c]))
    for work in (*by_right, *others):
        if work is not None:
            work.wait()
    for poster in (*left, *right):
        poster.record()


def _down_depth(p: int, i: int) -> int:
    """Receives of finished blocks posted ahead at chain position ``i`` (from the first one's
    step on): such a receive reuses the block's buffer, so it may be posted only after the
    block's partial sum went right, which happens ``2(p - 1 - i) - 1`` steps ahead of the
    finished block's arrival (one step at ``i = p - 2``)."""
    return max(1, min(DEPTH, 2 * (p - 1 - i) - 1))


def _allreduce_encoded(
    flat: torch.Tensor, comm: Comm, op: str, block_elems: int, codec: Any
) -> None:
    """:func:`allreduce` with every block on the wire as ``codec.encode`` bytes."""
    p, n = comm.size, flat.numel()
    k = num_blocks(n, block_elems)
    i = comm.index
    eng = Engine(comm)
    blocks = [block(flat, j, block_elems) for j in range(k)]

    def wire(j: int) -> torch.Tensor:
        size = codec.payload_nbytes(blocks[j].numel())
        return torch.empty(size, dtype=torch.uint8, device=flat.device)

    def decoded(payload: torch.Tensor, j: int) -> torch.Tensor:
        return codec.decode(payload, blocks[j].numel(), flat.dtype)

    up = eng.queue(i - 1, k, wire) if i > 0 else None
    down = eng.queue(i + 1, k, wire) if i < p - 1 else None
    for s in range(k + 2 * p - 3):
        b, c = s - i + 1, s - (2 * p - 3 - i)
        if i == 0 and s < k:
            eng.send(codec.encode(blocks[s]), 1)
        if up is not None and 0 <= b < k:
            mine = blocks[b]
            combine(op, mine, decoded(up.wait(b), b))
            if i < p - 1:
                eng.send(codec.encode(mine), i + 1)
            else:
                finish(op, mine, p)
                encoded = codec.encode(mine)
                eng.send(encoded, i - 1)
                mine.copy_(decoded(encoded, b))
        if down is not None and 0 <= c < k:
            got = down.wait(c)
            blocks[c].copy_(decoded(got, c))
            if i > 0:
                eng.send(got, i - 1)
    eng.finish()
