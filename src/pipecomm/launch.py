"""Start local ranks, keep them alive for reuse, or join a torchrun job.

Foundation of every experiment (no paper equation). Three ways in:

* ``spawn(fn, world_size, *args)`` starts ``world_size`` processes, runs ``fn(*args)`` on each
  with ``torch.distributed`` initialised, returns the per-rank results in rank order and stops them.
* ``Ranks(world_size)`` is a pool of ranks kept alive: ``ranks.run(fn, *args)`` runs again and
  again on the same processes (sweeps, tests and notebooks pay the process start once).
* ``init_from_env()`` joins a job started by ``torchrun`` (multi-node, NCCL on GPUs).

Local ranks listen on loopback only (TCP store on 127.0.0.1, a free port found automatically; gloo
bound to the loopback interface). Each rank sets its torch threads to cores / local ranks. When a
rank raises or dies, the others are stopped and the caller gets :class:`RankError` with that
rank's number and traceback; a run past ``timeout_s`` raises :class:`TimeoutError` naming the ranks
still running. Nothing is left running afterwards.

On Linux, ranks are forked from a server process that imported torch once (``multiprocessing``'s
forkserver; spawn elsewhere): starting a pool costs a fraction of a second instead of a torch
import (seconds of CPU) in every rank. Each rank gets the environment variables, working
directory, ``sys.path``, stdout and stderr that the starting process has at that moment, as with
spawn. The fork server itself stays, idle, until the starting process ends. As with spawn, a
rank imports the starting script: a script starts ranks under ``if __name__ == "__main__":``
(without it, :class:`UnguardedMainError` says so, once).

Example::

    # python -c "from pipecomm import launch; import examples; print(launch.spawn(examples.f, 4))"
    from pipecomm import launch
    with launch.Ranks(4) as ranks:
        for n in (1, 1024):
            print(ranks.run(mymodule.measure, n))      # one value per rank
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait as _mp_wait
from typing import Any

__all__ = [
    "RankError",
    "RankInfo",
    "Ranks",
    "TorchrunJob",
    "UnguardedMainError",
    "check_gpus",
    "comm_group",
    "reverse_transport",
    "device",
    "init_from_env",
    "local_world_size",
    "pool",
    "ranks_per_node",
    "spawn",
    "under_torchrun",
]

_STARTUP_TIMEOUT_S = 120.0
#: imported once by the fork server, so that a rank starts without importing them again
#: (torch._dynamo: the first torch.optim optimizer imports it; sklearn.datasets: the digits).
#: Third-party only: a rank imports pipecomm itself, so it runs the code as it is on disk.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "pandas", "sklearn.datasets"]


#: Exit status of a rank that found itself re-running its parent's script at module level
#: (:func:`_refuse_in_bootstrap`); the parent turns it into :class:`UnguardedMainError`.
_BOOTSTRAP_EXIT = 97


class UnguardedMainError(RuntimeError):
    """Ranks were started from a script's module level without ``if __name__ == "__main__":``:
    each rank re-runs the script while it starts and would start ranks of its own."""


def _main_script() -> str:
    main = sys.modules.get("__main__")
    return getattr(main, "__file__", None) or "the main script"


def _unguarded_error() -> UnguardedMainError:
    return UnguardedMainError(
        f"the ranks re-ran {_main_script()} while starting, and its module-level code starts "
        "ranks again: put the code that uses launch.Ranks / launch.spawn under "
        "`if __name__ == \"__main__\":` (multiprocessing starts each rank by importing the main "
        "script)"
    )


def _refuse_in_bootstrap() -> None:
    """In a rank that is still importing its parent's main script (multiprocessing's bootstrap:
    the script starts ranks at module level, without a ``__main__`` guard), exit at once with
    :data:`_BOOTSTRAP_EXIT` instead of multiprocessing's error; the parent says why, once."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_BOOTSTRAP_EXIT)


def _context() -> Any:
    """The multiprocessing context of local ranks: on Linux a fork server that has imported
    torch (a fresh interpreter that touches no GPU, so no CUDA state or threads are forked),
    elsewhere spawn."""
    if not sys.platform.startswith("linux") or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # ignored once the server runs
    forkserver.ensure_running()  # before OMP_NUM_THREADS is set for a pool: not the server's
    return ctx


class _Stdio:
    """This process's stdout and stderr as they are now, handed to a rank (a forked rank would
    otherwise write where the fork server's were when it started)."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        fds = []
        for fd in (1, 2):
            try:
                os.fstat(fd)
            except OSError:
                fds.append(None)
            else:
                fds.append(reduction.DupFd(fd))
        return (tuple, (fds,))


def _adopt_stdio(stdio: Any) -> None:
    """In a rank: write to the starting process's stdout and stderr (see :class:`_Stdio`)."""
    if not isinstance(stdio, tuple):
        return
    for wrapped, target in zip(stdio, (1, 2)):
        if wrapped is not None:
            fd = wrapped.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


class RankError(RuntimeError):
    """A rank raised an exception or died; carries the rank and its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{remote_traceback}"
        super().__init__(text)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: str


# --------------------------------------------------------------------------- helpers in a rank

_COMM_GROUP = None  # the process group that asynchronous collectives use (one per process)
_REVERSE: dict[str, Any] = {}  # world-wide groups for the other direction of each pair (duplex)


_PG_TIMEOUT: datetime.timedelta | None = None  # the world's timeout, reused for the comm group


def comm_group():
    """The process group of pipecomm's communication thread (asynchronous collectives).

    Created eagerly by :func:`spawn`, :class:`Ranks` and :func:`init_from_env`; a process that
    initialised ``torch.distributed`` itself gets it on first use, which like any ``new_group``
    must then happen on every rank in the same order.

    Example::

        g = launch.comm_group()   # a duplicate of the world group for background transfers
    """
    global _COMM_GROUP
    if _COMM_GROUP is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: start ranks with pipecomm.launch.spawn / "
                "Ranks, or call pipecomm.launch.init_from_env() under torchrun"
            )
        backend = dist.get_backend()
        _COMM_GROUP = dist.new_group(backend=backend, timeout=_PG_TIMEOUT)
        _REVERSE.clear()
        if backend != "nccl":  # NCCL has its own channels per direction
            _REVERSE["comm"] = dist.new_group(backend=backend, timeout=_PG_TIMEOUT)
            _REVERSE["world"] = dist.new_group(backend=backend, timeout=_PG_TIMEOUT)
    return _COMM_GROUP


def has_comm_group() -> bool:
    """Whether :func:`comm_group` exists in this process (it is created on first use).

    Example::

        launch.has_comm_group()   # True in a pipecomm pool
    """
    return _COMM_GROUP is not None


def reverse_transport(transport: Any) -> tuple[Any, int] | None:
    """Where pipecomm's messages to a *lower* global rank travel when ``transport`` carries
    those to a higher one: ``(group, tag)``, or ``None`` (one group carries both directions).

    On gloo one TCP connection per pair of ranks carries both directions of the pair, and a
    send and a receive posted together on it often run one after the other instead of at once
    (measured on shaped links, E14): half the link's duplex bandwidth is lost exactly where LP
    allreduce, BE and two-rank rings send and receive between the same two ranks. So each
    direction gets a connection of its own: a world-wide duplicate of the transport (created
    with :func:`comm_group`, on every rank) carries the reverse direction; a subgroup's reverse
    traffic shares the world's duplicate under a tag of its own, so concurrent collectives on
    different groups never match each other's messages. Before :func:`comm_group` exists (a
    process that initialised torch.distributed itself and has not used pipecomm's asynchronous
    collectives yet) and on NCCL: ``None``.

    Example::

        launch.reverse_transport(None)   # (<world duplicate>, 0) in a pipecomm pool
    """
    import zlib

    import torch.distributed as dist

    if _COMM_GROUP is None or not _REVERSE:
        return None
    if transport is _COMM_GROUP:
        return _REVERSE["comm"], 0
    if transport is None or transport is dist.group.WORLD:
        return _REVERSE["world"], 0
    name = dist.distributed_c10d._get_process_group_name(transport)
    return _REVERSE["world"], 1 + (zlib.crc32(name.encode()) & 0x3FFFFFFF)


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued kernels when it is a GPU (CUDA kernels run asynchronously, so
    a host clock read without this measures launches, not work); nothing for the CPU or None.

    Example::

        launch.synchronize(launch.device()); t0 = time.perf_counter()
    """
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device():
    """This rank's device: ``cuda:<current>`` when the default process group is NCCL (launch
    pinned one GPU per local rank), else ``cpu`` (gloo, or no process group at all).

    Experiments place models and batches with it, so one code path serves both profiles.

    Example::

        model = build_model().to(launch.device())
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_per_node() -> int | None:
    """Ranks per (real or emulated) node: ``LOCAL_WORLD_SIZE`` as set by torchrun or by launch.

    Example::

        rpn = launch.ranks_per_node()   # e.g. 2 under Ranks(8, ranks_per_node=2)
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


def local_world_size() -> int:
    """Number of ranks sharing this machine's cores (for thread settings)."""
    value = os.environ.get("PIPECOMM_PROCS_ON_HOST") or os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else 1


def _set_threads(procs_on_host: int) -> None:
    import torch

    threads = max(1, (os.cpu_count() or 1) // max(1, procs_on_host))
    torch.set_num_threads(threads)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans after a crash)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def to_cpu(obj: Any) -> Any:
    """Move tensors (nested in lists, tuples, dicts) to the CPU so any caller can unpickle them."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [to_cpu(x) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def _init_distributed(
    *, rank: int, world_size: int, backend: str, init_method: str, timeout_s: float, gpu: int
) -> None:
    """Join the process group; with NCCL first pin GPU ``gpu`` (this host's rank index: every
    local pool rank is on this host, whatever ``ranks_per_node`` emulates)."""
    import torch
    import torch.distributed as dist

    global _COMM_GROUP, _PG_TIMEOUT
    _PG_TIMEOUT = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(gpu % torch.cuda.device_count())
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=_PG_TIMEOUT,
    )
    _COMM_GROUP = None
    _REVERSE.clear()
    comm_group()


def _reply(conn: Any, kind: str, rank: int, value: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, rank, value), protocol=pickle.HIGHEST_PROTOCOL))


def _worker(
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    network: Any,
    net_handle: Any,
    rpn: int | None,
    pg_timeout_s: float,
    conn: Any,
    env: dict[str, str] | None = None,
    stdio: Any = None,
) -> None:
    """Body of one local rank: initialise, then serve ``run`` requests until told to stop."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _adopt_stdio(stdio)
    if env is not None:  # the starting process's environment (a fork server's is older)
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank % rpn if rpn else rank),
        LOCAL_WORLD_SIZE=str(rpn if rpn else world_size),
        GROUP_RANK=str(rank // rpn if rpn else 0),
        PIPECOMM_PROCS_ON_HOST=str(world_size),
    )
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        _set_threads(world_size)
        _init_distributed(
            rank=rank,
            world_size=world_size,
            backend=backend,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout_s=pg_timeout_s,
            gpu=rank,
        )
        if network is not None:
            from pipecomm import netem

            netem.activate(network, net_handle, rank=rank, world_size=world_size,
                           ranks_per_node=rpn)
        _reply(conn, "ready", rank, None)
    except BaseException as exc:  # report start-up failures with their traceback
        _reply(conn, "error", rank, (repr(exc), traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] == "stop":
            # No destroy_process_group(): it waits for every peer and would make stopping a
            # pool cost seconds. Exiting closes the sockets; the parent reaps the process.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        _, payload = message
        try:
            fn, args, kwargs = pickle.loads(payload)
            _reply(conn, "ok", rank, to_cpu(fn(*args, **kwargs)))
        except BaseException as exc:
            _reply(conn, "error", rank, (repr(exc), traceback.format_exc()))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_picklable(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` pickled for a rank, or one error saying why a rank could not
    import ``fn`` (defined in a notebook cell or ``__main__`` without a file) or unpickle the
    arguments.

    Example::

        payload = launch.check_picklable(mymodule.fn, (1 << 20,), {})
    """
    module = getattr(fn, "__module__", None)
    main = sys.modules.get("__main__")
    if module == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"fn={getattr(fn, '__qualname__', fn)!r} is defined in a notebook or interactive "
            "session, so the rank processes cannot import it. Put it in a .py module (for example "
            "next to the notebook) and import it from there, or use a function from pipecomm."
        )
    if "<locals>" in getattr(fn, "__qualname__", "") or getattr(fn, "__name__", "") == "<lambda>":
        raise ValueError(
            f"fn={fn!r} is a lambda or nested function, which rank processes cannot import; "
            "define it at module level in an importable .py file."
        )
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"cannot send fn and its arguments to the ranks (they must be picklable): {exc}"
        ) from exc


def _validate(world_size: int, backend: str, ranks_per_node: int | None, network: Any) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if ranks_per_node is not None and (
        not isinstance(ranks_per_node, int) or ranks_per_node < 1 or world_size % ranks_per_node
    ):
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} must be a positive int dividing "
            f"world_size={world_size}"
        )
    if network is not None and backend == "nccl":
        raise ValueError(
            "the emulated network is a CPU-profile tool and is refused with NCCL: pass "
            "network=None with backend='nccl', or use backend='gloo'"
        )
    if backend == "nccl":
        check_gpus(world_size)


def check_gpus(world_size: int) -> None:
    """Raise ValueError unless ``world_size`` GPUs are visible: NCCL places one rank per GPU.

    Example::

        launch.check_gpus(8)   # before starting an 8-rank NCCL pool
    """
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < world_size:
        raise ValueError(
            f"backend='nccl' with {world_size} local ranks needs {world_size} visible GPUs "
            f"(NCCL cannot place two ranks on one GPU), found {have}: use fewer ranks, "
            "backend='gloo', or torchrun across nodes"
        )


# --------------------------------------------------------------------------- the pool


class Ranks:
    """A pool of ``world_size`` local ranks kept alive between :meth:`run` calls.

    Args:
        world_size: number of ranks (processes).
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank).
        network: an emulated network (``pipecomm.netem.Network``) applied to pipecomm's
            point-to-point transfers on every rank, or ``None`` for the real backend.
        ranks_per_node: ranks per emulated node (sets ``LOCAL_WORLD_SIZE`` in the ranks).
        start_timeout_s: limit for starting the ranks and joining the process group.

    Example::

        with Ranks(4) as ranks:
            sums = ranks.run(mymodule.allreduce_ones, 1024)   # [1024.0 * 4] * 4
            again = ranks.run(mymodule.allreduce_ones, 2048)  # same processes, no start cost

    After a failed run (an exception, a dead rank, a timeout) all ranks are stopped; the next
    ``run`` starts fresh ones.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "gloo",
        network: Any = None,
        ranks_per_node: int | None = None,
        start_timeout_s: float = _STARTUP_TIMEOUT_S,
    ) -> None:
        _validate(world_size, backend, ranks_per_node, network)
        self.world_size = world_size
        self.backend = backend
        self.network = network
        self.ranks_per_node = ranks_per_node
        self.start_timeout_s = start_timeout_s
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._net_handle: Any = None

    # -- lifecycle
    def __enter__(self) -> Ranks:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._kill()

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def start(self) -> None:
        """Start the ranks (``run`` does so on demand); raises if any fails to join."""
        if self.alive:
            return
        _refuse_in_bootstrap()
        self._kill()
        last_error: Exception | None = None
        for _attempt in range(3):  # a free port can be taken between probing and binding
            try:
                self._start_once()
                return
            except RankError as exc:
                self._kill()
                last_error = exc
                if "address already in use" not in str(exc).lower():
                    raise
        assert last_error is not None
        raise last_error

    def _start_once(self) -> None:
        port = _free_port()
        if self.network is not None:
            from pipecomm import netem

            self._net_handle = netem.setup(self.network, self.world_size, self.ranks_per_node)
        pg_timeout = max(300.0, self.start_timeout_s)  # a hung collective errors after this
        ctx = _context()
        threads = str(max(1, (os.cpu_count() or 1) // self.world_size))
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.world_size, port, self.backend, self.network, self._net_handle,
                      self.ranks_per_node, pg_timeout, child, env, _Stdio()),
                name=f"pipecomm-rank{rank}",
                daemon=True,
            )
            old = os.environ.get("OMP_NUM_THREADS")
            os.environ["OMP_NUM_THREADS"] = threads  # read when a spawned interpreter starts
            try:
                proc.start()
            finally:
                if old is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
                else:
                    os.environ["OMP_NUM_THREADS"] = old
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("ready", self.start_timeout_s, what="start")

    def close(self) -> None:
        """Stop the ranks politely, then forcibly; idempotent."""
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("stop",))
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + 3.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._procs, self._conns = [], []
        if self._net_handle is not None:
            from pipecomm import netem

            with contextlib.suppress(Exception):
                netem.teardown(self._net_handle)
            self._net_handle = None

    # -- work
    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``fn`` must be importable by the rank processes (module level in a .py file).
        Raises :class:`RankError` (with the rank's traceback) if a rank raises or dies, and
        :class:`TimeoutError` naming the ranks still running after ``timeout_s`` seconds.

        Example::

            results = ranks.run(mymodule.measure, 1 << 20, timeout_s=60)
        """
        if timeout_s is None or timeout_s <= 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        payload = check_picklable(fn, args, kwargs)
        self.start()
        for conn in self._conns:
            conn.send(("run", payload))
        return self._collect("ok", timeout_s, what=getattr(fn, "__qualname__", repr(fn)))

    def _collect(self, expected: str, timeout_s: float, what: str) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        conn_rank = {id(c): r for r, c in enumerate(self._conns)}
        sentinel_rank = {p.sentinel: r for r, p in enumerate(self._procs)}
        try:
            while len(results) < self.world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    pending = sorted(set(range(self.world_size)) - set(results))
                    raise TimeoutError(
                        f"{what}: ranks {pending} still running after {timeout_s:.1f} s "
                        f"(world_size={self.world_size}); all ranks were stopped"
                    )
                waiting = [c for r, c in enumerate(self._conns) if r not in results]
                waiting += [p.sentinel for r, p in enumerate(self._procs) if r not in results]
                ready = _mp_wait(waiting, timeout=min(remaining, 1.0))
                # read messages before looking at deaths: a rank may report, then exit
                for obj in sorted(ready, key=lambda o: isinstance(o, int)):
                    if isinstance(obj, int):
                        rank = sentinel_rank[obj]
                        if rank in results:
                            continue
                        conn = self._conns[rank]
                        if conn.poll(0):
                            continue  # its last message comes first
                        self._procs[rank].join(5.0)  # the sentinel can fire before it is reaped
                        code = self._procs[rank].exitcode
                        if code == _BOOTSTRAP_EXIT:
                            raise _unguarded_error()
                        raise RankError(rank, f"died (exit code {code}) during {what}")
                    rank = conn_rank[id(obj)]
                    try:
                        message = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError) as exc:
                        self._procs[rank].join(5.0)
                        code = self._procs[rank].exitcode
                        if code == _BOOTSTRAP_EXIT:
                            raise _unguarded_error() from None
                        how = f"exit code {code}" if code is not None else "its connection closed"
                        raise RankError(rank, f"died ({how}) during {what}") from exc
                    kind, msg_rank, value = message
                    if kind == "error":
                        raise RankError(msg_rank, f"{value[0]} during {what}", value[1])
                    if kind != expected:
                        raise RankError(msg_rank, f"unexpected message {kind!r} during {what}")
                    results[msg_rank] = value
        except BaseException:
            self._kill()
            raise
        return [results[r] for r in range(self.world_size)]


class TorchrunJob:
    """The ranks of a torchrun job used like a :class:`Ranks` pool: :meth:`run` runs ``fn`` in
    this process (every rank of the job does the same) and returns every rank's result, in rank
    order, on every rank. So an experiment written for a local pool also runs multi-node.

    Example::

        # torchrun --nnodes 2 --nproc-per-node 4 ... -m pipecomm.lab.experiments.e13_dadam_convergence
        with launch.pool(8, backend="nccl") as ranks:     # a TorchrunJob under torchrun
            per_rank = ranks.run(mymodule.train, cfg)
    """

    def __init__(self, world_size: int, backend: str | None = None, network: Any = None) -> None:
        if network is not None:
            raise ValueError(
                "the emulated network needs local ranks that share memory (launch.Ranks); under "
                "torchrun the real network is measured: pass network=None"
            )
        self.info = init_from_env(backend)
        if world_size != self.info.world_size:
            raise ValueError(
                f"this run needs world_size={world_size} ranks but the torchrun job has "
                f"{self.info.world_size}: start torchrun with {world_size} processes in all, or "
                f"set the experiment's world size to {self.info.world_size}"
            )
        self.world_size = world_size

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        """Nothing to stop: torchrun owns the processes."""

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` here; every rank's result (or :class:`RankError` naming the
        first rank that raised). ``timeout_s`` is the process group's own timeout here."""
        import torch.distributed as dist

        try:
            mine: tuple[str, Any] = ("ok", to_cpu(fn(*args, **kwargs)))
        except Exception as exc:
            mine = ("error", (repr(exc), traceback.format_exc()))
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        for rank, (kind, value) in enumerate(gathered):
            if kind == "error":
                raise RankError(rank, value[0], value[1])
        return [value for _, value in gathered]


def under_torchrun() -> bool:
    """True in a process that torchrun started (``TORCHELASTIC_RUN_ID`` is set).

    Example::

        if launch.under_torchrun(): info = launch.init_from_env()
    """
    return "TORCHELASTIC_RUN_ID" in os.environ


def pool(
    world_size: int,
    backend: str = "gloo",
    network: Any = None,
    ranks_per_node: int | None = None,
) -> Ranks | TorchrunJob:
    """The ranks an experiment runs on: the torchrun job when started by torchrun (with
    ``backend``; ``ranks_per_node`` is then torchrun's), else a local :class:`Ranks` pool.

    Example::

        with launch.pool(4, network=net) as ranks:
            per_rank = ranks.run(mymodule.measure, 1 << 20)
    """
    if under_torchrun():
        return TorchrunJob(world_size, backend, network)
    return Ranks(world_size, backend=backend, network=network, ranks_per_node=ranks_per_node)


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    network: Any = None,
    ranks_per_node: int | None = None,
) -> list[Any]:
    """Start ``world_size`` local ranks, run ``fn(*args)`` on each, return results in rank order.

    Ranks are stopped afterwards, also when one fails (:class:`RankError` with its traceback) or
    the run exceeds ``timeout_s`` (:class:`TimeoutError`). Use :class:`Ranks` to run many times.

    Example::

        from pipecomm import launch
        sums = launch.spawn(mymodule.allreduce_ones, 4, 1024)
    """
    check_picklable(fn, args, {})
    with Ranks(world_size, backend=backend, network=network, ranks_per_node=ranks_per_node) as r:
        return r.run(fn, *args, timeout_s=timeout_s)


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> RankInfo:
    """Join a job started by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); NCCL when CUDA is available.

    Example::

        # torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 train.py
        info = launch.init_from_env()
        print(info.rank, info.world_size, info.backend)
    """
    import torch
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env: environment variables {missing} are not set; start this program "
            "with torchrun (for example `torchrun --nproc-per-node 4 -m pipecomm.lab.experiments."
            "e13_dadam_convergence --out DIR`) or use pipecomm.launch.spawn for local ranks"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    os.environ.setdefault("PIPECOMM_PROCS_ON_HOST", str(local_world))
    _set_threads(local_world)
    if not dist.is_initialized():
        _init_distributed(rank=rank, world_size=world, backend=backend, init_method="env://",
                          timeout_s=timeout_s, gpu=local_rank)
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    return RankInfo(rank, world, local_rank, local_world, backend, device)
