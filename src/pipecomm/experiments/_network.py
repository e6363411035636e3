"""The network an experiment runs on: emulated (``pipecomm.netem``) or real, its link models and
its label in the data.

No paper equation of its own: the links are the alpha-beta(-gamma) model of the LP paper
(:mod:`pipecomm.cost`, ``t = alpha + n beta``); :func:`choose_bandwidth` inverts the cost model's
AllReduce time (the Pipe-SGD experiments E7-E9 pick the bandwidth at which communication is a
given multiple of compute).

* E5-E9: one flat emulated network per pool (:func:`network_for`, :func:`network_and_link`);
  under NCCL none (the real interconnect; the model's link is E0's calibration).
* E10-E13: the cpu profile's two-level network (:data:`DEFAULT_NETWORK`, :func:`make_network`)
  and its intra-/inter-node link models (:func:`link_models`).
* Every data.csv's ``network`` column: :func:`network_text` (``"real"`` or the emulated
  network's ``describe()``, as :data:`pipecomm.results.NETWORK_COLUMN` documents).

Example::

    net = make_network(DEFAULT_NETWORK)
    intra, inter = link_models(net)
    network_text(net, ranks_per_node=2)   # 'emulated, single-port, 1.0 ms / 400 MB/s, ...'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pipecomm import cost, netem
from pipecomm.experiments import base

__all__ = [
    "DEFAULT_NETWORK",
    "FLAT_NETWORK",
    "TwoLevelParams",
    "NETWORK_KEYS",
    "choose_bandwidth",
    "link_models",
    "make_network",
    "network_and_link",
    "network_for",
    "network_text",
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


@dataclass(frozen=True)
class TwoLevelParams(base.Params):
    """The two-level network's parameters of an experiment (E10, E12), defaults from
    :data:`DEFAULT_NETWORK` (written once there); :func:`make_network` validates them."""

    intra_alpha_s: float = DEFAULT_NETWORK["intra_alpha_s"]
    intra_bandwidth_Bps: float = DEFAULT_NETWORK["intra_bandwidth_Bps"]
    inter_alpha_s: float = DEFAULT_NETWORK["inter_alpha_s"]
    inter_bandwidth_Bps: float = DEFAULT_NETWORK["inter_bandwidth_Bps"]
    ports: str = DEFAULT_NETWORK["ports"]


# ------------------------------------------------------------------------------------ network


def make_network(cfg: dict[str, Any]) -> netem.Network:
    """The two-level :class:`pipecomm.netem.Network` described by ``cfg`` (keys of
    :data:`DEFAULT_NETWORK`); ranks per node come from the launcher.

    Example::

        net = make_network(DEFAULT_NETWORK)   # 3 ms / 400 MB/s inside, 5 ms / 50 MB/s between
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

        intra, inter = link_models(make_network(DEFAULT_NETWORK))
        inter.bandwidth_Bps      # 50e6
    """
    return cost.link_from_network(net, "intra"), cost.link_from_network(net, "inter")


def network_text(net: netem.Network | None, ranks_per_node: int | None = None) -> str:
    """The ``network`` column: ``"real"`` (no emulation: the real interconnect) or the emulated
    network's ``describe(ranks_per_node)`` text.

    Example::

        network_text(None)                                  # 'real'
        network_text(netem.Network(1e-3, 50e6))             # 'emulated, single-port, ...'
    """
    return "real" if net is None else net.describe(ranks_per_node=ranks_per_node)


def network_and_link(
    p: Mapping[str, Any], emulated: Callable[[], netem.Network]
) -> tuple[netem.Network | None, cost.LinkModel]:
    """``(network, link)`` of a training experiment (E5-E9): ``(None, E0's calibrated link)``
    under NCCL, else ``(emulated(), that network's link)``.

    Example::

        net, link = network_and_link(p, lambda: netem.Network(1e-3, 50e6))
    """
    if p["backend"] == "nccl":
        return None, cost.calibrated_link()
    net = emulated()
    return net, cost.link_from_network(net)


def network_for(
    p: Mapping[str, Any], cal: Mapping[str, float] | None, nbytes: int
) -> netem.Network:
    """The emulated network of E7-E9: ``p["bandwidth_Bps"]`` when given, else the bandwidth at
    which the cost model's AllReduce takes ``p["comm_ratio"] * (C + U)`` of the compute-timing
    run ``cal`` (:func:`choose_bandwidth`).

    Example::

        network_for({"bandwidth_Bps": None, "comm_ratio": 1.0, "world_size": 2, "alpha_s": 1e-3,
                     "algorithm": "ring", "ports": "single"},
                    {"compute_s": 0.016, "update_s": 0.0005}, 830_000)
    """
    bw = p["bandwidth_Bps"]
    if bw is None:
        if cal is None:
            raise ValueError("bandwidth_Bps=None needs a compute-timing run to choose it from")
        target = p["comm_ratio"] * (cal["compute_s"] + cal["update_s"])
        bw = choose_bandwidth(
            target,
            nbytes,
            p["world_size"],
            p["alpha_s"],
            algorithm=p["algorithm"],
            ports=p["ports"],
        )
    return netem.Network(alpha_s=p["alpha_s"], bandwidth_Bps=float(bw), ports=p["ports"])


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

    ``gamma`` defaults to the calibrated reduction cost (:func:`pipecomm.cost.calibrated_link`).
    A target at or below the latency-and-reduction floor is a ValueError. ``algorithm`` defaults
    to ``"ring"`` rather than pipecomm's ``"lp"``: the Pipe-SGD experiments train with a ring
    AllReduce, as the Pipe-SGD paper does (their ``DEFAULTS``).

    Example::

        choose_bandwidth(0.02, 830_000, 2, 1e-3)      # about 45e6 (ring, p = 2)
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
