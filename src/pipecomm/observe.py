"""What pipecomm's collectives cost this rank: profiler ranges and counters.

Every call of :func:`pipecomm.collectives.allreduce`, ``broadcast`` and ``reduce`` (so also the
DDP hooks, :class:`pipecomm.pipesgd.PipeSGD`, the ``"pipecomm"`` backend and the decentralized
trainer, which call them) runs inside a ``torch.profiler.record_function`` range named
``pipecomm.<operation>.<algorithm>`` (for example ``pipecomm.allreduce.lp``): on the calling
thread for the call, and on pipecomm's communication thread for the transfers of an
``async_op=True`` call. A torch profiler trace (``torch.profiler.profile``, Chrome trace
export) shows them beside the compute; torch's profiler records other threads only when asked,
so pass :func:`all_threads` as its ``experimental_config`` to see the communication thread.
With no profiler running a range costs a check of torch's profiler flags.

:func:`counters` returns, per range name, the calls, the bytes (the tensors' sizes,
uncompressed) and the seconds this rank spent in them: the call's duration for a blocking call;
for an asynchronous one the time its job ran on the communication thread (``"torch"``: the time
to issue it). No printing, no synchronisation: the counters are plain sums under a lock.

Example::

    >>> import torch, torch.distributed as dist
    >>> from pipecomm import collectives, observe
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> observe.reset()
    >>> for _ in range(3):                        # train_one_epoch()
    ...     _ = collectives.allreduce(torch.ones(1024), algorithm="lp")
    >>> c = observe.counters()["pipecomm.allreduce.lp"]
    >>> print(c["calls"], c["bytes"] / 2**10, "KiB")
    3 12.0 KiB

    >>> with torch.profiler.profile(experimental_config=observe.all_threads()) as prof:
    ...     _ = collectives.allreduce(torch.ones(1024), algorithm="lp")   # train_a_few_steps()
    >>> "pipecomm.allreduce.lp" in {e.name for e in prof.events()}   # beside the compute
    True
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["all_threads", "counters", "on_thread", "profiling", "ranged", "reset", "totals"]

_LOCK = threading.Lock()
_COUNTS: dict[str, list[float]] = {}  # name -> [calls, bytes, seconds]


class _Call:
    """The collective call in progress on this thread: its range name, and whether its work
    went to the communication thread (which then counts the seconds)."""

    __slots__ = ("name", "submitted")

    def __init__(self, name: str) -> None:
        self.name = name
        self.submitted = False


_CURRENT: contextvars.ContextVar[_Call | None] = contextvars.ContextVar(
    "pipecomm_collective", default=None
)


def _add(name: str, calls: int, nbytes: int, seconds: float) -> None:
    with _LOCK:
        row = _COUNTS.setdefault(name, [0, 0, 0.0])
        row[0] += calls
        row[1] += nbytes
        row[2] += seconds


_autograd_profiler = torch.autograd.profiler


def profiling() -> bool:
    """A torch profiler runs in this process (``torch.profiler.profile`` sets the flag for
    every thread; ``_profiler_enabled()`` is this thread's callbacks, e.g. the legacy one).

    Example::

        >>> from pipecomm import observe
        >>> observe.profiling()   # False outside torch.profiler.profile(...)
        False
    """
    return _autograd_profiler._is_profiler_enabled or torch._C._autograd._profiler_enabled()


def all_threads() -> Any:
    """The ``experimental_config`` with which ``torch.profiler.profile`` also records the
    ranges of pipecomm's communication thread (torch's default records the profiling thread).

    Example::

        >>> from pipecomm import observe
        >>> from torch.profiler import ProfilerActivity
        >>> with torch.profiler.profile(activities=[ProfilerActivity.CPU],
        ...                             experimental_config=observe.all_threads()):
        ...     observe.profiling()
        True
    """
    return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)


def ranged(kind: str, choose: Callable[..., str] | None = None
           ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator of a public collective ``fn(t, ..., algorithm=..., async_op=...)``: the call
    runs in the range ``pipecomm.<kind>.<algorithm>`` and is counted (on success); for
    ``algorithm="auto"`` it is ``auto:<choose(t, ...)>``, e.g. ``pipecomm.allreduce.auto:ring``.

    Example::

        >>> @ranged("allreduce")
        ... def allreduce(t, *, algorithm="lp", async_op=False): ...
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        default = inspect.signature(fn).parameters["algorithm"].default

        @functools.wraps(fn)
        def wrapper(t: Any, *args: Any, **kwargs: Any) -> Any:
            alg = kwargs.get("algorithm", default)
            if alg == "auto" and choose is not None:
                with contextlib.suppress(Exception):  # the call itself raises, naming why
                    alg = f"auto:{choose(t, *args, **kwargs)}"
            call = _Call(f"pipecomm.{kind}.{alg}")
            token = _CURRENT.set(call)
            start = time.perf_counter()
            try:
                if profiling():
                    with torch.profiler.record_function(call.name):
                        result = fn(t, *args, **kwargs)
                else:
                    result = fn(t, *args, **kwargs)
            finally:
                _CURRENT.reset(token)
            seconds = 0.0 if call.submitted else time.perf_counter() - start
            nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            _add(call.name, 1, nbytes, seconds)
            return result

        return wrapper

    return decorate


def on_thread(job: Callable[[], Any]) -> Callable[[], Any]:
    """``job`` as the communication thread should run it: inside the range of the collective
    call that submits it (if any), its duration counted. Called by the submitting thread.

    Example::

        >>> import queue
        >>> from pipecomm import observe
        >>> worker, body = queue.Queue(), lambda: 42
        >>> worker.put(observe.on_thread(body))   # outside a collective call: body itself
        >>> worker.get()()
        42
    """
    call = _CURRENT.get()
    if call is None:
        return job
    call.submitted = True
    name = call.name

    def run() -> Any:
        start = time.perf_counter()
        try:
            if profiling():
                with torch.profiler.record_function(name):
                    return job()
            return job()
        finally:
            _add(name, 0, 0, time.perf_counter() - start)

    return run


def counters() -> dict[str, dict[str, float]]:
    """This rank's totals per range name since the start (or :func:`reset`): ``calls``,
    ``bytes`` (tensor sizes, uncompressed) and ``seconds``.

    Example::

        >>> from pipecomm import observe
        >>> observe.reset(); observe.counters()   # {"pipecomm.allreduce.lp": {"calls": 12, "bytes": 49152, ...}}
        {}
    """
    with _LOCK:
        return {
            name: {"calls": int(c), "bytes": int(b), "seconds": float(s)}
            for name, (c, b, s) in sorted(_COUNTS.items())
        }


def totals() -> dict[str, float]:
    """The sum of :func:`counters` over every collective.

    Example::

        >>> from pipecomm import observe
        >>> observe.reset(); observe.totals()["seconds"]
        0.0
    """
    out = {"calls": 0, "bytes": 0, "seconds": 0.0}
    for row in counters().values():
        for key in out:
            out[key] += row[key]
    return out


def reset() -> None:
    """Set every counter back to zero (jobs still running on the thread count afterwards).

    Example::

        >>> from pipecomm import observe
        >>> observe.reset(); print(observe.totals())
        {'calls': 0, 'bytes': 0, 'seconds': 0.0}
    """
    with _LOCK:
        _COUNTS.clear()
