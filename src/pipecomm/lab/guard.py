"""What keeps one run of the orchestrator from being damaged by another, or by a killed one.

* :func:`locked`: one run at a time per results directory (``results/<profile>/.lock``, an
  ``flock`` that the kernel releases when its holder dies, even by ``kill -9``); a second run
  refuses in one line naming the first's pid (:class:`Busy`).
* :func:`remove_debris`: what a killed run left -- half-assembled ``.<E>.tmp-<pid>`` result
  directories, ``.<E>.old-<pid>`` ones, ``.<file>.*.tmp`` partial writes -- removed by the next
  run (under the lock, so nothing of a live run is touched).
* :func:`kernel_dir` / :func:`remove_dead_kernel_dirs`: each notebook kernel's sockets and
  connection file live in one private ``pipecomm-kernel-<pid>-*`` directory of the system's
  temporary directory, removed when the kernel ends, or by the next run once ``<pid>`` is dead
  (which first stops whatever that kernel's session left running).
* :func:`check_writable`: the results directory takes a file before the first experiment runs.

Example::

    >>> import tempfile, pathlib
    >>> from pipecomm.lab import guard
    >>> base = pathlib.Path(tempfile.mkdtemp())
    >>> with guard.locked(base):
    ...     (base / ".lock").exists()
    True
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

_KERNEL_PREFIX = "pipecomm-kernel-"
_DEBRIS = re.compile(r"^\..+\.(tmp|old)-(\d+)$|^\..+\.tmp$")


class Busy(RuntimeError):
    """Another run holds the results directory."""


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (on this host)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def locked(base: Path) -> Iterator[None]:
    """Hold ``base/.lock`` for the block; raise :class:`Busy` at once when another process
    holds it (the message names its pid).

    Example::

        with guard.locked(RESULTS / "cpu"):
            ...   # run the experiments
    """
    base.mkdir(parents=True, exist_ok=True)
    path = base / ".lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise Busy(f"{path.parent} is in use by another run (pid {holder}): wait for it, or "
                       f"stop it (kill {holder})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def remove_debris(base: Path) -> list[str]:
    """Remove what killed runs left in ``base`` and its run and result directories
    (``.E4.tmp-<pid>``, ``.E4.old-<pid>``, ``.data.csv.x1y2.tmp``); call it holding
    :func:`locked`. Returns the names removed.

    Example::

        guard.remove_debris(RESULTS / "cpu")   # ['.E4.tmp-4242']
    """
    removed = []
    folders = {base}
    for _ in range(2):  # base, its run-<k> and result directories, and theirs
        folders |= {e for f in folders if f.is_dir() for e in f.iterdir()
                    if e.is_dir() and not e.name.startswith(".")}
    for folder in sorted(folders):
        for entry in folder.iterdir():
            if _DEBRIS.match(entry.name):
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(entry.name)
    return removed


def kernel_dir() -> Path:
    """A new private directory for one kernel's sockets and connection file, named after this
    process (``pipecomm-kernel-<pid>-*``) so that a later run can tell when it is orphaned."""
    return Path(tempfile.mkdtemp(prefix=f"{_KERNEL_PREFIX}{os.getpid()}-"))


def session_of(pid: str) -> int | None:
    """The session id of process ``pid`` (from /proc), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[3])


def kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid`` (a kernel leads its own: what it started,
    ranks and their helpers, went with it); returns how many there were."""
    members = [int(p.name) for p in Path("/proc").iterdir()
               if p.name.isdigit() and int(p.name) != os.getpid() and session_of(p.name) == sid]
    for pid in members:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return len(members)


def kernel_dirs() -> list[Path]:
    """Every kernel directory (:func:`kernel_dir`) in the system's temporary directory."""
    return sorted(Path(tempfile.gettempdir()).glob(f"{_KERNEL_PREFIX}*"))


def remove_dead_kernel_dirs() -> list[str]:
    """Remove the kernel directories (:func:`kernel_dir`) of runs that no longer run, first
    stopping what their kernel left running (the ``kernel.pid`` recorded there names its
    session)."""
    removed = []
    for entry in kernel_dirs():
        found = re.match(rf"{_KERNEL_PREFIX}(\d+)-", entry.name)
        if found and not alive(int(found.group(1))):
            with contextlib.suppress(OSError, ValueError):
                kill_session(int((entry / "kernel.pid").read_text()))
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry.name)
    return removed


def check_writable(base: Path) -> None:
    """Raise OSError naming ``base`` when a file cannot be created there (read-only, no
    permission, no space for even one block)."""
    try:
        base.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=base, prefix=".writable.", suffix=".tmp") as f:
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OSError(exc.errno, f"cannot write results to {base}: {exc.strerror}") from None
