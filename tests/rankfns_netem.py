"""Functions run on rank pools by tests/test_netem.py (module level, so ranks can import them)."""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist

from pipecomm.collectives.p2p import exchange
from pipecomm.lab.networks import launch, netem


def _fill(nbytes: int, src: int, dst: int, k: int) -> torch.Tensor:
    """A recognisable payload for message k from src to dst."""
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + src * 31 + dst * 17 + k * 5) % 251).to(
        torch.uint8
    )


def _sleep_until(t: float) -> None:
    while True:
        now = time.monotonic()
        if now >= t:
            return
        time.sleep(t - now)


def timed_pattern(pattern, nbytes: int, reps: int = 3, lead_s: float = 0.03, delays=None):
    """Post the messages ``pattern`` (list of (src, dst)) from a common start time ``T``.

    Each rank posts its sends (in pattern order) and its receives in one ``exchange`` at
    ``T + delays.get(rank, 0)``. Returns, per repetition, ``(T, start, end, ok)`` of this rank;
    ``start`` and ``end`` are read from the rank's emulated clock (``netem.clock()``: the
    monotonic clock shared by all ranks of the host, minus the wake-up lateness the virtual
    clock forgave); ``ok`` says the payloads arrived intact.
    """
    rank = dist.get_rank()
    delays = delays or {}
    out = []
    for rep in range(reps + 1):  # repetition 0 warms up and is not reported
        sends, recvs, expected = [], [], []
        for k, (src, dst) in enumerate(pattern):
            if src == rank:
                sends.append((_fill(nbytes, src, dst, k), dst))
            if dst == rank:
                buf = torch.zeros(nbytes, dtype=torch.uint8)
                recvs.append((buf, src))
                expected.append(_fill(nbytes, src, dst, k))
        dist.barrier()
        t = torch.tensor([time.monotonic() + lead_s], dtype=torch.float64)
        dist.broadcast(t, 0)
        start_at = float(t[0])
        _sleep_until(start_at + delays.get(rank, 0.0))
        start = netem.clock()
        exchange(sends, recvs)
        end = netem.clock()
        ok = all(torch.equal(b, e) for (b, _), e in zip(recvs, expected))
        if rep:
            out.append((start_at, start, end, ok))
    dist.barrier()
    return out


def stats_after(pattern, nbytes: int, reps: int = 3):
    """``timed_pattern`` preceded by ``netem.reset_stats()``; returns (timings, stats)."""
    netem.reset_stats()
    timings = timed_pattern(pattern, nbytes, reps)
    return timings, netem.stats()


def network_info():
    """What the rank sees: its network and its description."""
    net = netem.current()
    return net, (net.describe() if net else None)


_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]


def _payload(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 50
    if dtype == torch.bool:
        return x > 0
    if dtype == torch.complex64:
        return torch.complex(x, -x).to(dtype)
    return x.to(dtype)


def ring_roundtrip():
    """Send to the right and receive from the left, many dtypes and shapes (empty, 0-d, odd),
    two messages to the same peer in one exchange; returns a list of failures (empty = good)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    shapes = [(0,), (), (1,), (7, 3), (1001,), (16383,), (16384,), (5, 4001)]
    failures = []
    for i, dtype in enumerate(_DTYPES):
        sends, recvs, expected = [], [], []
        for j, shape in enumerate(shapes):
            sends.append((_payload(dtype, shape, 1000 * rank + 10 * i + j), right))
            recvs.append((torch.zeros(shape, dtype=dtype), left))
            expected.append(_payload(dtype, shape, 1000 * left + 10 * i + j))
        exchange(sends, recvs)
        for j, ((got, _), want) in enumerate(zip(recvs, expected)):
            if not torch.equal(got, want):
                failures.append(f"rank {rank}: dtype {dtype} shape {shapes[j]}")
    exchange([], [])  # nothing to do is fine
    return failures


def bad_exchange(kind: str):
    """Call exchange with a bad argument; return the exception's type name and message."""
    t = torch.zeros(4, 4)
    peer = (dist.get_rank() + 1) % dist.get_world_size()
    try:
        if kind == "noncontiguous":
            exchange([(t.t(), peer)], [])
        elif kind == "notensor":
            exchange([([1, 2], peer)], [])
        return None
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)


def concurrent_groups(nbytes: int, iters: int):
    """The main thread exchanges around the ring to the right on the world group while a second
    thread exchanges to the left on ``launch.comm_group()``, both at once, as the asynchronous
    collectives do. Returns the number of corrupted messages (0 = good)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    bad = [0, 0]

    def run(slot: int, to: int, frm: int, group) -> None:
        for k in range(iters):
            buf = torch.zeros(nbytes + slot, dtype=torch.uint8)
            exchange([(_fill(nbytes + slot, rank, to, k), to)], [(buf, frm)], group=group)
            if not torch.equal(buf, _fill(nbytes + slot, frm, rank, k)):
                bad[slot] += 1

    thread = threading.Thread(target=run, args=(1, left, right, launch.comm_group()))
    thread.start()
    run(0, right, left, None)
    thread.join()
    dist.barrier()
    return sum(bad)


def use_virtual_clock(on: bool) -> bool:
    """Turn the virtual clock on (p2p waits through ``netem.wait_until``, which forgives late
    wake-ups) or off (no lateness is ever forgiven: the emulator before the virtual clock).
    Returns whether it was on."""
    from pipecomm.collectives import p2p

    if not hasattr(use_virtual_clock, "original"):
        use_virtual_clock.original = getattr(p2p, "_sleep_until", None)
        use_virtual_clock.on = True
    was = use_virtual_clock.on
    if use_virtual_clock.original is not None:  # p2p's own sleep: route it through netem
        p2p._sleep_until = netem.wait_until if on else use_virtual_clock.original
    emu = netem.emulator()
    if on:
        emu.clock.__dict__.pop("settle", None)
    else:
        emu.clock.lag = 0.0
        emu.clock.settle = lambda deadline, t0, woke: deadline
    use_virtual_clock.on = on
    return was


def pingpong(nbytes: int, iters: int = 5, warmup: int = 2, modes=None):
    """E0's emulated ping-pong: pairs (2i, 2i+1) at once; the even rank reports per iteration
    the one-way time (half the round trip) on the wall clock and on ``netem.clock()``.
    ``modes`` (one bool per iteration, warm-up included) switches the virtual clock on or off
    before each iteration, for paired comparisons under the same load; then each reported item
    is ``(mode, wall, emulated)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    one = torch.zeros(1, dtype=torch.uint8)
    for _ in range(3):
        exchange([(one, peer)], [(one, peer)])
    wall, virtual, out = [], [], []
    for i in range(warmup + iters):
        if modes is not None:
            use_virtual_clock(modes[i])
        dist.barrier()
        start, vstart = time.perf_counter(), netem.clock()
        if rank % 2 == 0:
            exchange([(buf, peer)], [])
            exchange([], [(buf, peer)])
        else:
            exchange([], [(buf, peer)])
            exchange([(buf, peer)], [])
        if i >= warmup:
            wall.append((time.perf_counter() - start) / 2)
            virtual.append((netem.clock() - vstart) / 2)
            if modes is not None:
                out.append((modes[i], wall[-1], virtual[-1]))
    dist.barrier()
    if rank % 2 or peer >= world:
        return None
    return out if modes is not None else (wall, virtual)


def chain(nbytes: int, hops: int, reps: int = 3, modes=None):
    """A lock-step chain around the ring: rank 0 sends, each rank forwards what it received to
    its right, ``hops`` messages in all; the last receiver reports the wall and
    ``netem.clock()`` time of the chain per repetition (the lateness of every wake-up adds up
    along it without the virtual clock). ``modes`` as in :func:`pingpong` (one per repetition,
    the warm-up included); then each item is ``(mode, wall, emulated)``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    out = []
    for rep in range(reps + 1):
        if modes is not None:
            use_virtual_clock(modes[rep])
        dist.barrier()
        start, vstart = time.perf_counter(), netem.clock()
        for k in range(hops):
            if k % world == rank:
                exchange([(buf, right)], [])
            if (k + 1) % world == rank:
                exchange([], [(buf, left)])
        item = (time.perf_counter() - start, netem.clock() - vstart)
        out.append(item if modes is None else (modes[rep], *item))
    dist.barrier()
    return out[1:] if rank == hops % world else None


def late_chain(nbytes: int, hops: int, late_s: float, virtual: bool, reps: int = 2):
    """:func:`chain` with every emulated wait waking ``late_s`` after its deadline (the host's
    scheduling lateness, made large and certain), with p2p waiting through its own sleep
    (``virtual=False``) or through ``netem.wait_until`` (the virtual clock)."""
    import types

    from pipecomm.collectives import p2p

    def late_sleep(seconds: float) -> None:
        time.sleep(seconds + late_s)

    late = types.SimpleNamespace(monotonic=time.monotonic, sleep=late_sleep)
    from pipecomm.lab.networks.netem import emulation

    saved = (p2p.time, emulation.time, use_virtual_clock(virtual))  # p2p.time: its own sleep
    p2p.time = emulation.time = late
    try:
        return chain(nbytes, hops, reps)
    finally:
        p2p.time, emulation.time = saved[0], saved[1]
        use_virtual_clock(saved[2])
