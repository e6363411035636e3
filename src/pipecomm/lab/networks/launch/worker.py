"""A local rank's process: the fork server it starts from, and the loop it serves calls in.

:class:`pipecomm.lab.networks.launch.Ranks` starts each rank with :func:`run_rank` in a process of
:func:`process_context` (on Linux forked from a server that imported torch once), hands it this
process's stdout and stderr (:class:`ParentStdio`) and sends it calls pickled by
:func:`check_picklable`. A script that starts ranks without a ``__main__`` guard gets
:class:`UnguardedMainError` (:func:`refuse_in_bootstrap`, :func:`unguarded_error`).

Example::

    >>> from pipecomm.lab.networks import launch
    >>> payload = launch.check_picklable(launch.device, (1 << 20,), {})
    >>> type(payload)
    <class 'bytes'>
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any

from pipecomm.lab.networks.launch import flight
from pipecomm.lab.networks.launch.rank import init_distributed, set_threads, to_cpu

__all__ = [
    "BOOTSTRAP_EXIT",
    "ParentStdio",
    "UnguardedMainError",
    "check_picklable",
    "free_port",
    "process_context",
    "refuse_in_bootstrap",
    "run_rank",
    "unguarded_error",
]

#: imported once by the fork server, so that a rank starts without importing them again
#: (torch._dynamo: the first torch.optim optimizer imports it; sklearn.datasets: the digits).
#: Third-party only: a rank imports pipecomm itself, so it runs the code as it is on disk.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "pandas", "sklearn.datasets"]


#: Exit status of a rank that found itself re-running its parent's script at module level
#: (:func:`refuse_in_bootstrap`); the parent turns it into :class:`UnguardedMainError`.
BOOTSTRAP_EXIT = 97


class UnguardedMainError(RuntimeError):
    """Ranks were started from a script's module level without ``if __name__ == "__main__":``:
    each rank re-runs the script while it starts and would start ranks of its own."""


def _main_script() -> str:
    main = sys.modules.get("__main__")
    return getattr(main, "__file__", None) or "the main script"


def unguarded_error() -> UnguardedMainError:
    """The :class:`UnguardedMainError` naming the main script and the fix.

    Example::

        >>> raise unguarded_error()
        Traceback (most recent call last):
            ...
        pipecomm.lab.networks.launch.worker.UnguardedMainError: ...
    """
    return UnguardedMainError(
        f"the ranks re-ran {_main_script()} while starting, and its module-level code starts "
        "ranks again: put the code that uses launch.Ranks / launch.spawn under "
        "`if __name__ == \"__main__\":` (multiprocessing starts each rank by importing the main "
        "script)"
    )


def refuse_in_bootstrap() -> None:
    """In a rank that is still importing its parent's main script (multiprocessing's bootstrap:
    the script starts ranks at module level, without a ``__main__`` guard), exit at once with
    :data:`BOOTSTRAP_EXIT` instead of multiprocessing's error; the parent says why, once."""
    if getattr(mp.current_process(), "_inheriting", False):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(BOOTSTRAP_EXIT)


def process_context() -> Any:
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


class ParentStdio:
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
    """In a rank: write to the starting process's stdout and stderr (see :class:`ParentStdio`)."""
    if not isinstance(stdio, tuple):
        return
    for wrapped, target in zip(stdio, (1, 2)):
        if wrapped is not None:
            fd = wrapped.detach()
            if fd != target:
                os.dup2(fd, target)
                os.close(fd)


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphans after a crash)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _reply(conn: Any, kind: str, rank: int, value: Any) -> None:
    conn.send_bytes(pickle.dumps((kind, rank, value), protocol=pickle.HIGHEST_PROTOCOL))


def run_rank(
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
    start_timeout_s: float | None = None,
) -> None:
    """Body of one local rank: initialise (the process group's timeout ``pg_timeout_s``, its
    rendezvous waiting up to ``start_timeout_s``), then serve ``run`` requests until told to
    stop."""
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
        set_threads(world_size)
        init_distributed(
            rank=rank,
            world_size=world_size,
            backend=backend,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout_s=pg_timeout_s,
            gpu=rank,
            start_timeout_s=start_timeout_s,
        )
        if network is not None:
            from pipecomm.lab.networks import netem

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
            with contextlib.suppress(Exception):  # with PIPECOMM_FLIGHT_DIR: before the reply
                flight.dump(repr(exc))
            _reply(conn, "error", rank, (repr(exc), traceback.format_exc()))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a local pool's store; it can be taken before use).

    Example::

        >>> 0 < free_port() < 65536
        True
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_picklable(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """``(fn, args, kwargs)`` pickled for a rank, or one error saying why a rank could not
    import ``fn`` (defined in a notebook cell or ``__main__`` without a file) or unpickle the
    arguments.

    Example::

        >>> from pipecomm.lab.networks import launch
        >>> payload = launch.check_picklable(launch.device, (1 << 20,), {})
        >>> launch.check_picklable(lambda: 0, (), {})
        Traceback (most recent call last):
            ...
        ValueError: fn=<function <lambda> at 0x...> is a lambda or nested function, which rank ...
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
