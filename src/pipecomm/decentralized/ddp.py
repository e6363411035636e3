"""DecentralizedDataParallel: gossip of parameters overlapped with the next iteration.

DAdam paper (Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
Decentralized Training", ICLR 2025), adapt-while-combine as in the authors' implementation.
Iterations ``k = 0, 1, 2, ...`` count backward passes. With ``x_i^k`` the parameters of rank ``i``
before iteration ``k`` and ``W_k = topology.mixing_matrix(k)``, rank ``i`` mixes
``y_i^k = sum_j (W_k)_ij x_j^k`` and takes its *local* optimizer's step from ``y_i^k`` with the
gradient computed at the un-mixed ``x_i^k`` (SGD: ``x_i^{k+1} = y_i^k - lr * grad f_i(x_i^k)``);
optimizer state (momentum, Adam's moments) stays local. When ``backward()`` of iteration ``k``
returns, every rank holds ``x^{k+1}``.

How (one concept: per-bucket update inside backward):

* Parameters are cut into buckets of about ``bucket_mb`` MiB (one dtype and device each) in the
  order their gradients become ready in backward, learned in iteration 0 (rank 0's order is
  broadcast so that every rank has the same buckets). Each bucket has its own optimizer,
  ``optim_fn(list of (name, parameter))``.
* In iteration ``k >= 1``, as soon as all gradients of a bucket are accumulated (a
  post-accumulate-grad hook), the bucket waits for the gossip it launched in iteration ``k - 1``
  (the average of ``x^k`` over the rank's group of step ``k``, i.e. ``y^k``), copies it into the
  parameters, calls its optimizer's ``step()`` with the gradients (computed at ``x^k``), clears
  them, copies the new ``x^{k+1}`` into its flat buffer and launches the next gossip
  asynchronously: ``collectives.allreduce(buffer, op="avg", group=<its group at step k + 1>,
  async_op=True)``. That communication overlaps the rest of backward and the next forward.
  Gossip is launched in bucket order (a bucket that becomes ready early waits for the ones
  before it), so every rank issues the same operations in the same order.
* Iteration 0 steps every bucket at the end of backward (the replicas are equal, so
  ``y^0 = x^0`` whatever ``W_0`` is) and launches the first gossip, with the groups of step 1.
* At the end of every backward (an autograd final callback) the buckets not yet updated — those
  holding a parameter that got no gradient in this iteration — are updated with a zero gradient
  for such parameters (they are still mixed, and stepped: momentum and Adam's moments move). An
  unused parameter never hangs or freezes the run, and ranks may leave different parameters
  unused.
* Groups of one rank do not communicate (mixing is the identity). Process groups are created
  once per distinct group of the topology, on every rank in the same order, and reused.

Gossip uses :mod:`pipecomm.collectives` on the subgroups, so the emulated network
(:mod:`pipecomm.netem`) and the algorithm choice (``"lp"``, ``"mst"``, ``"be"``, ``"ring"``)
apply; ``"torch"`` is the backend's built-in subgroup allreduce and is refused under emulation.

``global_average()`` averages the parameters (and floating buffers) ``x^{k+1}`` held between
iterations over all ranks — equal to the average of the values the next iteration will mix, since
``W`` is doubly stochastic — and loads that average into the model, so every rank can evaluate or
checkpoint the consensus model; it also returns it as a state dict. The next step is not
disturbed: the next ``forward`` first puts each rank's own ``x_i^{k+1}`` back, so the following
iterations are exactly those of a run without the call. ``global_average(inplace=True)``
also sets every rank's parameters to that average and makes the in-flight gossip carry it, so the
run continues as the rule with ``x_i^{k+1} := mean_j x_j^{k+1}`` on every rank (optimizer states
stay local). ``averaged()`` swaps the average in for a ``with`` block (evaluation).

Beyond the authors' Decent-DP: groups of one rank, parameters unused in some iterations, a
non-destructive global average, ``state_dict()`` without wrapper prefixes, and a clear error when
the ranks' models differ.

Example::

    from pipecomm.decentralized import DecentralizedDataParallel, AccumAdam
    ddp = DecentralizedDataParallel(model, lambda named: AccumAdam([p for _, p in named]),
                                    topology="ring", algorithm="lp")
    for x, y in batches:
        loss = loss_fn(ddp(x), y)
        loss.backward()            # mixes, steps and launches the next gossip, bucket by bucket
    ddp.finish()
    torch.save(ddp.global_average(), "model.pt")   # every rank must call it
"""

from __future__ import annotations

import contextlib
import functools
import math
import numbers
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import collectives
from pipecomm.decentralized.topology import Topology, get_topology

__all__ = ["DecentralizedDataParallel", "OptimFn"]

#: ``optim_fn(list of (name, parameter)) -> torch.optim.Optimizer``
OptimFn = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]

_NAME = "DecentralizedDataParallel"

# Process groups of the topologies' groups, created once per process (every rank creates the same
# ones in the same order) and reused by every DecentralizedDataParallel of that process.
_PROCESS_GROUPS: dict[tuple[Any, tuple[int, ...]], dist.ProcessGroup] = {}


# id(parameter) -> the DecentralizedDataParallel that hooks it (to refuse wrapping twice)
_OWNERS: weakref.WeakValueDictionary[int, DecentralizedDataParallel] = weakref.WeakValueDictionary()


def _process_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The process group of ``ranks`` (created on first use: call on every rank, same order)."""
    key = (id(dist.group.WORLD), dist.get_world_size(), ranks)
    pg = _PROCESS_GROUPS.get(key)
    if pg is None:
        pg = dist.new_group(list(ranks))
        _PROCESS_GROUPS[key] = pg
    return pg


@dataclass(eq=False)
class _Bucket:
    """Parameters updated and gossiped together, their flat buffer, optimizer and gossip."""

    index: int
    indices: list[int]  # positions in DecentralizedDataParallel._params
    names: list[str]
    params: list[nn.Parameter]
    optimizer: torch.optim.Optimizer
    flat: torch.Tensor  # gossip buffer: x^{k+1} when launched, y^{k+1} once completed
    views: list[torch.Tensor]  # views of `flat` shaped like the parameters
    handle: Any = None  # in-flight gossip (None: nothing to mix, e.g. a group of one rank)
    ready: set[int] = field(default_factory=set)  # parameters whose gradient is complete
    updated: bool = False  # mixed and stepped in the current iteration


def _check_bucket_mb(bucket_mb: Any) -> float:
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real):
        raise TypeError(
            f"{_NAME}: bucket_mb must be a positive number of MiB (e.g. 25.0), "
            f"got {type(bucket_mb).__name__} ({bucket_mb!r})"
        )
    value = float(bucket_mb)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{_NAME}: bucket_mb must be a positive, finite number of MiB (e.g. 25.0; a tiny "
            f"value gives one bucket per parameter), got {bucket_mb!r}"
        )
    return value


def _check_algorithm(algorithm: Any) -> str:
    if not isinstance(algorithm, str) or algorithm not in collectives.ALGORITHMS:
        raise ValueError(
            f"{_NAME}: algorithm must be one of {collectives.ALGORITHMS}, got {algorithm!r}"
        )
    if algorithm == "torch":
        from pipecomm import netem

        if netem.current() is not None:
            raise ValueError(
                f"{_NAME}: algorithm='torch' (the backend's built-in allreduce) cannot run on "
                f"the emulated network ({netem.current().describe()}); pass one of pipecomm's "
                "own algorithms: 'lp', 'mst', 'be' or 'ring'"
            )
    return algorithm


def _signature(model: nn.Module) -> list[tuple[str, str, tuple[int, ...], str, bool]]:
    sig = [
        ("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
        for n, p in model.named_parameters()
    ]
    sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()]
    return sig


def _describe_mismatch(sig0: list, sig: list, rank: int) -> str:
    names0 = {e[1]: e for e in sig0}
    names = {e[1]: e for e in sig}
    for kind, name, *_ in sig0:
        if name not in names:
            return f"{kind} {name!r} exists on rank 0 but not on rank {rank}"
    for kind, name, *_ in sig:
        if name not in names0:
            return f"{kind} {name!r} exists on rank {rank} but not on rank 0"
    for e0 in sig0:
        e = names[e0[1]]
        for what, i in (("kind", 0), ("shape", 2), ("dtype", 3), ("requires_grad", 4)):
            if e0[i] != e[i]:
                return f"{e0[0]} {e0[1]!r} has {what} {e0[i]} on rank 0 and {e[i]} on rank {rank}"
    return f"the parameters and buffers are registered in a different order on rank {rank}"


class DecentralizedDataParallel(nn.Module):
    """Decentralized data parallelism (DAdam): local steps, parameters gossiped in the background.

    Args:
        model: the local replica (on its device already). Rank 0's parameters and buffers are
            broadcast to every rank here; every rank must build the same structure (names,
            shapes, dtypes), else a ValueError says what differs.
        optim_fn: ``optim_fn(list of (name, parameter)) -> torch.optim.Optimizer``, called once
            per bucket at the end of the first backward (any torch optimizer; its state stays
            local).
        topology: a name of :func:`~pipecomm.decentralized.topology.get_topology` (world size
            from ``torch.distributed``, ranks per node from :func:`pipecomm.launch.ranks_per_node`
            where needed) or a :class:`~pipecomm.decentralized.topology.Topology`.
        bucket_mb: bucket size in MiB (a bucket closes once it reaches it; a tiny value gives one
            parameter per bucket).
        algorithm: collective of the gossip: ``"torch"`` (built-in; refused under emulation),
            ``"lp"``, ``"mst"``, ``"be"`` or ``"ring"``.

    Usage: ``loss_fn(ddp(x), y).backward()`` — no ``optimizer.step()``: the mix and the step
    happen inside backward, which consumes the gradients (they are None afterwards). Every
    backward through the model is one iteration; every rank must run the same number of them.
    Use non-reentrant activation checkpointing only.

    Attributes:
        step_count: iterations done (backward passes).
        optimizers: one per bucket (empty before the first backward).
        bucket_names: the parameter names of every bucket (empty before the first backward).
        timing: cumulative seconds ``wait_s`` (blocked on gossip inside backward), ``update_s``
            (mix + optimizer steps), ``launch_s`` (copy + launch of gossip), ``gossip_bytes``
            (bytes this rank gossiped), ``iterations``; :meth:`reset_timing` zeroes it.

    Example::

        ddp = DecentralizedDataParallel(
            model, lambda named: torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9),
            topology="one-peer-exp", bucket_mb=4.0, algorithm="lp")
        for x, y in batches:
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
        with ddp.averaged():
            evaluate(model)
    """

    def __init__(
        self,
        model: nn.Module,
        optim_fn: OptimFn,
        topology: str | Topology = "complete",
        bucket_mb: float = 25.0,
        algorithm: str = "torch",
    ) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_NAME}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(optim_fn):
            raise TypeError(
                f"{_NAME}: optim_fn must be callable, optim_fn(list of (name, parameter)) -> "
                f"torch optimizer, got {type(optim_fn).__name__}"
            )
        bucket_bytes = _check_bucket_mb(bucket_mb) * 2**20
        algorithm = _check_algorithm(algorithm)
        if not dist.is_initialized():
            raise RuntimeError(
                f"{_NAME}: torch.distributed is not initialised: start ranks with "
                "pipecomm.launch.spawn / Ranks, or call pipecomm.launch.init_from_env() first"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if not isinstance(topology, (str, Topology)):
            raise TypeError(
                f"{_NAME}: topology must be a topology name or a Topology, "
                f"got {type(topology).__name__}"
            )
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
                raise ValueError(
                    f"{_NAME}: parameter {n!r} already belongs to a live "
                    f"{_NAME}; call its close() before wrapping the model again"
                )

        self.module = model
        self.topology = topo
        self.algorithm = algorithm
        self.bucket_mb = float(bucket_mb)
        self._bucket_bytes = bucket_bytes
        self._optim_fn = optim_fn
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._buckets: list[_Bucket] | None = None
        self._bucket_of: list[_Bucket] = []
        self._order: list[int] = []  # iteration 0: order in which gradients became ready
        self._seen: set[int] = set()
        self._next_launch = 0
        self._backward_task: int | None = None  # graph task of the backward in progress
        self._closed = False
        self._local_state: dict[str, torch.Tensor] | None = None  # put back by the next forward
        self.step_count = 0
        self.timing: dict[str, float] = {}
        self.reset_timing()

        self._check_same_model()
        self._broadcast_from_rank0()
        # every group any step uses, created on every rank in the same order
        self._groups = {g: _process_group(g) for g in topo.distinct_groups() if len(g) > 1}
        self._hooks = []
        for i, p in enumerate(self._params):
            self._hooks.append(
                p.register_post_accumulate_grad_hook(functools.partial(self._grad_ready, i))
            )
            _OWNERS[id(p)] = self

    # ------------------------------------------------------------------ construction helpers
    def _check_same_model(self) -> None:
        sig = _signature(self.module)
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, sig)
        for r, other in enumerate(gathered):
            if other != gathered[0]:
                raise ValueError(
                    f"{_NAME}: the models differ across ranks: "
                    f"{_describe_mismatch(gathered[0], other, r)}. Build the same model "
                    "(same names, shapes and dtypes) on every rank"
                )

    @torch.no_grad()
    def _broadcast_from_rank0(self) -> None:
        for t in [*self.module.parameters(), *self.module.buffers()]:
            data = t.detach()
            buf = data if data.is_contiguous() else data.contiguous()
            dist.broadcast(buf, src=0)
            if buf is not data:
                data.copy_(buf)

    # ------------------------------------------------------------------ nn.Module interface
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped model (its parameters are ``x^k``; gossip may be in flight).

        Example::

            loss = torch.nn.functional.mse_loss(ddp(x), y)
        """
        self._restore_local()
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

        Example::

            assert ddp.state_dict().keys() == model.state_dict().keys()
        """
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(  # type: ignore[override]
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load into the wrapped model, in place (keys as ``model.state_dict()``).

        After the first backward the in-flight gossip still carries the old values; to restart
        from a checkpoint consistently, load it on every rank and call
        ``global_average(inplace=True)``.

        Example::

            ddp.load_state_dict(torch.load("model.pt")); ddp.global_average(inplace=True)
        """
        if assign:
            raise ValueError(
                f"{_NAME}.load_state_dict: assign=True would replace the parameters that the "
                "hooks and optimizers hold; use assign=False (copy in place)"
            )
        return self.module.load_state_dict(state_dict, strict=strict)

    # ------------------------------------------------------------------ public helpers
    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """One optimizer per bucket, in bucket order (empty before the first backward)."""
        return [b.optimizer for b in self._buckets or []]

    @property
    def bucket_names(self) -> list[list[str]]:
        """Parameter names of every bucket (empty before the first backward)."""
        return [list(b.names) for b in self._buckets or []]

    def reset_timing(self) -> None:
        """Zero :attr:`timing`.

        Example::

            ddp.reset_timing(); train(10); print(ddp.timing["wait_s"] / 10)
        """
        self.timing.update(wait_s=0.0, update_s=0.0, launch_s=0.0, gossip_bytes=0, iterations=0)

    def finish(self) -> None:
        """Wait for all in-flight gossip (it is still mixed in the next iteration; no change).

        Example::

            ddp.finish()   # e.g. before timing something else, or at the end of training
        """
        for b in self._buckets or []:
            if b.handle is not None:
                b.handle.wait()

    def close(self) -> None:
        """Wait for in-flight gossip and remove the hooks; the model trains alone afterwards.

        Example::

            ddp.close(); ddp2 = DecentralizedDataParallel(model, optim_fn)
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

        Call it between iterations, on every rank. It waits for the in-flight gossip and
        returns a new state dict (keys of ``model.state_dict()``): floating entries are the
        mean over ranks of this rank's current values (``x^{k+1}``, which has the same mean as
        the ``W_{k+1} x^{k+1}`` the next iteration will mix); other entries are this rank's.

        The model holds the average afterwards (evaluate it, or save ``ddp.state_dict()``).
        ``inplace=False`` does not disturb training: the next ``forward`` puts this rank's own
        values back, so the following iterations are exactly those of a run without the call.
        ``inplace=True`` keeps the average as the new training state: it is also loaded into
        the in-flight gossip, so the next iteration mixes ``W_{k+1} xbar = xbar``: the run
        continues as the rule with ``x_i^{k+1} := xbar`` for all ``i`` (optimizer states stay
        local).

        Example::

            torch.save(ddp.global_average(), "checkpoint.pt")
        """
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
            collectives.allreduce(flat, algorithm=self.algorithm, op="avg")
            off = 0
            for k in keys:
                n = state[k].numel()
                out[k] = flat[off : off + n].view(state[k].shape).clone()
                off += n
        result = OrderedDict(
            (k, out[k] if k in out else (v.clone() if torch.is_tensor(v) else v))
            for k, v in state.items()
        )
        if not inplace:
            self._local_state = {k: v.clone() for k, v in state.items()}
        self.module.load_state_dict(result)
        if inplace:
            for b in self._buckets or []:
                if b.handle is not None:  # completed: make it carry the average
                    torch._foreach_copy_(b.views, [p.detach() for p in b.params])
        return result

    @contextlib.contextmanager
    def averaged(self) -> Iterator[nn.Module]:
        """Within the block the model holds :meth:`global_average`; restored afterwards.

        A collective (every rank enters it). Training state is unchanged after the block.

        Example::

            with ddp.averaged() as model:
                accuracy = evaluate(model)
        """
        self.global_average()
        try:
            yield self.module
        finally:
            self._restore_local()

    def extra_repr(self) -> str:
        return (
            f"topology={self.topology!r}, algorithm={self.algorithm!r}, "
            f"bucket_mb={self.bucket_mb}, step_count={self.step_count}"
        )

    # ------------------------------------------------------------------ the iteration
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook of parameter ``index``."""
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:
            if self._backward_task is not None:
                raise RuntimeError(
                    f"{_NAME}: an earlier backward through the model stopped before its end "
                    "(an exception inside backward?), leaving the replicas mid-update; build a "
                    f"new {_NAME} (after close()) to go on"
                )
            self._backward_task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self._buckets is None:  # iteration 0: learn the order
            if index not in self._seen:
                self._seen.add(index)
                self._order.append(index)
            return
        bucket = self._bucket_of[index]
        bucket.ready.add(index)
        if not bucket.updated and len(bucket.ready) == len(bucket.params):
            self._update(bucket)
            self._launch_in_order()

    def _end_of_backward(self) -> None:
        """Autograd final callback: update the buckets left (zero gradients), close iteration."""
        self._backward_task = None
        if self._buckets is None:
            self._build_buckets()
            assert self._buckets is not None
            for b in self._buckets:
                b.ready = {i for i in b.indices if i in self._seen}
            self._seen.clear()
        for b in self._buckets:
            if not b.updated:
                self._update(b)
        self._launch_in_order()
        for b in self._buckets:
            b.ready.clear()
            b.updated = False
        self._next_launch = 0
        self.step_count += 1
        self.timing["iterations"] += 1

    @torch.no_grad()
    def _update(self, b: _Bucket) -> None:
        """Mix (``y^k``: the completed gossip), step with the gradients of ``x^k``, clear them."""
        if b.handle is not None:
            t0 = time.perf_counter()
            b.handle.wait()
            b.handle = None
            t1 = time.perf_counter()
            self.timing["wait_s"] += t1 - t0
            torch._foreach_copy_([p.detach() for p in b.params], b.views)
        t1 = time.perf_counter()
        for i, p in zip(b.indices, b.params):
            if i not in b.ready:  # no gradient in this iteration: step with zero
                p.grad = torch.zeros_like(p)
        b.optimizer.step()
        for p in b.params:
            p.grad = None
        b.updated = True
        self.timing["update_s"] += time.perf_counter() - t1

    @torch.no_grad()
    def _launch_in_order(self) -> None:
        """Launch the gossip of updated buckets, in bucket order, on the groups of step k + 1."""
        assert self._buckets is not None
        while self._next_launch < len(self._buckets) and self._buckets[self._next_launch].updated:
            b = self._buckets[self._next_launch]
            self._next_launch += 1
            group = self.topology.group_of(self.rank, self.step_count + 1)
            if len(group) == 1:
                b.handle = None  # mixing with oneself is the identity
                continue
            t0 = time.perf_counter()
            torch._foreach_copy_(b.views, [p.detach() for p in b.params])
            b.handle = collectives.allreduce(
                b.flat,
                algorithm=self.algorithm,
                op="avg",
                group=self._groups[group],
                async_op=True,
            )
            self.timing["launch_s"] += time.perf_counter() - t0
            self.timing["gossip_bytes"] += b.flat.numel() * b.flat.element_size()

    def _build_buckets(self) -> None:
        """Buckets in rank 0's gradient-ready order of iteration 0; one optimizer per bucket."""
        order = list(self._order)
        order += [i for i in reversed(range(len(self._params))) if i not in self._seen]
        box = [order]
        dist.broadcast_object_list(box, src=0)
        order = box[0]
        chunks: list[list[int]] = []
        size = 0.0
        for i in order:
            p = self._params[i]
            if chunks and size < self._bucket_bytes:
                q = self._params[chunks[-1][0]]
                if q.dtype == p.dtype and q.device == p.device:
                    chunks[-1].append(i)
                    size += p.numel() * p.element_size()
                    continue
            chunks.append([i])
            size = p.numel() * p.element_size()
        buckets = []
        self._bucket_of = [None] * len(self._params)  # type: ignore[list-item]
        for bi, idx in enumerate(chunks):
            params = [self._params[i] for i in idx]
            names = [self._names[i] for i in idx]
            opt = self._optim_fn(list(zip(names, params)))
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(
                    f"{_NAME}: optim_fn must return a torch.optim.Optimizer, "
                    f"got {type(opt).__name__}"
                )
            got = {id(p) for g in opt.param_groups for p in g["params"]}
            if got != {id(p) for p in params}:
                raise ValueError(
                    f"{_NAME}: optim_fn must return an optimizer over exactly the parameters "
                    f"it is given (bucket {bi}: {names}); build it from [p for _, p in named]"
                )
            total = sum(p.numel() for p in params)
            flat = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
            views, off = [], 0
            for p in params:
                views.append(flat[off : off + p.numel()].view(p.shape))
                off += p.numel()
            b = _Bucket(bi, idx, names, params, opt, flat, views)
            buckets.append(b)
            for i in idx:
                self._bucket_of[i] = b
        self._buckets = buckets
