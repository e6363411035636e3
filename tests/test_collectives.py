"""pipecomm.collectives: LP, MST, BE and ring schedules (and the built-in) against oracles.

Two layers:

* In this process, without torch.distributed: the exact schedules run on p threads over a
  simulated transport (per-pair FIFO mailboxes; a send completes only once its receive is posted,
  as on gloo, so a schedule that would deadlock there fails here) that checks message sizes and
  aliasing, counts dependent steps and bytes; results against float64 oracles for p = 1..16, and step counts and
  per-rank bytes against the formulas of docs/algorithms.md.
* On one pool of 8 real ranks (gloo): every group size 1..8 through subgroups (several without
  rank 0), every algorithm, op, dtype, odd sizes, empty tensors, roots other than 0, LP blocks that
  do not divide the message, non-contiguous tensors, asynchronous handles interleaved with
  computation, compression, bad arguments; and against ``algorithm="torch"``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import queue
import sys
import threading
import time
from pathlib import Path

import pytest
import rankfns_collectives as fns
import scripts
import torch

from pipecomm import collectives as C
from pipecomm import compress
from pipecomm.collectives import _chunks, async_, be, lp, mst, ring

SCHEDULES = {"lp": lp, "mst": mst, "be": be, "ring": ring}


# --------------------------------------------------------------------------- simulated transport


RENDEZVOUS_TIMEOUT_S = 20.0  # a simulated send unmatched this long is a deadlock


class _SimNet:
    def __init__(self, p: int) -> None:
        self.p = p
        self.boxes = {(s, d): queue.Queue() for s in range(p) for d in range(p)}
        self.clock = [0] * p  # Lamport depth: the longest chain of dependent messages
        self.sent_bytes = [0] * p
        self.messages = [0] * p
        self.max_msgs_per_peer = 0
        # rendezvous, as gloo does it: a send completes only once its receive is posted
        self.sends = {k: 0 for k in self.boxes}  # messages sent per (src, dst)
        self.posted = {k: 0 for k in self.boxes}  # receives posted per (src, dst)
        self.cond = threading.Condition()


class _SimTransfer:
    def __init__(self, comm, t, peer, send):
        self.comm, self.t, self.peer, self.send = comm, t, peer, send
        self.snapshot = t.clone() if send else None
        self.done = False

    def wait(self) -> None:
        comm = self.comm
        if self.send:
            assert torch.equal(self.t, self.snapshot), "a send buffer changed before its wait"
            net, key = comm.net, (comm.index, self.peer)
            with net.cond:  # the receiver posts it, or the schedule deadlocks on gloo
                matched = net.cond.wait_for(lambda: net.posted[key] > self.seq,
                                            timeout=RENDEZVOUS_TIMEOUT_S)
            assert matched, f"send {key} #{self.seq} never met a posted receive (deadlock)"
            self.done = True
            comm.open_sends.remove(self)
            return
        posted = comm.open_recvs[self.peer]
        while not self.done:  # messages from one peer are matched in posting order
            first = posted.pop(0)
            data, stamp = comm.net.boxes[(self.peer, comm.index)].get(timeout=20)
            assert data.shape == first.t.shape and data.dtype == first.t.dtype, (
                f"rank {comm.index} expected {tuple(first.t.shape)} {first.t.dtype} from "
                f"{self.peer}, got {tuple(data.shape)} {data.dtype}"
            )
            first.t.copy_(data)
            first.done = True
            comm.net.clock[comm.index] = max(comm.net.clock[comm.index], stamp + 1)


class _SimComm:
    """Duck-typed :class:`pipecomm.collectives._group.Comm` on the simulated transport.

    Checks what the progress engine promises: a send buffer is not written before the send is
    waited, every send is waited by the end, a receive buffer overlaps no buffer in flight.
    """

    def __init__(self, net: _SimNet, index: int) -> None:
        self.net, self.index = net, index
        self.open_sends: list[_SimTransfer] = []
        self.open_recvs: dict[int, list[_SimTransfer]] = {i: [] for i in range(net.p)}
        self.max_peers_sending = 0  # most distinct peers with a send in flight at once

    @property
    def size(self) -> int:
        return self.net.p

    def _check(self, t, peer):
        assert t.is_contiguous() and t.dim() == 1, "transfers need contiguous 1-D tensors"
        assert t.numel() > 0, "empty transfers are skipped by the engine"
        assert peer != self.index and 0 <= peer < self.net.p, f"bad peer {peer}"

    def isend(self, t, peer):
        self._check(t, peer)
        tr = _SimTransfer(self, t, peer, True)
        tr.seq = self.net.sends[(self.index, peer)]
        self.net.sends[(self.index, peer)] += 1
        self.net.boxes[(self.index, peer)].put((tr.snapshot, self.net.clock[self.index]))
        self.net.sent_bytes[self.index] += t.nbytes
        self.net.messages[self.index] += 1
        self.open_sends.append(tr)
        self.max_peers_sending = max(self.max_peers_sending,
                                     len({o.peer for o in self.open_sends}))
        return tr

    def irecv(self, t, peer):
        self._check(t, peer)
        a0, a1 = t.data_ptr(), t.data_ptr() + t.nbytes
        for other in self.open_sends + [r for rs in self.open_recvs.values() for r in rs]:
            b0, b1 = other.t.data_ptr(), other.t.data_ptr() + other.t.nbytes
            assert a1 <= b0 or b1 <= a0, "a receive buffer overlaps a buffer in flight"
        tr = _SimTransfer(self, t, peer, False)
        self.open_recvs[peer].append(tr)
        with self.net.cond:
            self.net.posted[(peer, self.index)] += 1
            self.net.cond.notify_all()
        return tr

    direct_posts = True  # Comm.direct's posters (the ring's hot path); False: the engine's

    def direct(self, peer, send, like):
        return _SimPoster(self, peer, send) if self.direct_posts else None

    def finished(self) -> None:
        assert not self.open_sends, f"rank {self.index}: sends never waited"
        assert not any(self.open_recvs.values()), f"rank {self.index}: receives never waited"


class _SimPoster:
    """:class:`pipecomm.collectives.p2p.Direct` on the simulated transport (every check of
    :class:`_SimComm` applies)."""

    def __init__(self, comm: _SimComm, peer: int, send: bool) -> None:
        self.post = comm.isend if send else comm.irecv
        self.peer = peer

    def __call__(self, t):
        return self.post(t, self.peer)

    def record(self) -> None:
        pass


def simulate(p: int, body):
    """Run ``body(comm) -> result`` on p threads; return (results, net). Leftover messages fail."""
    net = _SimNet(p)
    results, errors = [None] * p, []

    def target(i: int) -> None:
        try:
            comm = _SimComm(net, i)
            results[i] = body(comm)
            comm.finished()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((i, exc))

    threads = [threading.Thread(target=target, args=(i,)) for i in range(p)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    leftover = {k: q.qsize() for k, q in net.boxes.items() if q.qsize()}
    assert not leftover, f"messages never received: {leftover}"
    return results, net


def test_simulated_send_waits_for_its_receive(monkeypatch):
    """The simulated transport's rendezvous bites: two ranks that each wait for their send before
    posting the receive deadlock (as on gloo) and fail; posting the receive first works."""
    monkeypatch.setattr(sys.modules[__name__], "RENDEZVOUS_TIMEOUT_S", 0.5)
    x = torch.arange(4.0)

    def send_first(comm):
        comm.isend(x, 1 - comm.index).wait()
        got = torch.empty(4)
        comm.irecv(got, 1 - comm.index).wait()

    def recv_first(comm):
        got = torch.empty(4)
        r = comm.irecv(got, 1 - comm.index)
        comm.isend(x, 1 - comm.index).wait()
        r.wait()
        return got

    with pytest.raises(AssertionError, match="deadlock"):
        simulate(2, send_first)
    out, _ = simulate(2, recv_first)
    assert all(torch.equal(t, x) for t in out)


def _run_sim(kind, alg, p, n, dtype, op="sum", root=0, block_elems=None, codec=None, seed=0):
    inputs = [fns.make_input(seed, r, n, dtype) for r in range(p)]
    sched = SCHEDULES[alg]
    kwargs = {}
    if alg == "lp":
        kwargs["block_elems"] = block_elems or max(1, n // 5 + 1)
    if codec is not None:
        kwargs["codec"] = codec

    def body(comm):
        x = inputs[comm.index].clone()
        if kind == "allreduce":
            sched.allreduce(x, comm, op, **kwargs)
        elif kind == "broadcast":
            sched.broadcast(x, comm, root, **kwargs)
        else:
            sched.reduce(x, comm, root, op, **kwargs)
        return x

    return simulate(p, body), inputs


def _sim_oracle(inputs, op):
    xs = torch.stack([x.double() for x in inputs])
    absum = xs.abs().sum(0)
    if op == "sum":
        return xs.sum(0), absum
    if op == "avg":
        return xs.mean(0), absum / len(inputs)
    return (xs.max(0).values if op == "max" else xs.min(0).values), absum


@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("scratch_bytes", [None, 192])
@pytest.mark.parametrize("alg", ["ring", "lp"])
def test_allreduce_direct_path_is_the_engine_path_bit_for_bit(alg, p, scratch_bytes, monkeypatch):
    """Ring and LP allreduce on direct posts (no engine) and on the engine: the same bits, for
    sizes below, at and across the segment / block size (cut small here), every op and dtypes
    whose rounding shows the order of the combines, with every partial sum's receive posted up
    front or (192 bytes of scratch: three 64-byte slots) rotating slots; the simulator checks
    both paths' buffer discipline (no buffer written while its send is in flight)."""
    from pipecomm.collectives import _engine, lp, ring

    if scratch_bytes is not None:
        monkeypatch.setattr(_engine, "SCRATCH_BYTES", scratch_bytes)
    for n, dtype, op in ((0, torch.float32, "sum"), (1, torch.float32, "sum"),
                         (1001, torch.float16, "sum"), (4099, torch.bfloat16, "avg"),
                         (777, torch.float32, "max"), (513, torch.int64, "min")):
        inputs = [fns.make_input(7, r, n, dtype) for r in range(p)]
        out = {}
        for direct in (True, False):
            monkeypatch.setattr(_SimComm, "direct_posts", direct)

            def body(comm, inputs=inputs, op=op):
                x = inputs[comm.index].clone()
                if alg == "ring":
                    ring.allreduce(x, comm, op, segment_bytes=64)
                else:
                    lp.allreduce(x, comm, op, block_elems=16)
                return x

            out[direct] = simulate(p, body)[0]
        for a, b in zip(out[True], out[False]):
            assert torch.equal(a, b), (p, n, dtype, op)
        assert all(torch.equal(a, out[True][0]) for a in out[True])  # one result everywhere
        want, _ = _sim_oracle(inputs, op)
        if dtype in (torch.float32, torch.int64):
            assert torch.allclose(out[True][0].double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_lp_broadcast_direct_and_engine_paths(p, monkeypatch):
    """LP broadcast on direct posts and on the engine: every rank ends with the root's bits,
    from any root, for blocks that divide the message and blocks that do not."""
    from pipecomm.collectives import lp

    x = fns.make_input(3, 0, 1001, torch.float64)
    for direct in (True, False):
        monkeypatch.setattr(_SimComm, "direct_posts", direct)
        for root, block_elems in ((0, 1001), (p - 1, 100), (p // 2, 7)):

            def body(comm, root=root, block_elems=block_elems):
                flat = x.clone() if comm.index == root else torch.zeros_like(x)
                lp.broadcast(flat, comm, root, block_elems=block_elems)
                return flat

            out, _ = simulate(p, body)
            assert all(torch.equal(t, x) for t in out), (direct, root, block_elems)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
def test_tree_sends_go_one_child_at_a_time(p):
    """The single-port discipline of tree schedules: a rank never has sends to two children in
    flight (on a real network they would share its link and the first child's copy, which its
    subtree waits for, would arrive last); the data is still right (the oracle: the input)."""
    from pipecomm.collectives import mst
    from pipecomm.collectives._chunks import even_offsets
    from pipecomm.collectives._engine import Engine
    from pipecomm.collectives._trees import binomial_scatter

    n = 1001
    x = torch.arange(n, dtype=torch.float64)

    def bcast(comm):
        flat = x.clone() if comm.index == 1 else torch.zeros(n, dtype=torch.float64)
        mst.broadcast(flat, comm, root=1)
        return flat, comm.max_peers_sending

    def scatter(comm):
        flat = x.clone() if comm.index == 0 else torch.zeros(n, dtype=torch.float64)
        eng = Engine(comm)
        offsets = even_offsets(n, p)
        binomial_scatter(flat, eng, offsets, comm.index, p, lambda u: u)
        eng.finish()
        lo, hi = offsets[comm.index], offsets[comm.index + 1]
        return torch.equal(flat[lo:hi], x[lo:hi]), comm.max_peers_sending

    out, _ = simulate(p, bcast)
    assert all(torch.equal(t, x) for t, _ in out) and max(m for _, m in out) == 1
    out, _ = simulate(p, scatter)
    assert all(ok for ok, _ in out) and max(m for _, m in out) == 1


def test_scratch_queue_posts_all_within_the_budget(monkeypatch):
    """Engine.scratch_queue: every receive posted up front when the stream's slots fit in
    SCRATCH_BYTES, else the slots that fit rotate with one fewer receives ahead (at least the
    engine's depth), so a slot is posted again only after its previous message was consumed."""
    from pipecomm.collectives import _engine

    class Posted:
        def wait(self):
            pass

    class Comm:
        size, index = 2, 0
        posted: list = []

        def irecv(self, t, peer):
            self.posted.append(t.data_ptr())
            return Posted()

    like = torch.zeros(1, dtype=torch.float32)
    for budget, slots, ahead in ((1 << 20, 10, 10), (64, 4, 3), (1, 3, 2)):
        monkeypatch.setattr(_engine, "SCRATCH_BYTES", budget)
        comm = Comm()
        comm.posted = []
        q = _engine.Engine(comm).scratch_queue(1, 10, 4, like, lambda j: 4 - j % 2)
        assert len(comm.posted) == ahead
        for j in range(10):
            assert q.wait(j).numel() == 4 - j % 2
            assert len(comm.posted) == min(10, j + 1 + ahead)  # messages 0 .. j + ahead
        # message j + ahead reuses the slot of j + ahead - slots, consumed before j when it exists
        assert ahead == 10 or ahead < slots
        assert len(set(comm.posted)) == slots  # slots rotate, message j in slot j % slots


@pytest.mark.parametrize("budget", [1, 64])
def test_schedules_with_rotating_scratch_match_oracle(monkeypatch, budget):
    """LP and ring with their scratch streams squeezed into rotating slots (a tiny
    SCRATCH_BYTES): the float64 oracle still holds."""
    from pipecomm.collectives import _engine

    monkeypatch.setattr(_engine, "SCRATCH_BYTES", budget)
    for alg in ("lp", "ring"):
        for p in (2, 3, 5, 8):
            for n in (1, 100, 1001):
                for kind in ("allreduce", "reduce"):
                    (res, _), inputs = _run_sim(kind, alg, p, n, torch.float32, "sum", root=p - 1,
                                                block_elems=7, seed=p * n)
                    want, absum = _sim_oracle(inputs, "sum")
                    for r in range(p) if kind == "allreduce" else [p - 1]:
                        why = fns.mismatch(res[r], want, absum, p, "sum", torch.float32)
                        assert why is None, f"{kind} {alg} p={p} n={n} budget={budget}: {why}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("alg", ["lp", "mst", "be", "ring"])
def test_simulated_schedules_match_oracle(alg):
    count = 0
    for p in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16):
        for n in (0, 1, 7, 100, 1001):
            for j in range(2):  # two of the four ops per (p, n), all ops over the sweep
                op = C.OPS[(p + n + 2 * j) % 4]
                case = p * 101 + n * 7 + j
                dtype = fns.DTYPES[case % len(fns.DTYPES)]
                if op == "avg" and not dtype.is_floating_point:
                    dtype = torch.float64
                blk = (1, 3, 16, 64, None)[case % 5]
                if blk is not None and n > 60 * blk:
                    blk = n // 37 + 1  # about 37 blocks, not dividing n
                root = case % p
                # allreduce
                (res, _), inputs = _run_sim(
                    "allreduce", alg, p, n, dtype, op, block_elems=blk, seed=case
                )
                want, absum = _sim_oracle(inputs, op)
                for r in range(p):
                    why = fns.mismatch(res[r], want, absum, p, op, dtype)
                    assert why is None, f"allreduce {alg} p={p} n={n} {op} {dtype} rank {r}: {why}"
                    assert torch.equal(res[r], res[0]), "allreduce results differ between ranks"
                # reduce to a root other than 0
                (res, _), inputs = _run_sim(
                    "reduce", alg, p, n, dtype, op, root=root, block_elems=blk, seed=case
                )
                why = fns.mismatch(res[root], want, absum, p, op, dtype)
                assert why is None, f"reduce {alg} p={p} n={n} {op} root {root}: {why}"
                count += 2
            (res, _), inputs = _run_sim(
                "broadcast", alg, p, n, torch.float32, root=(n + p) % p, block_elems=3
            )
            for r in range(p):
                assert torch.equal(res[r], inputs[(n + p) % p]), f"broadcast {alg} p={p} n={n}"
            count += 1
    assert count == 11 * 5 * 5


_BITS = json.loads((Path(__file__).parent / "data" / "collectives_bits.json").read_text())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg", ["lp", "mst", "be", "ring"])
def test_bit_identical_to_lockstep(alg):
    """The progress engine combines in the lock-step order: the same bits as the lock-step
    implementation recorded (``tests/data/collectives_bits.json``, ``fns.bitwise_cases``)."""
    digests = _BITS["digests"]
    checked = 0
    for case in fns.bitwise_cases():
        kind, a, op, dtype, p, n, root, block, codec, seed = case
        if a != alg:
            continue
        (res, _), _ = _run_sim(
            kind,
            alg,
            p,
            n,
            getattr(torch, dtype),
            op,
            root=root,
            block_elems=block,
            codec=compress.get_codec(codec) if codec else None,
            seed=seed,
        )
        h = hashlib.sha1()
        for r in [root] if kind == "reduce" else range(p):
            h.update(res[r].contiguous().view(torch.uint8).numpy().tobytes())
        assert h.hexdigest() == digests["|".join(map(str, case))], case
        checked += 1
    assert checked >= 60


def _steps(alg: str, kind: str, p: int, k: int) -> int:
    """Dependent steps of each schedule, as in docs/algorithms.md."""
    L = (p - 1).bit_length()
    pp = 1 << (p.bit_length() - 1)
    extra = int(p > pp)
    return {
        ("lp", "broadcast"): k + p - 2,
        ("lp", "reduce"): k + p - 2,
        ("lp", "allreduce"): k + 2 * p - 3,
        ("mst", "broadcast"): L,
        ("mst", "reduce"): L,
        ("mst", "allreduce"): 2 * L,
        ("be", "broadcast"): 2 * int(math.log2(pp)) + extra,
        ("be", "reduce"): extra + 2 * int(math.log2(pp)),
        ("be", "allreduce"): 2 * int(math.log2(pp)) + 2 * extra,
        ("ring", "broadcast"): L + p - 1,
        ("ring", "reduce"): p - 1 + L,
        ("ring", "allreduce"): 2 * (p - 1),
    }[(alg, kind)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg", ["lp", "mst", "be", "ring"])
@pytest.mark.parametrize("kind", ["broadcast", "reduce", "allreduce"])
def test_simulated_dependency_depth_and_bytes(alg, kind):
    """The progress engine never adds dependent steps to the lock-step schedule (the longest chain
    of messages, a Lamport clock, is at most its step count; an LP broadcast's is p - 1: no
    block waits for another block) and moves the bytes of docs/algorithms.md."""
    for p in (2, 3, 4, 5, 6, 7, 8, 11, 16):
        n, block = 48 * 16, 40  # n divisible by every p' and ring chunk sizes within one
        k = math.ceil(n / block)
        (_, net), _ = _run_sim(kind, alg, p, n, torch.float64, root=p // 2, block_elems=block)
        assert max(net.clock) <= _steps(alg, kind, p, k), f"{alg} {kind} p={p}: {net.clock}"
        if alg == "lp" and kind == "broadcast":
            assert max(net.clock) == p - 1
        nbytes, sent = n * 8, max(net.sent_bytes)
        pp = 1 << (p.bit_length() - 1)
        if alg == "lp":
            assert sent == (2 if kind == "allreduce" and p > 2 else 1) * nbytes
            assert max(net.messages) == (2 if kind == "allreduce" and p > 2 else 1) * k
        elif alg == "ring" and kind == "allreduce":
            assert sent <= 2 * (p - 1) * math.ceil(n / p) * 8
        elif alg == "be" and kind == "allreduce" and p == pp:
            assert sent == 2 * (p - 1) * nbytes // p
        elif alg == "mst" and kind == "broadcast":
            assert sent == ((p - 1).bit_length()) * nbytes


@pytest.mark.timeout(60)
def test_ring_segments_same_bits(monkeypatch):
    """Ring chunks cut into segments (down to one element) give the bits of whole chunks."""
    for p, n, dtype, op in (
        (2, 301, "float32", "sum"),
        (3, 209, "float16", "avg"),
        (5, 500, "float64", "max"),
        (8, 209, "bfloat16", "sum"),
    ):
        dt = getattr(torch, dtype)
        whole, _ = _run_sim("allreduce", "ring", p, n, dt, op, seed=p)
        for seg in (8, 1000):
            monkeypatch.setattr(ring, "SEGMENT_BYTES", seg)
            (res, net), _ = _run_sim("allreduce", "ring", p, n, dt, op, seed=p)
            for r in range(p):
                assert torch.equal(res[r], whole[0][r]), (p, n, dtype, op, seg, r)
            chunk_bytes = math.ceil(n / p) * dt.itemsize
            per_chunk = math.ceil(chunk_bytes / max(seg, dt.itemsize))
            assert 2 * (p - 1) * (per_chunk - 1) < max(net.messages) <= 2 * (p - 1) * per_chunk
            for kind in ("broadcast", "reduce"):
                (res, _), inputs = _run_sim(kind, "ring", p, n, dt, op, root=p - 1, seed=p)
                if kind == "broadcast":
                    assert all(torch.equal(x, inputs[p - 1]) for x in res)
        monkeypatch.undo()


def test_ring_default_segments_split_a_whole_chunk_in_two(monkeypatch):
    """Default segments: a chunk that would travel whole is cut in two halves once it holds at
    least twice MIN_SPLIT_BYTES (one message per chunk below, two at and above); a chunk larger
    than SEGMENT_BYTES keeps segments of that size; an explicit segment_bytes is taken as it is."""
    monkeypatch.setattr(ring, "SEGMENT_BYTES", 400)
    monkeypatch.setattr(ring, "MIN_SPLIT_BYTES", 100)
    p = 3
    for n, per_chunk in ((3 * 49, 1), (3 * 50, 2), (3 * 100, 2), (3 * 101, 2), (3 * 250, 3)):
        whole, _ = _run_sim("allreduce", "ring", p, n, torch.float32, "sum", seed=1)
        assert max(whole[1].messages) == 2 * (p - 1) * per_chunk, (n, per_chunk)
    from pipecomm.collectives._chunks import even_offsets

    flat = torch.zeros(300)
    assert ring._Segments(flat, even_offsets(300, 3), None).per_chunk == 2
    assert ring._Segments(flat, even_offsets(300, 3), 400).per_chunk == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alg", ["lp", "ring"])
@pytest.mark.parametrize("name", ["fp16", "bf16", "int8"])
def test_simulated_compression(alg, name):
    codec = compress.get_codec(name)
    rel = {"fp16": 2.0**-11, "bf16": 2.0**-8, "int8": 1 / 254}[name]
    for p in (2, 3, 5, 8):
        for n in (1, 7, 1000):
            for op in ("sum", "avg", "max"):
                (res, net), inputs = _run_sim(
                    "allreduce",
                    alg,
                    p,
                    n,
                    torch.float32,
                    op,
                    block_elems=37,
                    codec=codec,
                    seed=p + n,
                )
                want, absum = _sim_oracle(inputs, op)
                scale = absum.max().item() if op != "max" else inputs[0].abs().max().item() * p
                allowed = 1.05 * (p * rel + (p + 1) * 2.0**-23) * scale + 1e-30
                for r in range(p):
                    assert torch.equal(res[r], res[0]), "compressed results differ between ranks"
                    err = (res[r].double() - want).abs().max().item()
                    assert err <= allowed, f"{alg} {name} p={p} n={n} {op}: {err} > {allowed}"
                if n == 1000:  # what travels is the codec's payload, not the float32 data
                    assert max(net.sent_bytes) < (2 if alg == "lp" else 2 * (p - 1) / p + 0.01) * (
                        codec.payload_nbytes(n) + 4 * 32
                    )


def test_chunks():
    for n in (0, 1, 5, 7, 100):
        for parts in (1, 2, 3, 8):
            off = _chunks.even_offsets(n, parts)
            sizes = [b - a for a, b in zip(off, off[1:])]
            assert off[0] == 0 and off[-1] == n and len(sizes) == parts
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    flat = torch.arange(10)
    assert _chunks.num_blocks(10, 3) == 4 and _chunks.num_blocks(0, 3) == 0
    assert _chunks.block(flat, 3, 3).tolist() == [9]
    assert _chunks.block(flat, 1, 3).data_ptr() == flat[3:].data_ptr()  # a view, no copy


def test_default_block_bytes_is_the_closed_form_optimum_on_the_set_link():
    import math

    assert lp.link() == lp.DEFAULT_LINK
    try:
        lp.set_link(1e-3, 50e6)
        for kind in ("broadcast", "reduce", "allreduce"):
            for nbytes, p in ((10, 8), (1 << 20, 8), (3 << 22, 3), (1 << 20, 2)):
                b = lp.default_block_bytes(kind, nbytes, p)
                m = p - 2 if kind != "allreduce" else 2 * p - 3  # steps beyond the k blocks
                if nbytes <= lp.MIN_BLOCK_BYTES or m <= 0:
                    assert b == nbytes  # one block
                    continue
                star = math.sqrt(nbytes * 1e-3 * 50e6 / m)  # b* = sqrt(n alpha / (m beta))
                assert b == min(nbytes, max(lp.MIN_BLOCK_BYTES, -(-math.ceil(star) // 8) * 8))
        # encoded blocks: the block that is best on the wire, in uncompressed bytes
        wire = lp.default_block_bytes("allreduce", 1 << 22, 4)
        assert abs(lp.default_block_bytes("allreduce", 1 << 23, 4, 2.0) - 2 * wire) <= 16
        with pytest.raises(ValueError, match="bandwidth_Bps"):
            lp.set_link(1e-3, 0)
    finally:
        lp.set_link(*lp.DEFAULT_LINK)


def test_async_handle_unit():
    t = torch.zeros(3)
    h = async_.submit(lambda: time.sleep(0.3), t, "slow job")
    with pytest.raises(TimeoutError, match="slow job"):
        h.wait(timeout_s=0.01)
    assert h.wait(timeout_s=30) is t and h.is_completed()

    def boom():
        raise ZeroDivisionError("inside the thread")

    order = []
    h1 = async_.submit(lambda: order.append(1), t)
    h2 = async_.submit(boom, t)
    h3 = async_.submit(lambda: order.append(3), t)
    assert h3.wait(timeout_s=30) is t
    assert h1.is_completed() and h2.is_completed() and order == [1, 3]  # FIFO, keeps going
    with pytest.raises(ZeroDivisionError, match="inside the thread"):
        h2.wait()
    assert "done" in repr(h1)


class _FakeCuda:
    """A stand-in for ``torch.cuda`` that logs what the stream ordering does, in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.current = self.Stream(self, "caller")
        self.made = 0

    def Stream(self, owner=None, name=None, device=None):  # noqa: N802 - torch.cuda's name
        fake = self if owner is None else owner
        cuda = fake

        class _S:
            def __init__(self, name):
                self.name = name

            def wait_event(self, ev):
                cuda.log.append(("wait_event", self.name, ev.name))

        if name is None:
            fake.made += 1
            name = f"comm{fake.made}"
        return _S(name)

    def Event(self):  # noqa: N802
        cuda = self

        class _E:
            name = f"event{len(cuda.log)}"

            def record(self, stream):
                cuda.log.append(("record", self.name, stream.name))

        return _E()

    def current_stream(self, device=None):
        return self.current

    @contextlib.contextmanager
    def stream(self, s):
        self.log.append(("enter stream", s.name))
        yield
        self.log.append(("exit stream", s.name))

    @contextlib.contextmanager
    def device(self, d):
        self.log.append(("enter device", str(d)))
        yield


class _FakeCudaTensor:
    device = torch.device("cuda", 0)
    is_cuda = True

    def __init__(self, cuda):
        self.cuda = cuda

    def record_stream(self, s):
        self.cuda.log.append(("record_stream", s.name))


def test_stream_ordering_cpu_fallback_and_fake_cuda(monkeypatch):
    from pipecomm.collectives import _streams

    # CPU fallback: no ordering object, the job runs as it is and wait() adds nothing
    t = torch.zeros(4)
    assert _streams.order_for(t) is None
    h = async_.submit(lambda: t.add_(1), t)
    assert h.wait(timeout_s=30) is t and h._on_wait is None and t.tolist() == [1.0] * 4
    # CUDA path with a stand-in torch.cuda: the job runs on its own stream, after an event of the
    # caller's stream, and wait() orders the caller's stream after the job's end event
    cuda = _FakeCuda()
    monkeypatch.setattr(_streams, "order_for", lambda x: _streams.CudaOrder(x.device, cuda))
    x = _FakeCudaTensor(cuda)
    ran = []
    h = async_.submit(lambda: (ran.append(1), cuda.log.append(("job",))), x)
    assert h.wait(timeout_s=30) is x and ran == [1]
    names = [e[0] for e in cuda.log]
    assert names == [
        "record",
        "record_stream",
        "enter device",
        "enter stream",
        "wait_event",
        "job",
        "record",
        "exit stream",
        "wait_event",
    ], cuda.log
    ready, done = cuda.log[0][1], cuda.log[6][1]
    comm = cuda.log[1][1]
    assert cuda.log[0][2] == "caller" and comm.startswith("comm")
    assert cuda.log[4] == ("wait_event", comm, ready)  # the comm stream waits for the producer
    assert cuda.log[6][2] == comm  # the end event is on the comm stream
    assert cuda.log[8] == ("wait_event", "caller", done)  # caller's stream waits in wait()
    # one communication stream per device, reused by later jobs
    h = async_.submit(lambda: None, x)
    h.wait(timeout_s=30)
    assert {e[1] for e in cuda.log if e[0] == "enter stream"} == {comm}


def test_validation_before_any_setup():
    # these fail before torch.distributed is even consulted
    with pytest.raises(TypeError, match="t must be a torch.Tensor"):
        C.allreduce([1, 2])
    with pytest.raises(ValueError, match="algorithm"):
        C.reduce(torch.ones(2), algorithm="bucket")
    with pytest.raises(TypeError, match="avg"):
        C.allreduce(torch.ones(2, dtype=torch.int32), op="avg")
    if not torch.distributed.is_initialized():  # this process never joins a group
        with pytest.raises(RuntimeError, match="not initialised"):
            C.allreduce(torch.ones(2))
    assert C.ALGORITHMS == ("lp", "mst", "be", "ring", "torch")
    assert C.OPS == ("sum", "avg", "max", "min")


# --------------------------------------------------------------------------- real ranks


def _check(results):
    failures = [f for r in results for f in (r[0] if isinstance(r, tuple) else r)]
    assert not failures, "\n".join(failures[:20])


def _check_digests(results, cases):
    for idx, case in enumerate(cases):
        spec = case[5]
        ranks = range(8) if spec is None else spec
        ds = {results[r][1].get(idx) for r in ranks}
        assert len(ds) == 1, f"allreduce results differ between ranks: {case}"


@pytest.mark.timeout(240)
def test_allreduce_oracle_all_groups(pool):
    results = pool(8).run(fns.sweep, "allreduce", timeout_s=200)
    _check(results)
    _check_digests([r for r in results], fns.sweep_cases("allreduce"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["broadcast", "reduce"])
def test_rooted_oracle_all_groups(pool, kind):
    _check(pool(8).run(fns.sweep, kind, timeout_s=200))


@pytest.mark.timeout(240)
def test_large_messages(pool):
    results = pool(8).run(fns.sweep_large, timeout_s=200)
    _check(results)


@pytest.mark.timeout(240)
def test_matches_builtin(pool):
    _check(pool(8).run(fns.compare_with_builtin, timeout_s=200))


@pytest.mark.timeout(240)
def test_noncontiguous_and_requires_grad(pool):
    _check(pool(8).run(fns.noncontiguous_and_grad, timeout_s=200))


def test_unemulated_messages_skip_dist_isend(pool):
    _check(pool(8).run(fns.lean_path, timeout_s=200))


@pytest.mark.timeout(240)
def test_async_interleaved_with_computation(pool):
    results = pool(8).run(fns.async_interleaved, timeout_s=200)
    _check(results)
    for _, overlapped in results:
        assert all(overlapped.values()), overlapped  # completed while the main thread computed


@pytest.mark.timeout(240)
def test_batched_posts_path(pool):
    """The NCCL path (posts collected and issued as one batch at every wait), forced on gloo:
    no deadlock and correct results for every algorithm and kind."""
    _check(pool(8).run(fns.batched_posts, timeout_s=120))


@pytest.mark.timeout(240)
def test_bad_arguments(pool):
    _check(pool(8).run(fns.bad_arguments, timeout_s=200))


@pytest.mark.timeout(240)
def test_world_of_one(pool):
    _check(pool(1).run(fns.world_of_one, timeout_s=200))


@pytest.mark.timeout(240)
def test_compressed_allreduce(pool):
    numel, block_bytes = 1000, 120
    results = pool(8).run(fns.compressed_allreduce, numel, block_bytes, timeout_s=200)
    by_case = {}
    for out, _ in results:
        for row in out:
            by_case.setdefault((row["alg"], row["codec"], row["dtype"], row["spec"]), []).append(
                row
            )
    assert len(by_case) == 2 * 3 * 2 * 2
    rel = {"fp16": 2.0**-11, "bf16": 2.0**-8, "int8": 1 / 254}
    for (alg, name, dtype, spec), rows in by_case.items():
        p = rows[0]["p"]
        assert len(rows) == p and len({r["digest"] for r in rows}) == 1, (alg, name, spec)
        eps = 2.0**-10 if "float16" in dtype else 2.0**-23
        for r in rows:
            allowed = 1.05 * (p * rel[name] + (p + 1) * eps) * r["scale"]
            assert r["err"] <= allowed, (alg, name, dtype, spec, r["err"], allowed)
            codec = compress.get_codec(name)
            if alg == "lp":
                e = block_bytes // (2 if "float16" in dtype else 4)
                sizes = [min(e, numel - j) for j in range(0, numel, e)]
                k = len(sizes)
                assert r["encodes"] == k
                middle = 0 < r["index"] < p - 1 or r["index"] == p - 1
                assert r["decodes"] == (2 * k if middle else k)
            else:
                off = _chunks.even_offsets(numel, p)
                sizes = [b - a for a, b in zip(off, off[1:])]
                assert (r["encodes"], r["decodes"]) == (p, 2 * p - 1)
            assert r["encoded_bytes"] == sum(codec.payload_nbytes(s) for s in sizes)
    names = {d for _, d in results}
    assert len(names) == 1  # compression="fp16" by name: identical on every rank
    first = by_case[("lp", "fp16", "torch.float32", None)][0]["digest"]
    assert names == {first}  # and identical to the same codec passed as an object


@pytest.mark.timeout(240)
def test_under_emulated_network(pool):
    from pipecomm.lab.networks import netem

    net = netem.Network(5e-3, 10e6, ports="single")  # the pool test_netem.py uses as well
    numel = 12000
    results = pool(4, network=net).run(fns.under_emulation, numel, timeout_s=200)
    _check(results)
    lp.set_link(net.alpha_s, net.bandwidth_Bps)
    try:
        for _, blocks in results:
            for kind, b in blocks.items():  # the default LP block comes from the emulated link
                assert b == lp.default_block_bytes(kind, numel * 4, 4)
    finally:
        lp.set_link(*lp.DEFAULT_LINK)
    assert blocks["allreduce"] != lp.default_block_bytes("allreduce", numel * 4, 4)


@pytest.mark.timeout(240)
def test_each_direction_of_a_pair_has_its_own_connection(pool):
    results = pool(8).run(fns.duplex_routes, timeout_s=120)
    _check(results)
    tags = {r[1] for rank, r in enumerate(results) if rank in (1, 4, 6)}
    assert len(tags) == 1 and None not in tags  # the members agree on the subgroup's tag


@pytest.mark.timeout(240)
def test_concurrent_collectives_on_groups_sharing_ranks(pool):
    _check(pool(8).run(fns.concurrent_groups, 30, 5000, timeout_s=200))


def test_cuda_overlap_benchmark_runs_its_cpu_fallback(tmp_path):
    """benchmarks/bench_cuda_overlap.py (the GPU stream-overlap measurement) on the CPU: the same
    code path without streams; the ordering check passes and the JSON has every field (also for
    the two-rank real LP allreduce job)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "o.json"
    bench = _benchmark("bench_cuda_overlap")
    for job in ("reduce", "copy", "lp-allreduce"):
        argv = ["--repeats", "2", "--job", job, "--json", str(out)]
        if job == "lp-allreduce":  # its ranks import the script by name: a process of its own
            proc = subprocess.run([sys.executable, str(root / "benchmarks/bench_cuda_overlap.py"),
                                   *argv], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
        else:
            assert bench.main(argv) == 0
        res = json.loads(out.read_text())
        assert res["correct"] and res["device"] == "cpu"
        assert {"compute_s", "comm_s", "both_s", "serial_s", "overlap"} <= set(res)


@pytest.mark.timeout(240)
def test_host_staged_transport(pool):
    """The path CUDA tensors take on gloo (through host buffers), forced on CPU tensors: the
    results equal the oracle's. The GPU itself ran tools/gpu_collectives_check.py (ARTIFACT.md)."""
    _check(pool(3).run(fns.staged_transport, 5003, timeout_s=200))


def test_collectives_benchmark_quick_run_and_summary(tmp_path, capsys):
    """benchmarks/bench_collectives.py --quick (LP, ring and the built-in, allreduce and
    broadcast, p = 2, with the A/A rows of --aa; every algorithm's #wrong is tested against the
    built-in elsewhere): #wrong 0, the built-in's own ratio 1, the A/A ratio a positive interval
    around its median; --summary turns the CSV into ARTIFACT.md's table and refuses a CSV without
    rows of the requested size; --aa without the built-in is refused."""
    import csv as csvmod
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parents[1] / "benchmarks/bench_collectives.py")
    out = tmp_path / "b.csv"
    proc = subprocess.run([sys.executable, script, "--quick", "--algorithms", "lp", "ring",
                           "torch", "--ops", "allreduce", "broadcast", "--aa", "--lp-blocks",
                           "3", "--check-cost", "--csv", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = list(csvmod.DictReader(out.open()))
    # algorithms (+ lp/3, + A/A, + the check alone, + lp and ring without it, + the built-in
    # behind torch's own check) x ops x sizes
    assert len(rows) == 9 * 2 * 2
    assert ("| p | size | check alone (ms) | lp: added by the check | lp: check alone / call | "
            "ring: added by the check | ring: check alone / call | torch: added by its own check "
            "(DETAIL) |") in proc.stdout
    assert all(r["wrong"] == "0" for r in rows)
    for r in rows:  # LP in 3 blocks: ceil(n / 3) bytes, rounded up to whole float32 elements
        if r["algorithm"] == "lp/3":
            n = int(r["nbytes"])
            assert int(r["block_bytes"]) == -(-n // 12) * 4 and float(r["model_s"]) > 0
    assert all(float(r["ratio"]) == 1.0 for r in rows if r["algorithm"] == "torch")
    assert all(float(r["pratio"]) == 1.0 for r in rows if r["algorithm"] == "torch")  # paired
    assert all(0 < float(r["pratio_lo"]) <= float(r["pratio"]) <= float(r["pratio_hi"])
               for r in rows)
    aa = [r for r in rows if r["algorithm"] == "torch-aa"]
    assert len(aa) == 4 and all(
        0 < float(r["ratio_lo"]) <= float(r["ratio"]) <= float(r["ratio_hi"]) for r in aa)
    for r in rows:  # CPU: every repeat's core-seconds over the ranks, and its ratio's interval
        cpus = [float(c) for c in r["cpu_times_s"].split(";")]
        assert len(cpus) == int(r["repeats"]) and all(c > 0 for c in cpus)
        assert float(r["busy"]) > 0 and float(r["cpu_s"]) > 0
        assert 0 < float(r["cpu_ratio_lo"]) <= float(r["cpu_ratio"]) <= float(r["cpu_ratio_hi"])
    assert all(float(r["cpu_ratio"]) == 1.0 for r in rows if r["algorithm"] == "torch")
    bench = _benchmark("bench_collectives")  # the rest reads CSVs or refuses: in this process
    code, text, err = scripts.call_main(bench.main, ["--summary", str(out), "--min-size", "1M"], capsys)
    lines = text.splitlines()
    assert code == 0
    assert lines[0].startswith("| op | p | size | lp | ring | lp/3 | torch-aa | built-in")
    assert len(lines) == 2 + 2 and "| allreduce | 2 | 1 MiB |" in text
    code, text, err = scripts.call_main(bench.main, ["--summary", str(out)], capsys)
    assert code == 2 and "no rows of 16M or more" in err
    code, text, err = scripts.call_main(bench.main, ["--cpu-summary", str(out), "--min-size", "1M"],
                                  capsys)
    lines = text.splitlines()
    assert code == 0, err
    assert lines[0].startswith("| op | p | size | lp: wall / cpu ratio (busy) | ring: ")
    assert len(lines) == 2 + 2 and "| broadcast | 2 | 1 MiB |" in text
    code, text, err = scripts.call_main(bench.main, ["--check-summary", str(out)], capsys)
    assert code == 0 and len(text.splitlines()) == 2 + 2 * 2, err
    old_csv = tmp_path / "old.csv"  # written before the CPU columns
    old_csv.write_text("algorithm,op,p,nbytes,ratio\ntorch,allreduce,2,1048576,1.0\n")
    code, text, err = scripts.call_main(bench.main, ["--cpu-summary", str(old_csv), "--min-size", "1M"],
                                  capsys)
    assert code == 2 and "no CPU columns" in err
    code, text, err = scripts.call_main(bench.main, ["--aa", "--algorithms", "lp"], capsys)
    assert code == 2 and "include torch" in err
    code, text, err = scripts.call_main(bench.main, ["--lp-blocks", "0"], capsys)
    assert code == 2 and "--lp-blocks" in err


def test_collectives_benchmark_targets_from_the_csv_ratios(tmp_path, capsys):
    """bench_collectives.py --targets decides issue 13's loopback targets (benchmark rows, not
    claims) from the CSV's own ratio columns and the script's TARGET_BOUNDS (ring allreduce at
    most 1.15x, LP allreduce at most 1.3x the built-in, every p, messages >= 16 MiB): PASS when
    every point's 95% interval lies at or below the bound, FAIL when one lies wholly above, else
    INCONCLUSIVE; LP broadcast MET when its interval lies inside the A/A interval at every point,
    NOT MET otherwise, not decided without A/A rows; a CSV without 16 MiB messages is refused."""
    import csv as csvmod

    bc = _benchmark("bench_collectives")
    assert bc.TARGET_BOUNDS == {("allreduce", "ring"): 1.15, ("allreduce", "lp"): 1.3}

    def write(name, ring, lp_ar, lp_bc, aa=True, nbytes=16 << 20):
        """One row per algorithm, op and p (2, 4); ring / lp_ar / lp_bc: (ratio, lo, hi) per p."""
        rows = []
        for i, q in enumerate((2, 4)):
            cells = [("ring", "allreduce", ring[i]), ("lp", "allreduce", lp_ar[i]),
                     ("lp", "broadcast", lp_bc[i]), ("torch", "allreduce", (1.0, 1.0, 1.0)),
                     ("torch", "broadcast", (1.0, 1.0, 1.0))]
            if aa:
                cells += [(bc.AA, op, (1.0, 0.95, 1.05)) for op in ("allreduce", "broadcast")]
            rows += [{"algorithm": alg, "op": op, "p": q, "nbytes": nbytes, "ratio": r,
                      "ratio_lo": lo, "ratio_hi": hi} for alg, op, (r, lo, hi) in cells]
        path = tmp_path / name
        with path.open("w", newline="") as f:
            w = csvmod.DictWriter(f, fieldnames=bc.COLUMNS, restval="")
            w.writeheader()
            w.writerows(rows)
        return path

    good = write("good.csv", [(1.05, 1.0, 1.1)] * 2, [(1.2, 1.1, 1.25)] * 2,
                 [(1.0, 0.97, 1.03)] * 2)
    assert bc.main(["--targets", str(good)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ring allreduce <= 1.15x the built-in (every p, messages >= 16M, "
                               "95% interval): PASS: 2 of 2 points at or below, 0 wholly above; "
                               "worst 1.05 [1.00, 1.10] (p=2, 16M)")
    assert lines[1].startswith("lp allreduce <= 1.3x the built-in") and ": PASS: " in lines[1]
    assert lines[2].startswith("lp broadcast at parity with the built-in") \
        and "MET at 2 of 2 points" in lines[2] and "NOT MET" not in lines[2]
    bad = write("bad.csv", [(1.05, 1.0, 1.1), (1.25, 1.2, 1.3)],  # p = 4 wholly above 1.15
                [(1.3, 1.2, 1.4), (1.2, 1.1, 1.25)],  # p = 2 straddles 1.3
                [(1.0, 0.9, 1.03), (1.0, 0.97, 1.03)])  # p = 2 wider than the A/A interval
    lines = bc.targets(bad).splitlines()
    assert ": FAIL: 1 of 2 points at or below, 1 wholly above; worst 1.25 [1.20, 1.30] (p=4" \
        in lines[0]
    assert ": INCONCLUSIVE: 1 of 2 points at or below, 0 wholly above" in lines[1]
    assert "NOT MET at 1 of 2 points" in lines[2] and "0.90, 1.03] inside A/A" in lines[2]
    no_aa = write("noaa.csv", [(1.05, 1.0, 1.1)] * 2, [(1.2, 1.1, 1.25)] * 2,
                  [(1.0, 0.97, 1.03)] * 2, aa=False)
    lines = bc.targets(no_aa).splitlines()
    assert ": PASS: " in lines[0] and lines[2].endswith("not decided: no torch-aa rows "
                                                        "(run with --aa)")
    small = write("small.csv", [(1.05, 1.0, 1.1)] * 2, [(1.2, 1.1, 1.25)] * 2,
                  [(1.0, 0.97, 1.03)] * 2, nbytes=1 << 20)
    with pytest.raises(SystemExit) as exc:
        bc.main(["--targets", str(small)])
    assert exc.value.code == 2 and "no ring allreduce rows" in capsys.readouterr().err


def test_collectives_benchmark_paired_targets_after_their_aa_check(tmp_path, capsys):
    """--targets CSV --paired: the paired A/A check counts the torch-aa intervals that exclude 1
    against stats.misses_allowed (12 intervals: 2 allowed) and only then decides the same targets
    on the paired ratios (allreduces within their bounds PASS; LP broadcast 1.04 [1.01, 1.08] is
    NOT MET: not inside the A/A interval); with 3 misses the paired verdicts are "not usable"; a
    CSV without paired columns, and --paired without --targets, are refused (in this process: no
    rank starts)."""
    bench = _benchmark("bench_collectives")

    def csv_with(aa_misses: int):
        rows, i = ["algorithm,op,p,nbytes,pratio,pratio_lo,pratio_hi"], 0
        for q in (2, 4, 8):
            for op in ("broadcast", "allreduce"):
                for n in (16 << 20, 64 << 20):
                    rows.append(f"torch-aa,{op},{q},{n},"
                                + ("1.03,1.01,1.05" if i < aa_misses else "1.0,0.97,1.03"))
                    i += 1
                    rows += ([f"lp,{op},{q},{n},1.04,1.01,1.08"] if op == "broadcast" else
                             [f"lp,{op},{q},{n},1.2,1.15,1.25", f"ring,{op},{q},{n},1.05,1.0,1.1"])
        path = tmp_path / f"p{aa_misses}.csv"
        path.write_text("\n".join(rows) + "\n")
        return path

    lines = bench.paired_targets(csv_with(2)).splitlines()
    assert lines[0].startswith("paired A/A check PASS: 2 of 12 intervals exclude 1 (at most 2")
    assert lines[1].startswith("ring allreduce <= 1.15x paired PASS: 6 of 6 points")
    assert lines[2].startswith("lp allreduce <= 1.3x paired PASS")
    assert lines[3].startswith("lp broadcast at parity paired NOT MET at 0 of 6 points: p=2 16M: "
                               "1.04 [1.01, 1.08] inside A/A")
    lines = bench.paired_targets(csv_with(3)).splitlines()
    assert lines[0].startswith("paired A/A check FAIL: 3 of 12")
    assert lines[1].startswith("ring allreduce <= 1.15x paired not usable: 6 of 6 points")
    assert lines[3].startswith("lp broadcast at parity paired not usable: at 0 of 6")
    old = tmp_path / "old.csv"
    old.write_text("algorithm,op,p,nbytes,ratio,ratio_lo,ratio_hi\n" + "".join(
        f"{a},{op},2,{16 << 20},1.0,0.95,1.05\n"
        for op, algs in (("broadcast", ("torch", "lp")), ("allreduce", ("torch", "lp", "ring")))
        for a in algs))  # the unpaired verdicts print, then the paired reading is refused
    for argv, message in ((["--targets", str(old), "--paired"], "no paired ratios"),
                          (["--paired"], "--paired goes with --targets")):
        with pytest.raises(SystemExit) as exc:
            bench.main(argv)
        assert exc.value.code == 2 and message in capsys.readouterr().err


def test_loopback_lean_ring_matches_builtin_and_reports(capsys):
    """benchmarks/loopback_flows.py lean on 3 ranks and a size no chunk count divides evenly
    (the script trims it to whole chunks): its bare-ProcessGroup ring agrees with the built-in
    allreduce (the script refuses to time it otherwise) and every contender gets a ratio line;
    too few rounds are refused."""
    import subprocess
    import sys
    from pathlib import Path

    script = str(Path(__file__).resolve().parents[1] / "benchmarks/loopback_flows.py")
    proc = subprocess.run([sys.executable, script, "lean", "--p", "3", "--iters", "2",
                           "--nbytes", "40004"], capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("built-in", "pipecomm ring", "lean ring"):
        assert f"| {name} |" in proc.stdout
    assert "pipecomm ring / lean ring:" in proc.stdout
    with pytest.raises(SystemExit) as exc:  # refused before any rank starts: in this process
        _loopback_flows().main(["lean", "--iters", "1"])
    assert exc.value.code == 2 and "--iters >= 2" in capsys.readouterr().err


def _benchmark(name: str):
    """benchmarks/<name>.py as a module."""
    return scripts.load(f"benchmarks/{name}.py")


def _loopback_flows():
    """benchmarks/loopback_flows.py as a module."""
    return _benchmark("loopback_flows")


def test_loopback_cpu_profile_categories():
    """benchmarks/loopback_flows.py cpu: perf report lines land in their categories (first match
    wins), shares are fractions of all samples, unknown lines count as 'other'."""
    mod = _loopback_flows()
    report = """# header line
    30.00%  gloo_tcp_loop  [kernel.kallsyms]  [k] _copy_to_iter
    10.00%  python  libtorch_cpu.so  [.] gloo::sum<float>
     8.00%  python  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
     7.00%  python  [kernel.kallsyms]  [k] tcp_sendmsg_locked
     6.00%  python  [kernel.kallsyms]  [k] _raw_spin_unlock_irqrestore
     5.00%  swapper  [kernel.kallsyms]  [k] pv_native_safe_halt
     4.00%  python  [kernel.kallsyms]  [k] do_syscall_64
     3.00%  python  libc.so.6  [.] malloc
"""
    got = mod.cpu_shares(report)
    want = {"data copies": 0.30, "reductions": 0.10, "Python interpreter": 0.08,
            "TCP/IP stack": 0.07, "scheduling, wake-ups, polling": 0.06, "idle": 0.05,
            "other kernel": 0.04, "other user": 0.03}
    assert got == pytest.approx(want)
    assert list(got) == [name for name, _ in mod.CATEGORIES]


@pytest.mark.timeout(240)
def test_agreement_allgather_one_round_and_bruck(pool):
    _check(pool(8).run(fns.agreement_allgather, timeout_s=120))


@pytest.mark.timeout(240)
def test_mismatched_calls_raise_on_every_rank(pool):
    """Size, dtype, root, op, empty and LP-block disagreements at p = 2, 3, 5, each algorithm,
    synchronous and asynchronous: every member raises, naming both sides; nothing changed."""
    _check(pool(8).run(fns.mismatched_calls, timeout_s=200))


@pytest.mark.timeout(120)
def test_torch_detail_group_raises_on_every_rank(pool):
    """What the benchmark compares pipecomm's check with is torch's own: on a group of
    ``sweep.detail_group`` a size disagreement raises on every member (the p = 1 case is the
    doctest)."""
    _check(pool(3).run(fns.torch_detail_mismatch, timeout_s=60))


def test_link_limits_and_parity(tmp_path):
    """The link limits of a shaped network (n / B for a broadcast, 2 (N - 1) / N * n / B for an
    allreduce over N nodes; the goals on them are E15's claims); bench_collectives.py's --parity
    on A/A rows and --cluster's argument checks."""
    import csv as csvmod

    from pipecomm.lab.measure import bench

    bc = _benchmark("bench_collectives")
    n = 16 << 20
    assert bench.link_limit_s("broadcast", n, 8, 15e6) == n / 15e6
    assert bench.link_limit_s("allreduce", n, 8, 15e6) == pytest.approx(1.75 * n / 15e6)
    assert bench.link_limit_s("allreduce", n, 8, 15e6, ranks_per_node=2) == pytest.approx(
        1.5 * n / 15e6)
    assert bench.link_limit_s("reduce", n, 2, 15e6, ranks_per_node=2) == 0.0
    assert bc.parse_rate("15M") == 15e6 and bc.parse_rate("2.5e6") == 2.5e6
    for bad in ("fast", "-1M", "0"):
        with pytest.raises(Exception, match="rate"):
            bc.parse_rate(bad)

    def write(path, rows):
        with path.open("w", newline="") as f:
            w = csvmod.DictWriter(f, fieldnames=bc.COLUMNS, restval="")
            w.writeheader()
            w.writerows(rows)
        return path

    def row(alg, op, p, ratio, lo, hi, time_s=2.0, link_s=1.0):
        return {"algorithm": alg, "op": op, "p": p, "nbytes": n, "ratio": ratio,
                "ratio_lo": lo, "ratio_hi": hi, "time_s": time_s, "ci_lo_s": 0.9 * time_s,
                "ci_hi_s": 1.1 * time_s, "link_s": link_s}

    par = write(tmp_path / "par.csv", [
        row("lp", "broadcast", 8, 1.0, 0.97, 1.02), row("torch-aa", "broadcast", 8, 1.0, 0.95, 1.05),
        row("lp", "broadcast", 4, 1.0, 0.90, 1.02), row("torch-aa", "broadcast", 4, 1.0, 0.95, 1.05),
    ])
    assert "at 1 of 2 points" in bc.parity(par)
    with pytest.raises(SystemExit):
        bc.main(["--ranks-per-node", "2"])  # without --cluster
