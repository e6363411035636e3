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


# --------------------------------------------------------------------------- the communication log


def test_comm_log_records_every_call_at_p3(pool):
    results = pool(3).run(fns.comm_log, timeout_s=180)
    for res in results:
        assert res["same"]  # the log changes no result
        rows = res["records"]
        assert [(r["op"], r["algorithm"]) for r in rows] == [
            ("allreduce", "lp"), ("allreduce", "ring"), ("allreduce", rows[2]["algorithm"]),
            ("broadcast", "mst"), ("reduce", "lp"), ("allreduce", "be")]
        assert rows[2]["algorithm"].startswith("auto:")
        assert [r["bytes"] for r in rows] == [4096, 4096, 4096, 400, 12 << 20, 0]
        assert all(r["ranks"] == 3 and r["seconds"] >= 0 for r in rows)
        lp = rows[0]
        assert lp["algbw"] == pytest.approx(4096 / lp["seconds"] / 1e9)
        assert lp["busbw"] == pytest.approx(lp["algbw"] * 4 / 3)  # nccl-tests: 2(p-1)/p
        assert rows[3]["busbw"] == pytest.approx(rows[3]["algbw"])
        buckets = {(s["op"], s["algorithm"], s["bucket"]) for s in res["summary"]}
        assert ("allreduce", "lp", 4096) in buckets and ("broadcast", "mst", 512) in buckets
        assert ("allreduce", "be", 1) in buckets
        assert res["columns"][:3] == ["op", "algorithm", "bucket"]
    assert "2" in results[0]["missing"]  # rank 0 names the rank that did not come


def test_comm_log_is_bounded_and_off_by_default():
    import torch.distributed as dist

    from pipecomm import collectives

    assert observe.records() == []
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        collectives.allreduce(torch.ones(4))
        assert observe.records() == []  # off
        observe.log(3)
        for n in range(5):
            collectives.allreduce(torch.ones(n + 1), algorithm="ring")
        assert [r["bytes"] for r in observe.records()] == [12, 16, 20]
        observe.reset()
        assert observe.records() == []
    finally:
        observe.log(0)
        dist.destroy_process_group()


@pytest.mark.parametrize("fn, name", [(observe.log, "capacity"), (observe.flight, "steps")])
def test_bad_sizes_name_the_argument(fn, name):
    with pytest.raises(ValueError, match=name):
        fn(-1)
    with pytest.raises(TypeError, match=name):
        fn("many")


def test_importing_pipecomm_loads_no_pandas():
    import subprocess
    import sys

    code = ("import sys, pipecomm, pipecomm.observe, pipecomm.collectives, pipecomm.backend; "
            "print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=300).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- the flight recorder


def test_flight_recorder_sees_exchange(pool):
    """p2p.exchange's messages (posted together, waited together) are recorded like the
    schedules' own: op, peer, bytes, and posted <= waited <= completed."""
    for rank, msgs in enumerate(pool(3).run(fns.exchanged, 1001)):
        assert [(m["op"], m["peer"], m["bytes"]) for m in msgs] == [
            ("send", (rank + 1) % 3, 4004), ("recv", (rank - 1) % 3, 4004)], msgs
        assert all(m["posted"] <= m["waited"] <= m["completed"] for m in msgs), msgs


def test_flight_recorder_names_the_rank_that_stopped(tmp_path, monkeypatch):
    """p = 3, LP AllReduce of 8 blocks: rank 1 stops before block 3 to rank 2; with a 3 s
    timeout every rank dumps and the tool names rank 1 and that block."""
    import subprocess
    import sys

    from pipecomm.lab.networks import launch
    from pipecomm.lab.networks.launch import flight

    monkeypatch.setenv(flight.ENV_DIR, str(tmp_path))
    with pytest.raises(launch.RankError):
        launch.spawn(fns.lp_hang, 3, 1, 3, 4096, pg_timeout_s=3.0, timeout_s=120)
    dumps = flight.load(tmp_path)
    assert {1, 2} <= set(dumps)  # the waiter (its timeout) and the stopped rank (SIGTERM)
    assert any("SIGTERM" in r for r in dumps[1]["reasons"])
    found = flight.diagnose(dumps)
    assert found["stopped"] == 1 and found["peer"] == 1, found["text"]
    assert "it stopped after its sends" in found["text"]
    assert "block 2 to rank 2" in found["text"], found["text"]  # between blocks 2 and 3
    out = subprocess.run([sys.executable, "-m", "pipecomm.lab.networks.launch.flight",
                          str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "rank 1 waits for nobody: it stopped after" in out.stdout
    assert "pipecomm.allreduce.lp" in out.stdout


def test_diagnose_without_the_peers_dump_and_along_a_chain():
    from pipecomm.lab.networks.launch import flight

    def msg(op, peer, block, waited=None, completed=None):
        return dict(collective="c", call=0, step=block, op=op, peer=peer, block=block, bytes=8,
                    posted=0.0, waited=waited, completed=completed)

    alone = {2: dict(rank=2, reasons=["timeout"], messages=[msg("recv", 1, 0, waited=1.0)])}
    found = flight.diagnose(alone)
    assert found["stopped"] == 1 and "left no dump" in found["text"]
    chain = {0: dict(rank=0, reasons=["x"], messages=[msg("recv", 1, 4, waited=1.0)]),
             1: dict(rank=1, reasons=["x"], messages=[msg("recv", 2, 0, waited=2.0)]),
             2: dict(rank=2, reasons=["x"], messages=[])}
    found = flight.diagnose(chain)
    assert (found["waiter"], found["stopped"]) == (0, 2), found["text"]
    assert flight.diagnose({0: dict(rank=0, messages=[msg("recv", 1, 0, 1.0, 2.0)])}) is None
