"""Minimum-spanning-tree (binomial tree) collectives: the baseline of the LP paper.

Wang et al., arXiv 1611.04255, Sec. 2 (MST collectives as in MPICH); schedules exactly as in
``docs/algorithms.md`` ("MST"). With relative rank ``r = (rank - root) mod p`` and
``L = ceil(log2 p)`` rounds, the whole message moves in every round:

* broadcast: round ``j`` — each ``r < 2^j`` sends to ``r + 2^j``. ``T = L (alpha + n beta)``.
* reduce: the mirror image (rounds ``L-1 .. 0``, the receiver combines).
  ``T = L (alpha + n beta + n gamma)``.
* allreduce: reduce to group rank 0, then broadcast from group rank 0.
"""

from __future__ import annotations

import torch

from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish


def broadcast(flat: torch.Tensor, comm: Comm, root: int) -> None:
    """Binomial-tree broadcast of the whole message from group index ``root``.

    Example::

        broadcast(flat, comm, root=0)
    """
    p = comm.size
    if p == 1 or flat.numel() == 0:
        return
    r = (comm.index - root) % p
    for j in range((p - 1).bit_length()):
        d = 1 << j
        if r < d and r + d < p:
            comm.exchange([(flat, (root + r + d) % p)], [])
        elif d <= r < 2 * d:
            comm.exchange([], [(flat, (root + r - d) % p)])


def reduce(flat: torch.Tensor, comm: Comm, root: int, op: str) -> None:
    """Binomial-tree reduce to group index ``root``; other ranks' buffers are overwritten.

    Example::

        reduce(flat, comm, root=0, op="sum")
    """
    p = comm.size
    if p == 1 or flat.numel() == 0:
        return
    r = (comm.index - root) % p
    scratch = None
    for j in reversed(range((p - 1).bit_length())):
        d = 1 << j
        if d <= r < 2 * d:
            comm.exchange([(flat, (root + r - d) % p)], [])
            return
        if r < d and r + d < p:
            if scratch is None:
                scratch = torch.empty_like(flat)
            comm.exchange([], [(scratch, (root + r + d) % p)])
            combine(op, flat, scratch)
    finish(op, flat, p)  # only the root gets here


def allreduce(flat: torch.Tensor, comm: Comm, op: str) -> None:
    """Reduce to group rank 0, then broadcast from it.

    Example::

        allreduce(flat, comm, op="max")
    """
    reduce(flat, comm, 0, op)
    broadcast(flat, comm, 0)
