"""Runtime model of AllReduce vs decentralized (DAdam) training iterations.

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025) explain the per-iteration speed of decentralized training with three
factors: overlap of communication and computation, heterogeneous links, and varying compute
times. :func:`simulate` is a small discrete-event simulation that has each of them as an input
(the schedules of the two kinds of training; ``intra`` / ``inter`` links with a shared node
uplink; a log-normal compute factor of coefficient of variation ``compute_cv``);
:func:`group_allreduce_time` prices one group's allreduce on the two-level network and
:func:`uplink_streams` counts the streams that share a node's uplink.

Model, conventions and the closed form of a group allreduce: docs/update_rules.md,
"Iteration-time models" and "DAdam runtime model: conventions and closed form".

Example::

    >>> from pipecomm.lab.networks import cost
    >>> from pipecomm.decentralized import topology
    >>> from pipecomm.lab.training import dadam_runtime_model as runtime_model
    >>> intra = cost.LinkModel(alpha=5e-6, beta=1 / 100e9)
    >>> inter = cost.LinkModel(alpha=20e-6, beta=1 / 12.5e9)
    >>> kw = dict(bucket_bytes=[25e6] * 4, fwd_s=0.01, bwd_s=0.02, p=16, ranks_per_node=4,
    ...           intra=intra, inter=inter, compute_cv=0.1)
    >>> ar = runtime_model.simulate("allreduce", **kw)
    >>> de = runtime_model.simulate("decentralized", topology="aer", **kw)
    >>> round(ar["mean_iteration_s"] / de["mean_iteration_s"], 2)   # speedup per iteration
    1.19
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from pipecomm.decentralized.topology import Topology, get_topology
from pipecomm.lab.networks import cost

__all__ = [
    "group_allreduce_time",
    "lognormal_factors",
    "simulate",
    "step_comm_times",
    "uplink_streams",
]

CollectiveTimeFn = Callable[..., float]
_KINDS = ("allreduce", "decentralized")
_SHARING = ("algorithm", "all")


# ------------------------------------------------------------------------------------------------
# helpers


def lognormal_factors(cv: float, size: Any, rng: np.random.Generator) -> np.ndarray:
    """Independent log-normal factors with mean 1 and coefficient of variation ``cv``.

    ``cv = 0`` gives ones. ``sigma^2 = ln(1 + cv^2)``, ``mu = -sigma^2 / 2``.

    Example::

        >>> f = lognormal_factors(0.2, (50, 8), np.random.default_rng(0))   # iterations x ranks
        >>> f.shape
        (50, 8)
    """
    cv = _check_real(cv, "cv")
    if cv == 0.0:
        return np.ones(size)
    sigma2 = math.log1p(cv * cv)
    return rng.lognormal(mean=-sigma2 / 2.0, sigma=math.sqrt(sigma2), size=size)


def _default_collective_time_fn() -> CollectiveTimeFn:
    return cost.allreduce_time


def _scaled_link(link: Any, factor: float) -> Any:
    """``link`` with its per-byte time ``beta`` multiplied by ``factor``."""
    if factor == 1:
        return link
    if dataclasses.is_dataclass(link) and not isinstance(link, type):
        return dataclasses.replace(link, beta=link.beta * factor)
    if hasattr(link, "_replace"):  # namedtuple
        return link._replace(beta=link.beta * factor)
    return type(link)(
        link.alpha,
        link.beta * factor,
        getattr(link, "gamma", 0.0),
        ports=getattr(link, "ports", "single"),
    )


def uplink_streams(
    groups: Sequence[Sequence[int]],
    ranks_per_node: int,
    algorithm: str = "ring",
    sharing: str = "algorithm",
) -> dict[int, int]:
    """Streams leaving each node's uplink at once when all ``groups`` run their allreduce.

    Only groups spanning several nodes count. The rule: docs/update_rules.md, "DAdam runtime
    model: conventions and closed form".

    Example::

        >>> uplink_streams([(0, 1, 2, 3, 4, 5, 6, 7)], ranks_per_node=4)
        {0: 1, 1: 1}
        >>> uplink_streams([(0, 4), (1, 5), (2, 6), (3, 7)], ranks_per_node=4)
        {0: 4, 1: 4}
        >>> uplink_streams([(0, 1, 2, 3, 4, 5, 6, 7)], 4, sharing="all")
        {0: 4, 1: 4}
    """
    if sharing not in _SHARING:
        raise ValueError(f"sharing must be one of {_SHARING}, got {sharing!r}")
    rpn = ranks_per_node
    out: dict[int, int] = {}
    for g in groups:
        g = sorted(g)
        m = len(g)
        nodes = [r // rpn for r in g]
        if len(set(nodes)) < 2:
            continue
        if sharing == "all" or algorithm not in ("ring", "lp"):
            for n in nodes:
                out[n] = out.get(n, 0) + 1
            continue
        if algorithm == "ring":  # unidirectional ring g[0] -> g[1] -> ... -> g[m-1] -> g[0]
            edges = [(nodes[j], nodes[(j + 1) % m]) for j in range(m)]
        else:  # lp: bidirectional chain
            edges = [(nodes[j], nodes[j + 1]) for j in range(m - 1)]
            edges += [(b, a) for a, b in edges]
        for a, b in edges:
            if a != b:
                out[a] = out.get(a, 0) + 1
    return out


def group_allreduce_time(
    group: Sequence[int],
    nbytes: float,
    *,
    ranks_per_node: int,
    intra: Any,
    inter: Any,
    algorithm: str = "ring",
    streams: int | None = None,
    sharing: str = "algorithm",
    collective_time_fn: CollectiveTimeFn | None = None,
) -> float:
    """Closed-form time of an allreduce of ``nbytes`` over ``group`` on the two-level network.

    ``streams`` is the number of streams sharing the busiest uplink the group crosses (default:
    this group's own, from :func:`uplink_streams`); pass the count of all concurrent groups to
    model contention between them. A group of one rank costs 0.

    Example::

        >>> from pipecomm.lab.networks import cost
        >>> intra = cost.LinkModel(alpha=5e-6, beta=1 / 100e9)
        >>> inter = cost.LinkModel(alpha=20e-6, beta=1 / 12.5e9)
        >>> t = group_allreduce_time((0, 1, 2, 3, 4, 5, 6, 7), 1e6, ranks_per_node=4,
        ...                          intra=intra, inter=inter)      # one node pair of AER
        >>> round(t * 1e3, 3)   # ms
        0.42
    """
    fn = collective_time_fn or _default_collective_time_fn()
    m = len(group)
    nbytes = int(round(nbytes))
    if m <= 1 or nbytes == 0:
        return 0.0
    nodes = {r // ranks_per_node for r in group}
    if len(nodes) == 1:
        return float(fn(algorithm, nbytes, m, intra))
    if streams is None:
        streams = max(uplink_streams([group], ranks_per_node, algorithm, sharing).values())
    return float(fn(algorithm, nbytes, m, _scaled_link(inter, max(1, int(streams)))))


def step_comm_times(
    groups: Sequence[Sequence[int]],
    bucket_bytes: Sequence[float],
    *,
    ranks_per_node: int,
    intra: Any,
    inter: Any,
    algorithm: str = "ring",
    sharing: str = "algorithm",
    collective_time_fn: CollectiveTimeFn | None = None,
    _cache: dict | None = None,
) -> list[list[float]]:
    """Time of each group's allreduce of each bucket when the groups of one step run together.

    Returns ``times[group_index][bucket_index]``; concurrent cross-node groups share uplinks.

    Example::

        >>> from pipecomm.lab.networks import cost
        >>> intra = cost.LinkModel(alpha=5e-6, beta=1 / 100e9)
        >>> inter = cost.LinkModel(alpha=20e-6, beta=1 / 12.5e9)
        >>> topo = get_topology("aer", 8, ranks_per_node=4)
        >>> step_comm_times(topo.groups(1), [1e6, 2e6], ranks_per_node=4, intra=intra, inter=inter)
        [[0.00042, 0.00056]]
    """
    fn = collective_time_fn or _default_collective_time_fn()
    load = uplink_streams(groups, ranks_per_node, algorithm, sharing)
    cache = {} if _cache is None else _cache
    out = []
    for g in groups:
        nodes = {r // ranks_per_node for r in g}
        spans = len(nodes) > 1
        s = max(load.get(n, 1) for n in nodes) if spans else 1
        row = []
        for nb in bucket_bytes:
            key = (len(g), spans, s, float(nb))
            t = cache.get(key)
            if t is None:
                t = group_allreduce_time(
                    g,
                    nb,
                    ranks_per_node=ranks_per_node,
                    intra=intra,
                    inter=inter,
                    algorithm=algorithm,
                    streams=s,
                    collective_time_fn=fn,
                )
                cache[key] = t
            row.append(t)
        out.append(row)
    return out


# ------------------------------------------------------------------------------------------------
# simulation


def simulate(
    kind: str = "allreduce",
    *,
    bucket_bytes: Sequence[float],
    fwd_s: float | Sequence[float],
    bwd_s: float | Sequence[float],
    p: int,
    ranks_per_node: int | None,
    intra: Any,
    inter: Any,
    topology: str | Topology | None = None,
    compute_cv: float = 0.0,
    iterations: int = 50,
    seed: int = 0,
    algorithm: str = "ring",
    step_s: float | Sequence[float] = 0.0,
    warmup: int | None = None,
    sharing: str = "algorithm",
    collective_time_fn: CollectiveTimeFn | None = None,
    overlap: bool = True,
) -> dict[str, Any]:
    """Simulate ``iterations`` training iterations; return the mean time per iteration and more.

    ``kind="allreduce"``: bucketed gradient allreduce overlapped with the rest of backward, then
    the step (all ranks synchronised every iteration). ``kind="decentralized"``: DAdam; each
    bucket's gossip over ``topology`` (a name or a :class:`Topology`) overlaps everything until the
    same bucket's step of the next iteration. The three factors of the DAdam paper are the inputs:
    overlap (structure of the two schedules), heterogeneous links (``intra``, ``inter``,
    ``ranks_per_node``), varying compute (``compute_cv``: log-normal per rank and iteration).

    Arguments: ``bucket_bytes`` per bucket in forward order; ``fwd_s``, ``bwd_s``, ``step_s``
    per-bucket mean forward, backward and optimizer-step seconds (a scalar means the same for every
    bucket); ``p`` ranks, ``ranks_per_node`` consecutive ranks per node (None: one node);
    ``intra``/``inter`` link models (``pipecomm.lab.networks.cost.LinkModel``); ``algorithm`` the allreduce
    algorithm priced by ``collective_time_fn(algorithm, nbytes, p, link)`` (default
    ``pipecomm.lab.networks.cost.allreduce_time``); ``warmup`` dropped iterations (default ``max(1,
    iterations // 10)``); ``sharing`` the uplink-sharing rule (:func:`uplink_streams`);
    ``overlap=False`` the ablation of factor 1 (E11's overlap ablation): AllReduce launches its
    buckets, in the same order, only once every rank has finished backward; DAdam waits at the
    end of each iteration for the gossip it launched in it, before the next forward (its
    overlap with the rest of backward stays).

    Returns a dict: ``mean_iteration_s``, ``iteration_s`` (per measured iteration),
    ``compute_s`` (nominal forward + backward + step), ``comm_s`` (mean busy time per iteration of
    the busiest communication stream), ``exposed_s`` (``mean_iteration_s - compute_s``), and the
    inputs ``kind``, ``p``, ``ranks_per_node``, ``topology``, ``algorithm``, ``compute_cv``,
    ``overlap``.

    Example::

        >>> from pipecomm.lab.networks import cost
        >>> intra = cost.LinkModel(alpha=5e-6, beta=1 / 100e9)
        >>> inter = cost.LinkModel(alpha=20e-6, beta=1 / 12.5e9)
        >>> r = simulate("decentralized", topology="ring", bucket_bytes=[4e6] * 3, fwd_s=0.01,
        ...              bwd_s=0.02, p=8, ranks_per_node=4, intra=intra, inter=inter)
        >>> round(r["mean_iteration_s"], 4)   # = 3 x (0.01 + 0.02): the gossip is hidden
        0.09
        >>> kw = dict(bucket_bytes=[4e6] * 3, fwd_s=0.01, bwd_s=0.02, p=8, ranks_per_node=4,
        ...           intra=intra, inter=inter)
        >>> [round(simulate("allreduce", overlap=o, **kw)["mean_iteration_s"], 5)
        ...  for o in (True, False)]     # after backward: all three allreduces exposed
        [0.09084, 0.09252]
    """
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {_KINDS}, got {kind!r}")
    if sharing not in _SHARING:
        raise ValueError(f"sharing must be one of {_SHARING}, got {sharing!r}")
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be a string, got {type(algorithm).__name__}")
    if not isinstance(overlap, (bool, np.bool_)):
        raise TypeError(f"overlap must be a bool, got {type(overlap).__name__}")
    p = _check_int(p, "p", 1)
    rpn = p if ranks_per_node is None else _check_int(ranks_per_node, "ranks_per_node", 1)
    if p % rpn:
        raise ValueError(f"ranks_per_node={rpn} must divide p={p} (nodes hold equal rank counts)")
    sizes = _as_array(bucket_bytes, "bucket_bytes", None)
    if sizes.size == 0:
        raise ValueError("bucket_bytes must list at least one bucket")
    nb = sizes.size
    fwd = _as_array(fwd_s, "fwd_s", nb)
    bwd = _as_array(bwd_s, "bwd_s", nb)
    stp = _as_array(step_s, "step_s", nb)
    cv = _check_real(compute_cv, "compute_cv")
    iterations = _check_int(iterations, "iterations", 2)
    warmup = max(1, iterations // 10) if warmup is None else _check_int(warmup, "warmup", 0)
    if warmup >= iterations:
        raise ValueError(f"warmup={warmup} must be < iterations={iterations}")
    fn = collective_time_fn or _default_collective_time_fn()

    topo: Topology | None = None
    if kind == "decentralized":
        if topology is None:
            raise ValueError("kind='decentralized' needs topology= (a name or a Topology)")
        topo = get_topology(topology, p, ranks_per_node=rpn)
        if topo.world_size != p:
            raise ValueError(f"topology is for {topo.world_size} ranks, p={p}")

    rng = np.random.default_rng(seed)
    factors = lognormal_factors(cv, (iterations, p), rng)
    link_kw = dict(
        ranks_per_node=rpn,
        intra=intra,
        inter=inter,
        algorithm=algorithm,
        sharing=sharing,
        collective_time_fn=fn,
    )
    if kind == "allreduce":
        finish, busy = _simulate_allreduce(sizes, fwd, bwd, stp, factors, link_kw, overlap)
    else:
        assert topo is not None
        finish, busy = _simulate_decentralized(sizes, fwd, bwd, stp, factors, topo, link_kw,
                                               overlap)

    last = finish.max(axis=1)  # moment the last rank finishes each iteration
    per_iter = np.diff(last)[warmup - 1 :] if warmup > 0 else np.diff(np.r_[0.0, last])
    mean = float(per_iter.mean())
    compute = float(fwd.sum() + bwd.sum() + stp.sum())
    return {
        "kind": kind,
        "p": p,
        "ranks_per_node": rpn,
        "topology": None if topo is None else (topo.name or type(topo).__name__),
        "algorithm": algorithm,
        "compute_cv": cv,
        "overlap": bool(overlap),
        "mean_iteration_s": mean,
        "iteration_s": per_iter.tolist(),
        "compute_s": compute,
        "comm_s": float(busy[warmup:].mean()),
        "exposed_s": mean - compute,
    }


def _simulate_allreduce(
    sizes: np.ndarray,
    fwd: np.ndarray,
    bwd: np.ndarray,
    stp: np.ndarray,
    factors: np.ndarray,
    link_kw: dict[str, Any],
    overlap: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    iterations, p = factors.shape
    comm = step_comm_times([tuple(range(p))], sizes.tolist(), **link_kw)[0]
    order = np.arange(sizes.size)[::-1]  # backward order
    # gradients of bucket order[j] are ready after forward and backward of order[0..j]
    ready_nominal = fwd.sum() + np.cumsum(bwd[order])
    finish = np.empty((iterations, p))
    busy = np.full(iterations, float(sum(comm)))
    t = 0.0
    for k in range(iterations):
        s = factors[k]
        ready = t + np.outer(ready_nominal, s).max(axis=1)  # all ranks ready, per bucket
        if not overlap:  # the ablation: every bucket waits for the end of backward
            ready[:] = ready[-1]
        free = t
        for j, i in enumerate(order):
            free = max(free, ready[j]) + comm[i]
        compute_end = t + ready_nominal[-1] * s
        t = max(free, float(compute_end.max())) + float(stp.sum())
        finish[k] = t
    return finish, busy


def _simulate_decentralized(
    sizes: np.ndarray,
    fwd: np.ndarray,
    bwd: np.ndarray,
    stp: np.ndarray,
    factors: np.ndarray,
    topo: Topology,
    link_kw: dict[str, Any],
    overlap: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    iterations, p = factors.shape
    order = list(range(sizes.size))[::-1]
    sizes_list = sizes.tolist()
    cache: dict = {}
    step_cache: dict[int | None, tuple[list[np.ndarray], list[list[float]]]] = {}
    cursor = np.zeros(p)  # each rank's compute timeline
    free = np.zeros(p)  # each rank's communication stream
    done_prev: np.ndarray | None = None  # [bucket, rank]: gossip of the previous iteration done
    finish = np.empty((iterations, p))
    busy = np.zeros(iterations)
    fwd_total = float(fwd.sum())
    for k in range(iterations):
        s = factors[k]
        # the gossip launched in iteration k is mixed with W_{k+1}
        key = (k + 1) % topo.period if topo.period else None
        entry = step_cache.get(key) if key is not None else None
        if entry is None:
            groups = topo.groups(k + 1)
            times = step_comm_times(groups, sizes_list, _cache=cache, **link_kw)
            entry = ([np.asarray(g) for g in groups], times)
            if key is not None:
                step_cache[key] = entry
        groups_idx, times = entry
        cursor = cursor + fwd_total * s
        done = np.empty((sizes.size, p))
        busy_k = np.zeros(p)
        for i in order:
            cursor = cursor + bwd[i] * s
            if done_prev is not None:  # wait for the gossip of this bucket, then mix and step
                cursor = np.maximum(cursor, done_prev[i])
            cursor = cursor + stp[i]
            for g, row in zip(groups_idx, times):
                start = max(float(cursor[g].max()), float(free[g].max()))
                end = start + row[i]
                free[g] = end
                done[i, g] = end
                busy_k[g] += row[i]
        if not overlap:  # the ablation: this iteration's gossip done before the next forward
            cursor = np.maximum(cursor, done.max(axis=0))
        finish[k] = cursor
        busy[k] = busy_k.max()
        done_prev = done
    return finish, busy


# ------------------------------------------------------------------------------------------------
# argument checks


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_real(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return value


def _as_array(value: object, name: str, n: int | None) -> np.ndarray:
    if isinstance(value, (str, bytes, bool)):
        raise TypeError(f"{name} must be a number or a sequence of numbers, got {value!r}")
    if isinstance(value, numbers.Real):
        if n is None:
            raise TypeError(f"{name} must be a sequence (one entry per bucket), got {value!r}")
        arr = np.full(n, float(value))
    else:
        try:
            arr = np.asarray(list(value), dtype=np.float64)  # type: ignore[call-overload]
        except (TypeError, ValueError) as exc:
            raise TypeError(f"{name} must be a number or a sequence of numbers") from exc
        if arr.ndim != 1:
            raise ValueError(f"{name} must be one-dimensional, got shape {arr.shape}")
        if n is not None and arr.size != n:
            raise ValueError(f"{name} has {arr.size} entries; bucket_bytes has {n} buckets")
    if not np.all(np.isfinite(arr)) or np.any(arr < 0):
        raise ValueError(f"{name} must be finite and >= 0, got {arr.tolist()}")
    return arr
