"""Point-to-point transport shared by every pipecomm collective.

One primitive, :func:`exchange`: post a set of sends and receives at once, return when all are
done. Batching keeps NCCL free of deadlocks (``batch_isend_irecv``) and is where the emulated
network (:mod:`pipecomm.netem`) applies its per-link deadlines.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send each ``(tensor, dst)`` and receive into each ``(tensor, src)``; ranks are global.

    All operations are posted together and waited for together. Tensors must be contiguous.

    Example::

        # rank 0 and rank 1 swap a block
        exchange([(mine, peer)], [(theirs, peer)])
    """
    ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if not ops:
        return
    for work in dist.batch_isend_irecv(ops):
        work.wait()
