"""The trainers the training loops drive: one interface over AllReduce and decentralized training.

No paper equation of its own; the update rules are the library's:

* :class:`AllReduceTrainer` -- :class:`pipecomm.pipesgd.PipeSGD` in ``"layerwise"`` mode: gradient
  buckets all-reduced (average) asynchronously as soon as backward has produced them
  (PyTorch-DDP style), overlapped with the rest of backward, then one optimizer step (zero
  staleness): the schedule ``runtime_model.simulate("allreduce")`` models (DAdam paper, Wang,
  Zhang, Wu, Johansson, ICLR 2025). On pipecomm's collectives, so it runs on the emulated network.
* :class:`DecentralizedTrainer` -- :class:`~pipecomm.decentralized.DecentralizedDataParallel`:
  each bucket gossiped over the topology's group and stepped by its own optimizer from backward
  hooks (DAdam / AccumAdam, docs/update_rules.md).
* :class:`AfterBackwardTrainer` -- E11's overlap ablation of the AllReduce baseline: the same
  buckets, all-reduced only after backward (no overlap); ``DecentralizedTrainer(...,
  overlap=False)`` is DAdam's: ``step()`` waits for the iteration's gossip before the next
  forward.

Both answer :class:`Trainer`: call ``trainer.module`` forward, ``zero_grad()`` before backward,
``step()`` after it, ``averaged()`` for the parameters averaged over the ranks, ``close()`` at
the end. :func:`make_trainer` builds either from an optimizer factory. The loops over them are
E11/E12's timing loop (``dadam_timing.rank_time_training``) and E13's convergence loop.

The Pipe-SGD family (E5-E9, ``pipesgd_training``) drives PipeSGD's own modes (staleness,
compression, per-iteration timings) directly; what it shares from here is how a rank runs:
:func:`rank_world` and the GIL switch interval (:func:`gil_switch_interval`).

Example::

    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> model, loss_fn = nn.Linear(4, 1), nn.functional.mse_loss
    >>> x, y = torch.ones(8, 4), torch.zeros(8, 1)
    >>> trainer = make_trainer(model, lambda named: torch.optim.Adam([p for _, p in named]),
    ...                        topology=None, bucket_mb=25.0, algorithm="ring")
    >>> trainer.zero_grad(); loss_fn(trainer.module(x), y).backward(); trainer.step()
    >>> trainer.close()
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import collectives
from pipecomm.bucketing import bucket_indices
from pipecomm.decentralized.topology import Topology

__all__ = [
    "AfterBackwardTrainer",
    "AllReduceTrainer",
    "DecentralizedTrainer",
    "OptimizerFactory",
    "Trainer",
    "gil_switch_interval",
    "make_trainer",
    "rank_world",
]

#: Builds the optimizer of a trainer from the model's ``named_parameters()``.
OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


class Trainer(Protocol):
    """What a training loop calls on a data-parallel trainer."""

    module: nn.Module
    optimizer: torch.optim.Optimizer

    def zero_grad(self) -> None: ...

    def step(self) -> None: ...

    def averaged(self) -> contextlib.AbstractContextManager[nn.Module]: ...

    def close(self) -> None: ...


class _Replicated:
    """What the two AllReduce trainers share: gradients cleared to None, and every rank holding
    the same parameters after a step."""

    model: nn.Module

    def zero_grad(self) -> None:
        """Clear the gradients before the next backward."""
        self.model.zero_grad(set_to_none=True)

    def averaged(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model itself: after every step all ranks hold the same parameters."""
        return contextlib.nullcontext(self.model)


class AllReduceTrainer(_Replicated):
    """The AllReduce baseline: :class:`pipecomm.pipesgd.PipeSGD` in ``"layerwise"`` mode.

    Gradient buckets (reverse registration order, closed at ``bucket_mb`` MiB, as DDP) are
    all-reduced (average) asynchronously from backward hooks as soon as backward has produced
    them, overlapped with the rest of backward; ``step()`` waits for all of them and takes the
    optimizer's step (zero staleness) -- the schedule ``runtime_model.simulate("allreduce")``
    models, and the best overlapped AllReduce of this library.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, loss_fn = nn.Linear(4, 1), nn.functional.mse_loss
        >>> x, y = torch.ones(8, 4), torch.zeros(8, 1)
        >>> ar = AllReduceTrainer(model, torch.optim.Adam(model.parameters()), 1.0, "ring")
        >>> ar.zero_grad(); loss_fn(ar.module(x), y).backward(); ar.step()
        >>> ar.close()
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, bucket_mb: float, algorithm: str
    ) -> None:
        from pipecomm.pipesgd import PipeSGD

        self.model = self.module = model
        self.optimizer = optimizer
        self.trainer = PipeSGD(
            model, optimizer, mode="layerwise", algorithm=algorithm, bucket_mb=bucket_mb
        )

    def step(self) -> None:
        """Wait for the bucket allreduces and step."""
        self.trainer.step()

    def close(self) -> None:
        """Apply anything in flight and detach the hooks."""
        self.trainer.finish()
        self.trainer.remove_hooks()


class AfterBackwardTrainer(_Replicated):
    """AllReduce without overlap, the ablation arm of :class:`AllReduceTrainer` (E11): the same
    gradient buckets (reverse registration order, closed at ``bucket_mb`` MiB, as
    DDP), all-reduced (average) only once backward has finished -- launched back to back on
    the communication thread in ``step()``, all waited for -- then the optimizer's step. Only
    when the reductions start differs from :class:`AllReduceTrainer`, so the difference of the
    two is what the overlap with backward hides (``runtime_model.simulate("allreduce",
    overlap=False)`` models it). The replicas start equal when every rank builds the model
    from the same seed (the timing workload does); nothing is broadcast.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, loss_fn = nn.Linear(4, 1), nn.functional.mse_loss
        >>> x, y = torch.ones(8, 4), torch.zeros(8, 1)
        >>> ab = AfterBackwardTrainer(model, torch.optim.Adam(model.parameters()), 1.0, "ring")
        >>> ab.zero_grad(); loss_fn(ab.module(x), y).backward(); ab.step()
        >>> len(ab.buckets), ab.close()
        (1, None)
        >>> dist.destroy_process_group()
    """

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, bucket_mb: float, algorithm: str
    ) -> None:
        self.model = self.module = model
        self.optimizer = optimizer
        self.algorithm = algorithm
        self._params = [q for g in optimizer.param_groups for q in g["params"]
                        if q.requires_grad]
        #: indices into the optimizer's parameters, one list per bucket, in launch order
        self.buckets: list[list[int]] = bucket_indices(self._params, bucket_mb * 2**20,
                                                       order="reverse", kinds="interleaved")

    @torch.no_grad()
    def step(self) -> None:
        """All-reduce every bucket (launched back to back, then waited for), then step."""
        if dist.get_world_size() > 1:
            flats = []
            for idx in self.buckets:
                grads = [self._params[i].grad for i in idx]
                flats.append(torch.cat([
                    (torch.zeros_like(self._params[i]) if g is None else g).reshape(-1)
                    for i, g in zip(idx, grads)]))
            handles = [collectives.allreduce(f, algorithm=self.algorithm, op="avg",
                                             async_op=True) for f in flats]
            for idx, flat, h in zip(self.buckets, flats, handles):
                h.wait()
                offset = 0
                for i in idx:
                    q = self._params[i]
                    q.grad = flat[offset:offset + q.numel()].view_as(q).clone()
                    offset += q.numel()
        self.optimizer.step()

    def close(self) -> None:
        """Nothing in flight between steps: nothing to do."""


class DecentralizedTrainer:
    """:class:`~pipecomm.decentralized.DecentralizedDataParallel` behind :class:`Trainer`: the
    wrapper gossips and steps from backward hooks, so ``zero_grad()`` and ``step()`` do nothing
    -- except with ``overlap=False`` (E11's overlap ablation), where ``step()`` waits for the
    gossip launched in this iteration, so that none of it overlaps the next forward.

    Example::

        >>> from pipecomm.decentralized.topology import get_topology
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, x, topo = nn.Linear(4, 1), torch.ones(8, 4), get_topology("complete", 1)
        >>> adam_factory = lambda named: torch.optim.Adam([p for _, p in named])
        >>> tr = DecentralizedTrainer(model, adam_factory, topology=topo, bucket_mb=1.0,
        ...                           algorithm="ring")
        >>> tr.module(x).pow(2).mean().backward()      # gossip and step happen here
        >>> tr.close()
        >>> dist.destroy_process_group()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerFactory,
        *,
        topology: Topology,
        bucket_mb: float,
        algorithm: str,
        overlap: bool = True,
    ) -> None:
        from pipecomm.decentralized import DecentralizedDataParallel

        self.overlap = overlap
        self.ddp = self.module = DecentralizedDataParallel(
            model, optimizer, topology=topology, bucket_mb=bucket_mb, algorithm=algorithm
        )
        self.optimizer = self.ddp.optimizer

    def zero_grad(self) -> None:
        """Nothing: the wrapper consumes the gradients in backward."""

    def step(self) -> None:
        """Nothing: the wrapper steps every bucket in backward (``overlap=False``: wait for
        this iteration's gossip)."""
        if not self.overlap:
            self.ddp.finish()

    def averaged(self) -> contextlib.AbstractContextManager[nn.Module]:
        """The model holding the parameters averaged over all ranks (a collective)."""
        return self.ddp.averaged()

    def close(self) -> None:
        """Wait for in-flight gossip and remove the hooks."""
        self.ddp.close()


def make_trainer(
    model: nn.Module,
    optimizer: OptimizerFactory,
    *,
    topology: Topology | None,
    bucket_mb: float,
    algorithm: str,
    overlap: bool = True,
) -> AllReduceTrainer | AfterBackwardTrainer | DecentralizedTrainer:
    """:class:`AllReduceTrainer` when ``topology`` is None, else :class:`DecentralizedTrainer`
    on it; ``optimizer(named_parameters)`` builds the optimizer either way. ``overlap=False``
    is E11's ablation: :class:`AfterBackwardTrainer`, or a DecentralizedTrainer that waits for
    its gossip in ``step()``.

    Example::

        >>> from pipecomm.decentralized.topology import get_topology
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, adam = nn.Linear(4, 1), lambda named: torch.optim.Adam([p for _, p in named])
        >>> trainer = make_trainer(model, adam, topology=get_topology("complete", 1), bucket_mb=25.0,
        ...                        algorithm="ring")
        >>> type(trainer).__name__
        'DecentralizedTrainer'
        >>> trainer.close()
        >>> dist.destroy_process_group()
    """
    if topology is None:
        opt = optimizer(list(model.named_parameters()))
        cls = AllReduceTrainer if overlap else AfterBackwardTrainer
        return cls(model, opt, bucket_mb=bucket_mb, algorithm=algorithm)
    return DecentralizedTrainer(
        model, optimizer, topology=topology, bucket_mb=bucket_mb, algorithm=algorithm,
        overlap=overlap,
    )


def rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of this process; ``(0, 1)`` outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def gil_switch_interval(seconds: float) -> Iterator[None]:
    """Set Python's GIL switch interval (``sys.setswitchinterval``) for a block, then restore it.

    PipeSGD's AllReduce runs on a communication thread. Each time it wakes (a transfer done, an
    emulated deadline reached) it needs the GIL; while the compute thread runs Python (module
    calls, hooks, the optimizer loop) it may wait up to the switch interval -- 5 ms by default --
    per wake-up, which delays the reduction it should overlap. The experiments E6-E9 set
    ``switch_interval_s`` (recorded with their data); 0.005 is Python's default.

    Example::

        >>> old, train = sys.getswitchinterval(), lambda: sys.getswitchinterval()
        >>> with gil_switch_interval(1e-4):
        ...     round(train(), 6)
        0.0001
        >>> abs(sys.getswitchinterval() - old) < 1e-6    # restored (Python keeps microseconds)
        True
    """
    old = sys.getswitchinterval()
    sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(old)

