"""The SLURM path on a real SLURM (pipecomm.lab.networks.cluster.slurm): slurmctld and one slurmd per node
namespace of the virtual cluster, munge between them; ``artifact/slurm/run_gpu_profile.sbatch``
submitted with sbatch as a user would (cpu profile, a short E13, 2 nodes).

Needs what the virtual cluster needs (root, iproute2, tbf) and SLURM's programs (Debian:
``apt-get install slurm-wlm munge``); without them the SLURM test skips with the reason. Oracles:
E13 run in one local pool with the same parameters, scontrol's record of the job, and the host's
own lists of namespaces, processes and files (nothing left behind).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from pipecomm.lab.experiments import e13_dadam_convergence as e13
from pipecomm.lab.networks import cluster
from pipecomm.lab.networks.cluster import slurm

OK, REASON = slurm.available()
needs_slurm = pytest.mark.skipif(not OK, reason=f"no SLURM cluster here: {REASON}")


@pytest.mark.parametrize(("kwargs", "name"), [
    (dict(nodes=1), "nodes"), (dict(nodes=2.0), "nodes"), (dict(nodes=17), "nodes"),
    (dict(cpus_per_node=0), "cpus_per_node"), (dict(cpus_per_node=1.5), "cpus_per_node"),
    (dict(timeout_s=0), "timeout_s"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs, name):
    with pytest.raises(ValueError, match=name):
        slurm.SlurmCluster(**kwargs)


def test_available_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(slurm, "cluster_available", lambda: (True, "ok"))
    monkeypatch.setattr(slurm, "BINARIES", (*slurm.BINARIES, "no-such-slurm-program"))
    ok, why = slurm.available()
    assert not ok and "no-such-slurm-program" in why and "apt-get install slurm-wlm" in why
    monkeypatch.setattr(slurm, "cluster_available", lambda: (False, "needs root"))
    assert slurm.available() == (False, "needs root")


@needs_slurm
@pytest.mark.timeout(900)
def test_the_artifact_sbatch_script_runs_e13_on_two_slurm_nodes(tmp_path):
    """A failing job and a job past its wait report their state and the logs' tails; then
    sbatch on node 0, srun one task per node, torchrun's rendezvous at the first node (found by
    its host name), rank 0's results: the same final losses as E13 in one local pool."""
    out = tmp_path / "results"
    with slurm.SlurmCluster(2, timeout_s=120) as s:
        sinfo = s.command(["sinfo", "-h", "-o", "%D %t"]).stdout.split()
        # a failing job and one past its wait: the state, then the logs' tails in one block
        script = tmp_path / "fails.sbatch"
        script.write_text("#!/bin/bash\necho about to fail\nexit 3\n")
        failing = s.submit(script, options=[f"--output={tmp_path}/fails-%j.out"])
        assert s.wait(failing, timeout_s=60) == "FAILED"
        assert "about to fail" in s.logs(failing) and "-- slurmctld.log:" in s.logs(failing)
        script.write_text("#!/bin/bash\nsleep 300\n")
        slow = s.submit(script, options=[f"--output={tmp_path}/slow-%j.out"])
        with pytest.raises(TimeoutError, match=f"(?s)job {slow} still .*-- slurmd-n0.log:"):
            s.wait(slow, timeout_s=3)
        assert s.wait(slow, timeout_s=60) == "CANCELLED"  # cancelled at the limit
        job, state = slurm.run_artifact(s, out, timeout_s=600)
        assert state == "COMPLETED", s.logs(job, lines=30)
        info = s.job_info(job)
        log = Path(info["StdOut"]).read_text()
        slurmd_logs = [(s.dir / f"slurmd-{n}.log").read_text() for n in s.names]
        pids, prefix, workdir = [p.pid for p in s._procs], s.net.prefix, s.dir
    assert sinfo == ["2", "idle"]
    assert (info["NodeList"], info["NumNodes"], info["ExitCode"]) == ("n[0-1]", "2", "0:0")
    assert "== E13 on 2 nodes x 1 ranks" in log and f"results in {out}" in log
    assert all(f"launch task StepId={job}.0" in text for text in slurmd_logs)  # srun on both
    # everything it started is gone: daemons, namespaces, /etc/netns entries, its directory
    assert not any(_alive(pid) for pid in pids)
    assert [ns for ns in cluster.host.namespaces() if ns.startswith(prefix)] == []
    assert not list(slurm.NETNS_ETC.glob(f"{prefix}*")) and not workdir.exists()
    params = json.loads((out / "E13" / "params.json").read_text())
    assert (params["world_size"], params["ranks_per_node"], params["backend"]) == (2, 1, "gloo")
    local = e13.run(**{k: v for k, v in params.items() if k in e13.DEFAULTS})
    a, b = (e13.finals(d).sort_values(["method", "seed"])
            for d in (pd.read_csv(out / "E13" / "data.csv"), local))
    assert list(a.method) == list(b.method) == ["allreduce-adam", "dadam-complete"]
    np.testing.assert_allclose(a.loss.to_numpy(), b.loss.to_numpy(), rtol=1e-5)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0  # zombies are gone
