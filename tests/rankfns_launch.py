"""Functions executed on ranks by test_launch.py (must be importable by the rank processes)."""

import os
import time

import torch
import torch.distributed as dist

from pipecomm.lab.networks import launch


def identity_and_tensor(x):
    rank = dist.get_rank()
    t = torch.full((3,), float(rank))
    dist.all_reduce(t)
    return {"rank": rank, "x": x, "sum": t, "pid": os.getpid(),
            "threads": torch.get_num_threads(), "device": str(launch.device()),
            "local_world_size": os.environ["LOCAL_WORLD_SIZE"],
            "local_rank": os.environ["LOCAL_RANK"], "world": dist.get_world_size()}


def raise_on(rank_to_fail):
    if dist.get_rank() == rank_to_fail:
        raise ValueError(f"deliberate failure on rank {rank_to_fail}")
    dist.barrier()  # the others block on the failed rank
    return dist.get_rank()


def die_on(rank_to_die):
    if dist.get_rank() == rank_to_die:
        os._exit(7)
    dist.barrier()
    return dist.get_rank()


def sleep_on(rank_to_sleep, seconds):
    if dist.get_rank() == rank_to_sleep:
        time.sleep(seconds)
    return dist.get_rank()


def timed_sleep(seconds_by_rank):
    from pipecomm.lab.measure import bench

    s = seconds_by_rank[dist.get_rank()]
    return bench.time_fn(lambda: time.sleep(s), warmup=0, repeats=3)


def timed_burn(cpu_seconds_by_rank):
    """time_fn(cpu=True) of a busy loop that burns each rank's share of CPU seconds."""
    from pipecomm.lab.measure import bench

    s = cpu_seconds_by_rank[dist.get_rank()]

    def burn():
        end = time.process_time() + s
        while time.process_time() < end:
            pass

    return bench.time_fn(burn, warmup=0, repeats=2, cpu=True)


def start_state(name):
    """What a rank got from the process that started it; prints a line to stdout and stderr."""
    import sys

    print(f"stdout of rank {dist.get_rank()}", flush=True)
    print(f"stderr of rank {dist.get_rank()}", file=sys.stderr, flush=True)
    return os.environ.get(name), os.getcwd(), os.environ["OMP_NUM_THREADS"], os.getppid()
