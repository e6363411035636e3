"""A virtual cluster on one machine: nodes are Linux network namespaces joined by shaped links.

The network of the DAdam paper's runtime model (Wang, Zhang, Wu, Johansson, ICLR 2025: the ranks
of a node share one inter-node link; intra-node traffic is fast) and, with one rank per node, the
single-port model of the LP paper (Wang et al., arXiv 1611.04255: one full-duplex port per rank),
carried by the kernel's own TCP stack and traffic shaper (``tc tbf``, both directions of every
node link) instead of pipecomm's emulator; ``links="per-neighbor"`` gives one shaped link per pair
of nodes. Programs run through the multi-node path of the README: one ``torchrun`` agent
per node, inside its namespace. Nothing is configured in the host's own namespace, and everything
a run builds is removed afterwards (also on a failing rank, SIGINT / SIGTERM, and by the next run
after a kill). How the nodes are built (addresses, bridge, veth pairs, names, clean-up):
docs/network_model.md, "How the virtual cluster is built".

Modules: :mod:`.host` (the ``ip`` / ``tc`` commands, :func:`available`, clean-up),
:mod:`.virtual` (:class:`VirtualCluster`), :mod:`.job` (:class:`ClusterJob`: calls on the ranks
of a job), :mod:`.probes` (link measurements, :func:`calibrate`), :mod:`.programs` (a profile's
torchrun program); ``python -m pipecomm.lab.networks.cluster`` is the command line. Every name is
importable from ``pipecomm.lab.networks.cluster``.

Example::

    from pipecomm.lab.networks import cluster
    ok, why = cluster.available()
    if ok:
        with cluster.VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6) as c:
            c.torchrun(["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "out/E13"])
            print(c.run(mymodule.measure, 1 << 20))       # fn on every rank, results in rank order
"""

from __future__ import annotations

# re-exported: public API (pipecomm.lab.networks.cluster.<name>)
from pipecomm.lab.networks.cluster.host import (
    ClusterError,
    available,
    cleanup_stale,
    current,
    tbf_argv,
    tbf_max_rate,
)
from pipecomm.lab.networks.cluster.job import ClusterJob
from pipecomm.lab.networks.cluster.probes import (
    calibrate,
    chain_bandwidth,
    link_bandwidth,
    measure_bandwidth,
)
from pipecomm.lab.networks.cluster.programs import experiment_module, profile_args, program_args
from pipecomm.lab.networks.cluster.virtual import (
    IFNAME,
    LINKS,
    MAX_NODES,
    SUBNET,
    NodeResult,
    VirtualCluster,
)

__all__ = [
    "ClusterError",
    "ClusterJob",
    "NodeResult",
    "VirtualCluster",
    "available",
    "calibrate",
    "cleanup_stale",
    "current",
    "chain_bandwidth",
    "link_bandwidth",
    "measure_bandwidth",
    "experiment_module",
    "profile_args",
    "program_args",
    "IFNAME",
    "LINKS",
    "MAX_NODES",
    "SUBNET",
    "tbf_argv",
    "tbf_max_rate",
]
