"""The network an experiment runs on: emulated (``pipecomm.lab.networks.netem``) or real, its link models and
its label in the data.

No paper equation of its own: the links are the alpha-beta(-gamma) model of the LP paper
(:mod:`pipecomm.lab.networks.cost`, ``t = alpha + n beta``); :func:`choose_bandwidth` inverts the cost model's
AllReduce time (the Pipe-SGD experiments E7-E9 pick the bandwidth at which communication is a
given multiple of compute).

* E5-E9: one flat emulated network per pool (:func:`network_for`, :func:`network_and_link`);
  under NCCL none (the real interconnect; the model's link is E0's calibration).
* E10-E13: the cpu profile's two-level network (:data:`DEFAULT_NETWORK`, :func:`make_network`)
  and its intra-/inter-node link models (:func:`link_models`).
* Every data.csv's ``network`` column: :func:`network_text` (``"real"`` or the emulated
  network's ``describe()``, as :data:`pipecomm.lab.results.NETWORK_COLUMN` documents).
* Where an experiment measures: :func:`ranks_on` -- the same rank functions on the emulated
  network (``network="emulated"``, a local pool on :mod:`pipecomm.lab.networks.netem`) or on a real shaped one
  (``network="shaped"``, a :class:`pipecomm.lab.networks.cluster.VirtualCluster` of Linux network namespaces,
  tc tbf links, real TCP, one torchrun agent per node), with the network the cost models use.

Example::

    >>> net = make_network(DEFAULT_NETWORK)
    >>> intra, inter = link_models(net)
    >>> network_text(net, ranks_per_node=2)
    'emulated, single-port, 3.0 ms / 400 MB/s, inter-node 5.0 ms / 50 MB/s, 2 ranks/node'
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pipecomm.lab import experiment
from pipecomm.lab.networks import cost, launch, netem

__all__ = [
    "DEFAULT_NETWORK",
    "FLAT_NETWORK",
    "NETWORK_KINDS",
    "NetworkRanks",
    "TwoLevelParams",
    "NETWORK_KEYS",
    "check_network_kind",
    "choose_bandwidth",
    "link_models",
    "make_network",
    "network_and_link",
    "network_for",
    "network_text",
    "ranks_on",
]

#: The cpu profile's two-level network (docs/network_model.md): nodes of 2 ranks, intra-node links
#: of 3 ms / 400 MB/s, one inter-node uplink/downlink per node of 5 ms / 50 MB/s, single port.
#: The latencies are what netem.check_host accepts at p = 8 on a 2-core host (a real ring step of
#: a few KiB between 8 ranks takes about 2 ms there; an emulated link must be slower).
DEFAULT_NETWORK: dict[str, Any] = {
    "intra_alpha_s": 3e-3,
    "intra_bandwidth_Bps": 400e6,
    "inter_alpha_s": 5e-3,
    "inter_bandwidth_Bps": 50e6,
    "ports": "single",
}
#: The same network with homogeneous links (inter-node = intra-node), for the link-factor sweep.
FLAT_NETWORK: dict[str, Any] = {
    **DEFAULT_NETWORK,
    "inter_alpha_s": 3e-3,
    "inter_bandwidth_Bps": 400e6,
}

NETWORK_KEYS = tuple(DEFAULT_NETWORK)

#: Where a network experiment measures: pipecomm's emulator, or a real network the kernel shapes.
NETWORK_KINDS = ("emulated", "shaped")
#: Link calibration of a shaped cluster (:func:`pipecomm.lab.networks.cluster.calibrate`): 4 KiB is the latency.
SHAPED_CALIBRATION_SIZES = (4 << 10, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class TwoLevelParams(experiment.Params):
    """The two-level network's parameters of an experiment (E10, E12), defaults from
    :data:`DEFAULT_NETWORK` (written once there), and where the experiment measures
    (``network``: the emulator, or a shaped cluster of nodes of ``ranks_per_node`` ranks whose
    node links run at ``inter_bandwidth_Bps``, see :func:`ranks_on`)."""

    intra_alpha_s: float = DEFAULT_NETWORK["intra_alpha_s"]
    intra_bandwidth_Bps: float = DEFAULT_NETWORK["intra_bandwidth_Bps"]
    inter_alpha_s: float = DEFAULT_NETWORK["inter_alpha_s"]
    inter_bandwidth_Bps: float = DEFAULT_NETWORK["inter_bandwidth_Bps"]
    ports: str = DEFAULT_NETWORK["ports"]
    network: str = "emulated"  # "emulated" or "shaped": where it measures (ranks_on)

    def validate(self) -> None:
        check_network_kind(self.network)
        make_network(self.asdict())


# ------------------------------------------------------------------------------------ network


def make_network(cfg: dict[str, Any]) -> netem.Network:
    """The two-level :class:`pipecomm.lab.networks.netem.Network` described by ``cfg`` (keys of
    :data:`DEFAULT_NETWORK`); ranks per node come from the launcher.

    Example::

        >>> net = make_network(DEFAULT_NETWORK)   # 3 ms / 400 MB/s inside, 5 ms / 50 MB/s between
        >>> net.alpha_s, net.bandwidth_Bps, net.inter_alpha_s, net.inter_bandwidth_Bps
        (0.003, 400000000.0, 0.005, 50000000.0)
    """
    missing = [k for k in NETWORK_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"network parameters {missing} are missing; expected {NETWORK_KEYS}")
    return netem.Network(
        alpha_s=cfg["intra_alpha_s"],
        bandwidth_Bps=cfg["intra_bandwidth_Bps"],
        ports=cfg["ports"],
        inter_alpha_s=cfg["inter_alpha_s"],
        inter_bandwidth_Bps=cfg["inter_bandwidth_Bps"],
    )


def link_models(net: netem.Network) -> tuple[cost.LinkModel, cost.LinkModel]:
    """``(intra, inter)`` link models of an emulated network (gamma from E0's calibration).

    Example::

        >>> intra, inter = link_models(make_network(DEFAULT_NETWORK))
        >>> inter.alpha, 1 / inter.beta      # 5 ms, 50 MB/s
        (0.005, 50000000.0)
    """
    return cost.link_from_network(net, "intra"), cost.link_from_network(net, "inter")


def network_text(net: netem.Network | None, ranks_per_node: int | None = None) -> str:
    """The ``network`` column: ``"real"`` (no emulation: the real interconnect) or the emulated
    network's ``describe(ranks_per_node)`` text.

    Example::

        >>> network_text(None)
        'real'
        >>> network_text(netem.Network(1e-3, 50e6))
        'emulated, single-port, 1.0 ms / 50 MB/s'
    """
    return "real" if net is None else net.describe(ranks_per_node=ranks_per_node)


def network_and_link(
    params: experiment.Params, emulated: Callable[[], netem.Network]
) -> tuple[netem.Network | None, cost.LinkModel]:
    """``(network, link)`` of a training experiment (E5-E9): ``(None, E0's calibrated link)``
    under NCCL, else ``(emulated(), that network's link)``.

    Example::

        >>> from pipecomm.lab.experiments import e05_bsp_sgd
        >>> params = e05_bsp_sgd.Params.make(backend="gloo")
        >>> net, link = network_and_link(params, lambda: netem.Network(1e-3, 50e6))
        >>> link.alpha, 1 / link.beta
        (0.001, 50000000.0)
    """
    if params.backend == "nccl":
        return None, cost.calibrated_link()
    net = emulated()
    return net, cost.link_from_network(net)


def network_for(
    params: experiment.Params, cal: Mapping[str, float] | None, nbytes: int
) -> netem.Network:
    """The emulated network of E7-E9: ``params.bandwidth_Bps`` when given, else the bandwidth at
    which the cost model's AllReduce takes ``params.comm_ratio * (C + U)`` of the compute-timing
    run ``cal`` (:func:`choose_bandwidth`).

    Example::

        >>> from pipecomm.lab.experiments import e07_pipesgd_convergence
        >>> net = network_for(e07_pipesgd_convergence.Params.make(comm_ratio=1.0, world_size=2),
        ...                   {"compute_s": 0.016, "update_s": 0.0005}, 830_000)
        >>> round(net.bandwidth_Bps / 1e6, 1)      # MB/s
        57.3
    """
    bw = params.bandwidth_Bps
    if bw is None:
        if cal is None:
            raise ValueError("bandwidth_Bps=None needs a compute-timing run to choose it from")
        target = params.comm_ratio * (cal["compute_s"] + cal["update_s"])
        bw = choose_bandwidth(
            target,
            nbytes,
            params.world_size,
            params.alpha_s,
            algorithm=params.algorithm,
            ports=params.ports,
        )
    return netem.Network(alpha_s=params.alpha_s, bandwidth_Bps=float(bw), ports=params.ports)


def choose_bandwidth(
    target_s: float,
    nbytes: int,
    p: int,
    alpha_s: float,
    *,
    algorithm: str = "ring",
    ports: str = "single",
    gamma: float | None = None,
) -> float:
    """The emulated bandwidth (bytes/s) at which the cost model's AllReduce of ``nbytes`` over
    ``p`` ranks takes ``target_s`` seconds (bisection; the model is decreasing in bandwidth).

    ``gamma`` defaults to the calibrated reduction cost (:func:`pipecomm.lab.networks.cost.calibrated_link`).
    A target at or below the latency-and-reduction floor is a ValueError. ``algorithm`` defaults
    to ``"ring"`` rather than pipecomm's ``"lp"``: the Pipe-SGD experiments train with a ring
    AllReduce, as the Pipe-SGD paper does (their ``DEFAULTS``).

    Example::

        >>> round(choose_bandwidth(0.02, 830_000, 2, 1e-3) / 1e6, 1)      # MB/s (ring, p = 2)
        46.2
    """
    if gamma is None:
        gamma = cost.calibrated_link().gamma

    def model(bw: float) -> float:
        link = cost.LinkModel.from_bandwidth(alpha_s, bw, gamma=gamma, ports=ports)
        return cost.allreduce_time(algorithm, nbytes, p, link)

    lo, hi = 1e4, 1e12
    if not target_s > model(hi):
        raise ValueError(
            f"an AllReduce of {nbytes} bytes over p={p} costs at least {model(hi) * 1e3:.2f} ms "
            f"(latency alpha_s={alpha_s} and reductions) on any bandwidth; the target "
            f"{target_s * 1e3:.2f} ms (comm_ratio x compute) is unreachable: raise comm_ratio or "
            "lower alpha_s"
        )
    if model(lo) < target_s:
        return lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if model(mid) > target_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


# ------------------------------------------------------------------------- where it measures


@dataclass
class NetworkRanks:
    """The ranks an experiment measures on, and the network its cost models use.

    Attributes:
        kind: ``"emulated"`` (:mod:`pipecomm.lab.networks.netem`), ``"shaped"`` (a virtual cluster) or
            ``"real"`` (no network model: NCCL's interconnect).
        net: the network the models use: the emulated network itself, or the shaped cluster's
            calibrated links (alpha and bandwidth fitted per link, the requested ports) as a
            :class:`pipecomm.lab.networks.netem.Network` (a description; nothing is emulated with it);
            ``None`` when real.
        text: the data.csv ``network`` column (``describe()`` of the emulator or the cluster).
        calibration: the shaped cluster's :func:`pipecomm.lab.networks.cluster.calibrate` record (``None``
            when emulated).

    Example::

        with ranks_on("shaped", 8, netem.Network(1e-3, 20e6), 1 << 20) as ranks:
            rows = ranks.run(sweep.measure_points, points)[0]
            link = cost.link_from_network(ranks.net)     # the calibrated link
    """

    kind: str
    net: netem.Network | None
    text: str
    runner: launch.RankPool = field(repr=False)
    calibration: dict[str, Any] | None = None

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None) -> list:
        """``fn(*args)`` on every rank; results in rank order."""
        return self.runner.run(fn, *args, **({} if timeout_s is None else
                                              {"timeout_s": timeout_s}))


def check_network_kind(network: Any) -> str:
    """``network`` if it is one of :data:`NETWORK_KINDS`, else a ValueError naming it.

    Example::

        >>> check_network_kind("shaped")
        'shaped'
    """
    if network not in NETWORK_KINDS:
        raise ValueError(f"parameter network must be one of {NETWORK_KINDS}, got {network!r}")
    return network


@contextlib.contextmanager
def ranks_on(
    network: str,
    world_size: int,
    net: netem.Network | None,
    smallest_bytes: int | None = None,
    *,
    ranks_per_node: int | None = None,
    backend: str = "gloo",
    timeout_s: float = 600.0,
    calibration_sizes: Sequence[int] = SHAPED_CALIBRATION_SIZES,
    calibration_iters: int = 5,
) -> Iterator[NetworkRanks]:
    """Ranks on the ``network`` kind an experiment asked for, shaped like ``net``.

    * ``"emulated"``: :func:`emulated_pool`, which first checks that the host delivers
      ``net``'s links with messages of ``smallest_bytes``; ``smallest_bytes=None`` skips that
      probe (:func:`pipecomm.lab.networks.launch.pool`: the training experiments time whole iterations).
      ``net=None`` (NCCL, or no network): the real interconnect, ``kind="real"``.
    * ``"shaped"``: a :class:`pipecomm.lab.networks.cluster.VirtualCluster` of ``world_size /
      ranks_per_node`` nodes whose links the kernel shapes to ``net``'s inter-node bandwidth
      (``ports="per-neighbor"``: a link per pair of nodes); the ranks of a node share its
      namespace (intra-node traffic over its loopback, unshaped), and one torchrun job serves
      every call (:meth:`pipecomm.lab.networks.cluster.VirtualCluster.job`). Latency cannot be added to the
      links, so ``net``'s latencies do not apply; instead every link kind is calibrated first
      (:func:`pipecomm.lab.networks.cluster.calibrate`: alpha and bandwidth as measured), the host must carry
      every node link at once, and ``NetworkRanks.net`` holds the calibrated links for the cost
      models (and for LP's default block size on the ranks,
      :func:`pipecomm.collectives.lp.set_link`). Needs root, iproute2 and tc tbf
      (:func:`pipecomm.lab.networks.cluster.available`) and gloo; without them a RuntimeError says why (the
      emulator is the fallback: ``network="emulated"``).

    Example::

        with ranks_on(params.network, 8, net, 64 << 10) as ranks:
            out = ranks.run(sweep.measure_points, points)
    """
    from pipecomm.collectives import lp
    from pipecomm.lab.networks import cluster, launch

    check_network_kind(network)
    rpn = ranks_per_node or 1
    if network == "emulated" or net is None:
        if net is None:
            with launch.pool(world_size, backend=backend) as ranks:
                yield NetworkRanks("real", None, network_text(None), ranks)
        elif smallest_bytes is None:
            with launch.pool(world_size, backend=backend, network=net,
                             ranks_per_node=ranks_per_node) as ranks:
                yield NetworkRanks("emulated", net, network_text(net, ranks_per_node), ranks)
        else:
            with emulated_pool(world_size, net, smallest_bytes, ranks_per_node=ranks_per_node,
                            timeout_s=timeout_s) as ranks:
                yield NetworkRanks("emulated", net, network_text(net, ranks_per_node), ranks)
        return
    if backend != "gloo":
        raise ValueError(f"network='shaped' runs gloo ranks on CPU, got backend={backend!r}")
    ok, why = cluster.available()
    if not ok:
        raise RuntimeError(f"network='shaped' needs the virtual cluster (root, iproute2, tc tbf): "
                           f"{why}; network='emulated' runs on pipecomm's emulator instead")
    if world_size % rpn or world_size // rpn < 2:
        raise ValueError(f"a shaped cluster needs >= 2 nodes of ranks_per_node={rpn} ranks; "
                         f"world_size={world_size} does not divide into them")
    bandwidth = net.inter_bandwidth
    links = "per-neighbor" if net.ports == "per-neighbor" else "bridge"
    with cluster.VirtualCluster(world_size // rpn, rpn, bandwidth, links=links,
                                timeout_s=timeout_s) as c, c.job() as job:
        cal = job.run(cluster.calibrate, list(calibration_sizes), calibration_iters, rpn,
                      configured_Bps=bandwidth, timeout_s=timeout_s)[0]
        inter, intra = cal["inter"], cal["intra"] or cal["inter"]
        model_net = netem.Network(
            alpha_s=intra["alpha_s"], bandwidth_Bps=intra["bandwidth_Bps"], ports=net.ports,
            inter_alpha_s=inter["alpha_s"] if rpn > 1 else None,
            inter_bandwidth_Bps=inter["bandwidth_Bps"] if rpn > 1 else None)
        job.run(lp.set_link, model_net.alpha_s, model_net.bandwidth_Bps,  # LP's default blocks
                timeout_s=timeout_s)
        yield NetworkRanks("shaped", model_net, c.describe(), job, cal)


@contextlib.contextmanager
def emulated_pool(world_size: int, network: netem.Network, smallest_bytes: int, *,
                  ranks_per_node: int | None = None, timeout_s: float = 120.0) -> Iterator[Any]:
    """A local rank pool on the emulated ``network`` that is known to be valid: before anything
    is measured, :func:`pipecomm.lab.networks.netem.check_host` probes this host at this p with the smallest
    message the measurement sends (``smallest_bytes``) and with 1 MiB, and raises
    :class:`pipecomm.lab.networks.netem.HostTooSlow` (naming the link parameter to relax) when a real transfer
    is slower than the emulated one in a second probe too, :data:`pipecomm.lab.networks.netem.RECHECK_PAUSE_S`
    after a first that failed (a process that was finishing, e.g. the kernel tearing down network
    namespaces, is not the host).
    ``PIPECOMM_SKIP_HOST_CHECK=1`` skips the probe with a warning (the tests' tiny end-to-end runs
    on fast links check plumbing, not timing).

    Example::

        with network.emulated_pool(8, net, smallest_bytes=64 << 10) as ranks:
            rows = ranks.run(sweep.measure_points, points)[0]
    """
    sizes = sorted({max(1, int(smallest_bytes)), 1 << 20})
    with launch.Ranks(world_size, network=network, ranks_per_node=ranks_per_node) as ranks:
        if os.environ.get(netem.SKIP_CHECK_ENV, "") in ("", "0"):
            if not netem.check_host(ranks, sizes, timeout_s=timeout_s, raise_error=False).ok:
                time.sleep(netem.RECHECK_PAUSE_S)  # a passing disturbance, not the host: probe again
                netem.check_host(ranks, sizes, timeout_s=timeout_s)
        else:
            warnings.warn(f"{netem.SKIP_CHECK_ENV} is set: the emulated network "
                          f"({network.describe()}) was not checked against this host; its "
                          "timings may be the host's",
                          stacklevel=3)
        yield ranks
