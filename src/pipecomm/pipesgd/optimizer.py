"""PipeSGD: the optimizer wrapper (arguments, replicas, the Optimizer interface, checkpoints).

The algorithms and the exact update rule are described in :mod:`pipecomm.pipesgd`; the schedules
live in :mod:`pipecomm.pipesgd.strategies`, the gradient exchange in
:mod:`pipecomm.pipesgd.exchange`, the construction checks in :mod:`pipecomm.pipesgd.replicas`,
the opt-in timings in :mod:`pipecomm.pipesgd.timing`.

Example::

    >>> import torch
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1))
    >>> opt.param_groups[0]["lr"]   # shares the wrapped optimizer's (schedulers attach to it)
    0.1
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import compress, vocab
from pipecomm.compress import ErrorFeedback
from pipecomm.compress import check_error_feedback as compress_check
from pipecomm.decentralized.replicas import broadcast_state, check_same, group_members
from pipecomm.pipesgd.exchange import Exchange, Ready
from pipecomm.pipesgd.replicas import check_arguments, check_staleness, select_params
from pipecomm.pipesgd.strategies import Layerwise, Local, Pipelined, Strategy, Sync
from pipecomm.pipesgd.timing import NullTimer, StepTimer, TimedCodec

__all__ = ["PipeSGD"]

_STATE_KEYS = (
    "mode",
    "staleness",
    "iteration",
    "updates",
    "param_shapes",
    "in_flight",
    "optimizer",
)


class PipeSGD(torch.optim.Optimizer):
    """Data-parallel training with the AllReduce of the averaged gradient ``k`` steps behind.

    Wraps a ``torch.optim.Optimizer`` (as ``PostLocalSGDOptimizer`` does), sharing its
    ``param_groups``, ``state`` and ``defaults``: schedulers attach to it directly.

    Args:
        model: the local replica (every rank builds the same architecture; rank 0's parameters
            and buffers are broadcast at construction, so all replicas start equal).
        optimizer: any ``torch.optim.Optimizer`` over (a subset of) ``model``'s parameters.
        mode: ``"sync"`` (BSP-SGD), ``"layerwise"`` (per-bucket AllReduce from backward hooks)
            or ``"pipe"`` (Pipe-SGD / delayed GD); :data:`pipecomm.vocab.MODES`.
        staleness: k; ``None`` means 0 for ``"sync"``/``"layerwise"`` (which accept only 0) and
            1 for ``"pipe"`` (any k >= 0; k = 0 is sync through the communication thread).
        algorithm: AllReduce algorithm of :func:`pipecomm.collectives.allreduce`
            (:data:`pipecomm.vocab.ALGORITHM_CHOICES`; default ``"auto"``, per call the fastest).
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"int8"``; ``"lp"``/``"ring"`` only.
        bucket_mb: bucket size of ``"layerwise"`` in MiB (DDP's default 25); a bucket closes once
            it holds at least this much (:mod:`pipecomm.bucketing`). Unused by the other modes
            (one AllReduce per dtype and device).
        group: process group (``None``: all ranks; without ``torch.distributed`` initialised,
            a single local rank).
        block_bytes: LP block size passed to the AllReduce (``None``: the cost model's optimum).
        broadcast_init: broadcast the first rank's parameters and buffers at construction.
        timing: keep per-iteration timing records (:attr:`timings`, :attr:`timing_totals`;
            with CUDA parameters every timing point synchronises the device). Off by default:
            no timer and no synchronisation in the training loop.
        max_timings: how many records :attr:`timings` keeps (the running sums count all).
        error_feedback: add each unit's last compression error to its next gradient
            (``x = g_t + e_t`` is averaged, ``e_{t+1} = x - D(C(x))`` kept per rank and unit;
            :func:`pipecomm.compress.error_feedback`); needs a ``compression``. The residuals
            are part of :meth:`state_dict` and differ per rank: checkpoint every rank's.

    Construction is collective (every rank of ``group``). :meth:`finish` (optional) applies the
    ``k`` gradients still in flight; ``with PipeSGD(...) as opt:`` calls it on leaving the block.
    The rule, the order inside ``step()`` and checkpoints: docs/update_rules.md, "Pipelined SGD
    with staleness k".

    Example::

        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        >>> opt = PipeSGD(model, torch.optim.Adam(model.parameters(), lr=1e-3), mode="pipe",
        ...               staleness=1, algorithm="lp", compression="fp16")
        >>> sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)
        >>> batches = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(3)]
        >>> for x, y in batches:
        ...     opt.zero_grad()
        ...     torch.nn.functional.mse_loss(model(x), y).backward()
        ...     opt.step()
        ...     sched.step()
        >>> opt.iteration, opt.in_flight
        (3, 1)
        >>> opt.finish()
        >>> opt.in_flight
        0
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mode: str = "pipe",
        staleness: int | None = None,
        algorithm: str = vocab.DEFAULT_ALGORITHM,
        compression: str | None = None,
        bucket_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
        *,
        block_bytes: int | None = None,
        broadcast_init: bool = True,
        timing: bool = False,
        max_timings: int | None = 100_000,
        error_feedback: bool = False,
    ) -> None:
        # torch.optim.Optimizer.__init__ is not called (as in torch's PostLocalSGDOptimizer):
        # param_groups, state and defaults are the wrapped optimizer's own.
        if isinstance(optimizer, PipeSGD):
            raise TypeError("optimizer must be the optimizer to wrap, not a PipeSGD")
        check_arguments(model, optimizer, bucket_mb, block_bytes, timing, max_timings)
        self.mode: str = vocab.check_mode(mode)
        self.staleness: int = check_staleness(mode, staleness)
        self.algorithm: str = vocab.check_algorithm(algorithm, allowed=vocab.ALGORITHM_CHOICES)
        self.compression: str | None = vocab.check_compression(compression, algorithm=algorithm)
        self.error_feedback: bool = compress_check(error_feedback, compression, "PipeSGD")
        self.bucket_mb = float(bucket_mb)
        self.block_bytes = block_bytes
        self.timing: bool = timing
        self.model = model
        self.optimizer = optimizer
        self.group = group
        _, members = group_members(group, "PipeSGD", "group")
        self.world_size: int = len(members)
        self._params = select_params(model, optimizer, compression)
        if self.world_size > 1:
            settings = {"mode": self.mode, "staleness": self.staleness,
                        "algorithm": self.algorithm, "compression": self.compression,
                        "error_feedback": self.error_feedback, "bucket_mb": self.bucket_mb}
            check_same(model, settings, group, "PipeSGD", params=self._params)
            if broadcast_init:
                broadcast_state(model, members[0], group, algorithm)

        codec = None
        if compression is not None and self.world_size > 1:
            codec = compress.get_codec(compression)
            if timing:
                codec = TimedCodec(codec)
        cuda = [p.device for p in self._params if p.is_cuda]
        self._timer: StepTimer | NullTimer = (
            StepTimer(max_timings, cuda[0] if cuda else None, codec) if timing else NullTimer())
        layerwise = mode == "layerwise" and self.world_size > 1
        self._exchange = Exchange(
            self._params,
            self.bucket_mb * 2**20 if layerwise else None,
            "reverse" if layerwise else "forward",
            algorithm,
            group,
            block_bytes,
            codec,
            self._timer,
            ErrorFeedback(codec) if codec is not None and error_feedback else None,
        )
        self.iteration: int = 0  # step() calls so far (t of the next step)
        self.updates: int = 0  # optimizer steps applied so far
        self._strategy: Strategy = self._make_strategy()

    def _make_strategy(self) -> Strategy:
        ex, apply = self._exchange, self._apply
        if self.world_size == 1:
            return Local(ex, apply, self.staleness)
        if self.mode == "sync":
            return Sync(ex, apply)
        if self.mode == "layerwise":
            return Layerwise(ex, apply)
        return Pipelined(ex, apply, self.staleness)

    # ------------------------------------------------------------------ the Optimizer interface

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The wrapped optimizer's ``param_groups`` (looked up each time: the wrapped optimizer's
        ``load_state_dict`` replaces the list, and a scheduler must keep seeing the live one)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's defaults (read by some schedulers, e.g. OneCycleLR)."""
        return self.optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad`` (held-back gradients are never touched).

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> loss = model(torch.ones(1, 2)).sum()
            >>> opt.zero_grad(); loss.backward(); opt.step()
            >>> opt.iteration
            1
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """End iteration t: launch the AllReduce of this gradient, apply the one of t - k.

        ``closure`` (optional) is called once, with gradients enabled, before that (it should
        zero the gradients, run forward and backward, and return the loss, which is returned).
        Optimizers that re-evaluate the closure (L-BFGS) are not supported.

        Example::

            >>> model, loss_fn = torch.nn.Linear(2, 1), torch.nn.functional.mse_loss
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="sync")
            >>> x, y = torch.ones(4, 2), torch.zeros(4, 1)
            >>> opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
            >>> loss = opt.step(lambda: (opt.zero_grad(), (l := loss_fn(model(x), y)).backward(), l)[2])
            >>> opt.updates
            2
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        timer, before = self._timer, self.updates
        timer.open(self.iteration)  # the backward of this iteration counts as compute
        with torch.no_grad():
            self._strategy.step()
        self.iteration += 1
        timer.close(self.updates - before)
        return loss

    def _apply(self, entry: Any) -> None:
        """Install ``entry``'s averaged gradients as ``p.grad`` and take the optimizer's step."""
        grads = self._exchange.gradients(entry)
        timer = self._timer
        start = timer.clock()
        for p, g in zip(self._params, grads):
            p.grad = g
        self.optimizer.step()
        self.updates += 1
        timer.add("update_s", timer.settled() - start)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported: PipeSGD's buckets are fixed at construction; build a new PipeSGD."""
        raise NotImplementedError(
            "PipeSGD.add_param_group: the gradient buckets are fixed at construction; add the "
            "group to the wrapped optimizer before building PipeSGD"
        )

    def register_step_pre_hook(self, hook: Callable[..., Any]) -> Any:
        """Registered on the wrapped optimizer: runs before every *applied* update."""
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook: Callable[..., Any]) -> Any:
        """Registered on the wrapped optimizer: runs after every *applied* update."""
        return self.optimizer.register_step_post_hook(hook)

    # ------------------------------------------------------------------ the pipeline

    @property
    def in_flight(self) -> int:
        """Number of gradients launched but not yet applied (at most ``staleness`` after a step).

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), staleness=2)
            >>> model(torch.ones(1, 2)).sum().backward()
            >>> opt.step(); assert opt.in_flight == min(opt.iteration, opt.staleness)
            >>> opt.in_flight
            1
        """
        return len(self._strategy.pending)

    def finish(self) -> None:
        """Wait for the reductions in flight and apply them in order (drains the pipeline).

        Optional (see the class docstring); a no-op when nothing is in flight. A later
        ``step()`` starts a new pipeline: its first k iterations apply nothing again.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="pipe")
            >>> for batch in [torch.ones(1, 2)] * 3:
            ...     opt.zero_grad(); model(batch).sum().backward(); opt.step()
            >>> opt.finish()           # parameters now include every computed gradient
            >>> opt.updates
            3
        """
        self._strategy.check_between_steps("finish")
        if not self._strategy.pending:
            return
        timer, before = self._timer, self.updates
        timer.open(None)
        with torch.no_grad():
            self._strategy.drain()
        timer.close(self.updates - before)

    def remove_hooks(self) -> None:
        """Detach the backward hooks of ``"layerwise"`` (the optimizer is unusable afterwards).

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="layerwise")
            >>> opt.remove_hooks()     # before building another PipeSGD on the same model
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="layerwise")
        """
        self._strategy.close()

    def __enter__(self) -> PipeSGD:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        try:
            if exc_type is None:
                self.finish()
        finally:
            self.remove_hooks()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.remove_hooks()

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: step counters, the gradients in flight (averaged; waits
        for their reductions without applying them) and the wrapped optimizer's state (a deep
        copy, under ``"optimizer"``). The model's own ``state_dict()`` is saved separately (as in
        the example of :meth:`load_state_dict`).

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> sorted(opt.state_dict())
            ['in_flight', 'iteration', 'mode', 'optimizer', 'param_shapes', 'rank', 'residuals',
             'staleness', 'updates']
        """
        self._strategy.check_between_steps("state_dict")
        in_flight = []
        with torch.no_grad():
            for entry in self._strategy.pending:
                grads = self._exchange.gradients(entry)
                in_flight.append([None if g is None else g.detach().clone() for g in grads])
        return {
            "mode": self.mode,
            "staleness": self.staleness,
            "iteration": self.iteration,
            "updates": self.updates,
            "param_shapes": [tuple(p.shape) for p in self._params],
            "in_flight": in_flight,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "rank": dist.get_rank() if dist.is_initialized() else 0,
            "residuals": self._exchange.residuals(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh PipeSGD (same mode and staleness); loads the
        wrapped optimizer's state too. Load the model's parameters with ``model.load_state_dict``.

        Example::

            >>> import io
            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1))
            >>> path = io.BytesIO()
            >>> torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
            >>> _ = path.seek(0); ckpt = torch.load(path)
            >>> model.load_state_dict(ckpt["model"]); opt.load_state_dict(ckpt["opt"])
            <All keys matched successfully>
        """
        state = state_dict
        if not isinstance(state, dict):
            raise TypeError("state must be a dict from PipeSGD.state_dict(), got "
                            f"{type(state).__name__}")
        missing = set(_STATE_KEYS) - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}; pass PipeSGD.state_dict()")
        if state["mode"] != self.mode or state["staleness"] != self.staleness:
            raise ValueError(f"state was saved with mode={state['mode']!r}, staleness="
                             f"{state['staleness']}; this PipeSGD has mode={self.mode!r}, "
                             f"staleness={self.staleness}")
        shapes = [tuple(p.shape) for p in self._params]
        if [tuple(s) for s in state["param_shapes"]] != shapes:
            raise ValueError("state was saved for a model with different parameter shapes")
        if len(state["in_flight"]) > self.staleness:
            raise ValueError(f"state holds {len(state['in_flight'])} gradients in flight, more "
                             f"than staleness={self.staleness}")
        if self._strategy.pending:
            raise RuntimeError("load_state_dict needs a PipeSGD with nothing in flight (a fresh one)")
        self._strategy.check_between_steps("load_state_dict")
        for grads in state["in_flight"]:
            if len(grads) != len(self._params):
                raise ValueError("an in-flight gradient list does not match the parameters")
        residuals = state.get("residuals") or {}
        if residuals and self._exchange.feedback is None:
            raise ValueError("state holds error-feedback residuals; this PipeSGD has "
                             "error_feedback=False")
        rank = dist.get_rank() if dist.is_initialized() else 0
        if residuals and state.get("rank", 0) != rank:
            raise ValueError(f"state holds the error-feedback residuals of rank {state.get('rank')}, "
                             f"loaded on rank {rank}; the residuals differ per rank: load each "
                             "rank's own state")
        self.optimizer.load_state_dict(state["optimizer"])
        self._exchange.load_residuals(residuals)
        for grads in state["in_flight"]:
            own = [
                None if g is None else g.detach().to(device=p.device, dtype=p.dtype).clone()
                for p, g in zip(self._params, grads)
            ]
            self._strategy.pending.append(Ready(own))
        self.iteration = int(state["iteration"])
        self.updates = int(state["updates"])

    # ------------------------------------------------------------------ timings

    @property
    def timings(self) -> Any:
        """Per-iteration records (:data:`pipecomm.pipesgd.TIMING_KEYS`), newest last.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> PipeSGD(model, opt, timing=True).timings     # deque of dicts
            deque([], maxlen=...)
        """
        return self._timer_on("timings").records

    @property
    def timing_totals(self) -> dict[str, float]:
        """Running sums of the records' seconds, ``iterations`` and ``updates``.

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), timing=True)
            >>> opt.timing_totals["comm_s"]
            0.0
        """
        return self._timer_on("timing_totals").totals

    def reset_timings(self) -> None:
        """Clear :attr:`timings` and :attr:`timing_totals`; the next compute phase starts now
        (nothing to do with ``timing=False``).

        Example::

            >>> model = torch.nn.Linear(2, 1)
            >>> opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), timing=True)
            >>> for _ in range(2):
            ...     model(torch.ones(1, 2)).sum().backward(); opt.step()
            >>> opt.reset_timings()      # measure from here
            >>> opt.timing_totals["iterations"]
            0
        """
        self._timer.reset()

    def _timer_on(self, what: str) -> StepTimer:
        if not self._timer.enabled:
            raise RuntimeError(
                f"PipeSGD.{what}: this PipeSGD keeps no timings; build it with timing=True"
            )
        return self._timer  # type: ignore[return-value]

    def __repr__(self) -> str:
        return (
            f"PipeSGD(mode={self.mode!r}, staleness={self.staleness}, algorithm={self.algorithm!r}, "
            f"compression={self.compression!r}, world_size={self.world_size}, "
            f"iteration={self.iteration}, in_flight={self.in_flight}, optimizer={self.optimizer!r})"
        )
