"""A virtual cluster on one machine: nodes are Linux network namespaces joined by shaped links.

The network of the DAdam paper's runtime model (Wang, Zhang, Wu, Johansson, ICLR 2025: the ranks
of a node share one inter-node link; intra-node traffic is fast) and, with one rank per node, the
single-port model of the LP paper (Wang et al., arXiv 1611.04255: one full-duplex port per rank),
carried by the kernel's own TCP stack and traffic shaper instead of pipecomm's emulator:

* node ``i`` is a network namespace with a loopback and one interface ``eth0`` (address
  ``10.77.0.<i+1>/24``, a subnet that exists only inside the namespaces of the run);
* a bridge ``br0`` in a namespace of its own joins the nodes: node ``i``'s ``eth0`` is one end of
  a veth pair whose other end ``v<i>`` is a port of the bridge;
* each node's link is shaped in both directions to ``bandwidth_Bps`` by a token-bucket filter
  (``tc qdisc ... tbf``) on both ends of its veth: ``eth0`` shapes what the node sends,
  ``v<i>`` what it receives. The ranks of a node share its namespace, so they talk to each other
  over its loopback (unshaped) and share its link to the others (two-level network).

Nothing is configured in the host's own namespace: the veth ends are created inside the
namespaces (``ip -n``). Every listener (the rendezvous store, gloo) binds inside a node's
namespace. Names carry a per-run prefix ``pc<pid>-``; :class:`VirtualCluster` removes its
namespaces, links and processes on success, on a failing rank, on SIGINT / SIGTERM and at exit,
and :func:`cleanup_stale` (run by every new cluster) removes what a killed run left behind.
Latency cannot be added (the kernel here may lack the ``netem`` qdisc); links are bandwidth-shaped
only.

``links="per-neighbor"`` builds the per-neighbor port model instead (the LP paper's model with
one link per pair of ranks): no bridge; every pair of nodes ``i < j`` has its own veth pair
(``p<j>`` in node ``i``, ``p<i>`` in node ``j``), shaped both ways, and a host route to the
peer's address through it; a node's address sits on its ``eth0`` (a veth whose other end stays
in the node), so gloo still binds to ``eth0``.

Programs run through the multi-node path of the README: one ``torchrun`` agent per node, started
inside its namespace with ``--nnodes N --node-rank i --rdzv-backend c10d --rdzv-endpoint
<node 0>:<port>``, and ``GLOO_SOCKET_IFNAME=eth0``.

Example::

    from pipecomm.lab import cluster
    ok, why = cluster.available()
    if ok:
        with cluster.VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6) as c:
            c.torchrun(["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "out/E13"])
            print(c.run(mymodule.measure, 1 << 20))       # fn on every rank, results in rank order
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import functools
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ClusterError",
    "ClusterJob",
    "NodeResult",
    "VirtualCluster",
    "available",
    "calibrate",
    "cleanup_stale",
    "current",
    "chain_bandwidth",
    "link_bandwidth",
    "measure_bandwidth",
    "experiment_module",
    "profile_args",
    "program_args",
]

SUBNET = "10.77.0"  # /24, exists only inside the run's namespaces
IFNAME = "eth0"  # a node's interface (the same name in every node namespace)
LINKS = ("bridge", "per-neighbor")
MAX_NODES = 250
_CMD_TIMEOUT_S = 20.0
_PREFIX_RE = re.compile(r"^pc(\d+)-")
_COUNTER = iter(range(1 << 30))


class ClusterError(RuntimeError):
    """A virtual cluster could not be built, or a program on one of its nodes failed."""


@dataclass
class NodeResult:
    """What one node's program did: its node index, exit status and output."""

    node: int
    returncode: int
    stdout: str
    stderr: str


# --------------------------------------------------------------------------- host commands


def _cmd(argv: Sequence[str], timeout_s: float = _CMD_TIMEOUT_S, check: bool = True) -> str:
    """Run a short host command (``ip``, ``tc``) with a timeout; its stdout."""
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

        tbf_argv("pc1-0n0", "eth0", 15e6, 16384)
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

        tbf_max_rate(80e6, 80_000, 1 << 20)           # 86.6e6: 8% above the rate at 1 MiB
        tbf_max_rate(80e6, 80_000, 1 << 20, 2e-3)     # 104e6: a fit whose alpha is 2 ms
    """
    floor_s = max(0, nbytes - burst_bytes) / bandwidth_Bps - latency_s
    return nbytes / floor_s if floor_s > 0 else math.inf


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _cmd(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """Kill every process inside ``ns``, then delete it (its veth ends go with it)."""
    for _ in range(3):
        pids = [int(p) for p in _cmd(["ip", "netns", "pids", ns], check=False).split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    _cmd(["ip", "netns", "del", ns], check=False)


def cleanup_stale() -> list[str]:
    """Remove the namespaces (and their links and processes) of runs whose process is gone.

    Names of a run start with ``pc<pid>-``; a namespace whose ``pid`` is not alive is stale.
    Returns the names removed.

    Example::

        cluster.cleanup_stale()   # [] after clean runs
    """
    removed = []
    for ns in _namespaces():
        m = _PREFIX_RE.match(ns)
        if m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
            _kill_namespace(ns)
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
        _cmd(["ip", "netns", "add", ns])
        _cmd(["ip", "-n", ns, "link", "add", "name", "pa", "type", "veth", "peer", "name", "pb"])
        _cmd(tbf_argv(ns, "pa", 50e6, 32 << 10))
        _cmd(["ip", "-n", ns, "link", "add", "name", "br0", "type", "bridge"])
    except ClusterError as exc:
        return False, f"cannot build a shaped link: {exc}"
    finally:
        with contextlib.suppress(ClusterError):
            _kill_namespace(ns)
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


# --------------------------------------------------------------------------- the cluster


class VirtualCluster:
    """N nodes (network namespaces) on a bridge, every node link shaped both ways.

    Args:
        nodes: number of nodes (2 .. 250).
        ranks_per_node: torchrun worker processes per node (they share the node's namespace).
        bandwidth_Bps: rate of every node link, each direction, bytes per second; ``None`` leaves
            the links unshaped.
        burst_bytes: token-bucket depth (default: 1 ms of traffic, at least 16 KiB).
        links: ``"bridge"`` (one shaped link per node to a bridge: single-port / two-level) or
            ``"per-neighbor"`` (one shaped link per pair of nodes).
        timeout_s: default limit of each program run on the cluster.

    The rendezvous and every rank's gloo run inside the namespaces; results reach the caller
    through the file system (it is shared: only the network is virtual).

    Example::

        with VirtualCluster(nodes=8, ranks_per_node=1, bandwidth_Bps=50e6) as c:
            c.torchrun(["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "out"])
    """

    def __init__(
        self,
        nodes: int,
        ranks_per_node: int = 1,
        bandwidth_Bps: float | None = 50e6,
        *,
        burst_bytes: int | None = None,
        links: str = "bridge",
        timeout_s: float = 600.0,
    ) -> None:
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be an int in [2, {MAX_NODES}], got {nodes!r}")
        if (isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int)
                or ranks_per_node < 1):
            raise ValueError(f"ranks_per_node must be a positive int, got {ranks_per_node!r}")
        if bandwidth_Bps is not None and (
            isinstance(bandwidth_Bps, bool) or not isinstance(bandwidth_Bps, (int, float))
            or not 1e3 <= bandwidth_Bps <= 1e11
        ):
            raise ValueError(
                f"bandwidth_Bps must be None or a number in [1e3, 1e11] B/s, got {bandwidth_Bps!r}"
            )
        if burst_bytes is None:
            burst_bytes = max(16 << 10, int((bandwidth_Bps or 0) * 1e-3))
        if isinstance(burst_bytes, bool) or not isinstance(burst_bytes, int) or burst_bytes < 2048:
            raise ValueError(f"burst_bytes must be an int >= 2048, got {burst_bytes!r}")
        if links not in LINKS:
            raise ValueError(f"links must be one of {LINKS}, got {links!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.bandwidth_Bps = None if bandwidth_Bps is None else float(bandwidth_Bps)
        self.burst_bytes = burst_bytes
        self.links = links
        self.timeout_s = float(timeout_s)
        self.prefix = f"pc{os.getpid()}-{next(_COUNTER)}"
        self.bridge_ns = f"{self.prefix}br"
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._lock = threading.RLock()
        self._old_handlers: dict[int, Any] = {}
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.started = False

    # -- names
    def netns(self, node: int) -> str:
        """Namespace name of ``node``.

        Example::

            c.netns(0)   # 'pc4242-0n0'
        """
        self._check_node(node)
        return f"{self.prefix}n{node}"

    def addr(self, node: int) -> str:
        """IPv4 address of ``node`` (inside the run's subnet).

        Example::

            c.addr(0)   # '10.77.0.1'
        """
        self._check_node(node)
        return f"{SUBNET}.{node + 1}"

    def describe(self) -> str:
        """Short text for figure titles, ``env.json`` and logs.

        Example::

            c.describe()   # 'shaped: Linux tc tbf, real TCP; 2 nodes x 1 rank, 50 MB/s per ...'
        """
        bw = "unshaped" if self.bandwidth_Bps is None else f"{self.bandwidth_Bps / 1e6:.4g} MB/s"
        per = "node link" if self.links == "bridge" else "link per node pair"
        return (f"shaped: Linux tc tbf, real TCP; {self.nodes} nodes x {self.ranks_per_node} "
                f"rank{'s' if self.ranks_per_node > 1 else ''}, {bw} per {per} each way")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly description (for ``env.json``).

        Example::

            json.dumps(c.to_dict())
        """
        return {"network": "shaped", "nodes": self.nodes, "ranks_per_node": self.ranks_per_node,
                "bandwidth_Bps": self.bandwidth_Bps, "burst_bytes": self.burst_bytes,
                "links": self.links, "shaper": "tc tbf on both ends of every veth link",
                "subnet": f"{SUBNET}.0/24"}

    def _check_node(self, node: int) -> None:
        if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < self.nodes:
            raise ValueError(f"node must be an int in [0, {self.nodes}), got {node!r}")

    # -- life cycle
    def __enter__(self) -> VirtualCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Build the namespaces, the bridge and the shaped links (removes stale runs first).

        Example::

            c = VirtualCluster(2); c.start(); ...; c.close()
        """
        if self.started:
            return
        ok, reason = available()
        if not ok:
            raise ClusterError(f"no virtual cluster on this machine: {reason}")
        cleanup_stale()
        self._install_handlers()
        atexit.register(self.close)
        self.started = True
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{self.prefix}-")
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _add_ns(self, name: str) -> None:
        _cmd(["ip", "netns", "add", name])
        self._created.append(name)
        _cmd(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        if self.links == "per-neighbor":
            self._build_per_neighbor()
            return
        br = self.bridge_ns
        self._add_ns(br)
        _cmd(["ip", "-n", br, "link", "add", "name", "br0", "type", "bridge"])
        _cmd(["ip", "-n", br, "link", "set", "br0", "up"])
        for i in range(self.nodes):
            ns, port = self.netns(i), f"v{i}"
            self._add_ns(ns)
            _cmd(["ip", "-n", ns, "link", "add", "name", IFNAME, "type", "veth", "peer", "name",
                  port, "netns", br])
            _cmd(["ip", "-n", br, "link", "set", port, "master", "br0"])
            _cmd(["ip", "-n", br, "link", "set", port, "up"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME])
            _cmd(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            if self.bandwidth_Bps is not None:
                _cmd(tbf_argv(ns, IFNAME, self.bandwidth_Bps, self.burst_bytes))  # node -> bridge
                _cmd(tbf_argv(br, port, self.bandwidth_Bps, self.burst_bytes))  # bridge -> node

    def _build_per_neighbor(self) -> None:
        for i in range(self.nodes):
            ns = self.netns(i)
            self._add_ns(ns)
            _cmd(["ip", "-n", ns, "link", "add", "name", IFNAME, "type", "veth", "peer", "name",
                  f"{IFNAME}p"])
            _cmd(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/32", "dev", IFNAME])
            for dev in (IFNAME, f"{IFNAME}p"):
                _cmd(["ip", "-n", ns, "link", "set", dev, "up"])
        for i in range(self.nodes):
            for j in range(i + 1, self.nodes):
                a, b = self.netns(i), self.netns(j)
                _cmd(["ip", "-n", a, "link", "add", "name", f"p{j}", "type", "veth", "peer",
                      "name", f"p{i}", "netns", b])
                for ns, dev, peer in ((a, f"p{j}", j), (b, f"p{i}", i)):
                    _cmd(["ip", "-n", ns, "link", "set", dev, "up"])
                    _cmd(["ip", "-n", ns, "route", "add", f"{self.addr(peer)}/32", "dev", dev,
                          "src", self.addr(i if ns == a else j)])
                    if self.bandwidth_Bps is not None:
                        _cmd(tbf_argv(ns, dev, self.bandwidth_Bps, self.burst_bytes))

    def _install_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum: int, frame: Any) -> None:
            self.close()
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old_handlers[sig] = signal.signal(sig, on_term)
        # SIGINT raises KeyboardInterrupt in the main thread: __exit__ / atexit clean up

    def close(self) -> None:
        """Stop every process started on the cluster and remove its namespaces and links.

        Idempotent; also called on SIGTERM / SIGHUP and at interpreter exit.

        Example::

            c.close()
        """
        with self._lock:
            for proc in self._procs:
                _stop(proc)
            self._procs.clear()
            for ns in reversed(self._created):
                with contextlib.suppress(ClusterError):
                    _kill_namespace(ns)
            self._created.clear()
            if self._tmp is not None:
                with contextlib.suppress(OSError):
                    self._tmp.cleanup()
                self._tmp = None
            for sig, handler in self._old_handlers.items():
                with contextlib.suppress(ValueError, TypeError):
                    signal.signal(sig, handler)
            self._old_handlers.clear()
            self.started = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    # -- running programs
    def exec_argv(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside ``node``'s namespace.

        Example::

            subprocess.run(c.exec_argv(0, ["ip", "addr"]), timeout=10)
        """
        return ["ip", "netns", "exec", self.netns(node), *argv]

    def node_env(self, node: int) -> dict[str, str]:
        """Environment of a program on ``node``: gloo on the node's interface, thread counts
        for all ranks sharing the host's cores, and where node 0 is.

        Example::

            c.node_env(1)["GLOO_SOCKET_IFNAME"]   # 'eth0'
        """
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        src = str(Path(__file__).resolve().parents[2])
        env.update(
            GLOO_SOCKET_IFNAME=IFNAME,
            PIPECOMM_PROCS_ON_HOST=str(self.world_size),
            PYTHONPATH=os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])]),
            PYTHONUNBUFFERED="1",
            PIPECOMM_CLUSTER=self.describe(),
            NNODES=str(self.nodes),
            NODE_RANK=str(node),
            NPROC_PER_NODE=str(self.ranks_per_node),
            HEAD_ADDR=self.addr(0),
            NODE_ADDR=self.addr(node),
        )
        return env

    def torchrun_argv(self, node: int, program: Sequence[str], port: int = 29400) -> list[str]:
        """The torchrun agent command of ``node`` (to run inside its namespace).

        ``--local-addr`` and ``--rdzv-conf is_host=`` say which node hosts the rendezvous: all
        nodes share the host name, so torchrun cannot find out by itself.

        Example::

            c.torchrun_argv(1, ["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "o"])
        """
        return [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(self.nodes), "--nproc-per-node", str(self.ranks_per_node),
            "--node-rank", str(node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"{self.addr(0)}:{port}", "--rdzv-id", self.prefix,
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", self.addr(node),
            "--max-restarts", "0", *program,
        ]

    def per_node(
        self,
        argv: Callable[[int], Sequence[str]] | Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        cwd: str | os.PathLike | None = None,
    ) -> list[NodeResult]:
        """Run one program per node, each inside its namespace, and wait for all.

        ``argv`` is a command or a function of the node index. ``env`` adds to
        :meth:`node_env`. When a node's program fails, the others are stopped and
        :class:`ClusterError` names that node with the end of its stderr; past ``timeout_s``
        every program is stopped and :class:`TimeoutError` names the nodes still running.

        Example::

            c.per_node(["bash", "artifact/slurm/node.sh", "E13"], timeout_s=300)
        """
        if not self.started:
            raise ClusterError("the cluster is not started (use `with VirtualCluster(...)`)")
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        if not limit > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        with self._started(argv, env, cwd) as (procs, files):
            self._wait(procs, files, limit)
            return [NodeResult(i, p.returncode, *_read(f)) for i, (p, f) in
                    enumerate(zip(procs, files))]

    @contextlib.contextmanager
    def _started(self, argv: Callable[[int], Sequence[str]] | Sequence[str],
                 env: Mapping[str, str] | None, cwd: str | os.PathLike | None):
        """One program per node started inside its namespace; stopped on leaving."""
        assert self._tmp is not None
        run_dir = Path(tempfile.mkdtemp(prefix="run", dir=self._tmp.name))
        procs, files = [], []
        with contextlib.ExitStack() as stack:
            try:
                for i in range(self.nodes):
                    cmd = list(argv(i) if callable(argv) else argv)
                    out = stack.enter_context(open(run_dir / f"{i}.out", "w+"))
                    err = stack.enter_context(open(run_dir / f"{i}.err", "w+"))
                    files.append((out, err))
                    proc = subprocess.Popen(
                        self.exec_argv(i, cmd), stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                        env={**self.node_env(i), **(env or {})}, cwd=cwd, start_new_session=True,
                        preexec_fn=_term_with_parent,
                    )
                    with self._lock:
                        self._procs.append(proc)
                    procs.append(proc)
                yield procs, files
            finally:
                for proc in procs:
                    _stop(proc)
                    with self._lock, contextlib.suppress(ValueError):
                        self._procs.remove(proc)

    def _wait(self, procs: list[subprocess.Popen], files: list, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            if all(c == 0 for c in _check_procs(procs, files)):
                return
            if time.monotonic() > deadline:
                _timed_out(procs, files, limit)
            time.sleep(0.1)

    def torchrun(
        self,
        program: Sequence[str],
        *,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        port: int = 29400,
        cwd: str | os.PathLike | None = None,
    ) -> list[NodeResult]:
        """Start one torchrun agent per node, inside its namespace, running ``program``.

        ``program`` is what follows torchrun's own options, e.g. ``["-m", module, "--out",
        dir]``. Agents rendezvous (c10d) at node 0; the job has ``nodes * ranks_per_node`` ranks.

        Example::

            c.torchrun(["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "o",
                        "-p", "world_size=2", "-p", "ranks_per_node=1"])
        """
        if isinstance(program, str) or not program:
            raise ValueError(f"program must be a non-empty list of arguments, got {program!r}")
        return self.per_node(lambda i: self.torchrun_argv(i, program, port), env=env,
                             timeout_s=timeout_s, cwd=cwd)

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None,
            backend: str = "gloo", **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank of the cluster (one torchrun job for this
        call); results in rank order. ``fn`` must be importable (module level). A rank that
        raises gives :class:`pipecomm.launch.RankError` with its traceback. For many calls,
        :meth:`job` starts the ranks once.

        Example::

            out = c.run(mymodule.measure, 1 << 20)
        """
        with self.job(backend) as job:
            return job.run(fn, *args, timeout_s=timeout_s, **kwargs)

    @contextlib.contextmanager
    def job(self, backend: str = "gloo") -> Iterator[ClusterJob]:
        """A torchrun job on the cluster whose ranks stay up and run one call after another
        (:meth:`ClusterJob.run`): torchrun and the process groups start once per job, as a
        local :class:`pipecomm.launch.Ranks` pool does. The ranks are stopped on leaving.

        Example::

            with c.job() as ranks:
                for n in sizes:
                    out = ranks.run(mymodule.measure, n, timeout_s=60)
        """
        if not self.started:
            raise ClusterError("the cluster is not started (use `with VirtualCluster(...)`)")
        assert self._tmp is not None
        job_dir = Path(tempfile.mkdtemp(prefix="job", dir=self._tmp.name))
        (job_dir / "backend").write_text(backend)
        # the ranks import fn's module as this process does (e.g. a module next to a notebook)
        path = os.pathsep.join(p for p in sys.path if p and os.path.isdir(p))
        program = ["-m", "pipecomm.lab.cluster", "serve", str(job_dir)]
        with self._started(lambda i: self.torchrun_argv(i, program), {"PYTHONPATH": path},
                           None) as (procs, files):
            job = ClusterJob(self, job_dir, procs, files)
            try:
                yield job
            finally:
                job.close()


class ClusterJob:
    """The ranks of a :meth:`VirtualCluster.job`: ``run(fn, *args)`` on all of them.

    Calls travel through the (shared) file system: call ``k`` is ``call-<k>.pkl`` in the job's
    directory, written atomically; every rank runs it and writes ``result-<k>-<rank>.pkl``. A
    rank that raises writes its error and exits (the job is over: the others may wait in a
    collective); a node whose agent exits, or a call past its ``timeout_s``, stops the job.
    """

    def __init__(self, cluster: VirtualCluster, job_dir: Path, procs: list, files: list) -> None:
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
        from pipecomm import launch
        from pipecomm.lab import results

        if self._dead:
            raise ClusterError("this cluster job has stopped (an earlier call failed)")
        limit = self.cluster.timeout_s if timeout_s is None else float(timeout_s)
        if not limit > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
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
                    _timed_out(self._procs, self._files, limit)
                codes = _check_procs(self._procs, self._files, results=paths)
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


def _check_procs(procs: list[subprocess.Popen], files: list, results: list[Path] = ()
                 ) -> list[int | None]:
    """Exit codes of the node programs; a failed one raises (a rank's own error first)."""
    codes = [p.poll() for p in procs]
    failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
    if failed:
        time.sleep(1.0)  # let the others print why they stop too, and results land
        _raise_rank_error(results)
        i = failed[0]
        tail = _read(files[i])[1][-3000:]
        raise ClusterError(f"node {i} exited with status {codes[i]}:\n{tail}")
    return codes


def _timed_out(procs: list[subprocess.Popen], files: list, limit: float) -> None:
    codes = [p.poll() for p in procs]
    running = [i for i, c in enumerate(codes) if c is None]
    tails = "\n".join(f"--- node {i}\n{_read(files[i])[1][-1500:]}" for i in running)
    raise TimeoutError(f"nodes {running} still running after {limit:.0f} s; stopped\n{tails}")


def _raise_rank_error(paths: Sequence[Path]) -> None:
    from pipecomm import launch

    for rank, path in enumerate(paths):
        if path.exists():
            kind, value = pickle.loads(path.read_bytes())
            if kind == "error":
                raise launch.RankError(rank, value[0], value[1])


def _term_with_parent() -> None:
    """In a node program before exec: SIGTERM it when the orchestrator dies (``ip netns exec``
    execs the program in place, so the request stays). torchrun then stops its workers; the
    namespaces themselves go with the next run's :func:`cleanup_stale`."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _read(files: tuple) -> tuple[str, str]:
    texts = []
    for f in files:
        f.flush()
        f.seek(0)
        texts.append(f.read())
    return texts[0], texts[1]


def _stop(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
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


# --------------------------------------------------------------------------- rank side


def _serve_main(job_dir: str) -> None:
    """Body of a rank of :meth:`VirtualCluster.job` (under torchrun): run the calls as they
    come, until the orchestrator writes ``stop``."""
    from pipecomm import launch
    from pipecomm.lab import results

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


# --------------------------------------------------------------------------- measurements


def link_bandwidth(sizes: Sequence[int], iters: int = 3, src: int = 0, dst: int = 1
                   ) -> list[dict[str, Any]]:
    """Rank function: ``src`` sends ``n`` bytes to ``dst`` (gloo send/recv), ``dst`` answers
    with one byte; time of the pair per size (median over ``iters``). Rows on ``src``.

    Example::

        rows = c.run(cluster.link_bandwidth, [1 << 20, 4 << 20])[0]
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    ack = torch.zeros(1, dtype=torch.uint8)
    rows = []
    for n in [64 << 10, *sizes]:  # the first one opens the connection, not reported
        buf = torch.zeros(n, dtype=torch.uint8)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            if rank == src:
                dist.send(buf, dst)
                dist.recv(ack, dst)
            elif rank == dst:
                dist.recv(buf, src)
                dist.send(ack, src)
            times.append(time.perf_counter() - start)
        times.sort()
        rows.append({"nbytes": n, "time_s": times[len(times) // 2],
                     "bandwidth_Bps": n / times[len(times) // 2]})
    dist.barrier()
    return rows[1:] if rank == src else []


def chain_bandwidth(nbytes: int, iters: int = 3, stride: int = 1, best: bool = False,
                    messages: int = 1) -> float:
    """Rank function: every ``stride``-th rank ``i`` sends ``messages`` messages of ``nbytes``
    to rank ``i + stride`` while receiving as many from ``i - stride``, all those links busy at
    once (``stride`` = ranks per node: one flow per node link); the achieved rate per link
    (B/s, median over ``iters``, the same on every rank). Against :func:`link_bandwidth` (one
    link alone) it says whether the host carries every shaped link at once: the kernel's copies
    and shaping of concurrent flows share the host's cores, and a shaped network the host cannot
    carry measures the host. ``best``: the fastest repeat instead of the median (what the host
    can carry; the median also holds the scheduling lateness of many ranks on few cores, which
    varies from run to run). ``messages`` > 1: a stream, every receive posted before the first
    send (as pipecomm's progress engine posts them), so that one message's latency hides behind
    the next one's bytes.

    Example::

        rate = c.run(cluster.chain_bandwidth, 4 << 20)[0]
        streamed = c.run(cluster.chain_bandwidth, 4 << 20, 5, 1, False, 16)[0]
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride < world:
        raise ValueError(f"stride must be an int in [1, {world - 1}], got {stride!r}")
    if isinstance(messages, bool) or not isinstance(messages, int) or messages < 1:
        raise ValueError(f"messages must be an int >= 1, got {messages!r}")
    out = torch.zeros(nbytes, dtype=torch.uint8)
    into = torch.zeros(messages, nbytes, dtype=torch.uint8)
    chained = rank % stride == 0
    times = []
    for i in range(iters + 1):  # the first opens the connections, not counted
        dist.barrier()
        start = time.perf_counter()
        works = []
        if chained and rank >= stride:
            works += [dist.irecv(into[m], rank - stride) for m in range(messages)]
        if chained and rank + stride < world:
            works += [dist.isend(out, rank + stride) for _ in range(messages)]
        for w in works:
            w.wait()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    times.sort()
    return messages * nbytes / (times[0] if best else times[len(times) // 2])


def calibrate(sizes: Sequence[int], iters: int = 5, ranks_per_node: int = 1,
              host_margin: float = 0.9, configured_Bps: float | None = None) -> dict[str, Any]:
    """Rank function: the cluster's links as the cost models see them, and a check that the
    host carries them all at once.

    * inter-node link: node 0 -> node 1 (rank 0 -> rank ``ranks_per_node``),
      :func:`link_bandwidth` per size and its alpha-beta fit (``time = alpha + n / B``);
    * intra-node link (``ranks_per_node > 1``): rank 0 -> rank 1 over the node's loopback;
    * every node link busy at once (:func:`chain_bandwidth` at the largest size, the fastest of
      ``iters`` repeats: the median of 5 moved between 85% and 95% of a link from run to run at
      the same settings on this 2-core host) must keep ``host_margin`` of the lone link's
      median rate at that size, else :class:`ClusterError` (on every rank) naming the bandwidth
      to configure instead.

    Returns (the same on every rank) ``{"inter": {...}, "intra": {...} | None, "chain_Bps":
    rate}`` where each link is ``{"alpha_s", "bandwidth_Bps", "rows"}`` (``rows``: ``nbytes``,
    ``time_s``, ``bandwidth_Bps`` per size).

    Example::

        cal = c.run(cluster.calibrate, [4096, 1 << 20, 4 << 20], 5, 2)[0]
        cal["inter"]["bandwidth_Bps"]
    """
    import torch.distributed as dist

    from pipecomm import cost

    if len(set(sizes)) < 2:
        raise ValueError(f"sizes must hold >= 2 message sizes to fit alpha and beta, got {sizes!r}")

    def link(src: int, dst: int) -> dict[str, Any] | None:
        rows = link_bandwidth(sizes, iters, src, dst)
        out = [None]
        if dist.get_rank() == src:
            alpha, beta = cost.fit_alpha_beta([r["nbytes"] for r in rows],
                                              [r["time_s"] for r in rows])
            out = [{"alpha_s": float(alpha), "bandwidth_Bps": float(1.0 / beta) if beta > 0
                    else float("inf"), "rows": rows}]
        dist.broadcast_object_list(out, src=src)
        return out[0]

    inter = link(0, ranks_per_node)
    intra = link(0, 1) if ranks_per_node > 1 else None
    largest = max(sizes)
    alone = next(r["bandwidth_Bps"] for r in inter["rows"] if r["nbytes"] == largest)
    chain = chain_bandwidth(largest, iters, ranks_per_node, best=True)
    if chain < host_margin * alone:  # every rank sees the same numbers: all raise
        nodes = dist.get_world_size() // ranks_per_node
        advice = (f"lower the link bandwidth to about {0.8 * chain / alone * configured_Bps:.3g}"
                  " B/s" if configured_Bps else "lower the link bandwidth")
        raise ClusterError(
            f"this host cannot carry {nodes} shaped node links at once: each moved "
            f"{chain / 1e6:.1f} MB/s with all busy against {alone / 1e6:.1f} MB/s alone "
            f"(< {host_margin:.0%}); {advice}, or use fewer nodes")
    return {"inter": inter, "intra": intra, "chain_Bps": float(chain)}


def measure_bandwidth(
    bandwidth_Bps: float = 50e6,
    sizes: Sequence[int] = (1 << 20, 4 << 20, 16 << 20, 64 << 20),
    iters: int = 3,
    timeout_s: float = 600.0,
) -> list[dict[str, Any]]:
    """Build a 2-node cluster with links of ``bandwidth_Bps``, measure :func:`link_bandwidth`
    from node 0 to node 1; rows with the configured and achieved bandwidth.

    Example::

        for row in cluster.measure_bandwidth(50e6, [1 << 20]):
            print(row["nbytes"], row["bandwidth_Bps"] / row["configured_Bps"])
    """
    with VirtualCluster(2, 1, bandwidth_Bps) as c:
        rows = c.run(link_bandwidth, list(sizes), iters, timeout_s=timeout_s)[0]
    return [dict(r, configured_Bps=float(bandwidth_Bps)) for r in rows]


def experiment_module(experiment: str) -> str:
    """Module name of an experiment id (``"E13"`` -> ``pipecomm.lab.experiments.e13_...``).

    Example::

        cluster.experiment_module("E0")   # 'pipecomm.lab.experiments.e00_calibrate'
    """
    m = re.fullmatch(r"E(\d+)", str(experiment))
    found = sorted((Path(__file__).parent / "experiments").glob(
        f"e{int(m.group(1)):02d}_*.py")) if m else []
    if not found:
        raise ValueError(f"experiment={experiment!r} is not an experiment id like 'E13'")
    return f"pipecomm.lab.experiments.{found[0].stem}"


def profile_args(profile: str, experiment: str) -> list[str]:
    """``-p NAME=VALUE`` arguments of ``experiment`` in ``artifact/profiles/<profile>.yaml``.

    Example::

        cluster.profile_args("gpu", "E13")   # ['-p', 'backend=nccl', '-p', 'world_size=4', ...]
    """
    import yaml

    path = Path(__file__).resolve().parents[3] / "artifact" / "profiles" / f"{profile}.yaml"
    if not path.exists():
        raise ValueError(f"profile={profile!r}: no file {path.name} in artifact/profiles")
    exps = yaml.safe_load(path.read_text())["experiments"]
    if experiment not in exps:
        raise ValueError(f"experiment={experiment!r} is not in profile {profile!r}: {sorted(exps)}")
    out = []
    for name, value in (exps[experiment].get("params") or {}).items():
        out += ["-p", f"{name}={value if isinstance(value, str) else repr(value)}"]
    return out


def program_args(
    profile: str,
    experiment: str,
    out: str,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    overrides: Sequence[str] = (),
) -> list[str]:
    """torchrun's program for one experiment of a profile: ``-m <module> --out <out>``, the
    profile's parameters, the job's ``world_size`` / ``ranks_per_node`` where the experiment
    has them, then ``overrides`` (``-p NAME=VALUE`` items; the last value of a name wins).

    Example::

        cluster.program_args("gpu", "E13", "results/gpu/E13", world_size=8, ranks_per_node=4)
    """
    import importlib

    module = experiment_module(experiment)
    defaults = importlib.import_module(module).DEFAULTS
    args = ["-m", module, "--out", str(out), *profile_args(profile, experiment)]
    for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node)):
        if value is not None and name in defaults:
            args += ["-p", f"{name}={int(value)}"]
    return args + list(overrides)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipecomm.lab.cluster",
                                     description="virtual cluster helpers")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("available", help="print whether a virtual cluster can be built")
    sub.add_parser("cleanup", help="remove namespaces left by killed runs")
    bw = sub.add_parser("bandwidth", help="achieved vs configured rate of a shaped link")
    bw.add_argument("--rate", type=float, default=50e6, help="configured B/s (50e6)")
    bw.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 4 << 20, 16 << 20, 64 << 20])
    bw.add_argument("--iters", type=int, default=3)
    c = sub.add_parser("serve", help="(internal) rank side of VirtualCluster.job")
    c.add_argument("dir")
    pa = sub.add_parser("program", help="torchrun program of a profile's experiment, one "
                        "argument a line")
    pa.add_argument("profile")
    pa.add_argument("experiment")
    pa.add_argument("--out", required=True)
    pa.add_argument("--world-size", type=int, default=None)
    pa.add_argument("--ranks-per-node", type=int, default=None)
    args, extra = parser.parse_known_args(argv)  # extra: the program's -p NAME=VALUE items
    if extra and args.cmd != "program":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "available":
        ok, reason = available()
        print(f"{'yes' if ok else 'no'}: {reason}")
        return 0 if ok else 1
    if args.cmd == "cleanup":
        print("\n".join(cleanup_stale()))
        return 0
    if args.cmd == "bandwidth":
        print("bytes,time_s,achieved_Bps,configured_Bps,ratio")
        for r in measure_bandwidth(args.rate, args.sizes, args.iters):
            print(f"{r['nbytes']},{r['time_s']:.4f},{r['bandwidth_Bps']:.4g},"
                  f"{r['configured_Bps']:.4g},{r['bandwidth_Bps'] / r['configured_Bps']:.3f}")
        return 0
    if args.cmd == "serve":
        _serve_main(args.dir)
        return 0
    print("\n".join(program_args(args.profile, args.experiment, args.out, args.world_size,
                                  args.ranks_per_node, extra)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
