"""What code running in a rank asks: its device, its node, pipecomm's communication groups.

The rank's process group for asynchronous collectives (:func:`comm_group`, and the reverse
direction of each pair, :func:`reverse_transport`), the timeout every group pipecomm makes takes
from the world (:func:`group_timeout`), its device (:func:`device`,
:func:`synchronize`), the ranks per node (:func:`ranks_per_node`), and how a rank joins the job
(:func:`init_distributed`, :func:`set_threads`) and returns results (:func:`to_cpu`,
:class:`RankError`, :class:`RankInfo`). Used by local pools (:mod:`pipecomm.launch.worker`) and
torchrun jobs (:mod:`pipecomm.launch.torchrun`) alike.

Example::

    >>> import torch
    >>> from pipecomm import launch
    >>> build_model = lambda: torch.nn.Linear(2, 1)
    >>> model = build_model().to(launch.device())
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

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


_COMM_GROUP = None  # the process group that asynchronous collectives use (one per process)
_REVERSE: dict[str, Any] = {}  # world-wide groups for the other direction of each pair (duplex)
_COMM_WORLD = None  # the world group _COMM_GROUP was made in (a new world invalidates it)


def _forget_stale() -> None:
    """Drop the communication groups when the world they were made in is gone
    (``destroy_process_group``, then perhaps a new ``init_process_group``): a destroyed group
    must never carry a new world's messages."""
    global _COMM_GROUP, _COMM_WORLD
    if _COMM_GROUP is None:
        return
    import torch.distributed as dist

    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if world is None or world is not _COMM_WORLD:
        _COMM_GROUP, _COMM_WORLD = None, None
        _REVERSE.clear()


def group_timeout(group: Any = None) -> datetime.timedelta:
    """The timeout of ``group``'s operations (``None``: the default group's, the ``timeout=`` the
    job passed to ``init_process_group``): what every group pipecomm makes inherits.

    Read from the group's backend (``options._timeout`` of gloo and NCCL, which
    ``init_process_group`` / ``new_group`` set and ``_set_pg_timeout`` changes); torch's default
    for the backend where a backend keeps none.

    Example::

        >>> import datetime, torch.distributed as dist
        >>> from pipecomm import launch
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore(),
        ...                         timeout=datetime.timedelta(seconds=15))
        >>> launch.group_timeout()
        datetime.timedelta(seconds=15)
        >>> dist.destroy_process_group()
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        raise RuntimeError(
            "group_timeout: torch.distributed is not initialised (call init_process_group, or "
            "start ranks with pipecomm.launch.spawn / Ranks, first)"
        )
    pg = dist.group.WORLD if group is None else group
    if not isinstance(pg, dist.ProcessGroup):
        raise TypeError(
            f"group_timeout: group must be a ProcessGroup or None, got {type(pg).__name__}"
        )
    for kind in pg._device_types:
        try:
            options = pg._get_backend(kind).options
        except (AttributeError, RuntimeError):  # no backend for the device, or no options
            continue
        timeout = getattr(options, "_timeout", None)
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return c10d._get_default_timeout(dist.get_backend(pg))


def comm_group():
    """The process group of pipecomm's communication thread (asynchronous collectives).

    Created eagerly by :func:`spawn`, :class:`Ranks` and :func:`init_from_env`; a process that
    initialised ``torch.distributed`` itself gets it on first use, which like any ``new_group``
    must then happen on every rank in the same order. It (and the groups of the reverse
    direction) takes the world's timeout (:func:`group_timeout`), so a transfer to a dead or
    stuck peer fails as the job's own collectives do.

    Example::

        g = launch.comm_group()   # a duplicate of the world group for background transfers
    """
    global _COMM_GROUP, _COMM_WORLD
    _forget_stale()
    if _COMM_GROUP is None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: start ranks with pipecomm.launch.spawn / "
                "Ranks, or call pipecomm.launch.init_from_env() under torchrun"
            )
        backend = dist.get_backend()
        timeout = group_timeout()
        _COMM_GROUP = dist.new_group(backend=backend, timeout=timeout)
        _COMM_WORLD = dist.group.WORLD
        _REVERSE.clear()
        if backend != "nccl":  # NCCL has its own channels per direction
            _REVERSE["comm"] = dist.new_group(backend=backend, timeout=timeout)
            _REVERSE["world"] = dist.new_group(backend=backend, timeout=timeout)
    return _COMM_GROUP


def has_comm_group() -> bool:
    """Whether :func:`comm_group` exists in this process (it is created on first use).

    Example::

        launch.has_comm_group()   # True in a pipecomm pool
    """
    _forget_stale()
    return _COMM_GROUP is not None


def reverse_transport(transport: Any) -> tuple[Any, int] | None:
    """Where pipecomm's messages to a *lower* global rank travel when ``transport`` carries
    those to a higher one: ``(group, tag)``, or ``None`` (one group carries both directions).

    On gloo one TCP connection per pair of ranks carries both directions of the pair, and a
    send and a receive posted together on it often run one after the other instead of at once
    (measured on shaped links, E14): half the link's duplex bandwidth is lost exactly where LP
    allreduce, BE and two-rank rings send and receive between the same two ranks. So each
    direction gets a connection of its own: a world-wide duplicate of the transport (created
    with :func:`comm_group`, on every rank) carries the reverse direction; a subgroup's reverse
    traffic shares the world's duplicate under a tag of its own, so concurrent collectives on
    different groups never match each other's messages. Before :func:`comm_group` exists (a
    process that initialised torch.distributed itself and has not used pipecomm's asynchronous
    collectives yet) and on NCCL: ``None``.

    Example::

        launch.reverse_transport(None)   # (<world duplicate>, 0) in a pipecomm pool
    """
    import zlib

    import torch.distributed as dist

    _forget_stale()
    if _COMM_GROUP is None or not _REVERSE:
        return None
    if transport is _COMM_GROUP:
        return _REVERSE["comm"], 0
    if transport is None or transport is dist.group.WORLD:
        return _REVERSE["world"], 0
    name = dist.distributed_c10d._get_process_group_name(transport)
    return _REVERSE["world"], 1 + (zlib.crc32(name.encode()) & 0x3FFFFFFF)


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued kernels when it is a GPU (CUDA kernels run asynchronously, so
    a host clock read without this measures launches, not work); nothing for the CPU or None.

    Example::

        >>> import time
        >>> from pipecomm import launch
        >>> launch.synchronize(launch.device()); t0 = time.perf_counter()
    """
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def device():
    """This rank's device: ``cuda:<current>`` when the default process group is NCCL (launch
    pinned one GPU per local rank), else ``cpu`` (gloo, or no process group at all).

    Experiments place models and batches with it, so one code path serves both profiles.

    Example::

        >>> import torch
        >>> from pipecomm import launch
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


def ranks_per_node() -> int | None:
    """Ranks per (real or emulated) node: ``LOCAL_WORLD_SIZE`` as set by torchrun or by launch.

    Example::

        >>> from pipecomm import launch
        >>> rpn = launch.ranks_per_node()   # e.g. 2 under Ranks(8, ranks_per_node=2)
        >>> print(rpn)                      # outside a pool
        None
    """
    value = os.environ.get("LOCAL_WORLD_SIZE")
    return int(value) if value else None


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

    global _COMM_GROUP
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
    _COMM_GROUP = None
    _REVERSE.clear()
    comm_group()
