"""Cross-check pipecomm's AccumAdam against the DAdam authors' own implementation (decent-dp).

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025), Algorithm 4 (AccumAdam). The authors ship it as the PyPI package
``decent-dp`` (``decent_dp.optim.AccumAdam`` and ``decent_dp.ddp.DecentralizedDataParallel``).
decent-dp is *not* a dependency of pipecomm: this script installs it with pip into a separate
directory (``--target``) on first use, as ``benchmarks/bench_decentdp.py`` does (same installer).

Two comparisons, same seed, same data, parameter vectors compared element-wise:

(a) the optimizer alone, one process: two copies of a 2-layer MLP built from ``--seed``, trained
    ``--steps`` steps on the same fixed random batches, one with
    ``pipecomm.decentralized.AccumAdam``, one with ``decent_dp.optim.AccumAdam``, for every
    ``--k`` (accum_iter) and ``--weight-decay`` (L2, both add ``wd * x`` to the gradient).
    A control (pipecomm's AccumAdam against ``torch.optim.Adam``, K > 1) shows that the tolerance
    is tight enough to see a different rule.
(b) decentralized training (``--ranks`` p > 0, gloo, ``pipecomm.lab.networks.launch.Ranks``): every rank
    trains the MLP on its own fixed batches under pipecomm's ``DecentralizedDataParallel`` +
    AccumAdam and under decent-dp's ``DecentralizedDataParallel`` + its AccumAdam; each rank's
    local parameters ``x_i`` after ``--steps`` iterations are compared. ``--topology complete``
    or ``alternating-exp-ring`` (p = 4, 2 ranks per node). decent-dp's wrapper mixes at
    iteration k (0-based) with its schedule's step 1 for k = 1 and step k + 1 for k >= 2
    (its step counter counts forward passes); pipecomm mixes with step k. For the complete
    topology that is the same; for AER pipecomm is given a Topology with decent-dp's sequence
    (``--own-schedule`` keeps pipecomm's own: then the runs differ, as they should).

Tolerance: ``10 * steps * eps(dtype) * max(1, max |x|)`` absolute, i.e. up to 10 units of
round-off (at the parameters' scale) per step, accumulated over the steps: the two
implementations evaluate the same rule in a different floating-point order (decent-dp keeps
``b1 * M`` and ``b2 * V`` as its state and uses torch's foreach kernels), so they agree to
round-off, not bit for bit. ``--dtype float64`` makes the check 2^29 times tighter.

Exit status: 0 when every comparison agrees, 1 when one does not, 2 for a bad argument.

    python tools/crosscheck_accumadam.py                      # K = 2, 4; wd 0, 0.01; p = 2
    python tools/crosscheck_accumadam.py --ranks 4 --topology alternating-exp-ring
    python tools/crosscheck_accumadam.py --ranks 0 --dtype float64 --steps 40
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_decentdp import DEFAULT_TARGET, ensure_decent_dp  # noqa: E402

BETAS = (0.9, 0.999)
EPS = 1e-8
SIZES = (16, 32, 4)  # MLP in -> hidden -> out
BATCH = 8


def build_mlp(seed: int, dtype):
    """The 2-layer MLP (Linear, Tanh, Linear) built from ``seed`` in ``dtype``."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(), torch.nn.Linear(SIZES[1], SIZES[2])
    )
    return model.to(dtype)


def batches(seed: int, steps: int, dtype):
    """``steps`` fixed random (inputs, labels) batches drawn from ``seed``."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(BATCH, SIZES[0], generator=g, dtype=torch.float64).to(dtype),
         torch.randint(0, SIZES[2], (BATCH,), generator=g))
        for _ in range(steps)
    ]


def flat(model):
    import torch

    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def tolerance(steps: int, dtype, scale: float) -> float:
    import torch

    return 10.0 * steps * torch.finfo(dtype).eps * max(1.0, scale)


def compare(a, b, steps: int, dtype) -> dict:
    """Max abs / relative difference of two flat parameter vectors and the tolerance."""
    scale = float(max(a.abs().max(), b.abs().max()))
    diff = float((a - b).abs().max())
    tol = tolerance(steps, dtype, scale)
    return {"max_abs": diff, "max_rel": diff / scale, "tol": tol, "agree": diff <= tol}


def train_alone(opt_cls, seed: int, steps: int, dtype, **kw):
    """Train the MLP alone with ``opt_cls(params, **kw)``; the model and its optimizer."""
    import torch.nn.functional as F

    model = build_mlp(seed, dtype)
    opt = opt_cls(model.parameters(), **kw)
    for x, y in batches(seed + 1, steps, dtype):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def part_a(args, dtype) -> bool:
    """The optimizers alone; prints one line per (K, weight decay); True if all agree."""
    import torch
    from decent_dp.optim import AccumAdam as DecentAccumAdam

    from pipecomm.decentralized import AccumAdam

    ok = True
    print(f"(a) optimizer alone: MLP {SIZES}, {args.steps} steps, lr {args.lr}, seed {args.seed}, "
          f"{str(dtype).replace('torch.', '')}")
    for k in args.k:
        for wd in args.weight_decay:
            kw = dict(lr=args.lr, betas=BETAS, eps=EPS, weight_decay=wd, accum_iter=k)
            ours, opt = train_alone(AccumAdam, args.seed, args.steps, dtype, **kw)
            theirs, dopt = train_alone(DecentAccumAdam, args.seed, args.steps, dtype, **kw)
            res = compare(flat(ours), flat(theirs), args.steps, dtype)
            # decent-dp stores b1 * M and b2 * V (see docs/update_rules.md); compare M, V, A
            state = 0.0
            for p, q in zip(ours.parameters(), theirs.parameters()):
                s, d = opt.state[p], dopt.state[q]
                for mine, their in ((s["exp_avg"], d["exp_avg"] / BETAS[0]),
                                    (s["exp_avg_sq"], d["exp_avg_sq"] / BETAS[1]),
                                    (s["accum"], d["accum_grad"])):
                    scale = max(float(mine.abs().max()), 1e-30)
                    state = max(state, float((mine - their).abs().max()) / scale)
            line = (f"  K={k} wd={wd:g}: max |diff| {res['max_abs']:.3e}, relative "
                    f"{res['max_rel']:.3e}, tolerance {res['tol']:.3e} -> "
                    f"{'agree' if res['agree'] else 'DISAGREE'}; moments M, V, A "
                    f"(decent-dp's / b1, / b2) relative {state:.1e}")
            if k > 1:
                adam, _ = train_alone(torch.optim.Adam, args.seed, args.steps, dtype,
                                      lr=args.lr, betas=BETAS, eps=EPS, weight_decay=wd)
                ctrl = compare(flat(ours), flat(adam), args.steps, dtype)
                line += f"; control vs torch Adam {ctrl['max_abs']:.1e}"
            print(line)
            ok &= res["agree"]
    return ok


class _DecentDPSchedule:
    """Build a pipecomm Topology that mixes as decent-dp's wrapper does (see module docstring)."""

    @staticmethod
    def make(name: str, world_size: int, ranks_per_node: int):
        from pipecomm.decentralized.topology import Topology, get_topology

        inner = get_topology(name, world_size, ranks_per_node=ranks_per_node)

        class Shifted(Topology):
            period = None

            def _partition(self, step):
                return inner.groups(1 if step <= 1 else step + 1)

            def distinct_groups(self):
                return inner.distinct_groups()

        return Shifted(world_size, ranks_per_node)


def rank_train(cfg: dict) -> dict:
    """On every rank: train under ``cfg["impl"]``; this rank's flat parameters after training."""
    import torch
    import torch.nn.functional as F

    if cfg["target"] not in sys.path:
        sys.path.insert(0, cfg["target"])
    import torch.distributed as dist

    dtype = getattr(torch, cfg["dtype"])
    rank = dist.get_rank()
    model = build_mlp(cfg["seed"], dtype)
    kw = dict(lr=cfg["lr"], betas=BETAS, eps=EPS, weight_decay=cfg["wd"], accum_iter=cfg["k"])
    if cfg["impl"] == "pipecomm":
        from pipecomm.decentralized import AccumAdam, DecentralizedDataParallel

        topo = cfg["topology"]
        if topo != "complete" and not cfg["own_schedule"]:
            topo = _DecentDPSchedule.make(topo, dist.get_world_size(), cfg["ranks_per_node"])
        ddp = DecentralizedDataParallel(model, AccumAdam(model.parameters(), **kw),
                                        topology=topo, algorithm="torch")
    else:
        from loguru import logger

        logger.remove()
        from decent_dp.ddp import DecentralizedDataParallel as DecentDP
        from decent_dp.optim import AccumAdam as DecentAccumAdam

        ddp = DecentDP(model, optim_fn=lambda named: DecentAccumAdam([p for _, p in named], **kw),
                       topology=cfg["topology"])
    for x, y in batches(cfg["seed"] + 1 + 1000 * (rank + 1), cfg["steps"], dtype):
        F.cross_entropy(ddp(x), y).backward()
    if cfg["impl"] == "pipecomm":
        ddp.close()
    else:
        for op in ddp._comm_ops:  # let decent-dp's last gossip finish before the next run
            if op is not None:
                op.wait()
        for h in ddp._ddp_hooks:
            h.remove()
    return {"x": flat(model).tolist()}


def part_b(args, dtype) -> bool:
    """Decentralized training on ``args.ranks`` ranks; True if every rank's parameters agree."""
    import torch

    from pipecomm.lab.networks import launch

    rpn = 2 if args.topology == "alternating-exp-ring" else None
    print(f"(b) decentralized: p={args.ranks}, topology {args.topology}"
          f"{f' ({rpn} ranks per node)' if rpn else ''}, gloo, {args.steps} iterations")
    ok = True
    with launch.Ranks(args.ranks, ranks_per_node=rpn) as ranks:
        for k in args.k:
            for wd in args.weight_decay:
                cfg = {"seed": args.seed, "steps": args.steps, "lr": args.lr, "k": k, "wd": wd,
                       "dtype": str(dtype).replace("torch.", ""), "topology": args.topology,
                       "ranks_per_node": rpn, "target": str(args.target),
                       "own_schedule": args.own_schedule}
                ours = ranks.run(rank_train, {**cfg, "impl": "pipecomm"}, timeout_s=300)
                theirs = ranks.run(rank_train, {**cfg, "impl": "decent-dp"}, timeout_s=300)
                worst = None
                for a, b in zip(ours, theirs):
                    res = compare(torch.tensor(a["x"]), torch.tensor(b["x"]), args.steps, dtype)
                    if worst is None or res["max_abs"] > worst["max_abs"]:
                        worst = res
                    ok &= res["agree"]
                spread = float((torch.tensor(ours[0]["x"]) - torch.tensor(ours[-1]["x"]))
                               .abs().max())
                print(f"  K={k} wd={wd:g}: worst rank max |diff| {worst['max_abs']:.3e}, relative "
                      f"{worst['max_rel']:.3e}, tolerance {worst['tol']:.3e} -> "
                      f"{'agree' if worst['agree'] else 'DISAGREE'}"
                      f" (ranks differ from each other by {spread:.1e})")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps / iterations (>= 2)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4], help="accum_iter values")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--weight-decay", type=float, nargs="+", default=[0.0, 0.01])
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--ranks", type=int, default=2, help="p for part (b); 0 skips it")
    parser.add_argument("--topology", choices=["complete", "alternating-exp-ring"],
                        default="complete")
    parser.add_argument("--own-schedule", action="store_true",
                        help="(b) give pipecomm its own AER schedule, not decent-dp's (shows "
                             "that the schedules differ: expected to disagree)")
    parser.add_argument("--target", type=Path, default=DEFAULT_TARGET,
                        help="directory pip installs decent-dp into")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (decent-dp steps first in the 2nd forward), "
                     f"got {args.steps}")
    if min(args.k) < 1:
        parser.error(f"--k must be >= 1, got {min(args.k)}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if min(args.weight_decay) < 0:
        parser.error(f"--weight-decay must be >= 0, got {min(args.weight_decay)}")
    if args.ranks < 0 or args.ranks == 1:
        parser.error(f"--ranks must be 0 (skip part b) or >= 2, got {args.ranks}")
    if args.topology == "alternating-exp-ring" and args.ranks not in (0, 4):
        parser.error(f"--topology alternating-exp-ring needs --ranks 4, got {args.ranks}")
    version = ensure_decent_dp(args.target)
    # spawned ranks get sys.path from this process; PYTHONPATH covers anything they start
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(args.target), str(ROOT / "benchmarks"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    import torch

    dtype = getattr(torch, args.dtype)
    print(f"decent-dp {version} against pipecomm's AccumAdam")
    ok = part_a(args, dtype)
    if args.ranks:
        ok &= part_b(args, dtype)
    print("all agree" if ok else "DISAGREE")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
