"""The figures a user looks at first: pipecomm against the backend's built-in on a shaped network.

Reads the CSVs that ``bench_collectives.py --cluster`` and ``bench_training.py`` write (one
measured run each; nothing here is a model except the link limit, drawn as a dashed line and
labelled as such) and writes two PNGs:

* ``collectives.png``: time per call against message size, one panel per (op, p), one line per
  algorithm with its 95% interval, the built-in as ``torch``, and the link limit
  (:func:`pipecomm.lab.measure.bench.link_limit_s`, CSV ``link_s``). A CSV with one size per panel gives
  bars instead of lines.
* ``training.png``: time per training step per strategy (median over seeds of each run's median
  step, with its bootstrap 95% interval), stock DDP over gloo first, each bar labelled with its
  ratio to stock DDP and the bytes each rank sent per step.

    .venv/bin/python benchmarks/plot_shaped.py \\
        --collectives artifact/reference/shaped-bench/collectives_sweep_15M.csv \\
        --training artifact/reference/shaped-bench/training_15M.csv --out artifact/reference/shaped-bench
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from pipecomm.lab import results  # noqa: E402
from pipecomm.lab.training import shaped_training

ORDER = ("torch", "lp", "ring", "mst", "be")


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if not r.get("error")]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:g} MiB"


def collectives_figure(path: Path, out: Path, network: str) -> Path:
    """Time against message size per algorithm, with the link limit; one panel per (op, p)."""
    rows = [r for r in _rows(path) if r["algorithm"].split("/")[0] in ORDER
            and not r["algorithm"].endswith("-aa")]
    panels = sorted({(r["op"], int(r["p"])) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (op, p) in zip(axes[0], panels):
        mine = [r for r in rows if r["op"] == op and int(r["p"]) == p]
        sizes = sorted({int(r["nbytes"]) for r in mine})
        algs = [a for a in ORDER if any(r["algorithm"] == a for r in mine)]
        if len(sizes) == 1:  # one size: bars with their intervals, the link limit as a line
            t = {r["algorithm"]: r for r in mine}
            x = range(len(algs))
            mid = [float(t[a]["time_s"]) for a in algs]
            err = [[m - float(t[a]["ci_lo_s"]) for a, m in zip(algs, mid)],
                   [float(t[a]["ci_hi_s"]) - m for a, m in zip(algs, mid)]]
            ax.bar(x, mid, yerr=err, capsize=3,
                   color=["0.55" if a == "torch" else f"C{i}" for i, a in enumerate(algs)])
            ax.set_xticks(list(x), ["built-in" if a == "torch" else a for a in algs])
            limit = float(mine[0].get("link_s") or "nan")
            ax.axhline(limit, ls="--", color="k", lw=1, label="link limit (model)")
            for i, (a, m) in enumerate(zip(algs, mid)):
                if a != "torch":
                    ax.annotate(f"{m / float(t['torch']['time_s']):.2f}x", (i, m), ha="center",
                                va="bottom", fontsize=8)
            ax.set_title(f"{op}, p = {p}, {_mib(sizes[0])}", fontsize=9)
        else:
            for i, a in enumerate(algs):
                pts = sorted((int(r["nbytes"]), r) for r in mine if r["algorithm"] == a)
                xs = [n / 2**20 for n, _ in pts]
                ax.plot(xs, [float(r["time_s"]) for _, r in pts], marker="o",
                        color="0.55" if a == "torch" else f"C{i}",
                        label="built-in" if a == "torch" else a)
                ax.fill_between(xs, [float(r["ci_lo_s"]) for _, r in pts],
                                [float(r["ci_hi_s"]) for _, r in pts], alpha=0.2,
                                color="0.55" if a == "torch" else f"C{i}")
            lim = sorted({(int(r["nbytes"]), float(r["link_s"])) for r in mine
                          if r.get("link_s")})
            ax.plot([n / 2**20 for n, _ in lim], [s for _, s in lim], "k--", lw=1,
                    label="link limit (model)")
            ax.set(xscale="log", yscale="log", xlabel="message (MiB)")
            ax.set_title(f"{op}, p = {p}", fontsize=9)
        ax.set_ylabel("seconds per call")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"pipecomm vs the built-in collectives (gloo): {network}", fontsize=10)
    fig.tight_layout()
    target = out / "collectives.png"
    with results.atomic_path(target) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return target


def training_figure(path: Path, out: Path, network: str) -> Path:
    """Time per training step per strategy, with the interval over seeds and the ratio to
    stock DDP."""
    rows = pd.read_csv(path, keep_default_na=False, na_values=[""])
    if "ddp" not in set(rows.get("strategy", ())):
        raise ValueError(f"{path}: no stock DDP rows (strategy 'ddp') to compare with")
    missing = {"seed", "step_ms", "loss", "val_loss", "tx_bytes_per_rank_step"} - set(rows)
    if missing:
        raise ValueError(f"{path}: not a bench_training.py CSV (no {sorted(missing)})")
    t = shaped_training.step_table(rows)
    t = pd.concat([t[t.strategy == "ddp"], t[t.strategy != "ddp"]], ignore_index=True)
    names = t.strategy.tolist()
    mids, los, his = t.step_ms.tolist(), (t.step_ms - t.step_lo).tolist(), \
        (t.step_hi - t.step_ms).tolist()
    labels = [f"sent {r.MB_per_rank_step:.1f} MB per rank per step" if r.strategy == "ddp" else
              f"{r.ratio:.2f}x stock DDP, sent {r.MB_per_rank_step:.1f} MB per rank per step"
              for r in t.itertuples()]  # ratios paired by seed (step_table)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    y = range(len(names))
    ax.barh(y, mids, xerr=[los, his], capsize=3,
            color=["0.55" if shaped_training.is_stock(s) else "C0" for s in names])
    ax.set_yticks(list(y), ["stock DDP (gloo)" if s == "ddp" else
                            "stock DDP + torch's fp16 hook" if s == "ddp+fp16" else s
                            for s in names])
    ax.invert_yaxis()
    for i, (m, h, text) in enumerate(zip(mids, his, labels)):
        ax.annotate(text, (m + h, i), xytext=(5, 0), textcoords="offset points", va="center",
                    fontsize=8)
    seeds = int(t.seeds.max())
    ax.set_xlabel(f"ms per training step (median over {seeds} seeds, 95% interval)")
    ax.set_title(f"GPT training step (examples/train_gpt.py)\n{network}", fontsize=9)
    ax.set_xlim(0, max(m + h for m, h in zip(mids, his)) * 1.6)
    fig.tight_layout()
    target = out / "training.png"
    with results.atomic_path(target) as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
    return target


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--collectives", type=Path, default=None, metavar="CSV")
    ap.add_argument("--training", type=Path, default=None, metavar="CSV")
    ap.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    ap.add_argument("--network", default="single-port nodes (one rank each), Linux tc tbf "
                    "15 MB/s each way, network namespaces on one 2-core host",
                    help="what the runs were measured on (the figures' titles)")
    args = ap.parse_args(argv)
    if args.collectives is None and args.training is None:
        ap.error("give --collectives CSV and/or --training CSV")
    for given in (args.collectives, args.training):
        if given is not None and not given.is_file():
            ap.error(f"{given}: no such file")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        if args.collectives is not None:
            print(f"wrote {collectives_figure(args.collectives, args.out, args.network)}")
        if args.training is not None:
            print(f"wrote {training_figure(args.training, args.out, args.network)}")
    except ValueError as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
