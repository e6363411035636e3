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
