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
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from pipecomm.collectives._chunks import block, num_blocks
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish


def default_block_bytes(kind: str, nbytes: int, p: int, compression_ratio: float = 1.0) -> int:
    """The LP block size the cost model predicts to be fastest for this collective.

    ``pipecomm.cost.lp_optimal_block_bytes(kind, nbytes, p, link)`` with the link of the active
    emulated network (``pipecomm.netem.current()``, its intra-node level) or else
    ``cost.calibrated_link()``; ``compression_ratio`` (uncompressed / wire bytes) when blocks
    travel encoded. Every rank must get the same answer (same inputs, deterministic model), or
    the ranks would cut the message differently.

    Example::

        default_block_bytes("allreduce", 1 << 24, 8)   # 493448 with the fallback link
    """
    from pipecomm import cost, netem

    current = getattr(netem, "current", None)
    network = current() if current is not None else None
    link = cost.link_from_network(network) if network is not None else cost.calibrated_link()
    return _optimal_block_bytes(kind, nbytes, p, link, float(compression_ratio))


@functools.lru_cache(maxsize=4096)
def _optimal_block_bytes(kind: str, nbytes: int, p: int, link: Any, ratio: float) -> int:
    """Cached: the exact search over block sizes takes milliseconds, and training calls repeat."""
    from pipecomm import cost

    kwargs = {"compression_ratio": ratio} if ratio != 1.0 else {}
    return max(1, int(cost.lp_optimal_block_bytes(kind, nbytes, p, link, **kwargs)))


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
    for s in range(k + p - 2):
        sends, recvs = [], []
        if i < p - 1 and 0 <= s - i < k:
            sends.append((block(flat, s - i, block_elems), nxt))
        if i > 0 and 0 <= s - i + 1 < k:
            recvs.append((block(flat, s - i + 1, block_elems), prev))
        comm.exchange(sends, recvs)


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
    scratch = torch.empty(min(block_elems, n), dtype=flat.dtype, device=flat.device)
    for s in range(k + p - 2):
        sends, recvs = [], []
        if i < p - 1 and 0 <= s - i < k:
            sends.append((block(flat, s - i, block_elems), nxt))
        got = None
        if i > 0 and 0 <= s - i + 1 < k:
            got = block(flat, s - i + 1, block_elems)
            recvs.append((scratch[: got.numel()], prev))
        comm.exchange(sends, recvs)
        if got is not None:
            combine(op, got, scratch[: got.numel()])
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
    scratch = torch.empty(min(block_elems, n), dtype=flat.dtype, device=flat.device)
    for s in range(k + 2 * p - 3):
        a = s - i  # partial block sent right
        b = s - i + 1  # partial block received from the left
        c = s - (2 * p - 3 - i)  # finished block received from the right
        d = s - (2 * p - 2 - i)  # finished block sent left
        sends, recvs = [], []
        if i < p - 1 and 0 <= a < k:
            sends.append((block(flat, a, block_elems), i + 1))
        if i > 0 and 0 <= d < k:
            sends.append((block(flat, d, block_elems), i - 1))
        got = None
        if i > 0 and 0 <= b < k:
            got = block(flat, b, block_elems)
            recvs.append((scratch[: got.numel()], i - 1))
        if i < p - 1 and 0 <= c < k:
            recvs.append((block(flat, c, block_elems), i + 1))
        comm.exchange(sends, recvs)
        if got is not None:
            combine(op, got, scratch[: got.numel()])
            if i == p - 1:
                finish(op, got, p)


def _allreduce_encoded(
    flat: torch.Tensor, comm: Comm, op: str, block_elems: int, codec: Any
) -> None:
    """:func:`allreduce` with every block on the wire as ``codec.encode`` bytes."""
    p, n = comm.size, flat.numel()
    k = num_blocks(n, block_elems)
    i = comm.index

    def wire(j: int) -> torch.Tensor:
        size = codec.payload_nbytes(block(flat, j, block_elems).numel())
        return torch.empty(size, dtype=torch.uint8, device=flat.device)

    def decoded(payload: torch.Tensor, j: int) -> torch.Tensor:
        return codec.decode(payload, block(flat, j, block_elems).numel(), flat.dtype)

    pending_right = None  # encoded partial sum to forward right in the next step
    pending_left = None  # encoded finished block to forward left in the next step
    for s in range(k + 2 * p - 3):
        a, b = s - i, s - i + 1
        c, d = s - (2 * p - 3 - i), s - (2 * p - 2 - i)
        sends, recvs = [], []
        if i < p - 1 and 0 <= a < k:
            if i == 0:
                pending_right = codec.encode(block(flat, a, block_elems))
            sends.append((pending_right, i + 1))
        if i > 0 and 0 <= d < k:
            sends.append((pending_left, i - 1))
        got_b = got_c = None
        if i > 0 and 0 <= b < k:
            got_b = wire(b)
            recvs.append((got_b, i - 1))
        if i < p - 1 and 0 <= c < k:
            got_c = wire(c)
            recvs.append((got_c, i + 1))
        comm.exchange(sends, recvs)
        if got_b is not None:
            mine = block(flat, b, block_elems)
            combine(op, mine, decoded(got_b, b))
            if i < p - 1:
                pending_right = codec.encode(mine)
            else:
                finish(op, mine, p)
                pending_left = codec.encode(mine)
                mine.copy_(decoded(pending_left, b))
        if got_c is not None:
            block(flat, c, block_elems).copy_(decoded(got_c, c))
            pending_left = got_c
