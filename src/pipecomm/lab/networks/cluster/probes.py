"""Measurements of a virtual cluster's links: rank functions, and a 2-node bandwidth check.

:func:`link_bandwidth` (one link alone), :func:`chain_bandwidth` (every node link busy at once)
and :func:`calibrate` (both, with the alpha-beta fit the cost models use) run on the ranks of a
cluster job or a local pool; :func:`measure_bandwidth` builds a 2-node cluster for the check.

Example::

    from pipecomm.lab.networks.cluster import probes
    cal = c.run(probes.calibrate, [4096, 1 << 20, 4 << 20], 5, 2)[0]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pipecomm.lab.networks.cluster.host import ClusterError
from pipecomm.lab.networks.cluster.virtual import VirtualCluster

__all__ = ["calibrate", "chain_bandwidth", "link_bandwidth", "measure_bandwidth"]


def link_bandwidth(sizes: Sequence[int], iters: int = 3, src: int = 0, dst: int = 1,
                   best: bool = False) -> list[dict[str, Any]]:
    """Rank function: ``src`` sends ``n`` bytes to ``dst`` (gloo send/recv), ``dst`` answers
    with one byte; time of the pair per size (median over ``iters``; ``best``: the fastest,
    what the link carries when the host's load leaves it alone). Rows on ``src``.

    Example::

        rows = c.run(cluster.link_bandwidth, [1 << 20, 4 << 20])[0]
    """
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    ack = torch.zeros(1, dtype=torch.uint8)
    rows = []
    for n in [64 << 10, *sizes]:  # the first one opens the connection, not reported
        buf = torch.zeros(n, dtype=torch.uint8)
        times = []
        for _ in range(iters):
            dist.barrier()
            start = time.perf_counter()
            if rank == src:
                dist.send(buf, dst)
                dist.recv(ack, dst)
            elif rank == dst:
                dist.recv(buf, src)
                dist.send(ack, src)
            times.append(time.perf_counter() - start)
        times.sort()
        t = times[0] if best else times[len(times) // 2]
        rows.append({"nbytes": n, "time_s": t, "bandwidth_Bps": n / t})
    dist.barrier()
    return rows[1:] if rank == src else []


def chain_bandwidth(nbytes: int, iters: int = 3, stride: int = 1, best: bool = False,
                    messages: int = 1) -> float:
    """Rank function: every ``stride``-th rank ``i`` sends ``messages`` messages of ``nbytes``
    to rank ``i + stride`` while receiving as many from ``i - stride``, all those links busy at
    once (``stride`` = ranks per node: one flow per node link); the achieved rate per link
    (B/s, median over ``iters``, the same on every rank). Against :func:`link_bandwidth` (one
    link alone) it says whether the host carries every shaped link at once: the kernel's copies
    and shaping of concurrent flows share the host's cores, and a shaped network the host cannot
    carry measures the host. ``best``: the fastest repeat instead of the median (what the host
    can carry; the median also holds the scheduling lateness of many ranks on few cores, which
    varies from run to run). ``messages`` > 1: a stream, every receive posted before the first
    send (as pipecomm's progress engine posts them), so that one message's latency hides behind
    the next one's bytes.

    Example::

        rate = c.run(cluster.chain_bandwidth, 4 << 20)[0]
        streamed = c.run(cluster.chain_bandwidth, 4 << 20, 5, 1, False, 16)[0]
    """
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if isinstance(stride, bool) or not isinstance(stride, int) or not 1 <= stride < world:
        raise ValueError(f"stride must be an int in [1, {world - 1}], got {stride!r}")
    if isinstance(messages, bool) or not isinstance(messages, int) or messages < 1:
        raise ValueError(f"messages must be an int >= 1, got {messages!r}")
    out = torch.zeros(nbytes, dtype=torch.uint8)
    into = torch.zeros(messages, nbytes, dtype=torch.uint8)
    chained = rank % stride == 0
    times = []
    for i in range(iters + 1):  # the first opens the connections, not counted
        dist.barrier()
        start = time.perf_counter()
        works = []
        if chained and rank >= stride:
            works += [dist.irecv(into[m], rank - stride) for m in range(messages)]
        if chained and rank + stride < world:
            works += [dist.isend(out, rank + stride) for _ in range(messages)]
        for w in works:
            w.wait()
        dist.barrier()
        if i:
            times.append(time.perf_counter() - start)
    times.sort()
    return messages * nbytes / (times[0] if best else times[len(times) // 2])


def link_model(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A link's ``{"alpha_s", "bandwidth_Bps", "fit", "rows"}`` from :func:`link_bandwidth`'s rows:
    the alpha-beta fit (``time = alpha + n / B``, alpha clipped at 0, ``fit="alpha-beta"``),
    or, where noise makes the fitted per-byte time <= 0 (an unshaped loopback link on a loaded
    host), the fastest measured rate and the smallest message's time as alpha
    (``fit="fastest-rate"``): a finite, conservative link instead of an infinite bandwidth.

    Args:
        rows: dicts with ``nbytes``, ``time_s`` and ``bandwidth_Bps``, >= 2 distinct sizes.

    Example:
        >>> rows = [{"nbytes": 1000, "time_s": 2e-3, "bandwidth_Bps": 5e5},
        ...         {"nbytes": 9000, "time_s": 1e-3, "bandwidth_Bps": 9e6}]
        >>> m = link_model(rows)
        >>> m["fit"], m["bandwidth_Bps"], m["alpha_s"]
        ('fastest-rate', 9000000.0, 0.002)
    """
    from pipecomm.lab.networks import cost

    alpha, beta = cost.fit_alpha_beta([r["nbytes"] for r in rows], [r["time_s"] for r in rows])
    if beta > 0:
        return {"alpha_s": max(float(alpha), 0.0), "bandwidth_Bps": float(1.0 / beta),
                "fit": "alpha-beta", "rows": list(rows)}
    return {"alpha_s": float(min(rows, key=lambda r: r["nbytes"])["time_s"]),
            "bandwidth_Bps": float(max(r["bandwidth_Bps"] for r in rows)),
            "fit": "fastest-rate", "rows": list(rows)}


def calibrate(sizes: Sequence[int], iters: int = 5, ranks_per_node: int = 1,
              host_margin: float = 0.9, configured_Bps: float | None = None) -> dict[str, Any]:
    """Rank function: the cluster's links as the cost models see them, and a check that the
    host carries them all at once.

    * inter-node link: node 0 -> node 1 (rank 0 -> rank ``ranks_per_node``),
      :func:`link_bandwidth` per size and its alpha-beta fit (``time = alpha + n / B``);
    * intra-node link (``ranks_per_node > 1``): rank 0 -> rank 1 over the node's loopback;
    * every node link busy at once (:func:`chain_bandwidth` at the largest size, the fastest of
      ``iters`` repeats: the median of 5 moved between 85% and 95% of a link from run to run at
      the same settings on this 2-core host) must keep ``host_margin`` of the lone link's
      median rate at that size, else :class:`ClusterError` (on every rank) naming the bandwidth
      to configure instead.

    Returns (the same on every rank) ``{"inter": {...}, "intra": {...} | None, "chain_Bps":
    rate}`` where each link is ``{"alpha_s", "bandwidth_Bps", "rows"}`` (``rows``: ``nbytes``,
    ``time_s``, ``bandwidth_Bps`` per size).

    Example::

        cal = c.run(cluster.calibrate, [4096, 1 << 20, 4 << 20], 5, 2)[0]
        cal["inter"]["bandwidth_Bps"]
    """
    import torch.distributed as dist

    if len(set(sizes)) < 2:
        raise ValueError(f"sizes must hold >= 2 message sizes to fit alpha and beta, got {sizes!r}")

    def link(src: int, dst: int) -> dict[str, Any] | None:
        rows = link_bandwidth(sizes, iters, src, dst)
        out = [None]
        if dist.get_rank() == src:
            out = [link_model(rows)]
        dist.broadcast_object_list(out, src=src)
        return out[0]

    inter = link(0, ranks_per_node)
    intra = link(0, 1) if ranks_per_node > 1 else None
    largest = max(sizes)
    alone = next(r["bandwidth_Bps"] for r in inter["rows"] if r["nbytes"] == largest)
    chain = chain_bandwidth(largest, iters, ranks_per_node, best=True)
    if chain < host_margin * alone:  # every rank sees the same numbers: all raise
        nodes = dist.get_world_size() // ranks_per_node
        advice = (f"lower the link bandwidth to about {0.8 * chain / alone * configured_Bps:.3g}"
                  " B/s" if configured_Bps else "lower the link bandwidth")
        raise ClusterError(
            f"this host cannot carry {nodes} shaped node links at once: each moved "
            f"{chain / 1e6:.1f} MB/s with all busy against {alone / 1e6:.1f} MB/s alone "
            f"(< {host_margin:.0%}); {advice}, or use fewer nodes")
    return {"inter": inter, "intra": intra, "chain_Bps": float(chain)}


def measure_bandwidth(
    bandwidth_Bps: float = 50e6,
    sizes: Sequence[int] = (1 << 20, 4 << 20, 16 << 20, 64 << 20),
    iters: int = 3,
    timeout_s: float = 600.0,
    best: bool = False,
) -> list[dict[str, Any]]:
    """Build a 2-node cluster with links of ``bandwidth_Bps``, measure :func:`link_bandwidth`
    (``best``: the fastest of ``iters``) from node 0 to node 1; rows with the configured and
    achieved bandwidth.

    Example::

        for row in cluster.measure_bandwidth(50e6, [1 << 20]):
            print(row["nbytes"], row["bandwidth_Bps"] / row["configured_Bps"])
    """
    with VirtualCluster(2, 1, bandwidth_Bps) as c:
        rows = c.run(link_bandwidth, list(sizes), iters, 0, 1, best, timeout_s=timeout_s)[0]
    return [dict(r, configured_Bps=float(bandwidth_Bps)) for r in rows]
