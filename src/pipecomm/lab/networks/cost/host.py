"""The real backend on one host: :class:`HostLink` (E0's per-size link table plus the host's
shared bandwidth and per-message overheads), :func:`host_link` to read it, and LP's time and best
block on it (docs/algorithms.md, "The real backend on one host").

Example::

    >>> host_link().table[0]       # no calibration file: the fallback table
    (65536, 0.000254)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

import numpy as np

from pipecomm.lab.networks.cost.calibration import calibrated_link
from pipecomm.lab.networks.cost.link import (
    _CALIBRATION_ENV,
    DEFAULT_GAMMA_S_PER_BYTE,
    _check_op,
    _round_up8,
    as_count,
)

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
