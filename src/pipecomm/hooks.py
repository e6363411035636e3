"""DDP communication hooks on pipecomm's collectives: averaging, Pipe-SGD and gossip in DDP.

A DDP communication hook (``model.register_comm_hook(state, hook)``) receives each gradient
bucket, ``hook(state, bucket)``, and returns a ``torch.futures.Future`` of the tensor DDP writes
back into the gradients, as torch's own ``allreduce_hook`` and PowerSGD do.

* :func:`allreduce_hook` with :class:`CollectiveState` -- the bucket averaged over the group
  with pipecomm's AllReduce (``"lp"``, Wang et al., arXiv 1611.04255, or another of
  :data:`pipecomm.vocab.ALGORITHMS`), optionally compressed.
* :func:`pipelined_hook` with :class:`PipelinedState` -- Pipe-SGD (Li et al., NeurIPS 2018)
  with staleness k, ``w_{t+1} = step(w_t, g(w_{t-k}))`` for ``t >= k``: the rule of
  :class:`pipecomm.pipesgd.PipeSGD` (``mode="pipe"``). While the pipeline fills the hook returns
  zero gradients: skip ``optimizer.step()`` while :attr:`PipelinedState.filling` is True.
* :func:`gossip_hook` with :class:`GossipState` -- decentralized training: each step, the
  parameters (or the gradients) averaged with the peers of a topology's step.

A state averages over ``process_group`` (``None``: the world), which must be the DDP model's
group (:func:`register` checks it). Every state has ``state_dict()`` / ``load_state_dict()``;
save every rank's state and register the state before loading into it. Rules, the filling
phase, error feedback, gossip and checkpoints: docs/update_rules.md, "The same rules inside
torch's DistributedDataParallel", "Error feedback for compressed AllReduce" and "Gossip inside
torch's DDP".

Example::

    >>> import torch, torch.distributed as dist
    >>> from torch.nn.parallel import DistributedDataParallel as DDP
    >>> from pipecomm import hooks
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> model = DDP(torch.nn.Linear(2, 1))          # then train as usual (the states' examples)
    >>> hooks.register(model, hooks.CollectiveState(algorithm="lp"), hooks.allreduce_hook)
    >>> dist.destroy_process_group()

The hooks' annotations are evaluated (no ``from __future__ import annotations``): DDP's
``register_comm_hook`` compares them with ``dist.GradBucket`` and ``Future[torch.Tensor]``.
"""

import collections
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import backend, checks, collectives, compress, vocab
from pipecomm.collectives.async_ import CompletedHandle
from pipecomm.decentralized.gossip import topology_groups
from pipecomm.decentralized.topology import Topology, available_topologies, get_topology

__all__ = ["MIXES", "CollectiveState", "GossipState", "PipelinedState", "allreduce_hook",
           "gossip_hook", "pipelined_hook", "register"]


def _check_common(where: str, algorithm: Any, compression: Any, block_bytes: Any,
                  timeout_s: Any, error_feedback: Any = False) -> None:
    vocab.check_algorithm(algorithm, allowed=vocab.ALGORITHM_CHOICES, where=where)
    vocab.check_compression(compression, algorithm=algorithm, where=where)
    compress.check_error_feedback(error_feedback, compression, where)
    checks.block_bytes(block_bytes, where)
    checks.timeout_s(timeout_s, where)


def _group_of(where: str, process_group: Any) -> dist.ProcessGroup | None:
    """The state's group, checked at the hook: this rank must be one of its members."""
    if process_group is dist.GroupMember.NON_GROUP_MEMBER or process_group is not None and (
            dist.get_rank() not in dist.get_process_group_ranks(process_group)):
        raise ValueError(f"{where}: the state is bound to another process group: this rank "
                         f"({dist.get_rank()}) is not a member of state.process_group. Build the "
                         "state with process_group=<the DDP model's process_group> on every rank "
                         "of that group (or use pipecomm.hooks.register, which checks this)")
    return process_group


@dataclass
class CollectiveState:
    """The state of :func:`allreduce_hook`: which AllReduce averages the buckets, over which group.

    Args:
        algorithm: ``"auto"`` (per bucket the fastest measured,
            :func:`pipecomm.collectives.builtin.choose`), ``"lp"`` (linear pipelining, Wang et
            al., arXiv 1611.04255), ``"mst"``, ``"be"``, ``"ring"`` or ``"torch"``.
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"int8"`` (``"lp"``/``"ring"`` only).
        process_group: the DDP model's group (``None``: the world).
        block_bytes: LP block size (``None``: the cost model's optimum).
        timeout_s: how long a bucket's future waits for its AllReduce before it fails
            (``None``: :data:`pipecomm.backend.BACKSTOP` times the world's timeout; the
            AllReduce's own transfers fail after the world's timeout, naming the peer, first).
        error_feedback: add each bucket's last compression error to its next gradient
            (``e_{t+1} = x - D(C(x))``, ``x = g_t + e_t``; needs a ``compression``).

    Arguments are checked on construction, before any communication.

    Example::

        >>> import io
        >>> from pipecomm import hooks
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model, rank = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1)), 0
        >>> state = CollectiveState(algorithm="ring", compression="int8", error_feedback=True)
        >>> hooks.register(ddp_model, state, allreduce_hook)
        >>> ddp_model(torch.ones(1, 2)).sum().backward()
        >>> buf = io.BytesIO(); torch.save(state.state_dict(), buf); _ = buf.seek(0)  # per rank
        >>> state.load_state_dict(torch.load(buf))           # resumed: hook_rank{rank}.pt
        >>> dist.destroy_process_group()
    """

    algorithm: str = vocab.AUTO
    compression: str | None = None
    process_group: dist.ProcessGroup | None = None
    block_bytes: int | None = field(default=None, kw_only=True)
    timeout_s: float | None = field(default=None, kw_only=True)
    error_feedback: bool = field(default=False, kw_only=True)
    _residuals: dict = field(default_factory=dict, init=False, repr=False)
    _fresh: set = field(default_factory=set, init=False, repr=False)
    _params: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        _check_common("CollectiveState", self.algorithm, self.compression, self.block_bytes,
                      self.timeout_s, self.error_feedback)

    def state_dict(self) -> dict[str, Any]:
        """The residuals of error feedback (this rank's; per parameter index), for a checkpoint
        (the example of :class:`CollectiveState` saves one)."""
        return _state_dict(self, "CollectiveState", {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of the same rank into a registered state (the example
        of :class:`CollectiveState` restores one)."""
        _load_state_dict(self, "CollectiveState", state_dict)


def _launch(state: Any, where: str, t: torch.Tensor, group: Any = None) -> collectives.Handle:
    """Start the average of ``t`` over ``group`` (default: the state's) on the communication
    thread."""
    group = _group_of(where, state.process_group) if group is None else group
    return collectives.allreduce(t, algorithm=state.algorithm, op="avg", group=group,
                                 block_bytes=state.block_bytes, async_op=True,
                                 compression=getattr(state, "compression", None))


def allreduce_hook(
    state: CollectiveState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over ``state.process_group`` with pipecomm's AllReduce.

    The AllReduce (``op="avg"``: sum, then one division by p) runs in place on the bucket's
    buffer on pipecomm's communication thread; the returned future resolves to that buffer. With
    ``compression=None`` the result equals DDP's own averaging up to float round-off.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> ddp_model.register_comm_hook(CollectiveState(algorithm="lp"), allreduce_hook)
        >>> ddp_model(torch.ones(1, 2)).sum().backward()
        >>> ddp_model.module.bias.grad                       # averaged over p = 1 rank
        tensor([1.])
        >>> dist.destroy_process_group()
    """
    if not isinstance(state, CollectiveState):
        raise TypeError("allreduce_hook: state must be a CollectiveState, got "
                        f"{type(state).__name__}")
    buf = bucket.buffer()
    if state.error_feedback:
        _group_of("allreduce_hook", state.process_group)
        _compensate(state, bucket, buf, *_layout(bucket, buf, "allreduce_hook"))
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
        algorithm, compression, process_group, block_bytes, timeout_s, error_feedback: as in
            :class:`CollectiveState`.

    Attributes:
        iteration: synchronised backward passes so far (``no_sync`` passes do not count).
        filling: True after a backward whose hook returned zero gradients because the pipeline
            was still filling (``iteration <= staleness``): skip ``optimizer.step()`` then to
            apply PipeSGD's ``w_{t+1} = w_t`` exactly (docs/update_rules.md, "The same rules
            inside torch's DistributedDataParallel").

    :meth:`state_dict` holds the iteration, the k averages in flight and the residuals, so that
    a run resumed with :meth:`load_state_dict` applies the averages an uninterrupted run would
    (without it, a fresh state refills the pipeline: k more iterations without an update).

    Example::

        >>> import io
        >>> from pipecomm import hooks
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> state = PipelinedState(staleness=1, algorithm="ring")
        >>> hooks.register(ddp_model, state, pipelined_hook)
        >>> ddp_model(torch.ones(1, 2)).sum().backward()
        >>> state.filling                                    # the first k iterations apply nothing
        True
        >>> buf = io.BytesIO(); torch.save(state.state_dict(), buf); _ = buf.seek(0)
        >>> resumed = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> new = PipelinedState(staleness=1, algorithm="ring")
        >>> hooks.register(resumed, new, pipelined_hook)
        >>> new.load_state_dict(torch.load(buf))             # hook_rank{dist.get_rank()}.pt
        >>> new.filling == state.filling
        True
        >>> state.wait(); dist.destroy_process_group()
    """

    staleness: int = 1
    algorithm: str = vocab.AUTO
    compression: str | None = None
    process_group: dist.ProcessGroup | None = None
    block_bytes: int | None = field(default=None, kw_only=True)
    timeout_s: float | None = field(default=None, kw_only=True)
    error_feedback: bool = field(default=False, kw_only=True)
    iteration: int = field(default=0, init=False)
    _history: collections.deque = field(default_factory=collections.deque, init=False, repr=False)
    _residuals: dict = field(default_factory=dict, init=False, repr=False)
    _fresh: set = field(default_factory=set, init=False, repr=False)
    _params: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        k = self.staleness
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"PipelinedState: staleness must be an int >= 0, got {k!r}")
        _check_common("PipelinedState", self.algorithm, self.compression, self.block_bytes,
                      self.timeout_s, self.error_feedback)

    def state_dict(self) -> dict[str, Any]:
        """This rank's iteration, averages in flight and residuals (waits for the AllReduces in
        flight, without applying them). Call it between iterations (after ``backward``); the
        example of :class:`PipelinedState` saves one."""
        self.wait()
        in_flight = [
            [it, _by_index(self, {key: (item.offsets, item.avg) for key, item in launched.items()})]
            for it, launched in self._history
        ]
        extra = {"iteration": self.iteration, "in_flight": in_flight}
        return _state_dict(self, "PipelinedState", extra)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same staleness, same rank) into a fresh, registered state:
        the next backward returns the average an uninterrupted run would return (the example of
        :class:`PipelinedState` resumes one)."""
        sd = state_dict
        if self._history:
            raise RuntimeError("PipelinedState.load_state_dict needs a fresh state (nothing "
                               "launched yet)")
        if isinstance(sd, dict) and sd.get("staleness", self.staleness) != self.staleness:
            raise ValueError(f"PipelinedState.load_state_dict: state_dict was saved with staleness"
                             f"={sd['staleness']}, this state has staleness={self.staleness}")
        _load_state_dict(self, "PipelinedState", sd, ("iteration", "in_flight", "staleness"))
        for it, pieces in sd["in_flight"]:
            key, offsets, avg = _from_index(self, pieces, "in_flight")
            handle = CompletedHandle(avg, "loaded average")
            self._history.append((int(it), {key: _Launched(key, offsets, avg, handle)}))
        self.iteration = int(sd["iteration"])

    @property
    def filling(self) -> bool:
        """True while the last backward's gradients were the zeros of a filling pipeline."""
        return 0 < self.iteration <= self.staleness

    @property
    def in_flight(self) -> int:
        """AllReduces launched by the hook that have not finished yet."""
        return sum(not item.handle.is_completed() for _, launched in self._history
                   for item in launched.values())

    def wait(self) -> None:
        """Wait for every AllReduce still in flight (their averages are not applied): call it
        before destroying the process group or leaving the training loop (as the example of
        :class:`PipelinedState` does)."""
        handles = [item.handle for _, launched in self._history for item in launched.values()]
        if any(not h.is_completed() for h in handles):
            limit = backend.wait_limit_s(self.timeout_s)
            for h in handles:
                h.wait(limit)
        for h in handles:
            h.wait(0)  # re-raises a failed AllReduce's error


def _layout(bucket: dist.GradBucket, buf: torch.Tensor,
            where: str = "pipelined_hook") -> tuple[tuple[int, ...], tuple[int, ...]]:
    params = bucket.parameters()
    offsets, n = [], 0
    for p in params:
        offsets.append(n)
        n += p.numel()
    if n != buf.numel():
        raise RuntimeError(f"{where}: bucket {bucket.index()} holds {buf.numel()} elements but "
                           f"its parameters have {n} (sparse gradients are not supported)")
    return tuple(id(p) for p in params), tuple(offsets)


def pipelined_hook(
    state: PipelinedState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Pipe-SGD inside DDP: launch this bucket's average, return the one from k iterations ago.

    Iteration t (counted in :attr:`PipelinedState.iteration`) launches the average of a copy of
    the bucket (pipecomm's AllReduce, ``op="avg"``, on the communication thread) and returns a
    future of the average launched at iteration ``t - k`` for the same parameters (also when DDP
    rebuilt its buckets in between), or of zeros while ``t < k`` (what the optimizer does with
    them: docs/update_rules.md, "The same rules inside torch's DistributedDataParallel"). The
    returned average is fresh memory, never written again.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> state = PipelinedState(staleness=1, algorithm="lp", compression="fp16")
        >>> ddp_model.register_comm_hook(state, pipelined_hook)
        >>> for _ in range(2):
        ...     ddp_model(torch.ones(1, 2)).sum().backward()
        >>> state.filling
        False
        >>> state.wait()
        >>> dist.destroy_process_group()
    """
    if not isinstance(state, PipelinedState):
        raise TypeError("pipelined_hook: state must be a PipelinedState, got "
                        f"{type(state).__name__}")
    buf = bucket.buffer()
    params, offsets = _layout(bucket, buf)
    t, k = state.iteration, state.staleness
    if not state._history or state._history[-1][0] != t:
        state._history.append((t, {}))
    copy = buf.detach().clone()
    if state.error_feedback:
        _group_of("pipelined_hook", state.process_group)
        _compensate(state, bucket, copy, params, offsets)
    handle = _launch(state, "pipelined_hook", copy)
    state._history[-1][1][params] = _Launched(params, offsets, copy, handle)
    if t < k:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(torch.zeros_like(buf))
    else:
        # the average of t - k for these parameters: the same bucket's, or (after DDP rebuilt
        # its buckets) their pieces of the earlier buckets; zeros for parameters it lacked
        old = next(launched for it, launched in state._history if it == t - k)
        sizes = [p.numel() for p in bucket.parameters()]
        needed = [old[params]] if params in old else [
            item for item in old.values() if set(item.params) & set(params)]
        entries = {key: (item.offsets, item.avg) for key, item in old.items()}

        def value() -> torch.Tensor:
            avg = _gather(entries, params, offsets, sizes)
            return torch.zeros_like(buf) if avg is None else avg

        fut = backend.future_of([i.handle for i in needed], value, timeout_s=state.timeout_s)
    if bucket.is_last():
        state.iteration = t + 1
        while state._history and state._history[0][0] <= t - k:
            state._history.popleft()
    return fut


# --------------------------------------------------------------------------- gossip

#: what :func:`gossip_hook` averages with the peers of the step
MIXES = ("parameters", "gradients")


@dataclass
class GossipState:
    """The state of :func:`gossip_hook`: decentralized averaging over a topology, inside DDP.

    Args:
        topology: a name of :func:`pipecomm.decentralized.topology.get_topology`
            (``"one-peer-exp"``, ``"aer"``, ``"ring"``, ``"complete"``, ``"random-matching"``)
            built for the group's size (``"aer"``: ``LOCAL_WORLD_SIZE`` ranks per node), or a
            ``Topology`` over its ranks.
        mix: ``"parameters"`` (D-PSGD / DAdam: the bucket's parameters are averaged with the
            peers' and the optimizer steps from there with the rank's own gradient, the rule of
            DecentralizedDataParallel) or ``"gradients"`` (the gradient is averaged with the
            peers'; nothing pulls the replicas together). Exact rules: docs/update_rules.md,
            "Gossip inside torch's DDP".
        algorithm, process_group, block_bytes, timeout_s: as in :class:`CollectiveState`.

    Attributes:
        iteration: synchronised backward passes so far, the topology's step of the next one (the
            same on every rank; :meth:`state_dict` holds it).

    Example::

        >>> import io
        >>> from pipecomm import hooks
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> state = GossipState(topology="one-peer-exp", mix="parameters")
        >>> ddp_model.register_comm_hook(state, hooks.gossip_hook)
        >>> ddp_model(torch.ones(1, 2)).sum().backward()
        >>> state.iteration
        1
        >>> torch.save(state.state_dict(), io.BytesIO())      # every rank (the same iteration)
        >>> dist.destroy_process_group()
    """

    topology: str | Topology = "one-peer-exp"
    mix: str = "parameters"
    algorithm: str = vocab.DEFAULT_ALGORITHM
    process_group: dist.ProcessGroup | None = None
    block_bytes: int | None = field(default=None, kw_only=True)
    timeout_s: float | None = field(default=None, kw_only=True)
    iteration: int = field(default=0, init=False)
    _topo: Any = field(default=None, init=False, repr=False)  # (topology, this rank's index)
    _groups: dict = field(default_factory=dict, init=False, repr=False)
    _params: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.topology, Topology) and self.topology not in available_topologies():
            raise ValueError(f"GossipState: topology must be one of {available_topologies()} or "
                             f"a Topology, got {self.topology!r}")
        if self.mix not in MIXES:
            raise ValueError(f"GossipState: mix must be one of {MIXES}, got {self.mix!r}")
        _check_common("GossipState", self.algorithm, None, self.block_bytes, self.timeout_s)

    def _setup(self) -> tuple[Topology, int]:
        """The topology over the group and this rank's index; its groups' process groups are
        made on the first call (:func:`register`, or the first hook: every rank, one order)."""
        if self._topo is None:
            group = _group_of("gossip_hook", self.process_group)
            members = dist.get_process_group_ranks(group or dist.group.WORLD)
            topo = get_topology(self.topology, len(members))
            self._groups = topology_groups(topo, members)
            self._topo = (topo, members.index(dist.get_rank()))
        return self._topo

    def state_dict(self) -> dict[str, Any]:
        """The iteration (the topology's next step) and what the state mixes, for a checkpoint
        (the example of :class:`GossipState` saves one)."""
        return {"kind": "GossipState", "iteration": self.iteration, "mix": self.mix,
                "topology": getattr(self.topology, "name", self.topology)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` of a state with the same ``mix`` and topology: the next
        backward mixes over the step the uninterrupted run would. The replicas differ: resume
        each rank's own model (``DistributedDataParallel(..., init_sync=False)``, or load it
        after wrapping: DDP's construction broadcasts rank 0's).

        Example::

            >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
            >>> old = GossipState("ring", mix="gradients"); old.iteration = 7
            >>> state = GossipState("ring", mix="gradients")
            >>> state.load_state_dict(old.state_dict())        # hook_rank{dist.get_rank()}.pt
            >>> state.iteration
            7
            >>> dist.destroy_process_group()
        """
        sd, where = state_dict, "GossipState.load_state_dict"
        if not isinstance(sd, dict) or sd.get("kind") != "GossipState":
            raise TypeError(f"{where}: state_dict must come from GossipState.state_dict()")
        for key, mine in (("mix", self.mix), ("topology", self.state_dict()["topology"])):
            if sd.get(key) != mine:
                raise ValueError(f"{where}: state_dict was saved with {key}={sd.get(key)!r}, "
                                 f"this state has {key}={mine!r}")
        self.iteration = int(sd["iteration"])


def gossip_hook(
    state: GossipState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's parameters (or gradient) with this rank's peers of the iteration.

    Iteration t (:attr:`GossipState.iteration`) averages over this rank's group of
    ``topology.groups(t)`` (``W_t = topology.mixing_matrix(t)``) with pipecomm's AllReduce
    (``op="avg"``) on the communication thread. ``mix="parameters"``: once the average is in, the
    bucket's parameters hold ``y_i = sum_j (W_t)_ij x_j`` (inside backward, before the
    optimizer's step) and DDP gets the rank's own gradient; ``mix="gradients"``: DDP gets
    ``sum_j (W_t)_ij g_j``. A group of one rank returns at once.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> ddp_model.register_comm_hook(GossipState("ring", mix="gradients"), gossip_hook)
        >>> ddp_model(torch.ones(1, 2)).sum().backward()
        >>> ddp_model.module.bias.grad                       # p = 1: its own
        tensor([1.])
        >>> dist.destroy_process_group()
    """
    if not isinstance(state, GossipState):
        raise TypeError(f"gossip_hook: state must be a GossipState, got {type(state).__name__}")
    buf = bucket.buffer()
    topo, me = state._setup()
    group = topo.group_of(me, state.iteration)
    if bucket.is_last():
        state.iteration += 1
    params = [p.detach() for p in bucket.parameters()]
    mixes = state.mix == "parameters" and len(group) > 1
    x = torch.cat([p.reshape(-1) for p in params]) if mixes else buf
    handles = [_launch(state, "gossip_hook", x, state._groups[group])] if len(group) > 1 else []

    def value() -> torch.Tensor:
        if mixes:  # y_i = sum_j (W_t)_ij x_j into the parameters; DDP gets the own gradient
            for p, v in zip(params, x.split([p.numel() for p in params])):
                p.copy_(v.view_as(p))
        return buf

    return backend.future_of(handles, value, timeout_s=state.timeout_s)


def register(model: Any, state: CollectiveState | PipelinedState | GossipState,
             hook: Callable[..., Any]) -> None:
    """``model.register_comm_hook(state, hook)`` after checking that ``state`` averages over the
    model's process group (``state.process_group=None`` is bound to it). No communication.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> ddp_model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        >>> register(ddp_model, PipelinedState(staleness=1), pipelined_hook)
        >>> dist.destroy_process_group()
    """
    if not isinstance(state, CollectiveState | PipelinedState | GossipState):
        raise TypeError("register: state must be a CollectiveState, a PipelinedState or a "
                        f"GossipState, got {type(state).__name__}")
    if not hasattr(model, "register_comm_hook") or not hasattr(model, "process_group"):
        raise TypeError("register: model must be a DistributedDataParallel, got "
                        f"{type(model).__name__}")
    group = model.process_group
    if state.process_group is None:
        state.process_group = group
    elif state.process_group is not group:
        raise ValueError("register: the state is bound to another process group than the model's "
                         f"(state.process_group has ranks {_ranks(state.process_group)}, the "
                         f"model's {_ranks(group)}); build the state with "
                         "process_group=model.process_group or None")
    state._params = list(model.parameters())
    if isinstance(state, GossipState):
        state._setup()  # the topology's process groups, on every rank in the same order
    model.register_comm_hook(state, hook)


def _ranks(group: Any) -> list[int] | str:
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return "(this rank is not a member)"
    return dist.get_process_group_ranks(group or dist.group.WORLD)


# --------------------------------------------------------------------------- error feedback


def _compensate(state: Any, bucket: dist.GradBucket, x: torch.Tensor, params: tuple[int, ...],
                offsets: tuple[int, ...]) -> None:
    """``x += e`` and keep ``e = x - D(C(x))`` for this bucket (``e`` from the same parameters'
    residuals, also when DDP rebuilt its buckets); drop stale buckets after the last one."""
    residual = _gather(state._residuals, params, offsets, [p.numel() for p in bucket.parameters()])
    codec = compress.get_codec(state.compression)
    _, new = compress.error_feedback(x, residual, codec)
    state._residuals[params] = (offsets, new)
    state._fresh.add(params)
    if bucket.is_last():
        for key in [key for key in state._residuals if key not in state._fresh]:
            del state._residuals[key]
        state._fresh.clear()


def _gather(entries: dict, params: tuple[int, ...], offsets: tuple[int, ...],
            sizes: list[int]) -> torch.Tensor | None:
    """The flat tensor of ``params`` assembled from ``entries`` ({key: (offsets, tensor)}, keys
    being tuples of parameter ids); None if no parameter has an entry (``e_0 = 0``)."""
    same = entries.get(params)
    if same is not None:
        return same[1]
    where = {pid: (t, off) for key, (offs, t) in entries.items() for pid, off in zip(key, offs)}
    if not any(pid in where for pid in params):
        return None
    first = where[next(pid for pid in params if pid in where)][0]
    out = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
    for pid, off, n in zip(params, offsets, sizes):
        if pid in where:
            t, old = where[pid]
            out[off : off + n].copy_(t[old : old + n])
    return out


# --------------------------------------------------------------------------- checkpoints


def _registered(state: Any, what: str) -> list[torch.Tensor]:
    if state._params is None:
        raise RuntimeError(f"{type(state).__name__}.{what}: the state does not know the model's "
                           "parameters; register it with pipecomm.hooks.register(ddp_model, "
                           "state, hook) first")
    return state._params


def _by_index(state: Any, entries: dict) -> dict[int, torch.Tensor]:
    """{key: (offsets, flat)} -> {parameter index in model.parameters(): a copy of its piece}."""
    params = _registered(state, "state_dict")
    index = {id(p): i for i, p in enumerate(params)}
    out = {}
    for key, (offsets, flat) in entries.items():
        for pid, off in zip(key, offsets):
            n = params[index[pid]].numel()
            out[index[pid]] = flat[off : off + n].detach().clone()
    return dict(sorted(out.items()))


def _from_index(state: Any, pieces: dict, what: str) -> tuple[tuple[int, ...], tuple, torch.Tensor]:
    """{parameter index: piece} -> one entry (key, offsets, flat) on this model's parameters."""
    params = _registered(state, "load_state_dict")
    key, offsets, parts, n = [], [], [], 0
    for i, piece in sorted(pieces.items()):
        if not 0 <= int(i) < len(params) or piece.numel() != params[int(i)].numel():
            raise ValueError(f"{type(state).__name__}.load_state_dict: {what} holds a piece for "
                             f"parameter {i} of {tuple(piece.shape)} elements, which this model "
                             "does not have")
        p = params[int(i)]
        key.append(id(p))
        offsets.append(n)
        parts.append(piece.detach().reshape(-1).to(device=p.device, dtype=p.dtype))
        n += p.numel()
    flat = torch.cat(parts) if parts else torch.zeros(0)
    return tuple(key), tuple(offsets), flat


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _state_dict(state: Any, kind: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {"kind": kind, "rank": _rank(), "staleness": getattr(state, "staleness", 0),
            "compression": state.compression, "error_feedback": state.error_feedback,
            "residuals": _by_index(state, state._residuals), **extra}


def _load_state_dict(state: Any, kind: str, sd: Any, keys: tuple[str, ...] = ()) -> None:
    where = f"{kind}.load_state_dict"
    _registered(state, "load_state_dict")
    if not isinstance(sd, dict) or sd.get("kind") != kind:
        got = sd.get("kind", "something else") if isinstance(sd, dict) else type(sd).__name__
        raise TypeError(f"{where}: state_dict must come from {kind}.state_dict(), got {got}'s")
    missing = {"rank", "compression", "error_feedback", "residuals", *keys} - set(sd)
    if missing:
        raise ValueError(f"{where}: state_dict is missing {sorted(missing)}")
    if sd["error_feedback"] != state.error_feedback or sd["compression"] != state.compression:
        raise ValueError(f"{where}: state_dict was saved with compression={sd['compression']!r}, "
                         f"error_feedback={sd['error_feedback']}; this state has "
                         f"compression={state.compression!r}, "
                         f"error_feedback={state.error_feedback}")
    if sd["residuals"] and sd["rank"] != _rank():
        raise ValueError(f"{where}: state_dict holds the error-feedback residuals of rank "
                         f"{sd['rank']}, loaded on rank {_rank()}; the residuals differ per rank: "
                         "load each rank's own")
    state._residuals.clear()
    state._fresh.clear()
    if sd["residuals"]:
        key, offsets, flat = _from_index(state, sd["residuals"], "residuals")
        state._residuals[key] = (offsets, flat)
