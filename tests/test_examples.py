"""examples/train_gpt.py: every strategy trains for a few steps on 2 CPU ranks under torchrun,
and a checkpoint resumed at step 2 continues exactly as the uninterrupted run; a resume from
files that are stale (ranks at different steps), missing or unsafe to unpickle is refused.

Starting torchrun and importing torch in every rank costs many seconds on a loaded machine, so
one torchrun job (this file run as a script) calls the example's ``main`` for every
configuration on the same process group; the tests read the logs and checkpoints it wrote.
"""

from __future__ import annotations

import csv
import datetime
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import types
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
STEPS = 4
COMMON = ["--max-iters", str(STEPS), "--lr-decay-iters", str(STEPS), "--warmup-iters", "1",
          "--grad-accum", "2", "--batch-size", "4", "--eval-iters", "1", "--timeout", "120"]  # fmt: skip
#: strategies whose resume is exact (every one: the hook states are checkpointed too)
EXACT_RESUME = ("ddp", "ddp-pipelined-hook", "pipesgd", "decentralized", "ddp-gossip-hook")
#: PipeSGD with int8 and error feedback (its residuals differ per rank: one checkpoint per rank)
EF = ["--strategy", "pipesgd", "--compression", "int8", "--error-feedback"]
TIMEOUT_S = 420


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Payload:
    """Unpickling it calls ``os.makedirs(path)``: what ``torch.load(weights_only=False)`` runs."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return os.makedirs, (self.path, 0o777, True)


def damage(out: Path) -> None:
    """Copies of finished runs with a file stale, missing, or carrying a pickled call."""
    # decentralized, interrupted after step 3 (cut mid-line) with its checkpoints at step 2
    shutil.copytree(out / "decentralized-resumed", out / "interrupted")
    for rank in (0, 1):
        name = f"ckpt_rank{rank}.pt"
        shutil.copy(out / "step2" / name, out / "interrupted" / name)
    with open(out / "interrupted" / "log.jsonl", "a") as f:
        f.write('{"step": 4, "lo')
    shutil.copytree(out / "decentralized-resumed", out / "stale")  # rank 0 at step 4, rank 1 at 2
    shutil.copy(out / "step2" / "ckpt_rank1.pt", out / "stale" / "ckpt_rank1.pt")
    shutil.copytree(out / "decentralized-resumed", out / "missing")
    (out / "missing" / "ckpt_rank1.pt").unlink()
    for name, file in (("unsafe-ckpt", "ckpt.pt"), ("unsafe-hook", "hook_rank1.pt")):
        shutil.copytree(out / "ddp-pipelined-hook-resumed", out / name)
        obj = torch.load(out / name / file, weights_only=True)
        obj["note"] = Payload(str(out / name / "payload-ran"))
        torch.save(obj, out / name / file)


def refused(train: ModuleType, argv: list[str], out: Path, rank: int) -> None:
    """``train.main(argv)``; its refusal (SystemExit) goes to ``out/refused_rank{rank}.txt``."""
    try:
        train.main(argv)
    except SystemExit as e:
        (out / f"refused_rank{rank}.txt").write_text(str(e.code))


def write_ring_table(path: Path) -> None:
    """An autotune table for the allreduce of 2 ranks in which the ring is fastest."""
    from pipecomm.collectives import builtin, lp
    from pipecomm.lab.measure import autotune

    times = {"ring": 1.0, "torch": 1.5, "lp": 2.0, "mst": 2.0, "be": 2.0}
    rows = [{"op": "allreduce", "world_size": 2, "nbytes": 1 << 20, "algorithm": a, "time_s": t}
            for a, t in times.items()]
    autotune.write_table(autotune.table_of(rows, builtin.fingerprint(), lp.DEFAULT_LINK), path)


def drive(out: Path) -> None:
    """Run on every rank under torchrun: each strategy, then save at step 2 and resume; then
    resume after an interruption and from damaged copies."""
    import torch.distributed as dist

    train = load_script()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    for strategy in train.STRATEGIES:
        trace = (["--trace", str(out / "trace"), "--comm-log", str(out / "comm_log.csv")]
                 if strategy == "ddp-pipelined-hook" else [])
        train.main([*COMMON, "--strategy", strategy, "--algorithm", "lp", "--out",
                    str(out / strategy), *trace])
    if rank == 0:  # the default, auto, inside DDP: reading a table that crowns the ring
        write_ring_table(out / "tune.json")
    dist.barrier()
    os.environ["PIPECOMM_TUNE_FILE"] = str(out / "tune.json")
    train.main([*COMMON, "--strategy", "ddp-pipecomm", "--out", str(out / "ddp-pipecomm-auto"),
                "--comm-log", str(out / "comm_log_auto.csv")])
    os.environ["PIPECOMM_TUNE_FILE"] = "off"
    train.main([*COMMON, "--strategy", "ddp", "--compression", "int8", "--out",
                str(out / "ddp-int8")])  # torch's own uint8 quantization hook
    train.main([*COMMON, *EF, "--out", str(out / "pipesgd-ef")])
    for strategy in EXACT_RESUME:
        run = [*COMMON, "--strategy", strategy, "--out", str(out / f"{strategy}-resumed")]
        train.main([*run, "--max-iters", "2"])  # stops (and checkpoints) after step 2 of 4
        if strategy == "decentralized":  # each rank keeps its step-2 checkpoint for damage()
            (out / "step2").mkdir(exist_ok=True)
            shutil.copy(out / f"{strategy}-resumed" / f"ckpt_rank{rank}.pt", out / "step2")
        train.main([*run, "--resume"])
    run = [*COMMON, *EF, "--out", str(out / "pipesgd-ef-resumed")]
    train.main([*run, "--max-iters", "2"])
    train.main([*run, "--resume"])
    dist.barrier()
    if rank == 0:
        damage(out)
    dist.barrier()
    train.main([*COMMON, "--strategy", "decentralized", "--resume", "--out", str(out / "interrupted")])
    for name in ("unsafe-ckpt", "unsafe-hook"):
        argv = [*COMMON, "--strategy", "ddp-pipelined-hook", "--resume", "--out", str(out / name)]
        refused(train, argv, out / name, rank)
    dist.destroy_process_group()


def launch_ranks(argv: list[str], timeout_s: float, world: int = 2) -> list[tuple[int, str]]:
    """``examples/train_gpt.py argv`` as ``world`` processes (torchrun's environment, without
    its agent: each rank's exit status and stderr on its own); ``(returncode, stderr)`` each."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, str(SCRIPT), *argv], cwd=ROOT, text=True,
                         env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        out = []
        for p in procs:
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, err))
        return out
    except subprocess.TimeoutExpired:
        pytest.fail(f"the ranks did not exit in {timeout_s} s")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def read_log(path: Path) -> tuple[list[dict], dict]:
    records = [json.loads(line) for line in (path / "log.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r]
    rest = {k: v for r in records if "step" not in r for k, v in r.items()}
    return steps, rest


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("train_gpt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", __file__, str(out)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"torchrun did not finish in {TIMEOUT_S} s: {(e.stderr or '')[-3000:]}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.mark.parametrize("strategy", ["ddp", "ddp-pipecomm", "ddp-pipelined-hook", "pipesgd",
                                      "decentralized", "ddp-gossip-hook"])
def test_strategy_trains_and_checkpoints(runs: Path, strategy: str) -> None:
    steps, rest = read_log(runs / strategy)
    assert [r["step"] for r in steps] == list(range(STEPS))
    losses = [r["loss"] for r in steps]
    assert all(math.isfinite(v) for v in losses)
    assert math.isfinite(rest["val_loss"])
    # the untrained model predicts ~uniformly (ln of a ~100-character vocabulary); training
    # lowers it, but 4 steps at batch 4 are noisy: compare with the first step's loss
    assert rest["val_loss"] < losses[0]
    lrs = [r["lr"] for r in steps]
    assert lrs[0] < lrs[1] and lrs[-1] < lrs[1]  # warm-up, then cosine decay
    per_rank = strategy in ("decentralized", "ddp-gossip-hook")
    names = ["ckpt_rank0.pt", "ckpt_rank1.pt"] if per_rank else ["ckpt.pt"]
    for name in names:
        ckpt = torch.load(runs / strategy / name, weights_only=True)
        assert ckpt["step"] == STEPS and ckpt["args"]["strategy"] == strategy


def test_pipecomm_backend_trains_like_gloo(runs: Path) -> None:
    gloo, _ = read_log(runs / "ddp")
    lp, _ = read_log(runs / "ddp-pipecomm")
    assert [r["loss"] for r in lp] == pytest.approx([r["loss"] for r in gloo], rel=1e-4)


def test_the_default_auto_runs_the_tables_choice_inside_ddp(runs: Path) -> None:
    gloo, _ = read_log(runs / "ddp")
    auto, _ = read_log(runs / "ddp-pipecomm-auto")
    assert [r["loss"] for r in auto] == pytest.approx([r["loss"] for r in gloo], rel=1e-4)
    with open(runs / "comm_log_auto.csv") as f:
        rows = list(csv.DictReader(f))
    assert rows and {r["algorithm"] for r in rows if r["op"] == "allreduce"} == {"auto:ring"}


def test_torchs_quantization_hook_trains_close_to_ddp(runs: Path) -> None:
    """--strategy ddp --compression int8: torch's uint8 hook's algorithm (per-tensor scale,
    allgathered) leaves the first loss as is and the next within a percent of DDP's."""
    gloo, _ = read_log(runs / "ddp")
    int8, rest = read_log(runs / "ddp-int8")
    assert int8[0]["loss"] == gloo[0]["loss"] and len(int8) == len(gloo) == STEPS
    assert [r["loss"] for r in int8] == pytest.approx([r["loss"] for r in gloo], rel=1e-2)
    assert [r["loss"] for r in int8] != [r["loss"] for r in gloo]  # it did quantize
    assert math.isfinite(rest["val_loss"])


def test_torchs_own_quantization_hook_fails_on_gloo_the_port_does_not() -> None:
    """Why train_gpt.py runs its port: torch's hook indexes NCCL's nested allgather result
    (when torch's passes here, use it); the port averages within a quantization step."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks

    train = load_script()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        g = torch.linspace(-1.0, 3.0, 1000)
        bucket = types.SimpleNamespace(buffer=lambda: g)
        with pytest.raises(Exception, match="invalid index of a 0-dim tensor"):
            quantization_hooks.quantization_pertensor_hook(None, bucket).wait()
        out = train.uint8_allgather_hook(None, bucket).wait()
        assert out.dtype == torch.float32 and (out - g).abs().max() <= 4.0 / 255 / 2 + 1e-6
        assert not torch.equal(out, g)
    finally:
        dist.destroy_process_group()


def test_the_uint8_hook_does_not_deadlock_several_buckets(tmp_path: Path) -> None:
    """4 ranks, several buckets in flight: a hook that waited inside its callback (as torch's
    does) hung at step 1 here, every gloo worker thread blocked."""
    argv = ["--strategy", "ddp", "--compression", "int8", "--max-iters", "3", "--n-layer", "4",
            "--n-embd", "128", "--batch-size", "8", "--eval-iters", "1", "--timeout", "60",
            "--out", str(tmp_path)]
    for code, err in launch_ranks(argv, 120, world=4):
        assert code == 0, err[-3000:]
    steps, _ = read_log(tmp_path)
    assert [r["step"] for r in steps] == [0, 1, 2]


def test_pipelined_hook_trains_like_pipesgd(runs: Path) -> None:
    hook, _ = read_log(runs / "ddp-pipelined-hook")
    pipe, _ = read_log(runs / "pipesgd")
    assert [r["loss"] for r in hook] == pytest.approx([r["loss"] for r in pipe], rel=1e-4)


def test_gossip_hook_trains_like_decentralized(runs: Path) -> None:
    """The same rule (one-peer-exp at p = 2: each step the two replicas' average, then the local
    step with the own, clipped gradient) inside stock DDP and in DecentralizedDataParallel."""
    hook, rest = read_log(runs / "ddp-gossip-hook")
    wrapper, wrapper_rest = read_log(runs / "decentralized")
    assert [r["loss"] for r in hook] == pytest.approx([r["loss"] for r in wrapper], rel=1e-4)
    assert rest["val_loss"] == pytest.approx(wrapper_rest["val_loss"], rel=1e-4)


@pytest.mark.parametrize("strategy", [*EXACT_RESUME, "pipesgd-ef"])
def test_resume_continues_exactly(runs: Path, strategy: str) -> None:
    whole, _ = read_log(runs / strategy)
    resumed, _ = read_log(runs / f"{strategy}-resumed")
    assert [r["step"] for r in resumed] == list(range(STEPS))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole]


def test_resume_after_interruption_logs_each_step_once(runs: Path) -> None:
    """Checkpoints at step 2, the log at step 3 with a last line cut mid-write: the resumed log
    holds steps 0..3 once each (the run's, exact), and no damaged line."""
    lines = (runs / "interrupted" / "log.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]  # the cut line is gone
    steps = [r["step"] for r in records if "step" in r]
    assert steps == list(range(STEPS)), steps
    whole, _ = read_log(runs / "decentralized")
    assert [r["loss"] for r in records if "step" in r] == [r["loss"] for r in whole]
    assert [k for r in records if "step" not in r for k in r] == [
        "val_loss", "median_step_ms", "steps_timed", "comm"]  # the resumed run's only


@pytest.mark.parametrize("case, rank1", [("stale", "at 2"), ("missing", "missing")])
def test_resume_refuses_ranks_at_different_steps(runs: Path, case: str, rank1: str) -> None:
    """Rank 0's checkpoint at step 4, rank 1's at step 2 (stale) or none (missing): every rank
    exits non-zero with the one line, before training (well within --timeout), the log
    untouched."""
    out = runs / case
    log = (out / "log.jsonl").read_text()
    argv = [*COMMON, "--strategy", "decentralized", "--out", str(out), "--resume",
            "--timeout", "60"]  # fmt: skip
    t0 = time.monotonic()
    results = launch_ranks(argv, timeout_s=90)
    elapsed = time.monotonic() - t0
    line = (f"resume: ranks disagree on the checkpoint's step: rank 0 at 4, rank 1 {rank1} "
            f"({out / 'ckpt_rank1.pt'}); remove {out} or the stale file")  # fmt: skip
    for rank, (code, err) in enumerate(results):
        assert code != 0, (rank, err)
        assert err.strip().splitlines()[-1] == line, (rank, err[-2000:])
        assert "Traceback" not in err and err.count("resume:") == 1, (rank, err[-2000:])
    assert elapsed < 60, elapsed  # refused, not timed out
    assert (out / "log.jsonl").read_text() == log


def test_checkpoints_load_with_weights_only(runs: Path) -> None:
    """Every file train_gpt writes holds only tensors and plain containers; --resume loads them
    with weights_only=True, so a checkpoint or hook state carrying a pickled call is refused
    (unreadable) on every rank without running it."""
    files = [f for f in runs.rglob("*.pt") if not f.parent.name.startswith("unsafe")]
    assert {f.name for f in files} >= {"ckpt.pt", "ckpt_rank0.pt", "ckpt_rank1.pt",
                                       "hook_rank0.pt", "hook_rank1.pt"}  # fmt: skip
    for f in files:
        torch.load(f, weights_only=True)
    for name, file in (("unsafe-ckpt", "ckpt.pt"), ("unsafe-hook", "hook_rank1.pt")):
        out = runs / name
        assert not (out / "payload-ran").exists(), f"resume unpickled {out / file}'s call"
        for rank in (0, 1):
            text = (out / f"refused_rank{rank}.txt").read_text()
            assert text.startswith("resume: ranks disagree") and f"unreadable ({out / file})" in text


def test_error_feedback_trains_and_checkpoints_every_rank(runs: Path) -> None:
    steps, rest = read_log(runs / "pipesgd-ef")
    assert [r["step"] for r in steps] == list(range(STEPS)) and math.isfinite(rest["val_loss"])
    plain, _ = read_log(runs / "pipesgd")
    assert [r["loss"] for r in steps] != [r["loss"] for r in plain]  # int8 changed the updates
    for rank in (0, 1):
        ckpt = torch.load(runs / "pipesgd-ef" / f"ckpt_rank{rank}.pt", weights_only=True)
        assert ckpt["optimizer"]["rank"] == rank and ckpt["optimizer"]["residuals"]


def test_trace_and_counters(runs: Path) -> None:
    """--trace: a Chrome trace per rank with pipecomm's ranges on the main thread and on the
    communication thread; the log holds the counters."""
    for rank in (0, 1):
        events = json.loads((runs / "trace" / f"trace_rank{rank}.json").read_text())["traceEvents"]
        tids = {e.get("tid") for e in events if e.get("name") == "pipecomm.allreduce.lp"}
        assert len(tids) >= 2, tids
        assert any(e.get("name") == "aten::addmm" for e in events)  # the compute, beside it
    _, rest = read_log(runs / "ddp-pipelined-hook")
    lp = rest["comm"]["pipecomm.allreduce.lp"]
    assert lp["calls"] >= STEPS and lp["bytes"] > 0 and lp["seconds"] > 0


def test_comm_log_holds_every_ranks_calls(runs: Path) -> None:
    """--comm-log FILE: one CSV row per collective call of every rank, with algbw and busbw."""
    with open(runs / "comm_log.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["rank"] for r in rows} == {"0", "1"}
    assert len(rows) >= 2 * STEPS and {r["op"] for r in rows} == {"allreduce"}
    for r in rows:
        assert r["ranks"] == "2" and int(r["bytes"]) > 0 and float(r["seconds"]) > 0
        assert float(r["busbw"]) == pytest.approx(float(r["algbw"]))  # 2(p-1)/p = 1 at p = 2


def test_bad_arguments_are_refused_before_training() -> None:
    train = load_script()
    with pytest.raises(SystemExit):
        train.parse_args(["--strategy", "allreduce"])
    with pytest.raises(SystemExit):
        train.parse_args(["--grad-accum", "0"])
    with pytest.raises(SystemExit):
        train.parse_args(["--strategy", "decentralized", "--compression", "fp16"])
    with pytest.raises(SystemExit):
        train.parse_args(["--strategy", "pipesgd", "--error-feedback"])
    with pytest.raises(SystemExit):  # torch ships fp16 and uint8 hooks, no bf16 one here
        train.parse_args(["--strategy", "ddp", "--compression", "bf16"])
    args = train.parse_args(["--max-iters", "50", "--strategy", "decentralized"])
    assert train.resume_refusal(args, [[50], [50]]) is None
    assert "past --max-iters 50" in train.resume_refusal(args, [[60], [60]])
    assert "no checkpoint" in train.resume_refusal(args, [[train.MISSING], [train.MISSING]])
    assert args.lr_decay_iters == 50
    assert train.get_lr(0, args) < train.get_lr(args.warmup_iters, args) == pytest.approx(args.lr)
    assert train.get_lr(args.max_iters, args) == args.min_lr


if __name__ == "__main__":
    drive(Path(sys.argv[1]))
