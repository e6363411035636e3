"""Reservation arithmetic of the emulated network: the ports a message passes and when it arrives.

Every hop a message takes is a *port* busy for exactly ``n / (its bandwidth)`` seconds. Hops are
chained cut-through (:meth:`LinkSchedule.post`): a hop starts no earlier than the first byte
reaches it and no earlier than it can run at full rate without finishing before the last byte
arrives; among the free intervals of its port it takes the earliest that fits (committed
reservations never move, so a deadline shipped with a message stays valid). Pure arithmetic: no
processes, no clocks (:mod:`pipecomm.lab.networks.netem.emulation` keeps the table in shared memory).

Example::

    >>> from pipecomm.lab.networks.netem import LinkSchedule, Network
    >>> sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
    >>> sched.post(sched.new_table(), 0, 1, 1000, now=0.0)
    0.002
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from pipecomm.lab.networks.netem.network import Network

__all__ = ["Hop", "LinkSchedule"]


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

        >>> sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
        >>> table = sched.new_table()
        >>> sched.post(table, 0, 1, 1000, now=0.0)
        0.002
        >>> sched.post(table, 0, 1, 1000, now=0.0)
        0.003
    """

    def __init__(
        self, network: Network, world_size: int, ranks_per_node: int | None = None
    ) -> None:
        if not isinstance(network, Network):
            raise ValueError(f"network must be a pipecomm.lab.networks.netem.Network, got {network!r}")
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

            >>> sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
            >>> table = sched.new_table()
            >>> table.shape == (sched.table_size,), bool((table == 0).all())
            (True, True)
        """
        return np.zeros(self.table_size, dtype=np.float64)

    def node(self, rank: int) -> int:
        """Node of a global rank (0 on a flat network).

        Example::

            >>> LinkSchedule(Network(0, 1e9, ranks_per_node=2), 4).node(3)
            1
        """
        return rank // self.ranks_per_node if self.two_level else 0

    def route(self, src: int, dst: int, nbytes: int) -> list[Hop]:
        """The hops of a message from ``src`` to ``dst`` (global ranks) of ``nbytes`` bytes.

        Example::

            >>> sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
            >>> sched.route(0, 1, 1000)   # [Hop(out-port of 0, n/B, alpha), Hop(in-port of 1, n/B, 0)]
            [Hop(port=0, duration=0.001, latency=0.001), Hop(port=3, duration=0.001, latency=0.0)]
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

            >>> sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
            >>> table = sched.new_table()
            >>> sched.post(table, 0, 1, 1000, now=0.0), sched.post(table, 0, 1, 1000, now=0.0)
            (0.002, 0.003)
            >>> sched.busy(table, 0)
            [(0.0, 0.001), (0.001, 0.002)]
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

            >>> import time
            >>> sched = LinkSchedule(Network(1e-3, 1e6), world_size=2)
            >>> table = sched.new_table()
            >>> now = time.monotonic()
            >>> sched.post(table, src=0, dst=1, nbytes=4096, now=now) - now > 0
            True
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
