"""Train a character-level GPT data-parallel with torch DDP or one of pipecomm's strategies.

A nanoGPT-style training script (one file, read it top to bottom): a small GPT
(:class:`pipecomm.lab.workloads.models.CharTransformer`) on CPython's pydoc topics (:class:`pipecomm.lab.workloads.data.
CharCorpus`, offline), AdamW, gradient accumulation, linear warm-up + cosine learning rate set
every step, gradient clipping, checkpoint and resume, launched with torchrun. ``--strategy``
picks how the replicas stay in sync; every other line is the same:

* ``ddp`` - torch's ``DistributedDataParallel`` on gloo (CPU) or NCCL (CUDA): the baseline
  (``--compression fp16``: with torch's own ``fp16_compress_hook``; ``int8``: the algorithm of its
  experimental ``quantization_pertensor_hook``, uint8 allgathered, ported: torch's fails on gloo).
* ``ddp-pipecomm`` - the same DDP over ``pipecomm.backend.new_group(algorithm=...)``: its
  bucketed AllReduce is linear pipelining (Wang et al., arXiv 1611.04255) or mst / be / ring.
  With ``--error-feedback``: DDP with ``pipecomm.hooks.allreduce_hook`` and
  ``CollectiveState(..., error_feedback=True)`` (the residuals live in the hook state).
* ``ddp-pipelined-hook`` - DDP with ``pipecomm.hooks.pipelined_hook``: Pipe-SGD (Li et al.,
  NeurIPS 2018) inside stock DDP; the optimizer applies the average of ``--staleness`` steps ago
  and skips its step while the pipeline fills (``state.filling``), as PipeSGD does.
* ``pipesgd`` - ``pipecomm.pipesgd.PipeSGD`` wrapping AdamW (``mode="pipe"``); the same rule,
  without DDP.
* ``decentralized`` - ``pipecomm.decentralized.DecentralizedDataParallel`` (DAdam, Wang et al.,
  ICLR 2025): parameters gossiped over ``--topology``, the optimizer steps inside backward.
* ``ddp-gossip-hook`` - DDP with ``pipecomm.hooks.gossip_hook``: the same decentralized rule
  inside stock DDP (``--gossip-mix parameters``; ``gradients`` averages the gradients instead),
  each bucket averaged with the peers of the step during backward, the loop's own
  ``optimizer.step()``.

How each strategy does the training-loop features:

=====================  ==================  ===============================  ===================
strategy               accumulation        clipping (2-norm)                checkpoint
=====================  ==================  ===============================  ===================
ddp, ddp-pipecomm      ``no_sync()``       averaged gradient                rank 0, exact
ddp-pipelined-hook     ``no_sync()``       applied (stale) average          rank 0, exact (+ each
                                                                            rank's hook state)
pipesgd                grads add up        applied (stale) average, in a    rank 0, exact (the
                       locally             step pre-hook                    average in flight;
                                                                            one per rank with
                                                                            error feedback)
decentralized          ``no_sync()``       local gradient (``"global"``     one per rank, exact
                                           scope)
ddp-gossip-hook        ``no_sync()``       local gradient (``parameters``)  one per rank, exact
                                                                            (+ its hook state)
=====================  ==================  ===============================  ===================

Usage (CPU, 2 ranks; each rank prints nothing but rank 0's log)::

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --strategy ddp-pipecomm
    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --strategy pipesgd \\
        --max-iters 200 --grad-accum 2 --out out-gpt
    .venv/bin/torchrun ... examples/train_gpt.py --strategy pipesgd --max-iters 400 --out out-gpt --resume

``--compression int8 --error-feedback`` adds each bucket's last compression error to its next
gradient (``pipecomm.compress.error_feedback``). ``--trace DIR`` writes a Chrome trace of a few
steps per rank (``DIR/trace_rank{r}.json``, open in chrome://tracing or Perfetto): pipecomm's
collectives appear as ``pipecomm.allreduce.<algorithm>`` ranges beside the compute, on the main
and the communication thread. ``--comm-log FILE`` logs every rank's collective calls of training
(``pipecomm.observe.log``) and rank 0 writes them to the CSV ``FILE``, one row per call: rank, op,
algorithm, bytes, ranks, seconds, algbw and busbw (GB/s).

Rank 0 writes ``OUT/log.jsonl`` (one JSON object per step: step, loss, lr, dt_ms; then the
validation loss -- of the replicas' average for the decentralized strategies -- and this rank's
pipecomm counters, ``pipecomm.observe.counters()``) and ``OUT/ckpt.pt`` (``decentralized``,
``ddp-gossip-hook``, and ``pipesgd`` with error feedback: ``OUT/ckpt_rank{r}.pt``, the replicas
or residuals differ); the DDP hook strategies add ``OUT/hook_rank{r}.pt``, every rank's hook
state (averages in flight, residuals, the gossip's step) with its step. Every file holds only tensors
and plain containers: it loads with ``torch.load(..., weights_only=True)``.

``--resume`` first checks, on every rank, that every rank's checkpoint files (its own, or rank
0's ``ckpt.pt``, and its hook state) are there, readable and at the same step; otherwise every
rank exits with one line naming the stale or missing files, before any training collective.
It then keeps the lines of ``OUT/log.jsonl`` before the checkpoint's step (dropping those of the
steps after it, which the run repeats, the earlier run's summary lines, and a line cut
mid-write) and appends the resumed steps.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from pipecomm import backend, hooks, observe, vocab
from pipecomm.decentralized import DecentralizedDataParallel
from pipecomm.lab.networks import launch
from pipecomm.lab.workloads import data, models
from pipecomm.pipesgd import PipeSGD

STRATEGIES = ("ddp", "ddp-pipecomm", "ddp-pipelined-hook", "pipesgd", "decentralized",
              "ddp-gossip-hook")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every option's default, also of an option without a help text."""

    def add_argument(self, action: argparse.Action) -> None:
        if action.help is None and action.option_strings and action.default is not argparse.SUPPRESS:
            action.help = "(default: %(default)s)"
        super().add_argument(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (tiny defaults: a few seconds on two CPU ranks)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=_DefaultsHelp)
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp")
    p.add_argument("--algorithm", choices=vocab.ALGORITHM_CHOICES, default=vocab.DEFAULT_ALGORITHM,
                   help="pipecomm's AllReduce (not used by --strategy ddp)")  # fmt: skip
    p.add_argument("--compression", choices=vocab.CODECS, default=None, help="pipecomm's codec (lp / ring); with --strategy ddp, torch's own hooks: fp16, int8 (uint8 allgather)")
    p.add_argument("--staleness", type=int, default=1, help="k of Pipe-SGD")
    p.add_argument("--error-feedback", action="store_true",
                   help="feed each bucket's compression error into its next gradient")  # fmt: skip
    p.add_argument("--topology", default="one-peer-exp",
                   help="gossip topology (decentralized, ddp-gossip-hook)")
    p.add_argument("--gossip-mix", choices=hooks.MIXES, default="parameters",
                   help="what ddp-gossip-hook averages with the step's peers")
    # model and data
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=48)
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    # optimisation
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=3e-4)
    p.add_argument("--warmup-iters", type=int, default=10)
    p.add_argument("--lr-decay-iters", type=int, default=None, help="default: --max-iters")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="0: no clipping")
    # run
    p.add_argument("--eval-iters", type=int, default=8, help="val batches per rank at the end")
    p.add_argument("--ckpt-interval", type=int, default=0, help="0: checkpoint at the end only")
    p.add_argument("--out", default="out-train-gpt")
    p.add_argument("--resume", action="store_true", help="continue from OUT's checkpoint")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for any collective")
    p.add_argument("--trace", default=None, metavar="DIR",
                   help="write a Chrome trace of a few steps per rank to DIR")  # fmt: skip
    p.add_argument("--comm-log", default=None, metavar="FILE",
                   help="write every rank's collective calls (pipecomm.observe.records) to the CSV FILE")  # fmt: skip
    args = p.parse_args(argv)
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.max_iters
    for name in ("max_iters", "grad_accum", "batch_size", "lr_decay_iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.compression is not None and args.strategy in ("decentralized", "ddp-gossip-hook"):
        p.error("--compression applies to ddp-pipecomm, ddp-pipelined-hook and pipesgd (and "
                "fp16 or int8 to ddp: torch's own hooks)")
    if args.strategy == "ddp" and args.compression not in (None, "fp16", "int8"):
        p.error(f"--strategy ddp has torch's built-in fp16 and int8 (quantization) hooks only, "
                f"got --compression {args.compression}")
    if args.strategy == "ddp" and args.error_feedback:
        p.error("--error-feedback is pipecomm's (ddp-pipecomm, ddp-pipelined-hook, pipesgd)")
    if args.error_feedback and args.compression is None:
        p.error("--error-feedback needs --compression (nothing is lost to feed back without it)")
    return args


def get_lr(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up to ``--lr``, then cosine decay to ``--min-lr`` at ``--lr-decay-iters``."""
    if step < args.warmup_iters:
        return args.lr * (step + 1) / (args.warmup_iters + 1)
    if step >= args.lr_decay_iters:
        return args.min_lr
    ratio = (step - args.warmup_iters) / max(1, args.lr_decay_iters - args.warmup_iters)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (args.lr - args.min_lr)


def get_batch(
    corpus: data.CharCorpus, args: argparse.Namespace, step: int, rank: int, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's micro-batches of ``step``: a function of (seed, step, rank) only, so a resumed
    run sees the batches an uninterrupted run would have."""
    g = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * 1_009 + rank)
    out = []
    for _ in range(args.grad_accum):
        x, y = corpus.batch(args.batch_size, args.block_size, g)
        out.append((x.to(device), y.to(device)))
    return out


def make_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (nanoGPT's grouping)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": args.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.99))


def uint8_allgather_hook(group, bucket):
    """The algorithm of torch's experimental ``quantization_pertensor_hook``: each rank's bucket
    quantized to uint8 with its own per-tensor scale and zero point (``MinMaxObserver``'s),
    allgathered, dequantized and averaged on every rank. torch 2.13's own hook fails on gloo (it
    indexes NCCL's nested allgather result) and waits inside a callback, which can deadlock
    gloo's worker threads; here the scale and zero point travel in front of the codes (8 bytes),
    one allgather, nothing waited. No annotations: DDP compares them with ``dist.GradBucket``,
    and this file's are strings."""
    group = group or dist.group.WORLD
    t, p = bucket.buffer(), group.size()
    lo, hi = t.min().clamp(max=0.0), t.max().clamp(min=0.0)
    scale = ((hi - lo) / 255).clamp(min=torch.finfo(torch.float32).eps)
    zero = (-lo / scale).round().clamp(0, 255)
    codes = ((t / scale).round() + zero).clamp(0, 255).to(torch.uint8)
    mine = torch.cat([torch.stack([scale, zero]).float().view(torch.uint8), codes])  # 8 bytes
    every = [torch.empty_like(mine) for _ in range(p)]

    def average(_: Any) -> torch.Tensor:
        out = torch.zeros_like(t)
        for m in every:
            s, z = m[:8].view(torch.float32)
            out += s * (m[8:].float() - z)
        return out / p

    fut = dist.all_gather(every, mine, group=group, async_op=True).get_future()
    return fut.then(average)


def wrap(model: torch.nn.Module, args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """``(forward_model, optimizer, pipeline_state)`` of ``--strategy``: the only lines that
    differ from a torch DDP script."""
    opt = make_optimizer(model, args)
    clip = args.grad_clip
    if args.strategy == "ddp":
        ddp = DDP(model)
        if args.compression == "fp16":  # torch's own fp16 hook
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif args.compression == "int8":  # torch's uint8 hook, as it runs on gloo
            ddp.register_comm_hook(None, uint8_allgather_hook)
        return ddp, opt, None
    if args.strategy == "ddp-pipecomm" and args.error_feedback:
        ddp = DDP(model)
        state = hooks.CollectiveState(args.algorithm, args.compression, error_feedback=True)
        hooks.register(ddp, state, hooks.allreduce_hook)
        return ddp, opt, state
    if args.strategy == "ddp-pipecomm":
        pg = backend.new_group(algorithm=args.algorithm, compression=args.compression)
        return DDP(model, process_group=pg), opt, None
    if args.strategy == "ddp-pipelined-hook":
        ddp = DDP(model)
        state = hooks.PipelinedState(
            args.staleness, args.algorithm, args.compression, error_feedback=args.error_feedback
        )
        hooks.register(ddp, state, hooks.pipelined_hook)
        return ddp, opt, state
    if args.strategy == "ddp-gossip-hook":
        ddp = DDP(model, init_sync=not args.resume)  # resumed: every rank loaded its own replica
        state = hooks.GossipState(args.topology, args.gossip_mix, args.algorithm)
        hooks.register(ddp, state, hooks.gossip_hook)
        return ddp, opt, state
    if args.strategy == "pipesgd":
        opt = PipeSGD(model, opt, mode="pipe", staleness=args.staleness,
                      algorithm=args.algorithm, compression=args.compression,
                      error_feedback=args.error_feedback)  # fmt: skip
        if clip > 0:  # clip the averaged gradient that the update applies (as DDP does)

            def clip_applied_gradient(*_: Any) -> None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

            opt.register_step_pre_hook(clip_applied_gradient)
        return model, opt, None
    ddp = DecentralizedDataParallel(
        model, opt, topology=args.topology, algorithm=args.algorithm,
        max_grad_norm=clip if clip > 0 else None, grad_norm_scope="global",
        init_sync=not args.resume,  # resumed: every rank loaded its own replica
    )  # fmt: skip
    return ddp, ddp.optimizer, None


def per_rank(args: argparse.Namespace) -> bool:
    """Decentralized replicas differ, and so do PipeSGD's error-feedback residuals."""
    return args.strategy in ("decentralized", "ddp-gossip-hook") or (
        args.strategy == "pipesgd" and args.error_feedback)


def ckpt_path(args: argparse.Namespace, rank: int) -> Path:
    """Replicated strategies share one checkpoint (rank 0's); else one per rank."""
    return Path(args.out) / (f"ckpt_rank{rank}.pt" if per_rank(args) else "ckpt.pt")


def hook_path(args: argparse.Namespace, rank: int) -> Path:
    """Every rank's DDP hook state (its residuals are its own)."""
    return Path(args.out) / f"hook_rank{rank}.pt"


def hooked(args: argparse.Namespace) -> bool:
    """The strategies whose DDP hook state is checkpointed (``wrap`` returns it as ``pipe``)."""
    return args.strategy in ("ddp-pipelined-hook", "ddp-gossip-hook") or (
        args.strategy == "ddp-pipecomm" and args.error_feedback
    )


def _save(obj: Any, path: Path) -> None:
    torch.save(obj, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def save_checkpoint(
    model: torch.nn.Module, opt: Any, pipe: Any, step: int, args: argparse.Namespace, rank: int
) -> None:
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "args": vars(args)}  # fmt: skip
    if rank == 0 or per_rank(args):
        _save(ckpt, ckpt_path(args, rank))
    if pipe is not None:  # the hook's averages in flight and residuals: every rank
        _save({"step": step, "state": pipe.state_dict()}, hook_path(args, rank))


MISSING, UNREADABLE = -1, -2  # a file's step in the resume check when there is none


def _load(path: Path, keys: tuple[str, ...], device: torch.device) -> tuple[int, dict | None]:
    """``(step, contents)`` of a checkpoint file holding ``keys`` (``weights_only``: tensors and
    plain containers, nothing else is unpickled), or ``(MISSING | UNREADABLE, None)``."""
    if not path.exists():
        return MISSING, None
    try:
        obj = torch.load(path, map_location=device, weights_only=True)
    except Exception:  # cut mid-write, not a checkpoint, or holds something besides tensors
        return UNREADABLE, None
    if not isinstance(obj, dict) or not {"step", *keys} <= obj.keys():
        return UNREADABLE, None
    if type(obj["step"]) is not int or obj["step"] < 0:
        return UNREADABLE, None
    return obj["step"], obj


def resume_refusal(args: argparse.Namespace, steps: list[list[int]]) -> str | None:
    """The one line refusing a resume from the files whose steps (per rank: checkpoint, then
    hook state) are ``steps``, or None when all are at one step and it is not past the end."""
    flat = [s for rank in steps for s in rank]
    if min(flat) >= 0 and len(set(flat)) == 1:
        if flat[0] <= args.max_iters:
            return None
        return (f"resume: the checkpoint in {args.out} is at step {flat[0]}, past --max-iters "
                f"{args.max_iters}")  # fmt: skip
    best = max(flat)

    def state(s: int) -> str:
        return f"at {s}" if s >= 0 else "missing" if s == MISSING else "unreadable"

    parts = []  # per rank: "rank 1 at 7 (OUT/ckpt_rank1.pt)", naming the files not at `best`
    for r, codes in enumerate(steps):
        paths = [ckpt_path(args, r), *([hook_path(args, r)] if hooked(args) else [])]
        if len(set(codes)) == 1:  # the rank's files agree
            stale = ", ".join(str(p) for p, s in zip(paths, codes) if s != best or s < 0)
            parts.append(f"rank {r} {state(codes[0])}" + (f" ({stale})" if stale else ""))
        else:  # its hook state and its checkpoint disagree
            files = " and ".join(f"{state(s)} ({p})" for p, s in zip(paths, codes))
            parts.append(f"rank {r} {files}")
    if best < 0:
        return f"resume: no checkpoint to resume from: {', '.join(parts)}; run without --resume"
    return (f"resume: ranks disagree on the checkpoint's step: {', '.join(parts)}; remove "
            f"{args.out} or the stale file")  # fmt: skip


def load_resume(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[dict, Any]:
    """This rank's checkpoint and hook state (or None), once every rank has found its files at
    the same step (an all_gather of the steps, before any training collective); else every
    rank raises SystemExit with the same line."""
    step, ckpt = _load(ckpt_path(args, rank), ("model", "optimizer"), device)
    codes = [step]
    hook = None
    if hooked(args):
        hook_step, hook = _load(hook_path(args, rank), ("state",), device)
        codes.append(hook_step)
    mine = torch.tensor(codes, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    refusal = resume_refusal(args, [t.tolist() for t in gathered])
    if refusal is not None:
        raise SystemExit(refusal)
    return ckpt, (hook["state"] if hook is not None else None)


def start_log(args: argparse.Namespace, step: int) -> None:
    """Rewrite ``OUT/log.jsonl`` (atomically) with its step lines before ``step`` (the resumed
    checkpoint's; 0: empty), the run appends its own from ``step`` on. A step that comes again
    (an earlier resume) replaces the lines from it on; summary lines and damaged (cut mid-write)
    lines are dropped."""
    path = Path(args.out) / "log.jsonl"
    kept: list[tuple[int, str]] = []
    text = path.read_text(errors="replace") if path.exists() else ""
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # cut mid-write
            continue
        s = record.get("step") if isinstance(record, dict) else None
        if type(s) is not int or s >= step:
            continue
        while kept and kept[-1][0] >= s:
            kept.pop()
        kept.append((s, line))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for _, line in kept))
    os.replace(tmp, path)


def make_profiler(args: argparse.Namespace, steps: int, cuda: bool, rank: int) -> Any:
    """``torch.profiler.profile`` of a few steps (after two warm-up ones, when there are enough),
    pipecomm's communication thread included; the trace goes to ``--trace``/trace_rank{r}.json."""
    if args.trace is None:
        return None
    Path(args.trace).mkdir(parents=True, exist_ok=True)
    active = min(3, steps)
    warmup = min(1, steps - active)
    wait = min(2, steps - active - warmup)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def write(prof: Any) -> None:
        prof.export_chrome_trace(str(Path(args.trace) / f"trace_rank{rank}.json"))

    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1),
        on_trace_ready=write,
        experimental_config=observe.all_threads(),
    )


def log(args: argparse.Namespace, **record: Any) -> None:
    """Append one JSON line to ``OUT/log.jsonl`` (rank 0 only)."""
    with open(Path(args.out) / "log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")


@contextlib.contextmanager
def replicas_averaged(model: torch.nn.Module) -> Any:
    """Within the block ``model`` holds the mean over ranks of the parameters (each rank's own
    come back afterwards): gossip leaves the replicas apart."""
    own = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            dist.all_reduce(p.data)
            p.data /= dist.get_world_size()
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, mine in zip(model.parameters(), own):
                p.copy_(mine)


def write_comm_log(path: str, master: bool) -> None:
    """Every rank's logged calls (``pipecomm.observe.records``), with its rank, to the CSV
    ``path`` (written by rank 0); the log is turned off."""
    mine = [{"rank": dist.get_rank(), **r} for r in observe.records()]
    observe.log(0)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if master:
        rows = [r for rank_rows in every for r in rank_rows]
        fields = ["rank", "op", "algorithm", "bytes", "ranks", "seconds", "algbw", "busbw"]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(rows)
        print(f"comm log: {len(rows)} calls -> {path}")


@torch.no_grad()
def evaluate(fwd: Any, corpus: data.CharCorpus, args: argparse.Namespace, device: Any) -> float:
    """Validation loss (nats per character) over ``--eval-iters`` batches per rank, averaged
    over ranks; ``decentralized`` and ``ddp-gossip-hook`` evaluate the average of the replicas."""
    g = torch.Generator().manual_seed(args.seed + dist.get_rank())
    averaged = fwd.averaged() if isinstance(fwd, DecentralizedDataParallel) else None
    if args.strategy == "ddp-gossip-hook":
        averaged = replicas_averaged(fwd.module)
    with averaged or contextlib.nullcontext(fwd):
        net = fwd.module if hasattr(fwd, "module") else fwd
        net.eval()
        losses = []
        for _ in range(args.eval_iters):
            x, y = corpus.batch(args.batch_size, args.block_size, g, split="val")
            logits = net(x.to(device))
            losses.append(F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten()))
        net.train()
    total = torch.stack(losses).mean().reshape(1)
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def main(argv: list[str] | None = None) -> None:
    """Train with the command line ``argv``. Under torchrun it initialises (and at the end
    destroys) the default process group; a caller that initialised one already (a notebook, a
    test running several configurations) keeps it."""
    args = parse_args(argv)
    cuda = args.device.startswith("cuda")
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout)
        )
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:  # the cores shared by the ranks on this machine (every node of a virtual cluster)
        launch.set_threads(launch.local_world_size())
    master = rank == 0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.comm_log:
        observe.log(1_000_000)

    corpus = data.CharCorpus.from_name("pydoc")
    torch.manual_seed(args.seed)
    model = models.CharTransformer(
        corpus.vocab_size, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout
    ).to(device)

    start, ckpt, hook = 0, None, None
    if args.resume:
        try:
            ckpt, hook = load_resume(args, rank, device)  # every rank at one step, or exit
        except SystemExit:
            if owns_group:
                dist.destroy_process_group()
            raise
        model.load_state_dict(ckpt["model"])
        start = ckpt["step"]
    fwd, opt, pipe = wrap(model, args)
    if ckpt is not None:
        opt.load_state_dict(ckpt["optimizer"])
        if pipe is not None:  # continues as the uninterrupted run (no pipeline refill)
            pipe.load_state_dict(hook)
    if master:
        n = models.count_parameters(model)
        print(f"{args.strategy}: {n} parameters, {world} ranks, steps {start}..{args.max_iters}")
    if master:
        start_log(args, start)

    step_ms = []
    observe.reset()
    prof = make_profiler(args, args.max_iters - start, cuda, rank)
    if prof is not None:
        prof.start()
    for step in range(start, args.max_iters):
        t0 = time.perf_counter()
        lr = get_lr(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        batches = get_batch(corpus, args, step, rank, device)
        loss_sum = 0.0
        for micro, (x, y) in enumerate(batches):
            last = micro == len(batches) - 1
            # accumulate without communication except in the last micro-batch (PipeSGD
            # communicates only in step(), so gradients simply add up)
            sync = last or args.strategy == "pipesgd"
            with contextlib.nullcontext() if sync else fwd.no_sync():
                logits = fwd(x)
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten()) / len(batches)
                loss.backward()  # decentralized: mixes, clips and steps in the last one
            loss_sum += loss.item()
        if args.strategy == "pipesgd":
            opt.step()  # launches this gradient's average, applies (clipped) the one k steps ago
        elif args.strategy != "decentralized":
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            if not getattr(pipe, "filling", False):  # Pipe-SGD: w_{t+1} = w_t while filling
                opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) * 1e3
        step_ms.append(dt)
        if master:
            print(f"step {step:5d} | loss {loss_sum:.4f} | lr {lr:.2e} | {dt:7.1f} ms")
            log(args, step=step, loss=loss_sum, lr=lr, dt_ms=dt)
        if prof is not None:
            prof.step()
        if args.ckpt_interval and (step + 1) % args.ckpt_interval == 0:
            save_checkpoint(model, opt, pipe, step + 1, args, rank)
    if prof is not None:
        prof.stop()

    save_checkpoint(model, opt, pipe, args.max_iters, args, rank)
    if isinstance(pipe, hooks.PipelinedState):
        pipe.wait()  # the hook's averages still in flight (not applied)
    comm = observe.counters()  # before evaluation's own collectives
    if args.comm_log:
        write_comm_log(args.comm_log, master)
    if args.eval_iters > 0:
        val = evaluate(fwd, corpus, args, device)
        if master:
            print(f"val loss {val:.4f}")
            log(args, val_loss=val)
    if master:
        timed = step_ms[2:] or step_ms  # leave out the first steps (allocation, bucket rebuild)
        if timed:
            med = statistics.median(timed)
            print(f"median step {med:.1f} ms over {len(timed)} steps")
            log(args, median_step_ms=med, steps_timed=len(timed))
        log(args, comm=comm)
    if isinstance(fwd, DecentralizedDataParallel):
        fwd.close()
    if owns_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
