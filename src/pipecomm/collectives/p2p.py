"""Point-to-point transport shared by every pipecomm collective.

Two forms. :func:`exchange` posts a set of sends and receives at once and returns when all are
done (one lock-step step; batching keeps NCCL free of deadlocks). :func:`post_send` and
:func:`post_recv` post one message and return a :class:`Transfer` to wait for later: what the
progress engine (:mod:`pipecomm.collectives._engine`) builds on. Both pass every message through
the process's :class:`Interposer` (:func:`set_interposer`), if one is installed: an observer
counts what moved (:meth:`Interposer.on_done`); a delaying one (the lab's emulated network,
:mod:`pipecomm.lab.networks.netem`) also gives each message a delivery deadline (:meth:`Interposer.on_send`)
and waits for it (:meth:`Interposer.on_wait`), with the same rules on both paths (the
framing of the deadline: docs/network_model.md, "Where it is applied").

gloo moves host memory only: on a gloo group, CUDA tensors travel through host buffers (copied
to the host when a send is posted, into the device when a receive is waited). The emulated
network carries CPU tensors only (a delaying interposer refuses CUDA tensors).

A transfer that fails (the peer died and its connection closed, or nothing arrived within the
group's timeout) raises :class:`TransferError`, naming the operation and the peer's global rank.
"""

from __future__ import annotations

import time  # noqa: F401 - kept: tests swap p2p.time for a late-waking clock
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import observe

_HEADER = 8  # bytes: one float64 deadline in front of the payload
_FRAME_MAX = 64 * 1024  # payloads of this many bytes or more travel unframed, after the header


class TransferError(RuntimeError):
    """A point-to-point transfer failed: its peer died (the connection closed) or stalled past
    the group's timeout. ``op`` is ``"send"`` or ``"recv"``, ``peer`` the peer's global rank.

    Example::

        >>> err = TransferError.of("recv", 1, RuntimeError("Connection closed by peer"))
        >>> err.peer, str(err)
        (1, 'recv from rank 1 failed (rank 1 died or stalled): Connection closed by peer')
        >>> str(err.during("allreduce(lp)"))
        'allreduce(lp): recv from rank 1 failed (rank 1 died or stalled): Connection closed by peer'
    """

    def __init__(self, message: str, op: str, peer: int) -> None:
        super().__init__(message)
        self.op, self.peer = op, peer

    @classmethod
    def of(cls, op: str, peer: int, cause: BaseException) -> TransferError:
        """The error of ``op`` with global rank ``peer`` that the backend raised as ``cause``."""
        where = "to" if op == "send" else "from"
        return cls(f"{op} {where} rank {peer} failed (rank {peer} died or stalled): {cause}",
                   op, peer)

    def during(self, what: str) -> TransferError:
        """The same error, its message prefixed with the collective ``what`` it broke."""
        err = TransferError(f"{what}: {self}", self.op, self.peer)
        err.__cause__ = self
        return err


class Interposer:
    """What stands between pipecomm's messages and the backend (one per process,
    :func:`set_interposer`). This base observes only; a subclass with ``delays = True`` (the
    lab's emulated network) makes messages travel with delivery deadlines.

    ``on_send`` and ``on_wait`` are called only when ``delays``; ``on_done`` for every
    completed transfer (one posted message, or one :func:`exchange`), delaying or not.

    Example::

        >>> class Count(Interposer):
        ...     sent = 0
        ...     def on_done(self, bytes_sent, messages_sent, bytes_received, messages_received,
        ...                 waited_s):
        ...         self.sent += bytes_sent
        >>> set_interposer(Count()); interposer().describe()
        'Count'
        >>> set_interposer(None)
    """

    delays: bool = False

    def describe(self) -> str:
        """A short name for messages (the emulated network's description)."""
        return type(self).__name__

    def on_send(self, messages: Sequence[tuple[int, int]]) -> list[float]:
        """Reserve ``(global destination rank, nbytes)`` messages posted now, in order; return
        their delivery deadlines (``CLOCK_MONOTONIC`` seconds)."""
        raise NotImplementedError

    def on_wait(self, deadline: float) -> float:
        """Once a message's real transfer is done: sleep until its ``deadline``; return the
        seconds slept."""
        raise NotImplementedError

    def on_done(self, bytes_sent: int, messages_sent: int, bytes_received: int,
                messages_received: int, waited_s: float) -> None:
        """Count one completed transfer (``waited_s``: seconds slept for its deadlines)."""


_INTERPOSER: Interposer | None = None
_DELAY: Interposer | None = None  # _INTERPOSER when it delays: what the per-message paths test


def set_interposer(obj: Interposer | None) -> None:
    """Install ``obj`` as this process's :class:`Interposer` (``None``: none, the real backend
    untouched).

    Example::

        >>> set_interposer(None); interposer() is None
        True
    """
    global _INTERPOSER, _DELAY
    if obj is not None and not isinstance(obj, Interposer):
        raise TypeError(f"set_interposer: expected an Interposer or None, got {type(obj).__name__}")
    _INTERPOSER, _DELAY = obj, (obj if obj is not None and obj.delays else None)


def interposer() -> Interposer | None:
    """This process's :class:`Interposer`, or ``None``."""
    return _INTERPOSER


def delaying() -> Interposer | None:
    """The installed :class:`Interposer` if it delays messages (an emulated network), else
    ``None``."""
    return _DELAY


def _done(sent: int, nsent: int, received: int, nreceived: int, waited: float) -> None:
    if _INTERPOSER is not None:
        _INTERPOSER.on_done(sent, nsent, received, nreceived, waited)


def wait_all(works: Sequence[Any], ops: Sequence[tuple[str, int]],
             entries: Sequence[list | None] = ()) -> None:
    """Wait for each backend work, posted as ``ops[i] = ("send" | "recv", global rank)``, with
    its flight recorder entry ``entries[i]`` (:func:`pipecomm.observe.posted`), as
    :func:`wait_message` waits for one message.

    Example::

        works = [pg.recv([buf], 1, tag), pg.send([mine], 1, tag)]
        wait_all(works, [("recv", 1), ("send", 1)])
    """
    entries = list(entries) or [None] * len(ops)
    for work, (op, peer), entry in zip(works, ops, entries):
        wait_message([work], op, peer, entry)


def wait_message(works: Sequence[Any], op: str, peer: int, entry: list | None) -> None:
    """Wait for the backend ``works`` of one message (``op`` with global rank ``peer``), its
    flight recorder ``entry`` stamped waited, then completed; a failure is a :class:`TransferError`.

    Example::

        wait_message([pg.recv([buf], 1, tag)], "recv", 1, observe.posted("recv", 1, buf.nbytes))
    """
    observe.stamp(entry, "waited")
    for work in works:
        try:
            work.wait()
        except RuntimeError as exc:
            raise TransferError.of(op, peer, exc) from exc
    observe.stamp(entry, "completed")


def _post_batch(ops: list, names: list[tuple[str, int]]) -> None:
    """Post ``ops`` (``dist.P2POp``) together, each recorded by the flight recorder, and wait."""
    entries = [observe.posted(op, peer, o.tensor.nbytes) for o, (op, peer) in zip(ops, names)]
    wait_all(dist.batch_isend_irecv(ops), names, entries)


def _check(t: torch.Tensor, what: str, i: int) -> torch.Tensor:
    """``t`` itself, once it is a contiguous tensor (the error names the argument)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{what}[{i}] must be a (tensor, peer) pair, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{what}[{i}]: the tensor is not contiguous; pass t.contiguous()")
    return t


def _as_bytes(t: torch.Tensor, what: str, i: int) -> torch.Tensor:
    return _check(t, what, i).detach().reshape(-1).view(torch.uint8)


def _backend_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backend's ``send`` / ``recv`` take it: outside autograd, complex numbers as
    (real, imaginary) pairs (what ``dist.isend`` does)."""
    if t.requires_grad:
        t = t.detach()
    return torch.view_as_real(t) if t.is_complex() else t


def _staged(t: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """Whether ``t`` must travel through host memory: a CUDA tensor on a gloo group."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _process_group(group: dist.ProcessGroup | None, peer: int) -> tuple[dist.ProcessGroup, int]:
    """``group`` (``None``: the default group) and global rank ``peer``'s rank in it: what
    ``dist.isend`` / ``dist.irecv`` resolve, without their per-call checks."""
    pg = dist.group.WORLD if group is None else group
    return pg, (peer if pg is dist.group.WORLD else dist.get_group_rank(pg, peer))


def _no_cuda_under_emulation(tensors: Sequence[torch.Tensor]) -> None:
    if any(t.is_cuda for t in tensors):
        raise ValueError(f"the emulated network ({_DELAY.describe()}) carries CPU tensors only; "
                         "got a CUDA tensor (move it to the CPU, or leave the network unemulated)")


def _sleep_until(deadline: float) -> float:
    """Sleep until ``deadline`` through the delaying interposer (:meth:`Interposer.on_wait`,
    which also settles the emulated rank's virtual clock); return the time slept."""
    return _DELAY.on_wait(deadline)


def exchange(sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]],
             group: dist.ProcessGroup | None = None) -> None:
    """Send each ``(tensor, dst)`` and receive into each ``(tensor, src)``; ranks are global.

    All operations are posted together and waited for together. Tensors must be contiguous.
    Under a delaying :class:`Interposer` the call returns once every message is delivered.

    Example::

        # rank 0 and rank 1 swap a block
        exchange([(mine, peer)], [(theirs, peer)])
    """
    emu = _DELAY
    if emu is None:
        for i, (t, _) in enumerate(sends):
            _as_bytes(t, "sends", i)
        for i, (t, _) in enumerate(recvs):
            _as_bytes(t, "recvs", i)
        host_sends = [(t.to("cpu") if _staged(t, group) else t, peer) for t, peer in sends]
        host_recvs = [(torch.empty_like(t, device="cpu") if _staged(t, group) else t, peer)
                      for t, peer in recvs]
        ops = [dist.P2POp(dist.isend, t, peer, group) for t, peer in host_sends]
        ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in host_recvs]
        if not ops:
            return
        names = [("send", peer) for _, peer in sends] + [("recv", peer) for _, peer in recvs]
        _post_batch(ops, names)
        for (t, _), (h, _) in zip(recvs, host_recvs):
            if h is not t:
                t.copy_(h)
        _done(sum(t.numel() * t.element_size() for t, _ in sends), len(sends),
              sum(t.numel() * t.element_size() for t, _ in recvs), len(recvs), 0.0)
        return
    _emulated_exchange(emu, sends, recvs, group)


def _framed(payload: torch.Tensor, deadline: float) -> list[torch.Tensor]:
    """What carries ``payload`` (bytes) and its deadline: one framed copy below
    :data:`_FRAME_MAX` bytes, else the 8-byte header followed by the payload itself."""
    if payload.numel() < _FRAME_MAX:
        buf = torch.empty(_HEADER + payload.numel(), dtype=torch.uint8, device=payload.device)
        buf[_HEADER:].copy_(payload)
        buf[:_HEADER].view(torch.float64)[0] = deadline
        return [buf]
    return [torch.tensor([deadline], dtype=torch.float64, device=payload.device), payload]


def _landing(target: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, Any]:
    """Where a message into ``target`` (bytes) lands: the buffers to receive into, the one
    holding the header, and ``target`` where the payload is framed (copied out by
    :func:`_unframe`), else ``None``."""
    if target.numel() < _FRAME_MAX:
        buf = torch.empty(_HEADER + target.numel(), dtype=torch.uint8, device=target.device)
        return [buf], buf, target
    head = torch.empty(1, dtype=torch.float64, device=target.device)
    return [head, target], head, None


def _unframe(head: torch.Tensor, target: torch.Tensor | None) -> float:
    """A received message's deadline (a framed payload copied into ``target``)."""
    if target is None:
        return float(head[0])
    target.copy_(head[_HEADER:])
    return float(head[:_HEADER].view(torch.float64)[0])


def _emulated_exchange(emu, sends, recvs, group) -> None:
    payloads = [_as_bytes(t, "sends", i) for i, (t, _) in enumerate(sends)]
    targets = [_as_bytes(t, "recvs", i) for i, (t, _) in enumerate(recvs)]
    _no_cuda_under_emulation([*payloads, *targets])
    if not payloads and not targets:
        return
    # reserve first (the emulated clock starts at the post), then frame: copying is real cost
    deadlines = emu.on_send([(int(dst), p.numel()) for p, (_, dst) in zip(payloads, sends)])
    ops, names, heads = [], [], []
    for p, (_, dst), deadline in zip(payloads, sends, deadlines):
        for buf in _framed(p, deadline):
            ops.append(dist.P2POp(dist.isend, buf, dst, group))
            names.append(("send", dst))
    for t, (_, src) in zip(targets, recvs):
        bufs, head, framed = _landing(t)
        heads.append((head, framed))
        for buf in bufs:
            ops.append(dist.P2POp(dist.irecv, buf, src, group))
            names.append(("recv", src))
    _post_batch(ops, names)
    deadlines += [_unframe(head, framed) for head, framed in heads]
    waited = _sleep_until(max(deadlines))
    _done(sum(p.numel() for p in payloads), len(payloads), sum(t.numel() for t in targets),
          len(targets), waited)


# --------------------------------------------------------------------------- one message at a time


class Transfer:
    """One posted message: :meth:`wait` returns when it is complete.

    Complete means: the backend's operations are done and, under emulation, the message's
    delivery deadline has passed. Later waits return at once. A failed transfer raises
    :class:`TransferError` naming ``op`` and ``peer``.

    Example::

        t = post_recv(buf, src=0)
        ...                      # other work while the message travels
        t.wait()
    """

    __slots__ = ("_works", "_deadline", "_head", "_target", "_sent", "_received", "_done",
                 "_staged", "_op", "_peer", "_entry")

    def __init__(self, works, deadline=None, head=None, target=None, sent=0, received=0,
                 staged=None, op="recv", peer=-1) -> None:
        self._works = works
        self._op, self._peer = op, peer  # what a failure names: "send"/"recv", global rank
        self._staged = staged  # (host buffer, device tensor): gloo and CUDA, copied on wait
        self._deadline = deadline
        self._head = head  # receive under emulation: where the deadline arrives
        self._target = target  # framed receive: the payload is copied out of ``head``
        self._sent, self._received = sent, received
        self._done = False
        self._entry = observe.posted(op, peer, sent or received)  # the flight recorder's

    def wait(self) -> None:
        """Block until the message is complete (see the class docstring)."""
        if self._done:
            return
        wait_message(self._works, self._op, self._peer, self._entry)
        self._done = True
        if self._staged is not None and self._staged[1] is not None:
            host, device_tensor = self._staged
            device_tensor.copy_(host)
        deadline, waited = self._deadline, 0.0
        if self._head is not None:
            deadline = _unframe(self._head, self._target)
        if deadline is not None:
            waited = _sleep_until(deadline)
        _done(self._sent, int(self._sent > 0), self._received, int(self._received > 0), waited)


def post_send(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None,
              tag: int = 0) -> Transfer:
    """Post the send of a contiguous tensor to global rank ``dst`` now; wait on the result.

    The tensor must not change until the transfer has been waited. Messages between two ranks
    with the same group and ``tag`` arrive in the order they were posted.

    Example::

        pending = post_send(block, dst=1)
        ...
        pending.wait()           # before block is written again
    """
    emu = _DELAY
    if emu is None:  # straight to the process group: no byte view, no dist.isend per message
        sent = _check(t, "sends", 0).numel() * t.element_size()
        pg, peer = _process_group(group, dst)
        try:
            if _staged(t, group):  # the host copy is taken now: the tensor may change after
                host = t.detach().to("cpu")
                return Transfer([pg.send([_backend_view(host)], peer, tag)], sent=sent,
                                staged=(host, None), op="send", peer=dst)
            return Transfer([pg.send([_backend_view(t)], peer, tag)], sent=sent, op="send",
                            peer=dst)
        except RuntimeError as exc:
            raise TransferError.of("send", dst, exc) from exc
    payload = _as_bytes(t, "sends", 0)
    _no_cuda_under_emulation([t])
    (deadline,) = emu.on_send([(int(dst), payload.numel())])
    works = [dist.isend(buf, dst, group, tag) for buf in _framed(payload, deadline)]
    return Transfer(works, deadline=deadline, sent=payload.numel(), op="send", peer=dst)


def post_recv(t: torch.Tensor, src: int, group: dist.ProcessGroup | None = None,
              tag: int = 0) -> Transfer:
    """Post the receive of global rank ``src``'s next message into a contiguous tensor.

    The tensor holds the message once the transfer has been waited (under emulation, no earlier
    than the deadline the sender shipped).

    Example::

        pending = post_recv(buf, src=0)
        pending.wait()           # buf now holds the message
    """
    if _DELAY is None:  # straight to the process group, as post_send
        received = _check(t, "recvs", 0).numel() * t.element_size()
        pg, peer = _process_group(group, src)
        try:
            if _staged(t, group):
                host = torch.empty_like(t, device="cpu")
                return Transfer([pg.recv([_backend_view(host)], peer, tag)], received=received,
                                staged=(host, t.detach()), peer=src)
            return Transfer([pg.recv([_backend_view(t)], peer, tag)], received=received, peer=src)
        except RuntimeError as exc:
            raise TransferError.of("recv", src, exc) from exc
    target = _as_bytes(t, "recvs", 0)
    _no_cuda_under_emulation([t])
    bufs, head, framed = _landing(target)
    return Transfer([dist.irecv(buf, src, group, tag) for buf in bufs], head=head, target=framed,
                    received=target.numel(), peer=src)


# --------------------------------------------------------------------------- one stream, directly


class Direct:
    """Posts of one direction to one peer straight to the process group (see :func:`direct`).

    Each call posts one message and returns its :class:`Posted`; bytes and messages are
    recorded once by :meth:`record`. ``peer`` is the rank in ``pg``, ``rank`` the global rank a
    :class:`TransferError` names (default ``peer``).

    Example::

        send = Direct(pg, peer, tag, send=True)
        works = [send(a), send(b)]
        for w in works:
            w.wait()
        send.record()
    """

    __slots__ = ("_post", "_peer", "_tag", "_send", "nbytes", "count", "rank")

    def __init__(self, pg: dist.ProcessGroup, peer: int, tag: int, send: bool,
                 rank: int | None = None) -> None:
        self._post = pg.send if send else pg.recv
        self._peer, self._tag, self._send = peer, tag, send
        self.rank = peer if rank is None else rank
        self.nbytes = self.count = 0

    def __call__(self, t: torch.Tensor) -> Posted:
        self.nbytes += t.nbytes
        self.count += 1
        try:
            return Posted(self._post([t], self._peer, self._tag), self,
                          observe.posted("send" if self._send else "recv", self.rank, t.nbytes))
        except RuntimeError as exc:
            raise self.failed(exc) from exc

    def failed(self, cause: BaseException) -> TransferError:
        """The :class:`TransferError` of one of these messages that the backend raised as
        ``cause``."""
        return TransferError.of("send" if self._send else "recv", self.rank, cause)

    def record(self) -> None:
        """Count the posted messages (:meth:`Interposer.on_done`; once, after the waits)."""
        if self._send:
            _done(self.nbytes, self.count, 0, 0, 0.0)
        else:
            _done(0, 0, self.nbytes, self.count, 0.0)
        self.nbytes = self.count = 0


class Posted:
    """One message of a :class:`Direct` poster: the backend's work, whose failure
    :meth:`wait` raises as a :class:`TransferError` naming the peer."""

    __slots__ = ("_work", "_direct", "_entry")

    def __init__(self, work: Any, direct: Direct, entry: list | None = None) -> None:
        self._work, self._direct, self._entry = work, direct, entry  # entry: the flight recorder's

    def wait(self) -> bool:
        """Block until the backend is done with the message."""
        observe.stamp(self._entry, "waited")
        try:
            done = self._work.wait()
        except RuntimeError as exc:
            raise self._direct.failed(exc) from exc
        observe.stamp(self._entry, "completed")
        return done


def direct(like: torch.Tensor, peer: int, group: dist.ProcessGroup | None, tag: int,
           send: bool) -> Direct | None:
    """A :class:`Direct` poster to global rank ``peer`` for tensors like ``like`` (its dtype and
    device), or ``None`` where a message needs more than the backend's own send (an emulated
    network, a host copy of a CUDA tensor on gloo, complex numbers, autograd)."""
    if (_DELAY is not None or _staged(like, group) or like.is_complex()
            or like.requires_grad):
        return None
    pg, rank = _process_group(group, peer)
    return Direct(pg, rank, tag, send, rank=peer)
