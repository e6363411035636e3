"""One-way error of the emulated network at p = 2 and p = 8, without and with the virtual clock.

E0's emulated ping-pong (pairs (2i, 2i+1) at once, 2 ms / 50 MB/s) and a lock-step chain around
the ring; "before" forgives no lateness (the emulator without its virtual clock), "after" is p2p waiting
through ``netem.wait_until`` (the virtual clock). Reports the median relative error of
the one-way time on the wall clock and on ``netem.clock()`` over repetitions.

Run::

    .venv/bin/python benchmarks/bench_netem.py --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import rankfns_netem as rf  # noqa: E402

from pipecomm import launch, netem  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64 << 10, 1 << 20])
    ap.add_argument("--hops", type=int, default=16)
    args = ap.parse_args()
    net = netem.Network(2e-3, 50e6)
    print("p,mode,what,nbytes,model_ms,wall_err_pct,wall_err_ms,clock_err_pct,reps")
    for p in args.world_sizes:
        with launch.Ranks(p, network=net) as ranks:
            res: dict = {}
            for _ in range(args.reps):
                for mode in ("before", "after"):
                    ranks.run(rf.use_virtual_clock, mode == "after")
                    for n in args.sizes:
                        model = net.transfer_time(n)
                        out = [r for r in ranks.run(rf.pingpong, n) if r is not None]
                        wall = statistics.median(t for w, _ in out for t in w)
                        virt = statistics.median(t for _, v in out for t in v)
                        res.setdefault((mode, "pingpong", n), []).append((wall, virt, model))
                    n = args.sizes[0]
                    out = [r for r in ranks.run(rf.chain, n, args.hops) if r is not None][0]
                    wall = statistics.median(w for w, _ in out)
                    virt = statistics.median(v for _, v in out)
                    model = args.hops * net.transfer_time(n)
                    res.setdefault((mode, f"chain{args.hops}", n), []).append((wall, virt, model))
            for (mode, what, n), vals in res.items():
                model = vals[0][2]
                wall = statistics.median(v[0] for v in vals)
                virt = statistics.median(v[1] for v in vals)
                print(f"{p},{mode},{what},{n},{model * 1e3:.3f},{(wall / model - 1) * 100:+.1f},"
                      f"{(wall - model) * 1e3:+.3f},{(virt / model - 1) * 100:+.1f},{len(vals)}")


if __name__ == "__main__":
    main()
