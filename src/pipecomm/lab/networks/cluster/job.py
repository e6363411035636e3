"""The ranks of a virtual cluster's job, and the bookkeeping of the programs on its nodes.

A job (:meth:`pipecomm.lab.networks.cluster.VirtualCluster.job`) keeps torchrun's ranks up between calls:
the orchestrator side is :class:`ClusterJob`, the rank side :func:`serve`; calls and results
travel through the shared file system. The node programs are watched (:func:`check_nodes`,
:func:`raise_timeout`, :func:`read_output`) and stopped (:func:`stop_process`,
:func:`term_with_parent`) by the helpers here.

Example::

    with c.job() as ranks:                      # c: a started VirtualCluster
        out = ranks.run(mymodule.measure, 1 << 20, timeout_s=60)
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipecomm import checks
from pipecomm.lab.networks.cluster.host import ClusterError

__all__ = [
    "ClusterJob",
    "check_nodes",
    "raise_timeout",
    "read_output",
    "serve",
    "stop_process",
    "term_with_parent",
]


class ClusterJob:
    """The ranks of a :meth:`VirtualCluster.job`: ``run(fn, *args)`` on all of them.

    Calls travel through the (shared) file system: call ``k`` is ``call-<k>.pkl`` in the job's
    directory, written atomically; every rank runs it and writes ``result-<k>-<rank>.pkl``. A
    rank that raises writes its error and exits (the job is over: the others may wait in a
    collective); a node whose agent exits, or a call past its ``timeout_s``, stops the job.
    ``cluster`` is the :class:`pipecomm.lab.networks.cluster.VirtualCluster` the job runs on.
    """

    def __init__(self, cluster: Any, job_dir: Path, procs: list, files: list) -> None:
        self.cluster, self.dir, self._procs, self._files = cluster, job_dir, procs, files
        self.world_size = cluster.world_size
        self._calls = 0
        self._dead = False

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank of the job; results in rank order.

        Example::

            per_rank = job.run(sweep.measure_points, points, timeout_s=120)
        """
        from pipecomm.lab import results
        from pipecomm.lab.networks import launch

        if self._dead:
            raise ClusterError("this cluster job has stopped (an earlier call failed)")
        limit = checks.positive_number(self.cluster.timeout_s if timeout_s is None else timeout_s,
                                       "timeout_s", "ClusterJob.run", "seconds")
        payload = launch.check_picklable(fn, args, kwargs)
        k = self._calls
        self._calls += 1
        results.write_bytes(self.dir / f"call-{k}.pkl", payload)
        paths = [self.dir / f"result-{k}-{rank}.pkl" for rank in range(self.world_size)]
        deadline = time.monotonic() + limit
        try:
            while True:
                _raise_rank_error(paths)
                if all(p.exists() for p in paths):
                    return [pickle.loads(p.read_bytes())[1] for p in paths]
                if time.monotonic() > deadline:
                    raise_timeout(self._procs, self._files, limit)
                codes = check_nodes(self._procs, self._files, results=paths)
                if any(c == 0 for c in codes):
                    raise ClusterError("a node's torchrun agent ended during a call")
                time.sleep(0.02)
        except BaseException:
            self._dead = True
            raise

    def close(self) -> None:
        """Ask the ranks to leave (they exit after the current call); the cluster's context
        stops whatever is still running."""
        from pipecomm.lab import results

        if self._dead:
            return
        results.write_bytes(self.dir / "stop", b"")
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
            time.sleep(0.05)
        self._dead = True


def check_nodes(procs: list[subprocess.Popen], files: list, results: list[Path] = ()
                ) -> list[int | None]:
    """Exit codes of the node programs; a failed one raises (a rank's own error first).

    Example::

        codes = check_nodes(procs, files)   # [None, None] while both run
    """
    codes = [p.poll() for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
        time.sleep(1.0)  # let the others print why they stop too, and results land
        _raise_rank_error(results)
        i = failed[0]
        tail = read_output(files[i])[1][-3000:]
        raise ClusterError(f"node {i} exited with status {codes[i]}:\n{tail}")
    return codes


def raise_timeout(procs: list[subprocess.Popen], files: list, limit: float) -> None:
    """Raise :class:`TimeoutError` naming the node programs still running after ``limit``
    seconds, with the end of their stderr.

    Example::

        if time.monotonic() > deadline: raise_timeout(procs, files, limit)
    """
    codes = [p.poll() for p in procs]
    running = [i for i, c in enumerate(codes) if c is None]
    tails = "\n".join(f"--- node {i}\n{read_output(files[i])[1][-1500:]}" for i in running)
    raise TimeoutError(f"nodes {running} still running after {limit:.0f} s; stopped\n{tails}")


def _raise_rank_error(paths: Sequence[Path]) -> None:
    from pipecomm.lab.networks import launch

    for rank, path in enumerate(paths):
        if path.exists():
            kind, value = pickle.loads(path.read_bytes())
            if kind == "error":
                raise launch.RankError(rank, value[0], value[1])


def term_with_parent() -> None:
    """In a node program before exec: SIGTERM it when the orchestrator dies (``ip netns exec``
    execs the program in place, so the request stays). torchrun then stops its workers; the
    namespaces themselves go with the next run's :func:`cleanup_stale`."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def read_output(files: tuple) -> tuple[str, str]:
    """``(stdout, stderr)`` of a node program so far, from its two open files.

    Example::

        >>> import tempfile
        >>> files = [(tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+"))]   # node 0's
        >>> _ = files[0][0].write("rank 0 done")
        >>> out, err = read_output(files[0])
        >>> out, err
        ('rank 0 done', '')
    """
    texts = []
    for f in files:
        f.flush()
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def stop_process(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """Stop ``proc`` and its session (SIGTERM, then SIGKILL after ``grace_s``)."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


def serve(job_dir: str) -> None:
    """Body of a rank of :meth:`VirtualCluster.job` (under torchrun): run the calls as they
    come, until the orchestrator writes ``stop``."""
    from pipecomm.lab import results
    from pipecomm.lab.networks import launch

    path = Path(job_dir)
    info = launch.init_from_env((path / "backend").read_text())
    k = 0
    while True:
        call = path / f"call-{k}.pkl"
        while not call.exists():
            if (path / "stop").exists():
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)  # see lab.cli._leave_job
            time.sleep(0.01)
        try:
            fn, args, kwargs = pickle.loads(call.read_bytes())
            result: tuple[str, Any] = ("ok", launch.to_cpu(fn(*args, **kwargs)))
        except BaseException as exc:
            result = ("error", (repr(exc), traceback.format_exc()))
        results.write_bytes(path / f"result-{k}-{info.rank}.pkl", pickle.dumps(result))
        if result[0] != "ok":
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        k += 1
