"""Functions executed on ranks by test_auto.py (importable by the rank processes): ``algorithm=
"auto"`` against the built-in on the same inputs, the algorithm every member chose, tables that
differ between ranks, the ``pipecomm`` process group and a DDP hook with ``"auto"``."""

from __future__ import annotations

import contextlib
import copy
import itertools
import logging
import os

import torch
import torch.distributed as dist
from rankfns_collectives import make_input, mismatch, oracle

from pipecomm import backend, collectives, hooks, observe
from pipecomm.collectives import agreement, builtin

ENV = builtin.ENV_TUNE_FILE
SIZES = (16, 4096, 1 << 20)  # the table's sizes (bytes)
#: (op, p) -> the fastest algorithm at each of SIZES, in the test's table.
FASTEST = {
    ("allreduce", 3): ("torch", "lp", "be"),
    ("allreduce", 2): ("mst", "ring", "torch"),
    ("broadcast", 3): ("mst", "ring", "lp"),
    ("broadcast", 2): ("torch", "be", "lp"),
    ("reduce", 3): ("lp", "torch", "mst"),
    ("reduce", 2): ("ring", "be", "torch"),
}
_GROUPS: dict = {}


@contextlib.contextmanager
def tune_file(path: str | None):
    """``PIPECOMM_TUNE_FILE`` set to ``path`` (``None``: ``off``) on this rank, restored after."""
    before = os.environ.get(ENV)
    os.environ[ENV] = path or "off"
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


def expected(op: str, p: int, nbytes: int) -> str:
    """The test's own reading of the table: at or past an end of SIZES its end's fastest;
    between two sizes their fastest if both crown the same, else the built-in (in the test's
    table one crowned at one size only is 2 s at the other, against the built-in's 1.5 s)."""
    below = [j for j, n in enumerate(SIZES) if n <= nbytes] or [0]
    above = [j for j, n in enumerate(SIZES) if n >= nbytes] or [len(SIZES) - 1]
    a, b = FASTEST[(op, p)][below[-1]], FASTEST[(op, p)][above[0]]
    return a if a == b else "torch"


def _pair() -> dist.ProcessGroup:
    if "pair" not in _GROUPS:
        _GROUPS["pair"] = dist.new_group([0, 2])
    return _GROUPS["pair"]


def against_builtin(path: str) -> tuple[list[str], dict]:
    """Every op (allreduce sum/avg/max, broadcast, reduce sum/max) on the world of 3 and the
    group (0, 2), float32/int32/bfloat16, 0, 1, 1001 and 30000 elements, synchronous
    and asynchronous: auto's result against the built-in's on the same input (exact where it
    must be, else within round-off of the exact result), and the one range each call counted.
    Returns (failures, {case: range name})."""
    me, pair = dist.get_rank(), _pair()
    failures, chosen = [], {}
    calls = [("allreduce", op) for op in ("sum", "avg", "max")]
    calls += [("broadcast", "sum"), ("reduce", "sum"), ("reduce", "max")]
    with tune_file(path):
        for spec, group in (((0, 1, 2), None), ((0, 2), pair)):
            if me not in spec:
                continue
            root = spec[-1]
            for k, (kind, op) in enumerate(calls):
                for d, dtype in enumerate((torch.float32, torch.int32, torch.bfloat16)):
                    if op == "avg" and not dtype.is_floating_point:
                        continue
                    for numel in (0, 1, 1001, 30000):
                        seed = 1000 * k + 100 * d + numel % 97 + len(spec)
                        x, y = (make_input(seed, me, numel, dtype) for _ in range(2))
                        kw = {} if kind == "broadcast" else {"op": op}
                        kw.update({"src": root} if kind == "broadcast" else
                                  {"dst": root} if kind == "reduce" else {})
                        async_op = numel % 2 == 1
                        observe.reset()
                        h = getattr(collectives, kind)(x, algorithm="auto", group=group,
                                                       async_op=async_op, **kw)
                        if async_op:
                            h.wait()
                        case = f"{kind} {op} {dtype} numel={numel} group={spec}"
                        names = sorted(observe.counters())
                        chosen[case] = names[0] if len(names) == 1 else names
                        want = f"pipecomm.{kind}.auto:" + expected(
                            kind, len(spec), numel * x.element_size())
                        if names != [want]:
                            failures.append(f"rank {me} {case}: counted {names}, want {want}")
                        getattr(collectives, kind)(y, algorithm="torch", group=group, **kw)
                        if kind == "reduce" and me != root:
                            continue
                        if kind == "broadcast":
                            if not torch.equal(x, y):
                                failures.append(f"rank {me} {case}: broadcast differs")
                            continue
                        _, absum = oracle(seed, spec, numel, dtype, op)
                        why = mismatch(x, y.to(torch.float64), 2 * absum, len(spec), op, dtype)
                        if why:
                            failures.append(f"rank {me} {case}: {why}")
    return failures, chosen


def debug_lines(path: str) -> list[str]:
    """The ``pipecomm`` logger's debug lines of a few auto calls: one per new choice."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log, keep = logging.getLogger("pipecomm"), Keep(logging.DEBUG)
    level = log.level
    log.addHandler(keep)
    log.setLevel(logging.DEBUG)
    try:
        with tune_file(path):
            for numel in (3333, 3333, 3000, 300000):  # between 4 KiB and 1 MiB, then past 1 MiB
                collectives.allreduce(torch.ones(numel), algorithm="auto")
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
    return lines


def tables_differ(path: str, *others: str) -> list[str]:
    """Rank 2 reads one of ``others`` (another table that picks LP too; one that picks the
    built-in), ranks 0 and 1 ``path``: every rank raises MismatchError naming each rank's call
    and tuning, synchronously and asynchronously, and no tensor changed; then a call with the
    same table on every rank works."""
    me, failures = dist.get_rank(), []
    for other, async_op in itertools.product(others, (False, True)):
        t = torch.full((1024,), float(me))
        with tune_file(other if me == 2 else path):
            try:
                h = collectives.allreduce(t, algorithm="auto", async_op=async_op)
                if async_op:
                    h.wait()
                failures.append(f"rank {me} async={async_op}: no error")
            except agreement.MismatchError as exc:
                if "tuning=" not in str(exc) or "ranks 0, 1: allreduce(algorithm='lp'" not in str(
                        exc):
                    failures.append(f"rank {me}: the error names no tuning: {exc}")
        if not torch.equal(t, torch.full((1024,), float(me))):
            failures.append(f"rank {me} async={async_op}: the tensor changed")
    with tune_file(path):
        t = torch.full((1024,), float(me))
        collectives.allreduce(t, algorithm="auto")
        if not torch.equal(t, torch.full((1024,), 3.0)):
            failures.append(f"rank {me}: after the mismatch {t[:3]}")
    return failures


def process_group(path: str) -> list[str]:
    """A pipecomm group with algorithm "auto": dist.all_reduce / broadcast / reduce run the
    table's choice (the built-in on the inner backend, no recursion), AVG too; a DDP hook with
    the default state (auto) averages as DDP over gloo does."""
    me, failures = dist.get_rank(), []
    with tune_file(path):
        pg = backend.new_group(algorithm="auto")
        observe.reset()
        for numel, op in ((4, dist.ReduceOp.SUM), (1024, dist.ReduceOp.SUM),  # the table's
                          (4, dist.ReduceOp.AVG), (1 << 18, dist.ReduceOp.MAX)):  # sizes
            x = torch.full((numel,), float(me + 1))
            dist.all_reduce(x, op=op, group=pg)
            want = {dist.ReduceOp.SUM: 6.0, dist.ReduceOp.AVG: 2.0, dist.ReduceOp.MAX: 3.0}[op]
            if not torch.equal(x, torch.full((numel,), want)):
                failures.append(f"rank {me} all_reduce {numel} {op}: {x[:3]}")
        y = torch.full((1024,), float(me))
        dist.broadcast(y, src=1, group=pg)
        z = torch.full((4,), float(me + 1))
        dist.reduce(z, dst=2, group=pg)
        if not torch.equal(y, torch.ones(1024)) or (me == 2 and not torch.equal(
                z, torch.full((4,), 6.0))):
            failures.append(f"rank {me}: broadcast {y[:3]} reduce {z[:3]}")
        names = set(observe.counters())
        want = {"pipecomm.allreduce.auto:torch", "pipecomm.allreduce.auto:lp",
                "pipecomm.allreduce.auto:be", "pipecomm.broadcast.auto:ring",
                "pipecomm.reduce.auto:lp"}
        if names != want:
            failures.append(f"rank {me}: counted {sorted(names)}, want {sorted(want)}")
        torch.manual_seed(0)
        net = torch.nn.Linear(300, 3)
        ref = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net))
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        state = hooks.CollectiveState()
        hooks.register(ddp, state, hooks.allreduce_hook)
        x = torch.randn(4, 300, generator=torch.Generator().manual_seed(me))
        for m in (ddp, ref):
            m(x).square().sum().backward()
        for a, b in zip(ddp.parameters(), ref.parameters()):
            if not torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6):
                failures.append(f"rank {me}: the auto hook's gradient differs from DDP's")
    return failures


def profiled(path: str) -> list[tuple[str, int]]:
    """An asynchronous auto allreduce under torch's profiler (all threads): its ranges, each
    with the number of threads it was seen on."""
    with tune_file(path):
        t = torch.ones(1024)  # 4 KiB, a size of the table
        collectives.allreduce(t.clone(), algorithm="ring", async_op=True).wait()  # the thread
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                    experimental_config=observe.all_threads()) as prof:
            collectives.allreduce(t, algorithm="auto", async_op=True).wait()
    names = sorted({e.name for e in prof.events() if e.name.startswith("pipecomm.")})
    threads = {e.thread for e in prof.events() if e.name.startswith("pipecomm.allreduce.auto")}
    return [(name, len(threads)) for name in names]
