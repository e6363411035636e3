"""PipeSGD's strategies: when the averaged gradient of an iteration is launched and applied.

One concept: the schedule of one ``step()``. Each strategy keeps the gradients launched but not
yet applied in ``pending`` (oldest first) and applies an entry through the ``apply`` callable of
:class:`pipecomm.pipesgd.PipeSGD` (install it as ``p.grad``, take the wrapped optimizer's step).
With ``g(w)`` the gradient averaged over all ranks, every strategy realises
``w_{t+1} = step(w_t, g(w_{t-k}))`` for ``t >= k`` and ``w_{t+1} = w_t`` for ``t < k``:

* :class:`Local` — world size 1: nothing is communicated, the local gradient is held back k
  iterations (any mode);
* :class:`Sync` — BSP-SGD of the LP paper (Wang et al., arXiv 1611.04255), k = 0: one blocking
  AllReduce per unit after backward, then the step;
* :class:`Pipelined` — Pipe-SGD (Li et al., NeurIPS 2018) and delayed GD (Daily et al., ICLR
  2017 submission, "AGD (1 comm)", "AGD (2 comm)"): launch this iteration's AllReduce on the
  communication thread, apply the one launched k iterations ago (k = 0: wait for it at once);
* :class:`Layerwise` — layer-wise GD (Daily et al.), k = 0: a backward hook copies each gradient
  into its bucket and launches every complete bucket as backward goes on; ``step()`` launches the
  rest and waits for all of them.

Example::

    >>> import torch.distributed as dist
    >>> from pipecomm.pipesgd.timing import NullTimer
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> model = torch.nn.Linear(2, 1)
    >>> exchange = Exchange(list(model.parameters()), None, "forward", "lp", None, None, None,
    ...                     NullTimer())
    >>> applied = []
    >>> apply = applied.append
    >>> strategy = Pipelined(exchange, apply, staleness=1)
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> strategy.step()        # launches this iteration's reductions, applies the previous ones
    >>> len(applied), len(strategy.pending)
    (0, 1)
    >>> strategy.drain()       # applies everything still pending
    >>> len(applied), len(strategy.pending)
    (1, 0)
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Any

import torch

from pipecomm.pipesgd.exchange import Exchange, Launched, Ready

__all__ = ["Layerwise", "Local", "Pipelined", "Strategy", "Sync"]


class Strategy:
    """Base class: the queue of pending gradients (``staleness`` k of them held back) and the
    operations every strategy shares.

    Example::

        >>> class Never(Strategy):
        ...     def step(self) -> None:
        ...         self.exchange.release_grads()
        ...
    """

    def __init__(self, exchange: Exchange, apply: Callable[[Any], None], staleness: int = 0
                 ) -> None:
        self.exchange, self.apply, self.staleness = exchange, apply, staleness
        self.pending: collections.deque = collections.deque()

    def step(self) -> None:
        """End an iteration (called under ``torch.no_grad()``)."""
        raise NotImplementedError

    def _enqueue(self, entry: Any) -> None:
        """Queue ``entry``; apply the oldest entry once more than ``staleness`` are queued."""
        self.pending.append(entry)
        if len(self.pending) > self.staleness:
            self.apply(self.pending.popleft())
        else:
            self.exchange.release_grads()  # held back: p.grad must not be zeroed in place

    def drain(self) -> None:
        """Apply every pending entry, oldest first."""
        while self.pending:
            self.apply(self.pending.popleft())

    def check_between_steps(self, what: str) -> None:
        """Raise if ``what`` is called in the middle of an iteration (layer-wise only)."""

    def close(self) -> None:
        """Detach backward hooks, if any."""


class Local(Strategy):
    """World size 1: hold the local gradient back ``staleness`` iterations.

    Example::

        >>> from pipecomm.pipesgd.timing import NullTimer
        >>> model, applied = torch.nn.Linear(2, 1), []
        >>> exchange = Exchange(list(model.parameters()), None, "forward", "lp", None, None, None,
        ...                     NullTimer())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> Local(exchange, applied.append, staleness=2).step()
        >>> len(applied)           # held back
        0
    """

    def step(self) -> None:
        grads = self.exchange.local_gradients()
        if self.staleness == 0:
            self.apply(grads)
        else:
            self._enqueue(grads)


class Sync(Strategy):
    """BSP-SGD: blocking AllReduce of every unit, then the step.

    Example::

        >>> import torch.distributed as dist
        >>> from pipecomm.pipesgd.timing import NullTimer
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, applied = torch.nn.Linear(2, 1), []
        >>> exchange = Exchange(list(model.parameters()), None, "forward", "lp", None, None, None,
        ...                     NullTimer())
        >>> model(torch.ones(1, 2)).sum().backward()
        >>> Sync(exchange, applied.append).step()
        >>> len(applied)           # applied at once
        1
        >>> dist.destroy_process_group()
    """

    def step(self) -> None:
        entry = Launched(len(self.exchange.units))
        for u in range(len(entry.flats)):
            self.exchange.launch(entry, u, async_op=False)
        self.apply(entry)


class Pipelined(Strategy):
    """Pipe-SGD / delayed GD: launch now on the communication thread, apply k iterations later
    (the example of this module's docstring runs it)."""

    def step(self) -> None:
        entry = Launched(len(self.exchange.units))
        for u in range(len(entry.flats)):
            self.exchange.launch(entry, u, async_op=True)
        self._enqueue(entry)


class Layerwise(Strategy):
    """Layer-wise GD: buckets launched from backward hooks, all waited for in ``step()``.

    A bucket is launched once all its gradients are ready and every earlier bucket is launched
    (the same order on every rank). Two backward passes before one ``step()`` are refused (the
    bucket was already reduced); the error comes from ``step()``, after the launched reductions.

    Example::

        >>> import torch.distributed as dist
        >>> from pipecomm.pipesgd.timing import NullTimer
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model, applied = torch.nn.Linear(2, 1), []
        >>> exchange = Exchange(list(model.parameters()), None, "reverse", "lp", None, None, None,
        ...                     NullTimer())
        >>> apply, loss = applied.append, model(torch.ones(1, 2)).sum()
        >>> lw = Layerwise(exchange, apply); loss.backward(); lw.step(); lw.close()
        >>> len(applied)
        1
        >>> dist.destroy_process_group()
    """

    def __init__(self, exchange: Exchange, apply: Callable[[Any], None]) -> None:
        super().__init__(exchange, apply)
        n = len(exchange.params)
        self._unit_of: list[tuple[int, int]] = [(0, 0)] * n  # param -> (unit, slot)
        for u, unit in enumerate(exchange.units):
            for s, i in enumerate(unit.indices):
                self._unit_of[i] = (u, s)
        self._hooks: list[Any] = []
        self._reset()
        ref = weakref.ref(self)
        for i, p in enumerate(exchange.params):

            def hook(param: torch.Tensor, i: int = i) -> None:
                strategy = ref()
                if strategy is not None:
                    strategy._grad_ready(i, param)

            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _reset(self) -> None:
        units = self.exchange.units
        self._current = Launched(len(units))
        self._ready_count = [0] * len(units)
        self._seen = [False] * len(self.exchange.params)
        self._next_launch = 0
        self._double_backward = False

    def _slot(self, u: int, s: int) -> torch.Tensor:
        unit = self.exchange.units[u]
        return self._current.flats[u][unit.offsets[s] : unit.offsets[s] + unit.numels[s]]

    @torch.no_grad()
    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Backward hook: copy the gradient into its bucket; launch every complete bucket whose
        predecessors are launched."""
        if self._seen[i]:
            self._double_backward = True  # reported by step(), after the launched reductions
            return
        self._seen[i] = True
        u, s = self._unit_of[i]
        units, cur = self.exchange.units, self._current
        if cur.flats[u] is None:
            cur.flats[u] = torch.empty(units[u].total, dtype=units[u].dtype, device=units[u].device)
        if param.grad is not None:
            self._slot(u, s).copy_(param.grad.reshape(-1))
        else:
            self._slot(u, s).zero_()
        self._ready_count[u] += 1
        while self._next_launch < len(units) and self._ready_count[self._next_launch] == len(
            units[self._next_launch].indices
        ):
            self.exchange.launch(cur, self._next_launch, async_op=True, timed=False)
            self._next_launch += 1

    def _fill_missing(self, u: int) -> None:
        """Copy into bucket ``u`` the gradients whose hooks did not fire (zeros for None)."""
        unit = self.exchange.units[u]
        for s, i in enumerate(unit.indices):
            if not self._seen[i]:
                self._seen[i] = True
                g = self.exchange.params[i].grad
                if g is None:
                    self._slot(u, s).zero_()
                else:
                    self._slot(u, s).copy_(g.reshape(-1))

    def step(self) -> None:
        ex, cur, timer = self.exchange, self._current, self.exchange.timer
        start = timer.clock()
        for u in range(self._next_launch, len(ex.units)):
            if cur.flats[u] is not None:  # partly filled by hooks: add the missing ones
                self._fill_missing(u)
            ex.launch(cur, u, async_op=True, timed=False)
        self._next_launch = len(ex.units)
        timer.add("launch_s", timer.clock() - start)
        double = self._double_backward
        grads = ex.gradients(cur)  # waits for every bucket
        self._reset()
        if double:
            ex.release_grads()
            raise RuntimeError(
                "mode='layerwise' saw a parameter's gradient accumulated twice before "
                "step() (several backward passes per step); its bucket had already been "
                "reduced. Use mode='sync' or 'pipe' for gradient accumulation."
            )
        self.apply(Ready(grads))

    def check_between_steps(self, what: str) -> None:
        if any(self._seen):
            raise RuntimeError(
                f"{what}() was called after backward launched layer-wise reductions but before "
                "step(); call step() first"
            )

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
