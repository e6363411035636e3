"""The virtual cluster: N nodes (network namespaces) joined by links shaped both ways.

:class:`VirtualCluster` builds the nodes and links (:mod:`pipecomm.lab.networks.cluster.host`'s commands),
runs one program per node (:meth:`VirtualCluster.per_node`, :meth:`VirtualCluster.torchrun`) or
calls on every rank of a torchrun job (:meth:`VirtualCluster.run`, :meth:`VirtualCluster.job`:
:mod:`pipecomm.lab.networks.cluster.job`), and removes everything it made. The network it builds is
described in the docstring of :mod:`pipecomm.lab.networks.cluster`.

Example::

    from pipecomm.lab.networks.cluster import VirtualCluster
    with VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6) as c:
        print(c.run(mymodule.measure, 1 << 20))       # fn on every rank, results in rank order
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipecomm import checks
from pipecomm.lab.networks.cluster.host import (
    ClusterError,
    available,
    cleanup_stale,
    kill_namespace,
    run_command,
    run_prefix,
    tbf_argv,
)
from pipecomm.lab.networks.cluster.job import (
    ClusterJob,
    check_nodes,
    raise_timeout,
    read_output,
    stop_process,
    term_with_parent,
)

__all__ = ["IFNAME", "LINKS", "MAX_NODES", "SUBNET", "NodeResult", "VirtualCluster"]

SUBNET = "10.77.0"  # /24, exists only inside the run's namespaces
IFNAME = "eth0"  # a node's interface (the same name in every node namespace)
LINKS = ("bridge", "per-neighbor")
MAX_NODES = 250



@dataclass
class NodeResult:
    """What one node's program did: its node index, exit status and output."""

    node: int
    returncode: int
    stdout: str
    stderr: str


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
        checks.positive_number(timeout_s, "timeout_s", "VirtualCluster", "seconds")
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.bandwidth_Bps = None if bandwidth_Bps is None else float(bandwidth_Bps)
        self.burst_bytes = burst_bytes
        self.links = links
        self.timeout_s = float(timeout_s)
        self.prefix = run_prefix()
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

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> c.netns(0)   # 'pc4242-0n0'
            'pc...-...n0'
        """
        self._check_node(node)
        return f"{self.prefix}n{node}"

    def addr(self, node: int) -> str:
        """IPv4 address of ``node`` (inside the run's subnet).

        Example::

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> c.addr(0)
            '10.77.0.1'
        """
        self._check_node(node)
        return f"{SUBNET}.{node + 1}"

    def describe(self) -> str:
        """Short text for figure titles, ``env.json`` and logs.

        Example::

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> c.describe()
            'shaped: Linux tc tbf, real TCP; 2 nodes x 1 rank, 50 MB/s per node link each way'
        """
        bw = "unshaped" if self.bandwidth_Bps is None else f"{self.bandwidth_Bps / 1e6:.4g} MB/s"
        per = "node link" if self.links == "bridge" else "link per node pair"
        return (f"shaped: Linux tc tbf, real TCP; {self.nodes} nodes x {self.ranks_per_node} "
                f"rank{'s' if self.ranks_per_node > 1 else ''}, {bw} per {per} each way")

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly description (for ``env.json``).

        Example::

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> import json
            >>> json.dumps(c.to_dict())[:60]
            '{"network": "shaped", "nodes": 2, "ranks_per_node": 1, "band'
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
        run_command(["ip", "netns", "add", name])
        self._created.append(name)
        run_command(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self) -> None:
        if self.links == "per-neighbor":
            self._build_per_neighbor()
            return
        br = self.bridge_ns
        self._add_ns(br)
        run_command(["ip", "-n", br, "link", "add", "name", "br0", "type", "bridge"])
        run_command(["ip", "-n", br, "link", "set", "br0", "up"])
        for i in range(self.nodes):
            ns, port = self.netns(i), f"v{i}"
            self._add_ns(ns)
            run_command(["ip", "-n", ns, "link", "add", "name", IFNAME, "type", "veth", "peer", "name",
                  port, "netns", br])
            run_command(["ip", "-n", br, "link", "set", port, "master", "br0"])
            run_command(["ip", "-n", br, "link", "set", port, "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", IFNAME])
            run_command(["ip", "-n", ns, "link", "set", IFNAME, "up"])
            if self.bandwidth_Bps is not None:
                run_command(tbf_argv(ns, IFNAME, self.bandwidth_Bps, self.burst_bytes))  # node -> bridge
                run_command(tbf_argv(br, port, self.bandwidth_Bps, self.burst_bytes))  # bridge -> node

    def _build_per_neighbor(self) -> None:
        for i in range(self.nodes):
            ns = self.netns(i)
            self._add_ns(ns)
            run_command(["ip", "-n", ns, "link", "add", "name", IFNAME, "type", "veth", "peer", "name",
                  f"{IFNAME}p"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.addr(i)}/32", "dev", IFNAME])
            for dev in (IFNAME, f"{IFNAME}p"):
                run_command(["ip", "-n", ns, "link", "set", dev, "up"])
        for i in range(self.nodes):
            for j in range(i + 1, self.nodes):
                a, b = self.netns(i), self.netns(j)
                run_command(["ip", "-n", a, "link", "add", "name", f"p{j}", "type", "veth", "peer",
                      "name", f"p{i}", "netns", b])
                for ns, dev, peer in ((a, f"p{j}", j), (b, f"p{i}", i)):
                    run_command(["ip", "-n", ns, "link", "set", dev, "up"])
                    run_command(["ip", "-n", ns, "route", "add", f"{self.addr(peer)}/32", "dev", dev,
                          "src", self.addr(i if ns == a else j)])
                    if self.bandwidth_Bps is not None:
                        run_command(tbf_argv(ns, dev, self.bandwidth_Bps, self.burst_bytes))

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
                stop_process(proc)
            self._procs.clear()
            for ns in reversed(self._created):
                with contextlib.suppress(ClusterError):
                    kill_namespace(ns)
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

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> c.exec_argv(0, ["ip", "addr"])      # subprocess.run(..., timeout=10) once started
            ['ip', 'netns', 'exec', 'pc...n0', 'ip', 'addr']
        """
        return ["ip", "netns", "exec", self.netns(node), *argv]

    def node_env(self, node: int) -> dict[str, str]:
        """Environment of a program on ``node``: gloo on the node's interface, thread counts
        for all ranks sharing the host's cores, and where node 0 is.

        Example::

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> c.node_env(1)["GLOO_SOCKET_IFNAME"]
            'eth0'
        """
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("TORCHELASTIC_", "MASTER_", "GROUP_", "ROLE_"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        src = str(Path(__file__).resolve().parents[4])
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

            >>> c = VirtualCluster(nodes=2, ranks_per_node=1, bandwidth_Bps=50e6)   # not started
            >>> c.torchrun_argv(1, ["-m", "pipecomm.lab.experiments.e13_dadam_convergence", "--out", "o"])
            [..., '-m', 'torch.distributed.run', '--nnodes', '2', '--nproc-per-node', '1', '--node-rank', '1', ..., '--out', 'o']
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
        limit = checks.positive_number(self.timeout_s if timeout_s is None else timeout_s,
                                       "timeout_s", "VirtualCluster.per_node", "seconds")
        with self._started(argv, env, cwd) as (procs, files):
            self._wait(procs, files, limit)
            return [NodeResult(i, p.returncode, *read_output(f)) for i, (p, f) in
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
                        preexec_fn=term_with_parent,
                    )
                    with self._lock:
                        self._procs.append(proc)
                    procs.append(proc)
                yield procs, files
            finally:
                for proc in procs:
                    stop_process(proc)
                    with self._lock, contextlib.suppress(ValueError):
                        self._procs.remove(proc)

    def _wait(self, procs: list[subprocess.Popen], files: list, limit: float) -> None:
        deadline = time.monotonic() + limit
        while True:
            if all(c == 0 for c in check_nodes(procs, files)):
                return
            if time.monotonic() > deadline:
                raise_timeout(procs, files, limit)
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
        raises gives :class:`pipecomm.lab.networks.launch.RankError` with its traceback. For many calls,
        :meth:`job` starts the ranks once.

        Example::

            out = c.run(mymodule.measure, 1 << 20)
        """
        # refused before any rank starts (ClusterJob.run checks them again, per call)
        checks.positive_number(self.timeout_s if timeout_s is None else timeout_s, "timeout_s",
                               "VirtualCluster.run", "seconds")
        with self.job(backend) as job:
            return job.run(fn, *args, timeout_s=timeout_s, **kwargs)

    @contextlib.contextmanager
    def job(self, backend: str = "gloo") -> Iterator[ClusterJob]:
        """A torchrun job on the cluster whose ranks stay up and run one call after another
        (:meth:`ClusterJob.run`): torchrun and the process groups start once per job, as a
        local :class:`pipecomm.lab.networks.launch.Ranks` pool does. The ranks are stopped on leaving.

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
        program = ["-m", "pipecomm.lab.networks.cluster", "serve", str(job_dir)]
        with self._started(lambda i: self.torchrun_argv(i, program), {"PYTHONPATH": path},
                           None) as (procs, files):
            job = ClusterJob(self, job_dir, procs, files)
            try:
                yield job
            finally:
                job.close()
