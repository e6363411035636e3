"""The group a collective runs over: its members (global ranks) and the transport for p2p ops.

No paper equation: this is the bookkeeping every schedule of ``docs/algorithms.md`` needs.
Schedules address peers by *group index* (0..p-1, the order of
``dist.get_process_group_ranks(group)``); :meth:`Comm.isend` / :meth:`Comm.irecv` map them to
global ranks and post single messages for the progress engine (:mod:`._engine`) through
:func:`pipecomm.collectives.p2p.post_send` / ``post_recv``, :meth:`Comm.direct` straight to the
backend. Messages toward a lower global rank travel on a connection of their own
(:func:`pipecomm.collectives.async_.reverse_transport`), so both directions of a pair move at once.

On an NCCL group the posts are collected and go out together as one ``batch_isend_irecv``
whenever the rank waits for any transfer (why: docs/algorithms.md, "The communication thread:
GIL switch interval and one connection per direction").
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import observe
from pipecomm.collectives import async_, p2p


@dataclass(frozen=True)
class Comm:
    """One rank's view of a group: ``members[index]`` is this rank's global rank.

    ``transport`` is the process group the point-to-point operations run on: the user's group
    for synchronous calls, :func:`pipecomm.collectives.async_.comm_group` on the communication thread.
    """

    members: tuple[int, ...]
    index: int
    transport: dist.ProcessGroup | None
    reverse: tuple[dist.ProcessGroup, int] | None = None  # (group, tag) toward lower ranks

    @property
    def size(self) -> int:
        return len(self.members)

    def _route(self, lower: bool) -> tuple[dist.ProcessGroup | None, int]:
        """Group and tag of a message that travels toward the lower global rank (``lower``)
        or the higher one: each direction of a pair on a connection of its own
        (:func:`pipecomm.collectives.async_.reverse_transport`)."""
        if lower and self.reverse is not None:
            return self.reverse
        return self.transport, 0

    @functools.cached_property
    def batched(self) -> bool:
        """Whether posts are collected into batches (NCCL, see the module docstring)."""
        return dist.get_backend(self.transport) == "nccl"

    def isend(self, t: torch.Tensor, peer: int) -> p2p.Transfer | _Batched:
        """Post the send of ``t`` to group index ``peer``; ``.wait()`` on the result."""
        dst = self.members[peer]
        if self.batched:
            return _batch(self.transport).add(dist.isend, t, dst)
        group, tag = self._route(dst < self.members[self.index])
        return p2p.post_send(t, dst, group, tag)

    def irecv(self, t: torch.Tensor, peer: int) -> p2p.Transfer | _Batched:
        """Post a receive into ``t`` from group index ``peer``; ``.wait()`` on the result."""
        src = self.members[peer]
        if self.batched:
            return _batch(self.transport).add(dist.irecv, t, src)
        group, tag = self._route(self.members[self.index] < src)
        return p2p.post_recv(t, src, group, tag)

    def direct(self, peer: int, send: bool, like: torch.Tensor) -> p2p.Direct | None:
        """A poster straight to the backend for messages to (``send``) or from group index
        ``peer`` on their route (:func:`pipecomm.collectives.p2p.direct`), or ``None`` where the
        messages must go through :meth:`isend` / :meth:`irecv` (NCCL's batches, an emulated
        network, staged CUDA tensors)."""
        if self.batched:
            return None
        rank, me = self.members[peer], self.members[self.index]
        group, tag = self._route(rank < me if send else me < rank)
        return p2p.direct(like, rank, group, tag, send)


class _Batch:
    """NCCL posts not yet issued; any wait issues all pending ones as one batch."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.ops: list[dist.P2POp] = []
        self.pending: list[_Batched] = []

    def add(self, fn: Any, t: torch.Tensor, peer: int) -> _Batched:
        self.ops.append(dist.P2POp(fn, t, peer, self.group))
        op = "send" if fn is dist.isend else "recv"
        item = _Batched(self, op, peer, observe.posted(op, peer, t.nbytes))
        self.pending.append(item)
        return item

    def flush(self) -> None:
        if self.ops:
            works = dist.batch_isend_irecv(self.ops)
            for item, work in zip(self.pending, works):
                item.work = work
            self.ops, self.pending = [], []


class _Batched:
    """One NCCL post of a :class:`_Batch` (``op`` with global rank ``peer``)."""

    def __init__(self, batch: _Batch, op: str, peer: int, entry: list | None) -> None:
        self.batch, self.work = batch, None
        self.op, self.peer, self.entry = op, peer, entry  # entry: the flight recorder's

    def wait(self) -> None:
        self.batch.flush()  # every wait first issues all that is pending (it may be needed)
        p2p.wait_message([self.work], self.op, self.peer, self.entry)


_BATCHES: dict[tuple[int, int], _Batch] = {}


def _batch(group: dist.ProcessGroup | None) -> _Batch:
    key = (threading.get_ident(), id(group))
    if key not in _BATCHES:
        _BATCHES[key] = _Batch(group)
    return _BATCHES[key]


def members_of(group: dist.ProcessGroup | None) -> tuple[int, ...] | None:
    """Global ranks of ``group`` in group order, or ``None`` if this rank is not a member.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> members_of(None)          # (0, 1, ..., world_size - 1)
        (0,)
        >>> dist.destroy_process_group()
    """
    async_.initialised("collectives")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    members = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
    return members if dist.get_rank() in members else None


def make_comm(members: tuple[int, ...], transport: dist.ProcessGroup | None) -> Comm:
    """The :class:`Comm` of this rank in ``members`` (it must be one of them), with the
    transport of the reverse direction where there is one."""
    return Comm(members, members.index(dist.get_rank()), transport,
                async_.reverse_transport(transport))
