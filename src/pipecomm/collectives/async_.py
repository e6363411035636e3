"""Asynchronous collectives: one communication thread per process, a FIFO of operations.

Pipe-SGD (Li et al., NeurIPS 2018) and layer-wise GD (Daily et al., 2017) overlap the AllReduce
of one step with the computation of the next. pipecomm runs the point-to-point schedules of an
asynchronous collective on a daemon thread, in the order they were issued (the same order on every
rank, so the ranks' transfers match), on :func:`pipecomm.launch.comm_group` — a process group of
its own — while the main thread computes (torch kernels and transfer waits release the GIL).

A :class:`Handle` is what an ``async_op=True`` call returns: ``wait()`` returns the result tensor
or re-raises the error the operation hit on the thread; ``is_completed()`` polls. A transfer that
failed there (a dead peer, or one stalled past the communication group's timeout, which is the
world's) is re-raised as :class:`pipecomm.collectives.p2p.TransferError` naming the collective,
the operation and the peer's rank.

When the thread starts it lowers the interpreter's GIL switch interval from Python's 5 ms to
0.1 ms (``PIPECOMM_SWITCH_INTERVAL_S`` overrides; ``0`` keeps Python's): otherwise every time the
communication thread wakes up (a message arrived, a deadline passed) it may wait up to 5 ms for a
main thread that is running Python between torch kernels, which measurably stretches an
overlapped AllReduce (experiments E6-E9 run with the lowered interval).

CUDA tensors: a job runs with its tensor's device current (CUDA's current device is per thread)
on a communication stream of its own, ordered by events against the caller's stream
(:mod:`._streams`): it starts after the kernels that produced the tensor, and after ``wait()`` the
caller's later kernels run after it, while the computation in between overlaps it. Use ``wait()``
(not only ``is_completed()``) before reading a CUDA result: ``wait()`` adds the stream ordering.
CPU tensors run as they are (the CPU fallback). (Not yet run on a GPU: see artifact/ARTIFACT.md.)
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from pipecomm import observe
from pipecomm.collectives import _streams
from pipecomm.collectives.p2p import TransferError


class Handle:
    """The future of one asynchronous collective.

    Example::

        >>> import torch.distributed as dist
        >>> from pipecomm import collectives
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, x, grad = torch.nn.Linear(2, 1), torch.ones(1, 2), torch.ones(3)
        >>> h = collectives.allreduce(grad, async_op=True)
        >>> loss = model(x)            # overlaps the allreduce
        >>> grad = h.wait()            # the reduced tensor (grad itself, in place)
        >>> grad
        tensor([1., 1., 1.])
        >>> dist.destroy_process_group()
    """

    def __init__(self, result: torch.Tensor, what: str = "collective") -> None:
        self._result = result
        self._what = what
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._on_wait: Callable[[], None] | None = None  # CUDA: order the caller's stream

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        """True once the operation has finished (successfully or with an error)."""
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        """Block until done; return the result tensor or re-raise the operation's error.

        Raises :class:`TimeoutError` if ``timeout_s`` seconds pass first (the operation keeps
        running; a later ``wait`` may still succeed). Without a timeout, a lost peer surfaces as
        the process group's own timeout error.
        """
        if not self._done.wait(timeout_s):
            raise TimeoutError(
                f"{self._what} still running after {timeout_s} s (the operation continues; "
                "wait again, or check that every rank of the group issued the same operations "
                "in the same order)"
            )
        if self._error is not None:
            raise self._error
        if self._on_wait is not None:
            self._on_wait()
        return self._result

    def __repr__(self) -> str:
        state = "done" if self.is_completed() else "pending"
        return f"<pipecomm Handle {self._what}: {state}>"


class CompletedHandle(Handle):
    """A handle for an operation that had nothing to do (one rank, empty tensor, non-member)."""

    def __init__(self, result: torch.Tensor, what: str = "collective") -> None:
        super().__init__(result, what)
        self._finish()


class WorkHandle(Handle):
    """Wraps a backend ``Work`` (``algorithm="torch"``) plus a finishing step run once after it.

    The finishing step (``avg`` division, copy back into a non-contiguous tensor) runs in the
    thread that observes completion first, through :meth:`wait` or :meth:`is_completed`.
    """

    def __init__(
        self,
        work: Any,
        finalize: Callable[[], None],
        result: torch.Tensor,
        what: str = "collective",
    ) -> None:
        super().__init__(result, what)
        self._work = work
        self._finalize = finalize
        self._lock = threading.Lock()

    def _complete(self) -> None:
        with self._lock:
            if not self._done.is_set():
                try:
                    self._finalize()
                except BaseException as exc:  # surfaced by wait()
                    self._finish(exc)
                    return
                self._finish()

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._work.is_completed():
            self._complete()
        return self._done.is_set()

    def wait(self, timeout_s: float | None = None) -> torch.Tensor:
        if not self._done.is_set():
            try:
                if timeout_s is None:
                    self._work.wait()
                else:
                    self._work.wait(timedelta(seconds=timeout_s))
            except RuntimeError as exc:
                if timeout_s is not None and "timeout" in str(exc).lower():
                    raise TimeoutError(f"{self._what} still running after {timeout_s} s") from exc
                raise
            self._complete()
        return super().wait(0)


class _Worker:
    """The communication thread of this process: runs queued jobs one at a time, FIFO."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        interval = float(os.environ.get("PIPECOMM_SWITCH_INTERVAL_S", "1e-4"))
        if interval > 0:
            sys.setswitchinterval(min(sys.getswitchinterval(), interval))
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="pipecomm-comm", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, handle = self.jobs.get()
            try:
                fn()
            except TransferError as exc:  # surfaced by wait(), naming the collective
                handle._finish(exc.during(handle._what))
            except BaseException as exc:  # surfaced by wait()
                handle._finish(exc)
            else:
                handle._finish()


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def submit(fn: Callable[[], Any], result: torch.Tensor, what: str = "collective") -> Handle:
    """Queue ``fn`` on the communication thread (started on first use); return its handle.

    Jobs run in submission order. ``fn``'s errors are re-raised by ``handle.wait()``.

    Example::

        h = submit(lambda: lp.allreduce(flat, comm, "sum", block_elems=4096), tensor)
        h.wait()
    """
    global _WORKER
    fn = observe.on_thread(fn)  # the caller's profiler range and counters, on the thread
    handle = Handle(result, what)
    order = _streams.order_for(result)
    if order is not None:  # CUDA: the job on the communication stream, events both ways
        ready, box, plain = order.submitted(result), {}, fn

        def fn() -> None:
            box["done"] = order.run(plain, ready)

        handle._on_wait = lambda: order.waited(box["done"])
    with _WORKER_LOCK:
        if _WORKER is None or _WORKER.pid != os.getpid() or not _WORKER.thread.is_alive():
            _WORKER = _Worker()
        _WORKER.jobs.put((fn, handle))
    return handle
