"""Probes of why multi-step schedules are slower on the shaped network than on the emulator.

Each builds a virtual cluster of single-port nodes (``pipecomm.lab.networks.cluster``, root only; everything
is removed afterwards) and times collectives with :func:`pipecomm.lab.measure.sweep.measure_points`
(median of ``--iters`` after one warm-up). ARTIFACT.md's shaped section quotes their output.

Usage (as root, on a quiet machine)::

    .venv/bin/python benchmarks/shaped_probes.py steps --p 2 4 8        # excess per step vs p
    .venv/bin/python benchmarks/shaped_probes.py tbf-latency 100ms 3ms  # the shaper's queue depth
    .venv/bin/python benchmarks/shaped_probes.py slow-start 1 0         # TCP slow start after idle

``steps``: ring and BE allreduce of ``--nbytes`` on p nodes at ``--rate``, against the alpha-beta
model on that cluster's own calibration (:func:`pipecomm.lab.networks.kinds.ranks_on`): the
excess per step of each schedule. ``tbf-latency``: the same 8-node timings with the token
bucket's queue limit set to each value (the cluster's default is 100ms). ``slow-start``: with
``net.ipv4.tcp_slow_start_after_idle`` set in every node's namespace.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import sys
from collections.abc import Iterator

from pipecomm.lab.measure import sweep
from pipecomm.lab.networks import cluster, cost, netem
from pipecomm.lab.networks.kinds import ranks_on


def _points(nbytes: int, p: int, iters: int, cases: tuple[tuple[str, str], ...]) -> list[dict]:
    return [{"op": op, "algorithm": alg, "nbytes": nbytes, "p": p, "warmup": 1, "iters": iters,
             "first_warmup": True} for op, alg in cases]


def steps(ps: list[int], nbytes: int, rate: float, iters: int) -> None:
    """Measured vs modelled ring / BE allreduce per p, and the excess per step."""
    for p in ps:
        with ranks_on("shaped", p, netem.Network(0.0, rate), None, timeout_s=600) as ranks:
            rows = ranks.run(sweep.measure_points,
                             _points(nbytes, p, iters, (("allreduce", "ring"), ("allreduce", "be"))),
                             timeout_s=600)[0]
            link = cost.link_from_network(ranks.net)
        for r in rows:
            model = cost.collective_time("allreduce", r["algorithm"], nbytes, p, link)
            n_steps = 2 * (p - 1) if r["algorithm"] == "ring" else 2 * (p.bit_length() - 1)
            print(f"p={p} {r['algorithm']}: measured {r['time_s'] * 1e3:.0f} ms, model "
                  f"{model * 1e3:.0f} ms, excess {(r['time_s'] - model) * 1e3 / n_steps:.1f} ms "
                  f"per step over {n_steps} steps", flush=True)


@contextlib.contextmanager
def _tbf_latency(latency: str) -> Iterator[None]:
    """Clusters built inside use ``latency`` as their token buckets' queue limit."""
    original = cluster.virtual.tbf_argv  # what VirtualCluster builds its links with
    cluster.virtual.tbf_argv = lambda ns, dev, bw, burst: original(ns, dev, bw, burst)[:-1] + [
        latency]
    try:
        yield
    finally:
        cluster.virtual.tbf_argv = original


def _time_on_cluster(nbytes: int, rate: float, iters: int, sysctl: str | None = None) -> list:
    cases = (("allreduce", "ring"), ("allreduce", "be"), ("broadcast", "be"))
    with cluster.VirtualCluster(8, 1, rate) as c:
        if sysctl:
            for i in range(c.nodes):
                subprocess.run(["ip", "netns", "exec", c.netns(i), "sysctl", "-qw", sysctl],
                               check=True, timeout=20)
        return c.run(sweep.measure_points, _points(nbytes, 8, iters, cases), timeout_s=600)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe", choices=("steps", "tbf-latency", "slow-start"))
    parser.add_argument("values", nargs="*", help="tbf latencies (e.g. 100ms 3ms) or 1 / 0")
    parser.add_argument("--p", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--nbytes", type=int, default=4 << 20)
    parser.add_argument("--rate", type=float, default=15e6, help="link rate, B/s (15e6)")
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args(argv)
    ok, why = cluster.available()
    if not ok:
        print(f"no virtual cluster: {why}", file=sys.stderr)
        return 1
    if args.probe == "steps":
        steps(args.p, args.nbytes, args.rate, args.iters)
        return 0
    if not args.values:
        parser.error(f"{args.probe} needs values to compare")
    for v in args.values:
        if args.probe == "tbf-latency":
            with _tbf_latency(v):
                rows = _time_on_cluster(args.nbytes, args.rate, args.iters)
        else:
            rows = _time_on_cluster(args.nbytes, args.rate, args.iters,
                                    f"net.ipv4.tcp_slow_start_after_idle={v}")
        for r in rows:
            print(f"{args.probe} {v}: {r['op']} {r['algorithm']} {r['time_s']:.3f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
