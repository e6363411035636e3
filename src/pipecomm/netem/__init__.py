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

Modules: :mod:`.network` (:class:`Network`, the parameters), :mod:`.schedule`
(:class:`LinkSchedule`, the reservation arithmetic), :mod:`.emulation` (the launcher's contract,
the virtual clock, the counters), :mod:`.host_check` (:func:`check_host`). Every name is
importable from ``pipecomm.netem``.

Example::

    from pipecomm import launch, netem
    net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6, ports="single")
    with launch.Ranks(4, network=net) as ranks:
        ranks.run(mymodule.measure)          # in a rank: netem.current() == net
"""

from __future__ import annotations

# re-exported: public API (pipecomm.netem.<name>)
from pipecomm.netem.emulation import (
    MAX_LAG_S,
    VirtualClock,
    activate,
    clock,
    current,
    deactivate,
    emulator,
    record,
    reset_stats,
    setup,
    stats,
    teardown,
    wait_until,
)
from pipecomm.netem.host_check import (
    RECHECK_PAUSE_S,
    SKIP_CHECK_ENV,
    HostCheck,
    HostTooSlow,
    check_host,
)
from pipecomm.netem.network import PORTS, Network
from pipecomm.netem.schedule import Hop, LinkSchedule

__all__ = [
    "MAX_LAG_S",
    "PORTS",
    "RECHECK_PAUSE_S",
    "SKIP_CHECK_ENV",
    "HostCheck",
    "HostTooSlow",
    "Hop",
    "LinkSchedule",
    "Network",
    "VirtualClock",
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
