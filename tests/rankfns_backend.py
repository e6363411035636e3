"""Rank functions for tests/test_backend.py (pipecomm.backend's process group).

The oracle of every operation is the same operation on the world's gloo group, run in the same
process on the same inputs; DDP over a pipecomm group is compared with DDP over gloo.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipecomm import backend

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "AVG": R.AVG, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX}
DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "bfloat16": torch.bfloat16,
    "int32": torch.int32,
    "int64": torch.int64,
    "int8": torch.int8,
    "complex64": torch.complex64,
}


def make(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A deterministic input per (seed, rank): small integers, so every op is exact."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_complex:
        re = torch.randint(-3, 4, (numel,), generator=g).to(torch.float32)
        im = torch.randint(-3, 4, (numel,), generator=g).to(torch.float32)
        return torch.complex(re, im).to(dtype)
    lo = 1 if dtype in (torch.int8,) else -3  # int8 PRODUCT over 3 ranks stays in range
    return torch.randint(lo, 4, (numel,), generator=g).to(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype.is_floating_point or a.dtype.is_complex:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return torch.equal(a, b)


def _gloo_reference(fn: str, t: torch.Tensor, op: Any, root: int) -> torch.Tensor:
    """The world's gloo result; AVG (which gloo lacks) is SUM / p."""
    ref = t.clone()
    real = torch.view_as_real(ref) if ref.is_complex() else ref
    if fn == "allreduce":
        dist.all_reduce(real, op=R.SUM if op == R.AVG else op)
    elif fn == "reduce":
        dist.reduce(real, dst=root, op=R.SUM if op == R.AVG else op)
    else:
        dist.broadcast(real, src=root)
    if op == R.AVG:
        ref /= dist.get_world_size()
    return ref


def ops_and_dtypes(algorithm: str) -> list[str]:
    """Every ReduceOp x dtype x size for allreduce / reduce, broadcast from every root.

    Returns the mismatches (empty when all agree) and checks that the unsupported combinations
    raise errors naming the operation.
    """
    pg = backend.new_group(algorithm=algorithm)
    rank, p = dist.get_rank(), dist.get_world_size()
    bad = []
    for dname, dtype in DTYPES.items():
        for numel in (0, 1, 1001):
            for oname, op in OPS.items():
                if dtype.is_complex and oname in ("PRODUCT", "MIN", "MAX"):
                    continue  # torch refuses these before reaching the group
                if oname == "AVG" and not (dtype.is_floating_point or dtype.is_complex):
                    continue  # refused (tested in bad_inputs)
                if dtype == torch.bfloat16 and oname == "PRODUCT":
                    continue  # gloo has no bfloat16 product
                for fn in ("allreduce", "reduce"):
                    root = (numel + len(oname)) % p
                    x = make(numel, rank, numel, dtype)
                    ref = _gloo_reference(fn, x, op, root)
                    if fn == "allreduce":
                        dist.all_reduce(x, op=op, group=pg)
                    else:
                        dist.reduce(x, dst=root, op=op, group=pg)
                    if (fn == "allreduce" or rank == root) and not _same(x, ref):
                        bad.append(f"{fn} {oname} {dname} numel={numel} root={root}")
            for root in range(p):
                x = make(numel, rank, numel, dtype)
                ref = _gloo_reference("broadcast", x, None, root)
                dist.broadcast(x, src=root, group=pg)
                if not _same(x, ref):
                    bad.append(f"broadcast {dname} numel={numel} root={root}")
    return bad


def other_ops(algorithm: str) -> dict:
    """allgather, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single, gather,
    scatter, send/recv, barrier and a non-contiguous allreduce on a pipecomm group."""
    pg = backend.new_group(algorithm=algorithm)
    rank, p = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    x = torch.arange(5.0) + 10 * rank
    gathered = [torch.empty(5) for _ in range(p)]
    dist.all_gather(gathered, x, group=pg)
    out["all_gather"] = all(
        torch.equal(g, torch.arange(5.0) + 10 * i) for i, g in enumerate(gathered)
    )
    flat = torch.empty(5 * p)
    dist.all_gather_into_tensor(flat, x, group=pg)
    out["all_gather_into_tensor"] = torch.equal(flat, torch.cat(gathered))
    try:
        rs = torch.empty(2)
        dist.reduce_scatter_tensor(rs, torch.arange(2.0 * p) + rank, group=pg)
        out["reduce_scatter_tensor"] = torch.equal(
            rs, p * torch.arange(2.0 * rank, 2.0 * rank + 2) + sum(range(p))
        )
    except RuntimeError as exc:  # the inner gloo's own error, which names the operation
        out["reduce_scatter_tensor"] = f"error: {exc}"
    a2a_in = torch.arange(float(p)) + 100 * rank
    a2a_out = torch.empty(p)
    dist.all_to_all_single(a2a_out, a2a_in, group=pg)
    out["all_to_all_single"] = torch.equal(a2a_out, torch.arange(float(p)) * 100 + rank)
    gl = [torch.empty(5) for _ in range(p)] if rank == 0 else None
    dist.gather(x, gl, dst=0, group=pg)
    out["gather"] = rank != 0 or all(torch.equal(g, h) for g, h in zip(gl, gathered))
    sc = torch.empty(5)
    dist.scatter(sc, gathered if rank == p - 1 else None, src=p - 1, group=pg)
    out["scatter"] = torch.equal(sc, gathered[rank])
    if rank in (0, 1):  # then collectives on the same group (p2p_then_collectives repeats this)
        if rank == 0:
            dist.send(torch.full((3,), 7.0), dst=1, group=pg)
        else:
            r = torch.empty(3)
            dist.recv(r, src=0, group=pg)
            out["send_recv"] = torch.equal(r, torch.full((3,), 7.0))
    objs = [None] * p
    dist.all_gather_object(objs, {"rank": rank}, group=pg)
    out["all_gather_object"] = objs == [{"rank": i} for i in range(p)]
    dist.barrier(group=pg)
    out["barrier"] = True
    nc = (torch.arange(12.0).reshape(3, 4) * (rank + 1)).t()  # non-contiguous
    dist.all_reduce(nc, group=pg)
    out["noncontiguous"] = torch.equal(
        nc, (torch.arange(12.0).reshape(3, 4) * sum(range(1, p + 1))).t()
    )
    out["backend_name"] = dist.get_backend(pg)
    out["repr"] = repr(pg)
    return out


def p2p_then_collectives(algorithm: str, iters: int) -> list[str]:
    """``iters`` times: a send/recv from rank 0 to rank 1 on a pipecomm group, then collectives on
    the same group that run on its inner gloo backend (all_gather_object, barrier, all_gather,
    all_to_all_single, coalesced all_reduce / all_gather_into_tensor / reduce_scatter_tensor)
    and pipecomm's own all_reduce. Returns the mismatches (empty when all agree).

    The regression test of a deadlock: torch's trampoline for a Python ProcessGroup held the GIL
    while the operation it forwarded to gloo waited for gloo's work-queue lock, which a gloo worker
    held while freeing the previous operation's tensors, which needs the GIL (see "the inner
    backend's" operations of PipecommProcessGroup). Before the fix one rank hung in every
    30-iteration run at p = 3 (5 runs of 5), and in one run of two with a single iteration.
    """
    pg = backend.new_group(algorithm=algorithm)
    rank, p = dist.get_rank(), dist.get_world_size()
    bad = []
    for i in range(iters):
        if rank == 0:
            dist.send(torch.full((3,), float(i)), dst=1, group=pg)
        elif rank == 1:
            r = torch.empty(3)
            dist.recv(r, src=0, group=pg)
            if not torch.equal(r, torch.full((3,), float(i))):
                bad.append(f"{i}: recv {r.tolist()}")
        objs: list[Any] = [None] * p
        dist.all_gather_object(objs, (rank, i), group=pg)
        if objs != [(j, i) for j in range(p)]:
            bad.append(f"{i}: all_gather_object {objs}")
        dist.barrier(group=pg)
        gathered = [torch.empty(2) for _ in range(p)]
        dist.all_gather(gathered, torch.full((2,), float(rank + i)), group=pg)
        if [float(g[0]) for g in gathered] != [float(j + i) for j in range(p)]:
            bad.append(f"{i}: all_gather {gathered}")
        a2a = torch.empty(p)
        dist.all_to_all_single(a2a, torch.arange(float(p)) + 10 * rank, group=pg)
        if not torch.equal(a2a, 10 * torch.arange(float(p)) + rank):
            bad.append(f"{i}: all_to_all_single {a2a.tolist()}")
        xs = [torch.full((3,), float(rank)), torch.full((2,), 1.0)]
        flat, rs = torch.empty(2 * p), torch.empty(2)
        with dist._coalescing_manager(group=pg):
            for x in xs:
                dist.all_reduce(x, group=pg)
        with dist._coalescing_manager(group=pg):
            dist.all_gather_into_tensor(flat, torch.full((2,), float(rank)), group=pg)
        with dist._coalescing_manager(group=pg):
            dist.reduce_scatter_tensor(rs, torch.arange(2.0 * p) + rank, group=pg)
        if [float(x[0]) for x in xs] != [float(sum(range(p))), float(p)]:
            bad.append(f"{i}: coalesced all_reduce {xs}")
        if not torch.equal(flat, torch.arange(float(p)).repeat_interleave(2)):
            bad.append(f"{i}: coalesced all_gather_into_tensor {flat.tolist()}")
        if not torch.equal(rs, p * torch.arange(2.0 * rank, 2.0 * rank + 2) + sum(range(p))):
            bad.append(f"{i}: coalesced reduce_scatter_tensor {rs.tolist()}")
        y = torch.full((5,), float(rank + 1))
        dist.all_reduce(y, group=pg)
        if float(y[0]) != sum(range(1, p + 1)):
            bad.append(f"{i}: all_reduce {y.tolist()}")
    return bad


def async_work(algorithm: str) -> dict:
    """async_op=True: the Work completes on its own, its future resolves on the completion thread
    (callbacks run there too), then-chains see the reduced tensor, several works in flight."""
    import threading

    pg = backend.new_group(algorithm=algorithm)
    rank, p = dist.get_rank(), dist.get_world_size()
    xs = [torch.full((4096,), float(rank + i)) for i in range(4)]
    works = [dist.all_reduce(x, group=pg, async_op=True) for x in xs]
    seen: dict[str, Any] = {}

    def cb(fut):
        seen["thread"] = threading.current_thread().name
        return fut.value()[0] * 2

    chained = works[-1].get_future().then(cb)
    deadline = time.monotonic() + 60
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(0.001)  # completes without wait()
    completed_alone = all(w.is_completed() for w in works)
    ok = all(w.wait() for w in works)
    expected = [sum(range(p)) + p * i for i in range(4)]
    values = [float(w.get_future().value()[0][0]) for w in works]
    b = torch.arange(10.0) if rank == 0 else torch.zeros(10)
    bw = dist.broadcast(b, src=0, group=pg, async_op=True)
    bw.wait()
    return dict(
        completed_alone=completed_alone,
        wait=ok,
        values=values,
        expected=[float(e) for e in expected],
        chained=float(chained.wait()[0]),
        callback_thread=seen.get("thread"),
        broadcast=torch.equal(b, torch.arange(10.0)),
        success=all(w.is_success() for w in works),
    )


def subgroups(algorithm: str) -> dict:
    """A pipecomm subgroup from pipecomm.backend.new_group and one from dist.new_group with
    backend="pipecomm" (options from the environment); non-members get NON_GROUP_MEMBER."""
    rank, p = dist.get_rank(), dist.get_world_size()
    members = [r for r in range(p) if r != 1]  # e.g. [0, 2] at p = 3
    os.environ[backend.ENV_ALGORITHM] = algorithm
    try:
        a = backend.new_group(members, algorithm=algorithm)
        b = dist.new_group(members, backend="pipecomm")
    finally:
        del os.environ[backend.ENV_ALGORITHM]
    out: dict[str, Any] = {"member": rank in members}
    if rank not in members:
        out["non_member"] = a is dist.GroupMember.NON_GROUP_MEMBER
        return out
    out["algorithms"] = [a.options.algorithm, b.options.algorithm]
    for name, g in (("a", a), ("b", b)):
        x = torch.full((777,), float(rank + 1))
        dist.all_reduce(x, group=g)
        out[f"{name}_sum"] = float(x[0])
        y = torch.full((5,), float(rank))
        dist.broadcast(y, src=members[-1], group=g)
        out[f"{name}_bcast"] = float(y[0])
        dist.barrier(group=g)
    out["expected_sum"] = float(sum(r + 1 for r in members))
    return out


def bad_inputs() -> dict:
    """Errors raised before any communication (so they cannot desynchronise the ranks)."""
    out: dict[str, str] = {}
    for name, kwargs in {
        "algorithm": dict(algorithm="fancy"),
        "compression": dict(algorithm="mst", compression="fp16"),
        "codec": dict(algorithm="lp", compression="zip"),
        "block_bytes": dict(algorithm="lp", block_bytes=0),
        "ranks": dict(ranks=[0, 0]),
        "ranks_outside": dict(ranks=[0, 99]),
    }.items():
        try:
            backend.new_group(**kwargs)
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    pg = backend.new_group(algorithm="lp")
    for name, t, op in (
        ("int_avg", torch.ones(3, dtype=torch.int64), R.AVG),
        ("complex_max", torch.ones(3, dtype=torch.complex64), R.MAX),
    ):
        try:
            pg.allreduce([t], _allreduce_opts(op))
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return out


def mismatched(algorithm: str) -> dict:
    """Rank r all-reduces ``ones(1000 + 100 r)`` on a pipecomm group, then the ranks disagree
    on broadcast's dtype: every rank's ``wait`` raises naming both sides, tensors untouched;
    then a matched call still works."""
    from pipecomm.collectives import MismatchError

    rank = dist.get_rank()
    pg = backend.new_group(algorithm=algorithm)
    out: dict[str, Any] = {}
    for name, t, call in (
        ("size", torch.ones(1000 + 100 * rank), lambda t: dist.all_reduce(t, group=pg)),
        ("dtype", torch.ones(7, dtype=torch.float64 if rank else torch.float32),
         lambda t: dist.broadcast(t, src=0, group=pg)),
    ):
        try:
            call(t)
            out[name] = "no error"
        except MismatchError as exc:
            out[name] = str(exc)
        out[name + "_untouched"] = bool((t == 1).all())
    x = torch.ones(10)
    dist.all_reduce(x, group=pg)
    out["after"] = float(x[0])
    return out


def _allreduce_opts(op: Any) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts


# --------------------------------------------------------------------------- DDP


class Net(nn.Module):
    """A small MLP with odd sizes and a BatchNorm (buffers DDP broadcasts every forward)."""

    def __init__(self, width: int = 13) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, width)
        self.bn = nn.BatchNorm1d(width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.bn(self.fc1(x))))))


def _batch(seed: int, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * seed + 100 * step + rank)
    return torch.randn(9, 7, generator=g), torch.randn(9, 3, generator=g)


def train_ddp(group: Any, steps: int, seed: int = 0, bucket_cap_mb: float = 0.0005) -> list:
    """Parameters and buffers after ``steps`` SGD-with-momentum steps of DDP on ``group``.

    Every rank starts from different weights (so DDP's broadcast at construction matters), and
    the tiny bucket cap gives several buckets. Parameters come first, then the buffers (which
    differ between ranks after the last forward: BatchNorm's running statistics of the local
    batch; DDP broadcasts rank 0's at the start of each forward).
    """
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    model = Net()
    ddp = DDP(model, process_group=group, bucket_cap_mb=bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    for step in range(steps):
        x, y = _batch(seed, rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [t.detach().clone() for t in (*model.parameters(), *model.buffers())]


def ddp_matches_gloo(algorithm: str, steps: int = 5, compression: str | None = None) -> dict:
    """DDP over ``pipecomm.backend.new_group(algorithm)`` vs DDP over the world's gloo group."""
    pg = backend.new_group(algorithm=algorithm, compression=compression)
    ref = train_ddp(None, steps)
    got = train_ddp(pg, steps)
    diffs = [float((a.double() - b.double()).abs().max()) for a, b in zip(ref, got)]
    rel = [
        float(((a.double() - b.double()).abs() / (b.double().abs() + 1e-6)).max())
        for a, b in zip(ref, got)
    ]
    return dict(max_abs=max(diffs), max_rel=max(rel), ref=ref, got=got)


def ddp_overhead(steps: int = 30, width: int = 256, repeats: int = 3) -> dict:
    """Median per-iteration time of DDP over gloo vs DDP over pipecomm groups, same process,
    interleaved ``repeats`` times (an MLP of ``width``, batch 64)."""
    rank = dist.get_rank()
    groups = {"gloo": None}
    for a in ("lp", "ring"):
        groups[a] = backend.new_group(algorithm=a)
    times: dict[str, list[float]] = {k: [] for k in groups}
    for _ in range(repeats):
        for name, group in groups.items():
            torch.manual_seed(rank)
            model = nn.Sequential(
                nn.Linear(64, width),
                nn.ReLU(),
                nn.Linear(width, width),
                nn.ReLU(),
                nn.Linear(width, 10),
            )
            ddp = DDP(model, process_group=group)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
            per = []
            for _ in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad()
                nn.functional.cross_entropy(ddp(x), y).backward()
                opt.step()
                per.append(time.perf_counter() - t0)
            per.sort()
            times[name].append(per[len(per) // 2])
    n_params = sum(p.numel() for p in model.parameters())
    return dict(times=times, n_params=n_params)


# --------------------------------------------------------------------------- torchrun


def torchrun_main(out_dir: str) -> None:
    """Body of ``torchrun --standalone --nproc-per-node N tests/rankfns_backend.py OUT``:
    ``init_process_group(backend="pipecomm")`` with the algorithm of PIPECOMM_ALGORITHM, a few
    collectives on the world group, DDP on it against DDP on a gloo group; writes OUT/rank<r>.json.
    """
    import datetime
    import json

    dist.init_process_group(backend="pipecomm", timeout=datetime.timedelta(seconds=60))
    rank, p = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    from pipecomm.lab.networks import launch

    early = dist.new_group(list(range(p)), backend="pipecomm")
    half = dist.new_group([0], backend="pipecomm")  # a subgroup that not every rank is in
    # before the communication thread's group exists: every operation works on the subgroups
    e = torch.full((5,), float(rank + 1))
    dist.all_reduce(e, group=early)
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=p - 1, group=early)
    r = torch.full((4,), 2.0)
    dist.reduce(r, dst=0, group=early)
    dist.barrier(group=early)
    h = torch.ones(2)
    if rank == 0:
        dist.all_reduce(h, group=half)
    out: dict[str, Any] = {
        "early_subgroup": [float(e[0]), float(b[0]), float(r[0]) if rank == 0 else None,
                           float(h[0])],
        "comm_group_before_world_op": launch.has_comm_group(),
        "backend": dist.get_backend(),
        "type": type(world).__name__,
        "algorithm": getattr(world, "algorithm", None),
    }
    x = torch.full((1001,), float(rank + 1))
    dist.all_reduce(x, op=R.AVG)
    out["avg"] = float(x[0])
    y = torch.tensor([rank], dtype=torch.int64)
    dist.all_reduce(y, op=R.MAX)
    out["max"] = int(y[0])
    gathered = [torch.empty(1) for _ in range(p)]
    dist.all_gather(gathered, torch.tensor([float(rank)]))
    out["all_gather"] = [float(g[0]) for g in gathered]
    gloo = dist.new_group(backend="gloo")
    sub = dist.new_group(list(range(p)), backend="pipecomm")
    z = torch.ones(3)
    dist.all_reduce(z, group=sub)
    out["subgroup_sum"] = float(z[0])
    ref = train_ddp(gloo, 3)
    got = train_ddp(None, 3)
    out["ddp_max_abs"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    import sys

    torchrun_main(sys.argv[1])


def allreduce_latency(numel: int, iters: int = 30, repeats: int = 3) -> dict:
    """Median seconds per AllReduce of ``numel`` float32, attributed layer by layer: gloo's own,
    pipecomm's collective (synchronous, asynchronous + wait), and through the backend's group."""
    from pipecomm import collectives

    pg = backend.new_group(algorithm="lp")
    x = torch.ones(numel)
    cases = {
        "gloo": lambda: dist.all_reduce(x),
        "collectives_sync": lambda: collectives.allreduce(x, algorithm="lp"),
        "collectives_async_wait": lambda: collectives.allreduce(
            x, algorithm="lp", async_op=True
        ).wait(),
        "backend": lambda: dist.all_reduce(x, group=pg),
    }
    out: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            per = []
            for _ in range(iters):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                per.append(time.perf_counter() - t0)
            per.sort()
            out[name].append(per[len(per) // 2])
    return out
