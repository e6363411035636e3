"""Light-weight lossy gradient compression inside the AllReduce (Pipe-SGD, Li et al., NeurIPS 2018).

Pipe-SGD compresses every message of its AllReduce with cheap, element-wise codecs: truncation of
the floating-point representation and scalar quantization. This module provides them as codecs
that turn a 1-D floating tensor into a 1-D ``uint8`` payload (what travels on the wire) and back:
``"fp16"`` (IEEE half, relative error at most 2^-11 in half's normal range), ``"bf16"``
(bfloat16, at most 2^-8) and ``"int8"`` (symmetric quantization per chunk of ``chunk_size``
elements, error at most ``max|x over its chunk| / 254``).

Every codec has ``name``, ``encode(x) -> payload``, ``decode(payload, numel, dtype) -> tensor``,
``payload_nbytes(numel)`` (the exact length of ``encode``'s output) and ``ratio(dtype)``
(uncompressed / compressed bytes for long messages). Error feedback (:func:`error_feedback`,
:class:`ErrorFeedback`; Seide et al., Interspeech 2014; Karimireddy et al., ICML 2019) sends
``x = g_t + e_t`` and keeps ``e_{t+1} = x - decode(encode(x))`` locally per rank.

Error bounds, non-finite values, the payload layout: docs/algorithms.md, "Compression codecs";
error feedback: docs/update_rules.md, "Error feedback for compressed AllReduce".

Example::

    >>> import torch
    >>> from pipecomm import compress
    >>> grad = torch.linspace(-1, 1, 12).reshape(3, 4)
    >>> codec = compress.get_codec("int8")
    >>> payload = codec.encode(grad.reshape(-1))   # uint8, codec.payload_nbytes(n) bytes
    >>> payload.dtype, payload.numel() == codec.payload_nbytes(grad.numel())
    (torch.uint8, True)
    >>> approx = codec.decode(payload, grad.numel(), grad.dtype).view_as(grad)
    >>> bool((approx - grad).abs().max() < 0.01)
    True
"""

from __future__ import annotations

import math

import torch

from pipecomm import checks, vocab

__all__ = [
    "CODECS",
    "BF16Codec",
    "Codec",
    "ErrorFeedback",
    "FP16Codec",
    "Int8Codec",
    "check_error_feedback",
    "error_feedback",
    "get_codec",
    "relative_error",
]

CODECS: tuple[str, ...] = vocab.CODECS


def _check_input(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point:
        raise TypeError(
            f"x must be a floating-point tensor (float64/32/16, bfloat16), got {x.dtype}; "
            "gradient compression does not apply to integer or complex tensors"
        )
    if x.dim() != 1:
        raise ValueError(f"x must be 1-D, got shape {tuple(x.shape)}; pass x.reshape(-1)")
    return x.contiguous()


def _check_dtype(dtype: torch.dtype) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")


def _view_as(payload: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype``; copies first if the bytes are misaligned for it."""
    try:
        return payload.view(dtype)
    except RuntimeError:
        return payload.clone().view(dtype)


class Codec:
    """Base class: a lossy, element-wise codec from a 1-D floating tensor to a 1-D uint8 payload.

    Example::

        >>> codec = get_codec("fp16"); assert codec.payload_nbytes(10) == len(codec.encode(torch.ones(10)))
    """

    name: str = ""

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """1-D floating tensor -> 1-D uint8 payload of ``payload_nbytes(x.numel())`` bytes."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Payload -> new 1-D tensor of ``numel`` elements of ``dtype`` (never aliases ``payload``)."""
        raise NotImplementedError

    def payload_nbytes(self, numel: int) -> int:
        """Exact size in bytes of ``encode``'s output for ``numel`` elements."""
        raise NotImplementedError

    def ratio(self, dtype: torch.dtype) -> float:
        """Uncompressed / compressed bytes per element of ``dtype`` (long messages)."""
        raise NotImplementedError

    def _check_payload(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        _check_dtype(dtype)
        if not isinstance(numel, int) or isinstance(numel, bool) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        if (
            not isinstance(payload, torch.Tensor)
            or payload.dtype != torch.uint8
            or payload.dim() != 1
        ):
            desc = (
                f"{payload.dtype} {tuple(payload.shape)}"
                if isinstance(payload, torch.Tensor)
                else type(payload).__name__
            )
            raise TypeError(f"payload must be a 1-D torch.uint8 tensor, got {desc}")
        expected = self.payload_nbytes(numel)
        if payload.numel() != expected:
            raise ValueError(
                f"{self.name} payload for numel={numel} must have {expected} bytes, got {payload.numel()}"
            )
        return payload.contiguous()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class _Float16BitCodec(Codec):
    """Truncation to a 16-bit floating type (round to nearest even)."""

    wire_dtype: torch.dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input(x)
        return x.to(self.wire_dtype, copy=True).view(torch.uint8)

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        payload = self._check_payload(payload, numel, dtype)
        return _view_as(payload, self.wire_dtype).to(dtype, copy=True)

    def payload_nbytes(self, numel: int) -> int:
        return 2 * int(numel)

    def ratio(self, dtype: torch.dtype) -> float:
        _check_dtype(dtype)
        return dtype.itemsize / 2


class FP16Codec(_Float16BitCodec):
    """IEEE half precision on the wire; relative error <= 2^-11 in half's normal range.

    Example::

        >>> x = torch.tensor([1.0, 0.1, 3.0])
        >>> FP16Codec().decode(FP16Codec().encode(x), x.numel(), x.dtype)
        tensor([1.0000, 0.1000, 3.0000])
    """

    name = "fp16"
    wire_dtype = torch.float16


class BF16Codec(_Float16BitCodec):
    """bfloat16 on the wire; relative error <= 2^-8, float32's range.

    Example::

        >>> x = torch.tensor([1.0, 0.1, 3.0])
        >>> BF16Codec().decode(BF16Codec().encode(x), x.numel(), x.dtype)
        tensor([1.0000, 0.1001, 3.0000])
    """

    name = "bf16"
    wire_dtype = torch.bfloat16


class Int8Codec(Codec):
    """Symmetric 8-bit scalar quantization with one float32 scale per chunk of ``chunk_size``.

    Error per element <= max|x| over its chunk / 254. Payload: ``4 * ceil(n / chunk_size)`` bytes
    of scales, then ``n`` bytes of int8 values.

    Example::

        >>> x = torch.linspace(-1, 1, 5)
        >>> codec = Int8Codec(chunk_size=1024)
        >>> y = codec.decode(codec.encode(x), x.numel(), x.dtype)
        >>> bool((y - x).abs().max() <= 1 / 127)
        True
    """

    name = "int8"
    QMAX = 127

    def __init__(self, chunk_size: int = 256) -> None:
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self.chunk_size = chunk_size

    def _nchunks(self, numel: int) -> int:
        return -(-int(numel) // self.chunk_size)

    def payload_nbytes(self, numel: int) -> int:
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return 4 * self._nchunks(numel) + int(numel)

    def ratio(self, dtype: torch.dtype) -> float:
        _check_dtype(dtype)
        return dtype.itemsize / (1.0 + 4.0 / self.chunk_size)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input(x)
        n, c = x.numel(), self.chunk_size
        nchunks = self._nchunks(n)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        xf = x.to(torch.float32)
        padded = torch.nn.functional.pad(xf, (0, nchunks * c - n)).view(nchunks, c)
        absmax = padded.abs().amax(dim=1)  # nan if the chunk holds nan, inf if it holds inf
        finite = torch.isfinite(absmax)
        scale = torch.where(finite, absmax / self.QMAX, torch.full_like(absmax, float("nan")))
        ok = finite & (scale > 0)
        safe = torch.where(ok, scale, torch.ones_like(scale))
        q = torch.round(padded / safe[:, None]).clamp_(-self.QMAX, self.QMAX)
        q = torch.where(ok[:, None], q, torch.zeros_like(q)).to(torch.int8)
        return torch.cat([scale.view(torch.uint8), q.view(-1)[:n].view(torch.uint8)])

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        payload = self._check_payload(payload, numel, dtype)
        n, c = numel, self.chunk_size
        nchunks = self._nchunks(n)
        if n == 0:
            return torch.empty(0, dtype=dtype, device=payload.device)
        scale = _view_as(payload[: 4 * nchunks], torch.float32)
        q = payload[4 * nchunks :].view(torch.int8).to(torch.float32)
        q = torch.nn.functional.pad(q, (0, nchunks * c - n)).view(nchunks, c)
        return (q * scale[:, None]).view(-1)[:n].to(dtype)

    def __repr__(self) -> str:
        return f"Int8Codec(chunk_size={self.chunk_size})"


_REGISTRY = {"fp16": FP16Codec, "bf16": BF16Codec, "int8": Int8Codec}


def get_codec(name: str | None) -> Codec | None:
    """The codec called ``name`` ("fp16", "bf16", "int8"), or None for ``name=None``.

    Example::

        >>> codec = get_codec("bf16")
        >>> assert get_codec(None) is None
    """
    if name is None:
        return None
    if isinstance(name, Codec):
        return name
    if name not in _REGISTRY:
        raise ValueError(f"unknown compression {name!r}; choose one of {CODECS} or None")
    return _REGISTRY[name]()


def relative_error(x: torch.Tensor, name: str | Codec) -> float:
    """``||decode(encode(x)) - x|| / ||x||`` (2-norms, in float64) for codec ``name``.

    Returns 0.0 for an all-zero ``x`` that round-trips exactly, and ``inf`` if it does not.

    Example::

        >>> _ = torch.manual_seed(0)
        >>> round(relative_error(torch.randn(10_000), "int8"), 3)
        0.007
    """
    codec = get_codec(name)
    if codec is None:
        raise ValueError("name must be a codec name, not None")
    flat = _check_input(x.reshape(-1) if isinstance(x, torch.Tensor) else x)
    approx = codec.decode(codec.encode(flat), flat.numel(), flat.dtype)
    ref = flat.to(torch.float64)
    num = torch.linalg.vector_norm(approx.to(torch.float64) - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# --------------------------------------------------------------------------- error feedback


def check_error_feedback(error_feedback: object, compression: object, where: str) -> bool:
    """``error_feedback`` if it is a bool that ``compression`` allows, else an error naming both.

    Example::

        >>> check_error_feedback(True, "int8", where="PipeSGD")
        True
    """
    checks.flag(error_feedback, "error_feedback", where)
    if error_feedback and compression is None:
        raise ValueError(
            f"{where}: error_feedback=True needs a compression (compression=None loses nothing "
            "to feed back); pass compression='fp16', 'bf16' or 'int8', or error_feedback=False"
        )
    return error_feedback


def error_feedback(
    x: torch.Tensor, residual: torch.Tensor | None, codec: Codec
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of error feedback for one bucket: what to send, and the next residual.

    Args:
        x: this rank's 1-D gradient ``g_t`` of the bucket; updated in place to ``g_t + e_t``.
        residual: ``e_t``, the bucket's residual (``None``: ``e_0 = 0``).
        codec: the compression the message travels with.

    Returns ``(x, e_{t+1})`` with ``x = g_t + e_t`` and ``e_{t+1} = x - D(C(x))``: the local
    compression error (Karimireddy et al., ICML 2019, Algorithm 2 "EF-SGD"; torch's PowerSGD
    hook keeps its error the same way). ``x`` is then averaged with the compressed AllReduce.

    Example::

        >>> grad, e = torch.linspace(-1, 1, 6), None
        >>> x, e = error_feedback(grad.reshape(-1).clone(), e, get_codec("int8"))
        >>> e.shape
        torch.Size([6])
    """
    if residual is not None:
        x.add_(residual)
    approx = codec.decode(codec.encode(x), x.numel(), x.dtype)
    return x, x - approx


class ErrorFeedback:
    """The residuals of error feedback, one per bucket key (the state of :func:`error_feedback`).

    Args:
        codec: the compression of the AllReduce (a :class:`Codec`, or a name of one).

    Example::

        >>> flat = torch.linspace(-1, 1, 6)
        >>> ef = ErrorFeedback("int8")
        >>> flat = ef.compensate(0, flat)      # flat += e; e = flat - D(C(flat)); then allreduce flat
        >>> flat.shape
        torch.Size([6])
    """

    def __init__(self, codec: Codec | str) -> None:
        self.codec = get_codec(codec) if codec is None or isinstance(codec, str) else codec
        if self.codec is None:
            raise ValueError("ErrorFeedback: codec must be a compression, got None")
        self.residuals: dict = {}

    def compensate(self, key: object, x: torch.Tensor) -> torch.Tensor:
        """Add bucket ``key``'s residual to ``x`` (in place) and keep the new one; returns ``x``."""
        x, self.residuals[key] = error_feedback(x, self.residuals.get(key), self.codec)
        return x

    def __repr__(self) -> str:
        return f"ErrorFeedback({self.codec!r}, buckets={len(self.residuals)})"
