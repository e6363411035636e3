"""What pipecomm's profiler ranges and counters (:mod:`pipecomm.observe`) cost with no profiler.

Prints microseconds per call, best of ``--repeats`` rounds of ``--calls`` calls, in one process:

* ``record_function``: ``torch.profiler.record_function`` entered and left around nothing (what
  a range costs if it is entered unconditionally);
* ``check``: the check :mod:`pipecomm.observe` does instead when no profiler runs;
* ``wrapper``: the whole of :func:`pipecomm.observe.ranged` (check, counters, context variable)
  around a function that does nothing, minus that function called bare (the log off);
* ``flight hooks off``: what the transport calls per message with the flight recorder off
  (:func:`pipecomm.observe.posted` and two :func:`pipecomm.observe.stamp`);

then, on ``--world`` local gloo ranks, a blocking 4 KiB (1024 float32) AllReduce, LP and the
built-in (``"torch"``, gloo's; it passes through the same wrapper) (median of ``--repeats``
rounds of ``--allreduce-calls`` calls; rank 0's time), and the ratios of ``wrapper`` and
``record_function`` to it;

then the communication log's and the flight recorder's cost (``--log``): blocking LP AllReduces
of 4 KiB and 16 MiB on ``--world`` ranks with everything off, with :func:`pipecomm.observe.log`
on, and with the log and :func:`pipecomm.observe.flight` on, the three timed side by side in
each of ``--log-rounds`` rounds (order rotated per round); printed: each one's median time per
call and its ratio to "off" (median of the per-round ratios, 95% bootstrap interval). "off" is
the default, so its cost is the recording hooks' checks, which the ratio of log 0 to an
uninstrumented build would show; the ``wrapper`` row above bounds it.

Usage::

    .venv/bin/python benchmarks/bench_observe.py
    .venv/bin/python benchmarks/bench_observe.py --calls 200000 --repeats 7
    .venv/bin/python benchmarks/bench_observe.py --only-log --log-rounds 15
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pipecomm import observe
from pipecomm.lab.networks import launch


def per_call_us(fn: object, calls: int, repeats: int) -> float:
    """Best over ``repeats`` of the mean microseconds per call of ``fn()``."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def _bare(t: torch.Tensor, *, algorithm: str = "lp", async_op: bool = False) -> torch.Tensor:
    return t


def allreduce_us(calls: int, repeats: int, algorithm: str) -> float:
    """Rank function: median over rounds of the microseconds per blocking 4 KiB AllReduce."""
    import torch.distributed as dist

    from pipecomm import collectives

    t = torch.ones(1024)
    for _ in range(20):
        collectives.allreduce(t, algorithm=algorithm)
    rounds = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        for _ in range(calls):
            collectives.allreduce(t, algorithm=algorithm)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


MODES = ("off", "log", "log+flight")


def _mode(mode: str) -> None:
    observe.log(10_000 if mode != "off" else 0)
    observe.flight(1024 if mode == "log+flight" else 0)


def logged_us(nbytes: int, calls: int, rounds: int) -> dict[str, list[float]]:
    """Rank function: per round, microseconds per blocking LP AllReduce of ``nbytes`` with each
    of :data:`MODES` (timed side by side, the order rotated per round)."""
    import torch.distributed as dist

    from pipecomm import collectives

    t = torch.ones(nbytes // 4)
    for _ in range(5):
        collectives.allreduce(t, algorithm="lp")
    out: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in MODES[r % 3:] + MODES[: r % 3]:
            _mode(mode)
            dist.barrier()
            start = time.perf_counter()
            for _ in range(calls):
                collectives.allreduce(t, algorithm="lp")
            out[mode].append((time.perf_counter() - start) / calls * 1e6)
    _mode("off")
    return out


def log_cost(world: int, rounds: int) -> None:
    """Print the log's and the recorder's cost at 4 KiB and 16 MiB (rank 0's times)."""
    from pipecomm.lab.measure import stats

    for nbytes, calls in ((4 << 10, 200), (16 << 20, 3)):
        got = launch.spawn(logged_us, world, nbytes, calls, rounds, timeout_s=1800)[0]
        base = got["off"]
        for mode in MODES:
            med = statistics.median(got[mode])
            ratio, lo, hi = stats.paired_ratio_ci(got[mode], base)
            print(f"allreduce lp {nbytes >> 10:6d} KiB {mode:10s} {med:10.1f} us per call  "
                  f"ratio to off {ratio:.3f} [{lo:.3f}, {hi:.3f}] ({world} ranks, {rounds} rounds)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--allreduce-calls", type=int, default=200)
    p.add_argument("--log-rounds", type=int, default=11)
    p.add_argument("--only-log", action="store_true", help="only the log's and recorder's cost")
    args = p.parse_args(argv)
    if args.only_log:
        log_cost(args.world, args.log_rounds)
        return
    t = torch.ones(1024)

    def rf() -> None:
        with torch.profiler.record_function("pipecomm.allreduce.lp"):
            pass

    wrapped = observe.ranged("allreduce")(_bare)
    bare_us = per_call_us(lambda: _bare(t, algorithm="lp"), args.calls, args.repeats)
    wrapped_us = per_call_us(lambda: wrapped(t, algorithm="lp"), args.calls, args.repeats)
    def hooks() -> None:  # what the transport calls per message: a post, its wait, completion
        e = observe.posted("send", 1, 4096)
        observe.stamp(e, "waited")
        observe.stamp(e, "completed")

    rows = {
        "record_function": per_call_us(rf, args.calls, args.repeats),
        "check": per_call_us(observe.profiling, args.calls, args.repeats),
        "wrapper": wrapped_us - bare_us,
        "flight hooks off": per_call_us(hooks, args.calls, args.repeats),  # per message
    }
    for name, us in rows.items():
        print(f"{name:16s} {us:8.3f} us per call")
    for algorithm in ("lp", "torch"):
        ar = launch.spawn(allreduce_us, args.world, args.allreduce_calls, args.repeats, algorithm)[
            0
        ]
        print(f"allreduce 4KiB {algorithm:5s} {ar:8.1f} us per call ({args.world} ranks)")
        print(f"  wrapper / allreduce = {rows['wrapper'] / ar:.2e}, "
              f"record_function / allreduce = {rows['record_function'] / ar:.2e}")  # fmt: skip
    log_cost(args.world, args.log_rounds)


if __name__ == "__main__":
    main()
