"""Links for the cost models from measurements: the backend's link as E0 calibrated it
(``PIPECOMM_CALIBRATION``), the emulated network's link, and the least-squares fits of ``alpha``,
``beta`` and ``gamma`` that E0 makes.

Example::

    >>> n = [8, 1024, 2**20, 2**24]
    >>> a, b = fit_alpha_beta(n, [1e-4 + x * 1e-9 for x in n])
    >>> round(a * 1e6, 3), round(1 / b / 1e9, 3)      # 100 us, 1 GB/s
    (100.0, 1.0)
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np

from pipecomm.lab.networks.cost.link import (
    _CALIBRATION_ENV,
    DEFAULT_ALPHA_S,
    DEFAULT_BANDWIDTH_BPS,
    DEFAULT_GAMMA_S_PER_BYTE,
    LinkModel,
)

# --------------------------------------------------------------------------------------------
# Links from the emulated network and from calibration
# --------------------------------------------------------------------------------------------


def calibrated_link(path: str | os.PathLike | None = None) -> LinkModel:
    """The backend's link as fitted by experiment E0, or documented fallbacks.

    Looks for a JSON file with keys ``alpha_s``, ``beta_s_per_byte``, ``gamma_s_per_byte`` (and
    optionally ``ports``) at ``path``, else at the path in the environment variable
    ``PIPECOMM_CALIBRATION``. Without either it returns *fallback* values measured once for gloo
    over loopback on a 2-core development machine -- ``alpha = 160 us``, 2.5 GB/s
    (``beta = 4e-10 s/B``), ``gamma = 5e-11 s/B`` (a reduction at about 20 GB/s) -- which are
    only indicative: run E0 on the machine at hand for real numbers.

    Example::

        >>> calibrated_link().alpha      # no calibration file: the fallback
        0.00016
    """
    if path is None:
        path = os.environ.get(_CALIBRATION_ENV) or None
    if path is None:
        return LinkModel(
            alpha=DEFAULT_ALPHA_S,
            beta=1.0 / DEFAULT_BANDWIDTH_BPS,
            gamma=DEFAULT_GAMMA_S_PER_BYTE,
        )
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read the calibration file {os.fspath(path)!r}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"calibration file {os.fspath(path)!r} is not JSON: {exc}") from exc
    missing = [k for k in ("alpha_s", "beta_s_per_byte", "gamma_s_per_byte") if k not in data]
    if not isinstance(data, dict) or missing:
        raise ValueError(
            f"calibration file {os.fspath(path)!r} lacks keys {missing}; expected alpha_s, "
            "beta_s_per_byte, gamma_s_per_byte (as written by experiment E0)"
        )
    return LinkModel(
        alpha=data["alpha_s"],
        beta=data["beta_s_per_byte"],
        gamma=data["gamma_s_per_byte"],
        ports=data.get("ports", "single"),
    )


def link_from_network(network: Any, level: str = "intra", gamma: float | None = None) -> LinkModel:
    """The :class:`LinkModel` of an emulated ``netem.Network``.

    ``level="intra"`` (default; also the only level of a one-level network): ``alpha_s``,
    ``1 / bandwidth_Bps`` and the network's port model. ``level="inter"``: what an uncontended
    message between nodes costs in netem -- ``inter_alpha_s`` and
    ``1 / min(bandwidth_Bps, inter_bandwidth_Bps)`` (hops are cut-through), each defaulting to
    the intra value when unset -- with ``ports="single"`` (one uplink/downlink per node, shared
    FIFO by its ranks: the per-rank link is only this fast when one rank per node talks).
    ``gamma`` defaults to :func:`calibrated_link`'s (reductions run on the real CPU).

    Example::

        >>> from types import SimpleNamespace
        >>> net = SimpleNamespace(alpha_s=1e-3, bandwidth_Bps=400e6, ports="single",
        ...                       ranks_per_node=None, inter_alpha_s=None, inter_bandwidth_Bps=None)
        >>> link_from_network(net, gamma=0.0)
        LinkModel(alpha=0.001, beta=2.5e-09, gamma=0.0, ports='single')
    """
    if level not in ("intra", "inter"):
        raise ValueError(f"level must be 'intra' or 'inter', got {level!r}")
    for attr in ("alpha_s", "bandwidth_Bps", "ports"):
        if not hasattr(network, attr):
            raise TypeError(
                f"network must have attribute {attr!r} (a pipecomm.lab.networks.netem.Network), "
                f"got {type(network).__name__}"
            )
    if gamma is None:
        gamma = calibrated_link().gamma
    if level == "intra":
        return LinkModel.from_bandwidth(
            network.alpha_s, network.bandwidth_Bps, gamma=gamma, ports=network.ports
        )
    ia = getattr(network, "inter_alpha_s", None)
    ib = getattr(network, "inter_bandwidth_Bps", None)
    ia = network.alpha_s if ia is None else ia
    ib = network.bandwidth_Bps if ib is None else min(ib, network.bandwidth_Bps)
    return LinkModel.from_bandwidth(ia, ib, gamma=gamma, ports="single")


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------


def _nonneg_lstsq(x: np.ndarray, t: np.ndarray, w: np.ndarray) -> tuple[float, float]:
    """Minimise ``sum (w (c0 + c1 x - t))^2`` over ``c0, c1 >= 0`` (2-variable active sets)."""
    a = np.stack([w, w * x], axis=1)
    y = w * t
    best: tuple[float, float] | None = None
    best_res = math.inf
    candidates = []
    sol, *_ = np.linalg.lstsq(a, y, rcond=None)
    candidates.append((float(sol[0]), float(sol[1])))
    c0 = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0]))
    candidates.append((c0, 0.0))
    denom = float(a[:, 1] @ a[:, 1])
    candidates.append((0.0, float(a[:, 1] @ y / denom) if denom > 0 else 0.0))
    candidates.append((0.0, 0.0))
    for c0, c1 in candidates:
        if c0 < 0 or c1 < 0:
            continue
        res = float(np.sum((a @ np.array([c0, c1]) - y) ** 2))
        if res < best_res:
            best, best_res = (c0, c1), res
    assert best is not None
    return best


def _fit_inputs(nbytes: Any, times_s: Any, min_bytes: Any, relative: bool):
    x = np.asarray(nbytes, dtype=float).ravel()
    t = np.asarray(times_s, dtype=float).ravel()
    if x.shape != t.shape:
        raise ValueError(f"nbytes and times_s must have the same length, got {x.size} and {t.size}")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(t))):
        raise ValueError("nbytes and times_s must be finite")
    if np.any(x < 0) or np.any(t < 0):
        raise ValueError("nbytes and times_s must be >= 0")
    keep = x >= float(min_bytes)
    x, t = x[keep], t[keep]
    if np.unique(x).size < 2:
        raise ValueError(
            f"need measurements at >= 2 distinct sizes >= min_bytes={min_bytes}, "
            f"got {np.unique(x).size}"
        )
    if relative and np.any(t <= 0):
        raise ValueError("relative=True needs times_s > 0 (it divides by the measured time)")
    w = 1.0 / t if relative else np.ones_like(t)
    return x, t, w


def fit_alpha_beta(
    nbytes: Any, times_s: Any, *, min_bytes: int = 0, relative: bool = True
) -> tuple[float, float]:
    """Least-squares ``(alpha, beta)`` of ``time = alpha + beta * nbytes``, both ``>= 0``.

    ``relative=True`` minimises the relative error ``sum ((alpha + beta n - t) / t)^2``, so sizes
    from a few bytes to many MiB all count (an absolute fit is dominated by the largest sizes).
    Points with ``nbytes < min_bytes`` are dropped. Non-negativity is enforced exactly (the best
    of the unconstrained fit and the fits with one coefficient pinned at zero).

    Example::

        >>> n = [8, 1024, 2**20, 2**24]
        >>> a, b = fit_alpha_beta(n, [1e-4 + x * 1e-9 for x in n])
        >>> round(a * 1e6, 3), round(1 / b / 1e9, 3)      # 100 us, 1 GB/s
        (100.0, 1.0)
    """
    x, t, w = _fit_inputs(nbytes, times_s, min_bytes, relative)
    return _nonneg_lstsq(x, t, w)


def fit_gamma(nbytes: Any, times_s: Any, *, min_bytes: int = 0, relative: bool = True) -> float:
    """Reduction cost ``gamma`` (s/byte): slope of ``time = c + gamma * nbytes``, ``>= 0``.

    ``times_s`` are timings of a local reduction (``a += b``) of ``nbytes``; the fixed overhead
    ``c`` is fitted and discarded. Same weighting as :func:`fit_alpha_beta`.

    Example::

        >>> n = [1024, 2**16, 2**20, 2**24]
        >>> round(fit_gamma(n, [5e-6 + x * 2e-10 for x in n]) * 1e10, 6)
        2.0
    """
    x, t, w = _fit_inputs(nbytes, times_s, min_bytes, relative)
    return _nonneg_lstsq(x, t, w)[1]
