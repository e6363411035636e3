"""Gossip buckets of DecentralizedDataParallel: parameters mixed together, their process groups.

A :class:`Bucket` holds the parameters updated and gossiped together (their flat buffer, its
views, the in-flight gossip); :func:`as_one_block` makes a bucket's parameters views of one
contiguous block; :func:`subgroup` creates (once) the process group of a topology's group of
ranks. Used by :class:`pipecomm.decentralized.ddp.DecentralizedDataParallel`.

Example::

    >>> import torch.distributed as dist
    >>> from pipecomm.decentralized.gossip import subgroup
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> pg = subgroup((0,), whole_world=True)   # on every rank, in the same order
    >>> dist.get_world_size(pg)
    1
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import distributed_c10d as c10d

from pipecomm.collectives.async_ import group_timeout
from pipecomm.decentralized.topology import Topology

__all__ = ["Bucket", "as_one_block", "subgroup", "topology_groups"]

# Process groups of the topologies' groups (global ranks), created once per process and reused:
# key -> (the world they were made in, the group).
_PROCESS_GROUPS: dict[tuple[Any, ...], tuple[dist.ProcessGroup, Any]] = {}


@torch.no_grad()
def as_one_block(params: list[nn.Parameter]) -> torch.Tensor | None:
    """Move ``params`` (one dtype and device) into one contiguous tensor, each parameter a view of
    its slice (``p.data`` is replaced; the parameter objects stay), so that copying the bucket to
    and from its gossip buffer is one copy. Parameters that are not plain contiguous tensors
    (e.g. channels-last) keep their storage: returns ``None``.

    Example::

        >>> block = as_one_block(list(torch.nn.Linear(4, 2).parameters()))
        >>> block.numel()
        10
    """
    if not all(p.is_contiguous() for p in params):
        return None
    block = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype,
                        device=params[0].device)
    off = 0
    for p in params:
        view = block[off : off + p.numel()].view(p.shape)
        view.copy_(p.detach())
        p.data = view
        off += p.numel()
    return block


def subgroup(ranks: tuple[int, ...], whole_world: bool) -> dist.ProcessGroup:
    """The process group of the global ``ranks`` (created on first use, then reused).

    With ``whole_world`` every rank of the default group calls this, in the same order
    (``dist.new_group``); otherwise only the members of ``ranks`` call it (why:
    docs/algorithms.md, "What torch 2.13 allows `pipecomm.backend` to do, and where it stops").
    The group takes the world's timeout (:func:`pipecomm.collectives.async_.group_timeout`).

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> pg = subgroup((0,), whole_world=False)   # called on the group's ranks only
        >>> dist.get_world_size(pg)
        1
        >>> dist.destroy_process_group()
    """
    key = (id(dist.group.WORLD), dist.get_world_size(), whole_world, ranks)
    cached = _PROCESS_GROUPS.get(key)
    if cached is not None and cached[0] is dist.group.WORLD:
        return cached[1]
    timeout = group_timeout()
    if whole_world:
        pg = dist.new_group(list(ranks), timeout=timeout)
    else:
        name = "pipecomm-ddp-" + hashlib.sha1(repr(ranks).encode()).hexdigest()[:20]
        pg, _ = c10d._new_process_group_helper(
            len(ranks),
            ranks.index(dist.get_rank()),
            list(ranks),
            dist.get_backend(),
            c10d._get_default_store(),
            name,
            timeout=timeout,
        )
        c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(ranks)}
    _PROCESS_GROUPS[key] = (dist.group.WORLD, pg)  # the world kept: its id is never reused
    return pg


def topology_groups(topo: Topology, members: Sequence[int]) -> dict[tuple[int, ...], Any]:
    """{group: its process group} of ``topo``'s groups of more than one rank that this rank is
    in (``topo`` over the indices of ``members``, the global ranks that train; every group
    where they are the world, made on every rank in the same order): :func:`subgroup`.

    Example::

        >>> from pipecomm.decentralized.topology import get_topology
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> topology_groups(get_topology("ring", 1), [0])     # a group of one never communicates
        {}
        >>> dist.destroy_process_group()
    """
    whole, me = len(members) == dist.get_world_size(), list(members).index(dist.get_rank())
    return {g: subgroup(tuple(members[r] for r in g), whole) for g in topo.distinct_groups()
            if len(g) > 1 and (whole or me in g)}


@dataclass(eq=False)
class Bucket:
    """Parameters updated and gossiped together, their flat buffer and gossip.

    Example::

        b.to_flat(); b.handle = collectives.allreduce(b.flat, op="avg", group=g, async_op=True)
    """

    index: int
    indices: list[int]  # positions in the parameters of DecentralizedDataParallel
    names: list[str]
    params: list[nn.Parameter]
    groups: list[tuple[int, list[nn.Parameter]]]  # (optimizer group, the bucket's share of it)
    flat: torch.Tensor  # gossip buffer: x^{k+1} when launched, y^{k+1} once completed
    views: list[torch.Tensor]  # views of `flat` shaped like the parameters
    block: torch.Tensor | None = None  # the parameters' own storage when they are views of it
    handle: Any = None  # in-flight gossip (None: nothing to mix, e.g. a group of one rank)
    ready: set[int] = field(default_factory=set)  # parameters whose gradient is complete
    updated: bool = False  # mixed and stepped in the current iteration

    def to_flat(self) -> None:
        """``flat <- parameters`` (one copy when the parameters live in ``block``)."""
        if self.block is not None:
            self.flat.copy_(self.block)
        else:
            torch._foreach_copy_(self.views, [p.detach() for p in self.params])

    def from_flat(self) -> None:
        """``parameters <- flat``."""
        if self.block is not None:
            self.block.copy_(self.flat)
        else:
            torch._foreach_copy_([p.detach() for p in self.params], self.views)
