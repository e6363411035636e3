"""CUDA stream ordering of the communication thread: its own stream, events against the caller's.

Pipe-SGD (Li et al., NeurIPS 2018) overlaps the AllReduce of one step with the computation of the
next; on a GPU the communication's kernels run on a stream of their own, ordered by events
(docs/algorithms.md, "The communication thread: GIL switch interval and one connection per
direction"). CPU tensors need none of this: :func:`order_for` returns ``None`` and the job runs as it is (the
CPU fallback). The ``cuda`` argument exists so the ordering logic can be checked without a GPU
(a stand-in module with ``Stream``, ``Event``, ``current_stream``, ``stream`` and ``device``).

Example::

    order = order_for(tensor)            # None on the CPU
    ready = order.submitted(tensor)      # caller's thread
    done = order.run(job, ready)         # communication thread
    order.waited(done)                   # caller's thread, in Handle.wait()
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class CudaOrder:
    """Event ordering between the caller's stream and one communication stream per device.

    Example::

        order = CudaOrder(torch.device("cuda", 0))
        done = order.run(job, order.submitted(t))
        order.waited(done)
    """

    _streams: dict[tuple[int, Any], Any] = {}
    _lock = threading.Lock()

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        self.cuda = torch.cuda if cuda is None else cuda
        self.device = device
        key = (id(self.cuda), device)
        with CudaOrder._lock:
            if key not in CudaOrder._streams:
                CudaOrder._streams[key] = self.cuda.Stream(device=device)
        self.stream = CudaOrder._streams[key]

    def submitted(self, tensor: torch.Tensor) -> Any:
        """Caller's thread, at submission: the event after which ``tensor`` is ready."""
        ready = self.cuda.Event()
        ready.record(self.cuda.current_stream(self.device))
        tensor.record_stream(self.stream)
        return ready

    def run(self, fn: Callable[[], Any], ready: Any) -> Any:
        """Communication thread: run ``fn`` on the communication stream after ``ready``;
        return the event that marks its end on that stream."""
        with self.cuda.device(self.device), self.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            fn()
            done = self.cuda.Event()
            done.record(self.stream)
        return done

    def waited(self, done: Any) -> None:
        """Caller's thread, in ``wait()``: order the caller's current stream after ``done``."""
        self.cuda.current_stream(self.device).wait_event(done)


def order_for(tensor: torch.Tensor, cuda: Any = None) -> CudaOrder | None:
    """The stream ordering a job on ``tensor`` needs: a :class:`CudaOrder` for a CUDA tensor,
    ``None`` (run as it is) for a CPU tensor.

    Example::

        >>> order_for(torch.zeros(3)) is None   # a CPU tensor needs no ordering
        True
    """
    if tensor.device.type != "cuda":
        return None
    return CudaOrder(tensor.device, cuda)
