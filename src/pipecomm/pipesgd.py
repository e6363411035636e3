"""Pipelined SGD with staleness k: synchronous (BSP-SGD), layer-wise, and pipelined AllReduce SGD.

One concept: data-parallel training in which the gradient averaged over all ranks is applied
``k`` iterations late, while its AllReduce runs on pipecomm's communication thread. It implements

* BSP-SGD of the LP paper (Wang et al., arXiv 1611.04255) — ``mode="sync"``: after backward,
  one AllReduce (average) of the flattened gradients, then the optimizer's step;
* layer-wise GD of Daily, Vishnu, Siegel ("Leveraging Asynchronicity in Gradient Descent for
  Scalable Deep Learning", ICLR 2017 submission) — ``mode="layerwise"``: gradients are bucketed in
  backward order and each bucket's AllReduce starts from a backward hook as soon as its gradients
  are ready; all of them are waited for before the step (zero staleness, so the result is that of
  ``"sync"``; only the timing differs);
* Pipe-SGD (Li, Yu, Li, Avestimehr, Kim, Schwing, NeurIPS 2018) and delayed GD (Daily et al.,
  "AGD (1 comm)", "AGD (2 comm)") — ``mode="pipe"``: the step of iteration t launches the
  AllReduce of its gradient and applies the one launched at iteration t - k, so the AllReduce of
  iteration t - k runs while iterations t - k + 1 .. t compute (k = 1 is Pipe-SGD's pipeline of
  width 2; k = 2 keeps two reductions in flight). Pipe-SGD's light compression (``"fp16"``,
  ``"bf16"``, ``"int8"``) is applied inside the AllReduce (:mod:`pipecomm.collectives`).

Exact rule (``docs/update_rules.md``, "Pipelined SGD with staleness k"): with ``g(w)`` the
gradient averaged over all ranks, ``w_{t+1} = step(w_t, g(w_{t-k}))`` for ``t >= k`` and
``w_{t+1} = w_t`` for ``t < k``; after ``step()`` of iteration t returns, the parameters are
``w_{t+1}``. ``step`` is the wrapped optimizer's ``step()`` with ``p.grad`` set to the averaged
gradient (so SGD, momentum, Adam, ... all work, and their state advances once per update).

At world size 1 nothing is communicated, but the staleness is kept (gradients are held back k
iterations). The emulated network (:mod:`pipecomm.netem`) applies to every algorithm;
``"torch"`` (the built-in) cannot be emulated and is refused under it. Timings per iteration
(compute, time blocked on communication, compression, update) are kept in
:attr:`PipeSGD.timings` for the experiments' breakdowns; with CUDA parameters every timing point
first synchronises the device, so they measure GPU work rather than kernel launches (at the price
of serialising the host with the GPU there).

Example::

    from pipecomm.pipesgd import PipeSGD
    trainer = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), mode="pipe")
    for x, y in batches:
        model.zero_grad()
        loss_fn(model(x), y).backward()
        trainer.step()              # launches this gradient's AllReduce, applies the previous one
    trainer.finish()                # applies the reductions still in flight
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import operator
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import bench, collectives

__all__ = ["COMPRESSIONS", "MODES", "TIMING_KEYS", "PipeSGD"]

MODES: tuple[str, ...] = ("sync", "layerwise", "pipe")
COMPRESSIONS: tuple[str | None, ...] = (None, "fp16", "bf16", "int8")
_COMPRESSING_ALGORITHMS = ("lp", "ring")
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_BUFFER_DTYPES = tuple(collectives.SUPPORTED_DTYPES)

#: Keys of a per-iteration timing record (seconds unless said otherwise).
TIMING_KEYS: tuple[str, ...] = (
    "iteration",  # t, counting step() calls from 0 (None for the records of finish())
    "applied",  # whether an update was applied (False while the pipeline fills)
    "updates",  # optimizer steps in this record (0 or 1 for step(); up to k for finish())
    "compute_s",  # from the end of the previous step() to the start of this one (fwd + bwd)
    "launch_s",  # packing gradients into flat buffers and issuing their reductions
    "comm_s",  # time blocked waiting for a reduction (sync mode: the whole reduction)
    "compress_s",  # codec encode/decode time since the previous record, on any thread
    "update_s",  # installing the averaged gradient and the optimizer's step
    "iter_s",  # wall time from the end of the previous step() to the end of this one
)


# --------------------------------------------------------------------------- helpers


class _TimedCodec:
    """Wraps a :mod:`pipecomm.compress` codec and adds up the seconds spent encoding/decoding.

    Host-side time: on CUDA the kernels are asynchronous and only their launch is counted.
    """

    def __init__(self, codec: Any) -> None:
        self._codec = codec
        self.name = codec.name
        self.seconds = 0.0

    def payload_nbytes(self, numel: int) -> int:
        return self._codec.payload_nbytes(numel)

    def ratio(self, dtype: torch.dtype) -> float:
        return self._codec.ratio(dtype)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self._codec.encode(x)
        finally:
            self.seconds += time.perf_counter() - start

    def decode(self, payload: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = time.perf_counter()
        try:
            return self._codec.decode(payload, numel, dtype)
        finally:
            self.seconds += time.perf_counter() - start

    def __repr__(self) -> str:
        return f"_TimedCodec({self._codec!r})"


@dataclass(frozen=True)
class _Unit:
    """A set of same-dtype, same-device parameters reduced as one flat buffer."""

    indices: tuple[int, ...]  # into PipeSGD._params
    offsets: tuple[int, ...]  # start of each parameter in the flat buffer
    numels: tuple[int, ...]
    total: int
    dtype: torch.dtype
    device: torch.device


def _make_units(
    params: list[nn.Parameter], order: list[int], cap_bytes: float | None
) -> list[_Unit]:
    """Group ``params`` (visited in ``order``) by (device, dtype) and, if ``cap_bytes`` is set,
    close a unit once it holds at least ``cap_bytes`` bytes (DDP's bucketing)."""
    open_units: dict[tuple, list[int]] = {}
    done: list[list[int]] = []

    def nbytes(idx: list[int]) -> int:
        return sum(params[i].numel() * params[i].element_size() for i in idx)

    for i in order:
        key = (params[i].device, params[i].dtype)
        open_units.setdefault(key, []).append(i)
        if cap_bytes is not None and nbytes(open_units[key]) >= cap_bytes:
            done.append(open_units.pop(key))
    done.extend(open_units.values())
    if cap_bytes is not None:  # launch order = order in which the units can complete
        position = {i: n for n, i in enumerate(order)}
        done.sort(key=lambda idx: max(position[i] for i in idx))
    units = []
    for idx in done:
        numels = tuple(params[i].numel() for i in idx)
        offsets, acc = [], 0
        for n in numels:
            offsets.append(acc)
            acc += n
        units.append(
            _Unit(
                tuple(idx), tuple(offsets), numels, acc, params[idx[0]].dtype, params[idx[0]].device
            )
        )
    return units


class _Launched:
    """Gradients of one iteration: flat buffers per unit and their reductions' handles."""

    __slots__ = ("flats", "handles")

    def __init__(self, n_units: int) -> None:
        self.flats: list[torch.Tensor | None] = [None] * n_units
        self.handles: list[Any] = [None] * n_units


class _Ready:
    """Averaged gradients of one iteration, one tensor (or None) per parameter."""

    __slots__ = ("grads",)

    def __init__(self, grads: list[torch.Tensor | None]) -> None:
        self.grads = grads


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if not any(value is c or (isinstance(value, str) and value == c) for c in choices):
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


# --------------------------------------------------------------------------- the trainer


class PipeSGD:
    """Data-parallel training with the AllReduce of the averaged gradient ``k`` steps behind.

    Args:
        model: the local replica (every rank builds the same architecture; rank 0's parameters
            and buffers are broadcast at construction, so all replicas start equal).
        optimizer: any ``torch.optim.Optimizer`` over (a subset of) ``model``'s parameters.
        mode: ``"sync"`` (BSP-SGD), ``"layerwise"`` (per-bucket AllReduce from backward hooks)
            or ``"pipe"`` (Pipe-SGD / delayed GD).
        staleness: k; ``None`` means 0 for ``"sync"``/``"layerwise"`` (which accept only 0) and
            1 for ``"pipe"`` (any k >= 0; k = 0 is sync through the communication thread).
        algorithm: AllReduce algorithm of :func:`pipecomm.collectives.allreduce`
            (``"lp"``, ``"mst"``, ``"be"``, ``"ring"``, ``"torch"``).
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"int8"``; ``"lp"``/``"ring"`` only.
        bucket_mb: bucket size of ``"layerwise"`` in MiB (DDP's default 25); a bucket closes once
            it holds at least this much. Unused by the other modes (one AllReduce per dtype).
        group: process group (``None``: all ranks; without ``torch.distributed`` initialised,
            a single local rank).
        block_bytes: LP block size passed to the AllReduce (``None``: the cost model's optimum).
        broadcast_init: broadcast the first rank's parameters and buffers at construction.
        max_timings: how many per-iteration timing records :attr:`timings` keeps (the running
            sums in :attr:`timing_totals` count all).

    Construction is collective: every rank of ``group`` builds its PipeSGD (the replicas' shapes
    and arguments are compared, and must agree). Usage per iteration:
    ``model.zero_grad(); loss_fn(model(x), y).backward(); trainer.step()``.
    After ``step()`` of iteration t the parameters are ``w_{t+1}`` and ``p.grad`` holds the
    averaged gradient that was applied (``None`` while the pipeline fills). A parameter without a
    gradient on a rank contributes zeros to the average.

    Example::

        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        trainer = PipeSGD(model, opt, mode="pipe", staleness=1, algorithm="lp", compression="fp16")
        for x, y in batches:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            trainer.step()
        trainer.finish()
        print(trainer.timing_totals)
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        mode: str = "pipe",
        staleness: int | None = None,
        algorithm: str = "lp",
        compression: str | None = None,
        bucket_mb: float = 25.0,
        group: dist.ProcessGroup | None = None,
        *,
        block_bytes: int | None = None,
        broadcast_init: bool = True,
        max_timings: int | None = 100_000,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        _check_choice("mode", mode, MODES)
        self.mode: str = mode
        self.staleness: int = self._check_staleness(mode, staleness)
        _check_choice("algorithm", algorithm, collectives.ALGORITHMS)
        self.algorithm: str = algorithm
        _check_choice("compression", compression, COMPRESSIONS)
        if compression is not None and algorithm not in _COMPRESSING_ALGORITHMS:
            raise ValueError(
                f"compression={compression!r} needs algorithm 'lp' or 'ring' (compression "
                f"happens inside their transfers), got algorithm={algorithm!r}; pass "
                "compression=None or choose algorithm='lp'"
            )
        self.compression: str | None = compression
        if (
            isinstance(bucket_mb, bool)
            or not isinstance(bucket_mb, (int, float))
            or not math.isfinite(bucket_mb)
            or bucket_mb <= 0
        ):
            raise ValueError(
                f"bucket_mb must be a positive finite number of MiB, got {bucket_mb!r}"
            )
        self.bucket_mb = float(bucket_mb)
        if block_bytes is not None and (
            isinstance(block_bytes, bool) or not isinstance(block_bytes, int) or block_bytes <= 0
        ):
            raise ValueError(f"block_bytes must be a positive int or None, got {block_bytes!r}")
        self.block_bytes = block_bytes
        if max_timings is not None and (
            isinstance(max_timings, bool) or not isinstance(max_timings, int) or max_timings < 0
        ):
            raise ValueError(f"max_timings must be a non-negative int or None, got {max_timings!r}")

        self.model = model
        self.optimizer = optimizer
        self.group = group
        self._members = self._resolve_group(group)
        self.world_size: int = len(self._members)
        self._params = self._select_params(model, optimizer, compression)
        cuda = [p.device for p in self._params if p.is_cuda]
        self._timing_device: torch.device | None = cuda[0] if cuda else None

        if self.world_size > 1:
            self._check_replicas()
            if broadcast_init:
                self._broadcast_state()

        n = len(self._params)
        if mode == "layerwise":
            cap = self.bucket_mb * 2**20
            self._units = _make_units(self._params, list(reversed(range(n))), cap)
        else:
            self._units = _make_units(self._params, list(range(n)), None)
        self._unit_of: list[tuple[int, int]] = [(0, 0)] * n  # param -> (unit, slot)
        for u, unit in enumerate(self._units):
            for s, i in enumerate(unit.indices):
                self._unit_of[i] = (u, s)

        self._codec = None
        if compression is not None and self.world_size > 1:
            from pipecomm import compress

            self._codec = _TimedCodec(compress.get_codec(compression))

        self.iteration: int = 0  # step() calls so far (t of the next step)
        self.updates: int = 0  # optimizer steps applied so far
        self._pending: collections.deque = collections.deque()  # _Launched / _Ready / local grads

        # layer-wise state of the iteration being computed
        self._hooks: list[Any] = []
        self._current: _Launched | None = None
        self._ready_count: list[int] = []
        self._next_launch = 0
        self._seen: list[bool] = []
        self._double_backward = False
        if mode == "layerwise" and self.world_size > 1:
            self._reset_layerwise()
            self._register_hooks()

        self.timings: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_timings)
        self.timing_totals: dict[str, float] = {}
        self.reset_timings()

    # ------------------------------------------------------------------ construction helpers

    @staticmethod
    def _check_staleness(mode: str, staleness: Any) -> int:
        if staleness is None:
            return 1 if mode == "pipe" else 0
        if isinstance(staleness, bool):
            raise TypeError(f"staleness must be an int or None, got {staleness!r}")
        try:
            k = operator.index(staleness)
        except TypeError:
            raise TypeError(
                f"staleness must be an int or None, got {type(staleness).__name__}"
            ) from None
        if k < 0:
            raise ValueError(f"staleness must be >= 0 (iterations of delay), got {k}")
        if mode != "pipe" and k != 0:
            raise ValueError(
                f"mode={mode!r} has zero staleness; got staleness={k}. Use mode='pipe' for "
                "delayed updates (staleness >= 1), or staleness=None/0"
            )
        return k

    @staticmethod
    def _resolve_group(group: Any) -> tuple[int, ...]:
        initialized = dist.is_available() and dist.is_initialized()
        if not initialized:
            if group is not None:
                raise ValueError(
                    "group was given but torch.distributed is not initialised; start ranks with "
                    "pipecomm.launch, or pass group=None for single-process training"
                )
            return (0,)
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(
                f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}"
            )
        if group is dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError("this rank is not a member of group; create PipeSGD on members only")
        members = tuple(dist.get_process_group_ranks(group or dist.group.WORLD))
        if dist.get_rank() not in members:
            raise ValueError(
                f"this rank ({dist.get_rank()}) is not a member of group {list(members)}; "
                "create PipeSGD on members only"
            )
        return members

    @staticmethod
    def _select_params(
        model: nn.Module, optimizer: torch.optim.Optimizer, compression: str | None
    ) -> list[nn.Parameter]:
        in_model = {id(p) for p in model.parameters()}
        in_opt = set()
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in in_model:
                    raise ValueError(
                        f"optimizer holds a parameter of shape {tuple(p.shape)} that is not a "
                        "parameter of model; build the optimizer from model.parameters()"
                    )
                in_opt.add(id(p))
        params = [p for p in model.parameters() if p.requires_grad and id(p) in in_opt]
        if not params:
            raise ValueError(
                "model has no trainable parameter that optimizer updates; nothing to train"
            )
        for p in params:
            if p.dtype not in _PARAM_DTYPES:
                what = "compression" if compression is not None else "PipeSGD"
                raise TypeError(
                    f"{what} needs floating-point parameters (float16, bfloat16, float32, "
                    f"float64); got a parameter of dtype {p.dtype} and shape {tuple(p.shape)}"
                )
            if p.layout != torch.strided:
                raise TypeError(f"parameters must be dense (strided), got layout {p.layout}")
        return params

    def _allreduce_sync(self, t: torch.Tensor, op: str) -> torch.Tensor:
        return collectives.allreduce(t, algorithm=self.algorithm, op=op, group=self.group)

    def _check_replicas(self) -> None:
        """All ranks must train the same architecture with the same settings (else hangs)."""
        device = self._params[0].device
        fingerprint = 17
        for p in self._params:
            for v in (p.numel(), p.dim(), _PARAM_DTYPES.index(p.dtype), *p.shape):
                fingerprint = (fingerprint * 1_000_003 + int(v) + 1) % (2**61 - 1)
        settings = (
            MODES.index(self.mode),
            self.staleness,
            collectives.ALGORITHMS.index(self.algorithm),
            COMPRESSIONS.index(self.compression),
            int(self.bucket_mb * 1024),
        )
        local = torch.tensor(
            [len(self._params), sum(p.numel() for p in self._params), fingerprint, *settings],
            dtype=torch.int64,
            device=device,
        )
        both = torch.cat([local, -local])
        self._allreduce_sync(both, "max")
        hi, lo = both[: local.numel()], -both[local.numel() :]
        if not torch.equal(hi, lo):
            names = [
                "parameter count",
                "parameter elements",
                "parameter shapes/dtypes",
                "mode",
                "staleness",
                "algorithm",
                "compression",
                "bucket_mb",
            ]
            bad = [nm for nm, a, b in zip(names, hi.tolist(), lo.tolist()) if a != b]
            raise ValueError(
                f"the ranks' PipeSGD replicas differ in {', '.join(bad)}; every rank must build "
                "the same model and pass the same PipeSGD arguments"
            )

    @torch.no_grad()
    def _broadcast_state(self) -> None:
        """Copy the first member's parameters and buffers to every rank (equal replicas)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors = [t for t in tensors if t.dtype in _BUFFER_DTYPES and t.numel() > 0]
        by_key: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            by_key.setdefault((t.device, t.dtype), []).append(t)
        for group in by_key.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            collectives.broadcast(
                flat, self._members[0], algorithm=self.algorithm, group=self.group
            )
            offset = 0
            for t in group:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    # ------------------------------------------------------------------ layer-wise hooks

    def _register_hooks(self) -> None:
        ref = weakref.ref(self)
        for i, p in enumerate(self._params):

            def hook(param: torch.Tensor, i: int = i) -> None:
                trainer = ref()
                if trainer is not None:
                    trainer._grad_ready(i, param)

            self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def _reset_layerwise(self) -> None:
        self._current = _Launched(len(self._units))
        self._ready_count = [0] * len(self._units)
        self._seen = [False] * len(self._params)
        self._next_launch = 0
        self._double_backward = False

    @torch.no_grad()
    def _grad_ready(self, i: int, param: torch.Tensor) -> None:
        """Backward hook: copy the gradient into its bucket; launch every complete bucket whose
        predecessors are launched (the same order on every rank)."""
        if self._seen[i]:
            self._double_backward = True  # reported by step(), after the launched reductions
            return
        self._seen[i] = True
        u, s = self._unit_of[i]
        unit = self._units[u]
        cur = self._current
        if cur.flats[u] is None:
            cur.flats[u] = torch.empty(unit.total, dtype=unit.dtype, device=unit.device)
        if param.grad is not None:
            cur.flats[u][unit.offsets[s] : unit.offsets[s] + unit.numels[s]].copy_(
                param.grad.reshape(-1)
            )
        else:
            cur.flats[u][unit.offsets[s] : unit.offsets[s] + unit.numels[s]].zero_()
        self._ready_count[u] += 1
        while self._next_launch < len(self._units) and self._ready_count[self._next_launch] == len(
            self._units[self._next_launch].indices
        ):
            self._launch(cur, self._next_launch, async_op=True, timed=False)
            self._next_launch += 1

    def remove_hooks(self) -> None:
        """Detach the backward hooks of ``"layerwise"`` (the trainer is unusable afterwards).

        Example::

            trainer.remove_hooks()     # before building another PipeSGD on the same model
        """
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.remove_hooks()

    # ------------------------------------------------------------------ packing and applying

    def _pack(self, unit: _Unit) -> torch.Tensor:
        """A new flat buffer holding the unit's gradients (zeros where a gradient is None)."""
        parts = []
        for i, n in zip(unit.indices, unit.numels):
            g = self._params[i].grad
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

    def _launch(self, entry: _Launched, u: int, *, async_op: bool, timed: bool = True) -> None:
        """Pack unit ``u`` (unless hooks did) and start its AllReduce; with ``timed``, packing and
        issuing count as ``launch_s`` and a synchronous reduction as ``comm_s``."""
        unit = self._units[u]
        start = time.perf_counter()
        if entry.flats[u] is None:
            entry.flats[u] = self._pack(unit)
        issued = time.perf_counter()
        entry.handles[u] = collectives.allreduce(
            entry.flats[u],
            algorithm=self.algorithm,
            op="avg",
            group=self.group,
            block_bytes=self.block_bytes,
            async_op=async_op,
            compression=self._codec,
        )
        if timed:
            if not async_op:
                self._settle()
            done = time.perf_counter()
            if async_op:
                self._rec["launch_s"] += done - start
            else:
                self._rec["launch_s"] += issued - start
                self._rec["comm_s"] += done - issued

    def _grads_of(self, entry: Any) -> list[torch.Tensor | None]:
        """Wait for ``entry``'s reductions (timed as communication); per-parameter gradients."""
        if isinstance(entry, _Ready):
            return entry.grads
        if isinstance(entry, list):  # world size 1: the local gradients themselves
            return entry
        grads: list[torch.Tensor | None] = [None] * len(self._params)
        for unit, flat, handle in zip(self._units, entry.flats, entry.handles):
            if handle is not None and not isinstance(handle, torch.Tensor):
                start = time.perf_counter()
                handle.wait()
                self._settle()
                self._rec["comm_s"] += time.perf_counter() - start
            for i, off, n in zip(unit.indices, unit.offsets, unit.numels):
                grads[i] = flat[off : off + n].view(self._params[i].shape)
        return grads

    def _apply(self, entry: Any) -> None:
        """Install ``entry``'s averaged gradients as ``p.grad`` and take the optimizer's step."""
        grads = self._grads_of(entry)
        start = time.perf_counter()
        for p, g in zip(self._params, grads):
            p.grad = g
        self.optimizer.step()
        self.updates += 1
        self._settle()
        self._rec["update_s"] += time.perf_counter() - start

    def _release_grads(self) -> None:
        for p in self._params:
            p.grad = None

    # ------------------------------------------------------------------ public API

    @property
    def in_flight(self) -> int:
        """Number of gradients launched but not yet applied (at most ``staleness`` after a step).

        Example::

            trainer.step(); assert trainer.in_flight == min(trainer.iteration, trainer.staleness)
        """
        return len(self._pending)

    def step(self) -> None:
        """End iteration t: launch the AllReduce of this gradient, apply the one of t - k.

        Example::

            model.zero_grad(); loss_fn(model(x), y).backward(); trainer.step()
        """
        self._settle()  # the backward of this iteration counts as compute
        entry_t = time.perf_counter()
        rec = self._new_record(entry_t)
        k = self.staleness
        with torch.no_grad():
            if self.world_size == 1:
                if k == 0:
                    self._apply([p.grad for p in self._params])
                else:
                    self._pending.append([p.grad for p in self._params])
                    if len(self._pending) > k:
                        self._apply(self._pending.popleft())
                    else:
                        self._release_grads()  # held back: p.grad must not be zeroed in place
            elif self.mode == "layerwise":
                cur = self._current
                start = time.perf_counter()
                for u in range(self._next_launch, len(self._units)):
                    if cur.flats[u] is not None:  # partly filled by hooks: add the missing ones
                        self._fill_missing(cur, u)
                    self._launch(cur, u, async_op=True, timed=False)
                self._next_launch = len(self._units)
                rec["launch_s"] += time.perf_counter() - start
                double = self._double_backward
                grads = self._grads_of(cur)  # waits for every bucket
                self._reset_layerwise()
                if double:
                    self._release_grads()
                    raise RuntimeError(
                        "mode='layerwise' saw a parameter's gradient accumulated twice before "
                        "step() (several backward passes per step); its bucket had already been "
                        "reduced. Use mode='sync' or 'pipe' for gradient accumulation."
                    )
                self._apply(_Ready(grads))
            else:
                entry = _Launched(len(self._units))
                for u in range(len(self._units)):
                    self._launch(entry, u, async_op=self.mode == "pipe")
                if self.mode == "sync":
                    self._apply(entry)
                else:
                    self._pending.append(entry)
                    if len(self._pending) > k:
                        self._apply(self._pending.popleft())
                    else:
                        self._release_grads()
        rec["updates"] = self.updates - self._updates_before
        rec["applied"] = rec["updates"] > 0
        self.iteration += 1
        self._close_record(rec)

    def _fill_missing(self, cur: _Launched, u: int) -> None:
        """Copy into bucket ``u`` the gradients whose hooks did not fire (zeros for None)."""
        unit = self._units[u]
        for s, i in enumerate(unit.indices):
            if not self._seen[i]:
                self._seen[i] = True
                g = self._params[i].grad
                dst = cur.flats[u][unit.offsets[s] : unit.offsets[s] + unit.numels[s]]
                if g is None:
                    dst.zero_()
                else:
                    dst.copy_(g.reshape(-1))

    def finish(self) -> None:
        """Wait for the reductions in flight and apply them in order (drains the pipeline).

        A later ``step()`` starts a new pipeline: its first k iterations apply nothing again.

        Example::

            for batch in batches: ...; trainer.step()
            trainer.finish()           # parameters now include every computed gradient
        """
        self._check_between_steps("finish")
        if not self._pending:
            return
        rec = self._new_record(time.perf_counter())
        rec["iteration"] = None
        with torch.no_grad():
            while self._pending:
                self._apply(self._pending.popleft())
        rec["updates"] = self.updates - self._updates_before
        rec["applied"] = rec["updates"] > 0
        self._close_record(rec)

    def _check_between_steps(self, what: str) -> None:
        if self.mode == "layerwise" and self.world_size > 1 and any(self._seen):
            raise RuntimeError(
                f"{what}() was called after backward launched layer-wise reductions but before "
                "step(); call step() first"
            )

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: step counters, the gradients in flight (averaged; waits
        for their reductions without applying them) and the optimizer's state (a deep copy).
        The model's own ``state_dict()`` is saved separately, as usual.

        Example::

            torch.save({"model": model.state_dict(), "trainer": trainer.state_dict()}, path)
        """
        self._check_between_steps("state_dict")
        in_flight = []
        self._rec = {"comm_s": 0.0, "update_s": 0.0}  # waiting here is not an iteration's time
        with torch.no_grad():
            for entry in self._pending:
                grads = self._grads_of(entry)
                in_flight.append([None if g is None else g.detach().clone() for g in grads])
        return {
            "mode": self.mode,
            "staleness": self.staleness,
            "iteration": self.iteration,
            "updates": self.updates,
            "param_shapes": [tuple(p.shape) for p in self._params],
            "in_flight": in_flight,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh trainer (same mode and staleness); loads the
        optimizer's state too. Load the model's parameters with ``model.load_state_dict``.

        Example::

            ckpt = torch.load(path)
            model.load_state_dict(ckpt["model"]); trainer.load_state_dict(ckpt["trainer"])
        """
        if not isinstance(state, dict):
            raise TypeError(
                f"state must be a dict from PipeSGD.state_dict(), got {type(state).__name__}"
            )
        missing = {
            "mode",
            "staleness",
            "iteration",
            "updates",
            "param_shapes",
            "in_flight",
            "optimizer",
        } - set(state)
        if missing:
            raise ValueError(f"state is missing {sorted(missing)}; pass PipeSGD.state_dict()")
        if state["mode"] != self.mode or state["staleness"] != self.staleness:
            raise ValueError(
                f"state was saved with mode={state['mode']!r}, staleness={state['staleness']}; "
                f"this trainer has mode={self.mode!r}, staleness={self.staleness}"
            )
        shapes = [tuple(p.shape) for p in self._params]
        if [tuple(s) for s in state["param_shapes"]] != shapes:
            raise ValueError("state was saved for a model with different parameter shapes")
        if len(state["in_flight"]) > self.staleness:
            raise ValueError(
                f"state holds {len(state['in_flight'])} gradients in flight, more than "
                f"staleness={self.staleness}"
            )
        if self._pending:
            raise RuntimeError(
                "load_state_dict needs a trainer with nothing in flight (a fresh one)"
            )
        self._check_between_steps("load_state_dict")
        self.optimizer.load_state_dict(state["optimizer"])
        for grads in state["in_flight"]:
            if len(grads) != len(self._params):
                raise ValueError("an in-flight gradient list does not match the parameters")
            own = [
                None if g is None else g.detach().to(device=p.device, dtype=p.dtype).clone()
                for p, g in zip(self._params, grads)
            ]
            self._pending.append(_Ready(own))
        self.iteration = int(state["iteration"])
        self.updates = int(state["updates"])

    # ------------------------------------------------------------------ timings

    def reset_timings(self) -> None:
        """Clear :attr:`timings` and :attr:`timing_totals`; the next compute phase starts now.

        Example::

            for _ in range(warmup): ...; trainer.step()
            trainer.reset_timings()      # measure from here
        """
        self.timings.clear()
        self.timing_totals = {k: 0.0 for k in TIMING_KEYS if k.endswith("_s")}
        self.timing_totals["iterations"] = 0
        self.timing_totals["updates"] = 0
        self._rec: dict[str, Any] = {"comm_s": 0.0, "update_s": 0.0}
        self._updates_before = self.updates
        self._mark = time.perf_counter()
        self._codec_mark = self._codec.seconds if self._codec is not None else 0.0

    def _settle(self) -> None:
        """Before reading the clock: wait for the GPU's queued work (nothing on the CPU)."""
        if self._timing_device is not None:
            bench.synchronize(self._timing_device)

    def _new_record(self, now: float) -> dict[str, Any]:
        self._updates_before = self.updates
        rec = {
            "iteration": self.iteration,
            "applied": False,
            "updates": 0,
            "compute_s": now - self._mark,
            "launch_s": 0.0,
            "comm_s": 0.0,
            "compress_s": 0.0,
            "update_s": 0.0,
            "iter_s": 0.0,
        }
        self._rec = rec
        return rec

    def _close_record(self, rec: dict[str, Any]) -> None:
        now = time.perf_counter()
        rec["iter_s"] = now - self._mark
        if self._codec is not None:
            seconds = self._codec.seconds
            rec["compress_s"] = seconds - self._codec_mark
            self._codec_mark = seconds
        self._mark = now
        self.timings.append(rec)
        totals = self.timing_totals
        for key in ("compute_s", "launch_s", "comm_s", "compress_s", "update_s", "iter_s"):
            totals[key] += rec[key]
        totals["iterations"] += rec["iteration"] is not None
        totals["updates"] += rec["updates"]

    def __repr__(self) -> str:
        return (
            f"PipeSGD(mode={self.mode!r}, staleness={self.staleness}, algorithm={self.algorithm!r}, "
            f"compression={self.compression!r}, world_size={self.world_size}, "
            f"iteration={self.iteration}, in_flight={self.in_flight})"
        )
