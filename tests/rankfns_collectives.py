"""Functions executed on ranks by test_collectives.py (importable by the rank processes).

Every rank builds its input deterministically from (seed, global rank), so each rank can rebuild
all members' inputs and compute the expected result in float64 itself (the oracle). Functions
return lists of failure descriptions (empty = all good) plus whatever the test compares across
ranks.
"""

from __future__ import annotations

import hashlib
import time

import torch
import torch.distributed as dist

from pipecomm import collectives as C

ALGS = ("lp", "mst", "be", "ring", "torch")
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
DTYPES = (torch.float32, torch.int64, torch.float64, torch.int32, torch.float16, torch.bfloat16)

# Groups of sizes 1..8 for a world of 8 (global ranks; several exclude rank 0).
GROUP_SPECS_8 = (
    (3,),
    (2, 5),
    (1, 4, 6),
    (0, 2, 5, 7),
    (1, 3, 4, 6, 7),
    (0, 1, 2, 3, 4, 5),
    (1, 2, 3, 4, 5, 6, 7),
    None,  # the world
)

_GROUPS: dict = {}


def groups() -> dict:
    """spec -> process group (``None`` -> world); created once per process, on every rank."""
    if not _GROUPS:
        assert dist.get_world_size() == 8, "the group specs assume a world of 8 ranks"
        for spec in GROUP_SPECS_8:
            _GROUPS[spec] = dist.new_group(list(spec)) if spec is not None else None
    return _GROUPS


def members(spec) -> tuple[int, ...]:
    return tuple(range(8)) if spec is None else spec


def make_input(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 17)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=torch.int64).to(dtype)


def oracle(seed, ranks, numel, dtype, op):
    """Expected result in float64 and the sum of magnitudes (the round-off scale)."""
    xs = torch.stack([make_input(seed, r, numel, dtype).to(torch.float64) for r in ranks])
    if numel == 0:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty
    absum = xs.abs().sum(0)
    if op == "sum":
        return xs.sum(0), absum
    if op == "avg":
        return xs.mean(0), absum / len(ranks)
    if op == "max":
        return xs.max(0).values, absum
    return xs.min(0).values, absum


def mismatch(result, expected, absum, p, op, dtype) -> str | None:
    """Why ``result`` is not ``expected`` up to summation-order round-off (None if it is)."""
    got = result.to(torch.float64).reshape(-1)
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} != {tuple(expected.shape)}"
    if not dtype.is_floating_point or op in ("max", "min"):
        if torch.equal(got, expected):
            return None
        bad = (got != expected).nonzero()[0].item()
        return f"not exact at {bad}: {got[bad].item()} != {expected[bad].item()}"
    eps = torch.finfo(dtype).eps
    allowed = eps * (p * absum + expected.abs()) + torch.finfo(dtype).tiny
    err = (got - expected).abs()
    if bool((err <= allowed).all()):
        return None
    bad = int((err - allowed).argmax())
    return f"error {err[bad].item():.3g} > {allowed[bad].item():.3g} at {bad}"


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _call(kind, x, alg, op, root, group, block_bytes, async_op=False):
    if kind == "allreduce":
        return C.allreduce(
            x, algorithm=alg, op=op, group=group, block_bytes=block_bytes, async_op=async_op
        )
    if kind == "broadcast":
        return C.broadcast(
            x, root, algorithm=alg, group=group, block_bytes=block_bytes, async_op=async_op
        )
    return C.reduce(
        x, root, algorithm=alg, op=op, group=group, block_bytes=block_bytes, async_op=async_op
    )


def check_case(case, x_after, x_before):
    """Failure description of one finished case on this rank, or None."""
    kind, alg, op, dtype, numel, spec, root, block_bytes, seed = case
    me = dist.get_rank()
    ms = members(spec)
    label = f"rank {me}: {case}"
    if me not in ms:
        return None if torch.equal(x_after, x_before) else f"{label}: non-member changed t"
    if kind == "broadcast":
        want = make_input(seed, root, numel, dtype)
        return None if torch.equal(x_after, want) else f"{label}: broadcast differs from src"
    if kind == "reduce" and me != root:
        return None
    expected, absum = oracle(seed, ms, numel, dtype, op)
    why = mismatch(x_after, expected, absum, len(ms), op, dtype)
    return None if why is None else f"{label}: {why}"


def run_cases(cases):
    """Run each case (all ranks call, members or not); return (failures, digests)."""
    groups()
    failures, digests = [], {}
    for idx, case in enumerate(cases):
        kind, alg, op, dtype, numel, spec, root, block_bytes, seed = case
        x = make_input(seed, dist.get_rank(), numel, dtype)
        before = x.clone()
        out = _call(kind, x, alg, op, root, groups()[spec], block_bytes)
        if out is not x:
            failures.append(f"rank {dist.get_rank()}: {case}: did not return t")
        why = check_case(case, x, before)
        if why:
            failures.append(why)
        if kind == "allreduce" and dist.get_rank() in members(spec):
            digests[idx] = digest(x)
    return failures, digests


def sweep_cases(kind: str) -> list[tuple]:
    """Every group size 1..8 x every algorithm x every op, with dtypes, sizes, roots and LP
    block sizes varied across the cases (deterministic, the same on every rank)."""
    numels = (1, 7, 1000, 0, 13, 257, 3001)
    blocks = (None, 12, 100, 4000, 1, 36)
    ops = ("sum",) if kind == "broadcast" else C.OPS
    cases = []
    for gi, spec in enumerate(GROUP_SPECS_8):
        ms = members(spec)
        for ai, alg in enumerate(ALGS):
            for oi, op in enumerate(ops):
                for rep in range(2 if kind == "broadcast" else 1):
                    idx = gi * 31 + ai * 7 + oi * 3 + rep * 5
                    dtype = DTYPES[idx % len(DTYPES)]
                    if op == "avg" and not dtype.is_floating_point:
                        dtype = FLOATS[idx % len(FLOATS)]
                    numel = numels[idx % len(numels)]
                    block = blocks[idx % len(blocks)] if alg == "lp" else None
                    if block is not None and numel * dtype.itemsize > 150 * block:
                        block = numel * dtype.itemsize // 37 + 3  # about 37 blocks, not dividing
                    root = ms[(idx + rep) % len(ms)] if kind != "allreduce" else None
                    cases.append((kind, alg, op, dtype, numel, spec, root, block, 1000 + idx))
    return cases


def large_cases() -> list[tuple]:
    """~100k elements: every algorithm, world and a 5-rank group without rank 0."""
    cases = []
    for i, alg in enumerate(ALGS):
        for j, spec in enumerate((None, (1, 3, 4, 6, 7))):
            dtype = (torch.float32, torch.int64)[(i + j) % 2]
            block = 4000 + 4 * i if alg == "lp" and j == 0 else None
            seed = 5000 + 10 * i + j
            cases.append(("allreduce", alg, "sum", dtype, 100003, spec, None, block, seed))
            root = members(spec)[-1]
            cases.append(("reduce", alg, "max", dtype, 100003, spec, root, block, seed + 1))
            cases.append(("broadcast", alg, "sum", dtype, 100003, spec, root, block, seed + 2))
    return cases


def sweep(kind: str):
    return run_cases(sweep_cases(kind))


def sweep_large():
    return run_cases(large_cases())


def compare_with_builtin():
    """Each pipecomm algorithm against ``algorithm="torch"`` on the same inputs: integers
    bit-exact, floats within round-off; every dtype and op, world and a 3-rank group."""
    g = groups()
    failures = []
    me = dist.get_rank()
    for spec in (None, (1, 4, 6)):
        ms = members(spec)
        for d, dtype in enumerate(DTYPES):
            for o, op in enumerate(C.OPS):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                seed = 9000 + 10 * d + o
                ref = make_input(seed, me, 1000, dtype)
                C.allreduce(ref, algorithm="torch", op=op, group=g[spec])
                _, absum = oracle(seed, ms, 1000, dtype, op)
                for alg in ALGS[:-1]:
                    x = make_input(seed, me, 1000, dtype)
                    C.allreduce(x, algorithm=alg, op=op, group=g[spec], block_bytes=1000)
                    if me not in ms:
                        continue
                    # both are within round-off of the exact result: twice the bound apart
                    why = mismatch(x, ref.to(torch.float64), 2 * absum, len(ms), op, dtype)
                    if why:
                        failures.append(f"rank {me}: {alg} {op} {dtype} group {spec}: {why}")
    return failures


def noncontiguous_and_grad():
    """Transposed and strided views (results copied back, the rest untouched) and a leaf that
    requires grad."""
    failures = []
    me, p = dist.get_rank(), dist.get_world_size()
    for alg in ALGS:
        base = make_input(77, me, 6 * 10, torch.float64).view(6, 10)
        expect_base = base.clone()
        view = base[:, ::3]  # 6 x 4, not contiguous
        C.allreduce(view, algorithm=alg, op="sum", block_bytes=40)
        full, _ = oracle(77, range(p), 60, torch.float64, "sum")
        expect_base[:, ::3] = full.view(6, 10)[:, ::3]
        if not torch.allclose(base, expect_base, rtol=1e-12, atol=1e-12):
            failures.append(f"rank {me}: {alg}: strided allreduce wrong or touched other elements")
        t = make_input(78, me, 35, torch.float32).view(5, 7).t()  # transposed
        C.broadcast(t, 3, algorithm=alg, block_bytes=24)
        if not torch.equal(t, make_input(78, 3, 35, torch.float32).view(5, 7).t()):
            failures.append(f"rank {me}: {alg}: transposed broadcast wrong")
        base = make_input(80, me, 8 * 5, torch.float32).view(8, 5)
        h = C.allreduce(base.t(), algorithm=alg, op="min", block_bytes=20, async_op=True)
        h.wait(timeout_s=60)
        want, _ = oracle(80, range(p), 40, torch.float32, "min")
        if not torch.equal(base, want.float().view(8, 5)):
            failures.append(f"rank {me}: {alg}: asynchronous allreduce of a transposed view wrong")
        w = make_input(79, me, 9, torch.float32).requires_grad_()
        C.allreduce(w, algorithm=alg, op="max")
        want, _ = oracle(79, range(p), 9, torch.float32, "max")
        if not torch.equal(w.detach().double(), want) or not w.requires_grad:
            failures.append(f"rank {me}: {alg}: allreduce of a leaf requiring grad wrong")
    return failures


def lean_path():
    """Unemulated CPU messages go straight to the process group: ``dist.isend`` / ``irecv`` are
    never called, and every algorithm still matches the float64 oracle on the world and on
    subgroups whose group ranks differ from the global ranks, for float32 and int64."""
    failures = []
    saved = (dist.isend, dist.irecv)

    def refuse(*args, **kwargs):
        raise AssertionError("dist.isend / dist.irecv called: the lean path was not taken")

    dist.isend = dist.irecv = refuse
    try:
        for spec, group in groups().items():
            ranks = members(spec)
            if dist.get_rank() not in ranks or len(ranks) < 2:
                continue
            for i, alg in enumerate(ALGS[:-1]):
                for dtype in (torch.float32, torch.int64):
                    x = make_input(600 + i, dist.get_rank(), 1001, dtype)
                    C.allreduce(x, algorithm=alg, group=group, block_bytes=1000)
                    want, absum = oracle(600 + i, ranks, 1001, dtype, "sum")
                    bad = mismatch(x, want, absum, len(ranks), "sum", dtype)
                    if bad:
                        failures.append(f"lean path {alg} {dtype} group {spec}: {bad}")
    finally:
        dist.isend, dist.irecv = saved  # the pool serves other tests
    dist.barrier()
    return failures


def async_interleaved():
    """Several asynchronous operations (all algorithms, several groups, members or not) issued
    back to back, matmuls in between and a synchronous op on the world meanwhile; waited in
    order and checked. Also: progress without wait() (the thread works while we compute)."""
    g = groups()
    me = dist.get_rank()
    failures = []
    specs = (None, (1, 3, 4, 6, 7), (0, 2, 5, 7), (2, 5))
    pending = []
    a = torch.randn(160, 160, dtype=torch.float64)
    for i, alg in enumerate(ALGS * 2):
        spec = specs[i % len(specs)]
        kind = ("allreduce", "reduce", "broadcast")[i % 3]
        ms = members(spec)
        root = ms[i % len(ms)] if kind != "allreduce" else None
        dtype = (torch.float32, torch.int64)[i % 2]
        op = ("sum", "max", "min", "avg")[i % 4] if kind != "broadcast" else "sum"
        if op == "avg" and not dtype.is_floating_point:
            op = "sum"
        block = 400 if alg == "lp" and i % 2 else None
        case = (kind, alg, op, dtype, 3001 + i, spec, root, block, 300 + i)
        x = make_input(300 + i, me, 3001 + i, dtype)
        before = x.clone()
        h = _call(kind, x, alg, op, root, g[spec], block, async_op=True)
        pending.append((h, x, before, case))
        a = torch.tanh(a @ a)  # computation between issues
        if i == 4:  # a synchronous collective on the world while async ones are in flight
            y = make_input(301, me, 500, torch.int64)
            C.allreduce(y, algorithm="lp", op="sum", block_bytes=256)
            want, _ = oracle(301, range(8), 500, torch.int64, "sum")
            if not torch.equal(y.double(), want):
                failures.append(f"rank {me}: sync allreduce during async ops wrong")
    for h, x, before, case in pending:
        out = h.wait(timeout_s=60)
        if out is not x or not h.is_completed():
            failures.append(f"rank {me}: {case}: wait() did not return t / not completed")
        why = check_case(case, x, before)
        if why:
            failures.append(why)
    # Progress without wait(): poll while computing; must complete within the deadline.
    overlapped = {}
    for alg in ("lp", "ring", "torch"):
        x = make_input(400, me, 20000, torch.float32)
        h = C.allreduce(x, algorithm=alg, op="sum", async_op=True)
        deadline, steps = time.monotonic() + 60, 0
        while not h.is_completed() and time.monotonic() < deadline:
            a = torch.tanh(a @ a)
            steps += 1
        overlapped[alg] = h.is_completed()
        h.wait(timeout_s=60)
        expected, absum = oracle(400, range(8), 20000, torch.float32, "sum")
        why = mismatch(x, expected, absum, 8, "sum", torch.float32)
        if why:
            failures.append(f"rank {me}: polled async {alg}: {why}")
    return failures, overlapped


def _expect_error(fn, exc_type, words):
    try:
        fn()
    except exc_type as exc:
        text = str(exc)
        missing = [w for w in words if w not in text]
        return f"message lacks {missing}: {text}" if missing else None
    except Exception as exc:  # wrong type
        return f"raised {type(exc).__name__} instead of {exc_type.__name__}: {exc}"
    return f"did not raise {exc_type.__name__}"


def bad_arguments():
    """Every bad argument raises locally, naming the argument, before any communication; then
    a normal collective still works (no stray message was sent)."""
    g = groups()
    me = dist.get_rank()
    f = torch.arange(10, dtype=torch.float32)
    i = torch.arange(10, dtype=torch.int64)
    no0 = g[(1, 3, 4, 6, 7)]
    cases = {
        "non-tensor": (lambda: C.allreduce([1.0, 2.0]), TypeError, ["t must be a torch.Tensor"]),
        "bcast non-tensor": (lambda: C.broadcast(3.0), TypeError, ["t must"]),
        "algorithm": (lambda: C.allreduce(f, algorithm="tree"), ValueError, ["algorithm"]),
        "bcast algorithm": (lambda: C.broadcast(f, algorithm=None), ValueError, ["algorithm"]),
        "op": (lambda: C.allreduce(f, op="prod"), ValueError, ["op"]),
        "reduce op": (lambda: C.reduce(f, op="SUM"), ValueError, ["op"]),
        "avg int": (lambda: C.allreduce(i, op="avg"), TypeError, ["avg"]),
        "reduce avg int": (lambda: C.reduce(i, 0, op="avg", algorithm="mst"), TypeError, ["avg"]),
        "src outside world": (lambda: C.broadcast(f, src=8), ValueError, ["src"]),
        "src negative": (lambda: C.broadcast(f, src=-1, algorithm="torch"), ValueError, ["src"]),
        "dst outside": (lambda: C.reduce(f, dst=99), ValueError, ["dst"]),
        "dst type": (lambda: C.reduce(f, dst="0"), TypeError, ["dst"]),
        "block negative": (lambda: C.allreduce(f, block_bytes=-4), ValueError, ["block_bytes"]),
        "block zero": (lambda: C.broadcast(f, block_bytes=0), ValueError, ["block_bytes"]),
        "block float": (lambda: C.reduce(f, block_bytes=1.5), TypeError, ["block_bytes"]),
        "compression mst": (
            lambda: C.allreduce(f, algorithm="mst", compression="fp16"),
            ValueError,
            ["compression"],
        ),
        "compression be": (
            lambda: C.allreduce(f, algorithm="be", compression="int8"),
            ValueError,
            ["compression"],
        ),
        "compression torch": (
            lambda: C.allreduce(f, algorithm="torch", compression="bf16"),
            ValueError,
            ["compression"],
        ),
        "compression int": (lambda: C.allreduce(i, compression="fp16"), TypeError, ["compression"]),
        "compression name": (
            lambda: C.allreduce(f, compression="zip"),
            ValueError,
            ["compression"],
        ),
        "compression bcast": (
            lambda: C.broadcast(f, compression="fp16"),
            TypeError,
            ["compression"],
        ),
        "compression reduce": (lambda: C.reduce(f, compression="fp16"), TypeError, ["compression"]),
        "dtype bool": (lambda: C.allreduce(torch.ones(3, dtype=torch.bool)), TypeError, ["dtype"]),
        "dtype complex": (
            lambda: C.broadcast(torch.ones(3, dtype=torch.complex64)),
            TypeError,
            ["dtype"],
        ),
        "async_op": (lambda: C.allreduce(f, async_op="yes"), TypeError, ["async_op"]),
        "group": (lambda: C.allreduce(f, group="world"), TypeError, ["group"]),
    }
    if me in (1, 3, 4, 6, 7):  # members of a group without rank 0 must refuse src/dst = 0
        cases["src not in group"] = (
            lambda: C.broadcast(f, src=0, group=no0),
            ValueError,
            ["src", "[1, 3, 4, 6, 7]"],
        )
        cases["dst not in group"] = (
            lambda: C.reduce(f, dst=0, group=no0, algorithm="torch"),
            ValueError,
            ["dst"],
        )
    failures = []
    for name, (fn, exc_type, words) in cases.items():
        before = f.clone(), i.clone()
        why = _expect_error(fn, exc_type, words)
        if why:
            failures.append(f"rank {me}: {name}: {why}")
        if not (torch.equal(f, before[0]) and torch.equal(i, before[1])):
            failures.append(f"rank {me}: {name}: the tensor was modified")
    if me not in (1, 3, 4, 6, 7):  # non-members: a no-op whatever src is
        out = C.broadcast(f, src=0, group=no0)
        if out is not f or not torch.equal(f, torch.arange(10, dtype=torch.float32)):
            failures.append(f"rank {me}: non-member broadcast was not a no-op")
    # No stray message: the next collectives on the world and the group still match up.
    for alg in ALGS:
        x = torch.full((33,), float(me))
        C.allreduce(x, algorithm=alg, block_bytes=16)
        if not torch.equal(x, torch.full((33,), 28.0)):
            failures.append(f"rank {me}: {alg}: allreduce after bad arguments wrong")
    return failures


def world_of_one():
    """World size 1: every call is a no-op returning t (avg: identity), sync and async."""
    failures = []
    for alg in ALGS:
        for dtype in (torch.float32, torch.int32):
            x = make_input(5, 0, 17, dtype)
            want = x.clone()
            ops = C.OPS if dtype.is_floating_point else ("sum", "max", "min")
            for op in ops:
                if C.allreduce(x, algorithm=alg, op=op) is not x:
                    failures.append(f"{alg} allreduce did not return t")
                if C.reduce(x, 0, algorithm=alg, op=op, block_bytes=4) is not x:
                    failures.append(f"{alg} reduce did not return t")
            if C.broadcast(x, 0, algorithm=alg) is not x:
                failures.append(f"{alg} broadcast did not return t")
            h = C.allreduce(x, algorithm=alg, op="max", async_op=True)
            if h.wait(timeout_s=10) is not x or not h.is_completed():
                failures.append(f"{alg} async handle")
            if not torch.equal(x, want):
                failures.append(f"{alg} {dtype}: changed the tensor")
        try:
            C.broadcast(torch.zeros(2), src=1, algorithm=alg)
            failures.append(f"{alg}: src=1 in a world of one did not raise")
        except ValueError:
            pass
    return failures


class CountingCodec:
    """A real codec that counts its calls and the bytes it produces (what goes on the wire)."""

    def __init__(self, name):
        from pipecomm import compress

        self.inner = compress.get_codec(name)
        self.name = name
        self.encodes = self.decodes = self.encoded_bytes = 0

    def encode(self, x):
        self.encodes += 1
        out = self.inner.encode(x)
        self.encoded_bytes += out.numel()
        return out

    def decode(self, payload, numel, dtype):
        self.decodes += 1
        return self.inner.decode(payload, numel, dtype)

    def payload_nbytes(self, numel):
        return self.inner.payload_nbytes(numel)

    def ratio(self, dtype):
        return self.inner.ratio(dtype)


def compressed_allreduce(numel: int, block_bytes: int):
    """lp and ring with every codec, float32 and float16, the world and a 5-rank group: results
    close to the float64 oracle within the codec's error, bit-identical on every member, and
    the codec really used (call counts of the schedule)."""
    g = groups()
    me = dist.get_rank()
    out = []
    seed = 700
    for alg in ("lp", "ring"):
        for name in ("fp16", "bf16", "int8"):
            for dtype in (torch.float32, torch.float16):
                for spec in (None, (1, 3, 4, 6, 7)):
                    seed += 1
                    ms = members(spec)
                    x = make_input(seed, me, numel, dtype)
                    codec = CountingCodec(name)
                    C.allreduce(
                        x,
                        algorithm=alg,
                        op="avg" if name == "bf16" else "sum",
                        group=g[spec],
                        block_bytes=block_bytes,
                        compression=codec,
                    )
                    if me not in ms:
                        continue
                    op = "avg" if name == "bf16" else "sum"
                    expected, absum = oracle(seed, ms, numel, dtype, op)
                    out.append(
                        {
                            "alg": alg,
                            "codec": name,
                            "dtype": str(dtype),
                            "spec": spec,
                            "p": len(ms),
                            "index": ms.index(me),
                            "digest": digest(x),
                            "err": (x.double() - expected).abs().max().item() if numel else 0.0,
                            "scale": absum.max().item() if numel else 0.0,
                            "encodes": codec.encodes,
                            "decodes": codec.decodes,
                            "encoded_bytes": codec.encoded_bytes,
                        }
                    )
    # The string names work as well and agree with the codec objects.
    x = make_input(701, me, numel, torch.float32)
    C.allreduce(x, algorithm="lp", compression="fp16", block_bytes=block_bytes)
    return out, digest(x)


def under_emulation(numel: int):
    """Every pipecomm algorithm under the emulated network, default LP blocks; returns the
    failures and the default LP block size this rank computed per collective."""
    from pipecomm.collectives import lp
    from pipecomm.lab.networks import netem

    me, p = dist.get_rank(), dist.get_world_size()
    failures = []
    if netem.current() is None:
        failures.append(f"rank {me}: no emulated network active")
    for i, alg in enumerate(ALGS[:-1]):
        seed = 800 + i
        x = make_input(seed, me, numel, torch.float32)
        C.allreduce(x, algorithm=alg, op="sum")
        expected, absum = oracle(seed, range(p), numel, torch.float32, "sum")
        why = mismatch(x, expected, absum, p, "sum", torch.float32)
        if why:
            failures.append(f"rank {me}: emulated {alg} allreduce: {why}")
        x = make_input(seed, me, numel, torch.float32)
        C.broadcast(x, src=p - 1, algorithm=alg)
        if not torch.equal(x, make_input(seed, p - 1, numel, torch.float32)):
            failures.append(f"rank {me}: emulated {alg} broadcast wrong")
    try:  # the built-in cannot be emulated: refused before any communication
        C.allreduce(torch.ones(3), algorithm="torch")
        failures.append(f"rank {me}: algorithm='torch' was accepted under emulation")
    except ValueError as exc:
        if "cannot be emulated" not in str(exc):
            failures.append(f"rank {me}: unclear error for 'torch' under emulation: {exc}")
    nbytes = numel * 4
    blocks = {k: lp.default_block_bytes(k, nbytes, p) for k in ("broadcast", "reduce", "allreduce")}
    return failures, blocks


# --------------------------------------------------------------------------- bit-identity fixture


def bitwise_cases() -> list[tuple]:
    """``(kind, alg, op, dtype name, p, numel, root, block_elems, codec name, seed)`` cases whose
    outputs the lock-step implementation recorded in ``tests/data/collectives_bits.json``.

    Deterministic (the same list every call): every schedule, kind and p in 2..5 and 8, sizes
    that divide nothing, several dtypes and ops, LP blocks that do not divide the message, and
    compressed lp / ring allreduce.
    """
    cases = []
    dtypes = ("float32", "float16", "bfloat16", "float64", "int32")
    for a, alg in enumerate(("lp", "ring", "mst", "be")):
        for p in (2, 3, 4, 5, 8):
            for n in (1, 7, 1000, 4099):
                for k, kind in enumerate(("allreduce", "reduce", "broadcast")):
                    idx = a * 97 + p * 13 + n + k * 5
                    dtype = dtypes[idx % len(dtypes)]
                    op = "sum" if kind == "broadcast" else OPS_CYCLE[idx % len(OPS_CYCLE)]
                    if op == "avg" and dtype == "int32":
                        op = "sum"
                    block = (3, 64, 1000, 37)[idx % 4] if alg == "lp" else None
                    if block == 3 and n > 1000:
                        block = 41  # at most ~100 blocks: the simulated transport stays fast
                    root = idx % p if kind != "allreduce" else None
                    cases.append((kind, alg, op, dtype, p, n, root, block, None, idx))
    for alg in ("lp", "ring"):
        for codec in ("fp16", "bf16", "int8"):
            for p in (2, 3, 5):
                for n in (7, 1000):
                    for op in ("sum", "avg", "max"):
                        idx = len(cases)
                        block = 37 if alg == "lp" else None
                        cases.append(
                            ("allreduce", alg, op, "float32", p, n, None, block, codec, idx)
                        )
    return cases


OPS_CYCLE = ("sum", "avg", "max", "min")


def batched_posts():
    """Every algorithm with the NCCL-style batched posts (collected, issued as one
    ``batch_isend_irecv`` at the first wait) forced on the gloo world: results against the
    float64 oracle. Returns the failures."""
    from pipecomm.collectives import _group

    me, p = dist.get_rank(), dist.get_world_size()
    saved = _group.Comm.__dict__["batched"]
    _group.Comm.batched = True  # a class attribute shadows the cached property
    failures = []
    try:
        for i, alg in enumerate(ALGS[:-1]):
            for kind in ("allreduce", "reduce", "broadcast"):
                seed, n = 900 + i, 1001 + 17 * i
                x = make_input(seed, me, n, torch.float32)
                before = x.clone()
                _call(kind, x, alg, "sum", 1 if kind != "allreduce" else None, None, 400)
                why = (
                    check_case((kind, alg, "sum", torch.float32, n, None, 1, 400, seed), x, before)
                    if p == 8
                    else None
                )
                if p != 8:  # the world is not the 8-rank spec: check against the oracle here
                    want, absum = oracle(seed, range(p), n, torch.float32, "sum")
                    if kind == "broadcast":
                        ok = torch.equal(x, make_input(seed, 1, n, torch.float32))
                        why = None if ok else "broadcast differs"
                    elif kind == "allreduce" or me == 1:
                        why = mismatch(x, want, absum, p, "sum", torch.float32)
                if why:
                    failures.append(f"rank {me}: batched {alg} {kind}: {why}")
    finally:
        _group.Comm.batched = saved
    return failures


def duplex_routes():
    """Each direction of a pair on its own connection: where messages toward lower ranks go."""
    from pipecomm.collectives._group import make_comm
    from pipecomm.lab.networks import launch

    failures = []
    world = launch.reverse_transport(None)
    comm = launch.reverse_transport(launch.comm_group())
    if world is None or comm is None or world[1] != 0 or comm[1] != 0 or world[0] is comm[0]:
        failures.append(f"world / comm reverse transports wrong: {world}, {comm}")
    sub = groups()[(1, 4, 6)]
    tag = None
    if dist.get_rank() in (1, 4, 6):
        rev = make_comm((1, 4, 6), sub).reverse
        if rev is None or rev[0] is not world[0] or rev[1] <= 0:
            failures.append(f"subgroup reverse transport wrong: {rev}")
        tag = rev[1] if rev else None
        c = make_comm((1, 4, 6), sub)
        for lower, want in ((True, rev), (False, (sub, 0))):
            if c._route(lower) != want:
                failures.append(f"route(lower={lower}) = {c._route(lower)}, want {want}")
    return failures, tag


def concurrent_groups(rounds: int, numel: int):
    """Two threads on ranks 1 and 2 run synchronous LP allreduces on two groups that share
    them at the same time: their reverse traffic shares one connection under different tags
    and must never match the other group's messages (checked against the float64 oracle)."""
    import threading

    specs = [(0, 1, 2), (1, 2, 3)]
    if specs[0] not in _GROUPS:  # on every rank, in the same order
        for spec in specs:
            _GROUPS[spec] = dist.new_group(list(spec))
    gs = _GROUPS
    mine = [s for s in specs if dist.get_rank() in s]
    failures: list[str] = []

    def work(spec):
        for i in range(rounds):
            x = make_input(1000 + i + 17 * spec[0], dist.get_rank(), numel, torch.float32)
            C.allreduce(x, algorithm="lp", group=gs[spec], block_bytes=4096)
            want, absum = oracle(1000 + i + 17 * spec[0], spec, numel, torch.float32, "sum")
            bad = mismatch(x, want, absum, len(spec), "sum", torch.float32)
            if bad:
                failures.append(f"group {spec} round {i}: {bad}")

    threads = [threading.Thread(target=work, args=(s,)) for s in mine]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    dist.barrier()
    return failures


def staged_transport(numel: int):
    """Every message through host buffers, as for CUDA tensors on gloo (forced on CPU tensors
    here: ``p2p._staged`` answers yes): each algorithm's allreduce, sync and async, and broadcast
    against the float64 oracle."""
    from pipecomm.collectives import p2p

    original, p2p._staged = p2p._staged, lambda t, group: True
    try:
        return _staged_cases(numel)
    finally:
        p2p._staged = original  # the pool serves other tests


def _staged_cases(numel: int) -> list[str]:
    failures = []
    world = dist.get_world_size()
    for i, alg in enumerate(ALGS):
        for async_op in (False, True):
            x = make_input(500 + i, dist.get_rank(), numel, torch.float32)
            res = C.allreduce(x, algorithm=alg, async_op=async_op, block_bytes=4096)
            if async_op:
                res.wait()
            want, absum = oracle(500 + i, range(world), numel, torch.float32, "sum")
            bad = mismatch(x, want, absum, world, "sum", torch.float32)
            if bad:
                failures.append(f"staged allreduce {alg} async={async_op}: {bad}")
        y = make_input(900 + i, dist.get_rank(), numel, torch.float32)
        C.broadcast(y, 1, algorithm=alg, block_bytes=4096)
        if not torch.equal(y, make_input(900 + i, 1, numel, torch.float32)):
            failures.append(f"staged broadcast {alg}: differs from the root's data")
    dist.barrier()
    return failures


def interleaved_order(points: list) -> dict:
    """``sweep.measure_points(points, interleave=True)`` with every timed collective call
    recorded: the algorithms in call order (rank 0) and the rows."""
    from pipecomm.lab.measure import sweep

    calls: list[str] = []
    real = sweep.collective_call

    def recording(op, alg, t, g=None, block=None):
        fn = real(op, alg, t, g, block)

        def call():
            if t.numel() > 1024:  # not the first_warmup's small tensor
                calls.append(alg)
            fn()

        return call

    sweep.collective_call = recording
    try:
        rows = sweep.measure_points(points, interleave=True)
    finally:
        sweep.collective_call = real
    return {"calls": calls, "rows": rows}


def mismatched_calls() -> list[str]:
    """Members of groups of 2, 3 and 5 ranks call a collective with different arguments (size,
    dtype, root, op, empty against non-empty, LP block): every member must raise MismatchError
    naming each side's call, with its tensor untouched; synchronous and asynchronous calls. Then
    a matched call gives exactly the bits of the schedule run without the check."""
    from pipecomm.collectives import agreement
    from pipecomm.collectives._group import make_comm

    g = groups()
    me = dist.get_rank()
    failures = []
    for spec in ((2, 5), (1, 4, 6), (1, 3, 4, 6, 7)):
        if me not in spec:
            continue
        group, odd = g[spec], spec[-1]  # the last member differs
        mine = me == odd
        cases = {
            "size": ("allreduce", {}, 1000 + 100 * mine, torch.float32, ["numel=1000", "numel=1100"]),
            "dtype": ("broadcast", {"src": spec[0]}, 333, torch.float64 if mine else torch.float32,
                      ["float64", "float32"]),
            "root": ("broadcast", {"src": spec[1] if mine else spec[0]}, 77, torch.float32,
                     [f"src={spec[0]}", f"src={spec[1]}"]),
            "op": ("reduce", {"dst": spec[0], "op": "max" if mine else "sum"}, 50, torch.int64,
                   ["op='max'", "op='sum'"]),
            "empty": ("allreduce", {}, 0 if mine else 9, torch.float32, ["numel=0", "numel=9"]),
        }
        for alg in ("lp", "mst", "be", "ring"):
            for name, (kind, kw, numel, dtype, words) in cases.items():
                for async_op in (False, True):
                    t = make_input(5, me, numel, dtype)
                    before = t.clone()
                    try:
                        h = getattr(C, kind)(t, algorithm=alg, group=group, async_op=async_op, **kw)
                        if async_op:
                            h.wait()
                        failures.append(f"rank {me} {spec} {alg} {name} async={async_op}: no error")
                    except agreement.MismatchError as e:
                        missing = [w for w in [kind, *words] if w not in str(e)]
                        if missing:
                            failures.append(f"rank {me} {alg} {name}: {missing} not in {e}")
                    if not torch.equal(t, before):
                        failures.append(f"rank {me} {alg} {name}: tensor changed")
        t = make_input(6, me, 4099, torch.float32)
        try:
            C.allreduce(t, algorithm="lp", group=group, block_bytes=4096 if mine else 1024)
            failures.append(f"rank {me} {spec}: LP blocks differ, no error")
        except agreement.MismatchError as e:
            if "block_elems=1024" not in str(e) or "block_elems=256" not in str(e):
                failures.append(f"rank {me} block sizes not named: {e}")
        # matched: the same bits as the schedule without the check
        members = tuple(spec)
        for alg in ("lp", "mst", "be", "ring"):
            x = make_input(7, me, 5003, torch.float32)
            y = x.clone()
            C.allreduce(x, algorithm=alg, group=group, block_bytes=1024)
            schedule = __import__(f"pipecomm.collectives.{alg}", fromlist=[alg])
            kw = {"block_elems": 256} if alg == "lp" else {}
            schedule.allreduce(y, make_comm(members, group), "sum", **kw)
            if not torch.equal(x, y):
                failures.append(f"rank {me} {spec} {alg}: checked call differs from the schedule")
    dist.barrier()
    return failures


def torch_detail_mismatch() -> list[str]:
    """On a group of ``sweep.detail_group`` (torch's own agreement check) rank r's allreduce of
    ``10 + r`` elements raises on every member, before any of them returns."""
    from pipecomm.lab.measure import sweep

    g = sweep.detail_group(list(range(dist.get_world_size())))
    me = dist.get_rank()
    try:
        dist.all_reduce(torch.ones(10 + me), group=g)
        return [f"rank {me}: torch's check let a size mismatch through"]
    except RuntimeError as e:
        return [] if "mismatch" in str(e).lower() else [f"rank {me}: another error: {e}"]


def agreement_allgather() -> list[str]:
    """The check's allgather in one round and in Bruck's rounds (DIRECT_MAX forced to 1) over
    groups of 2, 3 and 5: every member gets every member's row in group order; a call inside
    ``skipped()`` makes no check."""
    from pipecomm.collectives import agreement
    from pipecomm.collectives._group import make_comm

    g = groups()
    me = dist.get_rank()
    failures = []
    saved = agreement.DIRECT_MAX
    try:
        for direct_max in (saved, 1):
            agreement.DIRECT_MAX = direct_max
            for spec in ((2, 5), (1, 4, 6), (1, 3, 4, 6, 7)):
                if me not in spec:
                    continue
                rows = agreement.allgather_rows([me, 7 * me, -me], make_comm(spec, g[spec]))
                if rows != [[r, 7 * r, -r] for r in spec]:
                    failures.append(f"rank {me} {spec} DIRECT_MAX={direct_max}: {rows}")
    finally:
        agreement.DIRECT_MAX = saved
    if me in (2, 5):  # skipped: no message, so a mismatched call would not be caught
        with agreement.skipped():
            agreement.check(agreement.Call("allreduce", "lp", "sum", -1, me, torch.float32, 1,
                                           None), make_comm((2, 5), g[(2, 5)]))
    dist.barrier()
    return failures
