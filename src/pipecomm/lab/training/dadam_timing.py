"""Per-iteration time of decentralized training vs AllReduce, measured and modelled (E10-E12).

Paper: Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance
Decentralized Training" (ICLR 2025): the runtime model of three factors -- overlap of
communication with computation, the network's links, varying compute times
(:mod:`pipecomm.lab.training.dadam_runtime_model`).

* :func:`rank_time_training` (E11, E12): on every rank, train the timing workload
  (:class:`~pipecomm.lab.workloads.tasks.TimingNet`) through a
  :class:`~pipecomm.lab.training.trainers.Trainer` -- AllReduce or DecentralizedDataParallel,
  both with Adam -- and time its iterations; :func:`predict_training` is the runtime model's
  prediction of the same statistic from a compute calibration
  (:func:`pipecomm.lab.measure.calibration.rank_calibrate_buckets`), the network's link
  parameters and the same injected compute factors.
* :func:`rank_gossip_times` (E10): the isolated gossip of one period of a topology, and
  :func:`model_gossip_time`, the cost model's time of one gossip step.
* Labels, checks and the measured-vs-model bar chart the three experiments share.

Example::

    from pipecomm.lab.networks import launch
    from pipecomm.lab.measure import calibration
    from pipecomm.lab.training import dadam_timing
    from pipecomm.lab.networks import kinds as network
    from pipecomm.lab.workloads import tasks as workloads
    net = network.make_network(network.DEFAULT_NETWORK)
    spec = workloads.timing_spec(p=8)
    with launch.Ranks(8, network=net, ranks_per_node=2) as ranks:
        calib = calibration.summarize_buckets(
            ranks.run(calibration.rank_calibrate_buckets, spec, timeout_s=120))
        spec["kind"], spec["topology"] = "decentralized", "alternating-exp-ring"
        measured = ranks.run(dadam_timing.rank_time_training, spec, timeout_s=300)[0]
    predicted = dadam_timing.predict_training(spec, calib, net)["iteration_s"]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipecomm import collectives
from pipecomm.decentralized import topology
from pipecomm.lab.checks import check_int
from pipecomm.lab.experiment import Params
from pipecomm.lab.measure import bench
from pipecomm.lab.measure.stats import join_repeats
from pipecomm.lab.networks import launch, netem
from pipecomm.lab.networks.kinds import link_models
from pipecomm.lab.training import dadam_runtime_model as runtime_model
from pipecomm.lab.training.trainers import DecentralizedTrainer, OptimizerFactory, make_trainer
from pipecomm.lab.workloads.tasks import build_timing_net, check_world, timing_bucket_mb

__all__ = [
    "bars_with_markers",
    "check_timing_workload",
    "method_name",
    "OverlappedRing",
    "model_gossip_time",
    "overlapped_gossip_time",
    "predict_training",
    "replay_ring_allreduces",
    "rank_gossip_times",
    "rank_time_training",
]


def _factors(spec: dict[str, Any], iterations: int) -> np.ndarray:
    """Compute factors ``[iteration, rank]``: exactly the draws of ``runtime_model.simulate``."""
    rng = np.random.default_rng(spec["seed"])
    return runtime_model.lognormal_factors(spec["compute_cv"], (iterations, spec["p"]), rng)



def _adam_fn(lr: float) -> OptimizerFactory:
    return functools.partial(_make_adam, lr=lr)


def _make_adam(named: list[tuple[str, nn.Parameter]], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam([p for _, p in named], lr=lr)


def rank_time_training(spec: dict[str, Any]) -> dict[str, Any]:
    """On every rank: train the timing workload and time its iterations.

    ``spec["kind"]`` ``"allreduce"`` (:class:`~pipecomm.lab.training.trainers.AllReduceTrainer`
    + Adam) or ``"decentralized"`` (:class:`~pipecomm.decentralized.DecentralizedDataParallel` +
    Adam on ``spec["topology"]``), gossip/allreduce ``spec["algorithm"]``; ``spec["overlap"]``
    False is E11's overlap ablation (:func:`pipecomm.lab.training.trainers.make_trainer`:
    AllReduce after backward, DAdam waiting for its gossip before the next forward). Iteration ``k`` of
    rank ``r`` scales its emulated compute by ``factors[k, r]`` (:func:`_factors`, the same draws
    as the runtime model's). ``warmup`` iterations (iteration 0 included), then ``blocks`` blocks
    of ``block_iters`` iterations timed with :func:`pipecomm.lab.measure.bench.time_fn` (a barrier before
    each block, max over ranks). Returns ``iteration_s`` = median block time / block_iters, the
    block times and, for decentralized runs, the wrapper's cumulative wait/update/launch times.
    """
    p = check_world(spec)
    rank = dist.get_rank()
    model = build_timing_net(spec)
    total = spec["warmup"] + spec["blocks"] * spec["block_iters"]
    factors = _factors(spec, total)
    x = torch.randn(
        spec["batch"], spec["width"], generator=torch.Generator().manual_seed(1000 + rank)
    )
    if spec["kind"] == "allreduce":
        topo = None
    elif spec["kind"] == "decentralized":
        topo = topology.get_topology(spec["topology"], p, ranks_per_node=spec["ranks_per_node"])
    else:
        raise ValueError(f"kind must be 'allreduce' or 'decentralized', got {spec['kind']!r}")
    trainer = make_trainer(
        model,
        _adam_fn(spec["lr"]),
        topology=topo,
        bucket_mb=timing_bucket_mb(spec),
        algorithm=spec["algorithm"],
        overlap=bool(spec.get("overlap", True)),
    )
    ddp = trainer.ddp if isinstance(trainer, DecentralizedTrainer) else None
    k = 0

    def one() -> None:
        nonlocal k
        model.set_factor(float(factors[k, rank]))
        k += 1
        trainer.zero_grad()
        trainer.module(x).pow(2).mean().backward()
        trainer.step()

    def block() -> None:
        for _ in range(spec["block_iters"]):
            one()

    try:
        for _ in range(spec["warmup"]):
            one()
        if ddp is not None:
            ddp.reset_timing()
        stats = bench.time_fn(block, warmup=0, repeats=spec["blocks"])
    finally:
        trainer.close()
    out = {
        "rank": rank,
        "iteration_s": stats["median_s"] / spec["block_iters"],
        "iteration_ci_lo_s": stats["ci_lo_s"] / spec["block_iters"],
        "iteration_ci_hi_s": stats["ci_hi_s"] / spec["block_iters"],
        "block_s": stats["times_s"],
        # per-iteration time of each block: the repeats behind iteration_s
        "times_s": join_repeats(
            [b / spec["block_iters"] for b in stats["times_s"]]),
        "iterations": k,
    }
    if ddp is not None:
        out.update({key: float(v) for key, v in ddp.timing.items()})
    return out


def predict_training(
    spec: dict[str, Any], calib: dict[str, Any], net: netem.Network
) -> dict[str, Any]:
    """The runtime model's prediction of :func:`rank_time_training`'s ``iteration_s``.

    Inputs: the per-bucket compute of ``calib`` (a separate compute-only run), the link
    parameters of ``net`` (:func:`link_models`), the topology, and the same compute factors that
    the measured run injects. The statistic mirrors the measurement: iterations after
    ``warmup``, cut into ``blocks`` blocks, median block time / ``block_iters``.
    ``iteration_s`` is the overlapped model's (each group allreduce timed by
    :class:`OverlappedRing`; docs/experiments.md, E11), ``lockstep_iteration_s`` the lock-step
    closed form's (:func:`pipecomm.lab.training.dadam_runtime_model.group_allreduce_time`);
    ``spec["overlap"]`` False models the ablation arm (``simulate(..., overlap=False)``).

    Example::

        >>> from pipecomm.lab.workloads import tasks as workloads
        >>> from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network
        >>> spec = dict(workloads.timing_spec(p=8), kind="decentralized", topology="alternating-exp-ring")
        >>> calib = {"bucket_bytes": [1 << 20] * 2, "fwd_s": [0.002] * 2, "bwd_s": [0.003] * 2,
        ...          "step_s": [0.0005] * 2}                 # a compute-only run's per-bucket times
        >>> round(predict_training(spec, calib, make_network(DEFAULT_NETWORK))["iteration_s"], 4)
        0.045
    """
    intra, inter = link_models(net)
    total = spec["warmup"] + spec["blocks"] * spec["block_iters"]
    p, rpn = spec["p"], spec["ranks_per_node"]
    kw = dict(
        bucket_bytes=calib["bucket_bytes"],
        fwd_s=calib["fwd_s"],
        bwd_s=calib["bwd_s"],
        step_s=calib["step_s"],
        p=p,
        ranks_per_node=rpn,
        compute_cv=spec["compute_cv"],
        iterations=total,
        seed=spec["seed"],
        algorithm=spec["algorithm"],
        warmup=spec["warmup"],
        overlap=bool(spec.get("overlap", True)),
    )
    if spec["kind"] == "allreduce":
        steps = [[tuple(range(p))]]
    else:
        topo = topology.get_topology(spec["topology"], p, ranks_per_node=rpn)
        steps = [topo.groups(s) for s in range(topo.period or 1)]
        kw["topology"] = spec["topology"]
    ring = OverlappedRing(net, rpn, p, steps, calib["bucket_bytes"], spec["algorithm"])
    kind = "allreduce" if spec["kind"] == "allreduce" else "decentralized"
    r = runtime_model.simulate(kind, intra=ring.intra, inter=ring.inter,
                               collective_time_fn=ring, **kw)
    lock = runtime_model.simulate(kind, intra=intra, inter=inter, **kw)

    def stat(res: dict[str, Any]) -> float:
        its = np.asarray(res["iteration_s"]).reshape(spec["blocks"], spec["block_iters"])
        return float(np.median(its.sum(axis=1))) / spec["block_iters"]

    return {
        "iteration_s": stat(r),
        "lockstep_iteration_s": stat(lock),
        "mean_iteration_s": r["mean_iteration_s"],
        "comm_s": r["comm_s"],
        "lockstep_comm_s": lock["comm_s"],
        "compute_s": r["compute_s"],
    }


# ------------------------------------------------------------------------ gossip timing (E10)

_GROUPS: dict[tuple[int, tuple[int, ...]], Any] = {}


def _group(ranks: tuple[int, ...]) -> Any:
    """Process group of ``ranks`` (created on first use; all ranks call in the same order)."""
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(list(ranks), timeout=launch.group_timeout())
    return _GROUPS[key]


def rank_gossip_times(
    bucket_bytes: Sequence[int],
    topology_name: str,
    ranks_per_node: int,
    algorithm: str,
    warmup: int,
    iters: int,
) -> list[dict[str, Any]]:
    """On every rank: for each step of one period of the topology, time the gossip of all
    buckets (float32 buffers of ``bucket_bytes``) over that step's groups, every group at once.

    The buckets are all-reduced (``op="avg"``) asynchronously, back to back on the
    communication thread, as DecentralizedDataParallel launches them; the time of a step is
    :func:`pipecomm.lab.measure.bench.time_fn`'s (barrier, max over ranks, median over ``iters``).
    Returns one row per step (identical on every rank).
    """
    p, rank = dist.get_world_size(), dist.get_rank()
    topo = topology.get_topology(topology_name, p, ranks_per_node=ranks_per_node)
    for g in topo.distinct_groups():  # every rank creates the same groups in the same order
        if len(g) > 1:
            _group(g)
    bufs = [torch.ones(max(1, int(n) // 4)) for n in bucket_bytes]
    rows = []
    for step in range(topo.period or 1):
        g = topo.group_of(rank, step)
        pg = _group(g) if len(g) > 1 else None

        def gossip(pg: Any = pg) -> None:
            if pg is None:
                return
            hs = [
                collectives.allreduce(b, algorithm=algorithm, op="avg", group=pg, async_op=True)
                for b in bufs
            ]
            for h in hs:
                h.wait()

        st = bench.time_fn(gossip, warmup=warmup, repeats=iters)
        rows.append(
            {
                "step": step,
                **bench.columns(st),
                "groups": " ".join("(" + ",".join(map(str, g)) + ")" for g in topo.groups(step)),
            }
        )
    return rows


def method_name(kind: str, topology: str | None) -> str:
    """Display name: ``AllReduce`` or ``DAdam (<topology>)`` (AER for the alternating ring).

    Example::

        >>> method_name("decentralized", "alternating-exp-ring")
        'DAdam (AER)'
    """
    if kind == "allreduce":
        return "AllReduce"
    return f"DAdam ({'AER' if topology == 'alternating-exp-ring' else topology})"


def overlapped_gossip_time(
    groups: Sequence[Sequence[int]],
    bucket_bytes: Sequence[int],
    ranks_per_node: int,
    net: netem.Network,
    algorithm: str,
) -> float:
    """The overlapped model's time of one gossip step (E10's ``model_s``): the last rank's end
    of :func:`replay_ring_allreduces` of every bucket over ``groups``, all groups at once, gamma
    from :func:`pipecomm.lab.networks.kinds.link_models`.

    Example::

        >>> from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network
        >>> t = overlapped_gossip_time([(0, 1, 2, 3)], [1 << 20], 2, make_network(DEFAULT_NETWORK),
        ...                            "ring")
        >>> round(t, 4)                     # lock-step: 0.0615 s
        0.0433
    """
    if algorithm != "ring":
        raise ValueError(f"algorithm: the overlapped model replays 'ring' only, got "
                         f"{algorithm!r}")
    p = max(r for g in groups for r in g) + 1
    p = -(-p // ranks_per_node) * ranks_per_node
    gamma = link_models(net)[0].gamma
    return float(max(replay_ring_allreduces(groups, bucket_bytes, net, ranks_per_node, p,
                                            gamma)["finish_s"]))


def model_gossip_time(
    groups: Sequence[Sequence[int]],
    bucket_bytes: Sequence[int],
    ranks_per_node: int,
    net: netem.Network,
    algorithm: str,
) -> float:
    """Lock-step cost-model time of one gossip step (E10's ``lockstep_s``): the slowest group's allreduces of every bucket, back
    to back, with concurrent groups sharing the inter-node uplinks
    (:func:`pipecomm.lab.training.dadam_runtime_model.step_comm_times`).

    Example::

        >>> from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network
        >>> round(model_gossip_time([(0, 1, 2, 3)], [1 << 20], 2, make_network(DEFAULT_NETWORK), "ring"), 4)
        0.0615
    """
    intra, inter = link_models(net)
    times = runtime_model.step_comm_times(
        groups,
        list(bucket_bytes),
        ranks_per_node=ranks_per_node,
        intra=intra,
        inter=inter,
        algorithm=algorithm,
    )
    return float(max(sum(row) for row in times))



def bars_with_markers(ax: Any, data: Any, *, x: str, y: str, hue: str, order: list,
                      hue_order: list, marker: str, label: str) -> None:
    """Seaborn bars of ``y`` (measured) with a black dash per bar at ``marker`` (the model).

    Example::

        bars_with_markers(ax, df, x="topology", y="measured_ms", hue="world_size",
                          order=["complete", "AER"], hue_order=[4, 8], marker="model_ms",
                          label="model")
    """
    import seaborn as sns

    sns.barplot(data=data, x=x, y=y, hue=hue, order=order, hue_order=hue_order, ax=ax,
                palette="deep")
    width = 0.8 / len(hue_order)
    for j, h in enumerate(hue_order):
        for i, xv in enumerate(order):
            sel = data[(data[hue] == h) & (data[x] == xv)]
            if len(sel):
                ax.plot([i - 0.4 + width * (j + 0.5)], [sel[marker].iloc[0]], "k_",
                        markersize=14, mew=2, label=label if i == 0 and j == 0 else None)


def check_timing_workload(params: Params, *nonnegative: str) -> None:
    """Validate the timing workload shared by E11 and E12: the gossip/AllReduce algorithm
    (pipecomm's own), the layer and iteration counts, and ``fwd_ms``, ``bwd_ms`` and any other
    ``nonnegative`` numbers."""
    if params.algorithm not in ("lp", "ring", "be", "mst"):
        raise ValueError(
            f"parameter algorithm must be one of lp, ring, be, mst (pipecomm's own; "
            f"'torch' cannot run on the emulated network), got {params.algorithm!r}"
        )
    for key, lo in (
        ("width", 1),
        ("layers", 1),
        ("blocks", 1),
        ("block_iters", 1),
        ("warmup", 1),
        ("calib_iters", 2),
        ("seed", 0),
    ):
        check_int(key, getattr(params, key), lo)
    for key in ("fwd_ms", "bwd_ms", *nonnegative):
        v = getattr(params, key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise ValueError(f"parameter {key} must be a number >= 0, got {v!r}")


# ------------------------------------------------------------- the overlapped model (E10-E12)


def replay_ring_allreduces(
    groups: Sequence[Sequence[int]],
    bucket_bytes: Sequence[int],
    net: netem.Network,
    ranks_per_node: int,
    world_size: int,
    gamma: float,
) -> dict[str, Any]:
    """The overlapped model of one gossip step: every group's ring allreduce of every bucket,
    back to back on each rank, all groups at once, replayed message by message on the
    emulator's own port arithmetic (:class:`pipecomm.lab.networks.netem.LinkSchedule`: latency in flight,
    one out- and one in-port per rank, one up- and one downlink per node, cut-through hops).

    Member ``j`` of a group of ``m`` sends message ``k`` (chunk ``j - k`` mod m, k = 0 .. 2m-3)
    to its right neighbour; message ``k >= 1`` leaves when message ``k - 1`` has arrived from
    the left (the ring's data dependency), after its combine (``gamma`` s/byte) in the
    reduce-scatter (k <= m - 1). A rank's next bucket starts when its previous allreduce has
    finished (all its receives arrived, all its sends delivered), as on the progress engine's
    one communication thread. docs/experiments.md (E10) derives where this differs from the
    lock-step closed form ``2(m-1)(alpha + n/m beta)`` (Patarasuk & Yuan 2009): a ring over two
    levels alternates fast and slow edges, and the messages of concurrent groups queue on a
    shared uplink while each other's latency is in flight.

    Args: ``groups`` of global ranks (disjoint; groups of one cost nothing), ``bucket_bytes``
    (float32 buckets, all-reduced in this order), the emulated ``net``, ``ranks_per_node``,
    ``world_size``, ``gamma`` (seconds per byte combined).
    Returns ``finish_s`` (per rank: when its last allreduce finished, all ranks starting at 0)
    and ``op_s`` (``op_s[g][i]``: when group g's allreduce of bucket i finished on its last
    member).

    Example::

        >>> from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network
        >>> r = replay_ring_allreduces([(0, 1, 2, 3)], [1 << 20], make_network(DEFAULT_NETWORK), 2,
        ...                            4, 0.0)
        >>> round(max(r["finish_s"]), 4)   # 3 intra + 3 inter edges (41.7 ms) and a queue, not 6 inter edges (61.5 ms)
        0.0433
    """
    import heapq

    sched = netem.LinkSchedule(net, world_size, ranks_per_node)
    table = sched.new_table()
    members = [tuple(g) for g in groups if len(g) > 1]
    sizes = [max(1, int(n) // 4) for n in bucket_bytes]  # float32 elements
    chunk_bytes = []
    for n in sizes:
        per_m = {}
        for g in members:
            o = [0]
            q, r = divmod(n, len(g))
            for c in range(len(g)):
                o.append(o[-1] + q + (1 if c < r else 0))
            per_m[len(g)] = [4 * (b - a) for a, b in zip(o, o[1:])]
        chunk_bytes.append(per_m)
    finish = [0.0] * world_size
    op_s = [[0.0] * len(sizes) for _ in groups]
    where = {}
    for gi, g in enumerate(groups):
        for j, r in enumerate(g):
            where[r] = (gi, j)
    # per rank: current bucket, next send index, time cursor, arrivals, deliveries of sends
    state = {r: {"i": 0, "k": 0, "t": 0.0, "recv": {}, "sent": []} for g in members for r in g}
    heap: list[tuple[float, int, int]] = []

    def advance(r: int) -> None:
        st = state[r]
        gi, j = where[r]
        g = groups[gi]
        m = len(g)
        while st["i"] < len(sizes):
            k = st["k"]
            last = 2 * m - 2
            if k < last:
                if k == 0:
                    t = st["t"]
                elif (st["i"], k - 1) in st["recv"]:
                    got = st["recv"][(st["i"], k - 1)]
                    c = chunk_bytes[st["i"]][m][(j - k) % m]
                    t = max(st["t"], got) + (gamma * c if k <= m - 1 else 0.0)
                else:
                    return
                heapq.heappush(heap, (t, r, k))
                st["k"] = -1 - k  # pending
                return
            if k == last and all((st["i"], x) in st["recv"] for x in range(last)):
                end = max([st["t"], *(st["recv"][(st["i"], x)] for x in range(last)),
                           *st["sent"]])
                op_s[gi][st["i"]] = max(op_s[gi][st["i"]], end)
                st.update(i=st["i"] + 1, k=0, t=end, sent=[])
                finish[r] = end
                continue
            return

    for r in state:
        advance(r)
    while heap:
        t, r, k = heapq.heappop(heap)
        st = state[r]
        gi, j = where[r]
        g = groups[gi]
        m = len(g)
        right = g[(j + 1) % m]
        c = chunk_bytes[st["i"]][m][(j - k) % m]
        deliver = sched.post(table, r, right, int(c), t, prune_before=t)
        st["sent"].append(deliver)
        st["t"] = t
        st["k"] = k + 1
        state[right]["recv"][(st["i"], k)] = deliver
        advance(right)
        advance(r)
    return {"finish_s": finish, "op_s": op_s}


class OverlappedRing:
    """The overlapped model's time of one group's ring allreduce, as the ``collective_time_fn``
    of :func:`pipecomm.lab.training.dadam_runtime_model.simulate`: the runtime model's schedule
    (overlap, varying compute, launch order) is unchanged; only the time of each group's
    allreduce of a bucket comes from :func:`replay_ring_allreduces` of that bucket with all the
    groups of its step at once, in place of the lock-step closed form. The runtime model asks
    for a time by group size, level and uplink streams (its own cache key,
    :func:`pipecomm.lab.training.dadam_runtime_model.step_comm_times`); this looks it up among the
    replays of every step of ``steps`` (the slowest group with that key).

    Args: ``net`` (the emulated network), ``ranks_per_node``, ``world_size``, ``steps`` (the
    groups of each distinct step), ``bucket_bytes``, ``algorithm`` (only ``"ring"`` is
    replayed). Pass ``intra=ring.intra, inter=ring.inter, collective_time_fn=ring`` to
    ``simulate``.

    Example::

        >>> from pipecomm.lab.networks.kinds import DEFAULT_NETWORK, make_network
        >>> net = make_network(DEFAULT_NETWORK)
        >>> ring = OverlappedRing(net, 2, 8, [[tuple(range(8))]], [1 << 20] * 2, "ring")
        >>> out = runtime_model.simulate("allreduce", bucket_bytes=[1 << 20] * 2, fwd_s=0.005,
        ...                              bwd_s=0.01, p=8, ranks_per_node=2, iterations=10,
        ...                              intra=ring.intra, inter=ring.inter,
        ...                              collective_time_fn=ring)
        >>> round(out["mean_iteration_s"], 4)
        0.1734
    """

    def __init__(self, net: netem.Network, ranks_per_node: int, world_size: int,
                 steps: Sequence[Sequence[Sequence[int]]], bucket_bytes: Sequence[float],
                 algorithm: str) -> None:
        if algorithm != "ring":
            raise ValueError(f"algorithm: the overlapped model replays 'ring' only, got "
                             f"{algorithm!r}")
        import dataclasses

        intra, inter = link_models(net)
        self.intra, self.inter = intra, dataclasses.replace(inter)  # told apart by identity
        self.table: dict[tuple[int, bool, int, int], float] = {}
        rpn = ranks_per_node
        for groups in steps:
            load = runtime_model.uplink_streams(groups, rpn, algorithm)
            for nb in dict.fromkeys(int(round(b)) for b in bucket_bytes):
                op = replay_ring_allreduces(groups, [nb], net, rpn, world_size,
                                            intra.gamma)["op_s"]
                for gi, g in enumerate(groups):
                    if len(g) < 2:
                        continue
                    nodes = {r // rpn for r in g}
                    spans = len(nodes) > 1
                    s = max(load.get(n, 1) for n in nodes) if spans else 1
                    key = (len(g), spans, s, nb)
                    self.table[key] = max(self.table.get(key, 0.0), op[gi][0])

    def __call__(self, algorithm: str, nbytes: int, m: int, link: Any) -> float:
        spans = link is not self.intra
        s = round(link.beta / self.inter.beta) if spans else 1
        key = (int(m), spans, int(s), int(nbytes))
        if key not in self.table:
            raise KeyError(f"the overlapped model has no replay of group size {m}, "
                           f"{'across nodes' if spans else 'inside a node'}, {s} uplink "
                           f"stream(s), {nbytes} bytes")
        return self.table[key]
