"""Ring collectives: reduce-scatter and allgather around a ring (the bandwidth-optimal baseline).

Patarasuk and Yuan, "Bandwidth optimal all-reduce algorithms for clusters of workstations" (2009),
the ring baseline next to the LP paper (arXiv 1611.04255). Schedules exactly as in
``docs/algorithms.md`` ("Ring"), chunks split as evenly as possible:

* allreduce: ring reduce-scatter (``p - 1`` steps: send one chunk right, receive one from the
  left, combine) then ring allgather (``p - 1`` steps).
  ``T = 2(p-1)(alpha + n/p beta) + (p-1) n/p gamma``.
* broadcast: binomial scatter from the root, then ring allgather.
* reduce: ring reduce-scatter, then binomial gather to the root.

With a codec (Pipe-SGD's light compression, allreduce only) chunks travel encoded: each
reduce-scatter hop decodes, adds its own chunk and re-encodes; the owner of a finished chunk
encodes it once (and keeps ``decode(encode(chunk))`` itself) and the allgather forwards those
bytes unchanged, decoded once by each rank.

Without a codec and where :meth:`._group.Comm.direct` allows it, the allreduce posts straight to
the backend (:func:`_allreduce_direct`, the same schedule and bits). On the progress engine
(:mod:`._engine`): without a codec every chunk travels as segments of at
most :data:`SEGMENT_BYTES`, each forwarded the moment it has arrived and been combined. The
reduce-scatter's receives are posted ahead into scratch segments reused across calls (no fresh
scratch buffer per call; :meth:`._engine.Engine.scratch_queue`), the allgather's straight into
place, all at once. Elementwise combines in the same order: the same bits as whole chunks.
Encoded chunks stay whole (a codec's scale is per payload).
"""

from __future__ import annotations

from typing import Any

import torch

from pipecomm.collectives._chunks import even_offsets, span
from pipecomm.collectives._engine import Engine, scratch_slots
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish
from pipecomm.collectives._trees import binomial_gather, binomial_scatter

#: Largest piece of a chunk on the wire (uncompressed). On gloo over loopback a message's
#: bandwidth keeps rising with its size (E0's per-size table), so segments are large; cutting a
#: 32 MiB chunk into 4 MiB segments still paid off (their combines overlap the transfers), while
#: 1 MiB segments were slower than whole chunks.
SEGMENT_BYTES = 4 << 20
#: A chunk of at least twice this many bytes that would travel whole under
#: :data:`SEGMENT_BYTES` travels as two halves instead (the default segment size only): the
#: second half's transfer then overlaps the first half's combine, as gloo's own ring keeps one
#: segment in flight while it reduces another. Smaller halves cost more in messages than they
#: gain (measured on gloo over loopback, ARTIFACT.md).
MIN_SPLIT_BYTES = 2 << 20


def _chunk(flat: torch.Tensor, offsets: list[int], c: int) -> torch.Tensor:
    return span(flat, offsets, c, c + 1)


class _Segments:
    """Chunk ``c`` of ``flat`` as ``per_chunk`` segments of at most ``elems`` elements (views;
    trailing ones may be empty, the same on every rank). All views are cut at once (one
    ``split``): a schedule asks for a segment several times per message, and with 8 ranks on
    2 cores every Python-level slice of the per-message path is paid many times over."""

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


def reduce_scatter(
    flat: torch.Tensor,
    eng: Engine,
    offsets: list[int],
    v: int,
    shift: int,
    op: str,
    to_group: Any,
    segment_bytes: int | None = None,
) -> int:
    """Ring reduce-scatter over all ``p`` ranks in virtual order ``v`` (right = ``v + 1``).

    Step ``s`` sends chunk ``v + shift - s`` and receives chunk ``v + shift - s - 1`` (mod p);
    returns the chunk this rank then holds fully reduced, ``v + shift + 1`` (mod p).

    Example::

        owned = reduce_scatter(flat, eng, even_offsets(n, p), comm.index, 0, "sum", lambda u: u)
    """
    p = eng.comm.size
    seg = _Segments(flat, offsets, segment_bytes)
    right, left = to_group((v + 1) % p), to_group((v - 1) % p)
    _reduce_scatter(seg, eng, v + shift, op, right, left, p, None)
    return (v + shift + 1) % p


def _reduce_scatter(seg, eng, first, op, right, left, p, finish_p) -> None:
    """Send chunk ``first``, then per step and segment: receive, combine, forward; at the last
    step ``finish_p`` (allreduce) finishes the owned segment and sends it as the allgather's
    first message."""
    nq = seg.per_chunk
    for q in range(nq):
        eng.send(seg.of(first % p, q), right)
    stream = eng.scratch_queue(left, (p - 1) * nq, seg.elems, seg.flat,
                               lambda j: seg.of((first - j // nq - 1) % p, j % nq).numel())
    for j in range((p - 1) * nq):
        s, q = divmod(j, nq)
        acc = seg.of((first - s - 1) % p, q)
        combine(op, acc, stream.wait(j))
        if s < p - 2:
            eng.send(acc, right)
        elif finish_p is not None:
            finish(op, acc, finish_p)
            eng.send(acc, right)


def allgather(
    flat: torch.Tensor,
    eng: Engine,
    offsets: list[int],
    v: int,
    owned: int,
    to_group: Any,
    segment_bytes: int | None = None,
    sent: bool = False,
) -> None:
    """Ring allgather: rank ``v`` holds chunk ``owned``; step ``s`` forwards chunk ``owned - s``.

    ``sent``: the owned chunk already went right (the allreduce sends it as it finishes).

    Example::

        allgather(flat, eng, even_offsets(n, p), comm.index, owned, lambda u: u)
    """
    p = eng.comm.size
    seg = _Segments(flat, offsets, segment_bytes)
    _allgather(seg, eng, owned, to_group((v + 1) % p), to_group((v - 1) % p), p, sent)


def _allgather(seg, eng, owned, right, left, p, sent) -> None:
    nq = seg.per_chunk
    if not sent:
        for q in range(nq):
            eng.send(seg.of(owned, q), right)
    count = (p - 1) * nq  # into their final place: all posted at once
    stream = eng.queue(left, count, lambda j: seg.of((owned - j // nq - 1) % p, j % nq), count)
    for j in range(count):
        got = stream.wait(j)
        if j // nq < p - 2:
            eng.send(got, right)


def allreduce(
    flat: torch.Tensor,
    comm: Comm,
    op: str,
    *,
    codec: Any = None,
    segment_bytes: int | None = None,
) -> None:
    """Ring allreduce in group order (optionally with encoded chunks).

    Example::

        allreduce(flat, comm, op="sum")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    offsets = even_offsets(n, p)
    if codec is not None:
        eng = Engine(comm)
        _allreduce_encoded(flat, eng, offsets, op, codec)
        eng.finish()
        return
    g = comm.index
    seg = _Segments(flat, offsets, segment_bytes)
    right, left = (g + 1) % p, (g - 1) % p
    send, recv = comm.direct(right, True, flat), comm.direct(left, False, flat)
    if send is not None and recv is not None:
        _allreduce_direct(seg, send, recv, g, op, p)
        return
    eng = Engine(comm)
    _reduce_scatter(seg, eng, g, op, right, left, p, p)
    _allgather(seg, eng, (g + 1) % p, right, left, p, sent=True)
    eng.finish()


def _allreduce_direct(seg: _Segments, send: Any, recv: Any, g: int, op: str, p: int) -> None:
    """The ring allreduce's schedule (the same messages, combines and bits as
    :func:`_reduce_scatter` then :func:`_allgather` on the engine) posted straight to the backend
    (:class:`pipecomm.collectives.p2p.Direct`): every message of the ring goes to the right
    neighbour or comes from the left one, so which send a buffer waits for is known from the
    schedule and the engine's bookkeeping is not needed. Receives of partial results land in
    scratch slots (:func:`._engine.scratch_slots`); before the allgather overwrites the chunks
    sent in the reduce-scatter, those sends are waited (all but the last chunk's, which stays in
    place)."""
    nq = seg.per_chunk
    count = (p - 1) * nq
    slots, ahead = scratch_slots(count, seg.elems, seg.flat)
    m = len(slots)
    sends = [send(t) for q in range(nq) if (t := seg.of(g, q)).numel()]
    pending: list[Any] = []

    def post(j: int) -> None:
        t = slots[j % m][: seg.of((g - j // nq - 1) % p, j % nq).numel()]
        pending.append((t, recv(t) if t.numel() else None))

    for j in range(ahead):
        post(j)
    for j in range(count):  # reduce-scatter: receive, combine, forward
        if j + ahead < count:
            post(j + ahead)
        got, work = pending[j]
        if work is not None:
            work.wait()
        acc = seg.of((g - j // nq - 1) % p, j % nq)
        combine(op, acc, got)
        if j // nq == p - 2:
            finish(op, acc, p)
        if acc.numel():
            sends.append(send(acc))
    last = sum(1 for q in range(nq) if seg.of((g + 1) % p, q).numel())  # the owned chunk's
    for work in sends[: len(sends) - last]:
        work.wait()
    sends = sends[len(sends) - last:]
    into = [seg.of((g - j // nq) % p, j % nq) for j in range(count)]  # chunks g, g - 1, ...
    works = [recv(t) if t.numel() else None for t in into]
    for j in range(count):  # allgather: forward as it arrives
        if works[j] is not None:
            works[j].wait()
        if j // nq < p - 2 and into[j].numel():
            sends.append(send(into[j]))
    for work in sends:
        work.wait()
    send.record()
    recv.record()


def _allreduce_encoded(
    flat: torch.Tensor, eng: Engine, offsets: list[int], op: str, codec: Any
) -> None:
    p, g = eng.comm.size, eng.comm.index
    right, left = (g + 1) % p, (g - 1) % p

    def chunk_of(j: int) -> int:  # message j from the left: reduce-scatter, then allgather
        return (g - j - 1) % p if j < p - 1 else (g - (j - p + 1)) % p

    def wire(j: int) -> torch.Tensor:
        size = codec.payload_nbytes(_chunk(flat, offsets, chunk_of(j)).numel())
        return torch.empty(size, dtype=torch.uint8, device=flat.device)

    def decoded(payload: torch.Tensor, c: int) -> torch.Tensor:
        return codec.decode(payload, _chunk(flat, offsets, c).numel(), flat.dtype)

    stream = eng.queue(left, 2 * (p - 1), wire)
    eng.send(codec.encode(_chunk(flat, offsets, g)), right)
    for s in range(p - 1):
        c = chunk_of(s)
        acc = _chunk(flat, offsets, c)
        combine(op, acc, decoded(stream.wait(s), c))
        if s == p - 2:
            finish(op, acc, p)
        pending = codec.encode(acc)
        eng.send(pending, right)
        if s == p - 2:
            acc.copy_(decoded(pending, c))
    # allgather of the encoded finished chunks; rank g owns chunk g + 1
    for s in range(p - 1):
        c = chunk_of(p - 1 + s)
        incoming = stream.wait(p - 1 + s)
        _chunk(flat, offsets, c).copy_(decoded(incoming, c))
        if s < p - 2:
            eng.send(incoming, right)


def broadcast(flat: torch.Tensor, comm: Comm, root: int) -> None:
    """Binomial scatter from group index ``root``, then ring allgather.

    Example::

        broadcast(flat, comm, root=0)
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    v = (comm.index - root) % p

    def to_group(u: int) -> int:
        return (root + u) % p

    offsets = even_offsets(n, p)
    eng = Engine(comm)
    binomial_scatter(flat, eng, offsets, v, p, to_group)
    allgather(flat, eng, offsets, v, v, to_group)
    eng.finish()


def reduce(flat: torch.Tensor, comm: Comm, root: int, op: str) -> None:
    """Ring reduce-scatter, then binomial gather to group index ``root``.

    Example::

        reduce(flat, comm, root=2, op="sum")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    v = (comm.index - root) % p

    def to_group(u: int) -> int:
        return (root + u) % p

    offsets = even_offsets(n, p)
    eng = Engine(comm)
    reduce_scatter(flat, eng, offsets, v, -1, op, to_group)
    binomial_gather(flat, eng, offsets, v, p, to_group)
    eng.finish()
    if v == 0:
        finish(op, flat, p)
