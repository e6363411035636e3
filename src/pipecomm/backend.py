"""A ``torch.distributed`` process group whose AllReduce, Broadcast and Reduce are pipecomm's.

Linear pipelining (``"lp"``, Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training
Large Scale Neural Networks", arXiv 1611.04255), that paper's baselines (``"mst"``, ``"be"``,
``"ring"``) and ``"auto"`` (per call the fastest measured) for any code that talks to
``torch.distributed``: torch's ``DistributedDataParallel``, ``dist.all_reduce``, comm hooks.
:class:`PipecommProcessGroup` is a Python ``torch.distributed.ProcessGroup``: ``allreduce`` /
``broadcast`` / ``reduce`` with SUM, AVG, MAX, MIN run :func:`pipecomm.collectives.allreduce` /
``broadcast`` / ``reduce`` on the communication thread; every other operation runs on the
group's *inner* gloo backend (NCCL for CUDA tensors). Two ways in, both for
``DistributedDataParallel(process_group=...)``: :func:`new_group`, on every rank as
``dist.new_group``; or ``import pipecomm.backend``, which registers the backend ``"pipecomm"``
for ``dist.init_process_group(backend="pipecomm")`` and ``dist.new_group(ranks,
backend="pipecomm")``, with the options of ``PIPECOMM_ALGORITHM`` (default ``"auto"``),
``PIPECOMM_COMPRESSION`` (none), ``PIPECOMM_BLOCK_BYTES`` (the cost model's optimum). What torch
2.13 allows here and where it stops: docs/algorithms.md, "What torch 2.13 allows
`pipecomm.backend` to do, and where it stops".

Example::

    import pipecomm.backend
    from torch.nn.parallel import DistributedDataParallel as DDP

    pg = pipecomm.backend.new_group(algorithm="lp")              # every rank
    model = DDP(model, process_group=pg)                         # trains as on gloo
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pg)           # LP AllReduce
    dist.all_gather(out, t, group=pg)                            # the inner gloo group

    # torchrun --nproc-per-node 2 train.py, with PIPECOMM_ALGORITHM=ring:
    dist.init_process_group(backend="pipecomm")
"""

from __future__ import annotations

import datetime
import operator
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import checks, collectives, vocab
from pipecomm.collectives import async_, builtin
from pipecomm.collectives.async_ import group_timeout

__all__ = ["BACKEND_NAME", "BACKSTOP", "ENV_ALGORITHM", "ENV_BLOCK_BYTES", "ENV_COMPRESSION",
           "Options", "PipecommProcessGroup", "for_cpp", "future_of", "new_group",
           "options_from_env", "wait_limit_s"]

#: The name ``import pipecomm.backend`` registers with ``torch.distributed.Backend``.
BACKEND_NAME = vocab.BACKEND_NAME
ENV_ALGORITHM = "PIPECOMM_ALGORITHM"
ENV_COMPRESSION = "PIPECOMM_COMPRESSION"
ENV_BLOCK_BYTES = "PIPECOMM_BLOCK_BYTES"

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default process group timeout
#: A pipecomm future (and ``Work.wait()``) gives up after this many times its group's timeout:
#: the transfer's own timeout, whose error names the operation and the peer, fires first.
BACKSTOP = 1.5
_RED = dist.ReduceOp.RedOpType
#: ReduceOps that pipecomm's algorithms implement, by pipecomm's name.
_PIPECOMM_OPS = {_RED.SUM: "sum", _RED.AVG: "avg", _RED.MAX: "max", _RED.MIN: "min"}
_COMPLEX_OPS = ("sum", "avg")  # elementwise on (real, imag); MAX/MIN/PRODUCT are undefined


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class Options:
    """What a pipecomm group runs: its algorithm, codec and LP block size (checked on creation).

    Also the ``pg_options`` that ``dist.new_group(ranks, backend="pipecomm", pg_options=...)``
    accepts.

    Example::

        >>> Options("ring", compression="fp16")
        Options(algorithm='ring', compression='fp16', block_bytes=None)
        >>> Options("mst", compression="fp16")
        Traceback (most recent call last):
            ...
        ValueError: pipecomm.backend: compression='fp16' needs algorithm 'lp' or 'ring' ...
    """

    algorithm: str = vocab.DEFAULT_ALGORITHM
    compression: str | None = None
    block_bytes: int | None = None

    def __post_init__(self) -> None:
        where = "pipecomm.backend"
        vocab.check_algorithm(self.algorithm, allowed=vocab.ALGORITHM_CHOICES, where=where)
        vocab.check_compression(self.compression, algorithm=self.algorithm, where=where)
        checks.block_bytes(self.block_bytes, where)


def options_from_env(environ: dict[str, str] | None = None) -> Options:
    """The :class:`Options` of ``PIPECOMM_ALGORITHM`` / ``PIPECOMM_COMPRESSION`` /
    ``PIPECOMM_BLOCK_BYTES`` (unset or empty: ``"auto"``, no codec, the cost model's block).

    Example::

        >>> options_from_env({"PIPECOMM_ALGORITHM": "ring", "PIPECOMM_COMPRESSION": "bf16"})
        Options(algorithm='ring', compression='bf16', block_bytes=None)
    """
    env = os.environ if environ is None else environ
    algorithm = env.get(ENV_ALGORITHM) or vocab.DEFAULT_ALGORITHM
    compression = env.get(ENV_COMPRESSION) or None
    if compression is not None and compression.lower() == "none":
        compression = None
    raw = env.get(ENV_BLOCK_BYTES) or None
    try:
        block_bytes = None if raw is None else int(raw)
    except ValueError:
        raise ValueError(
            f"{ENV_BLOCK_BYTES} must be a positive integer number of bytes, got {raw!r}"
        ) from None
    try:
        return Options(algorithm, compression, block_bytes)
    except ValueError as exc:  # name the variable the bad value came from
        given = [f"{n}={env[n]!r}" for n in (ENV_ALGORITHM, ENV_COMPRESSION) if env.get(n)]
        raise ValueError(f"{exc} (from {', '.join(given)} in the environment)") from None


# --------------------------------------------------------------------------- futures


class _Completer:
    """A daemon thread that resolves futures when pipecomm handles finish, in issue order (the
    order they finish in on the communication thread, whose queue is FIFO)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="pipecomm-futures", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            settle = self.jobs.get()
            settle()


_COMPLETER: _Completer | None = None
_COMPLETER_LOCK = threading.Lock()


def _enqueue(settle: Callable[[], None]) -> None:
    global _COMPLETER
    with _COMPLETER_LOCK:
        if _COMPLETER is None or _COMPLETER.pid != os.getpid() or not _COMPLETER.thread.is_alive():
            _COMPLETER = _Completer()
        _COMPLETER.jobs.put(settle)


def for_cpp(source: torch.futures.Future) -> torch.futures.Future:
    """A future that C++ code (DDP's reducer, torch's Work) sees fail when ``source`` does.

    Its ``wait()`` raises RuntimeError "Got the following error when running the callback:
    <the error>". Why: docs/algorithms.md, "What torch 2.13 allows `pipecomm.backend` to do, and
    where it stops".

    Example::

        >>> source = torch.futures.Future()
        >>> fut = for_cpp(source)
        >>> source.set_exception(ValueError("recv from rank 1 failed"))
        >>> fut.wait()
        Traceback (most recent call last):
            ...
        RuntimeError: Got the following error when running the callback: ValueError: recv from rank 1 failed...
    """
    return source.then(lambda fut: fut.value())


def wait_limit_s(timeout_s: float | None = None) -> float:
    """How long pipecomm waits for an asynchronous collective: ``timeout_s``, or (``None``)
    :data:`BACKSTOP` times the world's timeout, so that the transfer's own timeout (the
    communication group's, which is the world's), whose error names the peer, fires first.

    Example::

        >>> import datetime
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(),
        ...                         timeout=datetime.timedelta(seconds=20))   # p = 1
        >>> wait_limit_s(), wait_limit_s(5.0)
        (30.0, 5.0)
        >>> dist.destroy_process_group()
    """
    if timeout_s is None:
        return BACKSTOP * group_timeout().total_seconds()
    return timeout_s


def _settled(hs: list[collectives.Handle], value: Callable[[], Any],
             timeout_s: float) -> torch.futures.Future:
    """A Python future resolved with ``value()`` once every handle is done, or with the first
    handle's error (the original exception, for Python waiters)."""
    fut: torch.futures.Future = torch.futures.Future()

    def settle() -> None:
        try:
            for h in hs:
                h.wait(timeout_s)
            result = value()
        except BaseException as exc:  # handed to the future's waiters
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    if all(h.is_completed() for h in hs):
        settle()
    else:
        _enqueue(settle)
    return fut


def future_of(handles: collectives.Handle | Sequence[collectives.Handle], value: Callable[[], Any],
              *, timeout_s: float | None = None) -> torch.futures.Future:
    """A ``torch.futures.Future`` resolved with ``value()`` once every handle is done.

    Resolved on this module's completion thread (at once if the handles are already done). A
    handle's error, or a handle still running after ``timeout_s`` (``None``:
    :func:`wait_limit_s`), fails the future, also for C++ waiters such as DDP (:func:`for_cpp`).

    Example::

        >>> import torch
        >>> from pipecomm import collectives
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> t = torch.full((2,), 3.0)
        >>> h = collectives.allreduce(t, op="avg", async_op=True)
        >>> fut = future_of(h, lambda: t, timeout_s=60)
        >>> fut.then(lambda f: print(f.value())).wait()
        tensor([3., 3.])
        >>> dist.destroy_process_group()
    """
    hs = [handles] if isinstance(handles, collectives.Handle) else list(handles)
    return for_cpp(_settled(hs, value, wait_limit_s(timeout_s)))


class _Work(dist.Work):
    """A ``Work`` that completes with a ``torch.futures.Future``: ``wait()`` blocks on it (at
    most :data:`BACKSTOP` times the group's timeout) and re-raises its error; ``get_future()``
    returns it as C++ must see it (:func:`for_cpp`)."""

    def __init__(self, future: torch.futures.Future, what: str,
                 timeout: datetime.timedelta) -> None:
        super().__init__()
        self._future = for_cpp(future)
        self._what = what
        self._timeout = timeout
        self._done = threading.Event()
        self._error: BaseException | None = None
        future.add_done_callback(self._finish)

    def _finish(self, fut: torch.futures.Future) -> None:
        try:
            fut.value()
        except BaseException as exc:  # re-raised by wait()
            self._error = exc
        self._done.set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        """Block until done (at most ``timeout``, default :data:`BACKSTOP` times the group's);
        re-raise its error."""
        limit = timeout or BACKSTOP * self._timeout
        if not self._done.wait(limit.total_seconds()):
            raise TimeoutError(
                f"pipecomm {self._what} still running after {limit.total_seconds():g} s (check "
                "that every rank of the group issued the same operations in the same order)")
        if self._error is not None:
            raise self._error
        return True

    def get_future(self) -> torch.futures.Future:
        """The future, resolved with the list of result tensors on completion."""
        return self._future

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._future.value()

    def __repr__(self) -> str:
        return f"<pipecomm Work {self._what}: {'done' if self.is_completed() else 'pending'}>"


# --------------------------------------------------------------------------- the process group


def _red_op(op: Any) -> Any:
    """The ``RedOpType`` of a ``ReduceOp`` / ``RedOpType`` (PREMUL_SUM keeps its own type)."""
    return op.op if isinstance(op, dist.ReduceOp) else op


class PipecommProcessGroup(dist.ProcessGroup):
    """A process group that runs AllReduce, Broadcast and Reduce with pipecomm's algorithms.

    Made by :func:`new_group` or by ``torch.distributed`` itself for ``backend="pipecomm"``;
    every other operation runs on the inner backends (gloo for CPU, NCCL for CUDA tensors).

    Example::

        >>> import torch
        >>> import pipecomm.backend
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> pg = pipecomm.backend.new_group(algorithm="mst")
        >>> t = torch.ones(2)
        >>> w = dist.all_reduce(t, group=pg, async_op=True)     # on the communication thread
        >>> w.get_future().then(lambda f: f.value()[0] / 2).wait()
        tensor([0.5000, 0.5000])
        >>> dist.destroy_process_group()
    """

    def __init__(self, rank: int, size: int, options: Options, inner: dict[str, Any],
                 timeout: datetime.timedelta) -> None:
        super().__init__(rank, size)
        self.options = options
        self._inner = dict(inner)
        self._timeout = timeout
        self._members: tuple[int, ...] | None = None
        for device, (backend_type, backend) in inner.items():
            self._register_backend(torch.device(device), backend_type, backend)
        self._set_default_backend(inner["cpu"][0])

    # ----------------------------------------------------------------- identity

    def getBackendName(self) -> str:  # noqa: N802 (torch's C++ name)
        return BACKEND_NAME

    @property
    def gloo(self) -> Any:
        """The inner gloo backend, e.g. for ``pg.gloo.monitored_barrier(timeout)`` (torch's
        ``dist.monitored_barrier`` refuses a group whose backend is not named gloo)."""
        return self._inner["cpu"][1]

    @property
    def algorithm(self) -> str:
        """The group's algorithm: ``"auto"`` or one of :data:`pipecomm.vocab.ALGORITHMS`."""
        return self.options.algorithm

    def __repr__(self) -> str:
        o = self.options
        return (
            f"PipecommProcessGroup(rank={self.rank()}, size={self.size()}, "
            f"algorithm={o.algorithm!r}, compression={o.compression!r}, "
            f"block_bytes={o.block_bytes!r})")

    # ----------------------------------------------------------------- helpers

    def _backend_of(self, t: torch.Tensor) -> Any:
        return self._inner_of(t.device)

    def _global(self, group_rank: int) -> int:
        if self._members is None:
            self._members = tuple(dist.get_process_group_ranks(self))
        return self._members[group_rank]

    def _prepare(self, what: str, tensors: list[torch.Tensor],
                 op: str | None) -> tuple[list[torch.Tensor], bool]:
        """Check the operation; return the tensors to run on (real views of complex ones) and
        whether pipecomm runs it (else the inner backend does)."""
        if len(tensors) != 1 or any(
            not isinstance(t, torch.Tensor) or t.layout != torch.strided for t in tensors
        ):
            return tensors, False
        t = tensors[0]
        if t.is_complex():
            if op is not None and op not in _COMPLEX_OPS:
                raise ValueError(
                    f"pipecomm {what}: ReduceOp.{op.upper()} is not defined for complex tensors "
                    f"(got {t.dtype}); use SUM or AVG")
            t = torch.view_as_real(t)
        if op == "avg" and not t.dtype.is_floating_point:
            raise TypeError(
                f"pipecomm {what}: ReduceOp.AVG needs a floating-point or complex tensor, got "
                f"{t.dtype} (the inner gloo backend has no AVG); use SUM and divide")
        use = (self.options.algorithm != "torch" and t.dtype in collectives.SUPPORTED_DTYPES
               and not getattr(builtin.ISSUING, "on", False))  # auto chose the built-in
        return [t], use

    def _on_inner(self, kind: str, tensors: list[torch.Tensor], opts: Any, op: str | None) -> Any:
        """Run ``kind`` on the inner backend; AVG (which gloo lacks) as SUM, then / size."""
        backend = self._backend_of(tensors[0])
        if op != "avg":
            return getattr(backend, kind)(tensors, opts)
        sum_opts = dist.AllreduceOptions() if kind == "allreduce" else dist.ReduceOptions()
        sum_opts.reduceOp = dist.ReduceOp.SUM
        if kind == "reduce":
            sum_opts.rootRank, sum_opts.rootTensor = opts.rootRank, opts.rootTensor
        work = getattr(backend, kind)(tensors, sum_opts)
        divide = kind == "allreduce" or self.rank() == opts.rootRank
        p = self.size()

        def average(fut: torch.futures.Future) -> list[torch.Tensor]:
            fut.wait()
            if divide:
                for t in tensors:
                    t.div_(p)
            return tensors

        return _Work(work.get_future().then(average), f"{kind}(AVG, inner)", self._timeout)

    def _ready(self) -> None:
        """The world creates the communication thread's group at its first pipecomm operation
        (every rank takes part in it); a subgroup runs on its own connections until then."""
        if self is dist.group.WORLD and not async_.has_comm_group():
            async_.comm_group()

    def _work(self, what: str, handle: collectives.Handle, tensors: list[torch.Tensor]) -> _Work:
        limit = BACKSTOP * self._timeout.total_seconds()
        fut = _settled([handle], lambda: tensors, limit)
        return _Work(fut, f"{what}({self.options.algorithm})", self._timeout)

    # ----------------------------------------------------------------- collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """``dist.all_reduce`` on this group: pipecomm's AllReduce for SUM/AVG/MAX/MIN."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        if opts is None or not isinstance(opts, dist.AllreduceOptions):
            red = dist.ReduceOp.SUM if opts is None else opts
            opts = dist.AllreduceOptions()
            opts.reduceOp = red
        op = _PIPECOMM_OPS.get(_red_op(opts.reduceOp))
        run, use = self._prepare("allreduce", tensors, op)
        if not use or op is None:
            return self._on_inner("allreduce", run, opts, op)
        self._ready()
        t = run[0]
        codec = self.options.compression if op in ("sum", "avg") else None
        handle = collectives.allreduce(t, algorithm=self.options.algorithm, op=op, group=self,
                                       block_bytes=self.options.block_bytes, async_op=True,
                                       compression=codec if t.dtype.is_floating_point else None)
        return self._work("allreduce", handle, tensors)

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        """``dist.broadcast`` on this group (``opts.rootRank`` is a group rank)."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        if opts is None or not isinstance(opts, dist.BroadcastOptions):
            root = 0 if opts is None else operator.index(opts)
            opts = dist.BroadcastOptions()
            opts.rootRank, opts.rootTensor = root, 0
        run, use = self._prepare("broadcast", tensors, None)
        if not use:
            return self._on_inner("broadcast", run, opts, None)
        self._ready()
        handle = collectives.broadcast(run[0], src=self._global(opts.rootRank),
                                       algorithm=self.options.algorithm, group=self,
                                       block_bytes=self.options.block_bytes, async_op=True)
        return self._work("broadcast", handle, tensors)

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        """``dist.reduce`` on this group; ranks other than the root keep unspecified values."""
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        if opts is None:
            opts = dist.ReduceOptions()
        op = _PIPECOMM_OPS.get(_red_op(opts.reduceOp))
        run, use = self._prepare("reduce", tensors, op)
        if not use or op is None:
            return self._on_inner("reduce", run, opts, op)
        self._ready()
        handle = collectives.reduce(run[0], dst=self._global(opts.rootRank),
                                    algorithm=self.options.algorithm, op=op, group=self,
                                    block_bytes=self.options.block_bytes, async_op=True)
        return self._work("reduce", handle, tensors)

    # ----------------------------------------------------------------- the inner backend's
    # Every operation torch's trampoline forwards is defined here, calling the inner backend
    # through its Python binding (which releases the GIL): left to torch's C++ default, which
    # holds the GIL, gloo's workers deadlock with it (docs/algorithms.md, "What torch 2.13
    # allows `pipecomm.backend` to do, and where it stops").

    def _inner_of(self, device: Any) -> Any:
        kind = "cuda" if device is not None and torch.device(device).type == "cuda" else "cpu"
        if kind not in self._inner:
            raise RuntimeError(f"pipecomm group has no inner backend for {device} tensors (it has "
                               f"{sorted(self._inner)})")
        return self._inner[kind][1]

    def _all_of(self, works: list[Any], tensors: list[torch.Tensor], what: str) -> _Work:
        """One Work for several inner works, done when all are (re-raises the first error).

        They are waited for on the completion thread: gloo's reduce-scatter works have no future.
        """
        fut: torch.futures.Future = torch.futures.Future()

        def settle() -> None:
            try:
                for w in works:
                    w.wait(self._timeout)
            except BaseException as exc:  # handed to the future's waiters
                fut.set_exception(exc)
            else:
                fut.set_result(tensors)

        _enqueue(settle)
        return _Work(fut, f"{what}(inner)", self._timeout)

    def allgather(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> dist.Work:
        """``dist.all_gather`` (and ``all_gather_object``) on the inner backend."""
        opts = dist.AllgatherOptions() if opts is None else opts
        backend = self._backend_of(input_tensors[0])
        return backend.allgather(output_tensors, input_tensors, opts)

    def all_gather_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> _Work:
        """Coalesced ``all_gather_into_tensor``: one inner ``_allgather_base`` per pair."""
        opts = dist.AllgatherOptions() if opts is None else opts
        backend = self._backend_of(inputs[0])
        works = [backend._allgather_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._all_of(works, list(outputs), "all_gather_single_coalesced")

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        """Coalesced ``all_reduce`` on the inner backend."""
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._backend_of(tensors[0]).allreduce_coalesced(tensors, opts)

    def all_to_all_single(self, output: Any, input: Any, output_split_sizes: Any,
                          input_split_sizes: Any, opts=None) -> dist.Work:
        """``dist.all_to_all_single`` on the inner backend."""
        opts = dist.AllToAllOptions() if opts is None else opts
        backend = self._backend_of(input)
        return backend.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        """``dist.barrier`` on the inner backend of ``opts.device`` (CPU when unset)."""
        opts = dist.BarrierOptions() if opts is None else opts
        return self._inner_of(opts.device).barrier(opts)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any, opts: Any = None) -> Any:
        """``dist.reduce_scatter`` on the inner backend."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        backend = self._backend_of(output_tensors[0])
        return backend.reduce_scatter(output_tensors, input_tensors, opts)

    def reduce_scatter_single_coalesced(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
        """Coalesced ``reduce_scatter_tensor``: one inner ``_reduce_scatter_base`` per pair."""
        opts = dist.ReduceScatterOptions() if opts is None else opts
        backend = self._backend_of(inputs[0])
        works = [backend._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._all_of(works, list(outputs), "reduce_scatter_single_coalesced")

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        """``dist.send`` / ``isend`` on the inner backend (``dst`` is a group rank)."""
        return self._backend_of(tensors[0]).send(tensors, dst, tag)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        """``dist.recv`` / ``irecv`` on the inner backend (``src`` is a group rank)."""
        return self._backend_of(tensors[0]).recv(tensors, src, tag)


# --------------------------------------------------------------------------- creation


def _inner_backends(store: Any, rank: int, size: int, timeout: datetime.timedelta, ranks: list[int],
                    name: str) -> dict[str, Any]:
    """gloo for CPU tensors (and NCCL for CUDA tensors when available), on ``store``."""
    store = dist.PrefixStore("pipecomm-inner/", store)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", store), rank, size, timeout)
    gloo.options.global_ranks_in_group = ranks
    gloo.options.group_name = name
    inner = {"cpu": (dist.ProcessGroup.BackendType.GLOO, gloo)}
    if torch.cuda.is_available() and dist.is_nccl_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        opts.global_ranks_in_group = ranks
        opts.group_name = name
        nccl = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", store), rank, size, opts)
        inner["cuda"] = (dist.ProcessGroup.BackendType.NCCL, nccl)
    return inner


def _create(backend_opts: Any, pg_options: Any) -> PipecommProcessGroup:
    """The creator torch calls for ``backend="pipecomm"`` (``extended_api=True``)."""
    if pg_options is None:
        options = options_from_env()
    elif isinstance(pg_options, Options):
        options = pg_options
    else:
        raise TypeError(
            f"pg_options for backend 'pipecomm' must be a pipecomm.backend.Options or None, got "
            f"{type(pg_options).__name__}")
    timeout = backend_opts.timeout or _DEFAULT_TIMEOUT
    if dist.is_initialized():  # a subgroup made without timeout= waits no longer than the world
        timeout = min(timeout, group_timeout())
    rank, size = backend_opts.group_rank, backend_opts.group_size
    ranks = list(backend_opts.global_ranks_in_group)
    inner = _inner_backends(backend_opts.store, rank, size, timeout, ranks, backend_opts.group_id)
    return PipecommProcessGroup(rank, size, options, inner, timeout)


def _register() -> None:
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


_register()


def new_group(ranks: Sequence[int] | None = None, *, algorithm: str = vocab.DEFAULT_ALGORITHM,
              compression: str | None = None, block_bytes: int | None = None,
              timeout: datetime.timedelta | None = None) -> dist.ProcessGroup:
    """A pipecomm process group over ``ranks`` (global ranks; ``None``: all), made on every rank.

    Like ``dist.new_group`` it must be called by every rank of the job, members or not, in the
    same order as the other group creations; non-members get ``GroupMember.NON_GROUP_MEMBER``.
    AllReduce / Broadcast / Reduce run ``algorithm`` (``"auto"``: per call the fastest measured,
    :func:`pipecomm.collectives.builtin.choose`; LP: Wang et al., arXiv 1611.04255; ``"mst"``,
    ``"be"``, ``"ring"``; ``"torch"`` runs everything on the inner backend), SUM/AVG
    AllReduce of floating tensors carries ``compression`` (``"lp"``/``"ring"`` only), LP uses
    ``block_bytes`` per block (``None``: the cost model's optimum). The group's operations fail
    after ``timeout`` (``None``: the world's, :func:`pipecomm.collectives.async_.group_timeout`;
    pipecomm's operations give up after :data:`BACKSTOP` times it).

    Example::

        >>> import torch
        >>> import pipecomm.backend
        >>> from torch.nn.parallel import DistributedDataParallel
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> pg = pipecomm.backend.new_group(algorithm="ring", compression="bf16")
        >>> ddp = DistributedDataParallel(torch.nn.Linear(2, 1), process_group=pg)
        >>> evens = pipecomm.backend.new_group([0], algorithm="mst")    # on every rank
        >>> t = torch.ones(3); dist.all_reduce(t, group=evens); t
        tensor([1., 1., 1.])
        >>> dist.destroy_process_group()
    """
    options = Options(algorithm, compression, block_bytes)
    if not dist.is_initialized():
        raise RuntimeError(
            "pipecomm.backend.new_group: torch.distributed is not initialised; call "
            "dist.init_process_group (or start ranks with pipecomm.lab.networks.launch) first")
    if timeout is None:
        timeout = group_timeout()
    elif not isinstance(timeout, datetime.timedelta) or timeout.total_seconds() <= 0:
        raise ValueError(
            f"pipecomm.backend.new_group: timeout must be a positive datetime.timedelta or None, "
            f"got {timeout!r}")
    world = dist.get_world_size()
    if ranks is not None:
        ranks = list(ranks)
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int)]
        if bad or not ranks or len(set(ranks)) != len(ranks):
            raise ValueError(
                f"pipecomm.backend.new_group: ranks must be distinct ints, got {ranks!r}")
        outside = [r for r in ranks if not 0 <= r < world]
        if outside:
            raise ValueError(f"pipecomm.backend.new_group: ranks {outside} are outside the world "
                             f"(0..{world - 1})")
    if options.algorithm != "torch":
        async_.comm_group()  # a collective of every rank, so subgroups can run asynchronously
    return dist.new_group(ranks, backend=BACKEND_NAME, pg_options=options, timeout=timeout)

