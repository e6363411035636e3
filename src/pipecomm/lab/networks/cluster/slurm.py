"""A real SLURM on the virtual cluster: slurmctld and one slurmd per node namespace.

:class:`SlurmCluster` builds a :class:`~pipecomm.lab.networks.cluster.VirtualCluster`, writes a
``slurm.conf`` into a temporary directory and starts munged (in the host's namespace: its socket
is a path, which every namespace reaches), slurmctld in node 0's namespace and one slurmd in
every node's namespace. Each daemon runs in its own UTS namespace whose host name is its node's
(``n0``, ``n1``, ...), and ``ip netns exec`` gives every node an ``/etc/hosts`` naming all nodes
(``/etc/netns/<namespace>/hosts``), so that a job sees what it sees on a real cluster: its node's
host name, the other nodes' names resolving to their addresses, srun starting one task per node,
and torchrun's rendezvous at the first node found by its host name. :meth:`SlurmCluster.submit`
is ``sbatch`` as a user runs it; :meth:`SlurmCluster.wait` polls the job with a timeout, and a
failure shows the tails of the daemons' logs and of the job's output in one short block.
:meth:`SlurmCluster.close` cancels the jobs, stops every daemon and removes the namespaces, the
``/etc/netns`` entries and the directory. How to run it: docs/slurm.md.

``python -m pipecomm.lab.networks.cluster.slurm`` submits ``artifact/slurm/run_gpu_profile.sbatch``
with the cpu profile and a short E13 on two nodes, waits and checks rank 0's results.

Example::

    from pipecomm.lab.networks.cluster import slurm
    ok, why = slurm.available()
    if ok:
        with slurm.SlurmCluster(nodes=2) as s:
            job = s.submit("artifact/slurm/run_gpu_profile.sbatch", ["cpu"], ["--nodes", "2"])
            print(s.wait(job, timeout_s=600))                        # 'COMPLETED'
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipecomm import checks
from pipecomm.lab import guard
from pipecomm.lab.networks.cluster.host import ClusterError
from pipecomm.lab.networks.cluster.host import available as cluster_available
from pipecomm.lab.networks.cluster.job import stop_process, term_with_parent
from pipecomm.lab.networks.cluster.virtual import VirtualCluster

__all__ = ["BINARIES", "DONE_STATES", "NETNS_ETC", "SHORT_E13", "SlurmCluster", "available",
           "cleanup_stale", "main", "run_artifact"]

#: the programs a SLURM cluster needs (Debian: ``apt-get install slurm-wlm munge``)
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "srun", "unshare")
#: job states after which a job does not run again
DONE_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE", "PREEMPTED")
ROOT = Path(__file__).resolve().parents[5]
SBATCH = ROOT / "artifact" / "slurm" / "run_gpu_profile.sbatch"
_CTLD_PORT, _SLURMD_PORT = 6817, 6818  # inside the namespaces only
#: where ``ip netns exec NS`` finds the files it mounts over /etc (here: every node's hosts)
NETNS_ETC = Path("/etc/netns")


def available() -> tuple[bool, str]:
    """Whether a :class:`SlurmCluster` can start here, and a one-line reason: the virtual
    cluster's needs (:func:`pipecomm.lab.networks.cluster.available`) and SLURM's programs on the PATH.

    Example::

        >>> ok, why = available()   # (False, 'no slurmctld on the PATH (apt-get install ...)')
    """
    ok, why = cluster_available()
    if not ok:
        return False, why
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    missing = [b for b in BINARIES if shutil.which(b, path=path) is None]
    if missing:
        return False, (f"no {', '.join(missing)} on the PATH (Debian: apt-get install slurm-wlm "
                       "munge)")
    return True, "ok"


def cleanup_stale() -> list[Path]:
    """Remove what a killed run left outside its namespaces (which
    :func:`pipecomm.lab.networks.cluster.cleanup_stale` removes): its ``/etc/netns`` entries and its
    directory, named ``pc<pid>-...`` after a process that is gone; the paths removed.

    Example::

        >>> cleanup_stale()   # [] after clean runs
        []
    """
    found = [*(NETNS_ETC.glob("pc*-*") if NETNS_ETC.exists() else ()),
             *Path(tempfile.gettempdir()).glob("pc*-slurm-*")]
    gone = [f for f in found if (m := re.match(r"pc(\d+)-", f.name))
            and int(m.group(1)) != os.getpid() and not guard.alive(int(m.group(1)))]
    for f in gone:
        shutil.rmtree(f, ignore_errors=True)
    return gone


class SlurmCluster:
    """slurmctld, slurmd and munged on a virtual cluster of ``nodes`` network namespaces.

    Args:
        nodes: SLURM nodes (``n0`` .. ``n{nodes-1}``, partition ``debug``), 2 .. 16.
        cpus_per_node: CPUs each node declares (default: this machine's count; jobs ask for at
            most that many with ``--cpus-per-task``).
        bandwidth_Bps: rate of every node link (``None``: unshaped).
        timeout_s: limit of every wait for the daemons (their start, a command).

    Example::

        with SlurmCluster(nodes=2) as s:
            job = s.submit("job.sbatch", options=["--nodes", "2"])
            state = s.wait(job, timeout_s=300)
    """

    def __init__(self, nodes: int = 2, cpus_per_node: int | None = None,
                 bandwidth_Bps: float | None = None, timeout_s: float = 60.0) -> None:
        where = "SlurmCluster"
        if isinstance(nodes, bool) or not isinstance(nodes, int) or not 2 <= nodes <= 16:
            raise ValueError(f"{where}: nodes must be an int in 2 .. 16, got {nodes!r}")
        cpus = (os.cpu_count() or 1) if cpus_per_node is None else cpus_per_node
        if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
            raise ValueError(f"{where}: cpus_per_node must be an int >= 1, got {cpus_per_node!r}")
        self.timeout_s = checks.positive_number(timeout_s, "timeout_s", where, "seconds")
        self.nodes, self.cpus_per_node = nodes, cpus
        self.net = VirtualCluster(nodes, 1, bandwidth_Bps, timeout_s=timeout_s)
        self.names = [f"n{i}" for i in range(nodes)]
        self.dir: Path | None = None
        self._procs: list[subprocess.Popen] = []
        self._etc: list[Path] = []
        self._jobs: list[int] = []

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- start
    def start(self) -> None:
        """Build the namespaces, write the configuration, start the daemons and wait (at most
        ``timeout_s``) until every node is idle; on a failure, stop everything and raise
        :class:`~pipecomm.lab.networks.cluster.ClusterError` with the logs' tails.

        Example::

            s = SlurmCluster(2); s.start(); ...; s.close()
        """
        ok, why = available()
        if not ok:
            raise ClusterError(f"no SLURM cluster on this machine: {why}")
        cleanup_stale()
        try:
            self.net.start()
            self.dir = Path(tempfile.mkdtemp(prefix=f"{self.net.prefix}-slurm-"))
            self.dir.chmod(0o755)
            self._write_files()
            d = self.dir
            self._spawn(None, ["munged", "--foreground", "--force", f"--socket={d}/munge.socket",
                               f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                               f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"],
                        "munged")
            self._until(lambda: (d / "munge.socket").exists(), "munged's socket")
            self._spawn(0, ["slurmctld", "-D", "-f", str(d / "slurm.conf")], "slurmctld")
            self._until(lambda: self.command(["scontrol", "ping"], check=False).returncode == 0,
                        "slurmctld to answer")
            for i in range(self.nodes):
                self._spawn(i, ["slurmd", "-D", "-f", str(d / "slurm.conf")], f"slurmd-{i}")
            self._until(self._all_idle, "every node to be idle")
        except BaseException as exc:
            logs = self.logs(lines=30) if self.dir is not None else ""
            self.close()
            if isinstance(exc, ClusterError | TimeoutError | OSError):
                raise ClusterError(f"SLURM did not start: {exc}\n{logs}") from exc
            raise

    def _write_files(self) -> None:
        d = self.dir
        assert d is not None
        (d / "munge.key").write_bytes(os.urandom(1024))
        (d / "munge.key").chmod(0o400)
        for sub in ("state", *(f"spool/{n}" for n in self.names)):
            (d / sub).mkdir(parents=True)
        # slurmd initialises a cgroup plugin even without cgroup tracking: cgroup/v1 starts
        # without a hierarchy, where autodetection finds none in ip netns exec's fresh /sys
        # and cgroup/v2 refuses a machine whose controllers are v1 ("hybrid mode")
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.net.addr(i)} CPUs={self.cpus_per_node} "
                          "State=UNKNOWN" for i, n in enumerate(self.names))
        (d / "slurm.conf").write_text(f"""\
ClusterName=pipecomm
SlurmctldHost={self.names[0]}({self.net.addr(0)})
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_CTLD_PORT}
SlurmdPort={_SLURMD_PORT}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
MinJobAge=600
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.net.addr(i)} {n}\n" for i, n in enumerate(self.names))
        if not NETNS_ETC.exists():
            NETNS_ETC.mkdir()
            self._etc.append(NETNS_ETC)  # removed last, if still empty
        for i in range(self.nodes):
            etc = NETNS_ETC / self.net.netns(i)
            etc.mkdir()
            self._etc.insert(0, etc)
            (etc / "hosts").write_text(hosts)

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        assert self.dir is not None
        path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        return {**os.environ, "PATH": path, "SLURM_CONF": str(self.dir / "slurm.conf"),
                **(extra or {})}

    def _in_node(self, node: int, argv: Sequence[str]) -> list[str]:
        """``argv`` in ``node``'s namespace with its own host name (a UTS namespace)."""
        return self.net.exec_argv(node, ["unshare", "--uts", "sh", "-c",
                                         f'hostname {self.names[node]} && exec "$@"', "sh",
                                         *argv])

    def _spawn(self, node: int | None, argv: Sequence[str], name: str) -> None:
        assert self.dir is not None
        cmd = list(argv) if node is None else self._in_node(node, argv)
        with open(self.dir / f"{name}.stderr", "w") as err:
            self._procs.append(subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self._env(),
                                                start_new_session=True,
                                                preexec_fn=term_with_parent))

    def _until(self, ok: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ok():
            dead = [p for p in self._procs if p.poll() is not None]
            if dead:
                raise ClusterError(f"waiting for {what}: `{' '.join(dead[0].args[-4:])}` exited "
                                   f"with {dead[0].returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout_s:g} s for {what}")
            time.sleep(0.3)

    def _all_idle(self) -> bool:
        out = self.command(["scontrol", "-o", "show", "nodes"], check=False).stdout
        states = re.findall(r"State=(\S+)", out)
        return len(states) == self.nodes and all(s.startswith("IDLE") for s in states)

    # -- use
    def command(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
                cwd: str | os.PathLike | None = None, check: bool = True,
                timeout_s: float | None = None) -> subprocess.CompletedProcess:
        """Run a SLURM client command (``sbatch``, ``squeue``, ``scontrol``, ...) on node 0, as
        a user on its login node would; ``env`` adds to this process's environment.

        Example::

            print(s.command(["sinfo"]).stdout)
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        try:
            proc = subprocess.run(self._in_node(0, argv), capture_output=True, text=True,
                                  env=self._env(env), cwd=cwd, timeout=limit)
        except subprocess.TimeoutExpired as exc:
            raise TimeoutError(f"`{' '.join(argv)}` did not finish in {limit:g} s") from exc
        if check and proc.returncode != 0:
            raise ClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): "
                               f"{(proc.stderr or proc.stdout).strip()[-500:]}")
        return proc

    def submit(self, script: str | os.PathLike, args: Sequence[str] = (),
               options: Sequence[str] = (), *, env: Mapping[str, str] | None = None,
               cwd: str | os.PathLike | None = None) -> int:
        """``sbatch [options] script [args]`` from ``cwd`` (the job's ``SLURM_SUBMIT_DIR``,
        default the repository) with ``env`` added to the environment the job inherits; the
        job's id.

        Example::

            job = s.submit("artifact/slurm/run_gpu_profile.sbatch", ["cpu"], ["--nodes", "2"])
        """
        out = self.command(["sbatch", "--parsable", *options, str(script), *args], env=env,
                           cwd=cwd or ROOT).stdout
        job = int(out.strip().split(";")[0])
        self._jobs.append(job)
        return job

    def job_info(self, job: int) -> dict[str, str]:
        """``scontrol show job``'s fields of ``job`` (``JobState``, ``StdOut``, ``NodeList``...).

        Example::

            s.job_info(job)["JobState"]     # 'RUNNING'
        """
        out = self.command(["scontrol", "-o", "show", "job", str(job)], check=False).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job: int, timeout_s: float) -> str:
        """Wait until ``job`` is done, at most ``timeout_s``: its final state (``COMPLETED``...).
        Past the limit the job is cancelled and TimeoutError shows the logs' tails.

        Example::

            assert s.wait(job, timeout_s=600) == "COMPLETED", s.logs(job)
        """
        limit = checks.positive_number(timeout_s, "timeout_s", "SlurmCluster.wait", "seconds")
        deadline = time.monotonic() + limit
        while True:
            state = self.job_info(job).get("JobState", "")
            if state in DONE_STATES:
                return state
            if time.monotonic() > deadline:
                self.command(["scancel", str(job)], check=False)
                raise TimeoutError(f"job {job} still {state or 'unknown'} after {limit:g} s\n"
                                   f"{self.logs(job)}")
            time.sleep(0.5)

    def logs(self, job: int | None = None, lines: int = 8) -> str:
        """The last ``lines`` of slurmctld's and every slurmd's log (and ``job``'s output), in one
        block.

        Example::

            print(s.logs(job))
        """
        d = self.dir
        if d is None:
            return ""
        files = [d / "slurmctld.log", *(d / f"slurmd-{n}.log" for n in self.names)]
        if job is not None and (out := self.job_info(job).get("StdOut")):
            files.append(Path(out))
        parts = []
        for f in files:
            text = f.read_text(errors="replace").splitlines() if f.exists() else ["(none)"]
            parts.append(f"-- {f.name}:\n" + "\n".join(t[:200] for t in text[-lines:]))
        return "\n".join(parts)

    # -- stop
    def close(self) -> None:
        """Cancel the jobs, stop the daemons, remove the namespaces, ``/etc/netns`` entries and
        the directory. Idempotent.

        Example::

            s.close()
        """
        if self._jobs and self.dir is not None and self.net.started:
            with contextlib.suppress(Exception):
                self.command(["scancel", *map(str, self._jobs)], check=False, timeout_s=10)
        self._jobs.clear()
        for proc in reversed(self._procs):
            stop_process(proc)
        self._procs.clear()
        self.net.close()  # kills what is left in the namespaces (slurmstepd, the job's ranks)
        for etc in self._etc:
            if etc == NETNS_ETC:
                with contextlib.suppress(OSError):
                    etc.rmdir()
            else:
                shutil.rmtree(etc, ignore_errors=True)
        self._etc.clear()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


# --------------------------------------------------------------------------- the artifact's job


def main(argv: Sequence[str] | None = None) -> int:
    """Submit ``artifact/slurm/run_gpu_profile.sbatch`` (cpu profile, a short E13) to a SLURM
    cluster of ``--nodes`` nodes, wait, check rank 0's results; 0 when they are there."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="results (default: a temp dir)")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    args = ap.parse_args(argv)
    ok, why = available()
    if not ok:
        print(f"no SLURM cluster here: {why}", file=sys.stderr)
        return 2
    try:
        cluster = SlurmCluster(args.nodes, timeout_s=120)
    except ValueError as exc:
        ap.error(str(exc))
    with contextlib.ExitStack() as stack:
        out = args.out or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="slurm")))
        try:
            s = stack.enter_context(cluster)
            job, state = run_artifact(s, out, args.timeout_s)
        except (ClusterError, TimeoutError) as exc:  # their messages hold the logs' tails
            print(exc, file=sys.stderr)
            return 1
        files = sorted(f.name for f in (out / "E13").glob("*"))
        print(f"job {job}: {state}; rank 0 wrote {out / 'E13'}: {', '.join(files) or 'nothing'}"
              + ("" if args.out else " (a temporary directory, removed now)"))
        if state != "COMPLETED" or "data.csv" not in files:
            print(s.logs(job), file=sys.stderr)
            return 1
    return 0


#: a short E13 (the cpu profile's parameters with 3 iterations on the digits task)
SHORT_E13 = ("-p", "tasks=['digits']", "-p", "digits_seeds=[0]", "-p", "digits_iterations=3",
             "-p", "eval_every=2", "-p", "methods=['allreduce-adam','dadam-complete']",
             "-p", "digits_lrs=[0.003]", "--no-plot")


def run_artifact(s: SlurmCluster, out: Path, timeout_s: float,
                 overrides: Sequence[str] = SHORT_E13) -> tuple[int, str]:
    """Submit the artifact's sbatch script with the cpu profile, E13 and ``overrides`` on all of
    ``s``'s nodes, one rank each, results to ``out``; ``(job id, final state)``."""
    Path(out).mkdir(parents=True, exist_ok=True)  # the job's output file goes there too
    env = {"PROFILE": "cpu", "EXPERIMENTS": "E13", "NPROC_PER_NODE": "1", "OUT": str(out),
           "PYTHON": sys.executable, "PIPECOMM_PROCS_ON_HOST": str(s.nodes),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"),
                                          *filter(None, [os.environ.get("PYTHONPATH")])]),
           "NODE_TIMEOUT_S": str(int(timeout_s))}
    job = s.submit(SBATCH, ["cpu", *overrides],
                   ["--nodes", str(s.nodes), "--gpus-per-node", "0", "--cpus-per-task", "1",
                    "--time", "30",
                    f"--output={out}/slurm-%j.out"], env=env)
    return job, s.wait(job, timeout_s)


if __name__ == "__main__":
    sys.exit(main())
