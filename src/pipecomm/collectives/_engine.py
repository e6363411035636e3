"""The progress engine: receives posted ahead, blocks forwarded on arrival, sends waited lazily.

The schedules of docs/algorithms.md (LP, Wang et al., arXiv 1611.04255; MST, BE and ring) run
here instead of in lock-step: receives posted ahead (:class:`RecvQueue`), a send posted the moment
its data is ready, a send waited only before its buffer is written again
(:meth:`Engine.release`) or at the end (:meth:`Engine.finish`). The combines, and so the bits of
the result, follow the lock-step order (docs/algorithms.md, "Conventions").

Example::

    eng = Engine(comm)
    q = eng.queue(prev, k, lambda j: block(flat, j, b))       # blocks 0, 1 posted now
    for j in range(k):
        eng.send(q.wait(j), nxt)                              # forward as soon as it is here
    eng.finish()
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable
from typing import Any

import torch

DEPTH = 2  # receives posted ahead per stream, at least
#: Scratch one stream of partial results may hold (bytes): within it every receive of the stream
#: is posted up front (:meth:`Engine.scratch_queue`); a larger stream reuses as many slots as fit.
SCRATCH_BYTES = 64 << 20


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class Engine:
    """One rank's outstanding sends of one collective, over ``comm`` (group indices).

    ``comm`` provides ``isend(t, peer)`` and ``irecv(t, peer)`` returning objects with
    ``wait()`` (:class:`pipecomm.collectives._group.Comm`, or a simulated transport in tests).

    Example::

        eng = Engine(comm)
        eng.send(flat, 1)
        eng.finish()
    """

    def __init__(self, comm: Any, depth: int = DEPTH) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1 receive posted ahead, got {depth}")
        self.comm = comm
        self.depth = depth
        self._starts: list[int] = []  # sorted start addresses of outstanding sends
        # start -> [(end, transfer, tensor)]; the tensor is kept alive until its send is waited
        self._sends: dict[int, list[tuple[int, Any, torch.Tensor]]] = {}
        self._longest = 0

    def send(self, t: torch.Tensor, peer: int, exclusive: bool = False) -> None:
        """Post the send of ``t`` to group index ``peer`` now (empty tensors are skipped).

        ``exclusive``: first wait for this rank's outstanding sends (one message on the port at
        a time, in schedule order: the single-port model; tree schedules' sends to children).
        """
        if t.numel() == 0:
            return
        if exclusive:
            self.finish()
        transfer = self.comm.isend(t, peer)
        start, end = _span(t)
        if start not in self._sends:
            bisect.insort(self._starts, start)
            self._sends[start] = []
        self._sends[start].append((end, transfer, t))
        self._longest = max(self._longest, end - start)

    def recv(self, t: torch.Tensor, peer: int) -> Any:
        """Post a receive into ``t`` from group index ``peer`` (after :meth:`release` of ``t``)."""
        self.release(t)
        return self.comm.irecv(t, peer) if t.numel() > 0 else None

    def release(self, t: torch.Tensor) -> None:
        """Wait for every outstanding send whose buffer overlaps ``t`` (before ``t`` is written)."""
        if not self._starts or t.numel() == 0:
            return
        lo, hi = _span(t)
        i = bisect.bisect_left(self._starts, hi)  # sends starting before hi may overlap
        while i > 0 and self._starts[i - 1] + self._longest > lo:
            i -= 1
            start = self._starts[i]
            keep = []
            for item in self._sends[start]:
                if item[0] > lo:
                    item[1].wait()
                else:
                    keep.append(item)
            if keep:
                self._sends[start] = keep
            else:
                del self._sends[start]
                del self._starts[i]

    def finish(self) -> None:
        """Wait for every outstanding send (the collective is complete on this rank after it)."""
        for start in self._starts:
            for _, transfer, _ in self._sends[start]:
                transfer.wait()
        self._starts.clear()
        self._sends.clear()
        self._longest = 0

    def queue(self, peer: int, count: int, buffer: Callable[[int], torch.Tensor],
              depth: int | None = None, lazy: bool = False) -> RecvQueue:
        """A stream of ``count`` messages from ``peer``; message ``j`` lands in ``buffer(j)``.

        ``lazy``: post nothing until the first :meth:`RecvQueue.wait` (for buffers that are still
        to be sent from before the stream's first message is due).
        """
        depth = self.depth if depth is None else depth
        return RecvQueue(self, peer, count, buffer, depth, lazy)

    def scratch_queue(self, peer: int, count: int, elems: int, like: torch.Tensor,
                      size: Callable[[int], int]) -> RecvQueue:
        """A stream of ``count`` partial results from ``peer`` into scratch slots of ``elems``
        elements of ``like``'s dtype (message ``j`` holds ``size(j)`` elements; views of the
        reusable :func:`scratch`), slots and receives ahead as :func:`scratch_slots` chooses.

        Example::

            q = eng.scratch_queue(prev, k, block_elems, flat, lambda j: blocks[j].numel())
            for j in range(k):
                combine(op, blocks[j], q.wait(j))
        """
        slots, depth = scratch_slots(count, elems, like, self.depth)
        m = len(slots)
        return RecvQueue(self, peer, count, lambda j: slots[j % m][: size(j)], depth)


class RecvQueue:
    """Messages ``0..count-1`` from one peer, ``depth`` receives posted ahead of the consumer.

    ``wait(j)`` (called for ``j = 0, 1, ...`` in order) first posts the receives up to
    ``j + depth`` — by then the caller is done with message ``j - 1``, so ``buffer`` may hand out
    ``depth + 1`` rotating scratch slots — then waits for message ``j`` and returns its buffer.

    Example::

        q = eng.queue(peer, k, lambda j: scratch[j % 3])     # depth 2: three slots
        for j in range(k):
            combine(op, mine(j), q.wait(j))
    """

    def __init__(self, engine: Engine, peer: int, count: int, buffer: Callable[[int], torch.Tensor],
                 depth: int, lazy: bool = False) -> None:
        self.engine, self.peer, self.count, self.buffer = engine, peer, count, buffer
        self.depth = max(1, depth)
        self._posted: dict[int, tuple[torch.Tensor, Any]] = {}
        self._next = 0  # first message not yet posted
        if not lazy:
            self._post_until(self.depth)

    def _post_until(self, stop: int) -> None:
        while self._next < min(stop, self.count):
            buf = self.buffer(self._next)
            self._posted[self._next] = (buf, self.engine.recv(buf, self.peer))
            self._next += 1

    def wait(self, j: int) -> torch.Tensor:
        """Message ``j``'s buffer, once it has arrived (messages are consumed in order)."""
        self._post_until(j + 1 + self.depth)
        buf, transfer = self._posted.pop(j)
        if transfer is not None:
            transfer.wait()
        return buf


def scratch_slots(count: int, elems: int, like: torch.Tensor,
                  depth: int = DEPTH) -> tuple[tuple[torch.Tensor, ...], int]:
    """Scratch slots of ``elems`` elements of ``like``'s dtype for a stream of ``count`` partial
    results, and how many receives to keep posted ahead: one slot per message and all posted up
    front when they fit in :data:`SCRATCH_BYTES`, else as many slots as fit (at least
    ``depth + 1``) with one fewer receives ahead than slots (message ``j`` lands in slot
    ``j % len(slots)``; its slot's previous message was consumed before it is posted).

    Example::

        slots, ahead = scratch_slots(k, block_elems, flat)
    """
    elems = max(1, elems)
    fit = SCRATCH_BYTES // (elems * like.element_size())
    m = max(1, min(count, max(depth + 1, fit)))
    return scratch(m * elems, like).view(m, elems).unbind(0), (count if m >= count else m - 1)


_SCRATCH: dict[tuple, torch.Tensor] = {}


def scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A reusable scratch buffer of ``numel`` elements of ``like``'s dtype and device.

    Kept across calls (one per thread, dtype and device; it grows to the largest request). One
    user at a time per thread: a schedule finishes with it before it asks again.

    Example::

        buf = scratch(1 << 20, flat)[: 1000]
    """
    key = (threading.get_ident(), like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        _SCRATCH[key] = buf
    return buf[:numel]
