"""Ring collectives: reduce-scatter and allgather around a ring (the bandwidth-optimal baseline).

Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations" (2009),
the ring baseline next to the LP paper (arXiv 1611.04255). Schedules exactly as in
``docs/algorithms.md`` ("Ring"), chunks split as evenly as possible:

* allreduce: ring reduce-scatter (``p - 1`` steps: send one chunk right, receive one from the
  left, combine) then ring allgather (``p - 1`` steps).
  ``T = 2(p-1)(alpha + n/p beta) + (p-1) n/p gamma``.
* broadcast: binomial scatter from the root, then ring allgather.
* reduce: ring reduce-scatter, then binomial gather to the root.

With a codec (allreduce only) chunks travel whole and encoded. The reduce-scatter and the
allgather are written once (:func:`reduce_scatter`, :func:`allgather`) over a ring of messages
posted straight to the backend (:class:`_DirectRing`) or on the progress engine
(:class:`_EngineRing`); without a codec chunks travel as segments of at most
:data:`SEGMENT_BYTES` (docs/algorithms.md, "Ring").
"""

from __future__ import annotations

from typing import Any

import torch

from pipecomm.collectives._chunks import even_offsets
from pipecomm.collectives._engine import Engine, scratch_slots
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import Wire, combine, finish
from pipecomm.collectives._trees import binomial_gather, binomial_scatter, rooted

#: Largest piece of a chunk on the wire (uncompressed; docs/algorithms.md, "Ring").
SEGMENT_BYTES = 4 << 20
#: A chunk of at least twice this many bytes that would travel whole under
#: :data:`SEGMENT_BYTES` travels as two halves instead (the default segment size only).
MIN_SPLIT_BYTES = 2 << 20


class _Segments:
    """Chunk ``c`` of ``flat`` as ``per_chunk`` segments of at most ``elems`` elements (views;
    trailing ones may be empty, the same on every rank), all cut at once (one ``split``)."""

    def __init__(self, flat: torch.Tensor, offsets: list[int], segment_bytes: int | None) -> None:
        default = segment_bytes is None
        if default:
            segment_bytes = SEGMENT_BYTES
        self.flat = flat
        biggest = max(b - a for a, b in zip(offsets, offsets[1:]))
        self.elems = max(1, min(biggest, segment_bytes // flat.element_size()))
        if default and self.elems >= biggest >= 2 * MIN_SPLIT_BYTES // flat.element_size():
            self.elems = -(-biggest // 2)  # two halves (MIN_SPLIT_BYTES)
        self.per_chunk = max(1, -(-biggest // self.elems))
        sizes = [max(0, min(self.elems, hi - lo - q * self.elems))
                 for lo, hi in zip(offsets, offsets[1:]) for q in range(self.per_chunk)]
        pieces = flat.split([offsets[0], *sizes, flat.numel() - offsets[-1]])
        self._views = pieces[1:-1]

    def of(self, c: int, q: int) -> torch.Tensor:
        return self._views[c * self.per_chunk + q]


def reduce_scatter(seg: _Segments, ring: Any, first: int, op: str, p: int, wire: Wire,
                    finish_p: int | None = None) -> None:
    """Ring reduce-scatter over ``ring`` (one of :class:`_EngineRing`, :class:`_DirectRing`):
    send chunk ``first``; step ``s`` receives chunk ``first - s - 1`` (mod p) segment by
    segment, combines and forwards it. At the last step ``finish_p`` (allreduce) finishes the
    chunk then held complete, ``first + 1``, and sends it as the allgather's first message.

    Example::

        reduce_scatter(seg, _EngineRing(eng, right, left, Wire(None)), v - 1, "sum", p, wire)
    """
    nq = seg.per_chunk
    for q in range(nq):
        ring.send(wire.encode(seg.of(first % p, q)))

    def piece(j: int) -> torch.Tensor:
        return seg.of((first - j // nq - 1) % p, j % nq)

    ring.partials((p - 1) * nq, piece, seg.elems, seg.flat)
    for j in range((p - 1) * nq):
        acc = piece(j)
        combine(op, acc, wire.decode(ring.partial(j), acc))
        if j // nq < p - 2:
            ring.send(wire.encode(acc))
        elif finish_p is not None:
            finish(op, acc, finish_p)
            sent = wire.encode(acc)
            ring.send(sent)
            wire.keep(acc, sent)


def allgather(seg: _Segments, ring: Any, owned: int, p: int, wire: Wire, sent: bool) -> None:
    """Ring allgather: this rank holds chunk ``owned``; step ``s`` forwards chunk ``owned - s``.
    ``sent``: the owned chunk already went right (the allreduce sends it as it finishes).

    Example::

        allgather(seg, ring, owned, p, Wire(None), sent=False)
    """
    nq = seg.per_chunk
    if not sent:
        for q in range(nq):
            ring.send(wire.encode(seg.of(owned, q)))

    def into(j: int) -> torch.Tensor:
        return seg.of((owned - j // nq - 1) % p, j % nq)

    count = (p - 1) * nq
    ring.gathers(count, into, [seg.of(owned, q) for q in range(nq)])
    for j in range(count):
        got = ring.gathered(j)
        wire.land(into(j), got)
        if j // nq < p - 2:
            ring.send(got)


class _EngineRing:
    """A ring schedule's messages on the progress engine: partial results into scratch segments
    (or wire buffers), the allgather's straight into place, all posted at once (or wire buffers,
    two ahead)."""

    def __init__(self, eng: Engine, right: int, left: int, wire: Wire) -> None:
        self.eng, self.right, self.left, self.wire = eng, right, left, wire
        self.stream: Any = None

    def send(self, t: torch.Tensor) -> None:
        self.eng.send(t, self.right)

    def _coded(self, piece: Any) -> Any:
        return lambda j: self.wire.buffer(piece(j).numel(), piece(j))

    def partials(self, count: int, piece: Any, elems: int, like: torch.Tensor) -> None:
        if self.wire.codec is None:
            self.stream = self.eng.scratch_queue(self.left, count, elems, like,
                                                 lambda j: piece(j).numel())
        else:
            self.stream = self.eng.queue(self.left, count, self._coded(piece))

    def partial(self, j: int) -> torch.Tensor:
        return self.stream.wait(j)

    def gathers(self, count: int, into: Any, owned: list[torch.Tensor]) -> None:
        if self.wire.codec is None:
            self.stream = self.eng.queue(self.left, count, into, count)
        else:
            self.stream = self.eng.queue(self.left, count, self._coded(into))

    def gathered(self, j: int) -> torch.Tensor:
        return self.stream.wait(j)

    def finish(self) -> None:
        self.eng.finish()


class _DirectRing:
    """A ring allreduce's messages posted straight to the backend
    (:class:`pipecomm.collectives.p2p.Direct`). Partial results land in scratch slots
    (:func:`._engine.scratch_slots`); before the allgather overwrites the chunks sent in the
    reduce-scatter, those sends are waited (all but the owned chunk's, which stays in place)."""

    def __init__(self, send: Any, recv: Any) -> None:
        self.to_right, self.from_left = send, recv
        self.sends: list[Any] = []
        self.pending: list[tuple[torch.Tensor, Any]] = []

    def send(self, t: torch.Tensor) -> None:
        if t.numel():
            self.sends.append(self.to_right(t))

    def _post(self, t: torch.Tensor) -> None:
        self.pending.append((t, self.from_left(t) if t.numel() else None))

    def partials(self, count: int, piece: Any, elems: int, like: torch.Tensor) -> None:
        self.slots, self.ahead = scratch_slots(count, elems, like)
        self.piece, self.count = piece, count
        for j in range(self.ahead):
            self._post(self.slots[j % len(self.slots)][: piece(j).numel()])

    def partial(self, j: int) -> torch.Tensor:
        if j + self.ahead < self.count:  # its slot's previous message was combined
            nxt = j + self.ahead
            self._post(self.slots[nxt % len(self.slots)][: self.piece(nxt).numel()])
        got, work = self.pending[j]
        if work is not None:
            work.wait()
        return got

    def gathers(self, count: int, into: Any, owned: list[torch.Tensor]) -> None:
        last = sum(1 for t in owned if t.numel())  # the owned chunk's sends, the latest
        for work in self.sends[: len(self.sends) - last]:
            work.wait()
        self.sends = self.sends[len(self.sends) - last:]
        self.pending = []
        for j in range(count):
            self._post(into(j))

    def gathered(self, j: int) -> torch.Tensor:
        got, work = self.pending[j]
        if work is not None:
            work.wait()
        return got

    def finish(self) -> None:
        for work in self.sends:
            work.wait()
        self.to_right.record()
        self.from_left.record()


def allreduce(flat: torch.Tensor, comm: Comm, op: str, *, codec: Any = None,
              segment_bytes: int | None = None) -> None:
    """Ring allreduce in group order: reduce-scatter then allgather, on whichever ring
    (:class:`_EngineRing`, :class:`_DirectRing`) the module docstring describes.

    Example::

        allreduce(flat, comm, op="sum")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    g = comm.index
    right, left = (g + 1) % p, (g - 1) % p
    whole = flat.numel() * flat.element_size()  # encoded chunks: one segment each
    seg = _Segments(flat, even_offsets(n, p), segment_bytes if codec is None else whole)
    wire = Wire(codec)
    ring: Any = None
    if codec is None:
        send, recv = comm.direct(right, True, flat), comm.direct(left, False, flat)
        if send is not None and recv is not None:
            ring = _DirectRing(send, recv)
    ring = ring or _EngineRing(Engine(comm), right, left, wire)
    reduce_scatter(seg, ring, g, op, p, wire, p)
    allgather(seg, ring, (g + 1) % p, p, wire, sent=True)
    ring.finish()


def broadcast(flat: torch.Tensor, comm: Comm, root: int) -> None:
    """Binomial scatter from group index ``root``, then ring allgather.

    Example::

        broadcast(flat, comm, root=0)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    v, to_group = rooted(comm.index, root, p)
    offsets = even_offsets(n, p)
    eng = Engine(comm)
    binomial_scatter(flat, eng, offsets, v, p, to_group)
    ring = _EngineRing(eng, to_group((v + 1) % p), to_group((v - 1) % p), Wire(None))
    allgather(_Segments(flat, offsets, None), ring, v, p, Wire(None), sent=False)
    eng.finish()


def reduce(flat: torch.Tensor, comm: Comm, root: int, op: str) -> None:
    """Ring reduce-scatter, then binomial gather to group index ``root``.

    Example::

        reduce(flat, comm, root=2, op="sum")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    v, to_group = rooted(comm.index, root, p)
    offsets = even_offsets(n, p)
    eng = Engine(comm)
    ring = _EngineRing(eng, to_group((v + 1) % p), to_group((v - 1) % p), Wire(None))
    reduce_scatter(_Segments(flat, offsets, None), ring, v - 1, op, p, Wire(None))
    binomial_gather(flat, eng, offsets, v, p, to_group)
    eng.finish()
    if v == 0:
        finish(op, flat, p)
