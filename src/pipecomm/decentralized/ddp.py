"""DecentralizedDataParallel: gossip of parameters overlapped with the next iteration.

DAdam paper (Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
Decentralized Training", ICLR 2025), adapt-while-combine as in the authors' implementation: rank
``i`` mixes ``y_i^k = sum_j (W_k)_ij x_j^k`` (``W_k = topology.mixing_matrix(k)``) and takes its
local optimizer's step from ``y_i^k`` with the gradient computed at ``x_i^k``. Each bucket of
about ``bucket_mb`` MiB is updated inside backward as soon as its gradients are ready, and its
next gossip (``collectives.allreduce(..., op="avg", async_op=True)`` on the rank's group) overlaps
the rest of backward and the next forward.

Update rule and how it is executed (buckets, iteration 0, resume, clipping scope, fp16):
docs/update_rules.md, "Decentralized training" and "DecentralizedDataParallel: design notes".

Example::

    >>> import torch, torch.distributed as dist
    >>> from pipecomm.decentralized import DecentralizedDataParallel, AccumAdam
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> model = torch.nn.Linear(2, 1)
    >>> ddp = DecentralizedDataParallel(model, AccumAdam(model.parameters()), topology="ring")
    >>> ddp(torch.ones(4, 2)).sum().backward()   # mixes, steps, launches the next gossip
    >>> ddp.close(); dist.destroy_process_group()
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import checks, collectives, vocab
from pipecomm.bucketing import bucket_bytes, bucket_indices
from pipecomm.collectives import api
from pipecomm.decentralized.gossip import Bucket, as_one_block, topology_groups
from pipecomm.decentralized.replicas import NORM_SCOPES as NORM_SCOPES  # re-exported: public API
from pipecomm.decentralized.replicas import (
    broadcast_state,
    check_max_norm,
    check_same,
    check_scaler,
    group_members,
    make_optimizer,
)
from pipecomm.decentralized.topology import Topology, get_topology

__all__ = ["DecentralizedDataParallel", "OptimFn"]

#: ``optim_fn(list of (name, parameter)) -> torch.optim.Optimizer`` (called once, all parameters)
OptimFn = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]

_NAME = "DecentralizedDataParallel"
#: key this wrapper adds to ``optimizer.state_dict()``
STATE_KEY = "decentralized_data_parallel"

# id(parameter) -> the DecentralizedDataParallel that hooks it (to refuse wrapping twice)
_OWNERS: weakref.WeakValueDictionary[int, DecentralizedDataParallel] = weakref.WeakValueDictionary()


class DecentralizedDataParallel(nn.Module):
    """Decentralized data parallelism (DAdam): local steps, parameters gossiped in the background.

    Args:
        model: the local replica (on its device already). Every rank must build the same
            structure (names, shapes, dtypes), else a ValueError says what differs.
        optimizer: a ``torch.optim.Optimizer`` over the model's trainable parameters (any torch
            optimizer whose step treats parameters independently; its state stays local), or
            ``optim_fn(list of (name, parameter)) -> optimizer``, called once here. Exposed as
            :attr:`optimizer`; do not call its ``step()`` yourself.
        topology: a name of :func:`~pipecomm.decentralized.topology.get_topology` (size of the
            process group, ranks per node from ``LOCAL_WORLD_SIZE`` where needed) or a
            :class:`~pipecomm.decentralized.topology.Topology` over group ranks.
        bucket_mb: bucket size in MiB (a bucket closes once it reaches it; a tiny value gives one
            parameter per bucket).
        algorithm: the gossip's allreduce: ``"auto"`` (default: per call the fastest), ``"lp"``,
            ``"mst"``, ``"be"``, ``"ring"`` or ``"torch"`` (the built-in; not under emulation).
        process_group: the ranks that train (``None``: all); construct on those ranks only.
        max_grad_norm: clip this rank's gradient to this 2-norm (``None``: no clipping).
        grad_norm_scope: ``"bucket"`` (default: each bucket by its own norm, keeps the overlap
            with backward) or ``"global"`` (the whole local gradient; steps wait for the end
            of backward). Why: docs/update_rules.md, "DecentralizedDataParallel: design notes".
        grad_scaler: a ``torch.amp.GradScaler`` for fp16 (the wrapper unscales, skips
            non-finite steps and updates it; call only ``grad_scaler.scale(loss).backward()``).
        init_sync: broadcast rank 0's parameters and buffers at construction (turn it off when
            every rank loaded its own checkpoint before wrapping).

    Usage: ``loss_fn(ddp(x), y).backward()``; no ``optimizer.step()``: the mix and the step
    happen inside backward, which consumes the gradients (they are None afterwards). Every
    synchronising backward is one iteration; every rank must run the same number of them.
    Use non-reentrant activation checkpointing only.

    Attributes:
        step_count: iterations done (synchronising backward passes).
        optimizer: the optimizer; attach lr schedulers to it, checkpoint its ``state_dict()``.
        grad_norm: 2-norm of this rank's whole gradient before clipping in the last iteration
            (a tensor; ``None`` unless ``max_grad_norm`` is set).
        bucket_names: the parameter names of every bucket (empty before the first backward).
        timing: cumulative seconds ``wait_s`` (blocked on gossip inside backward), ``update_s``
            (mix + optimizer steps), ``launch_s`` (copy + launch of gossip), ``gossip_bytes``
            (bytes this rank gossiped), ``iterations``; :meth:`reset_timing` zeroes it.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model = torch.nn.Linear(4, 3)
        >>> batches = [(torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1]))] * 2
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> ddp = DecentralizedDataParallel(model, opt, topology="one-peer-exp", bucket_mb=4.0)
        >>> sched = torch.optim.lr_scheduler.StepLR(ddp.optimizer, step_size=100)
        >>> for x, y in batches:
        ...     for micro, (xm, ym) in enumerate(zip(x.chunk(2), y.chunk(2))):   # accumulation
        ...         ddp.require_backward_grad_sync = micro == 1      # or: with ddp.no_sync()
        ...         torch.nn.functional.cross_entropy(ddp(xm), ym).div(2).backward()
        ...     sched.step()
        >>> with ddp.averaged():
        ...     print(model)                                          # evaluate(model)
        Linear(in_features=4, out_features=3, bias=True)
        >>> ddp.timing["iterations"]
        2
        >>> ddp.close(); dist.destroy_process_group()
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimFn,
        topology: str | Topology = "complete",
        bucket_mb: float = 25.0,
        algorithm: str = vocab.DEFAULT_ALGORITHM,
        *,
        process_group: dist.ProcessGroup | None = None,
        max_grad_norm: float | None = None,
        grad_norm_scope: str = "bucket",
        grad_scaler: torch.amp.GradScaler | None = None,
        init_sync: bool = True,
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_NAME}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer, torch.optim.Optimizer) or callable(optimizer)):
            raise TypeError(f"{_NAME}: optimizer must be a torch.optim.Optimizer or a function "
                            "optim_fn(list of (name, parameter)) -> optimizer, got "
                            f"{type(optimizer).__name__}")
        bucket_bytes_ = bucket_bytes(bucket_mb, where=_NAME)
        algorithm = api.check_algorithm(algorithm, _NAME)
        max_norm = check_max_norm(max_grad_norm, grad_norm_scope)
        checks.flag(init_sync, "init_sync", _NAME)
        if not dist.is_initialized():
            raise RuntimeError(f"{_NAME}: torch.distributed is not initialised: start ranks with "
                               "pipecomm.lab.networks.launch.spawn / Ranks, or call "
                               "pipecomm.lab.networks.launch.init_from_env() first")
        pg, members = group_members(process_group)
        self.process_group = pg
        self._members = members
        self.rank = members.index(dist.get_rank())  # rank in the process group
        self.world_size = len(members)
        if not isinstance(topology, (str, Topology)):
            raise TypeError(f"{_NAME}: topology must be a topology name or a Topology, got "
                            f"{type(topology).__name__}")
        try:
            topo = get_topology(topology, self.world_size)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{_NAME}: topology={topology!r}: {exc}") from exc
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{_NAME}: the model has no parameter that requires grad")
        for n, p in named:
            owner = _OWNERS.get(id(p))
            if owner is not None and not owner._closed and any(q is p for q in owner._params):
                raise ValueError(f"{_NAME}: parameter {n!r} already belongs to a live {_NAME}; "
                                 "call its close() before wrapping the model again")
        opt = make_optimizer(optimizer, named)
        scaler = check_scaler(grad_scaler, [p for _, p in named])

        self.module = model
        self.optimizer = opt
        self.topology = topo
        self.algorithm = algorithm
        self.bucket_mb = float(bucket_mb)
        self.max_grad_norm = max_norm
        self.grad_norm_scope = grad_norm_scope
        self.grad_scaler = scaler
        self.grad_norm: torch.Tensor | None = None
        self.require_backward_grad_sync = True
        self._bucket_bytes = bucket_bytes_
        self._deferred = scaler is not None or max_norm is not None and grad_norm_scope == "global"
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._buckets: list[Bucket] | None = None
        self._bucket_of: list[Bucket] = []
        self._order: list[int] = []  # first backward: order in which gradients became ready
        self._seen: set[int] = set()
        self._next_launch = 0
        self._backward_task: int | None = None  # graph task of the backward in progress
        self._task_syncs = True  # whether the backward in progress synchronises
        self._forward_sync: bool | None = None  # require_backward_grad_sync at the last forward
        self._accumulated = False  # a no_sync backward left gradients to apply
        self._bucket_norms: list[torch.Tensor] = []
        self._closed = False
        self._local_state: dict[str, torch.Tensor] | None = None  # put back by the next forward
        self.step_count = 0
        self.timing: dict[str, float] = {}
        self.reset_timing()

        check_same(model, {}, pg, _NAME)
        if init_sync:
            broadcast_state(model, members[0], pg)
        self._groups = topology_groups(topo, members)  # every group a step uses, made once
        self._hooks = [opt.register_state_dict_post_hook(self._optimizer_state_dict_hook),
                       opt.register_load_state_dict_pre_hook(self._optimizer_load_hook)]
        for i, p in enumerate(self._params):
            hook = functools.partial(self._grad_ready, i)
            self._hooks.append(p.register_post_accumulate_grad_hook(hook))
            _OWNERS[id(p)] = self

    # ------------------------------------------------------------------ nn.Module interface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model (its parameters are ``x^k``; gossip may be in flight).

        Records ``require_backward_grad_sync`` for the backward of this forward (as torch's
        DistributedDataParallel does); the example of :class:`DecentralizedDataParallel` runs it.
        """
        checks.flag(self.require_backward_grad_sync, "require_backward_grad_sync", _NAME)
        self._restore_local()
        self._forward_sync = self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _restore_local(self) -> None:
        """Undo a non-in-place :meth:`global_average`: each rank's own ``x_i`` comes back."""
        if self._local_state is not None:
            self.module.load_state_dict(self._local_state)
            self._local_state = None

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """The wrapped model's named parameters, without a wrapper prefix."""
        return self.module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped model's named buffers, without a wrapper prefix."""
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        """This rank's model state: exactly ``model.state_dict()`` (same keys, no prefix).

        The optimizer's state (with this wrapper's iteration count) is
        ``ddp.optimizer.state_dict()``; both are per rank (the replicas differ).

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> list(ddp.state_dict())                 # model.state_dict()'s keys
            ['weight', 'bias']
            >>> ddp.close(); dist.destroy_process_group()
        """
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load into the wrapped model, in place (keys as ``model.state_dict()``).

        To resume a run, load every rank's own model state and then its optimizer state
        (``ddp.optimizer.load_state_dict``) before the first backward. After the first backward
        the in-flight gossip still carries the old values; load on every rank and call
        ``global_average(inplace=True)`` to restart from a common model.

        Example::

            >>> import io
            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> path = io.BytesIO()
            >>> torch.save({"model": ddp.state_dict(), "optimizer": ddp.optimizer.state_dict()}, path)
            >>> _ = path.seek(0); ckpt = torch.load(path)
            >>> ddp.load_state_dict(ckpt["model"]); ddp.optimizer.load_state_dict(ckpt["optimizer"])
            <All keys matched successfully>
            >>> ddp.close(); dist.destroy_process_group()
        """
        if assign:
            raise ValueError(f"{_NAME}.load_state_dict: assign=True would replace the parameters "
                             "that the hooks and optimizer hold; use assign=False (copy in place)")
        return self.module.load_state_dict(state_dict, strict=strict)

    # ------------------------------------------------------------------ optimizer state hooks
    def _optimizer_state_dict_hook(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        state[STATE_KEY] = {"step_count": self.step_count, "rank": self.rank,
                            "world_size": self.world_size}
        return state

    def _optimizer_load_hook(self, optimizer: Any, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        ours = state.pop(STATE_KEY, None)
        if ours is None:
            return state
        if (ours["rank"], ours["world_size"]) != (self.rank, self.world_size):
            raise ValueError(f"{_NAME}: optimizer.load_state_dict: the state was saved by rank "
                             f"{ours['rank']} of {ours['world_size']}, this is rank {self.rank} "
                             f"of {self.world_size}; every rank loads its own state (remove the "
                             f"key {STATE_KEY!r} to load another rank's state on purpose)")
        if ours["step_count"] != self.step_count:
            if self._buckets is not None:
                raise RuntimeError(f"{_NAME}: optimizer.load_state_dict: the state is of "
                                   f"iteration {ours['step_count']} but this wrapper is at "
                                   f"{self.step_count} with gossip in flight; load checkpoints "
                                   "into a new wrapper before its first backward")
            self.step_count = int(ours["step_count"])
        return state

    # ------------------------------------------------------------------ public helpers
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """``[ddp.optimizer]`` (kept for older code; there is one optimizer for all buckets)."""
        return [self.optimizer]

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names of every bucket (empty before the first backward)."""
        return [list(b.names) for b in self._buckets or []]

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes of forwards run inside accumulate gradients only (no mix, no step).

        The next backward of a forward run outside (``require_backward_grad_sync`` true) mixes
        and steps with the accumulated gradients, as torch's DistributedDataParallel.

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> with ddp.no_sync():
            ...     ddp(torch.ones(2, 2)).sum().backward()     # accumulates
            >>> ddp(torch.ones(2, 2)).sum().backward()         # mixes and steps with the sum
            >>> ddp.timing["iterations"]
            1
            >>> ddp.close(); dist.destroy_process_group()
        """
        self._check_usable("no_sync()")
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def _check_usable(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{_NAME}.{what}: the wrapper is closed")
        if self._backward_task is not None:
            raise RuntimeError(f"{_NAME}.{what}: called during a backward through the model")

    def _check_no_accumulation(self, what: str) -> None:
        if self._accumulated or not self.require_backward_grad_sync:
            raise RuntimeError(f"{_NAME}.{what}: gradients accumulated under no_sync() have not "
                               "been applied yet (call it outside no_sync(), after a "
                               "synchronising backward)")

    def reset_timing(self) -> None:
        """Zero :attr:`timing`.

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> ddp.reset_timing(); ddp(torch.ones(4, 2)).sum().backward(); ddp.timing["wait_s"]
            0.0
            >>> ddp.close(); dist.destroy_process_group()
        """
        self.timing.update(wait_s=0.0, update_s=0.0, launch_s=0.0, gossip_bytes=0, iterations=0)

    def finish(self) -> None:
        """Wait for all in-flight gossip (it is still mixed in the next iteration; no change).

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> ddp(torch.ones(4, 2)).sum().backward()
            >>> ddp.finish()   # e.g. before timing something else, or at the end of training
            >>> ddp.close(); dist.destroy_process_group()
        """
        for b in self._buckets or []:
            if b.handle is not None:
                b.handle.wait()

    def close(self) -> None:
        """Wait for in-flight gossip and remove the hooks; the model trains alone afterwards.

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> optim_fn = lambda named: torch.optim.SGD([p for _, p in named], lr=0.1)
            >>> ddp.close(); ddp2 = DecentralizedDataParallel(model, optim_fn)
            >>> ddp2.close(); dist.destroy_process_group()
        """
        if self._closed:
            return
        self.finish()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._closed = True

    @torch.no_grad()
    def global_average(self, inplace: bool = False) -> dict[str, torch.Tensor]:
        """Average of the parameters and floating buffers over all ranks (a collective).

        Call it between iterations, on every rank of the process group (not with gradients
        accumulated under :meth:`no_sync`). It waits for the in-flight gossip and returns a new
        state dict (keys of ``model.state_dict()``): floating entries are the mean over ranks of
        this rank's current values (``x^{k+1}``, which has the same mean as the
        ``W_{k+1} x^{k+1}`` the next iteration will mix); other entries are this rank's.

        The model holds the average afterwards (evaluate it, or save ``ddp.state_dict()``).
        ``inplace=False`` does not disturb training: the next ``forward`` puts this rank's own
        values back. ``inplace=True`` keeps the average as the new training state: it is also
        loaded into the in-flight gossip, so the next iteration mixes ``W_{k+1} xbar = xbar``
        (optimizer states stay local).

        Example::

            >>> import io
            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> torch.save(ddp.global_average(), io.BytesIO())
            >>> sorted(ddp.global_average())
            ['bias', 'weight']
            >>> ddp.close(); dist.destroy_process_group()
        """
        self._check_usable("global_average()")
        self._check_no_accumulation("global_average()")
        self.finish()
        self._restore_local()
        state = self.module.state_dict()
        by_kind: dict[tuple[torch.dtype, torch.device], list[str]] = {}
        for k, v in state.items():
            if torch.is_tensor(v) and v.is_floating_point():
                by_kind.setdefault((v.dtype, v.device), []).append(k)
        out: dict[str, torch.Tensor] = {}
        for keys in by_kind.values():
            flat = torch.cat([state[k].reshape(-1) for k in keys])
            collectives.allreduce(flat, algorithm=self.algorithm, op="avg",
                                  group=self.process_group)
            off = 0
            for k in keys:
                n = state[k].numel()
                out[k] = flat[off : off + n].view(state[k].shape).clone()
                off += n
        result = OrderedDict((k, out[k] if k in out else (v.clone() if torch.is_tensor(v) else v))
                             for k, v in state.items())
        if not inplace:
            self._local_state = {k: v.clone() for k, v in state.items()}
        self.module.load_state_dict(result)
        if inplace:
            for b in self._buckets or []:
                if b.handle is not None:  # completed: make it carry the average
                    b.to_flat()
        return result

    @contextlib.contextmanager
    def averaged(self) -> Iterator[nn.Module]:
        """Within the block the model holds :meth:`global_average`; restored afterwards.

        A collective (every rank enters it). Training state is unchanged after the block.

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> model = torch.nn.Linear(2, 1)
            >>> ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> with ddp.averaged() as model:
            ...     loss = model(torch.ones(4, 2)).sum().item()   # evaluate(model)
            >>> isinstance(loss, float)
            True
            >>> ddp.close(); dist.destroy_process_group()
        """
        self.global_average()
        try:
            yield self.module
        finally:
            self._restore_local()

    def extra_repr(self) -> str:
        return (f"topology={self.topology!r}, algorithm={self.algorithm!r}, "
                f"bucket_mb={self.bucket_mb}, step_count={self.step_count}")

    # ------------------------------------------------------------------ the iteration
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``index``."""
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:
            if self._backward_task is not None:
                raise RuntimeError(f"{_NAME}: an earlier backward through the model stopped "
                                   "before its end (an exception inside backward?), leaving the "
                                   f"replicas mid-update; build a new {_NAME} (after close()) to "
                                   "go on")
            self._backward_task = task
            sync = self._forward_sync
            self._task_syncs = self.require_backward_grad_sync if sync is None else sync
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if not self._task_syncs:
            return
        if self._buckets is None:  # first backward: learn the order
            if index not in self._seen:
                self._seen.add(index)
                self._order.append(index)
            return
        bucket = self._bucket_of[index]
        bucket.ready.add(index)
        if not self._deferred and not bucket.updated and len(bucket.ready) == len(bucket.params):
            self._update(bucket)
            self._launch_in_order()

    def _end_of_backward(self) -> None:
        """Autograd final callback: update the buckets left, close the iteration."""
        self._backward_task = None
        self._forward_sync = None
        if not self._task_syncs:
            self._accumulated = True
            return
        if self._buckets is None:
            self._build_buckets()
            assert self._buckets is not None
            for b in self._buckets:
                b.ready = {i for i in b.indices if i in self._seen}
            self._seen.clear()
            if self.step_count > 0:  # resumed: mix W_k x^k as the uninterrupted run would
                self._next_launch = 0
                for b in self._buckets:
                    b.updated = True
                self._launch_in_order(step=self.step_count)
                for b in self._buckets:
                    b.updated = False
                self._next_launch = 0
        if self._deferred:
            self._update_all()
        else:
            for b in self._buckets:
                if not b.updated:
                    self._update(b)
            if self.max_grad_norm is not None:
                self.grad_norm = torch.linalg.vector_norm(torch.stack(self._bucket_norms))
                self._bucket_norms = []
        self._launch_in_order()
        for b in self._buckets:
            b.ready.clear()
            b.updated = False
        self._next_launch = 0
        self._accumulated = False
        self.step_count += 1
        self.timing["iterations"] += 1

    @torch.no_grad()
    def _mix(self, b: Bucket) -> None:
        """``y^k``: wait for the bucket's gossip and copy it into the parameters."""
        if b.handle is not None:
            t0 = time.perf_counter()
            b.handle.wait()
            b.handle = None
            self.timing["wait_s"] += time.perf_counter() - t0
            b.from_flat()

    def _fill_missing_grads(self, b: Bucket) -> None:
        for i, p in zip(b.indices, b.params):
            if i not in b.ready and p.grad is None:  # no gradient in this iteration: zero
                p.grad = torch.zeros_like(p)

    @torch.no_grad()
    def _update(self, b: Bucket) -> None:
        """Mix, clip by the bucket's norm, step the bucket's parameters, clear their gradients."""
        self._mix(b)
        t1 = time.perf_counter()
        self._fill_missing_grads(b)
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(b.params, self.max_grad_norm)
            self._bucket_norms.append(norm.to(b.params[0].device))
        opt = self.optimizer
        saved_groups = opt.param_groups
        saved_params = [g["params"] for g in saved_groups]
        try:
            opt.param_groups = [saved_groups[gi] for gi, _ in b.groups]
            for gi, ps in b.groups:
                saved_groups[gi]["params"] = ps
            opt.step()
        finally:
            for g, ps in zip(saved_groups, saved_params):
                g["params"] = ps
            opt.param_groups = saved_groups
        for p in b.params:
            p.grad = None
        b.updated = True
        self.timing["update_s"] += time.perf_counter() - t1

    @torch.no_grad()
    def _update_all(self) -> None:
        """All buckets at once (global clipping, grad scaler): mix, unscale, clip, step."""
        assert self._buckets is not None
        for b in self._buckets:
            self._mix(b)
        t1 = time.perf_counter()
        for b in self._buckets:
            self._fill_missing_grads(b)
        scaler = self.grad_scaler
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        if self.max_grad_norm is not None:
            if self.grad_norm_scope == "global":
                self.grad_norm = torch.nn.utils.clip_grad_norm_(self._params, self.max_grad_norm)
            else:
                norms = [torch.nn.utils.clip_grad_norm_(b.params, self.max_grad_norm)
                         for b in self._buckets]
                self.grad_norm = torch.linalg.vector_norm(torch.stack(norms))
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        for p in self._params:
            p.grad = None
        for b in self._buckets:
            b.updated = True
        self.timing["update_s"] += time.perf_counter() - t1

    @torch.no_grad()
    def _launch_in_order(self, step: int | None = None) -> None:
        """Launch the gossip of updated buckets, in bucket order, on the groups of step k + 1."""
        assert self._buckets is not None
        step = self.step_count + 1 if step is None else step
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].updated:
            b = self._buckets[self._next_launch]
            self._next_launch += 1
            group = self.topology.group_of(self.rank, step)
            if len(group) == 1:
                b.handle = None  # mixing with oneself is the identity
                continue
            t0 = time.perf_counter()
            b.to_flat()
            b.handle = collectives.allreduce(b.flat, algorithm=self.algorithm, op="avg",
                                             group=self._groups[group], async_op=True)
            self.timing["launch_s"] += time.perf_counter() - t0
            self.timing["gossip_bytes"] += b.flat.numel() * b.flat.element_size()

    def _build_buckets(self) -> None:
        """Buckets in rank 0's gradient-ready order of the first backward."""
        order = list(self._order)
        order += [i for i in reversed(range(len(self._params))) if i not in self._seen]
        box = [order]
        dist.broadcast_object_list(box, src=self._members[0], group=self.process_group)
        order = box[0]
        chunks = bucket_indices(self._params, self._bucket_bytes, order=order)
        group_of = {id(p): gi for gi, g in enumerate(self.optimizer.param_groups)
                    for p in g["params"]}
        buckets = []
        self._bucket_of = [None] * len(self._params)  # type: ignore[list-item]
        for bi, idx in enumerate(chunks):
            params = [self._params[i] for i in idx]
            names = [self._names[i] for i in idx]
            shares: dict[int, list[nn.Parameter]] = {}
            for p in params:
                shares.setdefault(group_of[id(p)], []).append(p)
            total = sum(p.numel() for p in params)
            flat = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
            views, off = [], 0
            for p in params:
                views.append(flat[off : off + p.numel()].view(p.shape))
                off += p.numel()
            b = Bucket(bi, idx, names, params, sorted(shares.items()), flat, views,
                        block=as_one_block(params))
            buckets.append(b)
            for i in idx:
                self._bucket_of[i] = b
        self._buckets = buckets
