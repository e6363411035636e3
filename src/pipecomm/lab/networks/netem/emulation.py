"""The emulated network in the ranks: the launcher's contract, each rank's virtual clock, counters.

The port table of :class:`pipecomm.lab.networks.netem.schedule.LinkSchedule` lives in shared memory and is
guarded by one cross-process lock (:func:`setup` in the parent, :func:`activate` in each rank,
:func:`teardown` at the end); it is single-host only (all ranks read CLOCK_MONOTONIC). A rank
posts at its *emulated* time (:class:`VirtualClock`, :func:`clock`), waits for deadlines with
:func:`wait_until` and counts what it moved (:func:`stats`). The virtual clock is explained in
the docstring of :mod:`pipecomm.lab.networks.netem`.

Example::

    >>> from pipecomm.lab.networks import netem
    >>> net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6)
    >>> handle = netem.setup(net, 1, None)     # launch.Ranks does this, then activate in each rank
    >>> netem.activate(net, handle, rank=0, world_size=1, ranks_per_node=None)
    >>> netem.current() == net
    True
    >>> netem.deactivate(); netem.teardown(handle)
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pipecomm.collectives import lp, p2p
from pipecomm.lab.networks.netem.network import Network
from pipecomm.lab.networks.netem.schedule import LinkSchedule

__all__ = [
    "MAX_LAG_S",
    "VirtualClock",
    "activate",
    "clock",
    "current",
    "deactivate",
    "emulator",
    "record",
    "reset_stats",
    "setup",
    "stats",
    "teardown",
    "wait_until",
]

_LOCK_TIMEOUT_S = 60.0
MAX_LAG_S = 0.02  # most lateness a rank is forgiven; the port table keeps this much past


@dataclass
class _Handle:
    """What the parent hands to every rank: the shared table, its lock and its layout."""

    network: Network
    world_size: int
    ranks_per_node: int | None
    lock: Any
    table: Any  # multiprocessing RawArray of float64


class _Counter(p2p.Interposer):
    """What this process installs in :mod:`pipecomm.collectives.p2p` while nothing is emulated:
    it only counts (:func:`stats`)."""

    def on_done(self, bytes_sent: int, messages_sent: int, bytes_received: int,
                messages_received: int, waited_s: float) -> None:
        record(bytes_sent, messages_sent, bytes_received, messages_received, waited_s)


class _Emulator(_Counter):
    """The active network of this process: the delaying :class:`pipecomm.collectives.p2p.Interposer`
    that :func:`activate` installs (deadlines from the shared port table, waits through
    :func:`wait_until`, counts through :func:`record`)."""

    delays = True

    def __init__(self, network: Network, handle: _Handle, rank: int) -> None:
        self.rank = rank
        self.schedule = LinkSchedule(network, handle.world_size, handle.ranks_per_node)
        # the network as emulated: ranks_per_node resolved from the launcher
        self.network = dataclasses.replace(network, ranks_per_node=self.schedule.ranks_per_node)
        self.table = np.frombuffer(handle.table, dtype=np.float64)
        if self.table.size != self.schedule.table_size:
            raise RuntimeError("netem: the shared port table does not match the network layout")
        self.lock = handle.lock
        self.clock = VirtualClock()

    def describe(self) -> str:
        return self.network.describe()

    def on_wait(self, deadline: float) -> float:
        return wait_until(deadline)

    def on_send(self, messages: list[tuple[int, int]]) -> list[float]:
        """Reserve ``(dst, nbytes)`` messages sent by this rank, in order, at the rank's
        emulated time (:class:`VirtualClock`); return their deadlines."""
        if not messages:
            return []
        if not self.lock.acquire(timeout=_LOCK_TIMEOUT_S):
            raise RuntimeError(
                f"netem: the shared port table stayed locked for {_LOCK_TIMEOUT_S:.0f} s; a rank "
                "probably died while holding it - restart the ranks"
            )
        try:
            wall = time.monotonic()
            now = self.clock.now(wall)
            return [
                self.schedule.post(self.table, self.rank, dst, n, now, wall - MAX_LAG_S)
                for dst, n in messages
            ]
        finally:
            self.lock.release()


class VirtualClock:
    """A rank's emulated time: ``CLOCK_MONOTONIC`` minus the wake-up lateness it is forgiven.

    :meth:`settle` is called after every wait for a deadline. With ``t0`` the time the real
    transfers were done and ``W`` the wake-up (``W = t0`` when no sleep was needed), the wait
    ends at emulated time ``E = max(deadline, t0 - lag)`` and the lag becomes ``W - E``
    (capped at ``MAX_LAG_S``): a late wake-up is forgiven, a wait without sleep only shrinks
    the lag, and the rank's own work between waits counts in full.

    Example::

        >>> vc = VirtualClock()
        >>> vc.settle(deadline=1.000, t0=0.990, woke=1.003)   # woke 3 ms late
        1.0
        >>> round(vc.now(1.004), 6)   # posts as if woken on time
        1.001
    """

    def __init__(self) -> None:
        self.lag = 0.0
        self.oversleep = 0.0  # total of W - deadline over sleeps, for stats()
        self._lock = threading.Lock()

    def now(self, wall: float | None = None) -> float:
        """Emulated time at wall-clock time ``wall`` (default: now).

        Example::

            >>> VirtualClock().now(5.0)
            5.0
        """
        return (time.monotonic() if wall is None else wall) - self.lag

    def settle(self, deadline: float, t0: float, woke: float) -> float:
        """Account for one wait (see the class docstring); return its emulated end ``E``.

        Example::

            >>> VirtualClock().settle(1.0, 0.5, 1.002)   # lag 2 ms
            1.0
        """
        with self._lock:
            end = max(deadline, t0 - self.lag)
            self.lag = min(max(0.0, woke - end), MAX_LAG_S)
            if woke > t0:
                self.oversleep += max(0.0, woke - deadline)
            return end


_ACTIVE: _Emulator | None = None
_LINK_BEFORE = lp.DEFAULT_LINK  # LP's link before activate(), restored by deactivate()
_STATS_LOCK = threading.Lock()
_STATS: dict[str, float] = {}


def setup(network: Network, world_size: int, ranks_per_node: int | None) -> _Handle:
    """Create the shared port table of ``network`` (in the parent, before ranks start).

    The handle is passed to each rank as a ``multiprocessing`` process argument (launch's
    forkserver or spawn start method).

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6)
        >>> handle = netem.setup(net, 4, None)     # launch.Ranks does this
        >>> netem.teardown(handle)
    """
    if not isinstance(network, Network):
        raise ValueError(f"network must be a pipecomm.lab.networks.netem.Network, got {network!r}")
    sched = LinkSchedule(network, world_size, ranks_per_node)
    ctx = mp.get_context("spawn")
    return _Handle(
        network=network,
        world_size=world_size,
        ranks_per_node=sched.ranks_per_node,
        lock=ctx.Lock(),
        table=ctx.RawArray("d", sched.table_size),
    )


def activate(
    network: Network, handle: _Handle, *, rank: int, world_size: int, ranks_per_node: int | None
) -> None:
    """Make ``network`` this rank's network (in each rank, after ``init_process_group``).

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6)
        >>> handle = netem.setup(net, 4, None)
        >>> netem.activate(net, handle, rank=0, world_size=4, ranks_per_node=None)  # launch does it
        >>> netem.emulator() is not None
        True
        >>> netem.deactivate(); netem.teardown(handle)
    """
    global _ACTIVE
    if not isinstance(network, Network):
        raise ValueError(f"network must be a pipecomm.lab.networks.netem.Network, got {network!r}")
    if not isinstance(handle, _Handle) or handle.network != network:
        raise ValueError("handle must come from netem.setup() with the same network")
    if handle.world_size != world_size:
        raise ValueError(f"world_size={world_size} differs from the handle's {handle.world_size}")
    expected_rpn = network.ranks_per_node if network.ranks_per_node is not None else ranks_per_node
    if expected_rpn != handle.ranks_per_node:
        raise ValueError(
            f"ranks_per_node={ranks_per_node!r} differs from the one given to netem.setup() "
            f"({handle.ranks_per_node!r})"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, {world_size})")
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        raise ValueError(
            "the emulated network is refused with NCCL (it emulates CPU links only); use "
            "backend='gloo' or network=None"
        )
    global _LINK_BEFORE
    if _ACTIVE is None:
        _LINK_BEFORE = lp.link()
    _ACTIVE = _Emulator(network, handle, rank)
    p2p.set_interposer(_ACTIVE)
    lp.set_link(_ACTIVE.network.alpha_s, _ACTIVE.network.bandwidth_Bps)  # LP's default blocks
    reset_stats()


def deactivate() -> None:
    """Stop emulating in this process (transfers use the real backend again).

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> netem.deactivate(); assert netem.current() is None
    """
    global _ACTIVE
    if _ACTIVE is not None:
        lp.set_link(*_LINK_BEFORE)
    _ACTIVE = None
    p2p.set_interposer(_COUNTER)


def teardown(handle: _Handle) -> None:
    """Release what :func:`setup` created (in the parent, when the ranks have stopped).

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> handle = netem.setup(netem.Network(2e-3, 50e6), 2, None)
        >>> netem.teardown(handle)
    """
    if isinstance(handle, _Handle):
        handle.table = None
        handle.lock = None


def current() -> Network | None:
    """The network emulated in this rank, or ``None`` on the real backend.

    Its ``ranks_per_node`` is the one in force (the network's own, else the launcher's), so
    ``current().describe()`` and ``current().to_dict()`` are complete.

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> net = netem.current()
        >>> title = net.describe() if net else "real backend"
        >>> title
        'real backend'
    """
    return _ACTIVE.network if _ACTIVE is not None else None


def emulator() -> _Emulator | None:
    """This rank's active emulator (the interposer :mod:`pipecomm.collectives.p2p` posts through), or
    ``None`` when nothing is emulated.

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> if netem.emulator() is None: print("the real backend")
        the real backend
    """
    return _ACTIVE


def clock() -> float:
    """This rank's emulated time (seconds, ``CLOCK_MONOTONIC`` base): the monotonic clock minus
    the wake-up lateness forgiven so far (docs/network_model.md, "Per-rank virtual clock");
    ``time.monotonic()`` when nothing is emulated. Time an emulated measurement with it to
    exclude the host's oversleep.

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6)
        >>> handle = netem.setup(net, 1, None)
        >>> netem.activate(net, handle, rank=0, world_size=1, ranks_per_node=None)
        >>> start = netem.clock(); netem.wait_until(start + 0.001) >= 0
        True
        >>> elapsed = netem.clock() - start
        >>> elapsed >= 0.001
        True
        >>> netem.deactivate(); netem.teardown(handle)
    """
    emu = _ACTIVE
    return time.monotonic() if emu is None else emu.clock.now()


def wait_until(deadline: float) -> float:
    """Sleep (never spin) until ``deadline`` (``CLOCK_MONOTONIC`` seconds); return the time slept.

    Call it once the real transfers of a message are done, with the message's deadline: under
    emulation it also settles the rank's virtual clock (a late wake-up is forgiven for the
    rank's next posts, :class:`VirtualClock`). Without emulation it is a plain sleep.

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> net = netem.Network(alpha_s=2e-3, bandwidth_Bps=50e6)
        >>> handle = netem.setup(net, 1, None)
        >>> netem.activate(net, handle, rank=0, world_size=1, ranks_per_node=None)
        >>> deadlines = [netem.clock() + 0.001, netem.clock() + 0.002]
        >>> waited = netem.wait_until(max(deadlines))
        >>> 0 <= waited
        True
        >>> netem.deactivate(); netem.teardown(handle)
    """
    start = time.monotonic()
    now = start
    while now < deadline:
        time.sleep(deadline - now)
        now = time.monotonic()
    emu = _ACTIVE
    if emu is not None:
        emu.clock.settle(deadline, start, now)
    return now - start


# --------------------------------------------------------------------------- counters


def reset_stats() -> None:
    """Zero this rank's transfer counters.

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> netem.reset_stats(); netem.record(4096, 1, 0, 0, 0.0); print(netem.stats()["bytes_sent"])
        4096
        >>> netem.reset_stats()
    """
    emu = _ACTIVE
    with _STATS_LOCK:
        _STATS.update(
            bytes_sent=0, messages_sent=0, bytes_received=0, messages_received=0, time_waiting_s=0.0,
            _oversleep_base=emu.clock.oversleep if emu else 0.0,
        )


def stats() -> dict[str, float]:
    """This rank's counters since the last reset (all threads of the process).

    ``bytes_sent``/``messages_sent`` and ``bytes_received``/``messages_received`` count the
    payloads of :func:`pipecomm.collectives.p2p.exchange` (emulated or not);
    ``time_waiting_s`` is the time slept waiting for emulated deadlines; ``oversleep_s`` the
    wake-up lateness after those sleeps and ``lag_s`` the rank's current lag (both forgiven by
    the virtual clock; 0 without emulation).

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> netem.reset_stats(); netem.record(4096, 2, 0, 0, 0.011)
        >>> s = netem.stats()
        >>> s["bytes_sent"], s["messages_sent"], s["time_waiting_s"]
        (4096, 2, 0.011)
        >>> netem.reset_stats()
    """
    with _STATS_LOCK:
        out = dict(_STATS)
    emu = _ACTIVE
    base = out.pop("_oversleep_base", 0.0)
    out["oversleep_s"] = emu.clock.oversleep - base if emu else 0.0
    out["lag_s"] = emu.clock.lag if emu else 0.0
    return out


def record(
    bytes_sent: int,
    messages_sent: int,
    bytes_received: int,
    messages_received: int,
    waited_s: float,
) -> None:
    """Add one transfer's bytes, messages and emulated waiting time to this rank's
    :func:`stats` (called by :mod:`pipecomm.collectives.p2p` for every message).

    Example::

        >>> from pipecomm.lab.networks import netem
        >>> netem.record(4096, 1, 0, 0, 0.0)
        >>> netem.reset_stats()
    """
    with _STATS_LOCK:
        _STATS["bytes_sent"] += bytes_sent
        _STATS["messages_sent"] += messages_sent
        _STATS["bytes_received"] += bytes_received
        _STATS["messages_received"] += messages_received
        _STATS["time_waiting_s"] += waited_s


reset_stats()
_COUNTER = _Counter()
if p2p.interposer() is None:  # count the real backend's transfers too, from the lab's import on
    p2p.set_interposer(_COUNTER)
