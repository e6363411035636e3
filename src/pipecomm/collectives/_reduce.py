"""Reduction operators of the collectives: sum, avg, max, min (the gamma term of the cost model).

Partial results travel and are stored in the tensor's own dtype, as with the backends' built-in
collectives: each addition of a received piece is rounded once to that dtype (float16 and
bfloat16 included; there is no longer local accumulation to widen, since every rank adds each
received piece exactly once). ``avg`` is a sum divided by p once, by the rank that finishes a
piece, before it is distributed, so every rank holds identical bits. :class:`Wire`: a piece on the
wire as itself or encoded (the codec a parameter of one schedule).
"""

from __future__ import annotations

from typing import Any

import torch

OPS: tuple[str, ...] = ("sum", "avg", "max", "min")

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32,
                                             torch.float64, torch.int32, torch.int64)


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


class Wire:
    """How a piece travels in a reducing schedule: as itself (``codec=None``) or encoded by a
    codec (Pipe-SGD's light compression), so that one schedule serves both.

    ``encode(t)`` is what goes on the wire (``t`` itself without a codec); ``buffer(numel, like)``
    where a received message lands (``None``: the schedule's own buffer, scratch or in place);
    ``decode(got, like)`` the received piece as a tensor like ``like``; ``keep(t, sent)`` makes
    the rank that encoded a finished piece hold what the others decode (``decode(encode(t))``),
    ``land(t, got)`` writes a received finished piece into ``t``. Without a codec the last
    three do nothing and return their input, so the bits are those of the uncompressed schedule.

    Example::

        >>> wire = Wire(None)
        >>> t = torch.ones(3); wire.encode(t) is t and wire.decode(t, t) is t
        True
    """

    def __init__(self, codec: Any) -> None:
        self.codec = codec

    def encode(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.codec is None else self.codec.encode(t)

    def buffer(self, numel: int, like: torch.Tensor) -> torch.Tensor | None:
        if self.codec is None:
            return None
        return torch.empty(self.codec.payload_nbytes(numel), dtype=torch.uint8, device=like.device)

    def decode(self, got: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return got if self.codec is None else self.codec.decode(got, like.numel(), like.dtype)

    def keep(self, t: torch.Tensor, sent: torch.Tensor) -> None:
        if self.codec is not None:
            t.copy_(self.decode(sent, t))

    def land(self, t: torch.Tensor, got: torch.Tensor) -> None:
        if got is not t:
            t.copy_(self.decode(got, t))
