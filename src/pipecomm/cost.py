"""Alpha-beta-gamma cost models of pipecomm's collectives, the LP block size, and fitting.

One concept: the predicted time of a collective on a link described by three numbers,

* ``alpha`` -- seconds per message (latency),
* ``beta``  -- seconds per byte on the wire (1 / bandwidth),
* ``gamma`` -- seconds per byte reduced locally (the add of a reduction),

and a port model (``"single"``: one full-duplex port per rank, a rank's messages of one step
serialise; ``"per-neighbor"``: one link per ordered pair of ranks). The formulas are those of the
schedules pipecomm implements (``docs/algorithms.md``), which follow

* LP -- Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural
  Networks", arXiv 1611.04255: linear pipelining over a chain, ``(p + k - 2)(alpha + b beta)`` for
  broadcast and the optimal block count ``k* = sqrt((p - 2) n beta / alpha)``;
* MST and BE -- Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
  in MPICH", IJHPCA 2005; Chan, Heimlich, Purkayastha & van de Geijn, "Collective communication:
  theory, practice, and experience", CCPE 2007;
* ring -- Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
  workstations", JPDC 2009.

Steps are modelled in lock-step: a step (one ``p2p.exchange`` per rank) costs
``alpha + beta * V + gamma * R`` with ``V`` the most bytes any rank moves through one port in that
step (single port: the larger of its outgoing and incoming sums; per-neighbor: its largest message)
and ``R`` the most bytes any rank reduces in that step. For LP the block sizes are the real ones:
``k = ceil(n / b)`` blocks, the last of ``n - (k - 1) b`` bytes. BE and ring use ``n / p``-style
chunk sizes (exact when the element count divides evenly). An empty message (``n = 0``) or a single
rank (``p = 1``) costs nothing.

Example::

    >>> from pipecomm import cost
    >>> link = cost.LinkModel(alpha=10e-6, beta=1 / 10e9)
    >>> round(cost.broadcast_time("mst", 2**28, 64, link), 4)     # 6 rounds of the whole message
    0.1611
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipecomm import vocab

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALPHA_S",
    "DEFAULT_BANDWIDTH_BPS",
    "DEFAULT_GAMMA_S_PER_BYTE",
    "DEFAULT_LINK_TABLE",
    "DEFAULT_MESSAGE_OVERHEAD_S",
    "DEFAULT_MIN_BLOCK_BYTES",
    "OPS",
    "PORTS",
    "LP_MODELS",
    "HostLink",
    "LinkModel",
    "allreduce_time",
    "broadcast_time",
    "calibrated_link",
    "collective_time",
    "fit_alpha_beta",
    "fit_gamma",
    "host_link",
    "link_from_network",
    "lp_analytic_block_bytes",
    "lp_block_bytes_on_host",
    "lp_optimal_block_bytes",
    "lp_overlapped_block_bytes",
    "lp_overlapped_time",
    "lp_time_on_host",
    "model_table",
    "overlapped_time",
    "reduce_time",
]

ALGORITHMS: tuple[str, ...] = vocab.MODELLED_ALGORITHMS
OPS: tuple[str, ...] = ("broadcast", "reduce", "allreduce")
PORTS: tuple[str, ...] = ("single", "per-neighbor")
DEFAULT_MIN_BLOCK_BYTES = 4096

#: Fallback calibration (used when no E0 fit is available): gloo over loopback on a small
#: development machine -- about 160 us one-way latency, 2.5 GB/s per link, and a local
#: reduction (``a += b`` in float32, one thread) of about 20 GB/s (E0's fit on that machine).
DEFAULT_ALPHA_S = 160e-6
DEFAULT_BANDWIDTH_BPS = 2.5e9
DEFAULT_GAMMA_S_PER_BYTE = 5e-11

_CALIBRATION_ENV = "PIPECOMM_CALIBRATION"


# --------------------------------------------------------------------------------------------
# Link model and argument checks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LinkModel:
    """Cost parameters of one link: ``alpha`` s/message, ``beta`` s/byte, ``gamma`` s/byte reduced.

    ``ports`` is ``"single"`` (each rank sends one message at a time and receives one at a time)
    or ``"per-neighbor"`` (every ordered pair of ranks has a link of its own).

    Example::

        >>> LinkModel(alpha=1e-3, beta=1 / 400e6, gamma=1e-9).bandwidth_Bps
        400000000.0
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    ports: str = "single"

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"LinkModel.{name} must be a real number of seconds, got {type(value).__name__}"
                )
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"LinkModel.{name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.ports not in PORTS:
            raise ValueError(f"LinkModel.ports must be one of {PORTS}, got {self.ports!r}")

    @classmethod
    def from_bandwidth(
        cls, alpha_s: float, bandwidth_Bps: float, gamma: float = 0.0, ports: str = "single"
    ) -> LinkModel:
        """Build a link from latency and bandwidth in bytes per second.

        Example::

            >>> LinkModel.from_bandwidth(10e-6, 10e9).beta
            1e-10
        """
        if isinstance(bandwidth_Bps, bool) or not isinstance(bandwidth_Bps, numbers.Real):
            raise TypeError("bandwidth_Bps must be a real number of bytes per second")
        if not bandwidth_Bps > 0:
            raise ValueError(f"bandwidth_Bps must be > 0, got {bandwidth_Bps!r}")
        return cls(alpha=alpha_s, beta=1.0 / float(bandwidth_Bps), gamma=gamma, ports=ports)

    @property
    def bandwidth_Bps(self) -> float:
        """``1 / beta`` in bytes per second (``inf`` for ``beta = 0``)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def with_ports(self, ports: str) -> LinkModel:
        """The same link under another port model.

        Example::

            >>> LinkModel(1e-3, 1e-8).with_ports("per-neighbor").ports
            'per-neighbor'
        """
        return dataclasses.replace(self, ports=ports)


def as_count(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int of at least ``minimum`` (an integral float is accepted), else an
    error naming ``name``.

    Example::

        cost.as_count(8.0, "p", 1)   # 8
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    integral = isinstance(value, numbers.Integral)
    if integral or (isinstance(value, numbers.Real) and float(value).is_integer()):
        out = int(value)
    else:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _check_link(link: Any) -> LinkModel:
    if not isinstance(link, LinkModel):
        raise TypeError(
            f"link must be a pipecomm.cost.LinkModel, got {type(link).__name__}; "
            "build one with LinkModel(alpha, beta, gamma) or link_from_network(net)"
        )
    return link


def _check_algorithm(algorithm: Any) -> str:
    if algorithm == "torch":
        raise ValueError(
            "algorithm 'torch' (the backend's built-in collective) has no cost model; "
            f"use one of {ALGORITHMS}"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


def _check_op(op: Any) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


def _check_block(block_bytes: Any) -> int | None:
    if block_bytes is None:
        return None
    return as_count(block_bytes, "block_bytes", 1)


def _check_compression(algorithm: str, ratio: Any, codec: Any) -> tuple[float, float]:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"compression_ratio must be a real number >= 1, got {ratio!r}")
    if not (math.isfinite(ratio) and ratio >= 1.0):
        raise ValueError(f"compression_ratio must be finite and >= 1, got {ratio!r}")
    if isinstance(codec, bool) or not isinstance(codec, numbers.Real):
        raise TypeError(f"codec_s_per_byte must be a real number >= 0, got {codec!r}")
    if not (math.isfinite(codec) and codec >= 0.0):
        raise ValueError(f"codec_s_per_byte must be finite and >= 0, got {codec!r}")
    if (ratio != 1.0 or codec != 0.0) and algorithm not in ("lp", "ring"):
        raise ValueError(
            f"compression is modelled (and implemented) only for algorithms 'lp' and 'ring', "
            f"got algorithm={algorithm!r}; pass compression_ratio=1 and codec_s_per_byte=0"
        )
    return float(ratio), float(codec)


def _round_up8(x):
    return -(-x // 8) * 8


def _ceil_log2(p: int) -> int:
    return (p - 1).bit_length()


# --------------------------------------------------------------------------------------------
# LP (linear pipelining): closed forms of the lock-step schedule, vectorised over block sizes
# --------------------------------------------------------------------------------------------


def _lp_terms(
    op: str, n: int, p: int, b: np.ndarray, ports: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps S, wire bytes sum_s V_s and reduced bytes sum_s R_s of LP for block sizes ``b``.

    ``n >= 1`` and ``p >= 2``. Blocks: ``k = ceil(n / b)``, all of ``b`` bytes but the last of
    ``bl = n - (k - 1) b``. Derivation (lock-step, see the module docstring):

    * broadcast/reduce: steps ``s = 0 .. k + p - 3``; every step moves one block per link and only
      the final step carries the last block alone, so ``sum V = (k + p - 3) b + bl
      = n + (p - 2) b``; reduce adds every received block: ``sum R = sum V``.
    * allreduce: steps ``s = 0 .. k + 2p - 4``; the reduce direction is LP reduce towards rank
      p-1, the broadcast direction starts block j back at step ``j + p - 1``. Per step the largest
      block is ``b`` except the very last step (``bl`` alone): per-neighbor ``sum V = (S - 1) b +
      bl = n + (2p - 3) b``. Under a single port a rank that sends (or receives) in both directions
      moves two blocks through its port. The two directions meet on a rank only for block pairs
      ``(j, j')`` with ``j - j'`` even and ``>= 2``; for p >= 3 that happens in exactly ``k - 1``
      steps when ``k >= 3`` (none when ``k <= 2``): one of them pairs a full block with the last
      block, the others two full blocks (for ``k = 3`` both pair a full block with the last).
      Hence single-port ``sum V = n + (2p - 3) b + [k >= 4]((k - 2) b + bl) + [k = 3] 2 bl``.
      Reductions happen in the ``k + p - 2`` reduce steps: ``sum R = n + (p - 2) b``.
    """
    b = np.minimum(b.astype(np.int64), n)
    k = (n + b - 1) // b
    bl = n - (k - 1) * b
    if op in ("broadcast", "reduce"):
        steps = k + p - 2
        wire = n + (p - 2) * b
        reduced = wire if op == "reduce" else np.zeros_like(wire)
        return steps.astype(float), wire.astype(float), reduced.astype(float)
    steps = k + 2 * p - 3
    wire = n + (2 * p - 3) * b
    if ports == "single" and p >= 3:
        extra = np.where(k >= 4, (k - 2) * b + bl, np.where(k == 3, 2 * bl, 0))
        wire = wire + extra
    reduced = n + (p - 2) * b
    return steps.astype(float), wire.astype(float), reduced.astype(float)


def _lp_time_vec(
    op: str,
    n: int,
    p: int,
    b: np.ndarray,
    link: LinkModel,
    ratio: float = 1.0,
    codec: float = 0.0,
) -> np.ndarray:
    steps, wire, reduced = _lp_terms(op, n, p, np.asarray(b), link.ports)
    return link.alpha * steps + (link.beta / ratio) * wire + (link.gamma + codec) * reduced


def _lp_time(
    op: str,
    n: int,
    p: int,
    link: LinkModel,
    block_bytes: int | None,
    ratio: float = 1.0,
    codec: float = 0.0,
) -> float:
    if n == 0 or p == 1:
        return 0.0
    if block_bytes is None:
        block_bytes = lp_optimal_block_bytes(
            op, n, p, link, compression_ratio=ratio, codec_s_per_byte=codec
        )
    return float(_lp_time_vec(op, n, p, np.array([block_bytes]), link, ratio, codec)[0])


def lp_analytic_block_bytes(
    op: str,
    nbytes: int,
    p: int,
    link: LinkModel,
    *,
    compression_ratio: float = 1.0,
    codec_s_per_byte: float = 0.0,
) -> float:
    """Continuous optimum ``b* = n / k*`` of the LP cost with uniform blocks (no clamping).

    Minimising ``(k + c) alpha + d b`` with ``b = n / k`` gives ``b* = sqrt(n alpha / d)``:

    * broadcast: ``d = (p - 2) beta``  -> ``k* = sqrt((p - 2) n beta / alpha)`` (LP paper);
    * reduce: ``d = (p - 2)(beta + gamma)``;
    * allreduce, per-neighbor: ``d = (2p - 3) beta + (p - 2) gamma``;
    * allreduce, single port: ``d = (2p - 4) beta + (p - 2) gamma`` (the wire term is
      ``2n + (2p - 4) b``: two blocks per port in the k - 1 steps where both directions meet).

    ``beta`` is divided by ``compression_ratio`` and ``codec_s_per_byte`` is added to ``gamma``.
    Returns ``inf`` when ``d = 0`` (pipelining does not pay: one block) and ``0`` when
    ``alpha = 0``.

    Example::

        >>> link = LinkModel(alpha=10e-6, beta=1e-10)
        >>> round(2**28 / lp_analytic_block_bytes("broadcast", 2**28, 64, link))   # k*
        408
    """
    _check_op(op)
    link = _check_link(link)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    ratio, codec = _check_compression("lp", compression_ratio, codec_s_per_byte)
    beta, gamma = link.beta / ratio, link.gamma + codec
    if op == "broadcast":
        d = (p - 2) * beta
    elif op == "reduce":
        d = (p - 2) * (beta + gamma)
    elif link.ports == "per-neighbor":
        d = (2 * p - 3) * beta + (p - 2) * gamma
    else:
        d = (2 * p - 4) * beta + (p - 2) * gamma
    if d <= 0:
        return math.inf
    return math.sqrt(n * link.alpha / d)


def lp_optimal_block_bytes(
    op: str,
    nbytes: int,
    p: int,
    link: LinkModel,
    *,
    min_bytes: int = DEFAULT_MIN_BLOCK_BYTES,
    max_bytes: int | None = None,
    compression_ratio: float = 1.0,
    codec_s_per_byte: float = 0.0,
) -> int:
    """LP block size (bytes) that minimises the exact LP cost of ``op`` on ``link``.

    Candidates are every multiple of 8 in ``[min_bytes, min(max_bytes, nbytes)]`` and the whole
    message. For a fixed block count ``k = ceil(n / b)`` the exact cost (last block
    ``n - (k - 1) b``) is linear in ``b``, so only the two ends of each ``k``'s interval are
    evaluated; the result is the exact discrete minimum (ties go to the larger block). The
    continuous optimum of :func:`lp_analytic_block_bytes` (``k* = sqrt((p - 2) n beta / alpha)``
    for broadcast, the LP paper's formula) is where it lands for large messages. Messages of at
    most ``min_bytes`` bytes, ``p <= 2`` broadcast/reduce and links without bandwidth cost get one
    block (the whole message); an empty message gets 8.

    Example::

        >>> link = LinkModel(alpha=10e-6, beta=1e-10)
        >>> lp_optimal_block_bytes("broadcast", 2**28, 64, link)    # k = 408 blocks
        657936
    """
    _check_op(op)
    link = _check_link(link)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    lo = as_count(min_bytes, "min_bytes", 1)
    hi = n if max_bytes is None else as_count(max_bytes, "max_bytes", 1)
    if hi < lo and max_bytes is not None:
        raise ValueError(f"max_bytes ({hi}) must be >= min_bytes ({lo})")
    ratio, codec = _check_compression("lp", compression_ratio, codec_s_per_byte)
    if n <= lo or p == 1:
        return n if n > 0 else 8
    return _lp_optimal_block_bytes(op, n, p, link, lo, min(hi, n), ratio, codec)


@functools.lru_cache(maxsize=4096)
def _lp_optimal_block_bytes(
    op: str, n: int, p: int, link: LinkModel, lo: int, hi: int, ratio: float, codec: float
) -> int:
    # cached: collectives call this on every operation without an explicit block size
    lo8 = _round_up8(lo)
    hi8 = (hi // 8) * 8
    k_max = -(-n // lo8)
    k_min = -(-n // hi)
    if k_max - k_min > 4_000_000:  # astronomically many blocks: search around the analytic k*
        b_star = lp_analytic_block_bytes(
            op, n, p, link, compression_ratio=ratio, codec_s_per_byte=codec
        )
        k_star = n / b_star if b_star > 0 else k_max
        k_min = max(k_min, int(k_star / 64))
        k_max = min(k_max, int(k_star * 64) + 2)
    ks = np.arange(max(k_min, 1), k_max + 1, dtype=np.int64)
    # Block sizes with exactly k blocks: n / k <= b < n / (k - 1). Ends of that interval among
    # multiples of 8, clipped to [lo8, hi8].
    small = np.maximum(_round_up8(-(-n // ks)), lo8)
    large = np.where(ks > 1, ((n - 1) // np.maximum(ks - 1, 1) // 8) * 8, hi8)
    large = np.minimum(large, hi8)
    cands = np.concatenate([small[small <= large], large[small <= large]])
    cands = cands[(cands >= 1) & (cands < n)]
    if hi == n:
        cands = np.concatenate([cands, [n]])
    if cands.size == 0:  # nothing in range is a multiple of 8: take the largest allowed block
        return hi
    cands = np.unique(cands)[::-1]  # descending: argmin's first hit is the larger block
    times = _lp_time_vec(op, n, p, cands, link, ratio, codec)
    return int(cands[int(np.argmin(times))])


# --------------------------------------------------------------------------------------------
# Public cost functions
# --------------------------------------------------------------------------------------------


def _check_args(
    algorithm: str, link: LinkModel, nbytes: int, p: int, block_bytes: int | None
) -> tuple[str, LinkModel, int, int, int | None]:
    """The validated arguments every collective model takes."""
    return (
        _check_algorithm(algorithm),
        _check_link(link),
        as_count(nbytes, "nbytes", 0),
        as_count(p, "p", 1),
        _check_block(block_bytes),
    )


def broadcast_time(
    algorithm: str, nbytes: int, p: int, link: LinkModel, block_bytes: int | None = None
) -> float:
    """Predicted time (s) of a broadcast of ``nbytes`` from one rank to ``p`` ranks.

    * ``lp`` (LP paper): chain ``src, src+1, ...``; ``T = (k + p - 2) alpha + (n + (p - 2) b)
      beta`` -- the paper's ``(p + k - 2)(alpha + b beta)`` with the last block of its real size
      ``n - (k - 1) b`` (it travels alone only in the final step). ``block_bytes=None`` uses
      :func:`lp_optimal_block_bytes`. Same for both port models.
    * ``mst`` (binomial tree; Thakur et al. 2005): ``ceil(log2 p)(alpha + n beta)``.
    * ``be`` (scatter + recursive-doubling allgather; Thakur et al. 2005) with ``p'`` the largest
      power of two ``<= p``: ``2 log2 p' alpha + 2 (p' - 1)/p' n beta``, plus ``alpha + n beta``
      when ``p > p'`` (the core sends the message on to the extra ranks).
    * ``ring`` (binomial scatter + ring allgather; Chan et al. 2007):
      ``ceil(log2 p) alpha + (p - 1)/p n beta + (p - 1)(alpha + n/p beta)``.

    Example::

        >>> link = LinkModel(alpha=1e-3, beta=1e-6)
        >>> broadcast_time("lp", 4000, 4, link, block_bytes=1000)   # k + p - 2 = 6 steps of 2 ms
        0.012
    """
    algorithm, link, n, p, b = _check_args(algorithm, link, nbytes, p, block_bytes)
    if n == 0 or p == 1:
        return 0.0
    a, be = link.alpha, link.beta
    if algorithm == "lp":
        return _lp_time("broadcast", n, p, link, b)
    if algorithm == "mst":
        return _ceil_log2(p) * (a + n * be)
    if algorithm == "be":
        pp, r = _pow2_floor(p)
        lg = pp.bit_length() - 1
        t = 2 * lg * a + 2 * (pp - 1) / pp * n * be
        return t + (a + n * be if r > 0 else 0.0)
    # ring
    return _ceil_log2(p) * a + (p - 1) / p * n * be + (p - 1) * (a + n / p * be)


def reduce_time(
    algorithm: str, nbytes: int, p: int, link: LinkModel, block_bytes: int | None = None
) -> float:
    """Predicted time (s) of a reduction of ``nbytes`` from ``p`` ranks to one rank.

    * ``lp``: chain ending at ``dst``; every step receives a block and adds it:
      ``T = (k + p - 2) alpha + (n + (p - 2) b)(beta + gamma)`` -- the paper's
      ``(k + p - 2)(alpha + b beta + b gamma)`` with the real last block.
    * ``mst`` (mirror of the binomial broadcast): ``ceil(log2 p)(alpha + n beta + n gamma)``.
    * ``be`` (fold, recursive-halving reduce-scatter, binomial gather; Thakur et al. 2005):
      ``[p > p'](alpha + n beta + n gamma) + 2 log2 p' alpha + (p' - 1)/p' n (2 beta + gamma)``.
    * ``ring`` (ring reduce-scatter + binomial gather):
      ``(p - 1)(alpha + n/p (beta + gamma)) + ceil(log2 p) alpha + (p - 1)/p n beta``.

    Example::

        >>> link = LinkModel(alpha=1e-3, beta=1e-6, gamma=1e-6)
        >>> round(reduce_time("mst", 1000, 4, link), 6)     # 2 rounds of (1 + 1 + 1) ms
        0.006
    """
    algorithm, link, n, p, b = _check_args(algorithm, link, nbytes, p, block_bytes)
    if n == 0 or p == 1:
        return 0.0
    a, be, g = link.alpha, link.beta, link.gamma
    if algorithm == "lp":
        return _lp_time("reduce", n, p, link, b)
    if algorithm == "mst":
        return _ceil_log2(p) * (a + n * be + n * g)
    if algorithm == "be":
        pp, r = _pow2_floor(p)
        lg = pp.bit_length() - 1
        t = 2 * lg * a + (pp - 1) / pp * n * (2 * be + g)
        return t + (a + n * be + n * g if r > 0 else 0.0)
    return (p - 1) * (a + n / p * (be + g)) + _ceil_log2(p) * a + (p - 1) / p * n * be


def allreduce_time(
    algorithm: str,
    nbytes: int,
    p: int,
    link: LinkModel,
    block_bytes: int | None = None,
    compression_ratio: float = 1.0,
    codec_s_per_byte: float = 0.0,
) -> float:
    """Predicted time (s) of an allreduce of ``nbytes`` over ``p`` ranks.

    * ``lp`` (LP paper): reduce towards rank p-1 and, at the same time, broadcast finished blocks
      back to rank 0; ``S = k + 2p - 3`` steps, ``k + p - 2`` of them reduce a block.
      per-neighbor: ``T = S alpha + (n + (2p - 3) b) beta + (n + (p - 2) b) gamma`` (each step one
      block per link; the last step carries only the last block).
      single port: the ``k - 1`` steps (``k >= 3``, ``p >= 3``) in which a rank sends or receives in
      both directions move two blocks through its port -- ``alpha + 2 b beta + b gamma`` instead of
      ``alpha + b beta + b gamma`` -- so the wire term gains ``(k - 2) b + bl`` (``2 bl`` for
      ``k = 3``), ``bl`` the last block. Fill and drain steps (one direction only) cost
      ``alpha + b beta`` plus ``b gamma`` only where a block is added.
    * ``mst``: binomial reduce to rank 0 then binomial broadcast:
      ``ceil(log2 p)(2 alpha + 2 n beta + n gamma)``.
    * ``be`` (Rabenseifner; Thakur et al. 2005), ``p'`` the largest power of two ``<= p``:
      ``2 log2 p' alpha + 2 (p' - 1)/p' n beta + (p' - 1)/p' n gamma``, plus
      ``2 alpha + 2 n beta + n gamma`` for the fold when ``p > p'``.
    * ``ring`` (Patarasuk & Yuan 2009): ``2 (p - 1)(alpha + n/p beta) + (p - 1)/p n gamma``.

    Compression (``lp`` and ``ring`` only; Pipe-SGD): blocks travel encoded, so ``beta`` is divided
    by ``compression_ratio``; every hop that adds a block decodes and re-encodes it, so
    ``codec_s_per_byte`` (seconds per uncompressed byte for decode + encode) is added to ``gamma``.

    Example::

        >>> link = LinkModel(alpha=0.0, beta=1e-9, ports="per-neighbor")
        >>> allreduce_time("ring", 4000, 4, link)        # 2 * 3/4 * 4000 bytes at 1 ns/byte
        6e-06
    """
    algorithm, link, n, p, b = _check_args(algorithm, link, nbytes, p, block_bytes)
    ratio, codec = _check_compression(algorithm, compression_ratio, codec_s_per_byte)
    if n == 0 or p == 1:
        return 0.0
    a, be, g = link.alpha, link.beta, link.gamma
    if algorithm == "lp":
        return _lp_time("allreduce", n, p, link, b, ratio, codec)
    if algorithm == "mst":
        return _ceil_log2(p) * (2 * a + 2 * n * be + n * g)
    if algorithm == "be":
        pp, r = _pow2_floor(p)
        lg = pp.bit_length() - 1
        f = (pp - 1) / pp
        t = 2 * lg * a + 2 * f * n * be + f * n * g
        return t + (2 * a + 2 * n * be + n * g if r > 0 else 0.0)
    q = (p - 1) / p
    return 2 * (p - 1) * a + 2 * q * n * be / ratio + q * n * (g + codec)


def collective_time(
    op: str,
    algorithm: str,
    nbytes: int,
    p: int,
    link: LinkModel,
    block_bytes: int | None = None,
    *,
    compression_ratio: float = 1.0,
    codec_s_per_byte: float = 0.0,
) -> float:
    """Dispatch to :func:`broadcast_time`, :func:`reduce_time` or :func:`allreduce_time`.

    Compression arguments apply to ``op="allreduce"`` only.

    Example::

        >>> link = LinkModel(alpha=1e-3, beta=1e-6)
        >>> collective_time("broadcast", "mst", 1000, 8, link)     # 3 rounds of 2 ms
        0.006
    """
    _check_op(op)
    if op == "allreduce":
        return allreduce_time(
            algorithm, nbytes, p, link, block_bytes, compression_ratio, codec_s_per_byte
        )
    if compression_ratio != 1.0 or codec_s_per_byte != 0.0:
        raise ValueError(f"compression is modelled for op='allreduce' only, got op={op!r}")
    if op == "broadcast":
        return broadcast_time(algorithm, nbytes, p, link, block_bytes)
    return reduce_time(algorithm, nbytes, p, link, block_bytes)


def _pow2_floor(p: int) -> tuple[int, int]:
    pp = 1 << (p.bit_length() - 1)
    return pp, p - pp


# --------------------------------------------------------------------------------------------
# LP as the progress engine runs it: the overlapped model
# --------------------------------------------------------------------------------------------

#: The two models of LP's time: the paper's lock-step steps (every step pays ``alpha``) and the
#: progress engine's overlapped pipeline (a block's latency is in flight while the port sends
#: the next one; docs/algorithms.md, "LP as the engine runs it").
LP_MODELS: tuple[str, ...] = ("lock-step", "overlapped")


def _check_host_block(host_block_s: Any) -> float:
    if isinstance(host_block_s, bool) or not isinstance(host_block_s, numbers.Real):
        raise TypeError(f"host_block_s must be a real number of seconds, got {host_block_s!r}")
    if not (math.isfinite(host_block_s) and host_block_s >= 0):
        raise ValueError(f"host_block_s must be finite and >= 0, got {host_block_s!r}")
    return float(host_block_s)


def _lp_overlapped_vec(op: str, n: int, p: int, b: np.ndarray, link: LinkModel,
                       h: float) -> np.ndarray:
    """The overlapped LP time for block sizes ``b`` (``n >= 1``, ``p >= 2``)."""
    b = np.minimum(np.asarray(b).astype(np.int64), n)
    k = (n + b - 1) // b
    bl = n - (k - 1) * b
    a, be, g = link.alpha, link.beta, link.gamma
    if op == "broadcast":
        return (p - 1) * a + (n + (p - 2) * b) * be + k * h
    if op == "reduce":
        return (p - 1) * a + (n + (p - 2) * b) * be + ((p - 2) * b + bl) * g + k * h
    return np.array([_lp_replay(op, n, p, int(x), link) for x in b]) + k * h


@functools.lru_cache(maxsize=4096)
def _lp_replay(op: str, n: int, p: int, b: int, link: LinkModel) -> float:
    """LP ``op`` replayed on ``link``'s ports: each rank runs the engine's order of waits,
    combines and sends (:mod:`pipecomm.collectives.lp`), every send is reserved on the ports
    (:class:`pipecomm.netem.LinkSchedule`: ``alpha`` in flight, ``b beta`` on the sender's
    out-port and, single port, the receiver's in-port, earliest fit in posting order) when its
    rank posts it, and a receive completes at its delivery. Returns the time the last rank is
    done."""
    from pipecomm import netem

    bw = math.inf if link.beta == 0 else 1.0 / link.beta
    sched = netem.LinkSchedule(netem.Network(alpha_s=link.alpha, bandwidth_Bps=bw,
                                             ports=link.ports), p)
    table = sched.new_table()
    k = -(-n // b)
    size = [b] * (k - 1) + [n - (k - 1) * b]

    def program(i: int):  # ("send", peer, block, stream) | ("recv", ...) | ("cpu", seconds)
        if op != "allreduce":
            if i == 0:
                yield from (("send", 1, j, 0) for j in range(k))
                return
            for j in range(k):
                yield "recv", i - 1, j, 0
                if op == "reduce":
                    yield "cpu", link.gamma * size[j]
                if i < p - 1:
                    yield "send", i + 1, j, 0
            return
        if i == 0:
            yield from (("send", 1, j, 0) for j in range(k))
        for s in range(k + 2 * p - 3):
            up, down = s - i + 1, s - (2 * p - 3 - i)
            if i > 0 and 0 <= up < k:
                yield "recv", i - 1, up, 0
                yield "cpu", link.gamma * size[up]
                yield ("send", i + 1, up, 0) if i < p - 1 else ("send", i - 1, up, 1)
            if i < p - 1 and 0 <= down < k:
                yield "recv", i + 1, down, 1
                if i > 0:
                    yield "send", i - 1, down, 1

    ranks = [program(i) for i in range(p)]
    clock = [0.0] * p
    todo = [next(r, None) for r in ranks]
    delivered: dict[tuple[int, int, int, int], float] = {}
    end = 0.0
    while True:  # the ready action that happens first (a post is final once made)
        best, who = math.inf, -1
        for i, act in enumerate(todo):
            if act is None:
                continue
            t = clock[i]
            if act[0] == "recv":
                key = (act[1], i, act[2], act[3])
                if key not in delivered:
                    continue
                t = max(t, delivered[key])
            if t < best:
                best, who = t, i
        if who < 0:
            break
        act = todo[who]
        if act[0] == "send":
            due = sched.post(table, who, act[1], size[act[2]], now=best, prune_before=-1.0)
            delivered[(who, act[1], act[2], act[3])] = due
            end = max(end, due)
        elif act[0] == "cpu":
            best += act[1]
        clock[who] = best
        end = max(end, best)
        todo[who] = next(ranks[who], None)
    if any(act is not None for act in todo):
        raise RuntimeError("LP replay stalled: a rank waits for a message never sent")
    return end


def lp_overlapped_time(op: str, nbytes: int, p: int, link: LinkModel, block_bytes: int,
                       host_block_s: float = 0.0) -> float:
    """Predicted LP time as the progress engine runs it (the overlapped model).

    The engine forwards a block the moment it has arrived (and been combined), and a link's
    latency does not occupy its port, so a block's ``alpha`` is in flight while the port sends
    the next block: latency is paid once per hop of the chain, not once per pipeline step.
    Closed forms (Wang et al., arXiv 1611.04255, schedule; derivation in docs/algorithms.md,
    "LP as the engine runs it"), ``k = ceil(n / b)``, last block ``bl = n - (k - 1) b``:

    * broadcast: ``(p - 1) alpha + (n + (p - 2) b) beta + k h``;
    * reduce: ``(p - 1) alpha + (n + (p - 2) b) beta + ((p - 2) b + bl) gamma + k h``;
    * allreduce: no closed form (the engine's one loop per rank couples the two streams, and a
      single port carries both): the engine's order of posts replayed on the link's ports, plus
      ``k h``.

    ``h = host_block_s``: host seconds each block adds to the critical path (the block's share
    of the ranks' posting and wake-ups on a host with fewer cores than ranks); the lab takes
    E0's per-message latency of the real backend (``calibrated_link().alpha``). It is what
    keeps the optimum block finite: without it smaller blocks are always faster.

    Example::

        >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
        >>> round(lp_overlapped_time("broadcast", 4 << 20, 8, link, 1 << 18) * 1e3, 2)   # ms
        129.34
    """
    _check_op(op)
    link = _check_link(link)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    b = min(as_count(block_bytes, "block_bytes", 1), max(n, 1))
    h = _check_host_block(host_block_s)
    if n == 0 or p == 1:
        return 0.0
    return float(_lp_overlapped_vec(op, n, p, np.array([b]), link, h)[0])


def lp_overlapped_block_bytes(op: str, nbytes: int, p: int, link: LinkModel,
                              host_block_s: float, *,
                              min_bytes: int = DEFAULT_MIN_BLOCK_BYTES) -> int:
    """The LP block size (bytes, a multiple of 8, or the whole message) minimising
    :func:`lp_overlapped_time`.

    For broadcast the optimum is the paper's form with the host's per-block cost in place of
    the latency: ``b* = sqrt(n h / ((p - 2) beta))``, ``k* = sqrt((p - 2) n beta / h)``
    (reduce: ``beta + gamma`` for ``beta``); with ``h = 0`` it is ``min_bytes`` (as small as the
    host allows). Broadcast and reduce are minimised exactly over the two ends of every block
    count's interval (as :func:`lp_optimal_block_bytes`); allreduce over a geometric grid (8
    points per doubling, at most 512 blocks) and ``ceil(n / k)`` for ``k`` up to 16. Ties go to
    the larger block.

    Example::

        >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
        >>> lp_overlapped_block_bytes("broadcast", 4 << 20, 8, link, 124e-6) >> 10   # KiB
        64
    """
    _check_op(op)
    link = _check_link(link)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    lo = as_count(min_bytes, "min_bytes", 1)
    h = _check_host_block(host_block_s)
    if n <= lo or p == 1 or (p == 2 and op != "allreduce"):
        return n if n > 0 else 8
    return _lp_overlapped_block_bytes(op, n, p, link, h, lo)


@functools.lru_cache(maxsize=4096)
def _lp_overlapped_block_bytes(op: str, n: int, p: int, link: LinkModel, h: float,
                               lo: int) -> int:
    lo8 = _round_up8(lo)
    if op == "allreduce":  # each candidate is a replay: at most 512 blocks
        lo8 = max(lo8, _round_up8(-(-n // 512)))
        if lo8 >= n:
            return n
        ks = np.arange(1, min(n // lo8, 16) + 1)
        grid = np.r_[np.geomspace(lo8, n, max(2, int(8 * math.log2(n / lo8)) + 1)), -(-n // ks)]
        cands = np.unique(np.maximum(lo8, _round_up8(grid.astype(np.int64))))
    else:
        ks = np.arange(1, -(-n // lo8) + 1, dtype=np.int64)
        small = np.maximum(_round_up8(-(-n // ks)), lo8)
        large = np.where(ks > 1, ((n - 1) // np.maximum(ks - 1, 1) // 8) * 8, n)
        cands = np.unique(np.r_[small, large[large >= lo8]])
    cands = np.r_[cands[(cands >= lo8) & (cands < n)], n][::-1]  # descending: ties go large
    times = _lp_overlapped_vec(op, n, p, cands, link, h)
    return int(cands[int(np.argmin(times))])


def overlapped_time(op: str, algorithm: str, nbytes: int, p: int, link: LinkModel,
                    block_bytes: int | None = None, *, host_block_s: float = 0.0) -> float:
    """Predicted time of a collective as pipecomm's progress engine runs it: LP by the
    overlapped model (:func:`lp_overlapped_time`; ``block_bytes=None``: the block LP uses by
    default, :func:`lp_optimal_block_bytes`), MST, BE and ring by :func:`collective_time`
    (their steps wait for whole messages, so the lock-step model is theirs).

    Example::

        >>> link = LinkModel.from_bandwidth(2e-3, 50e6)
        >>> round(overlapped_time("broadcast", "mst", 1 << 20, 8, link), 4)
        0.0689
    """
    _check_op(op)
    _check_algorithm(algorithm)
    if algorithm != "lp":
        return collective_time(op, algorithm, nbytes, p, link, block_bytes)
    if block_bytes is None:
        n = as_count(nbytes, "nbytes", 0)
        block_bytes = lp_optimal_block_bytes(op, n, as_count(p, "p", 1), _check_link(link)) \
            if n > 0 else 8
    return lp_overlapped_time(op, nbytes, p, link, block_bytes, host_block_s)


# --------------------------------------------------------------------------------------------
# Links from the emulated network and from calibration
# --------------------------------------------------------------------------------------------


def calibrated_link(path: str | os.PathLike | None = None) -> LinkModel:
    """The backend's link as fitted by experiment E0, or documented fallbacks.

    Looks for a JSON file with keys ``alpha_s``, ``beta_s_per_byte``, ``gamma_s_per_byte`` (and
    optionally ``ports``) at ``path``, else at the path in the environment variable
    ``PIPECOMM_CALIBRATION``. Without either it returns *fallback* values measured once for gloo
    over loopback on a 2-core development machine -- ``alpha = 160 us``, 2.5 GB/s
    (``beta = 4e-10 s/B``), ``gamma = 5e-11 s/B`` (a reduction at about 20 GB/s) -- which are
    only indicative: run E0 on the machine at hand for real numbers.

    Example::

        >>> calibrated_link().alpha      # no calibration file: the fallback
        0.00016
    """
    if path is None:
        path = os.environ.get(_CALIBRATION_ENV) or None
    if path is None:
        return LinkModel(
            alpha=DEFAULT_ALPHA_S,
            beta=1.0 / DEFAULT_BANDWIDTH_BPS,
            gamma=DEFAULT_GAMMA_S_PER_BYTE,
        )
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read the calibration file {os.fspath(path)!r}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {os.fspath(path)!r} is not JSON: {exc}") from exc
    missing = [k for k in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte") if k not in data]
    if not isinstance(data, dict) or missing:
        raise ValueError(
            f"calibration file {os.fspath(path)!r} lacks keys {missing}; expected alpha_s, "
            "beta_s_per_byte, gamma_s_per_byte (as written by experiment E0)"
        )
    return LinkModel(
        alpha=data["alpha_s"],
        beta=data["beta_s_per_byte"],
        gamma=data["gamma_s_per_byte"],
        ports=data.get("ports", "single"),
    )


def link_from_network(network: Any, level: str = "intra", gamma: float | None = None) -> LinkModel:
    """The :class:`LinkModel` of an emulated ``netem.Network``.

    ``level="intra"`` (default; also the only level of a one-level network): ``alpha_s``,
    ``1 / bandwidth_Bps`` and the network's port model. ``level="inter"``: what an uncontended
    message between nodes costs in netem -- ``inter_alpha_s`` and
    ``1 / min(bandwidth_Bps, inter_bandwidth_Bps)`` (hops are cut-through), each defaulting to
    the intra value when unset -- with ``ports="single"`` (one uplink/downlink per node, shared
    FIFO by its ranks: the per-rank link is only this fast when one rank per node talks).
    ``gamma`` defaults to :func:`calibrated_link`'s (reductions run on the real CPU).

    Example::

        >>> from types import SimpleNamespace
        >>> net = SimpleNamespace(alpha_s=1e-3, bandwidth_Bps=400e6, ports="single",
        ...                       ranks_per_node=None, inter_alpha_s=None, inter_bandwidth_Bps=None)
        >>> link_from_network(net, gamma=0.0)
        LinkModel(alpha=0.001, beta=2.5e-09, gamma=0.0, ports='single')
    """
    if level not in ("intra", "inter"):
        raise ValueError(f"level must be 'intra' or 'inter', got {level!r}")
    for attr in ("alpha_s", "bandwidth_Bps", "ports"):
        if not hasattr(network, attr):
            raise TypeError(
                f"network must have attribute {attr!r} (a pipecomm.netem.Network), "
                f"got {type(network).__name__}"
            )
    if gamma is None:
        gamma = calibrated_link().gamma
    if level == "intra":
        return LinkModel.from_bandwidth(
            network.alpha_s, network.bandwidth_Bps, gamma=gamma, ports=network.ports
        )
    ia = getattr(network, "inter_alpha_s", None)
    ib = getattr(network, "inter_bandwidth_Bps", None)
    ia = network.alpha_s if ia is None else ia
    ib = network.bandwidth_Bps if ib is None else min(ib, network.bandwidth_Bps)
    return LinkModel.from_bandwidth(ia, ib, gamma=gamma, ports="single")


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------


def _nonneg_lstsq(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Minimise ``sum (w (c0 + c1 x - t))^2`` over ``c0, c1 >= 0`` (2-variable active sets)."""
    a = np.stack([w, w * x], axis=1)
    y = w * t
    best: tuple[float, float] | None = None
    best_res = math.inf
    candidates = []
    sol, *_ = np.linalg.lstsq(a, y, rcond=None)
    candidates.append((float(sol[0]), float(sol[1])))
    c0 = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0]))
    candidates.append((c0, 0.0))
    denom = float(a[:, 1] @ a[:, 1])
    candidates.append((0.0, float(a[:, 1] @ y / denom) if denom > 0 else 0.0))
    candidates.append((0.0, 0.0))
    for c0, c1 in candidates:
        if c0 < 0 or c1 < 0:
            continue
        res = float(np.sum((a @ np.array([c0, c1]) - y) ** 2))
        if res < best_res:
            best, best_res = (c0, c1), res
    assert best is not None
    return best


def _fit_inputs(nbytes: Any, times_s: Any, min_bytes: Any, relative: bool):
    x = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(times_s, dtype=float).ravel()
    if x.shape != t.shape:
        raise ValueError(f"nbytes and times_s must have the same length, got {x.size} and {t.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ValueError("nbytes and times_s must be finite")
    if np.any(x < 0) or np.any(t < 0):
        raise ValueError("nbytes and times_s must be >= 0")
    keep = x >= float(min_bytes)
    x, t = x[keep], t[keep]
    if np.unique(x).size < 2:
        raise ValueError(
            f"need measurements at >= 2 distinct sizes >= min_bytes={min_bytes}, "
            f"got {np.unique(x).size}"
        )
    if relative and np.any(t <= 0):
        raise ValueError("relative=True needs times_s > 0 (it divides by the measured time)")
    w = 1.0 / t if relative else np.ones_like(t)
    return x, t, w


def fit_alpha_beta(
    nbytes: Any, times_s: Any, *, min_bytes: int = 0, relative: bool = True
) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of ``time = alpha + beta * nbytes``, both ``>= 0``.

    ``relative=True`` minimises the relative error ``sum ((alpha + beta n - t) / t)^2``, so sizes
    from a few bytes to many MiB all count (an absolute fit is dominated by the largest sizes).
    Points with ``nbytes < min_bytes`` are dropped. Non-negativity is enforced exactly (the best
    of the unconstrained fit and the fits with one coefficient pinned at zero).

    Example::

        >>> n = [8, 1024, 2**20, 2**24]
        >>> a, b = fit_alpha_beta(n, [1e-4 + x * 1e-9 for x in n])
        >>> round(a * 1e6, 3), round(1 / b / 1e9, 3)      # 100 us, 1 GB/s
        (100.0, 1.0)
    """
    x, t, w = _fit_inputs(nbytes, times_s, min_bytes, relative)
    return _nonneg_lstsq(x, t, w)


def fit_gamma(nbytes: Any, times_s: Any, *, min_bytes: int = 0, relative: bool = True) -> float:
    """Reduction cost ``gamma`` (s/byte): slope of ``time = c + gamma * nbytes``, ``>= 0``.

    ``times_s`` are timings of a local reduction (``a += b``) of ``nbytes``; the fixed overhead
    ``c`` is fitted and discarded. Same weighting as :func:`fit_alpha_beta`.

    Example::

        >>> n = [1024, 2**16, 2**20, 2**24]
        >>> round(fit_gamma(n, [5e-6 + x * 2e-10 for x in n]) * 1e10, 6)
        2.0
    """
    x, t, w = _fit_inputs(nbytes, times_s, min_bytes, relative)
    return _nonneg_lstsq(x, t, w)[1]


# --------------------------------------------------------------------------------------------
# Tables for notebooks
# --------------------------------------------------------------------------------------------


def model_table(
    ops: Iterable[str],
    algorithms: Iterable[str],
    sizes: Iterable[int],
    ps: Iterable[int],
    link: LinkModel,
    ports: Iterable[str] | str | None = None,
    block_bytes: int | None = None,
) -> Any:
    """Tidy table of model times over every combination (notebook E1).

    Columns ``op, algorithm, nbytes, p, ports, time_s, block_bytes``; ``block_bytes`` is the LP
    block used (``lp_optimal_block_bytes`` unless ``block_bytes`` is given; capped at the message)
    and ``<NA>`` for the other algorithms. ``ports`` is one port model or several (default: the
    link's); each overrides ``link.ports``.

    Example::

        >>> link = LinkModel(alpha=10e-6, beta=1e-10)
        >>> df = model_table(["broadcast"], ["lp", "mst"], [2**20], [2, 64], link)
        >>> list(df.columns)
        ['op', 'algorithm', 'nbytes', 'p', 'ports', 'time_s', 'block_bytes']
        >>> len(df)
        4
    """
    import pandas as pd

    link = _check_link(link)
    if ports is None:
        ports = [link.ports]
    elif isinstance(ports, str):
        ports = [ports]
    ops, algorithms, sizes, ps, ports = (list(v) for v in (ops, algorithms, sizes, ps, ports))
    for op in ops:
        _check_op(op)
    for alg in algorithms:
        _check_algorithm(alg)
    rows = []
    for port in ports:
        lk = link.with_ports(port)
        for op in ops:
            for alg in algorithms:
                for p in ps:
                    for n in sizes:
                        n_ = as_count(n, "sizes", 0)
                        p_ = as_count(p, "ps", 1)
                        b = None
                        if alg == "lp":
                            b = (
                                lp_optimal_block_bytes(op, n_, p_, lk)
                                if block_bytes is None
                                else min(as_count(block_bytes, "block_bytes", 1), max(n_, 1))
                            )
                        t = collective_time(op, alg, n_, p_, lk, b)
                        rows.append((op, alg, n_, p_, port, t, b))
    df = pd.DataFrame(
        rows, columns=["op", "algorithm", "nbytes", "p", "ports", "time_s", "block_bytes"]
    )
    df["block_bytes"] = df["block_bytes"].astype("Int64")
    return df


# --------------------------------------------------------------------------------------------
# Real backend on one host: a per-size link and a shared-bandwidth term
# --------------------------------------------------------------------------------------------

#: Fallback per-size link (one message between two ranks, gloo over loopback on a 2-core
#: development machine, experiment E0's ping-pong of the reference run): sizes in bytes and
#: one-way seconds. Its bandwidth rises about 4x from 1 MiB to 64 MiB, which a straight
#: alpha-beta line cannot follow.
DEFAULT_LINK_TABLE: tuple[tuple[int, float], ...] = (
    (65536, 2.54e-4),
    (262144, 3.04e-4),
    (1048576, 7.17e-4),
    (4194304, 2.456e-3),
    (16777216, 7.388e-3),
    (67108864, 1.936e-2),
)
#: Assumed CPU time one rank spends per message in pipecomm's progress engine (posting it, being
#: woken when it completes, bookkeeping), at each end of a message, beyond what E0's table and
#: host rate contain; the ranks' overheads share the host's cores. An estimate, not a
#: calibration: the slope of LP's time over its block count at p = 4 and 8 in the block sweep of
#: ``benchmarks/bench_collectives.py --lp-blocks`` (artifact/reference/bench/lp_blocks_cpu.csv,
#: a 2-core development machine).
DEFAULT_MESSAGE_OVERHEAD_S = 5e-5
#: Assumed time one message adds to LP's critical path beyond its lone one-way time, at each end
#: (the engine woken by an arrival, combining, posting the next send, with other ranks' threads
#: between): longer than the CPU it takes, which other ranks' work can fill. An estimate, not a
#: calibration: the excess of LP allreduce's time per step at p = 2 over the lone-link table in
#: the block sweeps of ``benchmarks/bench_collectives.py --lp-blocks`` (2-core development
#: machine).
DEFAULT_MESSAGE_LATENCY_S = 1.5e-4


def _default_host_links() -> float:
    return float(os.cpu_count() or 1)


@dataclass(frozen=True)
class HostLink:
    """The real backend's link between two ranks of one host, by message size, plus the host.

    ``table``: ``((nbytes, seconds), ...)`` one-way times of single messages between two
    otherwise idle ranks, sizes increasing (E0's per-size calibration); :meth:`time`
    interpolates linearly between points and extends the last segment's slope beyond the
    largest size. ``host_links``: the host's aggregate rate when many ranks stream messages at
    once, in units of :attr:`rate_Bps` (one lone link's rate at the table's largest size): the
    ranks share the host's cores and memory system. E0's host section measures it (a chain of
    all its ranks streaming at once); the default is the number of CPU cores (an upper guess:
    one loopback transfer keeps both the sender's and the receiver's core busy). ``gamma``:
    seconds per byte reduced.
    ``message_overhead_s``: CPU seconds a rank spends per message of its own (posting, waking);
    ``cores`` share it and the reductions among the ranks (default: the number of CPU cores).
    ``message_latency_s``: what one message adds to the critical path at each end beyond its
    lone one-way time (a wake-up, the next send's posting).
    ``host_links_measured``: whether ``host_links`` came from E0's host section (a model on the
    default says little about this host; E2's claim C2.7 is not decided on it).

    Example::

        >>> link = HostLink(((1024, 1e-4), (1 << 20, 1e-3)), host_links=2.0)
        >>> round(link.time(1 << 19) * 1e3, 3)
        0.55
    """

    table: tuple[tuple[int, float], ...]
    host_links: float = dataclasses.field(default_factory=_default_host_links)
    gamma: float = DEFAULT_GAMMA_S_PER_BYTE
    message_overhead_s: float = DEFAULT_MESSAGE_OVERHEAD_S
    message_latency_s: float = DEFAULT_MESSAGE_LATENCY_S
    cores: float = dataclasses.field(default_factory=_default_host_links)
    host_links_measured: bool = False

    def __post_init__(self) -> None:
        table = tuple((int(n), float(t)) for n, t in self.table)
        if len(table) < 2:
            raise ValueError(f"table needs at least two (nbytes, seconds) points, got {table!r}")
        sizes = [n for n, _ in table]
        if sizes != sorted(set(sizes)) or sizes[0] <= 0:
            raise ValueError(f"table sizes must be positive and increasing, got {sizes}")
        if any(not (math.isfinite(t) and t > 0) for _, t in table):
            raise ValueError("table times must be finite and > 0 seconds")
        if not (self.host_links > 0 and self.gamma >= 0):
            raise ValueError(
                f"host_links must be > 0 and gamma >= 0, got {self.host_links!r}, {self.gamma!r}"
            )
        if not (self.message_overhead_s >= 0 and self.message_latency_s >= 0 and self.cores > 0):
            raise ValueError(
                f"message_overhead_s and message_latency_s must be >= 0 and cores > 0, got "
                f"{self.message_overhead_s!r}, {self.message_latency_s!r}, {self.cores!r}"
            )
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "host_links", float(self.host_links))

    @property
    def rate_Bps(self) -> float:
        """One lone link's rate at the table's largest size (bytes per second): where a
        stream of messages, each posted ahead of its predecessor's arrival, leaves a message's
        latency behind the next one's bytes."""
        n, t = self.table[-1]
        return n / t

    def time(self, nbytes: float | np.ndarray) -> np.ndarray | float:
        """One-way time of a message of ``nbytes`` between two otherwise idle ranks."""
        sizes = np.array([n for n, _ in self.table], dtype=float)
        times = np.array([t for _, t in self.table])
        x = np.asarray(nbytes, dtype=float)
        out = np.interp(x, sizes, times)
        slope = (times[-1] - times[-2]) / (sizes[-1] - sizes[-2])
        out = np.where(x > sizes[-1], times[-1] + slope * (x - sizes[-1]), out)
        return float(out) if np.ndim(out) == 0 else out


def host_link(path: str | os.PathLike | None = None) -> HostLink:
    """The real backend's :class:`HostLink`: E0's per-size table, or documented fallbacks.

    ``path`` (else the environment variable ``PIPECOMM_CALIBRATION``) names E0's
    ``calibration.json``; its ``gamma_s_per_byte``, its per-size table (``link_table``
    ``{"nbytes": [...], "time_s": [...]}``, else E0's record ``per_size``, sizes >= 64 KiB) and
    ``host_links`` (E0's host section) are used. Without a table there, the per-size table is
    read from E0's ``data.csv`` (or ``data.csv.gz``) next to it (rows of section ``real``, pair
    ``0-1``; median per size, sizes >= 64 KiB). What is missing falls back to
    :data:`DEFAULT_LINK_TABLE` and the number of CPU cores.

    Example::

        >>> host_link().table[0]       # no calibration file: the fallback table
        (65536, 0.000254)
    """
    if path is None:
        path = os.environ.get(_CALIBRATION_ENV) or None
    if path is None:
        return HostLink(DEFAULT_LINK_TABLE)
    gamma = calibrated_link(path).gamma
    with open(path, encoding="utf-8") as fh:
        data = json.load(fh)
    table = None
    if isinstance(data.get("link_table"), dict):
        t = data["link_table"]
        table = tuple(zip(t["nbytes"], t["time_s"]))
    elif isinstance(data.get("per_size"), dict):  # E0's calibration record
        t = data["per_size"]
        table = tuple((int(n), float(s)) for n, s in zip(t["nbytes"], t["one_way_s"])
                      if n >= 65536)
        table = table if len(table) >= 2 else None
    else:
        table = _table_from_e0_csv(os.path.dirname(os.fspath(path)))
    return HostLink(
        table or DEFAULT_LINK_TABLE,
        host_links=float(data.get("host_links", _default_host_links())),
        host_links_measured="host_links" in data,
        gamma=gamma,
        message_overhead_s=float(data.get("message_overhead_s", DEFAULT_MESSAGE_OVERHEAD_S)),
        message_latency_s=float(data.get("message_latency_s", DEFAULT_MESSAGE_LATENCY_S)),
    )


def _table_from_e0_csv(folder: str) -> tuple[tuple[int, float], ...] | None:
    import pandas as pd

    for name in ("data.csv", "data.csv.gz"):
        csv_path = os.path.join(folder, name)
        if os.path.exists(csv_path):
            df = pd.read_csv(csv_path)
            real = df[(df["section"] == "real") & (df["pair"].astype(str) == "0-1")]
            real = real[real["nbytes"] >= 65536]
            med = real.groupby("nbytes")["time_s"].median().sort_index()
            if len(med) >= 2:
                return tuple((int(n), float(t)) for n, t in med.items())
    return None


def lp_time_on_host(op: str, nbytes: int, p: int, link: HostLink, block_bytes: int) -> float:
    """Predicted LP time on the real backend, all ``p`` ranks on one host.

    LP's schedule (Wang et al., arXiv 1611.04255) of ``S`` steps (``k + p - 2``, or
    ``k + 2p - 3`` for allreduce, ``k = ceil(n / b)``) on the progress engine, every step taking
    the longer of two times (``docs/algorithms.md``, "The real backend on one host"):

    * one block over a lone link (``link.time(b)``), plus its combine (``gamma b``,
      reductions) and a rank's two messages' latency (``2 message_latency_s``): the critical
      path, which pipeline fill and drain expose;
    * the step's share of the host: its ``a_s`` messages (the blocks on the chain at step ``s``,
      on both chains for allreduce) move their bytes at the host's aggregate rate
      (``host_links`` lone links' :attr:`HostLink.rate_Bps`, at most ``a_s`` of them), and
      their overheads (one at each end) and combines share the ``cores``. A message's latency
      is not part of that share: the engine posts receives ahead, so it hides behind the bytes
      of the messages before it.

    With many blocks the pipeline is full and the time is the host's work, ``(p - 1) n`` bytes
    (twice that for allreduce) at its aggregate rate; with few, the fill and drain steps of one
    or two large blocks on a lone link add to it.

    Example::

        >>> link = HostLink(DEFAULT_LINK_TABLE, host_links=2.0, message_overhead_s=0.0,
        ...                 message_latency_s=0.0)
        >>> round(lp_time_on_host("broadcast", 1 << 26, 8, link, 1 << 21), 3)
        0.072
    """
    _check_op(op)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    if not isinstance(link, HostLink):
        raise TypeError(f"link must be a HostLink, got {type(link).__name__}")
    b = min(as_count(block_bytes, "block_bytes", 1), max(n, 1))
    if n == 0 or p == 1:
        return 0.0
    return float(_lp_host_vec(op, n, p, link, np.array([b]))[0])


def _lp_host_vec(op: str, n: int, p: int, link: HostLink, b: np.ndarray) -> np.ndarray:
    b = np.minimum(b.astype(float), n)
    reduces = op != "broadcast"
    lone = link.time(b) + reduces * link.gamma * b + 2 * link.message_latency_s  # one table pass
    return np.array([_lp_host_steps(op, n, p, link, x, t) for x, t in zip(b, lone)])


def _lp_host_steps(op: str, n: int, p: int, link: HostLink, b: float, lone: float) -> float:
    """Sum over LP's steps of the longer of ``lone`` (a block on a lone link) and the step's
    share of the host, for blocks of ``b`` bytes."""
    k = math.ceil(n / b)
    steps = np.arange(1, k + (2 * p - 3 if op == "allreduce" else p - 2) + 1)

    def on_chain(s: np.ndarray) -> np.ndarray:  # blocks j with link s - j in 1..p-1
        return np.clip(np.minimum(s, p - 1) - np.maximum(1, s - k + 1) + 1, 0, None)

    first = on_chain(steps)  # the reduce chain, or the broadcast's
    messages = first + (on_chain(steps - (p - 1)) if op == "allreduce" else 0)
    combined = first if op != "broadcast" else 0
    shared = messages * b / (np.minimum(link.host_links, messages) * link.rate_Bps) + (
        2 * messages * link.message_overhead_s + combined * link.gamma * b
    ) / link.cores
    return float(np.maximum(lone, shared).sum())


def lp_block_bytes_on_host(
    op: str, nbytes: int, p: int, link: HostLink, *, min_bytes: int = 65536
) -> int:
    """The LP block size (bytes, a multiple of 8, or the whole message) minimising
    :func:`lp_time_on_host`.

    Candidates: a geometric grid (8 points per doubling) from ``min_bytes`` to the message, the
    table's sizes (its kinks) and ``ceil(n / k)`` for ``k`` up to 64 blocks.

    Example::

        >>> lp_block_bytes_on_host("broadcast", 1 << 26, 8, host_link()) >= 1 << 20
        True
    """
    _check_op(op)
    n = as_count(nbytes, "nbytes", 0)
    p = as_count(p, "p", 1)
    if n <= min_bytes or p <= 2 and op != "allreduce":
        return n if n > 0 else 8
    return _lp_block_bytes_on_host(op, n, p, link, int(min_bytes))


@functools.lru_cache(maxsize=4096)
def _lp_block_bytes_on_host(op: str, n: int, p: int, link: HostLink, lo: int) -> int:
    ks = np.arange(1, min(n // lo, 64) + 1)
    grid = np.r_[
        np.geomspace(lo, n, max(2, int(8 * math.log2(n / lo)) + 1)),
        [size for size, _ in link.table],
        -(-n // ks),
    ]
    cands = np.unique(np.maximum(8, _round_up8(grid.astype(np.int64))))
    cands = np.r_[cands[(cands >= lo) & (cands < n)], n][::-1]
    return int(cands[int(np.argmin(_lp_host_vec(op, n, p, link, cands)))])
