"""What pipecomm's collectives cost this rank: profiler ranges and counters.

Every call of :func:`pipecomm.collectives.allreduce`, ``broadcast`` and ``reduce`` (so of the
hooks, PipeSGD, the ``"pipecomm"`` backend and the decentralized trainer too) runs inside a
``torch.profiler.record_function`` range ``pipecomm.<operation>.<algorithm>``, on the calling
thread and, for ``async_op=True``, on the communication thread (which torch's profiler records
with :func:`all_threads`). With no profiler running a range costs a check of torch's flags.

:func:`counters` returns, per range name, the calls, the bytes (the tensors' sizes,
uncompressed) and the seconds this rank spent in them: the call's duration for a blocking call;
for an asynchronous one the time its job ran on the communication thread (``"torch"``: the time
to issue it). No printing, no synchronisation: the counters are plain sums under a lock.

Off by default: :func:`log` keeps the last calls (:func:`records`), :func:`flight` the last
messages of the schedules (dumped by the lab's ranks on failure: ``python -m
pipecomm.lab.networks.launch.flight DIR`` names the rank that hangs).

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

import collections
import contextlib
import contextvars
import functools
import inspect
import itertools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import checks

__all__ = ["all_threads", "counters", "flight", "flight_records", "log", "on_thread", "posted",
           "profiling", "ranged", "records", "reset", "stamp", "totals"]

_LOCK = threading.Lock()
_COUNTS: dict[str, list[float]] = {}  # name -> [calls, bytes, seconds]


_LOG: collections.deque | None = None  # [op, algorithm, bytes, ranks, seconds] per call
_FLIGHT: collections.deque | None = None  # one list per message:
_FIELDS = ("collective", "call", "step", "op", "peer", "block", "bytes", "posted", "waited",
           "completed")  # call: the collective's number on this rank
_SEQ = itertools.count()


class _Call:
    """The collective call in progress on this thread: its range name, whether its work went to
    the communication thread (which then counts the seconds), its row of the log, and for the
    flight recorder its number on this rank and messages posted so far (per op and peer)."""

    __slots__ = ("name", "submitted", "row", "seq", "streams")

    def __init__(self, name: str) -> None:
        self.name, self.submitted, self.row = name, False, None
        self.seq = next(_SEQ) if _FLIGHT is not None else -1
        self.streams: dict[tuple[str, int], int] = {}


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
            if _LOG is not None and (p := dist.get_world_size(kwargs.get("group"))) > 0:
                call.row = [kind, alg, nbytes, p, seconds]
                if not call.submitted:  # else on_thread's job logs it, with its seconds
                    _LOG.append(call.row)
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
        start, token = time.perf_counter(), _CURRENT.set(call)  # the flight recorder's call
        try:
            if profiling():
                with torch.profiler.record_function(name):
                    return job()
            return job()
        finally:
            seconds = time.perf_counter() - start
            _add(name, 0, 0, seconds)
            _CURRENT.reset(token)
            if _LOG is not None and call.row is not None:
                call.row[4] = seconds
                _LOG.append(call.row)

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
    for buf in (_LOG, _FLIGHT):
        if buf is not None:
            buf.clear()


# --------------------------------------------------------------------------- the log, the recorder


def log(capacity: int = 10_000) -> None:
    """Log this rank's last ``capacity`` collective calls (0: off, the default), each once done.

    Example::

        >>> from pipecomm import observe
        >>> observe.log(1000); observe.records(); observe.log(0)    # [{"op": ...}, ...]
        []
    """
    global _LOG
    if capacity != 0:
        checks.positive_int(capacity, "capacity", "observe.log", "calls kept; 0: off")
    _LOG = collections.deque(maxlen=capacity) if capacity else None


def records(summarised: bool = False, frame: bool = False) -> Any:
    """The logged calls, oldest first: ``op``, ``algorithm`` (``auto:<choice>``), ``bytes``,
    ``ranks`` (group size), ``seconds``, nccl-tests' ``algbw`` (bytes / seconds) and ``busbw``
    (algbw times 2(p-1)/p for AllReduce, 1 for Broadcast and Reduce), in GB/s; ``summarised``:
    per op, algorithm and ``bucket`` (bytes rounded up to a power of two), ``calls``, ``ranks``
    and the median ``seconds``, ``algbw`` and ``busbw``; ``frame``: as a pandas DataFrame.

    Example::

        >>> import torch, torch.distributed as dist
        >>> from pipecomm import collectives, observe
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        >>> observe.log(); _ = collectives.allreduce(torch.ones(1024), algorithm="ring")
        >>> [observe.records()[-1][k] for k in ("op", "algorithm", "bytes", "ranks")]
        ['allreduce', 'ring', 4096, 1]
        >>> observe.records(summarised=True, frame=True)[["op", "bucket", "calls"]].values.tolist()
        [['allreduce', 4096, 1]]
        >>> observe.log(0); dist.destroy_process_group()
    """
    out: list[dict[str, Any]] = []
    for op, alg, n, p, s in list(_LOG or ()):
        algbw = n / s / 1e9 if s > 0 else 0.0
        out.append(dict(op=op, algorithm=alg, bytes=n, ranks=p, seconds=s, algbw=algbw,
                        busbw=algbw * (2 * (p - 1) / p if op == "allreduce" else 1.0)))
    if summarised:
        groups: dict[tuple, list[dict]] = {}
        for r in out:
            key = (r["op"], r["algorithm"], 1 << max(0, r["bytes"] - 1).bit_length())
            groups.setdefault(key, []).append(r)
        out = [dict(op=op, algorithm=alg, bucket=b, calls=len(rs), ranks=max(r["ranks"] for r in rs),
                    **{k: statistics.median(r[k] for r in rs) for k in ("seconds", "algbw", "busbw")})
               for (op, alg, b), rs in sorted(groups.items())]
    if frame:
        import pandas  # here: `import pipecomm` must not import pandas

        return pandas.DataFrame(out)
    return out


def flight(steps: int = 1024) -> None:
    """Record this rank's last ``steps`` point-to-point messages (0: off, the default): their
    :data:`_FIELDS` (block: the message's number among its call's of that op and peer, LP's
    block; step: its number in the call; times ``time.time()``, ``None`` until then).

    Example::

        >>> from pipecomm import observe
        >>> observe.flight(256); observe.flight_records(); observe.flight(0)
        []
    """
    global _FLIGHT
    if steps != 0:
        checks.positive_int(steps, "steps", "observe.flight", "messages kept; 0: off")
    _FLIGHT = collections.deque(maxlen=steps) if steps else None


def posted(op: str, peer: int, nbytes: int) -> list | None:
    """The transport's call: the recorder's entry (``None``: off) of a message ``op``
    (``"send"``/``"recv"``) of ``nbytes`` to or from global rank ``peer``, posted now.

    Example::

        >>> posted("send", 1, 4096) is None        # the recorder is off
        True
    """
    if _FLIGHT is None:
        return None
    call, name, seq, step, block = _CURRENT.get(), "p2p", -1, -1, -1
    if call is not None:
        name, seq, step = call.name, call.seq, sum(call.streams.values())
        block = call.streams[op, peer] = call.streams.get((op, peer), -1) + 1
    entry = [name, seq, step, op, peer, block, nbytes, time.time(), None, None]
    _FLIGHT.append(entry)
    return entry


def stamp(entry: list | None, what: str) -> None:
    """Mark ``entry`` (:func:`posted`; ``None``: nothing) ``"waited"`` or ``"completed"`` now.

    Example::

        >>> stamp(None, "waited")
    """
    if entry is not None:
        entry[_FIELDS.index(what)] = time.time()


def flight_records() -> list[dict[str, Any]]:
    """The recorded messages (:func:`flight`), oldest first, as dicts of :data:`_FIELDS`.

    Example::

        >>> flight_records()                       # off: nothing recorded
        []
    """
    return [dict(zip(_FIELDS, e)) for e in list(_FLIGHT or ())]
