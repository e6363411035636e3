"""The link of the cost models: :class:`LinkModel` (``alpha`` s/message, ``beta`` s/byte,
``gamma`` s/byte reduced, a port model), the vocabulary and fallback calibration every model of
:mod:`pipecomm.lab.networks.cost` shares, and the argument checks they all make.

Example::

    >>> LinkModel.from_bandwidth(10e-6, 10e9).beta
    1e-10
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

from pipecomm import vocab

ALGORITHMS: tuple[str, ...] = vocab.MODELLED_ALGORITHMS
OPS: tuple[str, ...] = ("broadcast", "reduce", "allreduce")
PORTS: tuple[str, ...] = ("single", "per-neighbor")
DEFAULT_MIN_BLOCK_BYTES = 4096

#: Fallback calibration (used when no E0 fit is available): gloo over loopback on a small
#: development machine -- about 160 us one-way latency, 2.5 GB/s per link, and a local
#: reduction (``a += b`` in float32, one thread) of about 20 GB/s (E0's fit on that machine).
DEFAULT_ALPHA_S = 160e-6
DEFAULT_BANDWIDTH_BPS = 2.5e9
DEFAULT_GAMMA_S_PER_BYTE = 5e-11

_CALIBRATION_ENV = "PIPECOMM_CALIBRATION"


@dataclass(frozen=True)
class LinkModel:
    """Cost parameters of one link: ``alpha`` s/message, ``beta`` s/byte, ``gamma`` s/byte reduced.

    ``ports`` is ``"single"`` (each rank sends one message at a time and receives one at a time)
    or ``"per-neighbor"`` (every ordered pair of ranks has a link of its own).

    Example::

        >>> LinkModel(alpha=1e-3, beta=1 / 400e6, gamma=1e-9).bandwidth_Bps
        400000000.0
    """

    alpha: float
    beta: float
    gamma: float = 0.0
    ports: str = "single"

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(
                    f"LinkModel.{name} must be a real number of seconds, got {type(value).__name__}"
                )
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"LinkModel.{name} must be finite and >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.ports not in PORTS:
            raise ValueError(f"LinkModel.ports must be one of {PORTS}, got {self.ports!r}")

    @classmethod
    def from_bandwidth(
        cls, alpha_s: float, bandwidth_Bps: float, gamma: float = 0.0, ports: str = "single"
    ) -> LinkModel:
        """Build a link from latency and bandwidth in bytes per second.

        Example::

            >>> LinkModel.from_bandwidth(10e-6, 10e9).beta
            1e-10
        """
        if isinstance(bandwidth_Bps, bool) or not isinstance(bandwidth_Bps, numbers.Real):
            raise TypeError("bandwidth_Bps must be a real number of bytes per second")
        if not bandwidth_Bps > 0:
            raise ValueError(f"bandwidth_Bps must be > 0, got {bandwidth_Bps!r}")
        return cls(alpha=alpha_s, beta=1.0 / float(bandwidth_Bps), gamma=gamma, ports=ports)

    @property
    def bandwidth_Bps(self) -> float:
        """``1 / beta`` in bytes per second (``inf`` for ``beta = 0``)."""
        return math.inf if self.beta == 0 else 1.0 / self.beta

    def with_ports(self, ports: str) -> LinkModel:
        """The same link under another port model.

        Example::

            >>> LinkModel(1e-3, 1e-8).with_ports("per-neighbor").ports
            'per-neighbor'
        """
        return dataclasses.replace(self, ports=ports)


def as_count(value: Any, name: str, minimum: int) -> int:
    """``value`` as an int of at least ``minimum`` (an integral float is accepted), else an
    error naming ``name``.

    Example::

        >>> from pipecomm.lab.networks import cost
        >>> cost.as_count(8.0, "p", 1)
        8
    """
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got bool")
    integral = isinstance(value, numbers.Integral)
    if integral or (isinstance(value, numbers.Real) and float(value).is_integer()):
        out = int(value)
    else:
        raise TypeError(f"{name} must be an integer, got {value!r}")
    if out < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {out}")
    return out


def _check_link(link: Any) -> LinkModel:
    if not isinstance(link, LinkModel):
        raise TypeError(
            f"link must be a pipecomm.lab.networks.cost.LinkModel, got {type(link).__name__}; "
            "build one with LinkModel(alpha, beta, gamma) or link_from_network(net)"
        )
    return link


def _check_algorithm(algorithm: Any) -> str:
    if algorithm == "torch":
        raise ValueError(
            "algorithm 'torch' (the backend's built-in collective) has no cost model; "
            f"use one of {ALGORITHMS}"
        )
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return algorithm


def _check_op(op: Any) -> str:
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    return op


def _check_block(block_bytes: Any) -> int | None:
    if block_bytes is None:
        return None
    return as_count(block_bytes, "block_bytes", 1)


def _check_compression(algorithm: str, ratio: Any, codec: Any) -> tuple[float, float]:
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"compression_ratio must be a real number >= 1, got {ratio!r}")
    if not (math.isfinite(ratio) and ratio >= 1.0):
        raise ValueError(f"compression_ratio must be finite and >= 1, got {ratio!r}")
    if isinstance(codec, bool) or not isinstance(codec, numbers.Real):
        raise TypeError(f"codec_s_per_byte must be a real number >= 0, got {codec!r}")
    if not (math.isfinite(codec) and codec >= 0.0):
        raise ValueError(f"codec_s_per_byte must be finite and >= 0, got {codec!r}")
    if (ratio != 1.0 or codec != 0.0) and algorithm not in ("lp", "ring"):
        raise ValueError(
            f"compression is modelled (and implemented) only for algorithms 'lp' and 'ring', "
            f"got algorithm={algorithm!r}; pass compression_ratio=1 and codec_s_per_byte=0"
        )
    return float(ratio), float(codec)


def _round_up8(x):
    return -(-x // 8) * 8


def _ceil_log2(p: int) -> int:
    return (p - 1).bit_length()
