"""pipecomm.observe: profiler ranges around every collective (also on the communication
thread), per-rank counters, and no record_function while no profiler runs."""

from __future__ import annotations

import pytest
import rankfns_observe as fns
import torch

from pipecomm import observe


def test_ranges_on_both_threads_and_counters(pool, tmp_path):
    for res in pool(2).run(fns.profiled, str(tmp_path), timeout_s=120):
        names = {name for name, _ in res["ranges"]}
        assert {
            "pipecomm.allreduce.lp",
            "pipecomm.allreduce.ring",
            "pipecomm.broadcast.mst",
        } <= names
        ring_tids = {tid for name, tid in res["ranges"] if name == "pipecomm.allreduce.ring"}
        assert len(ring_tids) == 2  # the call on the main thread, the transfers on the comm thread
        c = res["counters"]
        assert c["pipecomm.allreduce.lp"]["calls"] == 1
        assert c["pipecomm.allreduce.lp"]["bytes"] == 4096 * 4
        assert c["pipecomm.broadcast.mst"]["bytes"] == 100 * 4
        assert all(row["seconds"] > 0 for row in c.values())
        assert res["after_reset"] == {}


def test_no_record_function_without_a_profiler(monkeypatch):
    def refuse(name):
        raise AssertionError(f"record_function({name!r}) entered without a profiler")

    monkeypatch.setattr(torch.profiler, "record_function", refuse)

    @observe.ranged("allreduce")
    def fake(t, *, algorithm="lp", async_op=False):
        return t

    observe.reset()
    t = torch.zeros(10)
    assert fake(t, algorithm="ring") is t
    assert fake(t) is t
    c = observe.counters()
    assert c["pipecomm.allreduce.ring"]["calls"] == 1 and c["pipecomm.allreduce.lp"]["bytes"] == 40
    assert observe.totals()["calls"] == 2
    observe.reset()


def test_failed_calls_are_not_counted():
    @observe.ranged("reduce")
    def broken(t, *, algorithm="lp"):
        raise ValueError("bad")

    observe.reset()
    with pytest.raises(ValueError):
        broken(torch.zeros(3))
    assert observe.counters() == {}
