"""Binomial-tree scatter and gather of near-equal chunks (building blocks of "be" and "ring").

Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in MPICH"
(2005): the scatter half of a scatter-allgather broadcast and the gather half of a
reduce-scatter-gather reduce. ``m`` virtual ranks ``v = 0..m-1`` (``v = 0`` the root) map to group
indices through ``to_group``; chunk ``v`` (``offsets``, see :mod:`._chunks`) ends at (scatter) or
starts from (gather) virtual rank ``v``. ``ceil(log2 m)`` steps, ``(m - 1)/m n`` bytes out of the
root. Data lands directly in the flat buffer (no copies).

On the progress engine (:mod:`._engine`): a rank waits only for the message it needs; a
scatter's forwards go one child at a time in round order (``exclusive`` sends; docs/algorithms.md,
"Conventions"), a gather's upward send goes when the rank's range is complete.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipecomm.collectives._chunks import span
from pipecomm.collectives._engine import Engine


def rooted(index: int, root: int, p: int) -> tuple[int, Callable[[int], int]]:
    """``v = (index - root) mod p``, group index ``index`` relative to ``root``, and
    ``to_group(u) = (root + u) mod p``, its inverse (e.g. ``rooted(1, 3, 4)[0] == 2``)."""
    return (index - root) % p, lambda u: (root + u) % p


def _rounds(m: int) -> int:
    return (m - 1).bit_length()  # ceil(log2 m), 0 for m = 1


def binomial_scatter(flat: torch.Tensor, eng: Engine, offsets: list[int], v: int, m: int,
                     to_group: Callable[[int], int]) -> None:
    """Virtual rank 0 holds all chunks; afterwards virtual rank ``v`` holds chunk ``v``.

    Round with distance ``d`` (``2^(L-1)`` down to 1): ``v % 2d == 0`` sends chunks
    ``[v + d, v + 2d)`` to ``v + d``, after the rank's previous send has completed; the last
    is left in flight (``eng.finish`` waits).

    Example::

        binomial_scatter(flat, eng, even_offsets(n, p), v, p, lambda u: (root + u) % p)
    """
    rounds = _rounds(m)
    for j in range(rounds):
        d = 1 << (rounds - 1 - j)
        if v % (2 * d) == 0 and v + d < m:
            eng.send(span(flat, offsets, v + d, min(v + 2 * d, m)), to_group(v + d),
                     exclusive=True)  # one child at a time (the single-port model)
        elif v % (2 * d) == d:
            got = eng.recv(span(flat, offsets, v, min(v + d, m)), to_group(v - d))
            if got is not None:
                got.wait()


def binomial_gather(flat: torch.Tensor, eng: Engine, offsets: list[int], v: int, m: int,
                    to_group: Callable[[int], int]) -> None:
    """Virtual rank ``v`` holds chunk ``v``; afterwards virtual rank 0 holds all chunks.

    The mirror image of :func:`binomial_scatter` (distances 1, 2, 4, ...): the receives from
    all children are posted at once, then the rank's whole range goes up in one send.

    Example::

        binomial_gather(flat, eng, even_offsets(n, p), v, p, lambda u: (root + u) % p)
    """
    pending = []
    for j in range(_rounds(m)):
        d = 1 << j
        if v % (2 * d) == d:
            for got in pending:
                got.wait()
            eng.send(span(flat, offsets, v, min(v + d, m)), to_group(v - d))
            return
        if v % (2 * d) == 0 and v + d < m:
            got = eng.recv(span(flat, offsets, v + d, min(v + 2 * d, m)), to_group(v + d))
            if got is not None:
                pending.append(got)
    for got in pending:
        got.wait()
