"""Reduction operators of the collectives: sum, avg, max, min (the gamma term of the cost model).

Partial results travel and are stored in the tensor's own dtype, as with the backends' built-in
collectives: each addition of a received piece is rounded once to that dtype (float16 and
bfloat16 included; there is no longer local accumulation to widen, since every rank adds each
received piece exactly once). ``avg`` is a sum divided by p once, by the rank that finishes a
piece, before it is distributed, so every rank holds identical bits.
"""

from __future__ import annotations

import torch

OPS: tuple[str, ...] = ("sum", "avg", "max", "min")

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int32,
    torch.int64,
)


def combine(op: str, acc: torch.Tensor, other: torch.Tensor) -> None:
    """``acc <- acc (op) other`` in place (``avg`` adds; :func:`finish` divides)."""
    if op in ("sum", "avg"):
        acc.add_(other)
    elif op == "max":
        torch.maximum(acc, other, out=acc)
    elif op == "min":
        torch.minimum(acc, other, out=acc)
    else:  # validated by the public API
        raise ValueError(f"op must be one of {OPS}, got {op!r}")


def finish(op: str, piece: torch.Tensor, p: int) -> None:
    """Turn a complete sum into the average (``avg`` only; a no-op for the other ops)."""
    if op == "avg" and p > 1:
        piece.div_(p)
