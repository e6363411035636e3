"""``algorithm="torch"``: the backend's own collectives (gloo, NCCL), as the reference.

No paper equation; this is the "built-in" line of the LP paper's comparisons and the oracle of the
tests. ``op="avg"`` is a sum followed by a division by p (gloo has no AVG), done by every rank
(allreduce) or by ``dst`` (reduce).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def start(
    kind: str,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: str,
    root: int | None,
    async_op: bool,
) -> tuple[object | None, Callable[[int, bool], None]]:
    """Issue ``dist.all_reduce`` / ``broadcast`` / ``reduce`` on a contiguous ``tensor``.

    ``root`` is a global rank. Returns the backend's work (``None`` when synchronous) and the
    finishing step ``finish(p, is_root)`` (the ``avg`` division) to run once it has completed.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> flat = torch.full((4,), 2.0)
        >>> work, finish = start("allreduce", flat, None, "avg", None, async_op=False)
        >>> finish(dist.get_world_size(), False)
        >>> flat
        tensor([2., 2., 2., 2.])
        >>> dist.destroy_process_group()
    """
    if kind == "allreduce":
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)
    elif kind == "broadcast":
        work = dist.broadcast(tensor, src=root, group=group, async_op=async_op)
    else:
        work = dist.reduce(tensor, dst=root, op=_REDUCE_OPS[op], group=group, async_op=async_op)

    def finish(p: int, is_root: bool) -> None:
        if op == "avg" and (kind == "allreduce" or is_root):
            tensor.div_(p)

    return work, finish
