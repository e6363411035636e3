"""Emulated network: per-link latency and bandwidth, port contention, intra- vs inter-node links.

The link model is the alpha-beta (Hockney) model with a port discipline, as used by the collective
analyses of the LP paper (Wang et al., arXiv 1611.04255: a message of n bytes costs
``alpha + n * beta``, one port per rank) and of Thakur, Rabenseifner and Gropp (2005), extended
with the two-level network of the DAdam paper's runtime model (Wang et al., ICLR 2025: fast
intra-node links, one shared inter-node link per node).

A message of ``n`` bytes posted at time ``t`` is *delivered* at a deadline computed by the sender
when it posts (:class:`LinkSchedule`), and never before the real transfer has happened: the
emulated delay is a deadline, not an addition to the real cost. Waiting sleeps; it never spins.

* ``ports="single"``: each rank has one outgoing and one incoming port (full duplex). A port
  carries one message at a time for ``n / bandwidth`` seconds; messages queue (earliest-fit, in
  the order of their arrival at the port). ``alpha`` is in-flight latency and does not occupy a
  port: two back-to-back messages arrive at ``alpha + n/B`` and ``alpha + 2 n/B``.
* ``ports="per-neighbor"``: every ordered pair of ranks has its own link.
* Two levels (``ranks_per_node`` set, from the network or from the launcher): a message between
  nodes also passes through its node's one uplink and the other node's one downlink (shared by
  all ranks of a node), with ``inter_alpha_s`` / ``inter_bandwidth_Bps``. An uncontended
  inter-node message costs ``inter_alpha + n / min(bandwidth, inter_bandwidth)``.

Every hop a message takes is a *port* busy for exactly ``n / (its bandwidth)`` seconds. Hops are
chained cut-through (:meth:`LinkSchedule.post`): a hop starts no earlier than the first byte
reaches it and no earlier than it can run at full rate without finishing before the last byte
arrives; among the free intervals of its port it takes the earliest that fits (committed
reservations never move, so a deadline shipped with a message stays valid). The port table lives in shared memory and is
guarded by one cross-process lock; it is single-host only (all ranks read CLOCK_MONOTONIC).

Per-rank virtual clock. A rank posts at its *emulated* time, ``CLOCK_MONOTONIC`` minus the
lateness it has been forgiven: when a wait for a deadline ``D`` (:func:`wait_until`) wakes at
``W > D`` because the host scheduled the process late, the rank's emulated time at the wake is
``D`` and its lag becomes ``W - D``; the next message it posts is stamped ``now - lag``. So the
host's wake-up lateness never accumulates along a lock-step chain (rank 1 answers rank 0 at the
emulated time it received, not when it was scheduled); the real time of the rank's own work
between waits still counts in full, and a wait that needs no sleep only shrinks the lag. Lag is
per process (all threads of a rank), at most ``MAX_LAG_S``; :func:`clock` reads the emulated
time, so ``clock() - start`` of a measurement carries no oversleep at all. What the virtual clock
cannot forgive is a real transfer slower than its deadline: :func:`check_host` probes that the
host delivers the configured step at that p and refuses, naming the link parameter to relax.

Use: ``launch.Ranks(4, network=Network(2e-3, 50e6))`` — the launcher calls :func:`setup`,
:func:`activate` and :func:`teardown`; :func:`pipecomm.collectives.p2p.exchange` applies the
deadlines (it reserves with ``emulator().post`` and waits with :func:`wait_until`). Only pipecomm's own point-to-point transfers are emulated; backend built-ins are not.

Example::

    from pipecomm import launch, netem
    net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6, ports="single")
    with launch.Ranks(4, network=net) as ranks:
        ranks.run(mymodule.measure)          # in a rank: netem.current() == net
"""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "MAX_LAG_S",
    "HostCheck",
    "HostTooSlow",
    "Hop",
    "LinkSchedule",
    "Network",
    "activate",
    "check_host",
    "clock",
    "current",
    "deactivate",
    "emulator",
    "record",
    "reset_stats",
    "setup",
    "stats",
    "teardown",
    "wait_until",
]

PORTS = ("single", "per-neighbor")
_LOCK_TIMEOUT_S = 60.0
SKIP_CHECK_ENV = "PIPECOMM_SKIP_HOST_CHECK"  # set: no host probe (tests)
MAX_LAG_S = 0.02  # most lateness a rank is forgiven; the port table keeps this much past


# --------------------------------------------------------------------------- the network


def _check_number(name: str, value: Any, *, positive: bool, allow_inf: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    value = float(value)
    if math.isnan(value) or (math.isinf(value) and not allow_inf):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if not positive and value < 0:
        raise ValueError(f"{name} must be >= 0 (seconds), got {value!r}")
    return value


def _fmt_ms(seconds: float) -> str:
    text = f"{seconds * 1e3:.3g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return f"{text} ms"


def _fmt_bw(bps: float) -> str:
    if math.isinf(bps):
        return "inf B/s"
    if bps >= 1e9:
        return f"{bps / 1e9:.4g} GB/s"
    return f"{bps / 1e6:.4g} MB/s"


@dataclass(frozen=True)
class Network:
    """An emulated network (alpha-beta links with a port model, optionally two levels).

    Args:
        alpha_s: latency of a link in seconds (in flight, does not occupy a port).
        bandwidth_Bps: bandwidth of a link in bytes per second (``math.inf`` allowed).
        ports: ``"single"`` (one full-duplex port per rank) or ``"per-neighbor"`` (one link per
            ordered pair of ranks).
        ranks_per_node: ranks per emulated node; ``None`` takes the launcher's value
            (``launch.Ranks(..., ranks_per_node=...)``); no value at all means one flat level.
        inter_alpha_s: latency between nodes (default ``alpha_s``).
        inter_bandwidth_Bps: bandwidth of a node's uplink/downlink (default ``bandwidth_Bps``).

    Networks are immutable, hashable, picklable and compare by value.

    Example::

        net = Network(1e-3, 400e6, ports="single", inter_alpha_s=2e-3, inter_bandwidth_Bps=50e6)
        net.describe(ranks_per_node=2)
        # 'emulated, single-port, 1.0 ms / 400 MB/s, inter-node 2.0 ms / 50 MB/s, 2 ranks/node'
    """

    alpha_s: float
    bandwidth_Bps: float
    ports: str = "single"
    ranks_per_node: int | None = None
    inter_alpha_s: float | None = None
    inter_bandwidth_Bps: float | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(
            self, "alpha_s", _check_number("alpha_s", self.alpha_s, positive=False, allow_inf=False)
        )
        set_(
            self,
            "bandwidth_Bps",
            _check_number("bandwidth_Bps", self.bandwidth_Bps, positive=True, allow_inf=True),
        )
        if self.ports not in PORTS:
            raise ValueError(f"ports must be one of {PORTS}, got {self.ports!r}")
        rpn = self.ranks_per_node
        if rpn is not None and (isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1):
            raise ValueError(
                f"ranks_per_node must be a positive int or None (take the launcher's), got {rpn!r}"
            )
        if self.inter_alpha_s is not None:
            set_(
                self,
                "inter_alpha_s",
                _check_number("inter_alpha_s", self.inter_alpha_s, positive=False, allow_inf=False),
            )
        if self.inter_bandwidth_Bps is not None:
            set_(
                self,
                "inter_bandwidth_Bps",
                _check_number(
                    "inter_bandwidth_Bps", self.inter_bandwidth_Bps, positive=True, allow_inf=True
                ),
            )

    # -- derived values
    @property
    def inter_alpha(self) -> float:
        """Latency between nodes (``inter_alpha_s``, or ``alpha_s`` when unset)."""
        return self.alpha_s if self.inter_alpha_s is None else self.inter_alpha_s

    @property
    def inter_bandwidth(self) -> float:
        """Bandwidth of a node's uplink/downlink (``inter_bandwidth_Bps`` or ``bandwidth_Bps``)."""
        return self.bandwidth_Bps if self.inter_bandwidth_Bps is None else self.inter_bandwidth_Bps

    def transfer_time(self, nbytes: int, *, inter_node: bool = False) -> float:
        """Time of one uncontended message of ``nbytes`` (seconds).

        Intra-node (or flat): ``alpha + n / bandwidth``; between nodes:
        ``inter_alpha + n / min(bandwidth, inter_bandwidth)``.

        Example::

            Network(2e-3, 50e6).transfer_time(1 << 20)   # 0.002 + 1048576 / 50e6
        """
        if inter_node:
            return self.inter_alpha + nbytes / min(self.bandwidth_Bps, self.inter_bandwidth)
        return self.alpha_s + nbytes / self.bandwidth_Bps

    def describe(self, ranks_per_node: int | None = None) -> str:
        """Short human text for figure titles and logs.

        ``ranks_per_node`` is the launcher's value, used when the network has none.

        Example::

            Network(2e-3, 50e6, ranks_per_node=2).describe()
            # 'emulated, single-port, 2.0 ms / 50 MB/s, inter-node 2.0 ms / 50 MB/s, 2 ranks/node'
        """
        text = (
            f"emulated, {self.ports}{'-port' if self.ports == 'single' else ''}, "
            f"{_fmt_ms(self.alpha_s)} / {_fmt_bw(self.bandwidth_Bps)}"
        )
        rpn = self.ranks_per_node if self.ranks_per_node is not None else ranks_per_node
        explicit_inter = self.inter_alpha_s is not None or self.inter_bandwidth_Bps is not None
        if rpn is not None or explicit_inter:
            text += f", inter-node {_fmt_ms(self.inter_alpha)} / {_fmt_bw(self.inter_bandwidth)}"
            text += f", {rpn} ranks/node" if rpn is not None else ", ranks/node from the launcher"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the constructor arguments (JSON-friendly; ``from_dict`` inverts it).

        Example::

            Network.from_dict(net.to_dict()) == net   # True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Network:
        """Build a network from :meth:`to_dict` output (unknown keys are a ValueError).

        Example::

            Network.from_dict({"alpha_s": 2e-3, "bandwidth_Bps": 50e6, "ports": "single"})
        """
        if not isinstance(data, Mapping):
            raise ValueError(f"data must be a mapping from Network.to_dict(), got {data!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"data has unknown keys {unknown}; expected a subset of {sorted(names)}"
            )
        return cls(**data)


# --------------------------------------------------------------------------- reservation arithmetic


class Hop(NamedTuple):
    """One port a message passes: table index, busy time (s), latency to the next hop (s)."""

    port: int
    duration: float
    latency: float


class LinkSchedule:
    """Pure reservation arithmetic of the emulated network (no processes, no clocks).

    A *table* (a float64 numpy array from :meth:`new_table`, shared between processes in the
    launcher) holds the busy intervals of every port: per rank an out-port and an in-port
    (single) or a link per ordered pair (per-neighbor), and per node an uplink and a downlink
    (two levels). :meth:`post` reserves the hops of one message and returns its delivery time.

    Example::

        sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
        table = sched.new_table()
        sched.post(table, 0, 1, 1000, now=0.0)   # 0.002 (alpha + n/B)
        sched.post(table, 0, 1, 1000, now=0.0)   # 0.003 (waits one n/B for the port)
    """

    def __init__(
        self, network: Network, world_size: int, ranks_per_node: int | None = None
    ) -> None:
        if not isinstance(network, Network):
            raise ValueError(f"network must be a pipecomm.netem.Network, got {network!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        rpn = network.ranks_per_node if network.ranks_per_node is not None else ranks_per_node
        if rpn is not None and (
            isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1 or world_size % rpn
        ):
            raise ValueError(
                f"ranks_per_node={rpn!r} must be a positive int dividing world_size={world_size}"
            )
        self.network = network
        self.world_size = world_size
        self.ranks_per_node = rpn
        self.two_level = rpn is not None and rpn < world_size
        self.num_nodes = world_size // rpn if self.two_level else 1
        w = world_size
        # port indices
        if network.ports == "single":
            n_rank_ports = 2 * w
        else:
            n_rank_ports = w * w
        self._node_base = n_rank_ports
        n_ports = n_rank_ports + (2 * self.num_nodes if self.two_level else 0)
        shared_cap = 2 * w + 16  # ports several senders share
        caps = []
        for p in range(n_ports):
            caps.append(
                16 if (network.ports == "per-neighbor" and p < n_rank_ports) else shared_cap
            )
        self.num_ports = n_ports
        self._cap = caps
        self._off = [0] * n_ports
        off = 0
        for p in range(n_ports):
            self._off[p] = off
            off += 1 + 2 * caps[p]
        self.table_size = off

    # -- layout
    def new_table(self) -> np.ndarray:
        """A fresh table (all ports idle).

        Example::

            table = sched.new_table()
        """
        return np.zeros(self.table_size, dtype=np.float64)

    def node(self, rank: int) -> int:
        """Node of a global rank (0 on a flat network).

        Example::

            LinkSchedule(Network(0, 1e9, ranks_per_node=2), 4).node(3)   # 1
        """
        return rank // self.ranks_per_node if self.two_level else 0

    def route(self, src: int, dst: int, nbytes: int) -> list[Hop]:
        """The hops of a message from ``src`` to ``dst`` (global ranks) of ``nbytes`` bytes.

        Example::

            sched.route(0, 1, 1000)   # [Hop(out-port of 0, n/B, alpha), Hop(in-port of 1, n/B, 0)]
        """
        w = self.world_size
        for name, r in (("src", src), ("dst", dst)):
            if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < w:
                raise ValueError(f"{name}={r!r} must be a global rank in [0, {w})")
        if src == dst:
            return []
        net = self.network
        d = nbytes / net.bandwidth_Bps
        if not self.two_level or self.node(src) == self.node(dst):
            if net.ports == "single":
                return [Hop(src, d, net.alpha_s), Hop(w + dst, d, 0.0)]
            return [Hop(src * w + dst, d, net.alpha_s)]
        di = nbytes / net.inter_bandwidth
        up = Hop(self._node_base + self.node(src), di, net.inter_alpha)
        down = Hop(self._node_base + self.num_nodes + self.node(dst), di, 0.0)
        if net.ports == "single":
            return [Hop(src, d, 0.0), up, down, Hop(w + dst, d, 0.0)]
        return [Hop(src * w + dst, d, 0.0), up, down]

    def busy(self, table: np.ndarray, port: int) -> list[tuple[float, float]]:
        """Reserved ``(start, end)`` intervals of a port, in time order.

        Example::

            sched.busy(table, 0)   # [(0.0, 0.001), (0.001, 0.002)]
        """
        off = self._off[port]
        c = int(table[off])
        flat = table[off + 1 : off + 1 + 2 * c].tolist()
        return list(zip(flat[0::2], flat[1::2]))

    def _fit(
        self, table: np.ndarray, port: int, earliest: float, duration: float, prune_before: float
    ) -> float:
        """Reserve the earliest interval of ``duration`` starting at or after ``earliest``;
        forget intervals that ended before ``prune_before``."""
        off, cap = self._off[port], self._cap[port]
        c = int(table[off])
        flat = table[off + 1 : off + 1 + 2 * c].tolist()
        ivs = [(flat[i], flat[i + 1]) for i in range(0, 2 * c, 2) if flat[i + 1] > prune_before]
        start = earliest
        pos = len(ivs)
        for i, (s, e) in enumerate(ivs):
            if start + duration <= s:
                pos = i
                break
            if e > start:
                start = e
        if duration > 0:
            ivs.insert(pos, (start, start + duration))
        while len(ivs) > cap:  # full: give up the smallest gap (conservative, never overlaps)
            j = min(range(len(ivs) - 1), key=lambda k: ivs[k + 1][0] - ivs[k][1])
            ivs[j : j + 2] = [(ivs[j][0], ivs[j + 1][1])]
        out = [x for iv in ivs for x in iv]
        table[off] = len(ivs)
        table[off + 1 : off + 1 + len(out)] = out
        return start

    def post(
        self,
        table: np.ndarray,
        src: int,
        dst: int,
        nbytes: int,
        now: float,
        prune_before: float | None = None,
    ) -> float:
        """Reserve every hop of one message posted at ``now``; return its delivery time.

        Intervals that ended before ``prune_before`` (default ``now``) are forgotten; pass an
        earlier time when later posts may be stamped earlier than ``now`` (lagging ranks).

        Hops are cut-through. With ``e`` the end of the previous hop, ``lat`` its latency and
        ``D`` the longest hop duration so far (the stream then flows at the bottleneck rate, so
        its first byte passes at ``e + lat - D``), hop k may start at
        ``e + lat - min(duration_k, D)``: not before the first byte reaches it and not so early
        that it would finish before the last byte does. It takes the earliest free interval of
        its port from there. Delivery = end of the last hop + its latency. Uncontended, this
        is ``sum of latencies + n / (slowest bandwidth on the path)``.

        Example::

            sched.post(table, src=0, dst=1, nbytes=4096, now=time.monotonic())
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        prune = now if prune_before is None else min(now, prune_before)
        end, lat, dmax = now, 0.0, 0.0
        for hop in self.route(src, dst, nbytes):
            earliest = end + lat - min(hop.duration, dmax)
            start = self._fit(table, hop.port, earliest, hop.duration, prune)
            end, lat, dmax = start + hop.duration, hop.latency, max(dmax, hop.duration)
        return end + lat


# --------------------------------------------------------------------------- launcher contract


@dataclass
class _Handle:
    """What the parent hands to every rank: the shared table, its lock and its layout."""

    network: Network
    world_size: int
    ranks_per_node: int | None
    lock: Any
    table: Any  # multiprocessing RawArray of float64


class _Emulator:
    """The active network of this process."""

    def __init__(self, network: Network, handle: _Handle, rank: int) -> None:
        self.rank = rank
        self.schedule = LinkSchedule(network, handle.world_size, handle.ranks_per_node)
        # the network as emulated: ranks_per_node resolved from the launcher
        self.network = dataclasses.replace(network, ranks_per_node=self.schedule.ranks_per_node)
        self.table = np.frombuffer(handle.table, dtype=np.float64)
        if self.table.size != self.schedule.table_size:
            raise RuntimeError("netem: the shared port table does not match the network layout")
        self.lock = handle.lock
        self.clock = VirtualClock()

    def post(self, messages: list[tuple[int, int]]) -> list[float]:
        """Reserve ``(dst, nbytes)`` messages sent by this rank, in order, at the rank's
        emulated time (:class:`VirtualClock`); return their deadlines."""
        if not messages:
            return []
        if not self.lock.acquire(timeout=_LOCK_TIMEOUT_S):
            raise RuntimeError(
                f"netem: the shared port table stayed locked for {_LOCK_TIMEOUT_S:.0f} s; a rank "
                "probably died while holding it - restart the ranks"
            )
        try:
            wall = time.monotonic()
            now = self.clock.now(wall)
            return [
                self.schedule.post(self.table, self.rank, dst, n, now, wall - MAX_LAG_S)
                for dst, n in messages
            ]
        finally:
            self.lock.release()


class VirtualClock:
    """A rank's emulated time: ``CLOCK_MONOTONIC`` minus the wake-up lateness it is forgiven.

    :meth:`settle` is called after every wait for a deadline. With ``t0`` the time the real
    transfers were done and ``W`` the wake-up (``W = t0`` when no sleep was needed), the wait
    ends at emulated time ``E = max(deadline, t0 - lag)`` and the lag becomes ``W - E``
    (capped at ``MAX_LAG_S``): a late wake-up is forgiven, a wait without sleep only shrinks
    the lag, and the rank's own work between waits counts in full.

    Example::

        vc = VirtualClock()
        vc.settle(deadline=1.000, t0=0.990, woke=1.003)   # woke 3 ms late
        vc.now(1.004)                                    # 1.001: posts as if woken on time
    """

    def __init__(self) -> None:
        self.lag = 0.0
        self.oversleep = 0.0  # total of W - deadline over sleeps, for stats()
        self._lock = threading.Lock()

    def now(self, wall: float | None = None) -> float:
        """Emulated time at wall-clock time ``wall`` (default: now).

        Example::

            VirtualClock().now(5.0)   # 5.0 (no lag yet)
        """
        return (time.monotonic() if wall is None else wall) - self.lag

    def settle(self, deadline: float, t0: float, woke: float) -> float:
        """Account for one wait (see the class docstring); return its emulated end ``E``.

        Example::

            VirtualClock().settle(1.0, 0.5, 1.002)   # 1.0, lag 2 ms
        """
        with self._lock:
            end = max(deadline, t0 - self.lag)
            self.lag = min(max(0.0, woke - end), MAX_LAG_S)
            if woke > t0:
                self.oversleep += max(0.0, woke - deadline)
            return end


_ACTIVE: _Emulator | None = None
_STATS_LOCK = threading.Lock()
_STATS: dict[str, float] = {}


def setup(network: Network, world_size: int, ranks_per_node: int | None) -> _Handle:
    """Create the shared port table of ``network`` (in the parent, before ranks start).

    The handle is passed to each rank as a ``multiprocessing`` process argument (launch's
    forkserver or spawn start method).

    Example::

        handle = netem.setup(net, 4, None)     # launch.Ranks does this
    """
    if not isinstance(network, Network):
        raise ValueError(f"network must be a pipecomm.netem.Network, got {network!r}")
    sched = LinkSchedule(network, world_size, ranks_per_node)
    ctx = mp.get_context("spawn")
    return _Handle(
        network=network,
        world_size=world_size,
        ranks_per_node=sched.ranks_per_node,
        lock=ctx.Lock(),
        table=ctx.RawArray("d", sched.table_size),
    )


def activate(
    network: Network, handle: _Handle, *, rank: int, world_size: int, ranks_per_node: int | None
) -> None:
    """Make ``network`` this rank's network (in each rank, after ``init_process_group``).

    Example::

        netem.activate(net, handle, rank=0, world_size=4, ranks_per_node=None)  # launch does it
    """
    global _ACTIVE
    if not isinstance(network, Network):
        raise ValueError(f"network must be a pipecomm.netem.Network, got {network!r}")
    if not isinstance(handle, _Handle) or handle.network != network:
        raise ValueError("handle must come from netem.setup() with the same network")
    if handle.world_size != world_size:
        raise ValueError(f"world_size={world_size} differs from the handle's {handle.world_size}")
    expected_rpn = network.ranks_per_node if network.ranks_per_node is not None else ranks_per_node
    if expected_rpn != handle.ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} differs from the one given to netem.setup() "
            f"({handle.ranks_per_node!r})"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, {world_size})")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        raise ValueError(
            "the emulated network is refused with NCCL (it emulates CPU links only); use "
            "backend='gloo' or network=None"
        )
    _ACTIVE = _Emulator(network, handle, rank)
    reset_stats()


def deactivate() -> None:
    """Stop emulating in this process (transfers use the real backend again).

    Example::

        netem.deactivate(); assert netem.current() is None
    """
    global _ACTIVE
    _ACTIVE = None


def teardown(handle: _Handle) -> None:
    """Release what :func:`setup` created (in the parent, when the ranks have stopped).

    Example::

        netem.teardown(handle)
    """
    if isinstance(handle, _Handle):
        handle.table = None
        handle.lock = None


def current() -> Network | None:
    """The network emulated in this rank, or ``None`` on the real backend.

    Its ``ranks_per_node`` is the one in force (the network's own, else the launcher's), so
    ``current().describe()`` and ``current().to_dict()`` are complete.

    Example::

        net = netem.current()
        title = net.describe() if net else "real backend"
    """
    return _ACTIVE.network if _ACTIVE is not None else None


def emulator() -> _Emulator | None:
    """This rank's active emulator (what :mod:`pipecomm.collectives.p2p` posts through), or
    ``None`` when nothing is emulated.

    Example::

        if netem.emulator() is None: ...   # the real backend
    """
    return _ACTIVE


def clock() -> float:
    """This rank's emulated time (seconds, ``CLOCK_MONOTONIC`` base): the monotonic clock minus
    the wake-up lateness forgiven so far (see the module docstring); ``time.monotonic()`` when
    nothing is emulated. Time an emulated measurement with it to exclude the host's oversleep.

    Example::

        start = netem.clock(); collectives.allreduce(t, algorithm="ring")
        elapsed = netem.clock() - start
    """
    emu = _ACTIVE
    return time.monotonic() if emu is None else emu.clock.now()


def wait_until(deadline: float) -> float:
    """Sleep (never spin) until ``deadline`` (``CLOCK_MONOTONIC`` seconds); return the time slept.

    Call it once the real transfers of a message are done, with the message's deadline: under
    emulation it also settles the rank's virtual clock (a late wake-up is forgiven for the
    rank's next posts, :class:`VirtualClock`). Without emulation it is a plain sleep.

    Example::

        for work in works: work.wait()
        waited = netem.wait_until(max(deadlines))
    """
    start = time.monotonic()
    now = start
    while now < deadline:
        time.sleep(deadline - now)
        now = time.monotonic()
    emu = _ACTIVE
    if emu is not None:
        emu.clock.settle(deadline, start, now)
    return now - start


# --------------------------------------------------------------------------- host check


class HostTooSlow(ValueError):
    """The host cannot deliver the emulated network's step: a real transfer is slower."""


@dataclass(frozen=True)
class HostCheck:
    """Result of :func:`check_host`: per message size and link level, the real ring step of
    this host at this p against the emulated one; ``message`` says what to relax when not
    ``ok``.

    Example::

        chk = netem.check_host(ranks, [64 << 10], raise_error=False)
        print(chk.ok, chk.rows[0]["real_step_s"], chk.rows[0]["emulated_step_s"])
    """

    world_size: int
    rows: tuple[dict[str, Any], ...]
    ok: bool
    message: str


def _probe_rank(sizes: list[int], steps: int, reps: int) -> list[float]:
    """Rank side of :func:`check_host`: seconds per step of a chain of ``steps`` real ring steps
    (send to the right, receive from the left, wait), the fastest of ``reps``, per size: what the
    host can do (a late wake-up, which makes a slower repetition, is what the virtual clock
    forgives). Uses the backend directly: nothing is emulated."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = []
    for n in sizes:
        send = torch.zeros(max(1, n), dtype=torch.uint8)
        recv = torch.empty_like(send)
        per_rep = []
        for rep in range(reps + 1):  # repetition 0 warms up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            if rep:
                per_rep.append((time.perf_counter() - start) / steps)
        out.append(float(min(per_rep)))
    dist.barrier()
    return out


def _levels(network: Network, world_size: int, rpn: int | None) -> list[tuple[str, str, bool]]:
    sched = LinkSchedule(network, world_size, rpn)
    if not sched.two_level:
        return [("alpha_s", "bandwidth_Bps", False)]
    levels = [("inter_alpha_s", "inter_bandwidth_Bps", True)]
    if sched.ranks_per_node > 1:
        levels.insert(0, ("alpha_s", "bandwidth_Bps", False))
    return levels


def _advice(network: Network, level: tuple[str, str, bool], bad: list[tuple[int, float]]) -> str:
    """Which parameter of ``level`` to relax, from the violating (nbytes, real step) points."""
    a_name, b_name, inter = level
    alpha = network.inter_alpha if inter else network.alpha_s
    bw = min(network.bandwidth_Bps, network.inter_bandwidth) if inter else network.bandwidth_Bps
    need_alpha = max(real - n / bw for n, real in bad)
    fast = [(n, real) for n, real in bad if real > alpha and n > 0]
    need_bw = min(n / (real - alpha) for n, real in fast) if fast else None
    n_worst, _ = max(bad, key=lambda x: x[1] - (alpha + x[0] / bw))
    alpha_text = f"raise {a_name} to at least {_fmt_ms(need_alpha)}"
    bw_text = f"lower {b_name} to at most {_fmt_bw(need_bw)}" if need_bw else None
    if alpha >= n_worst / bw or bw_text is None:  # latency-bound step
        return alpha_text + (f" (or {bw_text})" if bw_text else "")
    return f"{bw_text} (or {alpha_text})"


def check_host(
    ranks: Any,
    sizes: list[int],
    network: Network | None = None,
    *,
    steps: int = 8,
    reps: int = 5,
    margin: float = 1.0,
    raise_error: bool = True,
    timeout_s: float = 120.0,
) -> HostCheck:
    """Probe that this host delivers the emulated step at the pool's p (in the parent).

    The emulated link must be slower than the real one: otherwise the real transfer, not the
    emulator, sets the time, and no virtual clock can hide that. On every rank of ``ranks``
    (a pool; its ``network`` unless given) a chain of real ring steps of each size in
    ``sizes`` is timed with the backend itself (nothing emulated; each rank's fastest of
    ``reps`` chains: the host's capability, not its scheduling noise); the slowest rank's step
    must take at most ``margin`` times the emulated time of one message of that size on every
    link level in use (intra-node: ``alpha_s + n / bandwidth_Bps``; between nodes: the
    ``inter_*`` link). Otherwise :class:`HostTooSlow` (when ``raise_error``) names the
    parameter to relax and the value that would fit.

    Example::

        with launch.Ranks(8, network=net) as ranks:
            netem.check_host(ranks, [64 << 10, 1 << 20])     # raises HostTooSlow if too fast
            ranks.run(mymodule.measure)
    """
    net = network if network is not None else getattr(ranks, "network", None)
    if not isinstance(net, Network):
        raise ValueError(f"network must be a pipecomm.netem.Network (or ranks.network), got {net!r}")
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of ints >= 0, got {sizes!r}")
    for name, value in (("steps", steps), ("reps", reps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin!r}")
    world = ranks.world_size
    rpn = net.ranks_per_node if net.ranks_per_node is not None else getattr(
        ranks, "ranks_per_node", None)
    levels = _levels(net, world, rpn)
    per_rank = ranks.run(_probe_rank, list(sizes), steps, reps, timeout_s=timeout_s)
    real = [max(col) for col in zip(*per_rank)]
    rows, problems = [], []
    for level in levels:
        bad = []
        for n, t in zip(sizes, real):
            emulated = net.transfer_time(n, inter_node=level[2])
            rows.append({"nbytes": n, "level": "inter-node" if level[2] else "intra-node",
                         "real_step_s": t, "emulated_step_s": emulated,
                         "ok": t <= margin * emulated})
            if t > margin * emulated:
                bad.append((n, t))
        if bad:
            n, t = max(bad, key=lambda x: x[1] / net.transfer_time(x[0], inter_node=level[2]))
            problems.append(
                f"a real ring step of {n} B takes {_fmt_ms(t)} here but the emulated "
                f"{'inter-node' if level[2] else 'link'} gives it "
                f"{_fmt_ms(net.transfer_time(n, inter_node=level[2]))}; {_advice(net, level, bad)}"
            )
    ok = not problems
    message = "ok" if ok else (
        f"netem: this host cannot deliver the emulated network ({net.describe(rpn)}) at "
        f"p={world}: " + "; ".join(problems)
    )
    result = HostCheck(world, tuple(rows), ok, message)
    if not ok and raise_error:
        raise HostTooSlow(message)
    return result


#: Seconds :func:`pipecomm.lab.network.emulated_pool` waits before probing the host a second time.
RECHECK_PAUSE_S = 2.0


# --------------------------------------------------------------------------- counters


def reset_stats() -> None:
    """Zero this rank's transfer counters.

    Example::

        netem.reset_stats(); run_step(); print(netem.stats())
    """
    emu = _ACTIVE
    with _STATS_LOCK:
        _STATS.update(
            bytes_sent=0, messages_sent=0, bytes_received=0, messages_received=0, time_waiting_s=0.0,
            _oversleep_base=emu.clock.oversleep if emu else 0.0,
        )


def stats() -> dict[str, float]:
    """This rank's counters since the last reset (all threads of the process).

    ``bytes_sent``/``messages_sent`` and ``bytes_received``/``messages_received`` count the
    payloads of :func:`pipecomm.collectives.p2p.exchange` (emulated or not);
    ``time_waiting_s`` is the time slept waiting for emulated deadlines; ``oversleep_s`` the
    wake-up lateness after those sleeps and ``lag_s`` the rank's current lag (both forgiven by
    the virtual clock; 0 without emulation).

    Example::

        netem.stats()   # {'bytes_sent': 4096, 'messages_sent': 2, ..., 'time_waiting_s': 0.011}
    """
    with _STATS_LOCK:
        out = dict(_STATS)
    emu = _ACTIVE
    out["oversleep_s"] = emu.clock.oversleep - out.pop("_oversleep_base", 0.0) if emu else 0.0
    out["lag_s"] = emu.clock.lag if emu else 0.0
    return out


def record(
    bytes_sent: int,
    messages_sent: int,
    bytes_received: int,
    messages_received: int,
    waited_s: float,
) -> None:
    """Add one transfer's bytes, messages and emulated waiting time to this rank's
    :func:`stats` (called by :mod:`pipecomm.collectives.p2p` for every message).

    Example::

        netem.record(4096, 1, 0, 0, 0.0)
    """
    with _STATS_LOCK:
        _STATS["bytes_sent"] += bytes_sent
        _STATS["messages_sent"] += messages_sent
        _STATS["bytes_received"] += bytes_received
        _STATS["messages_received"] += messages_received
        _STATS["time_waiting_s"] += waited_s


reset_stats()
