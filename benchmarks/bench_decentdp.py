"""Benchmark: pipecomm's DecentralizedDataParallel vs the DAdam authors' decent-dp, side by side.

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025) ship their implementation as the PyPI package ``decent-dp``. This script
trains the same model with the same topology, world size, bucket size and optimizer (torch Adam)
under both wrappers, on the real gloo backend (no emulation; both use the backend's built-in
subgroup allreduce; pipecomm runs its default, ``algorithm="auto"``, which picks per call what its
table or cost model crowns, and the script prints which collectives its gossip ran;
``--algorithm torch`` pins the built-in), in one pool of ranks, alternating the two
``--repeats`` times, and prints pipecomm's per-iteration time divided by decent-dp's: the ratio
of the medians over the repeats with its bootstrap 95% interval (:func:`pipecomm.lab.measure.stats.ratio_ci`;
the target: at most 1), and the ratio of the best repeats. ``--aa`` runs decent-dp a second time
in every alternation and prints its ratio to the first: an A/A comparison, the interval a wrapper
exactly as fast as decent-dp gets in the same run. Each alternation starts one run further on
(the order rotates), and beside the ratio of the medians the script prints the paired one: the
median of the per-alternation ratios (:func:`pipecomm.lab.measure.stats.paired_ratio_ci`), which a drift of
the host between alternations does not widen.

decent-dp is *not* a dependency: the script installs it (and its one dependency, loguru) with pip
into a separate directory (``--target``, default under the system temporary directory) the first
time it runs, and puts that directory on ``sys.path`` of the ranks.

    python benchmarks/bench_decentdp.py                       # LM, AER, p=4 (2 per node)
    python benchmarks/bench_decentdp.py --model mlp --topology complete --iters 50

Per-iteration time: ``bench.time_fn`` over blocks of ``--iters`` iterations (barrier before each
block, max over ranks, median over ``--blocks``) / ``--iters``, after ``--warmup`` iterations
(decent-dp builds its buckets in its second forward).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipecomm import vocab

DEFAULT_TARGET = Path(tempfile.gettempdir()) / "pipecomm-decent-dp"


def ensure_decent_dp(target: Path, timeout_s: float | None = None) -> str:
    """Import decent_dp, installing it with pip into ``target`` first if needed; its version.

    Also used by ``tools/crosscheck_accumadam.py`` and its test. A failed install (or one that
    runs past ``timeout_s`` seconds; ``None``: no limit) raises SystemExit with pip's message.

    Example::

        version = ensure_decent_dp(DEFAULT_TARGET, timeout_s=120)   # then: import decent_dp
    """
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    try:
        importlib.import_module("decent_dp.ddp")
    except ImportError:
        target.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            "decent-dp",
            "loguru",
        ]
        print("installing decent-dp:", " ".join(cmd), flush=True)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise SystemExit(
                f"could not install decent-dp with pip: no answer within {timeout_s} s"
            ) from None
        if done.returncode != 0:
            raise SystemExit(
                f"could not install decent-dp with pip (exit {done.returncode}):\n"
                f"{done.stderr.strip()[-2000:]}"
            ) from None
        importlib.invalidate_caches()
        importlib.import_module("decent_dp.ddp")
    from importlib import metadata

    try:
        return metadata.version("decent-dp")
    except metadata.PackageNotFoundError:
        return "unknown"


def _adam(named, lr):
    import torch

    return torch.optim.Adam([p for _, p in named], lr=lr)


def rank_bench(cfg: dict) -> dict:
    """On every rank: train ``cfg["model"]`` under ``cfg["impl"]``; time blocks of iterations."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pipecomm import observe
    from pipecomm.lab.measure import bench
    from pipecomm.lab.workloads.tasks import build_task_model, corpus

    if cfg["target"] not in sys.path:
        sys.path.insert(0, cfg["target"])
    rank = dist.get_rank()
    model = build_task_model(cfg["model"], seed=0)
    optim_fn = functools.partial(_adam, lr=cfg["lr"])
    if cfg["impl"] == "pipecomm":
        from pipecomm.decentralized import DecentralizedDataParallel

        observe.reset()

        ddp = DecentralizedDataParallel(
            model,
            optim_fn,
            topology=cfg["topology"],
            bucket_mb=float(cfg["bucket_mb"]),
            algorithm=cfg["algorithm"],
        )
    else:
        from loguru import logger

        logger.remove()  # decent-dp logs at debug level on rank 0
        from decent_dp.ddp import DecentralizedDataParallel as DecentDP

        ddp = DecentDP(
            model,
            optim_fn=optim_fn,
            topology=cfg["topology"],
            bucket_size_in_mb=int(cfg["bucket_mb"]),
        )
    g = torch.Generator().manual_seed(1000 + rank)
    if cfg["model"] == "mlp":
        xs = [torch.randn(cfg["batch"], 1, 8, 8, generator=g) for _ in range(8)]
        ys = [torch.randint(0, 10, (cfg["batch"],), generator=g) for _ in range(8)]
    else:
        text = corpus()
        pairs = [text.batch(cfg["batch"], 32, g) for _ in range(8)]
        xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    k = 0

    def one():
        nonlocal k
        x, y = xs[k % 8], ys[k % 8]
        k += 1
        out = ddp(x)
        F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1)).backward()

    for _ in range(cfg["warmup"]):
        one()

    def block():
        for _ in range(cfg["iters"]):
            one()

    stats = bench.time_fn(block, warmup=0, repeats=cfg["blocks"])
    ran = ""
    if cfg["impl"] == "pipecomm":
        ddp.close()
        ran = ", ".join(f"{name} x{c['calls']}" for name, c in observe.counters().items())
    else:
        for op in ddp._comm_ops:  # let decent-dp's in-flight gossip finish before the next run
            if op is not None:
                op.wait()
        for h in ddp._ddp_hooks:
            h.remove()
    return {"iteration_s": stats["median_s"] / cfg["iters"], "k": k, "ran": ran}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--model", choices=["char_transformer", "mlp"], default="char_transformer")
    parser.add_argument(
        "--topology",
        default="alternating-exp-ring",
        choices=["complete", "ring", "one-peer-exp", "alternating-exp-ring"],
    )
    parser.add_argument("--batch", type=int, default=8, help="samples per rank per iteration")
    parser.add_argument("--bucket-mb", type=int, default=25)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20, help="iterations per timed block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the two wrappers")
    parser.add_argument(
        "--target", type=Path, default=DEFAULT_TARGET, help="directory pip installs decent-dp into"
    )
    parser.add_argument("--aa", action="store_true",
                        help="also run decent-dp a second time per alternation (A/A noise floor)")
    parser.add_argument("--algorithm", default=vocab.DEFAULT_ALGORITHM,
                        choices=vocab.ALGORITHM_CHOICES,
                        help=f"pipecomm's gossip collective (default {vocab.DEFAULT_ALGORITHM}; "
                             "torch: the built-in, as decent-dp uses)")
    args = parser.parse_args(argv)
    if args.world_size % args.ranks_per_node:
        parser.error("--ranks-per-node must divide --world-size")
    version = ensure_decent_dp(args.target)
    # spawned ranks get sys.path from this process; PYTHONPATH covers anything they start
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(args.target), *filter(None, [os.environ.get("PYTHONPATH")])]
    )

    from pipecomm.lab.measure import stats, sweep
    from pipecomm.lab.networks import launch

    cfg = {
        "model": args.model,
        "topology": args.topology,
        "batch": args.batch,
        "bucket_mb": args.bucket_mb,
        "lr": args.lr,
        "warmup": args.warmup,
        "iters": args.iters,
        "blocks": args.blocks,
        "target": str(args.target),
        "algorithm": args.algorithm,
    }
    runs = ["pipecomm", "decent-dp", *(["decent-dp (A/A)"] if args.aa else [])]
    times: dict[str, list[float]] = {name: [] for name in runs}
    ran = ""
    start = time.perf_counter()
    with launch.Ranks(args.world_size, ranks_per_node=args.ranks_per_node) as ranks:
        for i in range(args.repeats):
            for name in sweep.rotated(runs, i):  # no fixed place in the round
                impl = "decent-dp" if name.startswith("decent-dp") else name
                res = ranks.run(rank_bench, {**cfg, "impl": impl}, timeout_s=600)
                times[name].append(res[0]["iteration_s"])
                ran = res[0]["ran"] or ran
    best = {k: min(v) for k, v in times.items()}
    ratio, lo, hi = stats.ratio_ci(times["pipecomm"], times["decent-dp"])
    print(
        f"decent-dp {version}; model {args.model}, topology {args.topology}, "
        f"p={args.world_size} ({args.ranks_per_node} per node), Adam, gloo (real network), "
        f"pipecomm's gossip {args.algorithm!r}, "
        f"{time.perf_counter() - start:.0f} s"
    )
    print(f"  pipecomm's gossip ran (rank 0, one run): {ran or 'nothing counted'}")
    for k, v in times.items():
        print(f"  {k:9}: " + ", ".join(f"{t * 1e3:.2f}" for t in v) + " ms/iteration")
    verdict = "at most 1" if hi <= 1 else "above 1" if lo > 1 else "straddles 1"
    print(
        f"pipecomm / decent-dp per-iteration time: median ratio {ratio:.3f} "
        f"[{lo:.3f}, {hi:.3f}] (95% interval over {args.repeats} alternations: {verdict}); "
        f"best of each {best['pipecomm'] / best['decent-dp']:.3f}"
    )
    pr, plo, phi = stats.paired_ratio_ci(times["pipecomm"], times["decent-dp"])
    print(f"  paired (median of the per-alternation ratios): {pr:.3f} [{plo:.3f}, {phi:.3f}]")
    if args.aa:
        aa, aa_lo, aa_hi = stats.ratio_ci(times["decent-dp (A/A)"], times["decent-dp"])
        print(f"decent-dp / decent-dp (A/A, the noise floor): {aa:.3f} [{aa_lo:.3f}, {aa_hi:.3f}]")
        pr, plo, phi = stats.paired_ratio_ci(times["decent-dp (A/A)"], times["decent-dp"])
        print(f"  paired: {pr:.3f} [{plo:.3f}, {phi:.3f}]")
    return ratio


if __name__ == "__main__":
    main()
