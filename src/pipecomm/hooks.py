"""DDP communication hooks on pipecomm's collectives: averaging, and Pipe-SGD inside stock DDP.

A DDP communication hook (``model.register_comm_hook(state, hook)``) receives each gradient
bucket, ``hook(state, bucket)``, and returns a ``torch.futures.Future`` of the tensor DDP writes
back into the gradients, as torch's own ``allreduce_hook`` and PowerSGD do.

* :func:`allreduce_hook` with :class:`CollectiveState` — the bucket averaged over the state's
  group with pipecomm's AllReduce: linear pipelining (``"lp"``, Wang et al., arXiv 1611.04255),
  ``"mst"``, ``"be"``, ``"ring"`` or the backend's ``"torch"``, optionally carrying Pipe-SGD's
  light compression (``"fp16"``, ``"bf16"``, ``"int8"``; ``"lp"``/``"ring"`` only).
* :func:`pipelined_hook` with :class:`PipelinedState` — Pipe-SGD (Li, Yu, Li, Avestimehr, Kim,
  Schwing, "Pipe-SGD: A Decentralized Pipelined SGD Framework for Distributed Deep Net
  Training", NeurIPS 2018) with staleness k: the hook of iteration t launches the average of the
  bucket's gradient at ``w_t`` and returns the average launched at iteration ``t - k``, so that
  AllReduce overlaps the k iterations in between. With the optimizer stepping after every
  backward this is the rule of :class:`pipecomm.pipesgd.PipeSGD` (``mode="pipe"``),
  ``w_{t+1} = step(w_t, g(w_{t-k}))`` for ``t >= k``.

The first k iterations differ in one respect. PipeSGD does not step at all while the pipeline
fills (``w_{t+1} = w_t`` for ``t < k``); a hook cannot stop the optimizer, so it returns zero
gradients and the loop's ``optimizer.step()`` runs with them. That is a no-op for SGD without
weight decay, with or without momentum (torch's momentum buffer starts at the zero gradient and
next becomes ``0 * mu + g``, the same as starting at ``g``; dampening must be 0): the parameters
equal PipeSGD's. It is *not* a no-op with weight decay (``w`` shrinks by ``lr * wd * w``), with
Adam/AdamW (the step count advances, changing the bias correction; AdamW also decays ``w``), or
with a learning-rate scheduler stepped per iteration (the schedule shifts by k). For those,
skip the step while :attr:`PipelinedState.filling` is True — then the parameters equal PipeSGD's
for every optimizer::

    loss.backward()
    if not state.filling:
        opt.step()

A state averages over ``process_group`` (``None``: the world), which must be the DDP model's
group: :func:`register` checks that before registering, and a hook called on a rank outside the
state's group raises an error naming it. Futures are resolved on :mod:`pipecomm.backend`'s
completion thread as soon as pipecomm's communication thread has finished the AllReduce.

Example::

    from torch.nn.parallel import DistributedDataParallel as DDP
    from pipecomm import hooks

    model = DDP(net)
    hooks.register(model, hooks.CollectiveState(algorithm="lp"), hooks.allreduce_hook)

    model = DDP(net)
    state = hooks.PipelinedState(staleness=1, algorithm="ring", compression="fp16")
    hooks.register(model, state, hooks.pipelined_hook)
    for x, y in batches:
        opt.zero_grad()
        loss_fn(model(x), y).backward()     # launches this gradient, returns the previous one
        opt.step()
    state.wait()                            # before destroying the process group

The hooks' annotations are evaluated (no ``from __future__ import annotations``): DDP's
``register_comm_hook`` compares them with ``dist.GradBucket`` and ``Future[torch.Tensor]``.
"""

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import backend, collectives, vocab

__all__ = [
    "CollectiveState",
    "PipelinedState",
    "allreduce_hook",
    "pipelined_hook",
    "register",
]

_DEFAULT_TIMEOUT_S = 1800.0  # torch's default process group timeout


def _check_common(
    where: str, algorithm: Any, compression: Any, block_bytes: Any, timeout_s: Any
) -> None:
    vocab.check_algorithm(algorithm, where=where)
    vocab.check_compression(compression, algorithm=algorithm, where=where)
    if block_bytes is not None and (
        isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0
    ):
        raise ValueError(
            f"{where}: block_bytes must be a positive int (bytes per LP block) or None, "
            f"got {block_bytes!r}"
        )
    if (
        isinstance(timeout_s, bool)
        or not isinstance(timeout_s, int | float)
        or not math.isfinite(timeout_s)
        or timeout_s <= 0
    ):
        raise ValueError(
            f"{where}: timeout_s must be a positive number of seconds, got {timeout_s!r}"
        )


def _group_of(where: str, process_group: Any) -> dist.ProcessGroup | None:
    """The state's group, checked at the hook: this rank must be one of its members."""
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or (
        process_group is not None
        and dist.get_rank() not in dist.get_process_group_ranks(process_group)
    ):
        raise ValueError(
            f"{where}: the state is bound to another process group: this rank "
            f"({dist.get_rank()}) is not a member of state.process_group. Build the state with "
            "process_group=<the DDP model's process_group> on every rank of that group (or use "
            "pipecomm.hooks.register, which checks this)"
        )
    return process_group


@dataclass
class CollectiveState:
    """The state of :func:`allreduce_hook`: which AllReduce averages the buckets, over which group.

    Args:
        algorithm: ``"lp"`` (linear pipelining, Wang et al., arXiv 1611.04255), ``"mst"``,
            ``"be"``, ``"ring"`` or ``"torch"`` (:data:`pipecomm.vocab.ALGORITHMS`).
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"int8"`` (``"lp"``/``"ring"`` only).
        process_group: the DDP model's group (``None``: the world).
        block_bytes: LP block size (``None``: the cost model's optimum).
        timeout_s: how long a bucket's future waits for its AllReduce before it fails.

    Arguments are checked on construction, before any communication.

    Example::

        state = CollectiveState(algorithm="ring", compression="bf16")
        ddp_model.register_comm_hook(state, allreduce_hook)
    """

    algorithm: str = vocab.DEFAULT_ALGORITHM
    compression: str | None = None
    process_group: dist.ProcessGroup | None = None
    block_bytes: int | None = field(default=None, kw_only=True)
    timeout_s: float = field(default=_DEFAULT_TIMEOUT_S, kw_only=True)

    def __post_init__(self) -> None:
        _check_common(
            "CollectiveState", self.algorithm, self.compression, self.block_bytes, self.timeout_s
        )


def _launch(state: Any, where: str, t: torch.Tensor) -> collectives.Handle:
    """Start the average of ``t`` over the state's group on the communication thread."""
    return collectives.allreduce(
        t,
        algorithm=state.algorithm,
        op="avg",
        group=_group_of(where, state.process_group),
        block_bytes=state.block_bytes,
        async_op=True,
        compression=state.compression,
    )


def allreduce_hook(
    state: CollectiveState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over ``state.process_group`` with pipecomm's AllReduce.

    The AllReduce (``op="avg"``: sum, then one division by p) runs in place on the bucket's
    buffer on pipecomm's communication thread; the returned future resolves to that buffer. With
    ``compression=None`` the result equals DDP's own averaging up to float round-off.

    Example::

        ddp_model.register_comm_hook(CollectiveState(algorithm="lp"), allreduce_hook)
    """
    if not isinstance(state, CollectiveState):
        raise TypeError(
            f"allreduce_hook: state must be a CollectiveState, got {type(state).__name__}"
        )
    buf = bucket.buffer()
    handle = _launch(state, "allreduce_hook", buf)
    return backend.future_of(handle, lambda: buf, timeout_s=state.timeout_s)


# --------------------------------------------------------------------------- Pipe-SGD


@dataclass
class _Launched:
    """One bucket's averaged copy, launched at some iteration, and where its parameters lie."""

    params: tuple[int, ...]  # id() of the bucket's parameters, in buffer order
    offsets: tuple[int, ...]  # element offset of each parameter in ``avg``
    avg: torch.Tensor
    handle: collectives.Handle


@dataclass
class PipelinedState:
    """The state of :func:`pipelined_hook`: staleness k and the AllReduce of Pipe-SGD.

    Args:
        staleness: k >= 0, how many iterations late an average is applied (Pipe-SGD's pipeline
            of width 2 is k = 1; k = 0 averages synchronously through the communication thread).
        algorithm, compression, process_group, block_bytes, timeout_s: as in
            :class:`CollectiveState`, the default algorithm being ``"ring"``.

    Attributes:
        iteration: synchronised backward passes so far (``no_sync`` passes do not count).
        filling: True after a backward whose hook returned zero gradients because the pipeline
            was still filling (``iteration <= staleness``): skip ``optimizer.step()`` then to
            apply PipeSGD's ``w_{t+1} = w_t`` exactly (see the module docstring).

    The averages in flight are not part of any checkpoint: a run resumed with a fresh state
    refills the pipeline (k more iterations of zero gradients).

    Example::

        state = PipelinedState(staleness=1, algorithm="ring")
        ddp_model.register_comm_hook(state, pipelined_hook)
    """

    staleness: int = 1
    algorithm: str = "ring"
    compression: str | None = None
    process_group: dist.ProcessGroup | None = None
    block_bytes: int | None = field(default=None, kw_only=True)
    timeout_s: float = field(default=_DEFAULT_TIMEOUT_S, kw_only=True)
    iteration: int = field(default=0, init=False)
    _history: collections.deque = field(default_factory=collections.deque, init=False, repr=False)

    def __post_init__(self) -> None:
        k = self.staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"PipelinedState: staleness must be an int >= 0, got {k!r}")
        _check_common(
            "PipelinedState", self.algorithm, self.compression, self.block_bytes, self.timeout_s
        )

    @property
    def filling(self) -> bool:
        """True while the last backward's gradients were the zeros of a filling pipeline."""
        return 0 < self.iteration <= self.staleness

    @property
    def in_flight(self) -> int:
        """AllReduces launched by the hook that have not finished yet."""
        return sum(
            not item.handle.is_completed()
            for _, launched in self._history
            for item in launched.values()
        )

    def wait(self) -> None:
        """Wait for every AllReduce still in flight (their averages are not applied): call it
        before destroying the process group or leaving the training loop.

        Example::

            state.wait()
            dist.destroy_process_group()
        """
        for _, launched in self._history:
            for item in launched.values():
                item.handle.wait(self.timeout_s)


def _layout(bucket: dist.GradBucket, buf: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    params = bucket.parameters()
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    if n != buf.numel():
        raise RuntimeError(
            f"pipelined_hook: bucket {bucket.index()} holds {buf.numel()} elements but its "
            f"parameters have {n} (sparse gradients are not supported)"
        )
    return tuple(id(p) for p in params), tuple(offsets)


def _from_history(
    params: tuple[int, ...],
    offsets: tuple[int, ...],
    sizes: list[int],
    buf: torch.Tensor,
    launched: dict[tuple[int, ...], _Launched],
) -> tuple[list[collectives.Handle], Callable[[], torch.Tensor]]:
    """The handles to wait for and the assembly of this bucket's average from an earlier
    iteration's buckets: the same bucket, or (after DDP rebuilt its buckets) its parameters'
    pieces of the earlier buckets."""
    same = launched.get(params)
    if same is not None:
        return [same.handle], lambda: same.avg
    where: dict[int, tuple[_Launched, int]] = {}
    for item in launched.values():
        for pid, off in zip(item.params, item.offsets):
            where[pid] = (item, off)
    needed = {id(where[pid][0]): where[pid][0] for pid in params if pid in where}

    def assemble() -> torch.Tensor:
        out = torch.zeros_like(buf)
        for pid, off, n in zip(params, offsets, sizes):
            if pid in where:
                item, old = where[pid]
                out[off : off + n].copy_(item.avg[old : old + n])
        return out

    return [item.handle for item in needed.values()], assemble


def pipelined_hook(
    state: PipelinedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Pipe-SGD inside DDP: launch this bucket's average, return the one from k iterations ago.

    Iteration t (counted in :attr:`PipelinedState.iteration`) launches the average of a copy of
    the bucket (pipecomm's AllReduce, ``op="avg"``, on the communication thread) and returns a
    future of the average launched at iteration ``t - k`` for the same parameters (also when DDP
    rebuilt its buckets in between), or of zeros while ``t < k`` (see the module docstring for
    what the optimizer does with them). The returned average is fresh memory, never written again.

    Example::

        state = PipelinedState(staleness=1, algorithm="lp", compression="fp16")
        ddp_model.register_comm_hook(state, pipelined_hook)
    """
    if not isinstance(state, PipelinedState):
        raise TypeError(
            f"pipelined_hook: state must be a PipelinedState, got {type(state).__name__}"
        )
    buf = bucket.buffer()
    params, offsets = _layout(bucket, buf)
    t, k = state.iteration, state.staleness
    if not state._history or state._history[-1][0] != t:
        state._history.append((t, {}))
    copy = buf.detach().clone()
    handle = _launch(state, "pipelined_hook", copy)
    state._history[-1][1][params] = _Launched(params, offsets, copy, handle)
    if t < k:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(torch.zeros_like(buf))
    else:
        old = next(launched for it, launched in state._history if it == t - k)
        sizes = [p.numel() for p in bucket.parameters()]
        handles, value = _from_history(params, offsets, sizes, buf, old)
        fut = backend.future_of(handles, value, timeout_s=state.timeout_s)
    if bucket.is_last():
        state.iteration = t + 1
        while state._history and state._history[0][0] <= t - k:
            state._history.popleft()
    return fut


def register(model: Any, state: CollectiveState | PipelinedState, hook: Callable[..., Any]) -> None:
    """``model.register_comm_hook(state, hook)`` after checking that ``state`` averages over the
    model's process group (``state.process_group=None`` is bound to it). No communication.

    Example::

        register(ddp_model, PipelinedState(staleness=1), pipelined_hook)
    """
    if not isinstance(state, CollectiveState | PipelinedState):
        raise TypeError(
            "register: state must be a CollectiveState or a PipelinedState, got "
            f"{type(state).__name__}"
        )
    if not hasattr(model, "register_comm_hook") or not hasattr(model, "process_group"):
        raise TypeError(
            f"register: model must be a DistributedDataParallel, got {type(model).__name__}"
        )
    group = model.process_group
    if state.process_group is None:
        state.process_group = group
    elif state.process_group is not group:
        raise ValueError(
            "register: the state is bound to another process group than the model's "
            f"(state.process_group has ranks {_ranks(state.process_group)}, the model's "
            f"{_ranks(group)}); build the state with process_group=model.process_group or None"
        )
    model.register_comm_hook(state, hook)


def _ranks(group: Any) -> list[int] | str:
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return "(this rank is not a member)"
    return dist.get_process_group_ranks(group or dist.group.WORLD)
