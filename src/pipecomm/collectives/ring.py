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
"""

from __future__ import annotations

from typing import Any

import torch

from pipecomm.collectives._chunks import even_offsets, span
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish
from pipecomm.collectives._trees import binomial_gather, binomial_scatter


def _chunk(flat: torch.Tensor, offsets: list[int], c: int) -> torch.Tensor:
    return span(flat, offsets, c, c + 1)


def reduce_scatter(
    flat: torch.Tensor,
    comm: Comm,
    offsets: list[int],
    v: int,
    shift: int,
    op: str,
    to_group: Any,
) -> int:
    """Ring reduce-scatter over all ``p`` ranks in virtual order ``v`` (right = ``v + 1``).

    Step ``s`` sends chunk ``v + shift - s`` and receives chunk ``v + shift - s - 1`` (mod p);
    returns the chunk this rank then holds fully reduced, ``v + shift + 1`` (mod p).

    Example::

        owned = reduce_scatter(flat, comm, even_offsets(n, p), comm.index, 0, "sum", lambda u: u)
    """
    p = comm.size
    scratch = torch.empty(offsets[1] - offsets[0], dtype=flat.dtype, device=flat.device)
    right, left = to_group((v + 1) % p), to_group((v - 1) % p)
    for s in range(p - 1):
        out = _chunk(flat, offsets, (v + shift - s) % p)
        acc = _chunk(flat, offsets, (v + shift - s - 1) % p)
        incoming = scratch[: acc.numel()]
        comm.exchange([(out, right)], [(incoming, left)])
        combine(op, acc, incoming)
    return (v + shift + 1) % p


def allgather(
    flat: torch.Tensor, comm: Comm, offsets: list[int], v: int, owned: int, to_group: Any
) -> None:
    """Ring allgather: rank ``v`` holds chunk ``owned``; step ``s`` forwards chunk ``owned - s``.

    Example::

        allgather(flat, comm, even_offsets(n, p), comm.index, owned, lambda u: u)
    """
    p = comm.size
    right, left = to_group((v + 1) % p), to_group((v - 1) % p)
    for s in range(p - 1):
        comm.exchange(
            [(_chunk(flat, offsets, (owned - s) % p), right)],
            [(_chunk(flat, offsets, (owned - s - 1) % p), left)],
        )


def _identity(u: int) -> int:
    return u


def allreduce(flat: torch.Tensor, comm: Comm, op: str, *, codec: Any = None) -> None:
    """Ring allreduce in group order (optionally with encoded chunks).

    Example::

        allreduce(flat, comm, op="sum")
    """
    p, n = comm.size, flat.numel()
    if p == 1 or n == 0:
        return
    offsets = even_offsets(n, p)
    if codec is not None:
        _allreduce_encoded(flat, comm, offsets, op, codec)
        return
    owned = reduce_scatter(flat, comm, offsets, comm.index, 0, op, _identity)
    finish(op, _chunk(flat, offsets, owned), p)
    allgather(flat, comm, offsets, comm.index, owned, _identity)


def _allreduce_encoded(
    flat: torch.Tensor, comm: Comm, offsets: list[int], op: str, codec: Any
) -> None:
    p, g = comm.size, comm.index
    right, left = (g + 1) % p, (g - 1) % p

    def wire(c: int) -> torch.Tensor:
        size = codec.payload_nbytes(_chunk(flat, offsets, c).numel())
        return torch.empty(size, dtype=torch.uint8, device=flat.device)

    def decoded(payload: torch.Tensor, c: int) -> torch.Tensor:
        return codec.decode(payload, _chunk(flat, offsets, c).numel(), flat.dtype)

    pending = codec.encode(_chunk(flat, offsets, g))
    for s in range(p - 1):
        c = (g - s - 1) % p
        incoming = wire(c)
        comm.exchange([(pending, right)], [(incoming, left)])
        acc = _chunk(flat, offsets, c)
        combine(op, acc, decoded(incoming, c))
        if s == p - 2:
            finish(op, acc, p)
        pending = codec.encode(acc)
        if s == p - 2:
            acc.copy_(decoded(pending, c))
    # allgather of the encoded finished chunks; rank g owns chunk g + 1
    for s in range(p - 1):
        c = (g - s) % p
        incoming = wire(c)
        comm.exchange([(pending, right)], [(incoming, left)])
        _chunk(flat, offsets, c).copy_(decoded(incoming, c))
        pending = incoming


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
    binomial_scatter(flat, comm, offsets, v, p, to_group)
    allgather(flat, comm, offsets, v, v, to_group)


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
    reduce_scatter(flat, comm, offsets, v, -1, op, to_group)
    binomial_gather(flat, comm, offsets, v, p, to_group)
    if v == 0:
        finish(op, flat, p)
