"""Overhead benchmarks of :class:`pipecomm.pipesgd.PipeSGD` (run on a quiet machine).

1. World size 1, in this process (no torch.distributed): PipeSGD (``"pipe"`` with k = 1,
   ``"sync"``, and ``"pipe"`` with ``timing=True``) against a plain hand-written loop
   ``opt.zero_grad(); loss.backward(); opt.step()`` on the same model and data: the framework's
   own overhead (at p = 1 nothing is communicated). Target: ratio <= 1.05.
2. World size 2 (gloo, local ranks): ``"layerwise"`` PipeSGD against
   ``torch.nn.parallel.DistributedDataParallel`` on the same model with the same bucket size.
   Target: ratio <= 1.10. ``"sync"`` and ``"pipe"`` are printed for information.

Each measurement: warm-up iterations, then ``--repeats`` repeats of ``--iters`` iterations; the
variants alternate within every repeat (so drifts of the machine hit all of them), a repeat's time
is the mean per-iteration time (at p = 2 the maximum over ranks), and the reported value is the
median over repeats; a ratio is the median of the per-repeat ratios, with the percentile-bootstrap
95% interval of that median (:func:`pipecomm.lab.measure.stats.median_ci`).

On a shared, busy machine ``--cpu-time`` measures p = 1 in CPU seconds of this process with one
torch thread (other processes then barely change the result).

Usage::

    .venv/bin/python benchmarks/bench_pipesgd.py                 # the real measurement
    .venv/bin/python benchmarks/bench_pipesgd.py --quick         # seconds: checks that it runs
    .venv/bin/python benchmarks/bench_pipesgd.py --algorithm lp  # layer-wise over pipecomm's LP
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch import nn

from pipecomm.lab.measure import stats
from pipecomm.lab.networks import launch
from pipecomm.pipesgd import PipeSGD


def make_model(cfg: dict) -> nn.Module:
    torch.manual_seed(0)
    widths = [cfg["in_features"], *cfg["hidden"]]
    layers: list[nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], cfg["classes"]))
    return nn.Sequential(*layers)


def make_data(cfg: dict, rank: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234 + rank)
    return [
        (
            torch.randn(cfg["batch"], cfg["in_features"], generator=g),
            torch.randint(0, cfg["classes"], (cfg["batch"],), generator=g),
        )
        for _ in range(8)
    ]


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _plain_iteration(model, opt, x, y) -> None:
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def _pipesgd_iteration(model, trainer, x, y) -> None:
    trainer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    trainer.step()


_CLOCK = time.perf_counter  # --cpu-time: time.process_time


def _timed(fn, data, iters: int, barrier=None) -> float:
    """Mean seconds per iteration of ``iters`` calls of ``fn(x, y)``."""
    if barrier is not None:
        barrier()
    start = _CLOCK()
    for i in range(iters):
        x, y = data[i % len(data)]
        fn(x, y)
    return (_CLOCK() - start) / iters


def _summarise(times: dict[str, list[float]], base: str) -> dict[str, dict[str, float]]:
    out = {}
    for name, ts in times.items():
        ratio, lo, hi = stats.median_ci([t / b for t, b in zip(ts, times[base])])
        out[name] = {
            "median_s": statistics.median(ts),
            "ratio": ratio,
            "ratio_lo": lo,
            "ratio_hi": hi,
            "repeats": len(ts),
        }
    return out


# --------------------------------------------------------------------------- world size 1


def bench_local(cfg: dict) -> dict[str, dict[str, float]]:
    """PipeSGD at world size 1 against the plain loop (this process, no torch.distributed)."""
    data = make_data(cfg)
    plain_model = make_model(cfg)
    plain_opt = make_optimizer(plain_model)
    variants = {"plain": lambda x, y: _plain_iteration(plain_model, plain_opt, x, y)}
    for name, mode, timing in (
        ("pipe", "pipe", False),
        ("sync", "sync", False),
        ("pipe+timing", "pipe", True),
    ):
        model = make_model(cfg)
        trainer = PipeSGD(model, make_optimizer(model), mode=mode, timing=timing)
        variants[name] = lambda x, y, m=model, t=trainer: _pipesgd_iteration(m, t, x, y)
    for fn in variants.values():
        _timed(fn, data, cfg["warmup"])
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cfg["repeats"]):
        for name, fn in variants.items():
            times[name].append(_timed(fn, data, cfg["iters"]))
    return _summarise(times, "plain")


# --------------------------------------------------------------------------- world size 2


def _ddp_rank(cfg: dict) -> dict[str, list[float]]:
    """On every rank: DDP vs PipeSGD (layer-wise, sync, pipe); per-repeat times, max over ranks."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    data = make_data(cfg, rank)
    ddp_model = make_model(cfg)
    ddp = DDP(ddp_model, bucket_cap_mb=cfg["bucket_mb"])
    ddp_opt = make_optimizer(ddp)
    variants = {"ddp": lambda x, y: _plain_iteration(ddp, ddp_opt, x, y)}
    trainers = []
    for mode in ("layerwise", "sync", "pipe"):
        model = make_model(cfg)
        trainer = PipeSGD(
            model,
            make_optimizer(model),
            mode=mode,
            algorithm=cfg["algorithm"],
            bucket_mb=cfg["bucket_mb"],
        )
        trainers.append(trainer)
        variants[mode] = lambda x, y, m=model, t=trainer: _pipesgd_iteration(m, t, x, y)
    for fn in variants.values():
        _timed(fn, data, cfg["warmup"], dist.barrier)
    for trainer in trainers:
        trainer.finish()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(cfg["repeats"]):
        for name, fn in variants.items():
            times[name].append(_timed(fn, data, cfg["iters"], dist.barrier))
            if name == "pipe":
                trainers[-1].finish()  # nothing in flight while the next variant runs
    for name, ts in times.items():
        t = torch.tensor(ts, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.tolist()
    for trainer in trainers:
        trainer.remove_hooks()
    return times


def bench_ddp(cfg: dict) -> dict[str, dict[str, float]]:
    times = launch.spawn(_ddp_rank, 2, cfg, timeout_s=cfg["timeout_s"])[0]
    return _summarise(times, "ddp")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings (checks it runs)")
    parser.add_argument("--in-features", type=int, default=512)
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 1024, 512])
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--iters", type=int, default=30, help="iterations per repeat")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--algorithm", default="torch", help="PipeSGD's allreduce at p = 2")
    parser.add_argument("--skip-local", action="store_true")
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument(
        "--cpu-time",
        action="store_true",
        help="p = 1 only: one torch thread, CPU seconds of this process instead of wall time "
        "(robust to other processes on a shared machine)",
    )
    args = parser.parse_args(argv)
    if args.cpu_time:
        global _CLOCK
        _CLOCK = time.process_time
        torch.set_num_threads(1)
        args.skip_ddp = True
    cfg = {
        "in_features": args.in_features,
        "hidden": list(args.hidden),
        "classes": args.classes,
        "batch": args.batch,
        "iters": args.iters,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "bucket_mb": args.bucket_mb,
        "algorithm": args.algorithm,
        "timeout_s": 1800.0,
    }
    if args.quick:
        cfg.update(
            in_features=16, hidden=[32], batch=8, iters=3, repeats=2, warmup=1, timeout_s=300.0
        )
    print(
        f"model: MLP {cfg['in_features']}-{'-'.join(map(str, cfg['hidden']))}-{cfg['classes']}, "
        f"batch {cfg['batch']}, {cfg['repeats']} repeats x {cfg['iters']} iterations after "
        f"{cfg['warmup']} warm-up; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    ok = True
    if not args.skip_local:
        res = bench_local(cfg)
        for name, r in res.items():
            print(
                f"p=1  {name:<11s} {r['median_s'] * 1e3:9.3f} ms/iter   ratio to plain "
                f"{r['ratio']:.3f} [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]"
            )
        r = res["pipe"]
        ratio = r["ratio"]
        print(
            f"RATIO pipesgd(p=1, pipe)/plain = {ratio:.3f}, 95% CI [{r['ratio_lo']:.3f}, "
            f"{r['ratio_hi']:.3f}] over {r['repeats']} repeats  (target <= 1.05)"
        )
        ok &= ratio <= 1.05
    if not args.skip_ddp:
        res = bench_ddp(cfg)
        for name, r in res.items():
            print(
                f"p=2  {name:<11s} {r['median_s'] * 1e3:9.3f} ms/iter   ratio to DDP "
                f"{r['ratio']:.3f} [{r['ratio_lo']:.3f}, {r['ratio_hi']:.3f}]"
            )
        ratio = res["layerwise"]["ratio"]
        print(
            f"RATIO pipesgd(p=2, layerwise, {cfg['algorithm']})/DDP(gloo) = {ratio:.3f}  "
            "(target <= 1.10)"
        )
        ok &= ratio <= 1.10
    print("targets met" if ok else "targets NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
