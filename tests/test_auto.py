"""algorithm="auto": the choice (a measured table, else the alpha-beta model on a set link, else
the built-in), the table file (its sizes and between them, damaged or foreign files ignored with one warning,
atomic writes), and on real ranks: results against the built-in's at p = 2 and 3, every member
choosing alike (and all raising when their tables differ), the counters, the profiler's range,
the debug line, a pipecomm process group with ``"auto"`` and a DDP hook with its default."""

from __future__ import annotations

import itertools
import json
import math
import warnings
from pathlib import Path

import pytest
import rankfns_auto as fns
import torch

from pipecomm import backend, collectives, hooks
from pipecomm.collectives import builtin, lp
from pipecomm.lab.measure import autotune
from pipecomm.lab.networks import cost


def _doc(fastest: dict, fp: str | None = None, link=lp.DEFAULT_LINK) -> dict:
    """A table document whose fastest algorithm at ``fns.SIZES[j]`` is ``fastest[(op, p)][j]``
    (1 s; the others 2 s, the built-in 1.5 s)."""
    rows = [{"op": op, "world_size": p, "nbytes": n, "algorithm": a,
             "time_s": 1.0 if a == best else 1.5 if a == "torch" else 2.0}
            for (op, p), algs in fastest.items() for n, best in zip(fns.SIZES, algs)
            for a in collectives.ALGORITHMS]
    return autotune.table_of(rows, fp or builtin.fingerprint(), link)


@pytest.fixture
def table(tmp_path, monkeypatch):
    """``table(doc_or_text)`` -> its path, a file of its own, named by PIPECOMM_TUNE_FILE."""
    count = itertools.count()

    def put(doc) -> str:
        path = tmp_path / f"tune{next(count)}.json"
        if isinstance(doc, dict):
            autotune.write_table(doc, path)
        else:
            path.write_text(doc)
        monkeypatch.setenv(builtin.ENV_TUNE_FILE, str(path))
        return str(path)

    return put


@pytest.fixture
def link():
    """``link(alpha_s, bandwidth_Bps)`` sets LP's link; the default is back afterwards."""
    yield lp.set_link
    lp.set_link(*lp.DEFAULT_LINK)


# --------------------------------------------------------------------------- the choice


def test_nothing_known_is_the_builtin(monkeypatch):
    monkeypatch.setenv(builtin.ENV_TUNE_FILE, "off")
    assert builtin.tune_path() is None and builtin.tune_table() is None
    for kind, p, n in itertools.product(("allreduce", "broadcast", "reduce"), (2, 3, 8),
                                        (0, 4096, 1 << 26)):
        assert builtin.choose(kind, n, p) == "torch"
        # without the built-in (an emulated network, a codec): the model on the default link
        assert builtin.choose(kind, n, p, allowed=("lp", "ring")) in ("lp", "ring")


def test_the_model_on_a_set_link_keeps_the_builtin_unless_clearly_faster(monkeypatch, link):
    monkeypatch.setenv(builtin.ENV_TUNE_FILE, "off")
    link(1e-3, 15e6)  # a shaped network's link, 15 MB/s
    assert builtin.choose("broadcast", 16 << 20, 8) == "lp"  # 3.7x the built-in's, measured
    assert builtin.choose("allreduce", 16 << 20, 8) == "torch"  # ring = the built-in
    assert builtin.choose("reduce", 16 << 20, 8) == "torch"  # LP's reduce about the built-in's
    assert builtin.choose("allreduce", 16 << 20, 8, allowed=("lp", "ring")) == "ring"
    assert builtin.choose("allreduce", 4096, 8, allowed=("lp", "mst", "be", "ring")) == "be"


def test_the_model_is_the_lab_lockstep_model(link):
    for (alpha, bw), kind, alg, p, n in itertools.product(
            ((160e-6, 2.5e9), (1e-3, 15e6)), ("allreduce", "broadcast", "reduce"),
            ("lp", "mst", "be", "ring"), (1, 2, 3, 5, 8, 13), (0, 4, 4096, 12289, 3 << 22)):
        link(alpha, bw)
        block = lp.default_block_bytes(kind, n, p) if alg == "lp" else None
        want = cost.collective_time(kind, alg, n, p, cost.LinkModel.from_bandwidth(alpha, bw),
                                    block)
        assert math.isclose(builtin.model_s(kind, alg, n, p), want, rel_tol=1e-9,
                            abs_tol=1e-15), (kind, alg, p, n)


def test_the_table_at_its_sizes_and_between(table, link):
    table(_doc(fns.FASTEST))
    for (op, p), n in itertools.product(fns.FASTEST, (0, 1, 16, 100, 2000, 3000, 4096, 60_000,
                                                     70_000, 1 << 20, 1 << 28)):
        assert builtin.choose(op, n, p) == fns.expected(op, p, n), (op, p, n)
    assert builtin.choose("allreduce", 4096, 3, dtype=torch.float16) == "lp"  # float32's rows
    assert builtin.choose("allreduce", 3000, 5) == "torch"  # no rows for p = 5
    assert builtin.choose("allreduce", 3000, 3, device="cuda") == "torch"
    assert builtin.choose("allreduce", 1 << 20, 3, allowed=("lp", "ring")) in ("lp", "ring")
    link(1e-3, 15e6)  # LP's times were measured with other blocks: not used
    assert builtin.choose("allreduce", 4096, 3) == "torch"  # LP's size
    assert builtin.choose("broadcast", 1 << 20, 3) == "torch"  # the next fastest after LP


def _damaged() -> dict[str, str]:
    good = _doc(fns.FASTEST)
    text = json.dumps(good)
    edited = json.loads(text)
    edited["points"]["allreduce:cpu:3:float32"]["4096"]["lp"] = 9.0  # digest now wrong
    negative = json.loads(text)
    negative["points"]["allreduce:cpu:3:float32"]["4096"]["lp"] = -1.0
    negative["digest"] = builtin.tune_digest(negative["points"])
    unknown = json.loads(text)
    unknown["points"]["allreduce:cpu:3:float32"]["4096"]["nccl"] = 0.1
    unknown["digest"] = builtin.tune_digest(unknown["points"])
    return {
        "not json": "{not json",
        "truncated": text[: len(text) // 2],
        "not an object": "[1, 2]",
        "format": json.dumps({**good, "format": "pipecomm-tune/0"}),
        "fingerprint": json.dumps(_doc(fns.FASTEST, fp="0" * 16)),
        "digest": json.dumps(edited),
        "negative time": json.dumps(negative),
        "unknown algorithm": json.dumps(unknown),
        "no link": json.dumps({k: v for k, v in good.items() if k != "link"}),
    }


@pytest.mark.parametrize("case", list(_damaged()))
def test_a_damaged_or_foreign_table_is_ignored_with_one_warning(table, case):
    path = table(_damaged()[case])
    with pytest.warns(RuntimeWarning, match="ignoring the tuning table") as seen:
        assert builtin.choose("allreduce", 4096, 3) == "torch"  # as if there were none
    assert len(seen) == 1 and path in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert builtin.choose("broadcast", 1 << 20, 3) == "torch"  # no second warning


def test_the_table_is_written_atomically_and_read_once(table, tmp_path):
    path = table(_doc(fns.FASTEST))
    assert builtin.read_table(path)["digest"] == json.loads(Path(path).read_text())["digest"]
    assert builtin.choose("allreduce", 4096, 3) == "lp"
    with pytest.raises(TypeError):  # a document that cannot be written leaves the old one
        autotune.write_table({"points": {1, 2}}, path)
    assert builtin.read_table(path) is not None
    assert [p.name for p in tmp_path.iterdir()] == ["tune0.json"]  # no temporary file left
    autotune.write_table(_doc({("allreduce", 3): ("be", "be", "be")}), path)
    assert builtin.choose("allreduce", 4096, 3) == "lp"  # this process keeps its first look
    assert builtin.read_table("/nonexistent/tune.json") is None


def test_the_fingerprint_tells_networks_apart(monkeypatch):
    def fingerprint() -> str:
        builtin._network.cache_clear()  # read once per process: afresh for each case
        return builtin.fingerprint()

    for k in ("MASTER_ADDR", "LOCAL_WORLD_SIZE", "WORLD_SIZE", *builtin.NETWORK_ENV):
        monkeypatch.delenv(k, raising=False)
    one_host = fingerprint()
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # one host: its interface does not matter
    assert fingerprint() == one_host
    monkeypatch.setenv("PIPECOMM_NETWORK", "shaped 15 MB/s")
    assert fingerprint() != one_host
    monkeypatch.delenv("PIPECOMM_NETWORK")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")  # several hosts: the rendezvous, interface
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    many = fingerprint()
    assert many != one_host
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert fingerprint() != many
    monkeypatch.undo()
    assert fingerprint() == one_host


def test_an_emulated_network_is_another_network_without_the_builtin(monkeypatch, link):
    from pipecomm.collectives import api, p2p

    class Emulated(p2p.Interposer):
        delays = True

        def describe(self) -> str:
            return "8 ranks at 15 MB/s"

    monkeypatch.setenv(builtin.ENV_TUNE_FILE, "off")
    real = builtin.fingerprint()
    p2p.set_interposer(Emulated())
    try:
        assert builtin.fingerprint() != real
        t = torch.ones(1 << 22)  # 16 MiB
        link(1e-3, 15e6)  # what the emulator sets
        monkeypatch.setattr(api, "members_of", lambda group: tuple(range(8)))
        assert api.auto_choice("broadcast", t, group=None) == "lp"  # never the built-in here
        assert api.auto_choice("allreduce", t, group=None) in ("be", "ring")
        assert builtin.choose("broadcast", 16 << 20, 8, allowed=("lp", "mst", "be", "ring")) == "lp"
    finally:
        p2p.set_interposer(None)
    assert builtin.fingerprint() == real


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="algorithm must be one of .*'auto'"):
        collectives.allreduce(torch.ones(2), algorithm="automatic")
    with pytest.raises(ValueError, match="algorithm"):
        hooks.CollectiveState(algorithm="Auto")
    with pytest.raises(ValueError, match="compression"):
        backend.Options("auto", compression="zip")
    assert backend.Options("auto", compression="fp16").algorithm == "auto"
    assert backend.options_from_env({backend.ENV_ALGORITHM: "auto"}) == backend.Options("auto")
    assert hooks.CollectiveState().algorithm == hooks.PipelinedState().algorithm == "auto"


# --------------------------------------------------------------------------- real ranks


def _check(results):
    failures = [f for r in results for f in (r[0] if isinstance(r, tuple) else r)]
    assert not failures, "\n".join(failures[:20])


_TABLES = itertools.count()


@pytest.fixture
def tables(tmp_path):
    """``tables(n)``: n valid tables for the ranks, each of a digest no other test used (ranks
    that agreed on a table once do not check it again)."""
    def make(n: int, fastest: dict = fns.FASTEST) -> list[str]:
        out = []
        for _ in range(n):
            i = next(_TABLES)
            doc = _doc(fastest)
            doc["points"]["allreduce:cpu:9:float32"] = {str(4096 + i): {"lp": 1.0}}
            doc["digest"] = builtin.tune_digest(doc["points"])
            out.append(str(autotune.write_table(doc, tmp_path / f"ranks{i}.json")))
        return out
    return make


@pytest.mark.timeout(240)
def test_auto_matches_the_builtin_and_every_member_chooses_alike(pool, tables):
    (path,) = tables(1)
    ranks = pool(3)
    assert len(set(ranks.run(builtin.fingerprint))) == 1
    results = ranks.run(fns.against_builtin, path, timeout_s=200)
    _check(results)
    by_case: dict[str, set] = {}
    for _, chosen in results:
        for case, name in chosen.items():
            by_case.setdefault(case, set()).add(str(name))
    assert len(by_case) > 100 and all(len(names) == 1 for names in by_case.values())


@pytest.mark.timeout(120)
def test_ranks_with_different_tables_all_raise(pool, tables):
    builtin_only = {**fns.FASTEST, ("allreduce", 3): ("torch",) * 3}
    _check(pool(3).run(fns.tables_differ, *tables(2), *tables(1, builtin_only), timeout_s=100))


@pytest.mark.timeout(120)
def test_the_choice_shows_in_the_profiler_and_the_debug_log(pool, tables):
    path = tables(1)[0]
    for res in pool(3).run(fns.profiled, path, timeout_s=100):
        ranges = dict(res)
        assert ranges.get("pipecomm.allreduce.auto:lp") == 2, res  # caller and comm thread
    for lines in pool(3).run(fns.debug_lines, path, timeout_s=100):
        # 13332 B twice and 12000 B: one choice (between 4 KiB and 1 MiB, which crown lp and be:
        # the built-in); 1.2 MB, past the last size: another
        assert len(lines) == 2, lines
        assert ("allreduce of 13332 B over 3 ranks (float32) -> torch (measured at 4096 B and "
                "1048576 B)") in lines[0]
        assert "-> be (measured at 1048576 B)" in lines[1]


@pytest.mark.timeout(180)
def test_a_process_group_with_auto_and_the_hook_default(pool, tables):
    _check(pool(3).run(fns.process_group, tables(1)[0], timeout_s=150))


def test_between_two_sizes_the_least_worst_ratio_to_the_builtin(table):
    """LP is crowned at 64 KiB (half the built-in's time) and loses at 1 MiB (1.5x): between the
    two it could be slower than the built-in, so auto takes what is below 0.95 of the built-in at
    both (ring, 0.9 and 0.8), though it is crowned at neither; past an end, that end's fastest."""
    times = {1 << 16: {"lp": 0.5, "ring": 0.9, "torch": 1.0, "mst": 2.0},
             1 << 20: {"lp": 1.5, "ring": 0.8, "torch": 1.0, "mst": 0.7}}
    rows = [{"op": "allreduce", "world_size": 4, "nbytes": n, "algorithm": a, "time_s": s}
            for n, ts in times.items() for a, s in ts.items()]
    table(autotune.table_of(rows, builtin.fingerprint(), lp.DEFAULT_LINK))
    pick = {n: builtin.choose("allreduce", n, 4) for n in (1 << 10, 1 << 16, 1 << 18, 1 << 20,
                                                          1 << 24)}
    assert pick == {1 << 10: "lp", 1 << 16: "lp", 1 << 18: "ring", 1 << 20: "mst",
                    1 << 24: "mst"}
    assert builtin.choose("allreduce", 1 << 18, 4, allowed=("lp", "torch")) == "torch"
    assert builtin.choose("allreduce", 1 << 18, 4, allowed=("lp", "mst")) == "lp"  # 1.5 vs 2.0
