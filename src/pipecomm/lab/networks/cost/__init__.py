"""Alpha-beta-gamma cost models of pipecomm's collectives, the LP block size, and fitting.

One concept: the predicted time of a collective on a link described by three numbers,

* ``alpha`` -- seconds per message (latency),
* ``beta``  -- seconds per byte on the wire (1 / bandwidth),
* ``gamma`` -- seconds per byte reduced locally (the add of a reduction),

and a port model (``"single"``: one full-duplex port per rank, a rank's messages of one step
serialise; ``"per-neighbor"``: one link per ordered pair of ranks). The formulas are those of the
schedules pipecomm implements (``docs/algorithms.md``): LP after Wang et al. (arXiv 1611.04255),
MST and BE after Thakur, Rabenseifner & Gropp (2005) and Chan et al. (2007), ring after Patarasuk
& Yuan (2009). An empty message (``n = 0``) or a single rank (``p = 1``) costs nothing.

Modules (every public name is importable from ``pipecomm.lab.networks.cost``):

====================  ==============================================================================
:mod:`.link`          :class:`LinkModel`, the shared vocabulary (``ALGORITHMS``, ``OPS``,
                      ``PORTS``), the fallback calibration and the argument checks
:mod:`.lockstep`      the paper's lock-step models of every schedule: :func:`broadcast_time`,
                      :func:`reduce_time`, :func:`allreduce_time`, :func:`collective_time`, LP's
                      optimal block (:func:`lp_optimal_block_bytes`,
                      :func:`lp_analytic_block_bytes`)
:mod:`.overlapped`    LP as the progress engine runs it: :func:`lp_overlapped_time`,
                      :func:`lp_overlapped_block_bytes`, :func:`overlapped_time`
:mod:`.calibration`   links from E0's calibration and the emulated network (:func:`calibrated_link`,
                      :func:`link_from_network`) and the fits (:func:`fit_alpha_beta`,
                      :func:`fit_gamma`)
:mod:`.tables`        :func:`model_table`, the models over a grid, for notebooks
:mod:`.host`          the real backend on one host: :class:`HostLink`, :func:`host_link`,
                      :func:`lp_time_on_host`, :func:`lp_block_bytes_on_host`
====================  ==============================================================================

Example::

    >>> from pipecomm.lab.networks import cost
    >>> link = cost.LinkModel(alpha=10e-6, beta=1 / 10e9)
    >>> round(cost.broadcast_time("mst", 2**28, 64, link), 4)     # 6 rounds of the whole message
    0.1611
"""

from __future__ import annotations

# re-exported: public API (pipecomm.lab.networks.cost.<name>)
from pipecomm.lab.networks.cost.calibration import (
    calibrated_link,
    fit_alpha_beta,
    fit_gamma,
    link_from_network,
)
from pipecomm.lab.networks.cost.host import (
    DEFAULT_LINK_TABLE,
    DEFAULT_MESSAGE_LATENCY_S,  # noqa: F401 -- public, outside __all__ (as before)
    DEFAULT_MESSAGE_OVERHEAD_S,
    HostLink,
    host_link,
    lp_block_bytes_on_host,
    lp_time_on_host,
)
from pipecomm.lab.networks.cost.link import (
    ALGORITHMS,
    DEFAULT_ALPHA_S,
    DEFAULT_BANDWIDTH_BPS,
    DEFAULT_GAMMA_S_PER_BYTE,
    DEFAULT_MIN_BLOCK_BYTES,
    OPS,
    PORTS,
    LinkModel,
    as_count,  # noqa: F401 -- public, outside __all__ (as before)
)
from pipecomm.lab.networks.cost.lockstep import (
    allreduce_time,
    broadcast_time,
    collective_time,
    lp_analytic_block_bytes,
    lp_optimal_block_bytes,
    reduce_time,
)
from pipecomm.lab.networks.cost.overlapped import (
    LP_MODELS,
    lp_overlapped_block_bytes,
    lp_overlapped_time,
    overlapped_time,
)
from pipecomm.lab.networks.cost.tables import model_table

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALPHA_S",
    "DEFAULT_BANDWIDTH_BPS",
    "DEFAULT_GAMMA_S_PER_BYTE",
    "DEFAULT_LINK_TABLE",
    "DEFAULT_MESSAGE_OVERHEAD_S",
    "DEFAULT_MIN_BLOCK_BYTES",
    "OPS",
    "PORTS",
    "LP_MODELS",
    "HostLink",
    "LinkModel",
    "allreduce_time",
    "broadcast_time",
    "calibrated_link",
    "collective_time",
    "fit_alpha_beta",
    "fit_gamma",
    "host_link",
    "link_from_network",
    "lp_analytic_block_bytes",
    "lp_block_bytes_on_host",
    "lp_optimal_block_bytes",
    "lp_overlapped_block_bytes",
    "lp_overlapped_time",
    "lp_time_on_host",
    "model_table",
    "overlapped_time",
    "reduce_time",
]
