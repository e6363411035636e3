"""Minimum-spanning-tree (binomial tree) collectives: the baseline of the LP paper.

Wang et al., arXiv 1611.04255, Sec. 2 (MST collectives as in MPICH); schedules exactly as in
``docs/algorithms.md`` ("MST"). With relative rank ``r = (rank - root) mod p`` and
``L = ceil(log2 p)`` rounds, the whole message moves in every round:

* broadcast: round ``j`` — each ``r < 2^j`` sends to ``r + 2^j``. ``T = L (alpha + n beta)``.
* reduce: the mirror image (rounds ``L-1 .. 0``, the receiver combines).
  ``T = L (alpha + n beta + n gamma)``.
* allreduce: reduce to group rank 0, then broadcast from group rank 0.

On the progress engine (:mod:`._engine`): a rank sends to its children one at a time in round
order (``exclusive`` sends; docs/algorithms.md, "Conventions"), and a reduce keeps the receives
of two children posted while it combines, in the lock-step order of the rounds.
"""

from __future__ import annotations

import torch

from pipecomm.collectives._engine import Engine, scratch
from pipecomm.collectives._group import Comm
from pipecomm.collectives._reduce import combine, finish


def broadcast(flat: torch.Tensor, comm: Comm, root: int, *, eng: Engine | None = None) -> None:
    """Binomial-tree broadcast of the whole message from group index ``root``.

    Example::

        broadcast(flat, comm, root=0)
    """
    p = comm.size
    if p == 1 or flat.numel() == 0:
        return
    own = eng is None
    eng = Engine(comm) if own else eng
    r = (comm.index - root) % p
    for j in range((p - 1).bit_length()):
        d = 1 << j
        if r < d and r + d < p:
            eng.send(flat, (root + r + d) % p, exclusive=True)  # one child at a time
        elif d <= r < 2 * d:
            eng.recv(flat, (root + r - d) % p).wait()
    if own:
        eng.finish()


def reduce(flat: torch.Tensor, comm: Comm, root: int, op: str, *,
           eng: Engine | None = None) -> None:
    """Binomial-tree reduce to group index ``root``; other ranks' buffers are overwritten.

    Example::

        reduce(flat, comm, root=0, op="sum")
    """
    p = comm.size
    if p == 1 or flat.numel() == 0:
        return
    own = eng is None
    eng = Engine(comm) if own else eng
    r = (comm.index - root) % p
    children, parent = [], None
    for j in reversed(range((p - 1).bit_length())):
        d = 1 << j
        if d <= r < 2 * d:
            parent = (root + r - d) % p
            break
        if r < d and r + d < p:
            children.append((root + r + d) % p)
    if children:  # in the lock-step order; two receives in flight, two scratch buffers
        n = flat.numel()
        slots = scratch(2 * n, flat).view(2, n)
        posted = [eng.recv(slots[c], children[c]) for c in range(min(2, len(children)))]
        for c in range(len(children)):
            posted[c].wait()
            combine(op, flat, slots[c % 2])
            if c + 2 < len(children):
                posted.append(eng.recv(slots[c % 2], children[c + 2]))
    if parent is not None:
        eng.send(flat, parent)
    else:
        finish(op, flat, p)  # only the root gets here
    if own:
        eng.finish()


def allreduce(flat: torch.Tensor, comm: Comm, op: str) -> None:
    """Reduce to group rank 0, then broadcast from it.

    Example::

        allreduce(flat, comm, op="max")
    """
    p = comm.size
    if p == 1 or flat.numel() == 0:
        return
    eng = Engine(comm)
    reduce(flat, comm, 0, op, eng=eng)
    broadcast(flat, comm, 0, eng=eng)
    eng.finish()
