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

With a codec (allreduce only) a block travels encoded, re-encoded at each hop. The steps run on
the progress engine (:mod:`._engine`), or straight to the backend where
:meth:`._group.Comm.direct` allows it (docs/algorithms.md, "Conventions" and "LP").
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pipecomm import checks
from pipecomm.collectives._chunks import block, num_blocks
from pipecomm.collectives._engine import DEPTH, Engine, scratch_slots
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import Wire, combine, finish

#: The link LP plans its default blocks on until :func:`set_link` is called: ``(alpha_s,
#: bandwidth_Bps)`` (docs/algorithms.md, "Block size of LP").
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
    bandwidth = checks.positive_number(bandwidth_Bps, "bandwidth_Bps", "lp.set_link", "bytes/s")
    alpha = 0.0 if alpha_s == 0 else checks.positive_number(alpha_s, "alpha_s", "lp.set_link",
                                                            "seconds")
    global _LINK
    _LINK = (alpha, bandwidth)


def link() -> tuple[float, float]:
    """The ``(alpha_s, bandwidth_Bps)`` LP's default blocks are planned on (:func:`set_link`)."""
    return _LINK


def default_block_bytes(kind: str, nbytes: int, p: int, compression_ratio: float = 1.0) -> int:
    """LP's block size (bytes) for ``kind`` of ``nbytes`` over ``p`` ranks: the alpha-beta
    optimum on :func:`link`, in closed form.

    ``b* = sqrt(n alpha r / (m beta))`` (``m = p - 2`` for broadcast and reduce, ``2p - 3`` for
    allreduce; ``r = compression_ratio``), rounded up to a multiple of 8 within
    ``[MIN_BLOCK_BYTES, nbytes]``; derivation: docs/algorithms.md, "Block size of LP".

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
    rank no sends); the sends are waited at the end."""
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


def allreduce(flat: torch.Tensor, comm: Comm, op: str, *, block_elems: int,
              codec: Any = None) -> None:
    """Bidirectional pipelined chain allreduce in group order (``k + 2p - 3`` steps), blocks on
    the wire as themselves or as ``codec.encode`` bytes (:class:`._reduce.Wire`).

    The one schedule of every path: its messages go through the progress engine
    (:class:`_EngineChain`) or, without a codec where :meth:`Comm.direct` allows, straight to
    the backend (:class:`_DirectChain`); the same messages, combines and bits either way.

    Example::

        allreduce(flat, comm, op="avg", block_elems=1024)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    k, i = num_blocks(n, block_elems), comm.index
    blocks = [block(flat, j, block_elems) for j in range(k)]
    wire = Wire(codec)
    chain = (_DirectChain.of(comm, blocks, flat, min(block_elems, n)) if codec is None else None
             ) or _EngineChain(comm, blocks, flat, min(block_elems, n), wire)
    if i == 0:
        for j in range(k):
            chain.right(j, wire.encode(blocks[j]))
    for s in range(k + 2 * p - 3):
        b = s - i + 1  # partial block received from the left, forwarded right at once
        c = s - (2 * p - 3 - i)  # finished block received from the right, forwarded left
        if i > 0 and 0 <= b < k:
            mine = blocks[b]
            combine(op, mine, wire.decode(chain.from_left(b), mine))
            if i < p - 1:
                chain.right(b, wire.encode(mine))
            else:
                finish(op, mine, p)
                sent = wire.encode(mine)
                chain.left(sent)
                wire.keep(mine, sent)
        if i < p - 1 and 0 <= c < k:
            got = chain.from_right(c)
            wire.land(blocks[c], got)
            if i > 0:
                chain.left(got)
    chain.finish()


class _EngineChain:
    """:func:`allreduce`'s messages on the progress engine: partial sums from the left into
    scratch slots (or wire buffers), finished blocks from the right into place once the block's
    partial sum went right (the engine waits for that send) or into wire buffers."""

    def __init__(self, comm: Comm, blocks: list[torch.Tensor], flat: torch.Tensor, elems: int,
                 wire: Wire) -> None:
        p, i, k = comm.size, comm.index, len(blocks)
        self.eng, self.i = Engine(comm), i
        self.up = self.down = None

        def coded(j: int) -> torch.Tensor:
            return wire.buffer(blocks[j].numel(), flat)

        if i > 0 and wire.codec is None:
            self.up = self.eng.scratch_queue(i - 1, k, elems, flat, lambda j: blocks[j].numel())
        elif i > 0:
            self.up = self.eng.queue(i - 1, k, coded)
        if i < p - 1 and wire.codec is None:
            self.down = self.eng.queue(i + 1, k, blocks.__getitem__, _down_depth(p, i), lazy=True)
        elif i < p - 1:
            self.down = self.eng.queue(i + 1, k, coded)

    def right(self, j: int, t: torch.Tensor) -> None:
        self.eng.send(t, self.i + 1)

    def left(self, t: torch.Tensor) -> None:
        self.eng.send(t, self.i - 1)

    def from_left(self, j: int) -> torch.Tensor:
        return self.up.wait(j)

    def from_right(self, j: int) -> torch.Tensor:
        return self.down.wait(j)

    def finish(self) -> None:
        self.eng.finish()


class _DirectChain:
    """:func:`allreduce`'s messages posted straight to the backend
    (:class:`pipecomm.collectives.p2p.Direct`). Which send a buffer waits for is known from the
    schedule: a finished block's receive goes into the block whose partial sum went right, so
    that send is waited just before the receive is posted (``_down_depth`` of them ahead, from
    the first finished block's step on); partial sums from the left land in scratch slots
    (:func:`._engine.scratch_slots`), posted ahead."""

    @classmethod
    def of(cls, comm: Comm, blocks: list[torch.Tensor], flat: torch.Tensor,
           elems: int) -> _DirectChain | None:
        """The chain's direct posters, or ``None`` where a neighbour's cannot post directly."""
        i, p = comm.index, comm.size
        left = (comm.direct(i - 1, True, flat), comm.direct(i - 1, False, flat)) if i > 0 else ()
        right = ((comm.direct(i + 1, True, flat), comm.direct(i + 1, False, flat))
                 if i < p - 1 else ())
        if None in (*left, *right):
            return None
        return cls(blocks, flat, elems, left, right, _down_depth(p, i))

    def __init__(self, blocks, flat, elems, left, right, depth) -> None:
        k = len(blocks)
        self.blocks, self.depth, self.posters = blocks, depth, (*left, *right)
        self.to_left, self.from_left_ = left if left else (None, None)
        self.to_right, self.from_right_ = right if right else (None, None)
        self.by_right: list[Any] = [None] * k  # sends to the right, until their buffer is reused
        self.others: list[Any] = []  # sends to the left: never written again
        self.up: list[tuple[torch.Tensor, Any]] = []
        self.down: list[Any] = []
        self.ahead = 0
        if self.from_left_ is not None:
            self.slots, self.ahead = scratch_slots(k, elems, flat)
            for j in range(self.ahead):
                self._post_up(j)

    def _post_up(self, j: int) -> None:
        t = self.slots[j % len(self.slots)][: self.blocks[j].numel()]
        self.up.append((t, self.from_left_(t)))

    def right(self, j: int, t: torch.Tensor) -> None:
        self.by_right[j] = self.to_right(t)

    def left(self, t: torch.Tensor) -> None:
        self.others.append(self.to_left(t))

    def from_left(self, j: int) -> torch.Tensor:
        if j + self.ahead < len(self.blocks):  # its slot's previous message was combined
            self._post_up(j + self.ahead)
        got, work = self.up[j]
        work.wait()
        return got

    def from_right(self, j: int) -> torch.Tensor:
        while len(self.down) < min(j + 1 + self.depth, len(self.blocks)):
            x = len(self.down)  # into a block whose partial sum went right: that send first
            if self.by_right[x] is not None:
                self.by_right[x].wait()
                self.by_right[x] = None
            self.down.append(self.from_right_(self.blocks[x]))
        self.down[j].wait()
        return self.blocks[j]

    def finish(self) -> None:
        for work in (*self.by_right, *self.others):
            if work is not None:
                work.wait()
        for poster in self.posters:
            poster.record()


def _down_depth(p: int, i: int) -> int:
    """Receives of finished blocks posted ahead at chain position ``i`` (from the first one's
    step on): such a receive reuses the block's buffer, so it may be posted only after the
    block's partial sum went right, which happens ``2(p - 1 - i) - 1`` steps ahead of the
    finished block's arrival (one step at ``i = p - 2``)."""
    return max(1, min(DEPTH, 2 * (p - 1 - i) - 1))
