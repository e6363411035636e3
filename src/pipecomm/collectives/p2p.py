"""Point-to-point transport shared by every pipecomm collective.

One primitive, :func:`exchange`: post a set of sends and receives at once, return when all are
done. Batching keeps NCCL free of deadlocks (``batch_isend_irecv``) and is where the emulated
network (:mod:`pipecomm.netem`) applies its per-link deadlines.

Under emulation every message carries its delivery deadline (``CLOCK_MONOTONIC`` seconds, a
float64 reserved by the sender when it posts): a payload under 64 KiB travels as a uint8 copy
behind an 8-byte header, a larger one as the 8-byte header followed by the tensor itself (no copy;
both sides decide from the byte count, which they share). ``exchange`` returns when the real transfers are done *and* every deadline of its messages
(sends included: a send completes when it is delivered) has passed; the wait sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from pipecomm import netem

_HEADER = 8  # bytes: one float64 deadline in front of the payload
_FRAME_MAX = 64 * 1024  # payloads of this many bytes or more travel unframed, after the header


def _as_bytes(t: torch.Tensor, what: str, i: int) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}[{i}] must be a (tensor, peer) pair, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what}[{i}]: the tensor is not contiguous; pass t.contiguous()")
    return t.detach().reshape(-1).view(torch.uint8)


def _sleep_until(deadline: float) -> float:
    """Sleep (never spin) until ``deadline`` on the monotonic clock; return the time slept."""
    start = time.monotonic()
    now = start
    while now < deadline:
        time.sleep(deadline - now)
        now = time.monotonic()
    return now - start


def exchange(
    sends: Sequence[tuple[torch.Tensor, int]],
    recvs: Sequence[tuple[torch.Tensor, int]],
    group: dist.ProcessGroup | None = None,
) -> None:
    """Send each ``(tensor, dst)`` and receive into each ``(tensor, src)``; ranks are global.

    All operations are posted together and waited for together. Tensors must be contiguous.
    Under an emulated network (:func:`pipecomm.netem.current`), sends are reserved on the
    emulated ports in list order and the call returns no earlier than every message of the
    call has been delivered.

    Example::

        # rank 0 and rank 1 swap a block
        exchange([(mine, peer)], [(theirs, peer)])
    """
    emu = netem._emulator()
    if emu is None:
        for i, (t, _) in enumerate(sends):
            _as_bytes(t, "sends", i)
        for i, (t, _) in enumerate(recvs):
            _as_bytes(t, "recvs", i)
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        netem._record(
            sum(t.numel() * t.element_size() for t, _ in sends),
            len(sends),
            sum(t.numel() * t.element_size() for t, _ in recvs),
            len(recvs),
            0.0,
        )
        return
    _emulated_exchange(emu, sends, recvs, group)


def _emulated_exchange(emu, sends, recvs, group) -> None:
    payloads = [_as_bytes(t, "sends", i) for i, (t, _) in enumerate(sends)]
    targets = [_as_bytes(t, "recvs", i) for i, (t, _) in enumerate(recvs)]
    if not payloads and not targets:
        return
    # reserve first (the emulated clock starts at the post), then frame: copying is real cost
    deadlines = emu.post([(int(dst), p.numel()) for p, (_, dst) in zip(payloads, sends)])
    ops = []
    for p, (_, dst), deadline in zip(payloads, sends, deadlines):
        if p.numel() < _FRAME_MAX:  # one message: header + copy of the payload
            buf = torch.empty(_HEADER + p.numel(), dtype=torch.uint8, device=p.device)
            buf[_HEADER:].copy_(p)
            buf[:_HEADER].view(torch.float64)[0] = deadline
            ops.append(dist.P2POp(dist.isend, buf, dst, group))
        else:  # large: the header, then the payload itself (no copy)
            head = torch.tensor([deadline], dtype=torch.float64, device=p.device)
            ops.append(dist.P2POp(dist.isend, head, dst, group))
            ops.append(dist.P2POp(dist.isend, p, dst, group))
    heads = []
    for t, (_, src) in zip(targets, recvs):
        if t.numel() < _FRAME_MAX:
            buf = torch.empty(_HEADER + t.numel(), dtype=torch.uint8, device=t.device)
            ops.append(dist.P2POp(dist.irecv, buf, src, group))
            heads.append((buf, t))
        else:
            head = torch.empty(1, dtype=torch.float64, device=t.device)
            ops.append(dist.P2POp(dist.irecv, head, src, group))
            ops.append(dist.P2POp(dist.irecv, t, src, group))
            heads.append((head, None))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for buf, t in heads:
        if t is None:
            deadlines.append(float(buf[0]))
        else:
            deadlines.append(float(buf[:_HEADER].view(torch.float64)[0]))
            t.copy_(buf[_HEADER:])
    waited = _sleep_until(max(deadlines))
    netem._record(
        sum(p.numel() for p in payloads),
        len(payloads),
        sum(t.numel() for t in targets),
        len(targets),
        waited,
    )
