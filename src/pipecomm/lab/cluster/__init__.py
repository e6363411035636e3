"""A virtual cluster on one machine: nodes are Linux network namespaces joined by shaped links.

The network of the DAdam paper's runtime model (Wang, Zhang, Wu, Johansson, ICLR 2025: the ranks
of a node share one inter-node link; intra-node traffic is fast) and, with one rank per node, the
single-port model of the LP paper (Wang et al., arXiv 1611.04255: one full-duplex port per rank),
carried by the kernel's own TCP stack and traffic shaper instead of pipecomm's emulator:

* node ``i`` is a network namespace with a loopback and one interface ``eth0`` (address
  ``10.77.0.<i+1>/24``, a subnet that exists only inside the namespaces of the run);
* a bridge ``br0`` in a namespace of its own joins the nodes: node ``i``'s ``eth0`` is one end of
  a veth pair whose other end ``v<i>`` is a port of the bridge;
* each node's link is shaped in both directions to ``bandwidth_Bps`` by a token-bucket filter
  (``tc qdisc ... tbf``) on both ends of its veth: ``eth0`` shapes what the node sends,
  ``v<i>`` what it receives. The ranks of a node share its namespace, so they talk to each other
  over its loopback (unshaped) and share its link to the others (two-level network).

Nothing is configured in the host's own namespace: the veth ends are created inside the
namespaces (``ip -n``). Every listener (the rendezvous store, gloo) binds inside a node's
namespace. Names carry a per-run prefix ``pc<pid>-``; :class:`VirtualCluster` removes its
namespaces, links and processes on success, on a failing rank, on SIGINT / SIGTERM and at exit,
and :func:`cleanup_stale` (run by every new cluster) removes what a killed run left behind.
Latency cannot be added (the kernel here may lack the ``netem`` qdisc); links are bandwidth-shaped
only.

``links="per-neighbor"`` builds the per-neighbor port model instead (the LP paper's model with
one link per pair of ranks): no bridge; every pair of nodes ``i < j`` has its own veth pair
(``p<j>`` in node ``i``, ``p<i>`` in node ``j``), shaped both ways, and a host route to the
peer's address through it; a node's address sits on its ``eth0`` (a veth whose other end stays
in the node), so gloo still binds to ``eth0``.

Programs run through the multi-node path of the README: one ``torchrun`` agent per node, started
inside its namespace with ``--nnodes N --node-rank i --rdzv-backend c10d --rdzv-endpoint
<node 0>:<port>``, and ``GLOO_SOCKET_IFNAME=eth0``.

Modules: :mod:`.host` (the ``ip`` / ``tc`` commands, :func:`available`, clean-up),
:mod:`.virtual` (:class:`VirtualCluster`), :mod:`.job` (:class:`ClusterJob`: calls on the ranks
of a job), :mod:`.probes` (link measurements, :func:`calibrate`), :mod:`.programs` (a profile's
torchrun program); ``python -m pipecomm.lab.cluster`` is the command line. Every name is
importable from ``pipecomm.lab.cluster``.

Example::

    from pipecomm.lab import cluster
    ok, why = cluster.available()
    if ok:
        with cluster.VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6) as c:
            c.torchrun(["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "out/E13"])
            print(c.run(mymodule.measure, 1 << 20))       # fn on every rank, results in rank order
"""

from __future__ import annotations

# re-exported: public API (pipecomm.lab.cluster.<name>)
from pipecomm.lab.cluster.host import (
    ClusterError,
    available,
    cleanup_stale,
    current,
    tbf_argv,
    tbf_max_rate,
)
from pipecomm.lab.cluster.job import ClusterJob
from pipecomm.lab.cluster.probes import (
    calibrate,
    chain_bandwidth,
    link_bandwidth,
    measure_bandwidth,
)
from pipecomm.lab.cluster.programs import experiment_module, profile_args, program_args
from pipecomm.lab.cluster.virtual import (
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
