"""``python -m pipecomm.lab.networks.cluster``: whether a virtual cluster can be built, clean-up, a
shaped link's achieved rate, a profile's torchrun program, and (internal) a job's rank side.

Example::

    python -m pipecomm.lab.networks.cluster available
"""

from __future__ import annotations

import argparse
import sys

from pipecomm.lab.networks.cluster.host import available, cleanup_stale
from pipecomm.lab.networks.cluster.job import serve
from pipecomm.lab.networks.cluster.probes import measure_bandwidth
from pipecomm.lab.networks.cluster.programs import program_args


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipecomm.lab.networks.cluster",
                                     description="virtual cluster helpers")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("available", help="print whether a virtual cluster can be built")
    sub.add_parser("cleanup", help="remove namespaces left by killed runs")
    bw = sub.add_parser("bandwidth", help="achieved vs configured rate of a shaped link")
    bw.add_argument("--rate", type=float, default=50e6, help="configured B/s (50e6)")
    bw.add_argument("--sizes", type=int, nargs="+", default=[1 << 20, 4 << 20, 16 << 20, 64 << 20])
    bw.add_argument("--iters", type=int, default=3)
    c = sub.add_parser("serve", help="(internal) rank side of VirtualCluster.job")
    c.add_argument("dir")
    pa = sub.add_parser("program", help="torchrun program of a profile's experiment, one "
                        "argument a line")
    pa.add_argument("profile")
    pa.add_argument("experiment")
    pa.add_argument("--out", required=True)
    pa.add_argument("--world-size", type=int, default=None)
    pa.add_argument("--ranks-per-node", type=int, default=None)
    args, extra = parser.parse_known_args(argv)  # extra: the program's -p NAME=VALUE items
    if extra and args.cmd != "program":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.cmd == "available":
        ok, reason = available()
        print(f"{'yes' if ok else 'no'}: {reason}")
        return 0 if ok else 1
    if args.cmd == "cleanup":
        print("\n".join(cleanup_stale()))
        return 0
    if args.cmd == "bandwidth":
        print("bytes,time_s,achieved_Bps,configured_Bps,ratio")
        for r in measure_bandwidth(args.rate, args.sizes, args.iters):
            print(f"{r['nbytes']},{r['time_s']:.4f},{r['bandwidth_Bps']:.4g},"
                  f"{r['configured_Bps']:.4g},{r['bandwidth_Bps'] / r['configured_Bps']:.3f}")
        return 0
    if args.cmd == "serve":
        serve(args.dir)
        return 0
    print("\n".join(program_args(args.profile, args.experiment, args.out, args.world_size,
                                  args.ranks_per_node, extra)))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
