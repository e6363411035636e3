"""Every rank of a collective must make the same call: checked before any data moves.

Before the first data message every member learns every member's :class:`Call` (an allgather
of a few integers, :func:`allgather_rows`, straight to the backend under :data:`TAG`), and all
of them raise the same :class:`MismatchError`, naming each rank's call, if any differs. Why, and
why one round before any data: docs/algorithms.md, "Ranks that disagree".

Example::

    call = Call("allreduce", "lp", "sum", -1, 1000, torch.float32, 256, None)
    check(call, comm)     # every rank returns, or every rank raises MismatchError
"""

from __future__ import annotations

import contextlib
import math
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import vocab
from pipecomm.collectives._group import make_comm, members_of
from pipecomm.collectives._reduce import OPS, SUPPORTED_DTYPES
from pipecomm.collectives.p2p import _process_group, wait_all

#: The tag of the check's messages: above every tag the schedules use (0 and ``1 + 30 bits``,
#: :func:`pipecomm.collectives.async_.reverse_transport`), so they never match a schedule's message.
TAG = (1 << 30) + 1
KINDS: tuple[str, ...] = ("allreduce", "broadcast", "reduce")
#: Up to this many members the allgather is one round of ``p - 1`` messages each way, above it
#: Bruck's rounds (why: docs/algorithms.md, "Ranks that disagree").
DIRECT_MAX = 32
_SKIP = threading.local()


class MismatchError(ValueError):
    """The ranks of a group called a collective with different arguments (raised on every
    member, before any data moved)."""


@dataclass(frozen=True)
class Call:
    """What every member of a collective must pass alike. ``root`` is a group index (-1: none),
    ``block_elems`` LP's elements per block (0: not LP), ``compression`` a codec name or
    ``None``, ``tuning`` what ``algorithm="auto"`` chose from (0: not auto;
    :func:`pipecomm.collectives.api.tuning`).

    Example::

        >>> Call("broadcast", "mst", "sum", 0, 4096, torch.float16, 0, None).describe()
        "broadcast(algorithm='mst', src=0, numel=4096, dtype=float16)"
    """

    kind: str
    algorithm: str
    op: str
    root: int
    numel: int
    dtype: torch.dtype
    block_elems: int
    compression: str | None
    tuning: int = 0

    @classmethod
    def of(cls, kind: str, t: torch.Tensor, algorithm: str, op: str, root: int | None,
           block_elems: int = 0, codec: Any = None, tuning: int = 0) -> Call:
        """The call of ``kind`` on ``t`` (``root`` a group index or ``None``; ``codec`` a codec
        object or ``None``) as a public entry point receives it.

        Example::

            >>> Call.of("broadcast", torch.ones(8), "lp", "sum", 0, block_elems=8)
            Call(kind='broadcast', algorithm='lp', op='sum', root=0, numel=8, dtype=torch.float32,
                 block_elems=8, compression=None, tuning=0)
        """
        name = None if codec is None else getattr(codec, "name", "") or type(codec).__name__
        return cls(kind, algorithm, op, -1 if root is None else root, t.numel(), t.dtype,
                   block_elems, name, tuning)

    def encode(self) -> list[int]:
        """The call as nine integers (names by their index in pipecomm's vocabularies)."""
        codec = 0 if self.compression is None else 1 + (zlib.crc32(self.compression.encode())
                                                        & 0x3FFFFFFF)
        return [KINDS.index(self.kind), vocab.ALGORITHMS.index(self.algorithm),
                OPS.index(self.op), self.root, self.numel, SUPPORTED_DTYPES.index(self.dtype),
                self.block_elems, codec, self.tuning]

    def describe(self, members: tuple[int, ...] | None = None) -> str:
        """``kind(algorithm=..., op=..., root, numel=..., dtype=..., ...)`` as a user wrote it;
        ``members`` turns the root's group index into its global rank."""
        parts = [f"algorithm={self.algorithm!r}"]
        if self.kind != "broadcast":
            parts.append(f"op={self.op!r}")
        if self.root >= 0:
            root = members[self.root] if members and self.root < len(members) else self.root
            parts.append(f"{'src' if self.kind == 'broadcast' else 'dst'}={root}")
        parts += [f"numel={self.numel}", f"dtype={str(self.dtype).replace('torch.', '')}"]
        if self.block_elems:
            parts.append(f"block_elems={self.block_elems}")
        if self.compression is not None:
            parts.append(f"compression={self.compression!r}")
        if self.tuning:
            parts.append(f"tuning={self.tuning:08x}")
        return f"{self.kind}({', '.join(parts)})"


def _decoded(row: list[int], mine: Call, members: tuple[int, ...]) -> str:
    """A peer's encoded call, described (a codec is named only when it is this rank's)."""
    kind, alg, op, root, numel, dtype, block, codec, tuning = row
    compression = None if codec == 0 else (mine.compression if codec == mine.encode()[7]
                                          else "<another codec>")
    return Call(KINDS[kind], vocab.ALGORITHMS[alg], OPS[op], root, numel,
                SUPPORTED_DTYPES[dtype], block, compression, tuning).describe(members)


def allgather_rows(row: list[int], comm: Any,
                   device: torch.device | str = "cpu") -> list[list[int]]:
    """Every member's ``row`` (equal-length lists of integers), in group order, on every member,
    over ``comm`` (:class:`pipecomm.collectives._group.Comm`) under :data:`TAG`: one round of
    ``p - 1`` messages each way up to :data:`DIRECT_MAX` members, else Bruck's allgather in
    ``ceil(log2 p)`` rounds of one message each way.

    Example::

        allgather_rows([dist.get_rank()], comm)    # [[0], [1], ..., [p - 1]]
    """
    p, i, width = comm.size, comm.index, len(row)
    if p <= DIRECT_MAX:
        out = torch.empty(p, width, dtype=torch.int64, device=device)
        out[i] = torch.tensor(row, dtype=torch.int64)
        others = [(i + d) % p for d in range(1, p)]
        _post(comm, [(out[i], j) for j in others], [(out[j], j) for j in others])
        return out.tolist()
    held = torch.empty(p, width, dtype=torch.int64, device=device)
    held[0] = torch.tensor(row, dtype=torch.int64)
    have = 1  # held[j] is the row of group index (i + j) mod p
    for r in range(math.ceil(math.log2(p))):
        d = 1 << r
        count = min(d, p - have)
        _post(comm, [(held[:count].clone(), (i - d) % p)],
              [(held[have:have + count], (i + d) % p)])
        have += count
    return held.roll(i, 0).tolist()


def _post(comm: Any, sends: list[tuple[torch.Tensor, int]],
          recvs: list[tuple[torch.Tensor, int]]) -> None:
    """One round: every ``(tensor, group index)`` send and receive posted, then all waited."""
    if comm.batched:  # NCCL: posted together, as the schedules' batches are
        ops = [dist.P2POp(dist.irecv, t, comm.members[j], comm.transport, TAG) for t, j in recvs]
        ops += [dist.P2POp(dist.isend, t, comm.members[j], comm.transport, TAG) for t, j in sends]
        works = dist.batch_isend_irecv(ops)
    else:
        works = []
        for t, j in recvs:
            pg, rank = _process_group(comm.transport, comm.members[j])
            works.append(pg.recv([t], rank, TAG))
        for t, j in sends:
            pg, rank = _process_group(comm.transport, comm.members[j])
            works.append(pg.send([t], rank, TAG))
    wait_all(works, [("recv", comm.members[j]) for _, j in recvs]
             + [("send", comm.members[j]) for _, j in sends])  # an error names the peer


@contextlib.contextmanager
def skipped() -> Iterator[None]:
    """Synchronous calls of this thread inside skip the check: what a benchmark times to price
    it (``benchmarks/bench_collectives.py --check-cost``). A mismatch there aborts gloo or
    returns a wrong result, as before the check existed: not for training code.

    Example::

        >>> from pipecomm import collectives
        >>> from pipecomm.collectives import agreement
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> t = torch.ones(4)
        >>> with agreement.skipped():
        ...     collectives.allreduce(t, algorithm="ring")
        tensor([1., 1., 1., 1.])
        >>> dist.destroy_process_group()
    """
    before = getattr(_SKIP, "on", False)
    _SKIP.on = True
    try:
        yield
    finally:
        _SKIP.on = before


def check_alone(kind: str, t: torch.Tensor, *, algorithm: str = "lp", op: str = "sum",
                root: int = 0, group: dist.ProcessGroup | None = None) -> None:
    """The check a synchronous pipecomm call of ``kind`` on ``t`` over ``group`` makes before
    it moves data (``root`` a group index), on its own: what a benchmark times to price it.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> check_alone("allreduce", torch.ones(1024), algorithm="ring")
        >>> dist.destroy_process_group()
    """
    members = members_of(group)
    if members is None or len(members) == 1:
        return
    call = Call.of(kind, t, algorithm, op, None if kind == "allreduce" else root)
    check(call, make_comm(members, group), t)


def check(call: Call, comm: Any, like: torch.Tensor | None = None) -> None:
    """Return on every member if every member of ``comm`` passed the same ``call``; else raise
    :class:`MismatchError` on every member, naming each rank's call (global ranks). ``like``:
    the call's tensor, whose device the messages use where the transport needs it (NCCL).

    Example::

        check(Call("allreduce", "ring", "avg", -1, t.numel(), t.dtype, 0, None), comm)
    """
    if getattr(_SKIP, "on", False):
        return
    device = like.device if like is not None and comm.batched else "cpu"
    rows = allgather_rows(call.encode(), comm, device)
    if all(r == rows[0] for r in rows):
        return
    by_call: dict[str, list[int]] = {}
    for rank, r in zip(comm.members, rows):
        by_call.setdefault(_decoded(r, call, comm.members), []).append(rank)
    sides = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {what}"
                      for what, rs in by_call.items())
    raise MismatchError(
        f"{call.kind}: the {comm.size} ranks of the group called it with different arguments "
        f"({sides}); every rank must pass the same op, algorithm, root, numel, dtype and "
        "block size (auto: read the same tuning table). Nothing was sent or changed"
    )
