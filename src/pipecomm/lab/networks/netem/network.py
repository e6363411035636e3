"""The emulated network's parameters: alpha-beta links with a port model, optionally two levels.

:class:`Network` is what a caller configures (``launch.Ranks(4, network=Network(2e-3, 50e6))``);
the rules that turn it into delivery times are in :mod:`pipecomm.lab.networks.netem.schedule`. The link model
is the alpha-beta (Hockney) model of the LP paper (Wang et al., arXiv 1611.04255) with the
two-level network of the DAdam paper's runtime model (Wang et al., ICLR 2025).

Example::

    >>> from pipecomm.lab.networks.netem import Network
    >>> round(Network(2e-3, 50e6).transfer_time(1 << 20), 6)   # 0.002 + 1048576 / 50e6
    0.022972
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["PORTS", "Network", "format_bandwidth", "format_ms"]

PORTS = ("single", "per-neighbor")


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


def format_ms(seconds: float) -> str:
    """``seconds`` as milliseconds for messages and titles (``0.002`` -> ``"2.0 ms"``).

    Example::

        >>> format_ms(2e-3)
        '2.0 ms'
    """
    text = f"{seconds * 1e3:.3g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return f"{text} ms"


def format_bandwidth(bps: float) -> str:
    """A bandwidth in bytes per second as MB/s or GB/s for messages and titles.

    Example::

        >>> format_bandwidth(50e6)
        '50 MB/s'
    """
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

        >>> net = Network(1e-3, 400e6, ports="single", inter_alpha_s=2e-3, inter_bandwidth_Bps=50e6)
        >>> net.describe(ranks_per_node=2)
        'emulated, single-port, 1.0 ms / 400 MB/s, inter-node 2.0 ms / 50 MB/s, 2 ranks/node'
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

            >>> round(Network(2e-3, 50e6).transfer_time(1 << 20), 6)   # 0.002 + 1048576 / 50e6
            0.022972
        """
        if inter_node:
            return self.inter_alpha + nbytes / min(self.bandwidth_Bps, self.inter_bandwidth)
        return self.alpha_s + nbytes / self.bandwidth_Bps

    def describe(self, ranks_per_node: int | None = None) -> str:
        """Short human text for figure titles and logs.

        ``ranks_per_node`` is the launcher's value, used when the network has none.

        Example::

            >>> Network(2e-3, 50e6, ranks_per_node=2).describe()
            'emulated, single-port, 2.0 ms / 50 MB/s, inter-node 2.0 ms / 50 MB/s, 2 ranks/node'
        """
        text = (
            f"emulated, {self.ports}{'-port' if self.ports == 'single' else ''}, "
            f"{format_ms(self.alpha_s)} / {format_bandwidth(self.bandwidth_Bps)}"
        )
        rpn = self.ranks_per_node if self.ranks_per_node is not None else ranks_per_node
        explicit_inter = self.inter_alpha_s is not None or self.inter_bandwidth_Bps is not None
        if rpn is not None or explicit_inter:
            text += f", inter-node {format_ms(self.inter_alpha)} / {format_bandwidth(self.inter_bandwidth)}"
            text += f", {rpn} ranks/node" if rpn is not None else ", ranks/node from the launcher"
        return text

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the constructor arguments (JSON-friendly; ``from_dict`` inverts it).

        Example::

            >>> net = Network(2e-3, 50e6, ports="single")
            >>> Network.from_dict(net.to_dict()) == net
            True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Network:
        """Build a network from :meth:`to_dict` output (unknown keys are a ValueError).

        Example::

            >>> Network.from_dict({"alpha_s": 2e-3, "bandwidth_Bps": 50e6, "ports": "single"})
            Network(alpha_s=0.002, bandwidth_Bps=50000000.0, ports='single', ranks_per_node=None,
                    inter_alpha_s=None, inter_bandwidth_Bps=None)
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
