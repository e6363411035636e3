"""Collectives on point-to-point operations: linear pipelining (LP) and its baselines.

LP — Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural
Networks" (arXiv 1611.04255) — against minimum-spanning-tree (``"mst"``), bidirectional-exchange
(``"be"``) and ring (``"ring"``) schedules, and the backend's built-in (``"torch"``). Every
algorithm but ``"torch"`` is built only on :mod:`pipecomm.collectives.p2p` (single messages
posted and waited for later), so the emulated network (:mod:`pipecomm.lab.networks.netem`) sees all of their
transfers. Exact schedules: ``lp``, ``mst``, ``be``, ``ring`` modules, run by the progress engine
``_engine`` (receives posted ahead, blocks forwarded on arrival, sends waited lazily); dispatch
and argument checks: ``api``; the communication thread of ``async_op=True``: ``async_`` (its CUDA
stream ordering: ``_streams``).

Example::

    >>> import torch, torch.distributed as dist
    >>> from pipecomm import collectives
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> grad, weights, stats = torch.ones(4), torch.zeros(4), torch.tensor([2.0])
    >>> collectives.allreduce(grad, algorithm="lp", op="avg")
    tensor([1., 1., 1., 1.])
    >>> collectives.broadcast(weights, src=0, algorithm="mst")
    tensor([0., 0., 0., 0.])
    >>> h = collectives.reduce(stats, dst=0, op="max", async_op=True); h.wait()
    tensor([2.])
    >>> dist.destroy_process_group()
"""

from pipecomm.collectives._reduce import OPS, SUPPORTED_DTYPES
from pipecomm.collectives.agreement import MismatchError
from pipecomm.collectives.api import ALGORITHMS, COMPRESSIONS, allreduce, broadcast, reduce
from pipecomm.collectives.async_ import Handle

__all__ = ["ALGORITHMS", "COMPRESSIONS", "OPS", "SUPPORTED_DTYPES", "Handle", "MismatchError",
           "allreduce", "broadcast", "reduce"]
