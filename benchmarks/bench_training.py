"""Whole training steps on a real, bandwidth-limited network: stock DDP over gloo against
pipecomm's strategies, same model, data and seeds.

Each run is ``examples/train_gpt.py`` (a nanoGPT-style GPT on pydoc text) under one torchrun
agent per node of a virtual cluster (:class:`pipecomm.lab.networks.cluster.VirtualCluster`: one network
namespace per node, every node link shaped to ``--cluster`` bytes/s each way by tc tbf; root
only; everything is removed afterwards). A strategy is ``NAME[:ALGORITHM][+CODEC]``:

* ``ddp``: torch's DistributedDataParallel on gloo (the baseline); ``ddp+fp16``: with torch's
  own ``fp16_compress_hook``;
* ``ddp-pipecomm:ring``, ``ddp-pipecomm:lp+fp16``: the same DDP over pipecomm's process group;
* ``ddp-pipelined-hook:ring``: Pipe-SGD inside stock DDP (the average of one step ago);
* ``pipesgd:ring``: PipeSGD wrapping AdamW;
* ``decentralized``: DecentralizedDataParallel (one-peer-exp gossip);
* ``ddp-gossip-hook``: the same rule inside stock DDP (``pipecomm.hooks.gossip_hook``).

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
import sys
from pathlib import Path

import pandas as pd

from pipecomm.lab import results
from pipecomm.lab.networks import cluster
from pipecomm.lab.training import shaped_training

DEFAULT_STRATEGIES = ("ddp", "ddp+fp16", "ddp-pipecomm:ring", "ddp-pipecomm:lp", "ddp-pipecomm:ring+fp16",
                      "ddp-pipecomm:ring+int8", "ddp-pipelined-hook:ring", "pipesgd:ring",
                      "decentralized", "ddp-gossip-hook")
COLUMNS = shaped_training.COLUMNS


def summary(csv_path: Path) -> str:
    """The markdown table of a CSV this script wrote
    (:func:`pipecomm.lab.training.shaped_training.step_table`): per strategy, the median over seeds of the
    runs' median step time with its bootstrap 95% interval, the ratio to ``ddp`` (median of the
    per-seed ratios, bootstrap interval over seeds), MB sent per rank per step and the final
    training and validation losses (mean, spread over seeds); failed runs below.

    Example::

        print(summary(Path("artifact/reference/shaped-bench/training_15M.csv")))
    """
    rows = pd.read_csv(csv_path, keep_default_na=False, na_values=[""])
    if rows.empty:
        raise ValueError(f"{csv_path}: no rows")
    # an all-empty column reads as float64 NaN: as text, so that "" fills it
    rows["error"] = rows.get("error", pd.Series(dtype=object)).astype(object).fillna("")
    out = ["| strategy | step (ms), median over seeds [95%] | vs stock DDP [95%] | "
           "sent per rank per step (MB) | loss (mean, spread) | val loss |",
           "|---|---|---|---|---|---|"]
    for r in shaped_training.step_table(rows).itertuples():
        ratio = "" if r.strategy == "ddp" or r.ratio != r.ratio else \
            f"{r.ratio:.2f}x [{r.ratio_lo:.2f}, {r.ratio_hi:.2f}]"
        out.append(f"| {r.strategy} | {r.step_ms:.0f} [{r.step_lo:.0f}, {r.step_hi:.0f}] | "
                   f"{ratio} | {r.MB_per_rank_step:.2f} | {r.loss:.4f} ({r.loss_spread:.4f}) | "
                   f"{r.val_loss:.4f} |")
    failed = rows[rows.error.ne("")]
    out += [f"\nfailed: {r.strategy} seed {r.seed}: {r.error[-200:]}" for r in failed.itertuples()]
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
        try:
            shaped_training.check_strategy(spec)
        except ValueError as exc:
            ap.error(f"--strategies: {exc}")
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
    config = {"steps": args.steps, "warmup_steps": args.warmup_steps, "n_layer": args.n_layer,
              "n_embd": args.n_embd, "batch_size": args.batch_size,
              "block_size": args.block_size, "timeout_s": args.timeout_s}

    def on_row(row: dict) -> None:
        if row.get("error"):
            print(f"{row['strategy']:>26} seed {row['seed']}: FAILED: {row['error'][-300:]}",
                  flush=True)
        else:
            print(f"{row['strategy']:>26} seed {row['seed']}: {row['step_ms']:8.1f} ms/step, loss "
                  f"{row['loss']:.4f}, val {row['val_loss']:.4f}, sent "
                  f"{row['tx_bytes_per_rank_step'] / 1e6:.2f} MB/rank/step", flush=True)
        rows.append(row)
        if args.csv is not None:
            _write(args.csv, rows)

    with net:
        shaped_training.run_rounds(net, args.strategies, args.seeds, config, done, on_row)
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
