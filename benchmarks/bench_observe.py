"""What pipecomm's profiler ranges and counters (:mod:`pipecomm.observe`) cost with no profiler.

Prints microseconds per call, best of ``--repeats`` rounds of ``--calls`` calls, in one process:

* ``record_function``: ``torch.profiler.record_function`` entered and left around nothing (what
  a range costs if it is entered unconditionally);
* ``check``: the check :mod:`pipecomm.observe` does instead when no profiler runs;
* ``wrapper``: the whole of :func:`pipecomm.observe.ranged` (check, counters, context variable)
  around a function that does nothing, minus that function called bare;

then, on ``--world`` local gloo ranks, a blocking 4 KiB (1024 float32) AllReduce, LP and the
built-in (``"torch"``, gloo's; it passes through the same wrapper) (median of ``--repeats``
rounds of ``--allreduce-calls`` calls; rank 0's time), and the ratios of ``wrapper`` and
``record_function`` to it.

Usage::

    .venv/bin/python benchmarks/bench_observe.py
    .venv/bin/python benchmarks/bench_observe.py --calls 200000 --repeats 7
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--allreduce-calls", type=int, default=200)
    args = p.parse_args(argv)
    t = torch.ones(1024)

    def rf() -> None:
        with torch.profiler.record_function("pipecomm.allreduce.lp"):
            pass

    wrapped = observe.ranged("allreduce")(_bare)
    bare_us = per_call_us(lambda: _bare(t, algorithm="lp"), args.calls, args.repeats)
    wrapped_us = per_call_us(lambda: wrapped(t, algorithm="lp"), args.calls, args.repeats)
    rows = {
        "record_function": per_call_us(rf, args.calls, args.repeats),
        "check": per_call_us(observe.profiling, args.calls, args.repeats),
        "wrapper": wrapped_us - bare_us,
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


if __name__ == "__main__":
    main()
