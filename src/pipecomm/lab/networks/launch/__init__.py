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
still running; a collective that waits ``pg_timeout_s`` (the process group's timeout, 300 s) for a
stuck peer fails on its rank. Nothing is left running afterwards.

On Linux, ranks are forked from a server process that imported torch once (``multiprocessing``'s
forkserver; spawn elsewhere): starting a pool costs a fraction of a second instead of a torch
import (seconds of CPU) in every rank. Each rank gets the environment variables, working
directory, ``sys.path``, stdout and stderr that the starting process has at that moment, as with
spawn. The fork server itself stays, idle, until the starting process ends. As with spawn, a
rank imports the starting script: a script starts ranks under ``if __name__ == "__main__":``
(without it, :class:`UnguardedMainError` says so, once).

Modules: this package holds the pool (:class:`Ranks`, :func:`spawn`, :func:`pool`);
:mod:`.rank` what code in a rank asks (:func:`comm_group`, :func:`device`, ...), :mod:`.worker`
a local rank's process (fork server, the serving loop), :mod:`.torchrun` torchrun jobs
(:func:`init_from_env`, :class:`TorchrunJob`). Every name is importable from ``pipecomm.lab.networks.launch``.

Example::

    # python -c "from pipecomm.lab.networks import launch; import examples; print(launch.spawn(examples.f, 4))"
    from pipecomm.lab.networks import launch
    with launch.Ranks(4) as ranks:
        for n in (1, 1024):
            print(ranks.run(mymodule.measure, n))      # one value per rank
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Callable
from multiprocessing.connection import wait as _mp_wait
from typing import Any, Protocol, runtime_checkable

# re-exported: public API (pipecomm.lab.networks.launch.<name>)
from pipecomm import checks
from pipecomm.lab.networks.launch.rank import (
    RankError,
    RankInfo,
    comm_group,
    device,
    group_timeout,
    has_comm_group,
    local_world_size,
    ranks_per_node,
    reverse_transport,
    set_threads,
    synchronize,
    to_cpu,
)
from pipecomm.lab.networks.launch.torchrun import TorchrunJob, init_from_env, under_torchrun
from pipecomm.lab.networks.launch.worker import (
    BOOTSTRAP_EXIT,
    ParentStdio,
    UnguardedMainError,
    check_picklable,
    free_port,
    process_context,
    refuse_in_bootstrap,
    run_rank,
    unguarded_error,
)

__all__ = [
    "RankError",
    "check_picklable",
    "has_comm_group",
    "synchronize",
    "to_cpu",
    "RankInfo",
    "Ranks",
    "TorchrunJob",
    "UnguardedMainError",
    "check_gpus",
    "comm_group",
    "gpu_count",
    "reverse_transport",
    "device",
    "group_timeout",
    "init_from_env",
    "local_world_size",
    "pool",
    "ranks_per_node",
    "set_threads",
    "spawn",
    "under_torchrun",
]



@runtime_checkable
class RankPool(Protocol):
    """What every set of ranks the lab runs functions on offers: ``run(fn, *args, timeout_s=)``
    runs ``fn(*args)`` on every rank and returns the results in rank order (a rank's exception
    is a :class:`RankError` naming it; past ``timeout_s``, a TimeoutError). Implemented by the
    local pool (:class:`Ranks`), a torchrun job (:class:`TorchrunJob`), the virtual cluster and
    its jobs (:class:`pipecomm.lab.networks.cluster.VirtualCluster`, ``ClusterJob``) and an experiment's
    :class:`pipecomm.lab.networks.kinds.NetworkRanks`; code that only runs functions takes any of them.

    Example::

        >>> from pipecomm.lab.networks import launch
        >>> issubclass(launch.Ranks, launch.RankPool), issubclass(launch.TorchrunJob, launch.RankPool)
        (True, True)
    """

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = ...) -> list[Any]:
        """``fn(*args)`` on every rank; the results in rank order."""
        ...


_STARTUP_TIMEOUT_S = 120.0
_PG_TIMEOUT_S = 300.0  # a pool's collectives fail after this long without progress


def _check_pg_timeout(pg_timeout_s: Any) -> None:
    checks.positive_number(pg_timeout_s, "pg_timeout_s", "launch.Ranks", "seconds")


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


def gpu_count() -> int:
    """The GPUs an NCCL pool may place its ranks on: torch's visible CUDA devices (0 without
    CUDA), or a rehearsal's stand-in GPUs while one runs (:func:`pipecomm.lab.standin.gpu_count`).

    Example::

        launch.gpu_count()   # 8 on an 8-GPU node
    """
    import torch

    from pipecomm.lab import standin

    stand_in = standin.gpu_count()
    if stand_in is not None:
        return stand_in
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_gpus(world_size: int) -> None:
    """Raise ValueError unless ``world_size`` GPUs are visible (:func:`gpu_count`): NCCL places
    one rank per GPU.

    Example::

        launch.check_gpus(8)   # before starting an 8-rank NCCL pool
    """
    have = gpu_count()
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
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (one GPU per rank; gloo on CPU while a
            rehearsal runs, :mod:`pipecomm.lab.standin`).
        network: an emulated network (``pipecomm.lab.networks.netem.Network``) applied to pipecomm's
            point-to-point transfers on every rank, or ``None`` for the real backend.
        ranks_per_node: ranks per emulated node (sets ``LOCAL_WORLD_SIZE`` in the ranks).
        start_timeout_s: limit for starting the ranks and joining the process group.
        pg_timeout_s: the process group's timeout (``init_process_group(timeout=...)``): a
            collective, or a transfer of pipecomm's communication thread, that waits this long
            for a dead or stuck peer fails, and the run raises :class:`RankError`.

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
        pg_timeout_s: float = _PG_TIMEOUT_S,
    ) -> None:
        from pipecomm.lab import standin

        _validate(world_size, backend, ranks_per_node, network)
        _check_pg_timeout(pg_timeout_s)
        self.world_size = world_size
        self.backend = standin.process_backend(backend)  # a rehearsal's NCCL: gloo on CPU
        self.network = network
        self.ranks_per_node = ranks_per_node
        self.start_timeout_s = start_timeout_s
        self.pg_timeout_s = float(pg_timeout_s)
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
        refuse_in_bootstrap()
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
        port = free_port()
        if self.network is not None:
            from pipecomm.lab.networks import netem

            self._net_handle = netem.setup(self.network, self.world_size, self.ranks_per_node)
        ctx = process_context()
        threads = str(max(1, (os.cpu_count() or 1) // self.world_size))
        env = {**os.environ, "OMP_NUM_THREADS": threads}
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=run_rank,
                args=(rank, self.world_size, port, self.backend, self.network, self._net_handle,
                      self.ranks_per_node, self.pg_timeout_s, child, env, ParentStdio(),
                      self.start_timeout_s),
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
            from pipecomm.lab.networks import netem

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
        checks.positive_number(timeout_s, "timeout_s", "launch.Ranks.run", "seconds")
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
                        if code == BOOTSTRAP_EXIT:
                            raise unguarded_error()
                        raise RankError(rank, f"died (exit code {code}) during {what}")
                    rank = conn_rank[id(obj)]
                    try:
                        message = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError) as exc:
                        self._procs[rank].join(5.0)
                        code = self._procs[rank].exitcode
                        if code == BOOTSTRAP_EXIT:
                            raise unguarded_error() from None
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
    pg_timeout_s: float = _PG_TIMEOUT_S,
) -> list[Any]:
    """Start ``world_size`` local ranks, run ``fn(*args)`` on each, return results in rank order.

    Ranks are stopped afterwards, also when one fails (:class:`RankError` with its traceback) or
    the run exceeds ``timeout_s`` (:class:`TimeoutError`). ``pg_timeout_s`` is the ranks' process
    group timeout (see :class:`Ranks`). Use :class:`Ranks` to run many times.

    Example::

        from pipecomm.lab.networks import launch
        sums = launch.spawn(mymodule.allreduce_ones, 4, 1024)
    """
    check_picklable(fn, args, {})
    with Ranks(world_size, backend=backend, network=network, ranks_per_node=ranks_per_node,
               pg_timeout_s=pg_timeout_s) as r:
        return r.run(fn, *args, timeout_s=timeout_s)
