"""One-way error of the emulated network at p = 2 and p = 8, without and with the virtual clock.

E0's emulated ping-pong (pairs (2i, 2i+1) at once, 2 ms / 50 MB/s) and a lock-step chain around
the ring; "before" forgives no lateness (the emulator without its virtual clock), "after" is p2p
waiting through ``netem.wait_until`` (the virtual clock). The two alternate message by message
(paired samples under the same machine load). Reports the median relative error of the one-way
time on the wall clock and on ``netem.clock()`` over all samples.

``--check-host`` instead runs :func:`pipecomm.lab.networks.netem.check_host` at p = 8 on the networks of
E0 (2 ms, 50 MB/s), E11's flat network (1 ms, 400 MB/s) and the two-level network of E10-E12.

Run::

    .venv/bin/python benchmarks/bench_netem.py --reps 3
    .venv/bin/python benchmarks/bench_netem.py --check-host
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import rankfns_netem as rf  # noqa: E402

from pipecomm.lab.networks import (
    launch,  # noqa: E402
    netem,
)


def check_hosts(world: int = 8) -> None:
    """Print what :func:`netem.check_host` says at ``world`` ranks on three networks."""
    cases = [
        ("E0 link", netem.Network(2e-3, 50e6), None, [64 << 10, 1 << 20]),
        ("E11 flat", netem.Network(1e-3, 400e6), None, [133 << 10]),
        ("E10-E12 two-level", netem.Network(1e-3, 400e6, inter_alpha_s=2e-3,
                                            inter_bandwidth_Bps=50e6), 2, [64 << 10]),
    ]
    for name, net, rpn, sizes in cases:
        with launch.Ranks(world, network=net, ranks_per_node=rpn) as ranks:
            chk = netem.check_host(ranks, sizes, raise_error=False)
        print(f"{name}: {'ok' if chk.ok else 'refused'}")
        for row in chk.rows:
            print(f"  {row['level']:10s} {row['nbytes']:>8d} B: real step "
                  f"{row['real_step_s'] * 1e3:.2f} ms, emulated {row['emulated_step_s'] * 1e3:.2f} ms")
        print(f"  {chk.message}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64 << 10, 1 << 20])
    ap.add_argument("--hops", type=int, default=16)
    ap.add_argument("--iters", type=int, default=5, help="samples per mode and repetition")
    ap.add_argument("--check-host", action="store_true")
    args = ap.parse_args()
    if args.check_host:
        check_hosts()
        return
    net = netem.Network(2e-3, 50e6)
    print("p,mode,what,nbytes,model_ms,wall_err_pct,wall_err_ms,clock_err_pct,samples")
    for p in args.world_sizes:
        with launch.Ranks(p, network=net) as ranks:
            res: dict = {}
            for _ in range(args.reps):  # modes alternate message by message: paired samples
                for n in args.sizes:
                    iters = 2 * args.iters
                    modes = [i % 2 == 1 for i in range(iters + 2)]
                    for rows in filter(None, ranks.run(rf.pingpong, n, iters, 2, modes)):
                        for mode, wall, virt in rows:
                            res.setdefault((mode, "pingpong", n), []).append((wall, virt))
                n = args.sizes[0]
                modes = [i % 2 == 1 for i in range(2 * args.iters + 1)]
                (rows,) = filter(None, ranks.run(rf.chain, n, args.hops, 2 * args.iters, modes))
                for mode, wall, virt in rows:
                    res.setdefault((mode, f"chain{args.hops}", n), []).append((wall, virt))
            for (mode, what, n), vals in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][2],
                                                                            kv[0][0])):
                hops = args.hops if what.startswith("chain") else 1
                model = hops * net.transfer_time(n)
                wall = statistics.median(v[0] for v in vals)
                virt = statistics.median(v[1] for v in vals)
                print(f"{p},{'after' if mode else 'before'},{what},{n},{model * 1e3:.3f},"
                      f"{(wall / model - 1) * 100:+.1f},{(wall - model) * 1e3:+.3f},"
                      f"{(virt / model - 1) * 100:+.1f},{len(vals)}")

if __name__ == "__main__":
    main()
