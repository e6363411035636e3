"""Decentralized training (DAdam; Wang, Zhang, Wu, Johansson, ICLR 2025).

* :mod:`.topology` - which ranks average at each iteration (complete, ring, one-peer-exp,
  alternating-exp-ring / aer, random-matching) and their mixing matrices.
* :mod:`.optim` - AccumAdam / AccumAdamW (Algorithm 4: moments fed with window-averaged gradients).

* ``DecentralizedDataParallel`` (:mod:`.ddp`) - gossip overlapped with the next iteration.
  Its buckets and their process groups are in :mod:`.gossip`, its
  construction checks (arguments, equal replicas, the optimizer) in :mod:`.replicas`.

Example::

    >>> from pipecomm.decentralized import topology, DecentralizedDataParallel, AccumAdam, AccumAdamW
    >>> topo = topology.get_topology("aer", 16, ranks_per_node=4)
"""

from __future__ import annotations

from . import topology
from .ddp import DecentralizedDataParallel
from .optim import AccumAdam, AccumAdamW
from .topology import get_topology

__all__ = ["AccumAdam", "AccumAdamW", "DecentralizedDataParallel", "get_topology", "topology"]

