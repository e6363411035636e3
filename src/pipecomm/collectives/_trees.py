"""Binomial-tree scatter and gather of near-equal chunks (building blocks of "be" and "ring").

Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH"
(2005): the scatter half of a scatter-allgather broadcast and the gather half of a
reduce-scatter-gather reduce. ``m`` virtual ranks ``v = 0..m-1`` (``v = 0`` the root) map to group
indices through ``to_group``; chunk ``v`` (``offsets``, see :mod:`._chunks`) ends at (scatter) or
starts from (gather) virtual rank ``v``. ``ceil(log2 m)`` steps, ``(m - 1)/m n`` bytes out of the
root. Data lands directly in the flat buffer (no copies).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipecomm.collectives._chunks import span
from pipecomm.collectives._group import Comm


def _rounds(m: int) -> int:
    return (m - 1).bit_length()  # ceil(log2 m), 0 for m = 1


def binomial_scatter(
    flat: torch.Tensor,
    comm: Comm,
    offsets: list[int],
    v: int,
    m: int,
    to_group: Callable[[int], int],
) -> None:
    """Virtual rank 0 holds all chunks; afterwards virtual rank ``v`` holds chunk ``v``.

    Round with distance ``d`` (``2^(L-1)`` down to 1): ``v % 2d == 0`` sends chunks
    ``[v + d, v + 2d)`` to ``v + d``.

    Example::

        binomial_scatter(flat, comm, even_offsets(n, p), v, p, lambda u: (root + u) % p)
    """
    rounds = _rounds(m)
    for j in range(rounds):
        d = 1 << (rounds - 1 - j)
        if v % (2 * d) == 0 and v + d < m:
            comm.exchange([(span(flat, offsets, v + d, min(v + 2 * d, m)), to_group(v + d))], [])
        elif v % (2 * d) == d:
            comm.exchange([], [(span(flat, offsets, v, min(v + d, m)), to_group(v - d))])


def binomial_gather(
    flat: torch.Tensor,
    comm: Comm,
    offsets: list[int],
    v: int,
    m: int,
    to_group: Callable[[int], int],
) -> None:
    """Virtual rank ``v`` holds chunk ``v``; afterwards virtual rank 0 holds all chunks.

    The mirror image of :func:`binomial_scatter` (distances 1, 2, 4, ...).

    Example::

        binomial_gather(flat, comm, even_offsets(n, p), v, p, lambda u: (root + u) % p)
    """
    for j in range(_rounds(m)):
        d = 1 << j
        if v % (2 * d) == d:
            comm.exchange([(span(flat, offsets, v, min(v + d, m)), to_group(v - d))], [])
            return
        if v % (2 * d) == 0 and v + d < m:
            comm.exchange([], [(span(flat, offsets, v + d, min(v + 2 * d, m)), to_group(v + d))])
