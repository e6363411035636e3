"""Opt-in per-iteration timings of PipeSGD: compute, launch, communication, compression, update.

One concept: the instrumentation behind ``PipeSGD(..., timing=True)`` (the breakdown of an
iteration, Li et al., NeurIPS 2018). Without it PipeSGD uses :class:`NullTimer`: no timer and no
CUDA synchronisation in the training loop. With it, every timing point on CUDA parameters first
synchronises the device, so the records measure GPU work rather than kernel launches.

Example::

    >>> timer = StepTimer(max_records=100, device=None)
    >>> timer.open(iteration=0)
    >>> start = timer.clock()   # ... communicate ...
    >>> timer.add("comm_s", timer.clock() - start)
    >>> timer.close(updates=1)
    >>> timer.records[-1]["comm_s"] >= 0
    True
"""

from __future__ import annotations

import collections
import time
from typing import Any

import torch

__all__ = ["TIMING_KEYS", "NullTimer", "StepTimer", "TimedCodec", "synchronize"]


def synchronize(device: Any) -> None:
    """Wait for ``device``'s queued kernels when it is a GPU (CUDA kernels run asynchronously, so
    a host clock read without this measures launches, not work); nothing for the CPU or None.

    Example::

        >>> import time
        >>> synchronize("cpu"); t0 = time.perf_counter()
    """
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)

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
_SUMMED = ("compute_s", "launch_s", "comm_s", "compress_s", "update_s", "iter_s")


class TimedCodec:
    """Wraps a :mod:`pipecomm.compress` codec and adds up the seconds spent encoding/decoding.

    Host-side time: on CUDA the kernels are asynchronous and only their launch is counted.

    Example::

        >>> import pipecomm.compress
        >>> codec = TimedCodec(pipecomm.compress.get_codec("fp16")); codec.seconds
        0.0
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
        return f"TimedCodec({self._codec!r})"


class NullTimer:
    """The timer of ``timing=False``: reads no clock, synchronises nothing, keeps no record.

    Example::

        >>> NullTimer().clock()
        0.0
    """

    enabled = False

    def clock(self) -> float:
        return 0.0

    settled = clock

    def open(self, iteration: int | None) -> None:
        pass

    def add(self, key: str, seconds: float) -> None:
        pass

    def close(self, updates: int) -> None:
        pass

    def reset(self) -> None:
        pass


class StepTimer:
    """Per-iteration records (:data:`TIMING_KEYS`) and their running sums.

    ``open`` starts a record (its ``compute_s`` is the time since the previous record closed),
    ``add`` adds seconds to one of its keys (dropped while no record is open), ``close`` ends it.

    Example::

        >>> timer = StepTimer(max_records=None, device=None)
        >>> timer.open(0); timer.add("launch_s", 0.5); timer.close(updates=0)
        >>> timer.totals["launch_s"]
        0.5
    """

    enabled = True

    def __init__(
        self, max_records: int | None, device: torch.device | None, codec: TimedCodec | None = None
    ) -> None:
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_records)
        self.totals: dict[str, float] = {}
        self._device = device
        self._codec = codec
        self._rec: dict[str, Any] | None = None
        self.reset()

    def clock(self) -> float:
        """The host clock, without waiting for the GPU."""
        return time.perf_counter()

    def settled(self) -> float:
        """The host clock after the GPU's queued work (nothing to wait for on the CPU)."""
        synchronize(self._device)
        return time.perf_counter()

    def reset(self) -> None:
        """Clear the records and sums; the next compute phase starts now."""
        self.records.clear()
        self.totals = {k: 0.0 for k in TIMING_KEYS if k.endswith("_s")}
        self.totals["iterations"] = 0
        self.totals["updates"] = 0
        self._rec = None
        self._mark = time.perf_counter()
        self._codec_mark = self._codec.seconds if self._codec is not None else 0.0

    def open(self, iteration: int | None) -> None:
        now = self.settled()
        self._rec = dict.fromkeys(_SUMMED, 0.0)
        self._rec.update(iteration=iteration, applied=False, updates=0)
        self._rec["compute_s"] = now - self._mark

    def add(self, key: str, seconds: float) -> None:
        if self._rec is not None:
            self._rec[key] += seconds

    def close(self, updates: int) -> None:
        rec, self._rec = self._rec, None
        now = time.perf_counter()
        rec["updates"] = updates
        rec["applied"] = updates > 0
        rec["iter_s"] = now - self._mark
        if self._codec is not None:
            seconds = self._codec.seconds
            rec["compress_s"] = seconds - self._codec_mark
            self._codec_mark = seconds
        self._mark = now
        self.records.append({k: rec[k] for k in TIMING_KEYS})
        for key in _SUMMED:
            self.totals[key] += rec[key]
        self.totals["iterations"] += rec["iteration"] is not None
        self.totals["updates"] += updates
