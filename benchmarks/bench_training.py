"""Whole training steps on a real, bandwidth-limited network: stock DDP over gloo against
pipecomm's strategies, same model, data and seeds.

Each run is ``examples/train_gpt.py`` (a nanoGPT-style GPT on pydoc text) under one torchrun
agent per node of a virtual cluster (:class:`pipecomm.lab.cluster.VirtualCluster`: one network
namespace per node, every node link shaped to ``--cluster`` bytes/s each way by tc tbf; root
only; everything is removed afterwards). A strategy is ``NAME[:ALGORITHM][+CODEC]``:

* ``ddp``: torch's DistributedDataParallel on gloo (the baseline);
* ``ddp-pipecomm:ring``, ``ddp-pipecomm:lp+fp16``: the same DDP over pipecomm's process group;
* ``ddp-pipelined-hook:ring``: Pipe-SGD inside stock DDP (the average of one step ago);
* ``pipesgd:ring``: PipeSGD wrapping AdamW;
* ``decentralized``: DecentralizedDataParallel (one-peer-exp gossip).

Per run (one strategy, one seed): rank 0's median step time over the steps after
``--warmup-steps`` (the run's unit: the seeds are the independent repeats), the loss of the last
step and the validation loss, and the bytes each rank sent per step (the node interfaces' tx
counters over the whole run, rendezvous and evaluation included, divided by the ranks of the
node and the steps). Seeds run in rounds, every strategy once per round, the order rotated from
round to round. A run that fails is a row with its ``error`` (the end of the failing node's
output) and the sweep goes on; the CSV is rewritten after every run, so an interrupted sweep
keeps what finished, and ``--resume`` skips the (strategy, seed) runs already in it. ``--summary CSV`` prints, per strategy, the median step time over seeds with its
bootstrap 95% interval, its ratio to ``ddp`` (paired by seed), the bytes per step and the final
losses.

Usage (as root, on a quiet machine)::

    .venv/bin/python benchmarks/bench_training.py --cluster 15M --nodes 4 --seeds 0 1 2 \\
        --csv artifact/reference/shaped-bench/training_15M.csv
    .venv/bin/python benchmarks/bench_training.py --summary artifact/reference/shaped-bench/training_15M.csv
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipecomm.lab import cluster, results, stats, sweep

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
DEFAULT_STRATEGIES = ("ddp", "ddp-pipecomm:ring", "ddp-pipecomm:lp", "ddp-pipecomm:ring+fp16",
                      "ddp-pipecomm:ring+int8", "ddp-pipelined-hook:ring", "pipesgd:ring",
                      "decentralized")
COLUMNS = ("strategy", "seed", "nodes", "ranks_per_node", "bandwidth_Bps", "steps", "step_ms",
           "step_times_ms", "loss", "val_loss", "tx_bytes_per_rank_step", "error")


def strategy_args(spec: str) -> list[str]:
    """``train_gpt.py`` arguments of a strategy ``NAME[:ALGORITHM][+CODEC]``.

    Example::

        strategy_args("ddp-pipecomm:ring+fp16")
        # ['--strategy', 'ddp-pipecomm', '--algorithm', 'ring', '--compression', 'fp16']
    """
    head, _, codec = spec.partition("+")
    name, _, algorithm = head.partition(":")
    out = ["--strategy", name]
    if algorithm:
        out += ["--algorithm", algorithm]
    if codec:
        out += ["--compression", codec]
    return out


def _tx_bytes(net: Any) -> list[int]:
    """Bytes each node's interface has sent so far."""
    out = []
    for i in range(net.nodes):
        text = subprocess.run(net.exec_argv(i, ["cat", f"/sys/class/net/{cluster.IFNAME}/"
                                                   "statistics/tx_bytes"]),
                              capture_output=True, text=True, timeout=20, check=True).stdout
        out.append(int(text.strip()))
    return out


def run_once(net: Any, spec: str, seed: int, args: argparse.Namespace) -> dict:
    """One training run of ``spec`` at ``seed`` on the cluster; its row."""
    with tempfile.TemporaryDirectory(prefix="train") as out:
        before = _tx_bytes(net)
        argv = [str(SCRIPT), *strategy_args(spec), "--seed", str(seed), "--out", out,
                "--max-iters", str(args.steps), "--n-layer", str(args.n_layer),
                "--n-embd", str(args.n_embd), "--batch-size", str(args.batch_size),
                "--block-size", str(args.block_size), "--eval-iters", "2",
                "--timeout", str(args.timeout_s)]
        net.torchrun(argv, timeout_s=args.timeout_s, cwd=str(ROOT))
        sent = [b - a for a, b in zip(before, _tx_bytes(net))]
        log = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
    steps = [r for r in log if "dt_ms" in r]
    timed = [r["dt_ms"] for r in steps[args.warmup_steps:]]
    val = [r["val_loss"] for r in log if "val_loss" in r]
    return {"strategy": spec, "seed": seed, "nodes": net.nodes,
            "ranks_per_node": net.ranks_per_node, "bandwidth_Bps": net.bandwidth_Bps,
            "steps": len(steps), "step_ms": statistics.median(timed),
            "step_times_ms": ";".join(f"{t:.2f}" for t in timed), "loss": steps[-1]["loss"],
            "val_loss": val[-1] if val else float("nan"),
            "tx_bytes_per_rank_step": statistics.mean(sent) / net.ranks_per_node / len(steps)}


def summary(csv_path: Path) -> str:
    """The markdown table of a CSV this script wrote: per strategy, the median over seeds of the
    runs' median step time with its bootstrap 95% interval, the ratio to ``ddp`` (median of the
    per-seed ratios, bootstrap interval over seeds), bytes sent per rank per step, and the mean
    final training and validation losses with their spread over seeds.

    Example::

        print(summary(Path("artifact/reference/shaped-bench/training_15M.csv")))
    """
    with csv_path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{csv_path}: no rows")
    failed = [r for r in rows if r.get("error")]
    rows = [r for r in rows if not r.get("error")]
    by: dict[str, dict[int, dict]] = {}
    for r in rows:
        by.setdefault(r["strategy"], {})[int(r["seed"])] = r
    base = by.get("ddp", {})
    out = ["| strategy | step (ms), median over seeds [95%] | vs stock DDP [95%] | "
           "sent per rank per step (MB) | loss (mean, spread) | val loss |",
           "|---|---|---|---|---|---|"]
    for spec, runs in by.items():
        ms = [float(runs[s]["step_ms"]) for s in sorted(runs)]
        mid, lo, hi = stats.median_ci(ms) if len(ms) > 1 else (ms[0], ms[0], ms[0])
        common = [s for s in sorted(runs) if s in base]
        ratio = ""
        if spec != "ddp" and common:
            r, rlo, rhi = stats.paired_ratio_ci([float(runs[s]["step_ms"]) for s in common],
                                                [float(base[s]["step_ms"]) for s in common])
            ratio = f"{r:.2f}x [{rlo:.2f}, {rhi:.2f}]"
        loss = [float(runs[s]["loss"]) for s in sorted(runs)]
        val = [float(runs[s]["val_loss"]) for s in sorted(runs)]
        sent = statistics.mean(float(runs[s]["tx_bytes_per_rank_step"]) for s in runs) / 1e6
        out.append(f"| {spec} | {mid:.0f} [{lo:.0f}, {hi:.0f}] | {ratio} | {sent:.2f} | "
                   f"{statistics.mean(loss):.4f} ({max(loss) - min(loss):.4f}) | "
                   f"{statistics.mean(val):.4f} |")
    out += [f"\nfailed: {r['strategy']} seed {r['seed']}: {r['error'][-200:]}" for r in failed]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", type=float, default=15e6, metavar="RATE",
                    help="node link rate, bytes/s each way (default 15e6)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--strategies", nargs="+", default=list(DEFAULT_STRATEGIES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup-steps", type=int, default=5)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per run")
    ap.add_argument("--csv", type=Path, default=None)
    ap.add_argument("--resume", action="store_true",
                    help="keep the rows of --csv and run only the (strategy, seed) not in it")
    ap.add_argument("--summary", type=Path, default=None, metavar="CSV",
                    help="print the table of a CSV and exit")
    args = ap.parse_args(argv)
    if args.summary is not None:
        try:
            print(summary(args.summary))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--summary: {exc}")
        return 0
    for spec in args.strategies:
        name = strategy_args(spec)[1]
        if name not in ("ddp", "ddp-pipecomm", "ddp-pipelined-hook", "pipesgd", "decentralized"):
            ap.error(f"--strategies: unknown strategy {spec!r} (NAME[:ALGORITHM][+CODEC])")
    if args.steps <= args.warmup_steps or args.warmup_steps < 0:
        ap.error("--steps must exceed --warmup-steps >= 0")
    if args.nodes < 2 or args.ranks_per_node < 1 or not args.cluster > 0:
        ap.error("--nodes >= 2, --ranks-per-node >= 1 and a positive --cluster rate")
    ok, why = cluster.available()
    if not ok:
        ap.error(f"a virtual cluster is not available here: {why}")
    if args.resume and args.csv is None:
        ap.error("--resume needs --csv")
    rows: list[dict] = []
    if args.resume and args.csv.exists():
        with args.csv.open(newline="") as f:
            rows = [r for r in csv.DictReader(f) if not r.get("error")]
    done = {(r["strategy"], int(r["seed"])) for r in rows}
    net = cluster.VirtualCluster(args.nodes, args.ranks_per_node, args.cluster,
                                 timeout_s=args.timeout_s)
    print(f"# {net.describe()}; {len(args.strategies)} strategies x {len(args.seeds)} seeds",
          flush=True)
    with net:
        for i, seed in enumerate(args.seeds):
            for spec in sweep.rotated(args.strategies, i):
                if (spec, seed) in done:
                    continue
                try:
                    row = run_once(net, spec, seed, args)
                except (cluster.ClusterError, TimeoutError) as exc:
                    row = {"strategy": spec, "seed": seed, "error": " ".join(str(exc).split())}
                    print(f"{spec:>26} seed {seed}: FAILED: {row['error'][-300:]}", flush=True)
                else:
                    print(f"{spec:>26} seed {seed}: {row['step_ms']:8.1f} ms/step, loss "
                          f"{row['loss']:.4f}, val {row['val_loss']:.4f}, sent "
                          f"{row['tx_bytes_per_rank_step'] / 1e6:.2f} MB/rank/step", flush=True)
                rows.append(row)
                if args.csv is not None:
                    _write(args.csv, rows)
    if args.csv is not None:
        print(f"# wrote {len(rows)} rows to {args.csv}")
        print(summary(args.csv))
    return 0 if not any(r.get("error") for r in rows) else 1


def _write(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV at ``path``, atomically (:func:`pipecomm.lab.results.atomic_path`)."""
    with results.atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, restval="")
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
