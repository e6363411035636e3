"""python -m pipecomm.run: an unmodified script whose backend comes from the environment runs
on pipecomm under torchrun and trains exactly as on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipecomm import run

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group(backend=os.environ["BACKEND"])
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
ddp = DDP(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
g = torch.Generator().manual_seed(rank)
for step in range(5):
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
out = dict(params=[p.detach().flatten().tolist() for p in model.parameters()], sum=t.item(),
           backend=str(dist.get_backend()), name=__name__, argv=sys.argv[1:],
           algorithm=os.environ.get("PIPECOMM_ALGORITHM"))
if rank == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)
dist.destroy_process_group()
"""


#: What a process of this torch build sometimes prints when it aborts as a torchrun job of
#: plain gloo and DDP ends (seen in 3 of 15 runs of this test, in the gloo reference run too, so
#: not pipecomm's): such a run is started again, up to three times in all; any other failure
#: fails the test.
GLOO_EXIT_ABORT = "terminate called without an active exception"


def torchrun(script: Path, out: Path, backend: str, *wrapper: str) -> dict:
    env = dict(os.environ, BACKEND=backend)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", *wrapper, str(script), str(out), "--flag"]  # fmt: skip
    for _ in range(3):
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode == 0 or GLOO_EXIT_ABORT not in proc.stderr:
            break
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_script_runs_on_pipecomm_like_on_gloo(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    gloo = torchrun(script, tmp_path / "gloo.json", "gloo")
    ours = torchrun(
        script, tmp_path / "pipecomm.json", "pipecomm", "-m", "pipecomm.run", "--algorithm", "ring"
    )
    assert gloo["backend"] == "gloo" and ours["backend"] == "pipecomm"
    assert ours["name"] == "__main__" and ours["argv"] == [
        str(tmp_path / "pipecomm.json"),
        "--flag",
    ]
    assert ours["algorithm"] == "ring" and ours["sum"] == gloo["sum"] == 3.0
    assert ours["params"] == gloo["params"]  # p = 2: the same sums, bit for bit


def test_arguments_are_checked():
    args = run.parse_args(["--algorithm", "ring", "train.py", "--lr", "3", "--algorithm", "x"])
    assert args.script == "train.py" and args.args == ["--lr", "3", "--algorithm", "x"]
    with pytest.raises(SystemExit):
        run.parse_args(["--algorithm", "fancy", "train.py"])
    with pytest.raises(SystemExit):
        run.parse_args(["--algorithm", "mst", "--compression", "int8", "train.py"])
    with pytest.raises(SystemExit):
        run.parse_args(["--block-bytes", "0", "train.py"])
    with pytest.raises(SystemExit, match="no such script"):
        run.main(["does-not-exist.py"])
