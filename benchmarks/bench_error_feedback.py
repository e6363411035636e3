"""Error feedback on examples/train_gpt.py: int8 with and without it against uncompressed.

One torchrun job (``--world`` CPU ranks, gloo) runs ``examples/train_gpt.py``'s ``main`` for every
seed, strategy and configuration on one process group: uncompressed, ``--compression int8``,
``--compression int8 --error-feedback`` and ``--compression fp16`` (its error is about 30 times
smaller than int8's: how far a run drifts from a tiny perturbation alone). Then, per strategy and configuration, it prints the mean
(and range) over seeds of the final training loss (mean of the last 10 steps), the validation
loss, and the distance of the final parameters to the uncompressed run of the same seed:
``max |w - w_ref|`` and ``||w - w_ref|| / ||w_ref||`` (2-norms over all parameters).

``--drift`` instead measures, in one process and without training, what error feedback is for:
the sum of T compressed messages of one rank against the sum of its T gradients (Karimireddy et
al., ICML 2019: with error feedback they differ by the last residual alone, without it the
errors add up). The gradients are ``g_t = s * (1 + 0.5 z_t)`` with a fixed per-element scale
``s`` log-normal over two decades (so an int8 chunk holds elements far below its step) and
``z_t`` standard normal; it prints ``||sum_t D(C(x_t)) - sum_t g_t|| / ||sum_t g_t||`` at T = 1,
10, 100, 1000.

Usage::

    .venv/bin/python benchmarks/bench_error_feedback.py --out /tmp/ef --seeds 1 2 3
    .venv/bin/python benchmarks/bench_error_feedback.py --strategies pipesgd --max-iters 300
    .venv/bin/python benchmarks/bench_error_feedback.py --drift
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
CONFIGS = {
    "none": [],
    "int8": ["--compression", "int8"],
    "int8+ef": ["--compression", "int8", "--error-feedback"],
    "fp16": ["--compression", "fp16"],  # a far smaller perturbation: the chaos floor
}


def drive(spec: dict) -> None:
    """Run on every rank under torchrun: every (seed, strategy, config) on one process group."""
    import torch.distributed as dist

    load = importlib.util.spec_from_file_location("train_gpt", SCRIPT)
    train = importlib.util.module_from_spec(load)
    load.loader.exec_module(train)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    for seed in spec["seeds"]:
        for strategy in spec["strategies"]:
            for name, extra in CONFIGS.items():
                out = Path(spec["out"]) / f"{strategy}-{name}-s{seed}"
                train.main(["--strategy", strategy, "--seed", str(seed), "--max-iters",
                            str(spec["max_iters"]), "--algorithm", spec["algorithm"],
                            "--out", str(out), *extra])  # fmt: skip
    dist.destroy_process_group()


def params(out: Path) -> torch.Tensor:
    name = "ckpt.pt" if (out / "ckpt.pt").exists() else "ckpt_rank0.pt"
    sd = torch.load(out / name, weights_only=True)["model"]  # tensors and plain containers
    return torch.cat([v.reshape(-1).double() for v in sd.values() if v.is_floating_point()])


def summary(out: Path, seeds: list[int], strategies: list[str]) -> list[dict]:
    rows = []
    for strategy in strategies:
        for name in CONFIGS:
            per_seed = []
            for seed in seeds:
                run = out / f"{strategy}-{name}-s{seed}"
                lines = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines()]
                losses = [r["loss"] for r in lines if "step" in r]
                val = next(r["val_loss"] for r in lines if "val_loss" in r)
                w, ref = params(run), params(out / f"{strategy}-none-s{seed}")
                per_seed.append(dict(train=statistics.fmean(losses[-10:]), val=val,
                                     max_abs=float((w - ref).abs().max()),
                                     rel_l2=float((w - ref).norm() / ref.norm())))  # fmt: skip
            row = {"strategy": strategy, "config": name, "seeds": seeds}
            for key in ("train", "val", "max_abs", "rel_l2"):
                vals = [s[key] for s in per_seed]
                row[key] = statistics.fmean(vals)
                row[key + "_range"] = (min(vals), max(vals))
            rows.append(row)
    return rows


def drift(n: int = 65_536, steps: tuple[int, ...] = (1, 10, 100, 1000)) -> None:
    """Print the relative error of the summed messages with and without error feedback."""
    from pipecomm import compress

    g = torch.Generator().manual_seed(0)
    scale = torch.exp(torch.randn(n, generator=g) * 1.15)  # about two decades
    print("| codec | T | without error feedback | with error feedback |")
    print("|---|---|---|---|")
    for name in ("int8", "fp16"):
        codec = compress.get_codec(name)
        residual = None
        sums = {"g": torch.zeros(n, dtype=torch.float64), "plain": None, "ef": None}
        sums["plain"], sums["ef"] = sums["g"].clone(), sums["g"].clone()
        for t in range(1, max(steps) + 1):
            grad = scale * (1 + 0.5 * torch.randn(n, generator=g))
            plain = codec.decode(codec.encode(grad), n, grad.dtype)
            x, residual = compress.error_feedback(grad.clone(), residual, codec)
            sent = codec.decode(codec.encode(x), n, x.dtype)
            sums["g"] += grad.double()
            sums["plain"] += plain.double()
            sums["ef"] += sent.double()
            if t in steps:
                ref = sums["g"].norm()
                a = (sums["plain"] - sums["g"]).norm() / ref
                b = (sums["ef"] - sums["g"]).norm() / ref
                print(f"| {name} | {t} | {a:.2e} | {b:.2e} |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out-bench-ef")
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--strategies", nargs="+", default=["ddp-pipecomm", "pipesgd"])
    p.add_argument("--algorithm", default="lp")
    p.add_argument("--max-iters", type=int, default=300)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--summary-only", action="store_true", help="read an earlier --out")
    p.add_argument("--drift", action="store_true", help="the summed-message error, no training")
    args = p.parse_args(argv)
    if args.drift:
        drift()
        return
    out = Path(args.out).resolve()
    if not args.summary_only:
        out.mkdir(parents=True, exist_ok=True)
        spec = dict(out=str(out), seeds=args.seeds, strategies=args.strategies,
                    max_iters=args.max_iters, algorithm=args.algorithm)  # fmt: skip
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.world), __file__, "--drive", json.dumps(spec)]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    rows = summary(out, args.seeds, args.strategies)
    print("| strategy | compression | final train loss | val loss | max abs dw | rel L2 dw |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = [f"{r[k]:.4f} [{r[k + '_range'][0]:.4f}, {r[k + '_range'][1]:.4f}]"
                 for k in ("train", "val")]  # fmt: skip
        cells += [f"{r[k]:.2e} [{r[k + '_range'][0]:.2e}, {r[k + '_range'][1]:.2e}]"
                  for k in ("max_abs", "rel_l2")]  # fmt: skip
        print(f"| {r['strategy']} | {r['config']} | " + " | ".join(cells) + " |")
    (out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--drive":
        drive(json.loads(sys.argv[2]))
    else:
        main()
