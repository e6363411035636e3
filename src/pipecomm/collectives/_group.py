"""The group a collective runs over: its members (global ranks) and the transport for p2p ops.

No paper equation: this is the bookkeeping every schedule of ``docs/algorithms.md`` needs.
Schedules address peers by *group index* (0..p-1, the order of
``dist.get_process_group_ranks(group)``); :meth:`Comm.exchange` maps them to global ranks and hands
the step to :func:`pipecomm.collectives.p2p.exchange`, the only transport pipecomm's own
algorithms use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipecomm.collectives import p2p


@dataclass(frozen=True)
class Comm:
    """One rank's view of a group: ``members[index]`` is this rank's global rank.

    ``transport`` is the process group the point-to-point operations run on: the user's group
    for synchronous calls, :func:`pipecomm.launch.comm_group` on the communication thread.
    """

    members: tuple[int, ...]
    index: int
    transport: dist.ProcessGroup | None

    @property
    def size(self) -> int:
        return len(self.members)

    def exchange(
        self,
        sends: Sequence[tuple[torch.Tensor, int]],
        recvs: Sequence[tuple[torch.Tensor, int]],
    ) -> None:
        """One step: post all ``(tensor, group_index)`` sends and receives together, wait for all.

        Empty tensors are dropped (both sides of a transfer compute the same size, so they agree).
        """
        s = [(t, self.members[i]) for t, i in sends if t.numel() > 0]
        r = [(t, self.members[i]) for t, i in recvs if t.numel() > 0]
        if s or r:
            p2p.exchange(s, r, self.transport)


def members_of(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    """Global ranks of ``group`` in group order, or ``None`` if this rank is not a member.

    Example::

        members_of(None)          # (0, 1, ..., world_size - 1)
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start ranks with pipecomm.launch.spawn / "
            "Ranks, or call pipecomm.launch.init_from_env() (or dist.init_process_group) first"
        )
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
        )
    members = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    return members if dist.get_rank() in members else None


def make_comm(members: tuple[int, ...], transport: dist.ProcessGroup | None) -> Comm:
    """The :class:`Comm` of this rank in ``members`` (it must be one of them)."""
    return Comm(members, members.index(dist.get_rank()), transport)
