"""E15 — pipecomm against the backend's built-in on a real shaped network: collectives and
whole training steps.

Everything runs on :class:`pipecomm.lab.networks.cluster.VirtualCluster` s of single-port nodes (one rank
per Linux network namespace, each node's link shaped both ways to ``bandwidth_Bps`` by ``tc
tbf``, real TCP through gloo, one torchrun agent per node); the nodes share this host's cores.

0. **LP's blocks** (``section="lp-plan"``), when ``lp_plan_blocks`` lists any: LP broadcasts of
   ``lp_plan_bytes`` at p = max(``world_sizes``) with each of those blocks, whose step times fit
   the link LP's default blocks are planned on from then on (:func:`pipeline_link`); without
   them LP plans on the link calibration (a ping-pong of ``link_sizes``).
1. **Collectives** (``section="collective"``): every op of ``cases`` with pipecomm's algorithm
   and gloo's own (``"torch"``: ``dist.broadcast`` / ``reduce`` / ``all_reduce`` on a gloo group),
   at each p of ``world_sizes`` (ranks 0..p-1 of one cluster of max(p) nodes) and each size of
   ``sizes``; the algorithms of a point are timed round-robin (:func:`pipecomm.lab.measure.sweep.
   measure_points` with ``interleave``), each repeat a separate call from a common start, so
   repeat i of two algorithms is a pair. Beside each point its link limit
   (:func:`pipecomm.lab.measure.bench.link_limit_s`: ``n / B`` for broadcast and reduce, ``2 (p - 1) / p
   * n / B`` for allreduce).
2. **auto** (``section="auto"``), when ``auto_cases`` names any: on the same ranks, first
   auto's table (:func:`pipecomm.lab.measure.autotune.rank_tune`: every algorithm at each op of
   ``auto_cases``, p and size of ``auto_sizes``, ``tune_iters`` repeats, one job per op;
   ``section="tune"``), then ``algorithm="auto"`` timed round-robin (one job per op) with the
   algorithms it is compared with, each row saying what auto ran (``chose``).
3. **Training steps** (``section="training"``): ``examples/train_gpt.py`` (:mod:`pipecomm.lab.
   shaped_training`) on a cluster of ``train_nodes`` nodes for each configuration of
   ``train_batch`` (name -> sequences per rank per step; the model is fixed: ``n_layer`` x
   ``n_embd``) and each of its ``train_strategies``, every strategy once per seed, the order
   rotated from seed to seed. A run's step time is rank 0's median after ``warmup_steps``; the
   seeds are the independent repeats.

A training strategy with ``:auto`` first has auto's table measured on the training cluster
(allreduce at p = ``train_nodes`` and the sizes of ``train_tune_sizes``), which its runs read
(``PIPECOMM_TUNE_FILE``).

Claims: C15.1-C15.3 and C15.2b on the collectives, C15.6-C15.9 on auto, C15.4, C15.5 and
C15.10 on the training steps (artifact/claims.yaml).
Needs root, iproute2 and tc tbf (:func:`pipecomm.lab.networks.cluster.available`); profile ``shaped``.

Run::

    python -m pipecomm.lab.experiments.e15_against_builtin --out results/manual/E15
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.collectives import builtin, lp
from pipecomm.lab import checks, claims, experiment, results
from pipecomm.lab.cli import main
from pipecomm.lab.measure import autotune, bench, stats, sweep
from pipecomm.lab.networks import cluster, cost, netem
from pipecomm.lab.networks.kinds import ranks_on
from pipecomm.lab.training import shaped_training

ID = "E15"
NOTEBOOK = "15_against_builtin"
OPS = ("broadcast", "reduce", "allreduce")
ALGORITHMS = ("lp", "mst", "be", "ring", "torch")
AUTO = "auto"


@dataclass(frozen=True)
class Params(experiment.Params):
    """E15's parameters with their quick defaults (the notebook's parameters cell); the
    ``shaped`` profile in artifact/profiles/ overrides them."""

    bandwidth_Bps: float = 20e6
    world_sizes: list[int] = field(default_factory=lambda: [2])
    sizes: list[int] = field(default_factory=lambda: [1 << 20])
    cases: dict[str, list[str]] = field(default_factory=lambda: {
        "broadcast": ["lp", "torch"], "allreduce": ["ring", "torch"]})
    iters: int = 3
    warmup: int = 1
    auto_cases: dict[str, list[str]] = field(default_factory=lambda: {
        "allreduce": ["ring", "torch", "auto"]})
    auto_sizes: list[int] = field(default_factory=lambda: [1 << 20])
    tune_iters: int = 1
    train_tune_sizes: list[int] = field(default_factory=lambda: [1 << 20, 4 << 20])
    link_sizes: list[int] = field(default_factory=lambda: [1 << 20, 4 << 20])
    link_iters: int = 5
    lp_plan_blocks: list[int] = field(default_factory=list)
    lp_plan_bytes: int = 4 << 20
    train_nodes: int = 2
    train_batch: dict[str, int] = field(default_factory=lambda: {"comm-bound": 8})
    train_strategies: dict[str, list[str]] = field(default_factory=lambda: {
        "comm-bound": ["ddp", "ddp-pipecomm:ring"]})
    seeds: list[int] = field(default_factory=lambda: [0])
    steps: int = 6
    warmup_steps: int = 2
    n_layer: int = 4
    n_embd: int = 128
    block_size: int = 64
    timeout_s: float = 600.0

    def validate(self) -> None:
        if not 1e5 <= self.bandwidth_Bps <= 1e10:
            raise ValueError(f"parameter bandwidth_Bps must be in [1e5, 1e10] B/s, got "
                             f"{self.bandwidth_Bps!r}")
        if not self.world_sizes or any(not 2 <= q <= cluster.MAX_NODES for q in self.world_sizes):
            raise ValueError(f"parameter world_sizes must list p in [2, {cluster.MAX_NODES}] "
                             f"(one node per rank), got {self.world_sizes!r}")
        for name in ("sizes", "link_sizes", "auto_sizes", "train_tune_sizes"):
            vals = getattr(self, name)
            if not vals or any(n < 1024 or n % 4 for n in vals):
                raise ValueError(f"parameter {name} must list message sizes >= 1024 bytes, "
                                 f"multiples of 4 (float32), got {vals!r}")
        if self.lp_plan_bytes < 1024 or self.lp_plan_bytes % 4:
            raise ValueError(f"parameter lp_plan_bytes must be a message size >= 1024 bytes, a "
                             f"multiple of 4 (float32), got {self.lp_plan_bytes!r}")
        if self.lp_plan_blocks and (len(set(self.lp_plan_blocks)) < 2 or any(
                b < 8 or b % 4 or b > self.lp_plan_bytes for b in self.lp_plan_blocks)):
            raise ValueError(f"parameter lp_plan_blocks must list >= 2 distinct block sizes, "
                             f"multiples of 4 in [8, lp_plan_bytes={self.lp_plan_bytes}], got "
                             f"{self.lp_plan_blocks!r}")
        if len(self.link_sizes) < 2:
            raise ValueError(f"parameter link_sizes needs >= 2 sizes to fit alpha and beta, got "
                             f"{self.link_sizes!r}")
        if any(op not in OPS for op in self.cases) or any(
                not algs or any(a not in ALGORITHMS for a in algs) for algs in self.cases.values()):
            raise ValueError(f"parameter cases must map ops from {OPS} to algorithms from "
                             f"{ALGORITHMS}, got {self.cases!r}")
        if any(op not in OPS for op in self.auto_cases) or any(
                AUTO not in algs or any(a not in (*ALGORITHMS, AUTO) for a in algs)
                for algs in self.auto_cases.values()):
            raise ValueError(f"parameter auto_cases must map ops from {OPS} to lists with "
                             f"{AUTO!r} and algorithms from {ALGORITHMS}, got "
                             f"{self.auto_cases!r}")
        if not 2 <= self.train_nodes <= cluster.MAX_NODES:
            raise ValueError(f"parameter train_nodes must be in [2, {cluster.MAX_NODES}], got "
                             f"{self.train_nodes!r}")
        if set(self.train_batch) != set(self.train_strategies):
            raise ValueError(f"parameters train_batch and train_strategies must name the same "
                             f"configurations, got {sorted(self.train_batch)} and "
                             f"{sorted(self.train_strategies)}")
        if any(b < 1 for b in self.train_batch.values()):
            raise ValueError(f"parameter train_batch must map configurations to batch sizes "
                             f">= 1, got {self.train_batch!r}")
        for specs in self.train_strategies.values():
            for spec in specs:
                try:
                    shaped_training.check_strategy(spec)
                except ValueError as exc:
                    raise ValueError(f"parameter train_strategies: {exc}") from None
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"parameter seeds must list distinct seeds, got {self.seeds!r}")
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"parameter steps ({self.steps!r}) must exceed warmup_steps "
                             f"({self.warmup_steps!r}) >= 0")
        for name, minimum in (("iters", 1), ("warmup", 0), ("link_iters", 1), ("tune_iters", 1),
                              ("n_layer", 1),
                              ("n_embd", 4), ("block_size", 1)):
            if getattr(self, name) < minimum:
                raise ValueError(f"parameter {name} must be >= {minimum}, got "
                                 f"{getattr(self, name)!r}")
        checks.positive_float(self, "timeout_s")


DEFAULTS = Params.defaults()


def plan(params: Params, auto: bool = False) -> list[dict[str, Any]]:
    """The timed collective points: per p, op and size, every algorithm of ``cases`` (the
    algorithms of one comparison consecutive, so that they are timed round-robin); ``auto``:
    those of ``auto_cases`` at ``auto_sizes``.

    Example::

        >>> [(pt["op"], pt["algorithm"], pt["p"]) for pt in plan(Params.make())]
        [('broadcast', 'lp', 2), ('broadcast', 'torch', 2), ('allreduce', 'ring', 2), ('allreduce', 'torch', 2)]
        >>> [pt["algorithm"] for pt in plan(Params.make(), auto=True)]
        ['ring', 'torch', 'auto']
    """
    cases, sizes = (params.auto_cases, params.auto_sizes) if auto else (params.cases,
                                                                        params.sizes)
    return [{"op": op, "algorithm": alg, "nbytes": n, "p": q, "warmup": params.warmup,
             "iters": params.iters, "first_warmup": True}
            for q in sorted(params.world_sizes) for op, algs in cases.items()
            for n in sizes for alg in algs]


def write_tuned(rows: list[dict[str, Any]], cfg: dict[str, Any],
                seconds: float) -> list[dict[str, Any]]:
    """On every rank: auto's table of the tuning ``rows`` (rank 0's, timed in earlier jobs)
    written to ``cfg["out"]`` (:func:`pipecomm.lab.measure.autotune.rank_write`); rank 0 returns
    its rows (:func:`table_rows`), the others ``[]``.

    Example::

        ranks.run(write_tuned, rows, {"repeats": 3, "link": None, "out": "/tmp/tune.json"}, 60.0)
    """
    tuned = autotune.rank_write(rows, cfg, seconds)
    return [] if tuned is None else table_rows(tuned["doc"])


def measure_tuned(points: list[dict[str, Any]], path: str) -> list[dict[str, Any]]:
    """On every rank: ``points`` timed round-robin with auto's table at ``path``
    (``PIPECOMM_TUNE_FILE``); rank 0 returns the rows, the others ``[]``.

    Example::

        ranks.run(measure_tuned, plan(params, auto=True), "/tmp/tune.json")
    """
    os.environ[builtin.ENV_TUNE_FILE] = path
    return sweep.measure_points(points, None, True)


def _tune_and_measure(ranks: Any, params: Params, path: str) -> tuple[list, list]:
    """auto's table on ``ranks`` (one job per op of ``auto_cases``: each within the job
    timeout on a slow link), then auto's points (one job per op): (table rows, timed rows)."""
    cfg = {"ops": list(params.auto_cases), "p": sorted(params.world_sizes),
           "sizes": params.auto_sizes, "algorithms": list(ALGORITHMS),
           "repeats": params.tune_iters, "warmup": 1, "link": None, "out": path}
    start, rows = time.monotonic(), []
    for op in params.auto_cases:
        rows += ranks.run(sweep.measure_points, autotune.points_of({**cfg, "ops": [op]}), None,
                          True, timeout_s=params.timeout_s)[0]
    tune = ranks.run(write_tuned, rows, cfg, time.monotonic() - start,
                     timeout_s=params.timeout_s)[0]
    auto = [row for op in params.auto_cases
            for row in ranks.run(measure_tuned, [pt for pt in plan(params, auto=True)
                                                 if pt["op"] == op], path,
                                 timeout_s=params.timeout_s)[0]]
    return tune, auto


def pipeline_link(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """LP's pipeline step as a link ``(alpha_s, bandwidth_Bps)``: the alpha-beta fit
    (:func:`pipecomm.lab.networks.cost.fit_alpha_beta`) of the time per step, ``time_s / (k + p -
    2)`` with ``k = ceil(n / b)``, against the block ``b`` of LP broadcasts of one message at
    several blocks -- the model :func:`pipecomm.collectives.lp.default_block_bytes` plans on,
    fitted on the pipeline itself (docs/algorithms.md, "Block size of LP").

    Example::

        >>> rows = [{"nbytes": 1 << 22, "world_size": 8, "block_bytes": b,
        ...          "time_s": (-(-(1 << 22) // b) + 6) * (1e-4 + b / 13e6)} for b in (16384, 65536)]
        >>> a, bw = pipeline_link(rows); round(a * 1e6, 1), round(bw / 1e6, 1)
        (100.0, 13.0)
    """
    blocks = [int(r["block_bytes"]) for r in rows]
    steps = [r["time_s"] / (-(-int(r["nbytes"]) // b) + int(r["world_size"]) - 2)
             for r, b in zip(rows, blocks)]
    alpha, beta = cost.fit_alpha_beta(blocks, steps)
    if beta <= 0:
        raise ValueError(f"LP's step time does not grow with its block ({blocks} bytes: "
                         f"{[round(s * 1e3, 3) for s in steps]} ms): no link to plan on")
    return float(alpha), float(1.0 / beta)


def _plan_lp_blocks(ranks: Any, params: Params) -> list[dict[str, Any]]:
    """With ``lp_plan_blocks``: LP broadcasts of ``lp_plan_bytes`` at p = max(``world_sizes``)
    and each of those blocks (round-robin, ``tune_iters`` repeats), their :func:`pipeline_link`
    set on every rank for LP's default blocks (:func:`pipecomm.collectives.lp.set_link`);
    the rows (``alpha_s``, ``bandwidth_Bps`` of the fit beside each), else ``[]`` (LP plans on
    the link calibration)."""
    if not params.lp_plan_blocks:
        return []
    q = max(params.world_sizes)
    points = [{"op": "broadcast", "algorithm": "lp", "nbytes": params.lp_plan_bytes, "p": q,
               "warmup": 1, "iters": params.tune_iters, "first_warmup": True, "block_bytes": b}
              for b in params.lp_plan_blocks]
    rows = ranks.run(sweep.measure_points, points, None, True, timeout_s=params.timeout_s)[0]
    alpha, bandwidth = pipeline_link(rows)
    ranks.run(lp.set_link, alpha, bandwidth, timeout_s=params.timeout_s)
    return [{**r, "alpha_s": alpha, "bandwidth_Bps": bandwidth} for r in rows]


def table_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A tuning table's points as rows (``op``, ``world_size``, ``nbytes``, ``algorithm``,
    ``time_s``, ``fastest``: what auto picks there).

    Example::

        >>> doc = {"points": {"broadcast:cpu:8:float32": {"16": {"lp": 1.0, "torch": 4.0}}}}
        >>> [(r["algorithm"], r["fastest"]) for r in table_rows(doc)]
        [('lp', True), ('torch', False)]
    """
    best = {(op, q, n): b for op, q, n, b, _ in autotune.choices(doc)}
    return [{"op": op, "world_size": int(q), "nbytes": int(n), "algorithm": a, "time_s": t,
             "fastest": best[(op, int(q), int(n))] == a}
            for key, sizes in sorted(doc["points"].items())
            for op, _, q, _ in [key.split(":")]
            for n, times in sorted(sizes.items(), key=lambda kv: int(kv[0]))
            for a, t in times.items()]


@contextlib.contextmanager
def _tune_file(path: str | None) -> Iterator[None]:
    """``PIPECOMM_TUNE_FILE=path`` in this process (inherited by the clusters it starts)."""
    old = os.environ.get(builtin.ENV_TUNE_FILE)
    if path is not None:
        os.environ[builtin.ENV_TUNE_FILE] = path
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(builtin.ENV_TUNE_FILE, None)
        else:
            os.environ[builtin.ENV_TUNE_FILE] = old


def run(**params: Any) -> pd.DataFrame:
    """Time the collectives, then the training steps, on shaped clusters (module docstring)."""
    params = Params.make(**params)
    ok, why = cluster.available()
    if not ok:
        raise RuntimeError(f"E15 needs the virtual cluster (root, iproute2, tc tbf): {why}")
    nodes = max(params.world_sizes)
    with ranks_on("shaped", nodes, netem.Network(0.0, params.bandwidth_Bps), None,
                  timeout_s=params.timeout_s, calibration_sizes=params.link_sizes,
                  calibration_iters=params.link_iters) as ranks:
        planned = _plan_lp_blocks(ranks, params)
        rows = ranks.run(sweep.measure_points, plan(params), None, True,  # interleaved
                         timeout_s=params.timeout_s)[0]
        where = ranks.text
        tune, auto = [], []
        if params.auto_cases:
            with tempfile.TemporaryDirectory(prefix="e15-tune") as tmp:
                tune, auto = _tune_and_measure(ranks, params, os.path.join(tmp, "tune.json"))
    frames = [pd.DataFrame(planned).assign(section="lp-plan"),
              pd.DataFrame(rows).assign(section="collective"),
              pd.DataFrame(auto).assign(section="auto"),
              pd.DataFrame(tune).assign(section="tune", config="collective")]
    coll = pd.concat([f for f in frames if len(f)], ignore_index=True).assign(network=where)
    coll["link_s"] = [bench.link_limit_s(r.op, int(r.nbytes), int(r.world_size),
                                         params.bandwidth_Bps) for r in coll.itertuples()]
    train = []
    net = cluster.VirtualCluster(params.train_nodes, 1, params.bandwidth_Bps,
                                 timeout_s=params.timeout_s)
    total = len(params.seeds) * sum(map(len, params.train_strategies.values()))
    runs = results.Runs(total=total, desc="E15 training runs")
    with net, tempfile.TemporaryDirectory(prefix="e15-tune") as tmp:
        path = None
        if any(spec.partition("+")[0].endswith(":" + AUTO)
               for specs in params.train_strategies.values() for spec in specs):
            path = os.path.join(tmp, "tune.json")
            cfg = {"ops": ["allreduce"], "p": [params.train_nodes],
                   "sizes": params.train_tune_sizes, "algorithms": list(ALGORITHMS),
                   "repeats": params.tune_iters, "warmup": 1, "link": None, "out": path}
            with net.job() as job:
                tuned = job.run(autotune.rank_tune, cfg, timeout_s=params.timeout_s)[0]
            train.append(pd.DataFrame(table_rows(tuned["doc"])).assign(
                section="tune", config="training", network=net.describe()))
        for name, specs in params.train_strategies.items():
            config = {"steps": params.steps, "warmup_steps": params.warmup_steps,
                      "n_layer": params.n_layer, "n_embd": params.n_embd,
                      "batch_size": params.train_batch[name], "block_size": params.block_size,
                      "timeout_s": params.timeout_s}
            with _tune_file(path):
                rows = shaped_training.run_rounds(net, specs, params.seeds, config, runs=runs)
            train.append(pd.DataFrame(rows).assign(
                section="training", config=name, batch_size=config["batch_size"],
                network=net.describe()))
    runs.close()
    return pd.concat([coll, *train], ignore_index=True)


def versus_builtin(df: pd.DataFrame) -> pd.DataFrame:
    """Per collective point of pipecomm's algorithms: median time, ratio to the built-in of the
    same (op, size, p) -- the median of the paired ratios of the repeats with its bootstrap 95%
    interval (:func:`pipecomm.lab.measure.stats.paired_ratio_ci`) -- and time over the link limit with
    its interval (the median's).

    Example::

        >>> df = pd.DataFrame([{"section": "collective", "op": "broadcast", "algorithm": a,
        ...                     "nbytes": 1 << 24, "world_size": 8, "time_s": t, "ci_lo_s": t,
        ...                     "ci_hi_s": t, "link_s": 1.1,
        ...                     "times_s": stats.join_repeats([t, 1.02 * t, 0.98 * t])}
        ...                    for a, t in (("lp", 2.0), ("torch", 6.0))])
        >>> versus_builtin(df)[["op", "algorithm", "ratio", "over_limit"]].round(3)
                  op algorithm  ratio  over_limit
        0  broadcast        lp  0.333       1.818
    """
    col = df[df.section == "collective"]
    keys = ["op", "nbytes", "world_size"]
    cols = [*keys, "algorithm", "time_s", "builtin_s", "ratio", "ratio_lo", "ratio_hi", "link_s",
            "over_limit", "over_limit_lo", "over_limit_hi", "block_bytes"]
    out = []
    for key, g in (col.groupby(keys, sort=True) if len(col) else ()):
        base = g[g.algorithm == "torch"]
        for r in g[g.algorithm != "torch"].itertuples():
            ratio = (float("nan"),) * 3
            if len(base):
                ratio = stats.paired_ratio_ci(stats.repeats(r.times_s),
                                              stats.repeats(base.times_s.iloc[0]))
            out.append({**dict(zip(keys, key)), "algorithm": r.algorithm, "time_s": r.time_s,
                        "builtin_s": base.time_s.iloc[0] if len(base) else float("nan"),
                        "ratio": ratio[0], "ratio_lo": ratio[1], "ratio_hi": ratio[2],
                        "link_s": r.link_s, "over_limit": r.time_s / r.link_s,
                        "over_limit_lo": r.ci_lo_s / r.link_s,
                        "over_limit_hi": r.ci_hi_s / r.link_s,
                        "block_bytes": getattr(r, "block_bytes", float("nan"))})
    return pd.DataFrame(out, columns=cols)


def versus_auto(df: pd.DataFrame) -> pd.DataFrame:
    """Per point of the auto section: what auto ran (``chose``), its median time, and its paired
    ratio (median of the repeats' ratios, bootstrap 95% interval) to each algorithm timed beside
    it (``vs``), to the built-in and to ``best``, the one of them with the lowest median.

    Example::

        >>> df = pd.DataFrame([{"section": "auto", "op": "broadcast", "algorithm": a,
        ...                     "nbytes": 1 << 24, "world_size": 8, "time_s": t, "chose": c,
        ...                     "times_s": stats.join_repeats([t, 1.02 * t, 0.98 * t])}
        ...                    for a, t, c in (("lp", 2.0, None), ("torch", 6.0, None),
        ...                                    ("auto", 2.1, "lp"))])
        >>> versus_auto(df)[["vs", "chose", "ratio"]].round(2)
              vs chose  ratio
        0     lp    lp   1.05
        1  torch    lp   0.35
        2   best    lp   1.05
    """
    col = df[df.section == "auto"] if "section" in df else df.iloc[:0]
    keys = ["op", "nbytes", "world_size"]
    cols = [*keys, "vs", "against", "chose", "time_s", "ratio", "ratio_lo", "ratio_hi"]
    out = []
    for key, g in (col.groupby(keys, sort=True) if len(col) else ()):
        auto, others = g[g.algorithm == AUTO], g[g.algorithm != AUTO]
        if auto.empty or others.empty:
            continue
        a = auto.iloc[0]
        best = others.loc[others.time_s.idxmin()]
        for vs, r in [*((o.algorithm, o) for _, o in others.iterrows()), ("best", best)]:
            ratio = stats.paired_ratio_ci(stats.repeats(a.times_s), stats.repeats(r.times_s))
            out.append({**dict(zip(keys, key)), "vs": vs, "against": r.algorithm,
                        "chose": a.chose, "time_s": a.time_s, "ratio": ratio[0],
                        "ratio_lo": ratio[1], "ratio_hi": ratio[2]})
    return pd.DataFrame(out, columns=cols)


def step_tables(df: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """Per training configuration: :func:`pipecomm.lab.training.shaped_training.step_table` (ratios to
    stock DDP, ``ddp``)."""
    tr = df[df.section == "training"]
    return {name: shaped_training.step_table(g) for name, g in tr.groupby("config", sort=False)}


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One line per collective point (time, ratio to the built-in, time over the link limit)
    and per training strategy (ms per step, ratio to stock DDP, MB per rank per step, losses);
    failed training runs are listed with their error."""
    lines = []
    planned = df[df.section == "lp-plan"] if "section" in df else df.iloc[:0]
    if len(planned):
        r = planned.iloc[0].to_dict()  # a Series' .nbytes is its own memory size
        steps = ", ".join(f"{b / 1024:g} KiB {t * 1e3:.0f} ms" for b, t in
                          zip(planned.block_bytes, planned.time_s))
        lines.append({"what": f"LP's blocks planned on its pipeline (broadcast, "
                              f"{r['nbytes'] / (1 << 20):g} MiB, p={int(r['world_size'])})",
                      "value": f"{steps}: alpha {r['alpha_s'] * 1e6:.0f} us, "
                               f"{r['bandwidth_Bps'] / 1e6:.1f} MB/s"})
    for r in versus_builtin(df).itertuples():
        block = (f"; {r.block_bytes / 1024:.0f} KiB blocks" if pd.notna(r.block_bytes)
                 and r.block_bytes > 0 else "")
        lines.append({"what": f"{r.op} {r.algorithm}, {r.nbytes / (1 << 20):g} MiB, "
                              f"p={int(r.world_size)}",
                      "value": f"{r.time_s * 1e3:.0f} ms; vs built-in "
                               f"{claims.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, '.2f')}x "
                               f"({r.builtin_s * 1e3:.0f} ms); "
                               f"{r.over_limit:.2f}x the link limit{block}"})
    for r in versus_auto(df).itertuples():
        lines.append({"what": f"auto {r.op}, {r.nbytes / (1 << 20):g} MiB, p={int(r.world_size)}"
                              f" vs {r.vs}" + (f" ({r.against})" if r.vs == "best" else ""),
                      "value": f"ran {r.chose}; {r.time_s * 1e3:.0f} ms; "
                               f"{claims.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, '.2f')}x"})
    for name, t in step_tables(df).items():
        for r in t.itertuples():
            lines.append({"what": f"{name}: {r.strategy}",
                          "value": f"{r.step_ms:.0f} [{r.step_lo:.0f}, {r.step_hi:.0f}] ms/step; "
                                   f"vs ddp {claims.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, '.2f')}"
                                   f"x; {r.MB_per_rank_step:.2f} MB/rank/step; loss {r.loss:.4f} "
                                   f"(spread {r.loss_spread:.4f}), val {r.val_loss:.4f}"})
    tr = df[df.section == "training"]
    if "error" in tr:
        for r in tr[tr.error.astype(object).fillna("").ne("")].itertuples():
            lines.append({"what": f"{r.config}: {r.strategy} seed {int(r.seed)}",
                          "value": f"FAILED: {r.error[-200:]}"})
    return pd.DataFrame(lines, columns=["what", "value"])


def plot(df: pd.DataFrame, **params: Any):
    """Top, one panel per op: time against message size per algorithm at the largest p, with
    the link limit. Bottom, one panel per training configuration: ms per step per strategy, the
    median over seeds with its 95% interval (stock DDP and torch's own hook in grey)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    col = df[df.section == "collective"]
    ops = [op for op in OPS if op in set(col.op)]
    tables = step_tables(df)
    ncols = max(len(ops), len(tables), 1)
    nrows = int(bool(ops)) + int(bool(tables)) or 1
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.8 * ncols, 4 * nrows), squeeze=False)
    for ax in axes.flat:
        ax.set_visible(False)
    q = int(col.world_size.max()) if len(col) else 0
    for ax, op in zip(axes[0], ops):
        ax.set_visible(True)
        g = col[(col.op == op) & (col.world_size == q)]
        for alg, h in g.groupby("algorithm"):
            h = h.sort_values("nbytes")
            err = np.vstack([h.time_s - h.ci_lo_s, h.ci_hi_s - h.time_s])
            label = "built-in (gloo)" if alg == "torch" else f"pipecomm {alg}"
            ax.errorbar(h.nbytes, h.time_s, yerr=err, fmt="-o", ms=4, capsize=2,
                        color=sweep.ALG_COLORS.get(alg, "k"), label=label)
        a = df[(df.section == "auto") & (df.op == op) & (df.world_size == q)
               & (df.algorithm == AUTO)] if "section" in df else df.iloc[:0]
        if len(a):
            ax.errorbar(a.nbytes, a.time_s, yerr=np.vstack([a.time_s - a.ci_lo_s,
                                                            a.ci_hi_s - a.time_s]),
                        fmt="*", ms=10, capsize=2, color="k",
                        label=f"auto (ran {', '.join(sorted(set(a.chose.dropna())))})")
        lim = g.drop_duplicates("nbytes").sort_values("nbytes")
        ax.plot(lim.nbytes, lim.link_s, "k--", marker="_", ms=14, label="link limit")
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (s)",
               title=f"{op}, p={q} single-port nodes")
        ax.legend(fontsize=7)
    for ax, (name, t) in zip(axes[-1], tables.items()):
        ax.set_visible(True)
        y = np.arange(len(t))
        ax.barh(y, t.step_ms, xerr=np.vstack([t.step_ms - t.step_lo, t.step_hi - t.step_ms]),
                color=["0.5" if shaped_training.is_stock(s) else "C0"
                       for s in t.strategy], capsize=2)
        ax.set_yticks(y, t.strategy, fontsize=7)
        ax.invert_yaxis()
        tr = df[(df.section == "training") & (df.config == name)]
        ax.set(xlabel="ms per training step (median over seeds, 95%)",
               title=f"{name}: batch {int(tr.batch_size.iloc[0])}, {tr.seed.nunique()} seeds")
    where = df.network.dropna().iloc[0] if "network" in df and len(df) else ""
    fig.suptitle(f"E15 — pipecomm against gloo's built-in; {where}", fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


@claims.check("e15_collective_vs_builtin")
def check_collective_vs_builtin(df: pd.DataFrame, op: str, algorithm: str,
                                world_sizes: list[int], min_bytes: int, at_most: float,
                                may_miss: str | int) -> claims.Verdict:
    """pipecomm's ``algorithm`` for ``op`` takes at most ``at_most`` times the built-in's time at
    every p of ``world_sizes`` and every size of at least ``min_bytes``, decided on the 95%
    interval of the paired ratio (PASS: every interval at or below; FAIL: one wholly above),
    except for the allowance of ``may_miss`` points (:func:`pipecomm.lab.claims.allowance`).

    Example::

        >>> df = pd.DataFrame([{"section": "collective", "op": "broadcast", "algorithm": a,
        ...                     "nbytes": 1 << 24, "world_size": 8, "time_s": t, "ci_lo_s": t,
        ...                     "ci_hi_s": t, "link_s": 1.1,
        ...                     "times_s": stats.join_repeats([t, 1.02 * t, 0.98 * t])}
        ...                    for a, t in (("lp", 2.0), ("torch", 6.0))])
        >>> check_collective_vs_builtin(df, "broadcast", "lp", [8], 1 << 24, 0.4, "none").verdict
        'PASS'
    """
    return _bound(df, op, algorithm, world_sizes, min_bytes, at_most, may_miss, "ratio",
                  f"{algorithm} {op} / built-in {op}")


@claims.check("e15_collective_vs_link")
def check_collective_vs_link(df: pd.DataFrame, op: str, algorithm: str, world_sizes: list[int],
                             min_bytes: int, at_most: float,
                             may_miss: str | int) -> claims.Verdict:
    """pipecomm's ``algorithm`` for ``op`` takes at most ``at_most`` times the link limit
    (:func:`pipecomm.lab.measure.bench.link_limit_s`) at every p of ``world_sizes`` and every size of at
    least ``min_bytes``, decided on the 95% interval of the median time, except for the
    allowance of ``may_miss`` points.

    Example::

        >>> row = {"section": "collective", "op": "broadcast", "nbytes": 1 << 24,
        ...        "world_size": 8, "link_s": 1.1, "times_s": "1.96;2.0;2.04"}
        >>> df = pd.DataFrame([dict(row, algorithm="lp", time_s=2.0, ci_lo_s=1.96, ci_hi_s=2.04),
        ...                    dict(row, algorithm="torch", time_s=2.0, ci_lo_s=1.96, ci_hi_s=2.04)])
        >>> check_collective_vs_link(df, "broadcast", "lp", [8], 1 << 24, 1.25, "none").verdict
        'FAIL'
    """
    return _bound(df, op, algorithm, world_sizes, min_bytes, at_most, may_miss, "over_limit",
                  f"{algorithm} {op} / link limit")


def _bound(df: pd.DataFrame, op: str, algorithm: str, world_sizes: list[int], min_bytes: int,
           at_most: float, may_miss: str | int, col: str, what: str) -> claims.Verdict:
    claims.require_columns(df, "section", "op", "algorithm", "nbytes", "world_size", "time_s",
                           "times_s", "ci_lo_s", "ci_hi_s", "link_s")
    vs = versus_builtin(df)
    vs = vs[(vs.op == op) & (vs.algorithm == algorithm) & vs.world_size.isin(world_sizes)
            & (vs.nbytes >= min_bytes)].dropna(subset=[col])
    if vs.empty:
        raise claims.NotDecidable(f"no {algorithm} {op} point of >= {min_bytes} bytes at p in "
                         f"{world_sizes} with its comparison")
    verdicts = [claims.at_most(lo, hi, at_most)
                for lo, hi in zip(vs[f"{col}_lo"], vs[f"{col}_hi"])]
    measured = "; ".join(f"p={int(r.world_size)}, {r.nbytes / (1 << 20):g} MiB: "
                         + claims.fmt_ci(getattr(r, col), getattr(r, f"{col}_lo"),
                                         getattr(r, f"{col}_hi"), ".2f") + "x"
                         for r in vs.itertuples())
    return _over_points(verdicts, may_miss, measured, f"{what} <= {at_most:g}")


def _over_points(verdicts: list[str], may_miss: str | int, measured: str,
                 criterion: str) -> claims.Verdict:
    """The verdict of a bound over several points, ``may_miss`` of them allowed to miss."""
    allowed = claims.allowance(len(verdicts), may_miss)
    where = "at every point" if not allowed else f"at all but {allowed} of {len(verdicts)} points"
    if allowed:
        measured += f"; {claims.missed(verdicts, allowed)}"
    return claims.Verdict(measured, f"{criterion} {where} (95% interval)",
                          claims.combine(verdicts, allowed))


@claims.check("e15_auto_vs")
def check_auto_vs(df: pd.DataFrame, op: str, vs: str, world_sizes: list[int], min_bytes: int,
                  at_most: float, may_miss: str | int) -> claims.Verdict:
    """``algorithm="auto"``'s ``op`` takes at most ``at_most`` times ``vs`` (an algorithm timed
    beside it, ``"torch"`` the built-in, or ``"best"``: the fastest of them by median) at every p
    of ``world_sizes`` and size of at least ``min_bytes`` of the auto section, decided on the 95%
    interval of the paired ratio (:func:`versus_auto`), except for ``may_miss`` points.

    Example::

        >>> df = pd.DataFrame([{"section": "auto", "op": "broadcast", "algorithm": a,
        ...                     "nbytes": 1 << 24, "world_size": 8, "time_s": t, "chose": c,
        ...                     "times_s": stats.join_repeats([t, 1.02 * t, 0.98 * t])}
        ...                    for a, t, c in (("lp", 2.0, None), ("torch", 6.0, None),
        ...                                    ("auto", 2.0, "lp"))])
        >>> check_auto_vs(df, "broadcast", "torch", [8], 1 << 24, 0.35, "none").verdict
        'PASS'
    """
    claims.require_columns(df, "section", "op", "algorithm", "nbytes", "world_size", "time_s",
                           "times_s", "chose")
    vs_ = versus_auto(df)
    vs_ = vs_[(vs_.op == op) & (vs_.vs == vs) & vs_.world_size.isin(world_sizes)
              & (vs_.nbytes >= min_bytes)].dropna(subset=["ratio"])
    if vs_.empty:
        raise claims.NotDecidable(f"no auto {op} point of >= {min_bytes} bytes at p in {world_sizes} "
                         f"timed beside {vs!r}")
    verdicts = [claims.at_most(lo, hi, at_most) for lo, hi in zip(vs_.ratio_lo, vs_.ratio_hi)]
    measured = "; ".join(f"p={int(r.world_size)}, {r.nbytes / (1 << 20):g} MiB: auto ran "
                         f"{r.chose}, / {r.against} "
                         + claims.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, ".2f") + "x"
                         for r in vs_.itertuples())
    return _over_points(verdicts, may_miss, measured, f"auto {op} / {vs} {op} <= {at_most:g}")


@claims.check("e15_step_within_spread")
def check_step_within_spread(df: pd.DataFrame, config: str, strategy: str,
                             baseline: str) -> claims.Verdict:
    """In training configuration ``config``, ``strategy``'s step time (median over seeds) is at
    most the slowest seed of ``baseline``'s -- within the baseline's seed spread or below it --
    decided on the median's 95% interval (PASS: its upper bound at or below; FAIL: its lower bound
    above; else INCONCLUSIVE); the paired ratio is reported beside.

    Example::

        >>> df = pd.DataFrame({"section": "training", "config": "c", "seed": [0, 1, 2] * 2,
        ...                    "strategy": ["a"] * 3 + ["b"] * 3,
        ...                    "step_ms": [400.0, 410.0, 420.0, 400.0, 405.0, 410.0],
        ...                    "loss": 2.0, "val_loss": 2.5, "tx_bytes_per_rank_step": 5e6,
        ...                    "error": ""})
        >>> check_step_within_spread(df, "c", "b", "a").verdict
        'PASS'
    """
    claims.require_columns(df, "section", "config", "strategy", "seed", "step_ms")
    tr = df[(df.section == "training") & (df.config == config)]
    ok = tr[tr.get("error", pd.Series("", index=tr.index)).astype(object).fillna("").eq("")]
    t = shaped_training.step_table(tr, base=baseline).set_index("strategy")
    if strategy not in t.index or baseline not in t.index:
        raise claims.NotDecidable(f"configuration {config!r} lacks {strategy!r} or {baseline!r}")
    base = ok[ok.strategy == baseline].step_ms
    r = t.loc[strategy]
    if r.seeds < 2 or len(base) < 2:
        raise claims.NotDecidable(f"{strategy!r} and {baseline!r} in {config!r} need >= 2 seeds each "
                         "for a spread")
    verdict = claims.at_most(r.step_lo, r.step_hi, base.max())
    measured = (f"{strategy} {claims.fmt_ci(r.step_ms, r.step_lo, r.step_hi, '.0f')} ms/step "
                f"(median of {int(r.seeds)} seeds) against "
                f"{baseline}'s seeds {base.min():.0f}-{base.max():.0f} ms; paired ratio "
                f"{claims.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, '.3f')}")
    return claims.Verdict(measured, f"median step time <= the slowest of {baseline}'s seeds "
                          "(95% interval)", verdict)


@claims.check("e15_step_ratio")
def check_step_ratio(df: pd.DataFrame, config: str, strategy: str, baseline: str,
                     at_most: float, loss_within_spread: bool) -> claims.Verdict:
    """In training configuration ``config``, ``strategy``'s step time is at most ``at_most``
    times ``baseline``'s, decided on the 95% bootstrap interval of the per-seed paired ratio;
    with ``loss_within_spread``, its mean final loss must also lie within the baseline's seed
    spread (max - min) of the baseline's mean, else FAIL.

    Example::

        >>> df = pd.DataFrame({"section": "training", "config": "c", "seed": [0, 1, 2] * 2,
        ...                    "strategy": ["a"] * 3 + ["b"] * 3,
        ...                    "step_ms": [400.0, 410.0, 420.0, 240.0, 250.0, 255.0],
        ...                    "loss": [2.0, 2.1, 2.2, 2.05, 2.1, 2.2], "val_loss": 2.5,
        ...                    "tx_bytes_per_rank_step": 5e6, "error": ""})
        >>> check_step_ratio(df, "c", "b", "a", 0.625, True).verdict
        'PASS'
    """
    claims.require_columns(df, "section", "config", "strategy", "seed", "step_ms", "loss")
    tr = df[(df.section == "training") & (df.config == config)]
    t = shaped_training.step_table(tr, base=baseline).set_index("strategy")
    if strategy not in t.index or baseline not in t.index:
        raise claims.NotDecidable(f"configuration {config!r} lacks {strategy!r} or {baseline!r}")
    r = t.loc[strategy]
    if r.seeds < 2:
        raise claims.NotDecidable(f"{strategy!r} in {config!r} has {r.seeds} seed(s): a ratio's interval "
                         "needs >= 2 independent runs")
    verdict = claims.at_most(r.ratio_lo, r.ratio_hi, at_most)
    measured = (f"{strategy} / {baseline} = {claims.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, '.3f')}"
                f" ({r.step_ms:.0f} vs {t.loc[baseline].step_ms:.0f} ms/step, {int(r.seeds)} "
                f"seeds)")
    criterion = f"step-time ratio <= {at_most:g} (95% interval over seeds)"
    if loss_within_spread:
        base = t.loc[baseline]
        gap = abs(r.loss - base.loss)
        measured += (f"; final loss {r.loss:.4f} vs {base.loss:.4f} (gap {gap:.4f}, baseline "
                     f"spread {base.loss_spread:.4f})")
        criterion += " and final loss within the baseline's seed spread"
        if gap > base.loss_spread:
            verdict = "FAIL"
    return claims.Verdict(measured, criterion, verdict)


if __name__ == "__main__":
    main(sys.modules[__name__])
