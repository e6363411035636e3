"""Asynchronous collectives: one communication thread per process, a FIFO of operations.

Pipe-SGD (Li et al., NeurIPS 2018) and layer-wise GD (Daily et al., 2017) overlap the AllReduce
of one step with the computation of the next: the schedules of an asynchronous collective run on
a daemon thread, in issue order (the same on every rank), on :func:`comm_group` (its own process
group; the reverse direction's, :func:`reverse_transport`; the world's timeout,
:func:`group_timeout`) while the main thread computes (kernels and waits release the GIL).

An ``async_op=True`` call returns a :class:`Handle`: ``wait()`` returns the result tensor or
re-raises the operation's error (a failed transfer as
:class:`pipecomm.collectives.p2p.TransferError`, naming the collective, operation and peer);
``is_completed()`` polls.

The thread lowers the GIL switch interval (``PIPECOMM_SWITCH_INTERVAL_S``); CUDA jobs run on a
communication stream of their own (:mod:`._streams`); use ``wait()`` (not only
``is_completed()``) before reading a CUDA result. Why, and the stream ordering:
docs/algorithms.md, "The communication thread: GIL switch interval and one connection per
direction".
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import zlib
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

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
                "in the same order)")
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

    def __init__(self, work: Any, finalize: Callable[[], None], result: torch.Tensor,
                 what: str = "collective") -> None:
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


# --------------------------------------------------------------------------- the thread's groups

_COMM_GROUP = None  # the process group that asynchronous collectives use (one per process)
_REVERSE: dict[str, Any] = {}  # world-wide groups for the other direction of each pair (duplex)
_COMM_WORLD = None  # the world group _COMM_GROUP was made in (a new world invalidates it)


def _forget_stale() -> None:
    """Drop the communication groups when the world they were made in is gone
    (``destroy_process_group``, then perhaps a new ``init_process_group``): a destroyed group
    must never carry a new world's messages."""
    global _COMM_GROUP, _COMM_WORLD
    if _COMM_GROUP is None:
        return
    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is None or world is not _COMM_WORLD:
        _COMM_GROUP, _COMM_WORLD = None, None
        _REVERSE.clear()


def initialised(where: str) -> None:
    """Return once torch.distributed is initialised, else a RuntimeError naming ``where``."""
    if not dist.is_initialized():
        raise RuntimeError(f"{where}: torch.distributed is not initialised: start ranks with "
                           "pipecomm.lab.networks.launch.spawn / Ranks, or call dist.init_process_group "
                           "(pipecomm.lab.networks.launch.init_from_env() under torchrun) first")


def group_timeout(group: Any = None) -> timedelta:
    """The timeout of ``group``'s operations (``None``: the default group's, the ``timeout=`` the
    job passed to ``init_process_group``): what every group pipecomm makes inherits.

    Read from the group's backend (``options._timeout`` of gloo and NCCL, which
    ``init_process_group`` / ``new_group`` set and ``_set_pg_timeout`` changes); torch's default
    for the backend where a backend keeps none.

    Example::

        >>> import datetime, torch.distributed as dist
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(),
        ...                         timeout=datetime.timedelta(seconds=15))
        >>> group_timeout()
        datetime.timedelta(seconds=15)
        >>> dist.destroy_process_group()
    """
    initialised("group_timeout")
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            f"group_timeout: group must be a ProcessGroup or None, got {type(pg).__name__}")
    for kind in pg._device_types:
        try:
            options = pg._get_backend(kind).options
        except (AttributeError, RuntimeError):  # no backend for the device, or no options
            continue
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, timedelta):
            return timeout
    return c10d._get_default_timeout(dist.get_backend(pg))


def comm_group() -> dist.ProcessGroup:
    """The process group of the communication thread (asynchronous collectives).

    Created on first use, which like any ``new_group`` must happen on every rank in the same
    order. It (and the groups of the reverse direction) takes the world's timeout
    (:func:`group_timeout`).

    Example::

        g = comm_group()   # a duplicate of the world group for background transfers
    """
    global _COMM_GROUP, _COMM_WORLD
    _forget_stale()
    if _COMM_GROUP is None:
        initialised("comm_group")
        backend = dist.get_backend()
        timeout = group_timeout()
        _COMM_GROUP = dist.new_group(backend=backend, timeout=timeout)
        _COMM_WORLD = dist.group.WORLD
        _REVERSE.clear()
        if backend != "nccl":  # NCCL has its own channels per direction
            _REVERSE["comm"] = dist.new_group(backend=backend, timeout=timeout)
            _REVERSE["world"] = dist.new_group(backend=backend, timeout=timeout)
    return _COMM_GROUP


def has_comm_group() -> bool:
    """Whether :func:`comm_group` exists in this process (it is created on first use).

    Example::

        has_comm_group()   # True in a pipecomm pool
    """
    _forget_stale()
    return _COMM_GROUP is not None


def reverse_transport(transport: Any) -> tuple[Any, int] | None:
    """Where pipecomm's messages to a *lower* global rank travel when ``transport`` carries
    those to a higher one: ``(group, tag)``, or ``None`` (one group carries both directions).

    A subgroup's reverse traffic shares the world's duplicate under a tag of its own. ``None``
    before :func:`comm_group` exists and on NCCL. Why: docs/algorithms.md, "The communication
    thread: GIL switch interval and one connection per direction".

    Example::

        reverse_transport(None)   # (<world duplicate>, 0) in a pipecomm pool
    """
    _forget_stale()
    if _COMM_GROUP is None or not _REVERSE:
        return None
    if transport is _COMM_GROUP:
        return _REVERSE["comm"], 0
    if transport is None or transport is dist.group.WORLD:
        return _REVERSE["world"], 0
    name = dist.distributed_c10d._get_process_group_name(transport)
    return _REVERSE["world"], 1 + (zlib.crc32(name.encode()) & 0x3FFFFFFF)
