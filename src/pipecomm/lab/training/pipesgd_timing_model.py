"""Iteration-time model of AllReduce SGD: synchronous, layer-wise and pipelined (Pipe-SGD).

The steady-state time of one training iteration from compute time, update time, gradient size,
cluster size, link and compression, after Li, Yu, Li, Avestimehr, Kim, Schwing, "Pipe-SGD: A
Decentralized Pipelined SGD Framework for Distributed Deep Net Training", NeurIPS 2018 (arXiv
1811.03619), and Daily, Vishnu, Siegel, "Leveraging Asynchronicity in Gradient Descent for
Scalable Deep Learning" (ICLR 2017 submission; layer-wise GD, "AGD (1 comm)", "AGD (2 comm)").

With ``C`` = ``compute_s``, ``U`` = ``update_s``, ``M`` the AllReduce of ``nbytes`` on the wire
(:func:`pipecomm.lab.networks.cost.allreduce_time`, ``beta`` divided by the compression ratio), ``E`` the
codec's encode/decode time and ``A = M + E``: ``"nocomm"`` ``T = C + U``; ``"sync"``
``T = C + A + U``; ``"layerwise"`` (fluid limit) ``T = C + U + max(0, A - f C)``, ``f`` the
backward fraction; ``"pipe"`` / ``"delayed"`` (``k >= 1``) ``T = max(C + U, A)``.

Derivation (bucketed layer-wise, ``overlap_update=False``, why ``k`` does not change the steady
state): docs/update_rules.md, "Iteration-time models" and "Pipe-SGD timing model: derivation".

Example::

    >>> from pipecomm.lab.networks import cost
    >>> from pipecomm.lab.training import pipesgd_timing_model as timing_model
    >>> link = cost.LinkModel.from_bandwidth(50e-6, 1.25e9)        # 10 Gb/s Ethernet-ish
    >>> kw = dict(compute_s=0.1, update_s=0.01, nbytes=100 * 2**20, p=4, link=link)
    >>> round(timing_model.speedup("pipe", **kw), 2)
    1.87
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from pipecomm import vocab
from pipecomm.lab.networks import cost

__all__ = ["CODECS", "MODES", "breakdown", "compression_ratio", "iteration_time", "speedup"]

MODES: tuple[str, ...] = vocab.TIMING_MODES
CODECS: tuple[str, ...] = vocab.CODECS


def compression_ratio(
    name: str | float | None,
    *,
    chunk: int | None = 256,
    itemsize: int = 4,
    scale_bytes: int = 4,
) -> float:
    """Bytes before / bytes on the wire of a codec (Pipe-SGD's light-weight compression).

    * ``None``: 1 (no compression).
    * ``"fp16"``, ``"bf16"`` (16-bit truncation): ``itemsize / 2`` -- 2 for float32 gradients.
    * ``"int8"`` (8-bit scalar quantization with one scale of ``scale_bytes`` per ``chunk``
      elements): ``itemsize * chunk / (chunk + scale_bytes)``; the defaults are those of
      :class:`pipecomm.compress.Int8Codec` (256-element chunks, float32 scales): 4 * 256 / 260 =
      3.94 for float32; ``chunk=None`` ignores the scales (ratio ``itemsize``).
    * a number ``>= 1``: that ratio.

    Example::

        >>> compression_ratio("fp16"), compression_ratio("int8", chunk=None)
        (2.0, 4.0)
        >>> round(compression_ratio("int8"), 4), compression_ratio("int8", chunk=4)
        (3.9385, 2.0)
    """
    for arg, val in (("itemsize", itemsize), ("scale_bytes", scale_bytes)):
        if isinstance(val, bool) or not isinstance(val, numbers.Integral) or val < 0:
            raise ValueError(f"{arg} must be a non-negative integer, got {val!r}")
    if name is None:
        return 1.0
    if isinstance(name, numbers.Real) and not isinstance(name, bool):
        if not (math.isfinite(name) and name >= 1):
            raise ValueError(f"a numeric compression ratio must be finite and >= 1, got {name!r}")
        return float(name)
    if name in ("fp16", "bf16"):
        if itemsize < 2:
            raise ValueError(f"{name} needs elements of >= 2 bytes, got itemsize={itemsize}")
        return itemsize / 2.0
    if name == "int8":
        if itemsize < 1:
            raise ValueError(f"itemsize must be >= 1, got {itemsize}")
        if chunk is None:
            return float(itemsize)
        if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1:
            raise ValueError(f"chunk must be a positive number of elements or None, got {chunk!r}")
        return itemsize * chunk / (chunk + scale_bytes)
    raise ValueError(f"compression must be None, one of {CODECS} or a ratio >= 1, got {name!r}")


def _nonneg(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number of seconds, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def _staleness(mode: str, staleness: Any) -> int:
    if staleness is not None and (
        isinstance(staleness, bool) or not isinstance(staleness, numbers.Integral)
    ):
        raise TypeError(f"staleness must be an integer or None, got {staleness!r}")
    if mode in ("pipe", "delayed"):
        k = 1 if staleness is None else int(staleness)
        if k < 0:
            raise ValueError(f"staleness must be >= 0, got {k}")
        return k
    if staleness not in (None, 0):
        raise ValueError(
            f"mode {mode!r} has staleness 0; got staleness={staleness!r} "
            "(use mode='pipe' or 'delayed' for stale gradients)"
        )
    return 0


def _split_buckets(nbytes: int, buckets: int) -> list[int]:
    q, r = divmod(nbytes, buckets)
    return [q + 1 if i < r else q for i in range(buckets)]


def breakdown(
    mode: str,
    *,
    compute_s: float,
    update_s: float,
    nbytes: int,
    p: int,
    link: cost.LinkModel,
    algorithm: str = "ring",
    staleness: int | None = None,
    compression: str | float | None = None,
    codec_s_per_byte: float = 0.0,
    backward_fraction: float = 0.67,
    buckets: int | None = None,
    block_bytes: int | None = None,
    chunk: int | None = 256,
    overlap_update: bool = True,
) -> dict[str, float]:
    """Per-iteration time split into what lies on the critical path.

    Model: docs/update_rules.md, "Iteration-time models".

    Returns ``compute``, ``communication`` and ``compression`` (the parts of ``M`` and ``E`` not
    hidden behind computation, split in proportion ``M : E``), ``update``, ``total`` (their sum)
    and ``hidden`` (the part of ``M + E`` overlapped with compute or update). ``compression`` is
    a codec name (see :func:`compression_ratio`, ``chunk`` passed on) or a ratio;
    ``codec_s_per_byte`` only counts with compression. ``algorithm`` and ``block_bytes`` go to
    :func:`pipecomm.lab.networks.cost.allreduce_time` (compression needs ``"lp"`` or ``"ring"``). The default
    algorithm is ``"ring"``, not pipecomm's default ``"auto"``: this models Pipe-SGD as its paper
    analyses it (ring AllReduce, Li et al. 2018), and the E6 experiment compares against that.

    Example::

        >>> from pipecomm.lab.networks.cost import LinkModel
        >>> link = LinkModel(alpha=0.0, beta=1e-9)
        >>> b = breakdown("sync", compute_s=0.2, update_s=0.0, nbytes=10**8, p=2, link=link)
        >>> round(b["communication"], 6), round(b["total"], 6)     # ring, p = 2: n beta
        (0.1, 0.3)
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    k = _staleness(mode, staleness)
    c = _nonneg(compute_s, "compute_s")
    u = _nonneg(update_s, "update_s")
    codec = _nonneg(codec_s_per_byte, "codec_s_per_byte")
    f = _nonneg(backward_fraction, "backward_fraction")
    if f > 1:
        raise ValueError(f"backward_fraction must be in [0, 1], got {backward_fraction!r}")
    if buckets is not None and (
        isinstance(buckets, bool) or not isinstance(buckets, numbers.Integral) or buckets < 1
    ):
        raise ValueError(f"buckets must be a positive integer or None, got {buckets!r}")
    ratio = compression_ratio(compression, chunk=chunk)
    if compression is None:
        codec = 0.0

    def comm(n: int) -> tuple[float, float]:
        m = cost.allreduce_time(algorithm, n, p, link, block_bytes, ratio, 0.0)
        if codec == 0.0:
            return m, 0.0
        a = cost.allreduce_time(algorithm, n, p, link, block_bytes, ratio, codec)
        return m, max(a - m, 0.0)

    if mode == "nocomm":
        m_tot = e_tot = 0.0
        total = c + u
    elif mode == "layerwise" and buckets is not None:
        fwd, bwd = (1 - f) * c, f * c
        finish = 0.0
        m_tot = e_tot = 0.0
        sizes = _split_buckets(cost.as_count(nbytes, "nbytes", 0), int(buckets))
        for i, nb in enumerate(sizes):
            m, e = comm(nb)
            m_tot, e_tot = m_tot + m, e_tot + e
            finish = max(finish, fwd + bwd * (i + 1) / len(sizes)) + m + e
        total = max(finish, c) + u
    else:
        m_tot, e_tot = comm(nbytes)
        a = m_tot + e_tot
        if mode == "layerwise":
            total = c + u + max(0.0, a - f * c)
        elif mode == "sync" or k == 0:
            total = c + a + u
        elif overlap_update or k >= 2:
            total = max(c + u, a)
        else:
            total = u + max(c, a)
    a_tot = m_tot + e_tot
    exposed = max(total - c - u, 0.0)
    share = m_tot / a_tot if a_tot > 0 else 1.0
    return {
        "compute": c,
        "communication": exposed * share,
        "compression": exposed * (1.0 - share),
        "update": u,
        "total": c + u + exposed,
        "hidden": max(a_tot - exposed, 0.0),
    }


def iteration_time(
    mode: str,
    *,
    compute_s: float,
    update_s: float,
    nbytes: int,
    p: int,
    link: cost.LinkModel,
    algorithm: str = "ring",
    staleness: int | None = None,
    compression: str | float | None = None,
    codec_s_per_byte: float = 0.0,
    backward_fraction: float = 0.67,
    buckets: int | None = None,
    block_bytes: int | None = None,
    chunk: int | None = 256,
    overlap_update: bool = True,
) -> float:
    """Steady-state seconds per iteration of ``mode`` (the formulas of the module docstring).

    Example::

        >>> from pipecomm.lab.networks.cost import LinkModel
        >>> link = LinkModel(alpha=0.0, beta=1e-9)
        >>> kw = dict(compute_s=0.1, update_s=0.0, nbytes=10**8, p=2, link=link)
        >>> iteration_time("sync", **kw), iteration_time("pipe", **kw)   # C + M and max(C, M)
        (0.2, 0.1)
    """
    return breakdown(
        mode,
        compute_s=compute_s,
        update_s=update_s,
        nbytes=nbytes,
        p=p,
        link=link,
        algorithm=algorithm,
        staleness=staleness,
        compression=compression,
        codec_s_per_byte=codec_s_per_byte,
        backward_fraction=backward_fraction,
        buckets=buckets,
        block_bytes=block_bytes,
        chunk=chunk,
        overlap_update=overlap_update,
    )["total"]


def speedup(mode: str, *, baseline: str = "sync", **kwargs: Any) -> float:
    """``iteration_time(baseline) / iteration_time(mode)`` with the same keyword arguments.

    ``staleness`` applies to ``mode`` only (the baseline gets its default); ``compression`` and
    ``codec_s_per_byte`` apply to both unless ``baseline_compression`` is given (``None`` for an
    uncompressed baseline, as in Pipe-SGD's comparison against conventional AllReduce).

    Example::

        >>> from pipecomm.lab.networks.cost import LinkModel
        >>> link = LinkModel(alpha=0.0, beta=1e-9)
        >>> speedup("pipe", compute_s=0.1, update_s=0.0, nbytes=10**8, p=2, link=link)
        2.0
    """
    base_kwargs = dict(kwargs)
    base_kwargs.pop("staleness", None)
    if "baseline_compression" in kwargs:
        kwargs.pop("baseline_compression")
        base_kwargs["compression"] = base_kwargs.pop("baseline_compression")
    t_mode = iteration_time(mode, **kwargs)
    t_base = iteration_time(baseline, **base_kwargs)
    if t_mode == 0.0:
        raise ValueError(
            "the iteration time of mode is zero (no compute, update or communication); "
            "a speedup is undefined"
        )
    return t_base / t_mode
