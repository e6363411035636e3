"""Probes of why multi-step schedules are slower on the shaped network than on the emulator.

Each builds a virtual cluster of single-port nodes (``pipecomm.lab.networks.cluster``, root only; everything
is removed afterwards) and times collectives with :func:`pipecomm.lab.measure.sweep.measure_points`
(median of ``--iters`` after one warm-up). ARTIFACT.md's shaped section quotes their output.

Usage (as root, on a quiet machine)::

    .venv/bin/python benchmarks/shaped_probes.py steps --p 2 4 8        # excess per step vs p
    .venv/bin/python benchmarks/shaped_probes.py tbf-latency 100ms 3ms  # the shaper's queue depth
    .venv/bin/python benchmarks/shaped_probes.py slow-start 1 0         # TCP slow start after idle
    .venv/bin/python benchmarks/shaped_probes.py lp-broadcast --p 2 8 --nbytes 16777216
    .venv/bin/python benchmarks/shaped_probes.py gloo-broadcast --p 4 8 16 --rate 5e6

``steps``: ring and BE allreduce of ``--nbytes`` on p nodes at ``--rate``, against the alpha-beta
model on that cluster's own calibration (:func:`pipecomm.lab.networks.kinds.ranks_on`): the
excess per step of each schedule. ``tbf-latency``: the same 8-node timings with the token
bucket's queue limit set to each value (the cluster's default is 100ms). ``slow-start``: with
``net.ipv4.tcp_slow_start_after_idle`` set in every node's namespace. ``lp-broadcast``: LP
broadcast of ``--nbytes`` on p nodes with the default block and blocks of ``values`` bytes
(default 65536 262144 1048576 4194304), timed round-robin with the CPU seconds of every rank:
time over the link limit n / B beside the pipeline model (p + k - 2)(alpha + b / B) on the
cluster's calibrated link; p = 2 is one hop (TCP through tbf, no forwarding).
``gloo-broadcast``: gloo's own broadcast per p over n / B, beside what two readings of it
predict: the root sending the whole message to each other rank, (p - 1) n / B, or an
unsegmented binomial tree whose concurrent sends share a sender's link, L (L + 1) / 2 n / B with
L = ceil(log2 p) (6 against 7 at p = 8, 10 against 15 at p = 16).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
from collections.abc import Iterator

from pipecomm.lab.measure import stats, sweep
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


def lp_broadcast(ps: list[int], nbytes: int, rate: float, iters: int, blocks: list[int]) -> None:
    """LP broadcast per p and block: measured and modelled over the link limit, CPU per call."""
    for p in ps:
        pts = [{**pt, "block_bytes": b} for b in (None, *blocks)
               for pt in _points(nbytes, p, iters, (("broadcast", "lp"),))]
        with ranks_on("shaped", p, netem.Network(0.0, rate), None, timeout_s=600) as ranks:
            rows = ranks.run(sweep.measure_points, pts, None, True, True, timeout_s=600)[0]
            link = cost.link_from_network(ranks.net)
        limit = nbytes / rate  # the shaped rate's n / B, as E15's link limit
        for r in rows:
            b = int(r["block_bytes"])
            model = cost.collective_time("broadcast", "lp", nbytes, p, link, b)
            cpu = statistics.median(stats.repeats(r["cpu_times_s"]))
            print(f"p={p} block={b} (k={-(-nbytes // b)}): {r['time_s']:.3f} s = "
                  f"{r['time_s'] / limit:.2f} n/B, model {model / limit:.2f} n/B (calibrated "
                  f"alpha {link.alpha * 1e3:.2f} ms, {link.bandwidth_Bps / 1e6:.1f} MB/s); CPU "
                  f"{cpu:.2f} s per call summed over {p} ranks", flush=True)


def gloo_broadcast(ps: list[int], nbytes: int, rate: float, iters: int) -> None:
    """gloo's broadcast per p over n / B, beside the two readings' predictions."""
    for p in ps:
        with ranks_on("shaped", p, netem.Network(0.0, rate), None, timeout_s=600) as ranks:
            r = ranks.run(sweep.measure_points, _points(nbytes, p, iters, (("broadcast", "torch"),)),
                          timeout_s=600)[0][0]
        times = stats.repeats(r["times_s"])
        depth = (p - 1).bit_length()
        print(f"p={p}: gloo broadcast {r['time_s']:.3f} s = {r['time_s'] * rate / nbytes:.2f} n/B "
              f"(repeats {min(times) * rate / nbytes:.2f}-{max(times) * rate / nbytes:.2f}); "
              f"root to each rank {p - 1} n/B, binomial sharing links {depth * (depth + 1) // 2} "
              f"n/B", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("probe", choices=("steps", "tbf-latency", "slow-start", "lp-broadcast",
                                              "gloo-broadcast"))
    parser.add_argument("values", nargs="*",
                        help="tbf latencies (e.g. 100ms 3ms), 1 / 0, or LP block sizes (bytes)")
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
    if args.probe == "lp-broadcast":
        blocks = [int(v) for v in args.values] or [1 << 16, 1 << 18, 1 << 20, 1 << 22]
        lp_broadcast(args.p, args.nbytes, args.rate, args.iters, blocks)
        return 0
    if args.probe == "gloo-broadcast":
        gloo_broadcast(args.p, args.nbytes, args.rate, args.iters)
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
