"""Ranks started by torchrun: join the job, and use it like a local pool.

Example::

    # torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 train.py
    from pipecomm.lab.networks import launch
    info = launch.init_from_env()
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from typing import Any

from pipecomm.lab.networks.launch import flight
from pipecomm.lab.networks.launch.rank import (
    RankError,
    RankInfo,
    init_distributed,
    local_world_size,
    set_threads,
    to_cpu,
)

__all__ = ["TorchrunJob", "init_from_env", "under_torchrun"]


class TorchrunJob:
    """The ranks of a torchrun job used like a :class:`Ranks` pool: :meth:`run` runs ``fn`` in
    this process (every rank of the job does the same) and returns every rank's result, in rank
    order, on every rank. So an experiment written for a local pool also runs multi-node.

    Example::

        # torchrun --nnodes 2 --nproc-per-node 4 ... -m pipecomm.lab.experiments.e13_dadam_convergence
        with launch.pool(8, backend="nccl") as ranks:     # a TorchrunJob under torchrun
            per_rank = ranks.run(mymodule.train, cfg)
    """

    def __init__(self, world_size: int, backend: str | None = None, network: Any = None) -> None:
        if network is not None:
            raise ValueError(
                "the emulated network needs local ranks that share memory (launch.Ranks); under "
                "torchrun the real network is measured: pass network=None"
            )
        self.info = init_from_env(backend)
        if world_size != self.info.world_size:
            raise ValueError(
                f"this run needs world_size={world_size} ranks but the torchrun job has "
                f"{self.info.world_size}: start torchrun with {world_size} processes in all, or "
                f"set the experiment's world size to {self.info.world_size}"
            )
        self.world_size = world_size

    def __enter__(self) -> TorchrunJob:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def close(self) -> None:
        """Nothing to stop: torchrun owns the processes."""

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0,
            **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` here; every rank's result (or :class:`RankError` naming the
        first rank that raised). ``timeout_s`` is the process group's own timeout here."""
        import torch.distributed as dist

        try:
            mine: tuple[str, Any] = ("ok", to_cpu(fn(*args, **kwargs)))
        except Exception as exc:
            mine = ("error", (repr(exc), traceback.format_exc()))
            flight.dump(repr(exc))  # with PIPECOMM_FLIGHT_DIR
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, mine)
        for rank, (kind, value) in enumerate(gathered):
            if kind == "error":
                if mine[0] == "ok":
                    flight.dump(f"rank {rank} failed: {value[0]}")
                raise RankError(rank, value[0], value[1])
        return [value for _, value in gathered]


def under_torchrun() -> bool:
    """True in a process that torchrun started (``TORCHELASTIC_RUN_ID`` is set).

    Example::

        >>> from pipecomm.lab.networks import launch
        >>> if launch.under_torchrun(): info = launch.init_from_env()
        >>> launch.under_torchrun()   # not started by torchrun
        False
    """
    return "TORCHELASTIC_RUN_ID" in os.environ


def init_from_env(backend: str | None = None, timeout_s: float = 600.0) -> RankInfo:
    """Join a job started by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``); NCCL when CUDA is available.

    Example::

        # torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint HOST:29500 train.py
        info = launch.init_from_env()
        print(info.rank, info.world_size, info.backend)
    """
    import torch
    import torch.distributed as dist

    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"init_from_env: environment variables {missing} are not set; start this program "
            "with torchrun (for example `torchrun --nproc-per-node 4 -m pipecomm.lab.experiments."
            "e13_dadam_convergence --out DIR`) or use pipecomm.lab.networks.launch.spawn for local ranks"
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    # the ranks sharing this host's cores: torchrun's local world, unless the starter knows more
    # (a virtual cluster's nodes of one rank all share one host: threads = cores // all ranks)
    os.environ.setdefault("PIPECOMM_PROCS_ON_HOST", str(local_world))
    set_threads(local_world_size())
    if not dist.is_initialized():
        init_distributed(rank=rank, world_size=world, backend=backend, init_method="env://",
                          timeout_s=timeout_s, gpu=local_rank)
    device = f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"
    return RankInfo(rank, world, local_rank, local_world, backend, device)
