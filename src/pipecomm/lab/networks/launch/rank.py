"""What code running in a rank asks: its device, its node, pipecomm's communication groups.

The rank's process group for asynchronous collectives (:func:`comm_group`, and the reverse
direction of each pair, :func:`reverse_transport`), the timeout every group pipecomm makes takes
from the world (:func:`group_timeout`), its device (:func:`device`,
:func:`synchronize`), the ranks per node (:func:`ranks_per_node`), and how a rank joins the job
(:func:`init_distributed`, :func:`set_threads`) and returns results (:func:`to_cpu`,
:class:`RankError`, :class:`RankInfo`). Used by local pools (:mod:`pipecomm.lab.networks.launch.worker`) and
torchrun jobs (:mod:`pipecomm.lab.networks.launch.torchrun`) alike.

Example::

    >>> import torch
    >>> from pipecomm.lab.networks import launch
    >>> build_model = lambda: torch.nn.Linear(2, 1)
    >>> model = build_model().to(launch.device())
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

# the library's, re-exported: the communication thread's groups and the world's timeout
# (pipecomm.collectives.async_), the GPU sync of timings, the ranks per node of topologies
from pipecomm.collectives import lp
from pipecomm.collectives.async_ import comm_group, group_timeout, has_comm_group, reverse_transport
from pipecomm.decentralized.topology import env_ranks_per_node as ranks_per_node
from pipecomm.lab.networks import cost
from pipecomm.lab.networks.launch import flight
from pipecomm.pipesgd.timing import synchronize

__all__ = [
    "RankError",
    "RankInfo",
    "comm_group",
    "device",
    "group_timeout",
    "has_comm_group",
    "init_distributed",
    "local_world_size",
    "ranks_per_node",
    "reverse_transport",
    "set_threads",
    "synchronize",
    "to_cpu",
]


class RankError(RuntimeError):
    """A rank raised an exception or died; carries the rank and its traceback."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank = rank
        self.remote_traceback = remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback of rank {rank} ---\n{remote_traceback}"
        super().__init__(text)


@dataclass(frozen=True)
class RankInfo:
    """Where this process sits in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: str


def device():
    """This rank's device: ``cuda:<current>`` when the default process group is NCCL (launch
    pinned one GPU per local rank), else ``cpu`` (gloo, or no process group at all).

    Experiments place models and batches with it, so one code path serves both profiles.

    Example::

        >>> import torch
        >>> from pipecomm.lab.networks import launch
        >>> build_model = lambda: torch.nn.Linear(2, 1)
        >>> model = build_model().to(launch.device())
        >>> model.weight.device == launch.device()
        True
    """
    import torch
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def local_world_size() -> int:
    """Number of ranks sharing this machine's cores (for thread settings)."""
    value = os.environ.get("PIPECOMM_PROCS_ON_HOST") or os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else 1


def set_threads(procs_on_host: int) -> None:
    """Set torch's threads to this host's cores shared by ``procs_on_host`` ranks.

    Example::

        set_threads(local_world_size())
    """
    import torch

    threads = max(1, (os.cpu_count() or 1) // max(1, procs_on_host))
    torch.set_num_threads(threads)


def to_cpu(obj: Any) -> Any:
    """Move tensors (nested in lists, tuples, dicts) to the CPU so any caller can unpickle them."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [to_cpu(x) for x in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    return obj


def init_distributed(
    *,
    rank: int,
    world_size: int,
    backend: str,
    init_method: str,
    timeout_s: float,
    gpu: int,
    start_timeout_s: float | None = None,
) -> None:
    """Join the process group; with NCCL first pin GPU ``gpu`` (this host's rank index: every
    local pool rank is on this host, whatever ``ranks_per_node`` emulates).

    ``timeout_s`` is the world's timeout (every collective, and every group pipecomm makes);
    ``start_timeout_s`` (default ``timeout_s``) how long the rendezvous waits for the other
    ranks, so a short collective timeout does not fail a slow start.
    """
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(gpu % torch.cuda.device_count())
    start = datetime.timedelta(seconds=max(timeout_s, start_timeout_s or 0.0))
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=start))
    store.set_timeout(start)
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    comm_group()  # a new world: the communication thread's groups are made afresh
    flight.install()  # with PIPECOMM_FLIGHT_DIR: record, dump on failure and on SIGTERM
    calibrated = cost.calibrated_link()  # E0's link (PIPECOMM_CALIBRATION), LP's default blocks
    lp.set_link(calibrated.alpha, 1.0 / calibrated.beta)
