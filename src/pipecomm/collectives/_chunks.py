"""How messages are cut: LP blocks of ``b`` bytes and p near-equal chunks (scatter, ring).

Implements the "Chunks and blocks" rule of ``docs/algorithms.md``: element counts split as evenly as
possible, the first ``n % p`` chunks one element longer; any ``n``, including 0 and ``n < p``.
All pieces are slices (views) of the flat buffer, so cutting copies nothing.
"""

from __future__ import annotations

import torch


def even_offsets(n: int, parts: int) -> list[int]:
    """Offsets ``o`` (length ``parts + 1``) with chunk ``c = [o[c], o[c+1])``.

    Example::

        >>> even_offsets(7, 3)
        [0, 3, 5, 7]
    """
    q, r = divmod(n, parts)
    offsets = [0]
    for c in range(parts):
        offsets.append(offsets[-1] + q + (1 if c < r else 0))
    return offsets


def span(flat: torch.Tensor, offsets: list[int], first: int, last: int) -> torch.Tensor:
    """The view of chunks ``first .. last - 1`` (consecutive chunks are one contiguous slice)."""
    return flat[offsets[first] : offsets[last]]


def num_blocks(n: int, block_elems: int) -> int:
    """``k = ceil(n / b)`` blocks of ``block_elems`` elements (the last one may be shorter)."""
    return -(-n // block_elems)


def block(flat: torch.Tensor, j: int, block_elems: int) -> torch.Tensor:
    """Block ``j`` of the flat buffer (a view)."""
    return flat[j * block_elems : (j + 1) * block_elems]
