"""What gloo over loopback can move on this host, and where an LP rank's time goes.

``flows``: one local pool of 8 gloo ranks; one flow alone (:func:`pipecomm.lab.networks.cluster.link_bandwidth`)
against every hop of an 8-rank chain at once (:func:`pipecomm.lab.networks.cluster.chain_bandwidth`, what LP's
pipeline runs) and 3 flows at once, ``--nbytes`` each: the host's aggregate byte rate, which
bounds every schedule's time on one machine (ARTIFACT.md, "Where LP's time goes").

``profile``: every rank loops ``--algorithm``'s ``--op`` of ``--nbytes`` for ``--seconds``, the
built-in first, and ``py-spy record --idle`` samples rank 3 meanwhile (``pip install py-spy``;
it writes collapsed stacks to ``--out``). Prints calls and time per call of each algorithm, and
the share of samples per innermost function.

``cpu``: the same loops, the built-in first, then each of ``--algorithms``; while each runs,
``perf record -a`` samples every CPU of the host (``linux-perf``; root or
``kernel.perf_event_paranoid`` <= 0) and the samples are sorted into :data:`CATEGORIES` (the data's
copies in and out of the kernel, reductions, the TCP/IP stack, scheduling and wake-ups, the
Python interpreter, idle, the rest). Prints CPU milliseconds per call by category for each
algorithm: where an algorithm's extra time against the built-in goes on a host whose cores are
all busy.

``lean``: the floor of any Python implementation on ``torch.distributed``'s point-to-point API.
pipecomm's ring allreduce, the built-in, and :func:`lean_ring` -- the same ring schedule (receives
posted ahead, sends waited lazily, the same TCP connections) written straight on
``ProcessGroup.send`` / ``recv`` with none of pipecomm's layers -- timed round-robin, ``--iters``
rounds from common starts (:func:`pipecomm.lab.measure.bench.time_fn`), each with its median ratio to the
built-in and the bootstrap 95% interval. pipecomm's ring against the lean ring is what its own
layers cost; the lean ring against the built-in is what the backend's point-to-point path costs
against the backend's own ring, which no schedule written in Python can remove.

Usage::

    .venv/bin/python benchmarks/loopback_flows.py flows
    .venv/bin/python benchmarks/loopback_flows.py profile --op allreduce --out /tmp/lp.txt
    .venv/bin/python benchmarks/loopback_flows.py cpu --op allreduce --algorithms ring lp
    .venv/bin/python benchmarks/loopback_flows.py lean --iters 30
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import collectives
from pipecomm.lab.measure import bench, stats
from pipecomm.lab.networks import cluster, launch


def rank_pid() -> int:
    """This rank's process id."""
    return os.getpid()


def rank_loop(algorithm: str, op: str, nbytes: int, seconds: float) -> tuple[int, float]:
    """Run the collective back to back for ``seconds`` (ranks agree when to stop); calls and
    seconds per call."""
    x = torch.randn(nbytes // 4)
    calls = 0
    dist.barrier()
    end = time.monotonic() + seconds
    start = time.perf_counter()
    while True:
        go = torch.tensor([1 if time.monotonic() < end else 0])
        dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if not go.item():
            break
        if op == "allreduce":
            collectives.allreduce(x, algorithm=algorithm)
        else:
            collectives.broadcast(x, src=0, algorithm=algorithm)
        calls += 1
    return calls, (time.perf_counter() - start) / max(calls, 1)


def flows(nbytes: int, iters: int) -> None:
    with launch.Ranks(8) as ranks:
        alone = ranks.run(cluster.link_bandwidth, [nbytes], iters, timeout_s=300)[0][0]
        chain = ranks.run(cluster.chain_bandwidth, nbytes, iters, timeout_s=300)[0]
        three = ranks.run(cluster.chain_bandwidth, nbytes, iters, 2, timeout_s=300)[0]
    print(f"one flow alone {alone['bandwidth_Bps'] / 1e9:.2f} GB/s; 7 flows at once "
          f"{chain / 1e9:.2f} GB/s each, {7 * chain / 1e9:.2f} GB/s together; 3 flows "
          f"{three / 1e9:.2f} GB/s each, {3 * three / 1e9:.2f} GB/s together")


def sampled(ranks, alg: str, op: str, nbytes: int, seconds: float, sample) -> float:
    """Every rank loops ``alg``'s ``op`` for ``seconds``; ``sample()`` runs here meanwhile, once
    the loop has settled. Prints the calls and returns the seconds per call."""
    done: dict = {}
    worker = threading.Thread(target=lambda: done.update(r=ranks.run(
        rank_loop, alg, op, nbytes, seconds, timeout_s=seconds + 120)))
    worker.start()
    try:
        time.sleep(min(2.0, seconds / 4))
        sample()
    finally:
        worker.join()
    calls, per_call = done["r"][0]
    print(f"{op} {alg}: {calls} calls, {per_call * 1e3:.1f} ms per call", flush=True)
    return per_call


def profile(algorithm: str, op: str, nbytes: int, seconds: float, out: str) -> None:
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        raise SystemExit("py-spy is not installed (pip install py-spy)")
    with launch.Ranks(8) as ranks:
        pids = ranks.run(rank_pid)
        sampled(ranks, "torch", op, nbytes, seconds, lambda: None)
        sampled(ranks, algorithm, op, nbytes, seconds, lambda: subprocess.run(
            [spy, "record", "-p", str(pids[3]), "-d", str(max(1, int(seconds / 2))), "-r", "200",
             "--idle", "-f", "raw", "-o", out], capture_output=True, timeout=seconds + 60))
    leaves: collections.Counter = collections.Counter()
    with open(out) as f:
        lines = f.read().splitlines()
    for line in lines:
        stack, n = line.rsplit(" ", 1)
        leaves[re.sub(r" \(.*", "", stack.split(";")[-1])] += int(n)
    total = sum(leaves.values())
    print(f"rank 3, {total} samples: " + ", ".join(f"{k} {v / total:.1%}"
                                                  for k, v in leaves.most_common(8)))


#: (category, pattern): a perf sample goes to the first category whose pattern matches
#: ``"<command> <shared object> <symbol>"`` (perf report's comm, dso and sym columns).
CATEGORIES = (
    ("idle", r"^swapper |safe_halt|cpuidle|do_idle"),
    ("data copies", r"_copy_to_iter|_copy_from_iter|copy_user|memcpy|memmove"),
    ("reductions", r"gloo::sum|add_kernel|VectorizedLoop"),
    ("Python interpreter", r" libpython"),
    ("TCP/IP stack", r"\[k\] .*(tcp|skb|sock|softirq|\bip_|inet|net_|dev_|loopback|napi)"),
    ("scheduling, wake-ups, polling",
     r"\[k\] .*(spin_unlock|task_switch|schedule|futex|wake|switch_to|enqueue|dequeue"
     r"|update_curr|epoll|ep_|poll|read_tsc)|epoll_wait|pthread_cond|__futex"),
    ("other kernel", r"\[k\] "),
    ("other user", r""),
)


def cpu_shares(report: str) -> dict[str, float]:
    """Fractions of all samples per category from ``perf report --stdio --no-children
    --sort comm,dso,sym -g none`` text (lines ``"<pct>% <comm> <dso> [k|.] <symbol>"``).

    Example::

        cpu_shares("  60.00%  python  [kernel.kallsyms]  [k] _copy_to_iter\n"
                   "  40.00%  swapper [kernel.kallsyms]  [k] pv_native_safe_halt\n")
        # {'data copies': 0.6, 'idle': 0.4, ...every other category 0.0}
    """
    shares = {name: 0.0 for name, _ in CATEGORIES}
    for line in report.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(.*)$", line)
        if not m:
            continue
        text = " ".join(m.group(2).split()) + " "
        for name, pattern in CATEGORIES:
            if re.search(pattern, text):
                shares[name] += float(m.group(1)) / 100
                break
    return shares


def _perf_report(perf: str, seconds: float) -> str:
    """``perf record -a`` for about ``seconds / 2``; its report by command, object and symbol."""
    data = f"/tmp/pipecomm_perf_{os.getpid()}.data"
    try:
        rec = subprocess.run([perf, "record", "-a", "-F", "999", "-o", data, "--", "sleep",
                              str(max(1.0, seconds / 2))],
                             capture_output=True, text=True, timeout=seconds + 60)
        if rec.returncode != 0:
            raise SystemExit(f"perf record failed (root or kernel.perf_event_paranoid <= 0 "
                             f"needed): {rec.stderr.strip()[-300:]}")
        return subprocess.run(
            [perf, "report", "-i", data, "--stdio", "--no-children", "--sort", "comm,dso,sym",
             "-g", "none", "--percent-limit", "0"],
            capture_output=True, text=True, timeout=300, check=True).stdout
    finally:
        if os.path.exists(data):
            os.remove(data)


def cpu(algorithms: list[str], op: str, nbytes: int, seconds: float) -> None:
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("perf is not installed (apt install linux-perf)")
    cores = os.cpu_count() or 1
    rows = {}
    with launch.Ranks(8) as ranks:
        for alg in ("torch", *algorithms):
            got: dict = {}
            per_call = sampled(ranks, alg, op, nbytes, seconds,
                               lambda g=got: g.update(report=_perf_report(perf, seconds)))
            rows[alg] = (per_call, cpu_shares(got["report"]))
    names = [name for name, _ in CATEGORIES]
    print(f"CPU ms per call ({cores} cores x time per call, by category; 8 ranks, "
          f"{nbytes / 2**20:g} MiB):")
    print("| category | " + " | ".join(rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in [*names, "total"]:
        cells = [per * cores * (sum(sh.values()) if name == "total" else sh[name]) * 1e3
                 for per, sh in rows.values()]
        print(f"| {name} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")


def lean_ring(x: torch.Tensor, slots: list[torch.Tensor]) -> None:
    """Ring allreduce (sum) of ``x`` over the world on bare ``ProcessGroup.send`` / ``recv``:
    reduce-scatter of ``p`` chunks, every receive posted ahead into ``slots`` (``p - 1`` chunk
    buffers), then allgather straight into place. Messages to a lower rank take pipecomm's reverse
    connection (:func:`pipecomm.lab.networks.launch.reverse_transport`), as pipecomm's ring does. ``x.numel()``
    must be a multiple of the world size.

    Example::

        lean_ring(x, list(torch.empty(p - 1, x.numel() // p).unbind(0)))
    """
    p, r = dist.get_world_size(), dist.get_rank()
    pg, (back, tag) = dist.group.WORLD, launch.reverse_transport(None)
    c = x.numel() // p
    right, left = (r + 1) % p, (r - 1) % p
    out_pg, out_tag = (back, tag) if right < r else (pg, 0)
    in_pg, in_tag = (back, tag) if r < left else (pg, 0)

    def chunk(i: int) -> torch.Tensor:
        return x[(i % p) * c:(i % p + 1) * c]

    def send(t: torch.Tensor) -> Any:
        return out_pg.send([t], right, out_tag)

    def recv(t: torch.Tensor) -> Any:
        return in_pg.recv([t], left, in_tag)

    sends = [send(chunk(r))]
    recvs = [recv(slots[s]) for s in range(p - 1)]
    for s in range(p - 1):  # reduce-scatter: combine, forward
        recvs[s].wait()
        acc = chunk(r - s - 1)
        acc.add_(slots[s])
        sends.append(send(acc))
    for w in sends[:-1]:  # those chunks are about to be overwritten by the allgather
        w.wait()
    recvs = [recv(chunk(r - s)) for s in range(p - 1)]
    for s in range(p - 1):  # allgather: forward as it arrives
        recvs[s].wait()
        if s < p - 2:
            sends.append(send(chunk(r - s)))
    for w in sends[p - 1:]:
        w.wait()


def rank_lean(nbytes: int, iters: int) -> dict:
    """On every rank: check :func:`lean_ring` against the built-in, then time the built-in,
    pipecomm's ring and the lean ring round-robin. Rank 0 returns ``{name: times}``."""
    p = dist.get_world_size()
    n = nbytes // 4 // p * p
    gen = torch.Generator().manual_seed(dist.get_rank())
    x = torch.randn(n, generator=gen)
    slots = list(torch.empty(p - 1, n // p).unbind(0))
    got, ref = x.clone(), x.clone()
    lean_ring(got, slots)
    dist.all_reduce(ref)
    if not torch.allclose(got, ref, rtol=1e-5, atol=1e-4 * p):
        raise AssertionError("lean_ring disagrees with the built-in allreduce")
    calls = {"built-in": lambda: dist.all_reduce(x),
             "pipecomm ring": lambda: collectives.allreduce(x, algorithm="ring"),
             "lean ring": lambda: lean_ring(x, slots)}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for fn in calls.values():
        bench.time_fn(fn, warmup=2, repeats=1)
    for _ in range(iters):
        for name, fn in calls.items():
            times[name] += bench.time_fn(fn, warmup=0, repeats=1)["times_s"]
    return times


def lean(p: int, nbytes: int, iters: int) -> None:
    with launch.Ranks(p) as ranks:
        times = ranks.run(rank_lean, nbytes, iters, timeout_s=120 + 10 * iters)[0]
    print(f"ring allreduce, {p} ranks, {nbytes / 2**20:g} MiB, {iters} rounds "
          "(median ms; ratio to the built-in, 95% interval):")
    for name, ts in times.items():
        ratio, lo, hi = stats.ratio_ci(ts, times["built-in"])
        print(f"| {name} | {stats.median_ci(ts)[0] * 1e3:.1f} | {ratio:.3f} [{lo:.3f}, {hi:.3f}] |")
    ratio, lo, hi = stats.ratio_ci(times["pipecomm ring"], times["lean ring"])
    print(f"pipecomm ring / lean ring: {ratio:.3f} [{lo:.3f}, {hi:.3f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("flows", "profile", "cpu", "lean"))
    parser.add_argument("--p", type=int, default=8, help="ranks of the lean comparison")
    parser.add_argument("--nbytes", type=int, default=16 << 20)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--algorithm", default="lp")
    parser.add_argument("--algorithms", nargs="+", default=["ring", "lp"])
    parser.add_argument("--op", choices=("allreduce", "broadcast"), default="allreduce")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", default="loopback_profile.txt")
    args = parser.parse_args(argv)
    if args.what == "flows":
        flows(args.nbytes, args.iters)
    elif args.what == "lean":
        if args.p < 2 or args.iters < 2:
            parser.error("lean needs --p >= 2 and --iters >= 2")
        lean(args.p, args.nbytes, args.iters)
    elif args.what == "cpu":
        cpu(args.algorithms, args.op, args.nbytes, args.seconds)
    else:
        profile(args.algorithm, args.op, args.nbytes, args.seconds, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
