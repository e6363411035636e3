"""Overlap of the communication thread's CUDA work with compute on one GPU.

Pipe-SGD (Li et al., NeurIPS 2018) hides an AllReduce behind the next step's compute. On a GPU
that needs the communication's kernels on a stream of their own
(:mod:`pipecomm.collectives._streams`). With one GPU no collective between two ranks can run
(NCCL needs a GPU per rank), so this measures the stream mechanism itself: a job on pipecomm's
communication thread (:func:`pipecomm.collectives.async_.submit`) that does what LP's reduce does
on a GPU -- add blocks into an accumulator, block by block -- races a loop of matrix products on
the caller's stream.

``--job lp-allreduce`` runs a real LP allreduce instead: two gloo ranks share the device (gloo
stages CUDA tensors through host memory), each with its own matmul loop, the allreduce submitted
with ``async_op=True`` (the communication thread and its stream) -- the closest one GPU comes to
Pipe-SGD's overlap of an AllReduce with the next step's compute.

Reported, each the median of ``--repeats`` (CUDA-synchronised wall time):

* ``compute_s``: the matmul loop alone; ``comm_s``: the communication job alone;
* ``both_s``: the job submitted, then the matmul loop, then ``wait()`` and a synchronize;
* ``serial_s``: the same work with the job run on the caller's stream (no overlap possible);
* ``overlap`` = (compute_s + comm_s - both_s) / min(compute_s, comm_s): 1 is full overlap,
  0 none;
* ``correct``: the job's result after ``wait()`` equals the expected sum although the tensor it
  reads was produced by a kernel still queued when the job was submitted (stream ordering under
  ``CUDA_LAUNCH_BLOCKING=0``).

Without CUDA it runs on the CPU (the fallback path: no streams) so the script itself is tested.

Run::

    python benchmarks/bench_cuda_overlap.py --repeats 10 --json out.json
    python benchmarks/bench_cuda_overlap.py --job lp-allreduce --numel 16777216 --json lp.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pipecomm.collectives import async_


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _matmuls(device: torch.device, n: int, matmuls: int):
    """The compute loop (``matmuls`` products of two ``n x n`` matrices, bf16 on a GPU) and the
    fields that describe it and the device."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def compute() -> None:
        for _ in range(matmuls):
            torch.mm(a, b)

    return compute, {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "matmul": f"{matmuls} x {n}x{n} {str(dtype).replace('torch.', '')}"}


def _race(compute, start, run, device: torch.device, repeats: int, before=None) -> dict:
    """``compute_s``, ``comm_s`` (``start().wait()``), ``both_s`` (``start()``, ``compute()``,
    ``wait()``), ``serial_s`` (``run()`` then ``compute()``) and the overlap, after one warm-up of
    each (kernels, the communication thread, the stream)."""
    def comm() -> None:
        start().wait()

    def both() -> None:
        handle = start()
        compute()
        handle.wait()

    def serial() -> None:
        run()
        compute()

    runs = (("compute_s", compute), ("comm_s", comm), ("both_s", both), ("serial_s", serial))
    for _, fn in runs:
        fn()
    out = {name: _timed(fn, device, repeats, before) for name, fn in runs}
    out["overlap"] = ((out["compute_s"] + out["comm_s"] - out["both_s"])
                      / min(out["compute_s"], out["comm_s"]))
    return out


def measure(device: torch.device, n: int, matmuls: int, numel: int, blocks: int, adds: int,
            repeats: int, job: str = "reduce") -> dict:
    """Time compute alone, the communication job alone, both at once and both serialised.

    ``job="reduce"``: LP's reduce (block adds, SM work); ``job="copy"``: every block copied to
    pinned host memory and back (what a backend staging GPU data through the host does, copy
    engines)."""
    compute, out = _matmuls(device, n, matmuls)
    data = torch.randn(blocks, numel // blocks, device=device)
    acc = torch.zeros(numel // blocks, device=device)
    pinned = device.type == "cuda"
    host = torch.empty(data.shape, pin_memory=pinned)

    def reduce_job() -> None:  # LP's reduce on one rank: add every block into the accumulator
        if job == "copy":  # staging through the host: device -> pinned host -> device
            for _ in range(adds):
                for k in range(blocks):
                    host[k].copy_(data[k], non_blocking=pinned)
                    data[k].copy_(host[k], non_blocking=pinned)
            return
        for _ in range(adds):
            for k in range(blocks):
                acc.add_(data[k])

    out["comm_job"] = (f"{adds} x {blocks} block "
                       f"{'adds' if job == 'reduce' else 'host round trips'} of {numel // blocks}"
                       " float32")
    out["repeats"] = repeats
    out.update(_race(compute, lambda: async_.submit(reduce_job, acc, "lp-reduce"), reduce_job,
                     device, repeats))
    out["correct"] = ordering_correct(device, n)
    return out


def rank_lp_allreduce(n: int, matmuls: int, numel: int, repeats: int) -> dict:
    """On each of two gloo ranks sharing the GPU: a real LP allreduce (``op="avg"``, float32,
    host-staged by gloo, :func:`pipecomm.collectives.allreduce` with ``async_op=True``: the
    communication thread and its stream) against each rank's own loop of matmuls. Both ranks run
    every configuration at once (a barrier before each repeat), so ``compute_s`` is two processes'
    matmuls sharing one GPU. Rank 0 returns the same fields as :func:`measure`."""
    import torch.distributed as dist

    from pipecomm import collectives

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    compute, out = _matmuls(device, n, matmuls)
    x = torch.full((numel,), float(dist.get_rank() + 1), device=device)  # avg: 1.5 from then on
    out["matmul"] += " on each of 2 ranks"
    out["comm_job"] = f"LP allreduce of {numel} float32 between 2 gloo ranks on one device"
    out["repeats"] = repeats
    out.update(_race(compute,
                     lambda: collectives.allreduce(x, algorithm="lp", op="avg", async_op=True),
                     lambda: collectives.allreduce(x, algorithm="lp", op="avg"),
                     device, repeats, before=dist.barrier))
    _sync(device)
    out["correct"] = bool(torch.all(x == 1.5).item())
    return out


def ordering_correct(device: torch.device, n: int) -> bool:
    """Submit a job that reads a tensor whose producing kernel is still queued behind a long
    matmul on the caller's stream; after ``wait()`` its result must be the producer's."""
    dtype = torch.float32
    big = torch.randn(n, n, device=device, dtype=dtype)
    ok = True
    for trial in range(5):
        x = torch.zeros(1 << 20, device=device)
        torch.mm(big, big)  # keeps the caller's stream busy
        x.fill_(float(trial + 1))  # the producer, queued behind the matmul
        out = torch.zeros_like(x)
        handle = async_.submit(lambda x=x, out=out: out.add_(x).mul_(2.0), out, "ordering")
        handle.wait()
        ok &= bool(torch.all(out == 2.0 * (trial + 1)).item())
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8192, help="matrix size of the compute loop")
    p.add_argument("--matmuls", type=int, default=20)
    p.add_argument("--numel", type=int, default=1 << 26, help="float32 elements reduced")
    p.add_argument("--blocks", type=int, default=16)
    p.add_argument("--adds", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--job", choices=["reduce", "copy", "lp-allreduce"], default="reduce",
                   help="lp-allreduce: a real LP allreduce between two gloo ranks on one device")
    p.add_argument("--json", default=None, help="write the result here")
    args = p.parse_args(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cpu":  # the fallback: small sizes, the same code path without streams
        args.n, args.matmuls, args.numel = min(args.n, 256), min(args.matmuls, 4), 1 << 16
    if args.job == "lp-allreduce":
        from pipecomm.lab.networks import launch

        with launch.Ranks(2) as ranks:
            outs = ranks.run(rank_lp_allreduce, args.n, args.matmuls, args.numel, args.repeats,
                             timeout_s=300 + 60 * args.repeats)
        out = outs[0]
        out["correct"] = all(o["correct"] for o in outs)
    else:
        out = measure(device, args.n, args.matmuls, args.numel, args.blocks, args.adds,
                      args.repeats, args.job)
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
