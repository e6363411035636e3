"""Rank functions for tests/test_observe.py (pipecomm.observe)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from pipecomm import collectives, observe


def profiled(out: str) -> dict:
    """Three collectives under torch's profiler (all threads): the trace's pipecomm ranges with
    their thread ids, the main thread's id, and the counters."""
    import threading

    t = torch.ones(4096)
    collectives.allreduce(t.clone(), algorithm="ring", async_op=True).wait()  # start the thread
    observe.reset()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=observe.all_threads()
    ) as prof:
        collectives.allreduce(t, algorithm="lp")
        collectives.allreduce(t, algorithm="ring", op="avg", async_op=True).wait()
        collectives.broadcast(t[:100], 0, algorithm="mst")
    path = Path(out) / f"trace_rank{dist.get_rank()}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    ranges = [
        (e["name"], e.get("tid")) for e in events if str(e.get("name")).startswith("pipecomm.")
    ]
    counters = observe.counters()
    observe.reset()
    return dict(ranges=ranges, counters=counters, after_reset=observe.counters(),
                main_tid=threading.get_native_id())  # fmt: skip


def comm_log() -> dict:
    """The communication log at this world size: every kind of call logged once (an empty
    tensor too), results as without the log, and monitored_barrier on a pipecomm group."""
    import datetime

    import pipecomm.backend

    rank, p = dist.get_rank(), dist.get_world_size()
    x = torch.arange(1024, dtype=torch.float32) * (rank + 1)
    plain = collectives.allreduce(x.clone(), algorithm="lp", block_bytes=1024)
    observe.log(100)
    try:
        logged = collectives.allreduce(x.clone(), algorithm="lp", block_bytes=1024)
        collectives.allreduce(x.clone(), algorithm="ring", async_op=True).wait()
        collectives.allreduce(x.clone(), algorithm="auto")
        collectives.broadcast(x[:100].clone(), 0, algorithm="mst")
        collectives.reduce(torch.ones(3 << 20, dtype=torch.uint8).to(torch.int32), 0,
                           algorithm="lp")
        collectives.allreduce(torch.empty(0), algorithm="be")
        records, summary = observe.records(), observe.records(summarised=True)
        frame = observe.records(summarised=True, frame=True)
    finally:
        observe.log(0)
    pg = pipecomm.backend.new_group(algorithm="lp")
    pg.gloo.monitored_barrier(datetime.timedelta(seconds=30))
    missing = None
    if rank != p - 1:  # the last rank skips the barrier: rank 0 names it
        try:
            pg.gloo.monitored_barrier(datetime.timedelta(seconds=2))
        except RuntimeError as exc:
            missing = str(exc)
    return dict(same=bool(torch.equal(plain, logged)), records=records, summary=summary,
                columns=list(frame.columns), missing=missing)


def lp_hang(stop_rank: int, stop_block: int, block_bytes: int) -> None:
    """An LP AllReduce in which ``stop_rank`` stops (sleeps far past the group's timeout) just
    before it sends block ``stop_block`` to its right neighbour."""
    import time

    from pipecomm.collectives import p2p

    rank = dist.get_rank()
    if rank == stop_rank:
        post = p2p.Direct.__call__
        sent = {"n": 0}

        def hanging(self, t):
            if self._send and self.rank == rank + 1:
                if sent["n"] == stop_block:
                    time.sleep(600)
                sent["n"] += 1
            return post(self, t)

        p2p.Direct.__call__ = hanging
    collectives.allreduce(torch.ones(8 * block_bytes // 4), algorithm="lp",
                          block_bytes=block_bytes)


def exchanged(n: int) -> list[dict]:
    """One :func:`pipecomm.collectives.p2p.exchange` of ``n`` float32 with the next rank (ring
    order) under the flight recorder: this rank's recorded messages."""
    from pipecomm.collectives.p2p import exchange

    rank, p = dist.get_rank(), dist.get_world_size()
    observe.flight(64)
    try:
        exchange([(torch.ones(n), (rank + 1) % p)], [(torch.empty(n), (rank - 1) % p)])
        return observe.flight_records()
    finally:
        observe.flight(0)
