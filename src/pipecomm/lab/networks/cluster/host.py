"""Host commands of the virtual cluster: Linux network namespaces, veth links shaped by tc tbf.

What :class:`pipecomm.lab.networks.cluster.VirtualCluster` is built from: short ``ip`` / ``tc`` commands
with a timeout (:func:`run_command`), the token-bucket shaper (:func:`tbf_argv`, and
:func:`tbf_max_rate`, the fastest a shaped transfer can look), the namespaces of this host
(:func:`namespaces`, :func:`kill_namespace`, :func:`cleanup_stale`) and whether this machine can
build any of it (:func:`available`). Names of a run start with ``pc<pid>-`` (:func:`run_prefix`).

Example::

    from pipecomm.lab.networks.cluster import host
    ok, why = host.available()
    host.cleanup_stale()   # [] after clean runs
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from pipecomm.lab import guard

__all__ = [
    "ClusterError",
    "available",
    "cleanup_stale",
    "current",
    "kill_namespace",
    "namespaces",
    "run_command",
    "run_prefix",
    "tbf_argv",
    "tbf_max_rate",
]

_CMD_TIMEOUT_S = 20.0
_PREFIX_RE = re.compile(r"^pc(\d+)-")
_COUNTER = iter(range(1 << 30))


class ClusterError(RuntimeError):
    """A virtual cluster could not be built, or a program on one of its nodes failed."""


def run_prefix() -> str:
    """A fresh name prefix ``pc<pid>-<n>`` for one virtual cluster of this process (its
    namespaces' names start with it; :func:`cleanup_stale` reads the pid back).

    Example::

        >>> run_prefix()   # 'pc4242-0'
        'pc...-...'
    """
    return f"pc{os.getpid()}-{next(_COUNTER)}"


def run_command(argv: Sequence[str], timeout_s: float = _CMD_TIMEOUT_S, check: bool = True) -> str:
    """Run a short host command (``ip``, ``tc``) with a timeout; its stdout. A command that
    fails (``check``), times out or cannot start raises :class:`ClusterError` naming it.

    Example::

        run_command(["ip", "netns", "list"])
    """
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"`{' '.join(argv)}` did not finish in {timeout_s:.0f} s") from exc
    except OSError as exc:
        raise ClusterError(f"`{' '.join(argv)}` could not start: {exc}") from exc
    if check and proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"`{' '.join(argv)}` failed: {msg[0] if msg else proc.returncode}")
    return proc.stdout


def _rate(bandwidth_Bps: float) -> str:
    return f"{round(bandwidth_Bps * 8)}bit"


def tbf_argv(ns: str, dev: str, bandwidth_Bps: float, burst_bytes: int) -> list[str]:
    """The ``tc`` command that shapes ``dev`` in namespace ``ns`` to ``bandwidth_Bps`` with a
    token bucket of ``burst_bytes`` and a queue of 100 ms.

    Example::

        >>> tbf_argv("pc1-0n0", "eth0", 15e6, 16384)
        ['tc', '-n', 'pc1-0n0', 'qdisc', 'add', 'dev', 'eth0', 'root', 'tbf', 'rate', '120000000bit', 'burst', '16384', 'latency', '100ms']
    """
    return ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate",
            _rate(bandwidth_Bps), "burst", str(burst_bytes), "latency", "100ms"]


def tbf_max_rate(bandwidth_Bps: float, burst_bytes: int, nbytes: int,
                 latency_s: float = 0.0) -> float:
    """The highest rate (B/s) a transfer of ``nbytes`` can show on a link that tc tbf shapes to
    ``bandwidth_Bps`` with a bucket of ``burst_bytes`` (:class:`VirtualCluster`'s
    ``burst_bytes``): a full bucket lets ``burst_bytes`` through at once and the rest at the
    rate, so the transfer takes at least ``(nbytes - burst_bytes) / bandwidth_Bps``. A measured
    rate above the configured one by up to this much is the shaper's burst, not an error.
    ``latency_s``: a latency already taken off the measured time (an alpha-beta fit's alpha:
    the fit's bandwidth is ``nbytes / (time - alpha)``). Infinite when the bucket holds the
    whole transfer.

    Example::

        >>> round(tbf_max_rate(80e6, 80_000, 1 << 20) / 1e6, 1)           # 8% above the rate at 1 MiB
        86.6
        >>> round(tbf_max_rate(80e6, 80_000, 1 << 20, 2e-3) / 1e6, 1)     # a fit whose alpha is 2 ms
        103.7
    """
    floor_s = max(0, nbytes - burst_bytes) / bandwidth_Bps - latency_s
    return nbytes / floor_s if floor_s > 0 else math.inf


def namespaces() -> list[str]:
    """Names of this host's network namespaces (``ip netns list``).

    Example::

        [ns for ns in namespaces() if ns.startswith("pc")]
    """
    out = run_command(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_namespace(ns: str) -> None:
    """Kill every process inside ``ns``, then delete it (its veth ends go with it).

    Example::

        kill_namespace("pc4242-0n0")
    """
    for _ in range(3):
        pids = [int(p) for p in run_command(["ip", "netns", "pids", ns], check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    run_command(["ip", "netns", "del", ns], check=False)


def cleanup_stale() -> list[str]:
    """Remove the namespaces (and their links and processes) of runs whose process is gone.

    Names of a run start with ``pc<pid>-``; a namespace whose ``pid`` is not alive is stale.
    Returns the names removed.

    Example::

        cluster.cleanup_stale()   # [] after clean runs
    """
    removed = []
    for ns in namespaces():
        m = _PREFIX_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not guard.alive(int(m.group(1))):
            kill_namespace(ns)
            removed.append(ns)
    return removed


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"needs Linux network namespaces (platform is {sys.platform})"
    if os.geteuid() != 0:
        return False, "needs root to create network namespaces (euid is not 0)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"needs iproute2 (`{tool}` is not on PATH)"
    ns = f"pc{os.getpid()}-probe{next(_COUNTER)}"
    try:
        run_command(["ip", "netns", "add", ns])
        run_command(["ip", "-n", ns, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"])
        run_command(tbf_argv(ns, "pa", 50e6, 32 << 10))
        run_command(["ip", "-n", ns, "link", "add", "name", "br0", "type", "bridge"])
    except ClusterError as exc:
        return False, f"cannot build a shaped link: {exc}"
    finally:
        with contextlib.suppress(ClusterError):
            kill_namespace(ns)
    return True, "network namespaces, veth, bridge and tc tbf available"


def available() -> tuple[bool, str]:
    """Whether a :class:`VirtualCluster` can be built here, and a one-line reason.

    Needs Linux, root, iproute2 (``ip``, ``tc``) and the tbf qdisc; tried once per process by
    building and removing a shaped veth pair. ``PIPECOMM_NO_CLUSTER=1`` answers no.

    Example::

        ok, reason = cluster.available()
        if not ok:
            print(f"shaped network unavailable ({reason}); using the emulator")
    """
    if os.environ.get("PIPECOMM_NO_CLUSTER", "") not in ("", "0"):
        return False, "disabled by PIPECOMM_NO_CLUSTER"
    return _probe()


def current() -> str | None:
    """In a process started on a virtual cluster (a rank, a node program): the cluster's
    :meth:`VirtualCluster.describe` text, for ``env.json`` and figure titles; else ``None``.

    Example::

        network = cluster.current() or (netem.current().describe() if netem.current() else "real")
    """
    return os.environ.get("PIPECOMM_CLUSTER") or None
