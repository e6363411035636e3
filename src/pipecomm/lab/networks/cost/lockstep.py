"""The paper's alpha-beta-gamma models of every schedule, lock-step: LP's closed forms and
optimal block (:func:`lp_analytic_block_bytes`, :func:`lp_optimal_block_bytes`), and
:func:`broadcast_time`, :func:`reduce_time`, :func:`allreduce_time`, :func:`collective_time` for
LP, MST, BE and ring on a :class:`~pipecomm.lab.networks.cost.link.LinkModel`.

The formulas are those of the schedules pipecomm implements (``docs/algorithms.md``), which follow

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

    >>> link = LinkModel(alpha=10e-6, beta=1 / 10e9)
    >>> round(broadcast_time("mst", 2**28, 64, link), 4)     # 6 rounds of the whole message
    0.1611
"""

from __future__ import annotations

import functools
import math

import numpy as np

from pipecomm.lab.networks.cost.link import (
    DEFAULT_MIN_BLOCK_BYTES,
    LinkModel,
    _ceil_log2,
    _check_algorithm,
    _check_block,
    _check_compression,
    _check_link,
    _check_op,
    _round_up8,
    as_count,
)

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
