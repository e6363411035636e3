"""Gradient exchange of PipeSGD: flat buffers per bucket, their averaging AllReduce, unpacking.

One concept: how the gradients of one iteration travel. Parameters are grouped into units by
:mod:`pipecomm.bucketing` (``bucket_bytes=None``: one unit per kind), each unit's gradients are
packed into a new flat buffer, averaged with :func:`pipecomm.collectives.allreduce`
(``op="avg"``) and viewed back as per-parameter gradients; the strategies (:mod:`.strategies`)
decide when units are launched and applied.

Example::

    >>> import torch, torch.distributed as dist
    >>> from pipecomm.pipesgd.timing import NullTimer
    >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
    >>> model = torch.nn.Linear(2, 1)
    >>> params = list(model.parameters())
    >>> model(torch.ones(1, 2)).sum().backward()
    >>> ex = Exchange(params, bucket_bytes=None, order="forward", algorithm="lp", group=None,
    ...               block_bytes=None, codec=None, timer=NullTimer())
    >>> entry = Launched(len(ex.units))
    >>> for u in range(len(ex.units)):
    ...     ex.launch(entry, u, async_op=True)
    >>> grads = ex.gradients(entry)          # waits; one averaged tensor per parameter
    >>> grads
    [tensor([[1., 1.]]), tensor([1.])]
    >>> dist.destroy_process_group()
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipecomm import bucketing, collectives

__all__ = ["Exchange", "Launched", "Ready", "Unit", "make_units"]


@dataclass(frozen=True)
class Unit:
    """A set of same-dtype, same-device parameters reduced as one flat buffer."""

    indices: tuple[int, ...]  # into the parameter list
    offsets: tuple[int, ...]  # start of each parameter in the flat buffer
    numels: tuple[int, ...]
    total: int
    dtype: torch.dtype
    device: torch.device


def make_units(params: list[nn.Parameter], bucket_bytes: float | None, order: str) -> list[Unit]:
    """Units of ``params`` by :func:`pipecomm.bucketing.bucket_indices` (``kinds="interleaved"``:
    one open unit per kind), listed in the order they can complete.

    Example::

        >>> make_units([torch.zeros(3), torch.zeros(5)], None, "forward")[0].offsets
        (0, 3)
    """
    units = []
    for idx in bucketing.bucket_indices(params, bucket_bytes, order=order, kinds="interleaved"):
        numels = tuple(params[i].numel() for i in idx)
        offsets, acc = [], 0
        for n in numels:
            offsets.append(acc)
            acc += n
        first = params[idx[0]]
        units.append(Unit(tuple(idx), tuple(offsets), numels, acc, first.dtype, first.device))
    return units


class Launched:
    """Gradients of one iteration: flat buffers per unit and their reductions' handles."""

    __slots__ = ("flats", "handles")

    def __init__(self, n_units: int) -> None:
        self.flats: list[torch.Tensor | None] = [None] * n_units
        self.handles: list[Any] = [None] * n_units


class Ready:
    """Averaged gradients of one iteration, one tensor (or None) per parameter."""

    __slots__ = ("grads",)

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        self.grads = grads


class Exchange:
    """Packs, launches and waits for the averaging AllReduce of the units of ``params``.

    Example::

        >>> from pipecomm.pipesgd.timing import NullTimer
        >>> params = list(torch.nn.Linear(2, 1).parameters())
        >>> ex = Exchange(params, None, "forward", "lp", None, None, None, NullTimer())
        >>> ex.units        # one Unit per (dtype, device) kind
        [Unit(indices=(0, 1), offsets=(0, 2), numels=(2, 1), total=3, dtype=torch.float32,
              device=device(type='cpu'))]
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        bucket_bytes: float | None,
        order: str,
        algorithm: str,
        group: Any,
        block_bytes: int | None,
        codec: Any,
        timer: Any,
        feedback: Any = None,
    ) -> None:
        self.params = params
        self.units = make_units(params, bucket_bytes, order)
        self.algorithm = algorithm
        self.group = group
        self.block_bytes = block_bytes
        self.codec = codec
        self.timer = timer
        self.feedback = feedback  # compress.ErrorFeedback (residual per unit) or None

    def pack(self, unit: Unit) -> torch.Tensor:
        """A new flat buffer holding the unit's gradients (zeros where a gradient is None)."""
        parts = []
        for i, n in zip(unit.indices, unit.numels):
            g = self.params[i].grad
            if g is None:
                parts.append(torch.zeros(n, dtype=unit.dtype, device=unit.device))
            else:
                if g.layout != torch.strided:
                    raise TypeError(
                        "sparse gradients are not supported by PipeSGD; use dense gradients "
                        "(for example nn.Embedding(sparse=False))"
                    )
                parts.append(g.reshape(-1))
        return torch.cat(parts)

    def launch(self, entry: Launched, u: int, *, async_op: bool, timed: bool = True) -> None:
        """Pack unit ``u`` (unless hooks did) and start its AllReduce; with ``timed``, packing and
        issuing count as ``launch_s`` and a synchronous reduction as ``comm_s``."""
        timer = self.timer
        start = timer.clock()
        if entry.flats[u] is None:
            entry.flats[u] = self.pack(self.units[u])
        if self.feedback is not None:  # x = g + e; e = x - D(C(x)); average x
            self.feedback.compensate(u, entry.flats[u])
        issued = timer.clock()
        entry.handles[u] = collectives.allreduce(
            entry.flats[u],
            algorithm=self.algorithm,
            op="avg",
            group=self.group,
            block_bytes=self.block_bytes,
            async_op=async_op,
            compression=self.codec,
        )
        if timed:
            if async_op:
                timer.add("launch_s", timer.clock() - start)
            else:
                done = timer.settled()
                timer.add("launch_s", issued - start)
                timer.add("comm_s", done - issued)

    def gradients(self, entry: Any) -> list[torch.Tensor | None]:
        """Wait for ``entry``'s reductions (timed as communication); per-parameter gradients.
        ``entry`` is a :class:`Launched`, a :class:`Ready` or a list of local gradients."""
        if isinstance(entry, Ready):
            return entry.grads
        if isinstance(entry, list):  # world size 1: the local gradients themselves
            return entry
        timer = self.timer
        grads: list[torch.Tensor | None] = [None] * len(self.params)
        for unit, flat, handle in zip(self.units, entry.flats, entry.handles):
            if handle is not None and not isinstance(handle, torch.Tensor):
                start = timer.clock()
                handle.wait()
                timer.add("comm_s", timer.settled() - start)
            for i, off, n in zip(unit.indices, unit.offsets, unit.numels):
                grads[i] = flat[off : off + n].view(self.params[i].shape)
        return grads

    def residuals(self) -> dict[int, torch.Tensor]:
        """Copies of the error-feedback residuals, by unit index (empty without feedback)."""
        if self.feedback is None:
            return {}
        return {u: e.detach().clone() for u, e in sorted(self.feedback.residuals.items())}

    def load_residuals(self, residuals: dict[int, torch.Tensor]) -> None:
        """Restore :meth:`residuals` (same units: same parameters, same bucket size)."""
        if self.feedback is None:
            return
        self.feedback.residuals.clear()
        for u, e in residuals.items():
            unit = self.units[int(u)] if 0 <= int(u) < len(self.units) else None
            if unit is None or e.numel() != unit.total:
                raise ValueError(f"residual of unit {u} does not match this PipeSGD's units")
            self.feedback.residuals[int(u)] = e.detach().to(unit.device, unit.dtype).clone()

    def local_gradients(self) -> list[torch.Tensor | None]:
        """The parameters' own ``.grad`` (world size 1: nothing to average)."""
        return [p.grad for p in self.params]

    def release_grads(self) -> None:
        """``p.grad = None`` for every parameter (a held-back gradient must not be zeroed in
        place by ``zero_grad(set_to_none=False)``)."""
        for p in self.params:
            p.grad = None
