"""pipecomm's collectives on CUDA tensors over gloo, two ranks sharing one GPU (a smoke check).

One GPU cannot host two NCCL ranks, but gloo ranks can share it: this runs every algorithm's
allreduce and broadcast, synchronous and asynchronous (the communication thread's CUDA stream),
on CUDA tensors and compares with the float64 sum / the root's data. Without CUDA it runs on CPU
tensors (the same code path minus the device).

    PYTHONPATH=src python3 tools/gpu_collectives_check.py
"""

from __future__ import annotations

import sys

import torch


def check_rank(numel: int) -> list[str]:
    """On every rank: each algorithm's allreduce (sync and async) and broadcast on the device."""
    import torch.distributed as dist

    from pipecomm import collectives as C

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    failures = []
    want = sum(torch.arange(numel, dtype=torch.float64) * (r + 1) for r in range(world))
    for alg in C.ALGORITHMS:
        for async_op in (False, True):
            x = (torch.arange(numel, dtype=torch.float64) * (rank + 1)).float().to(dev)
            try:
                res = C.allreduce(x, algorithm=alg, async_op=async_op)
                if async_op:
                    res.wait()
                if x.device != dev or not torch.allclose(x.double().cpu(), want, rtol=1e-5):
                    failures.append(f"allreduce {alg} async={async_op}: wrong result on {x.device}")
            except Exception as exc:  # reported, not hidden
                failures.append(f"allreduce {alg} async={async_op}: {type(exc).__name__}: {exc}")
        y = torch.full((numel,), float(rank + 7), device=dev)
        try:
            C.broadcast(y, 0, algorithm=alg)
            if not torch.all(y.cpu() == 7.0):
                failures.append(f"broadcast {alg}: wrong result")
        except Exception as exc:
            failures.append(f"broadcast {alg}: {type(exc).__name__}: {exc}")
    return failures


def main() -> int:
    from pipecomm.lab.networks import launch

    with launch.Ranks(2) as ranks:
        per_rank = ranks.run(check_rank, 1 << 20, timeout_s=300)
    failures = sorted({f for r in per_rank for f in r})
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    print(f"device {dev}, torch {torch.__version__}: {len(failures)} failure(s)")
    for f in failures:
        print("  ", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
