"""Host check of the emulated network: does a real transfer here keep within the emulated step?

The emulated link must be slower than the real one: otherwise the real transfer, not the
emulator, sets the time, and no virtual clock can hide that. :func:`check_host` probes it on a
pool's ranks and names the link parameter to relax.

Example::

    with launch.Ranks(8, network=net) as ranks:
        netem.check_host(ranks, [64 << 10, 1 << 20])     # raises HostTooSlow if too fast
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from pipecomm.lab.networks.netem.network import Network, format_bandwidth, format_ms
from pipecomm.lab.networks.netem.schedule import LinkSchedule

__all__ = ["RECHECK_PAUSE_S", "SKIP_CHECK_ENV", "HostCheck", "HostTooSlow", "check_host"]

SKIP_CHECK_ENV = "PIPECOMM_SKIP_HOST_CHECK"  # set: no host probe (tests)


class HostTooSlow(ValueError):
    """The host cannot deliver the emulated network's step: a real transfer is slower."""


@dataclass(frozen=True)
class HostCheck:
    """Result of :func:`check_host`: per message size and link level, the real ring step of
    this host at this p against the emulated one; ``message`` says what to relax when not
    ``ok``.

    Example::

        chk = netem.check_host(ranks, [64 << 10], raise_error=False)
        print(chk.ok, chk.rows[0]["real_step_s"], chk.rows[0]["emulated_step_s"])
    """

    world_size: int
    rows: tuple[dict[str, Any], ...]
    ok: bool
    message: str


def _probe_rank(sizes: list[int], steps: int, reps: int) -> list[float]:
    """Rank side of :func:`check_host`: seconds per step of a chain of ``steps`` real ring steps
    (send to the right, receive from the left, wait), the fastest of ``reps``, per size: what the
    host can do (a late wake-up, which makes a slower repetition, is what the virtual clock
    forgives). Uses the backend directly: nothing is emulated."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    out = []
    for n in sizes:
        send = torch.zeros(max(1, n), dtype=torch.uint8)
        recv = torch.empty_like(send)
        per_rep = []
        for rep in range(reps + 1):  # repetition 0 warms up
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                ops = [dist.P2POp(dist.isend, send, right), dist.P2POp(dist.irecv, recv, left)]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            if rep:
                per_rep.append((time.perf_counter() - start) / steps)
        out.append(float(min(per_rep)))
    dist.barrier()
    return out


def _levels(network: Network, world_size: int, rpn: int | None) -> list[tuple[str, str, bool]]:
    sched = LinkSchedule(network, world_size, rpn)
    if not sched.two_level:
        return [("alpha_s", "bandwidth_Bps", False)]
    levels = [("inter_alpha_s", "inter_bandwidth_Bps", True)]
    if sched.ranks_per_node > 1:
        levels.insert(0, ("alpha_s", "bandwidth_Bps", False))
    return levels


def _advice(network: Network, level: tuple[str, str, bool], bad: list[tuple[int, float]]) -> str:
    """Which parameter of ``level`` to relax, from the violating (nbytes, real step) points."""
    a_name, b_name, inter = level
    alpha = network.inter_alpha if inter else network.alpha_s
    bw = min(network.bandwidth_Bps, network.inter_bandwidth) if inter else network.bandwidth_Bps
    need_alpha = max(real - n / bw for n, real in bad)
    fast = [(n, real) for n, real in bad if real > alpha and n > 0]
    need_bw = min(n / (real - alpha) for n, real in fast) if fast else None
    n_worst, _ = max(bad, key=lambda x: x[1] - (alpha + x[0] / bw))
    alpha_text = f"raise {a_name} to at least {format_ms(need_alpha)}"
    bw_text = f"lower {b_name} to at most {format_bandwidth(need_bw)}" if need_bw else None
    if alpha >= n_worst / bw or bw_text is None:  # latency-bound step
        return alpha_text + (f" (or {bw_text})" if bw_text else "")
    return f"{bw_text} (or {alpha_text})"


def check_host(
    ranks: Any,
    sizes: list[int],
    network: Network | None = None,
    *,
    steps: int = 8,
    reps: int = 5,
    margin: float = 1.0,
    raise_error: bool = True,
    timeout_s: float = 120.0,
) -> HostCheck:
    """Probe that this host delivers the emulated step at the pool's p (in the parent).

    The emulated link must be slower than the real one: otherwise the real transfer, not the
    emulator, sets the time, and no virtual clock can hide that. On every rank of ``ranks``
    (a pool; its ``network`` unless given) a chain of real ring steps of each size in
    ``sizes`` is timed with the backend itself (nothing emulated; each rank's fastest of
    ``reps`` chains: the host's capability, not its scheduling noise); the slowest rank's step
    must take at most ``margin`` times the emulated time of one message of that size on every
    link level in use (intra-node: ``alpha_s + n / bandwidth_Bps``; between nodes: the
    ``inter_*`` link). Otherwise :class:`HostTooSlow` (when ``raise_error``) names the
    parameter to relax and the value that would fit.

    Example::

        with launch.Ranks(8, network=net) as ranks:
            netem.check_host(ranks, [64 << 10, 1 << 20])     # raises HostTooSlow if too fast
            ranks.run(mymodule.measure)
    """
    net = network if network is not None else getattr(ranks, "network", None)
    if not isinstance(net, Network):
        raise ValueError(f"network must be a pipecomm.lab.networks.netem.Network (or ranks.network), got {net!r}")
    if not sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in sizes):
        raise ValueError(f"sizes must be a non-empty list of ints >= 0, got {sizes!r}")
    for name, value in (("steps", steps), ("reps", reps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin!r}")
    world = ranks.world_size
    rpn = net.ranks_per_node if net.ranks_per_node is not None else getattr(
        ranks, "ranks_per_node", None)
    levels = _levels(net, world, rpn)
    per_rank = ranks.run(_probe_rank, list(sizes), steps, reps, timeout_s=timeout_s)
    real = [max(col) for col in zip(*per_rank)]
    rows, problems = [], []
    for level in levels:
        bad = []
        for n, t in zip(sizes, real):
            emulated = net.transfer_time(n, inter_node=level[2])
            rows.append({"nbytes": n, "level": "inter-node" if level[2] else "intra-node",
                         "real_step_s": t, "emulated_step_s": emulated,
                         "ok": t <= margin * emulated})
            if t > margin * emulated:
                bad.append((n, t))
        if bad:
            n, t = max(bad, key=lambda x: x[1] / net.transfer_time(x[0], inter_node=level[2]))
            problems.append(
                f"a real ring step of {n} B takes {format_ms(t)} here but the emulated "
                f"{'inter-node' if level[2] else 'link'} gives it "
                f"{format_ms(net.transfer_time(n, inter_node=level[2]))}; {_advice(net, level, bad)}"
            )
    ok = not problems
    message = "ok" if ok else (
        f"netem: this host cannot deliver the emulated network ({net.describe(rpn)}) at "
        f"p={world}: " + "; ".join(problems)
    )
    result = HostCheck(world, tuple(rows), ok, message)
    if not ok and raise_error:
        raise HostTooSlow(message)
    return result


#: Seconds :func:`pipecomm.lab.networks.kinds.emulated_pool` waits before probing the host a second time.
RECHECK_PAUSE_S = 2.0
