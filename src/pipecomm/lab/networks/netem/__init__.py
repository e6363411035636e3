"""Emulated network: per-link latency and bandwidth, port contention, intra- vs inter-node links.

The link model is the alpha-beta (Hockney) model with a port discipline, as used by the collective
analyses of the LP paper (Wang et al., arXiv 1611.04255: a message of n bytes costs
``alpha + n * beta``, one port per rank) and of Thakur, Rabenseifner and Gropp (2005), extended
with the two-level network of the DAdam paper's runtime model (Wang et al., ICLR 2025: fast
intra-node links, one shared inter-node link per node). ``ports="single"`` gives each rank one
outgoing and one incoming port, ``ports="per-neighbor"`` a link per ordered pair; with
``ranks_per_node`` set, messages between nodes also pass through the nodes' shared up- and
downlinks (``inter_alpha_s`` / ``inter_bandwidth_Bps``).

A message's delivery time is a deadline computed by the sender when it posts
(:class:`LinkSchedule`), never earlier than the real transfer: the emulated cost is
``max(real, emulated)``. Waiting sleeps; a per-rank virtual clock (:func:`clock`) forgives the
host's wake-up lateness; :func:`check_host` refuses a link the host cannot deliver. Only
pipecomm's own point-to-point transfers (:func:`pipecomm.collectives.p2p.exchange`) are
emulated; backend built-ins are not. Single host only.

Model, reservation arithmetic, virtual clock and what is not modelled: docs/network_model.md.

Modules: :mod:`.network` (:class:`Network`, the parameters), :mod:`.schedule`
(:class:`LinkSchedule`, the reservation arithmetic), :mod:`.emulation` (the launcher's contract,
the virtual clock, the counters), :mod:`.host_check` (:func:`check_host`). Every name is
importable from ``pipecomm.lab.networks.netem``.

Example::

    from pipecomm.lab.networks import launch
    from pipecomm.lab.networks import netem
    net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6, ports="single")
    with launch.Ranks(4, network=net) as ranks:
        ranks.run(mymodule.measure)          # in a rank: netem.current() == net
"""

from __future__ import annotations

# re-exported: public API (pipecomm.lab.networks.netem.<name>)
from pipecomm.lab.networks.netem.emulation import (
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
from pipecomm.lab.networks.netem.host_check import (
    RECHECK_PAUSE_S,
    SKIP_CHECK_ENV,
    HostCheck,
    HostTooSlow,
    check_host,
)
from pipecomm.lab.networks.netem.network import PORTS, Network
from pipecomm.lab.networks.netem.schedule import Hop, LinkSchedule

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
