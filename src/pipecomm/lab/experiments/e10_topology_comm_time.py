"""E10 — communication time per iteration per topology (the DAdam paper's Table 1).

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025) tabulate the communication time of one iteration for each topology (the
table's numbers could not be recovered; docs/papers.md). This experiment measures it for the models
in use in this artifact -- E11/E12's timing workload (two 1 MiB buckets), E13's digits MLP and E13's
character-level transformer (one bucket each) -- and compares it with the cost model.

For every step of one period of each topology (complete, ring, one-peer-exp, AER) every rank
all-reduces each bucket over its group, all groups at once, on the two-level emulated network;
``runs`` interleaved runs, one repeat each. The model (column ``model_s``) is
``dadam_timing.replay_ring_allreduces``, the lock-step closed form beside it (``lockstep_s``).
Claims (artifact/claims.yaml): C10.1 the model's signed error for every measured time; C10.2b
AER's time against the one-peer exponential graph's (C10.2, against complete's, superseded).

Timing, the models' inputs and the network: docs/experiments.md, "E10: protocol in detail"; the
overlapped model: docs/experiments.md, E10.

Run::

    python -m pipecomm.lab.experiments.e10_topology_comm_time --out results/manual/E10
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.decentralized import topology
from pipecomm.lab import claims
from pipecomm.lab.checks import check_int, check_world_sizes
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats
from pipecomm.lab.networks.kinds import TwoLevelParams, make_network, ranks_on
from pipecomm.lab.training.dadam_timing import (
    bars_with_markers,
    model_gossip_time,
    overlapped_gossip_time,
    rank_gossip_times,
)
from pipecomm.lab.training.pipesgd_training import rounds
from pipecomm.lab.workloads.tasks import TASK_MODELS, workload_bucket_bytes

ID = "E10"
NOTEBOOK = "10_topology_comm_time"
TOPOLOGIES = ["complete", "ring", "one-peer-exp", "alternating-exp-ring"]
SHORT = {
    "complete": "complete",
    "ring": "ring",
    "one-peer-exp": "one-peer-exp",
    "alternating-exp-ring": "AER",
}
@dataclass(frozen=True)
class Params(TwoLevelParams):
    """E10's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_sizes: list[int] = field(default_factory=lambda: [4])
    ranks_per_node: int = 2
    models: list[str] = field(default_factory=lambda: ["timing", "char_transformer"])
    topologies: list[str] = field(default_factory=lambda: list(TOPOLOGIES))
    algorithm: str = "ring"
    warmup: int = 1
    iters: int = 2
    runs: int = 5
    timeout_s: float = 300.0

    def validate(self) -> None:
        rpn = check_int("ranks_per_node", self.ranks_per_node)
        check_world_sizes("world_sizes", self.world_sizes, rpn)
        if not self.models or not isinstance(self.models, (list, tuple)):
            raise ValueError(f"parameter models must be a non-empty list, got {self.models!r}")
        known = ["timing", *TASK_MODELS]
        for m in self.models:
            if m not in known:
                raise ValueError(f"parameter models: unknown model {m!r}; choose from {known}")
        if not self.topologies or not isinstance(self.topologies, (list, tuple)):
            raise ValueError(
                f"parameter topologies must be a non-empty list, got {self.topologies!r}")
        for t in self.topologies:
            if t not in topology.available_topologies() or t == "random-matching":
                raise ValueError(f"parameter topologies: {t!r} is not one of {TOPOLOGIES}")
        if self.algorithm != "ring":
            raise ValueError(
                f"parameter algorithm must be 'ring' (the overlapped model replays pipecomm's "
                f"ring; the gossip of DecentralizedDataParallel), got {self.algorithm!r}"
            )
        check_int("warmup", self.warmup, 0)
        check_int("iters", self.iters)
        check_int("runs", self.runs)
        super().validate()  # the network's parameters


DEFAULTS = Params.defaults()


def run(**params: Any) -> pd.DataFrame:
    """Measure the gossip time of every step of every topology in ``runs`` interleaved runs;
    add the overlapped model's time and the lock-step one."""
    params = Params.make(**params)
    net = make_network(params.asdict())
    rpn = params.ranks_per_node
    sizes = {m: workload_bucket_bytes(m) for m in params.models}
    todo = [(m, t) for m in params.models for t in params.topologies]
    rows = []
    for p in params.world_sizes:
        smallest = min(min(b) for b in sizes.values()) // p  # a ring chunk
        with ranks_on(params.network, p, net, smallest, ranks_per_node=rpn,
                      timeout_s=params.timeout_s) as ranks:
            models: dict[tuple, tuple[float, float]] = {}
            for run_id, (model, topo_name) in rounds(todo, params.runs):
                topo = topology.get_topology(topo_name, p, ranks_per_node=rpn)
                per_rank = ranks.run(
                    rank_gossip_times,
                    sizes[model],
                    topo_name,
                    rpn,
                    params.algorithm,
                    params.warmup,
                    params.iters,
                    timeout_s=params.timeout_s,
                )
                for r in per_rank[0]:
                    groups = topo.groups(r["step"])
                    key = (model, topo_name, r["step"])
                    if key not in models:
                        models[key] = (
                            overlapped_gossip_time(groups, sizes[model], rpn, ranks.net,
                                                   params.algorithm),
                            model_gossip_time(groups, sizes[model], rpn, ranks.net,
                                              params.algorithm))
                    rows.append(
                        {
                            "world_size": p,
                            "model": model,
                            "topology": topo_name,
                            "run": run_id,
                            "step": r["step"],
                            "period": topo.period,
                            "groups": r["groups"],
                            "n_buckets": len(sizes[model]),
                            "model_bytes": sum(sizes[model]),
                            **{k: r[k] for k in ("time_s", "ci_lo_s", "ci_hi_s",
                                                 "repeats", "times_s")},
                            "model_s": models[key][0],
                            "lockstep_s": models[key][1],
                            "spectral_gap": topo.spectral_gap(),
                            "algorithm": params.algorithm,
                            "ranks_per_node": rpn,
                            "backend": "gloo",
                            "network": ranks.text,
                            "network_kind": ranks.kind,
                        }
                    )
    return pd.DataFrame(rows)


def per_iteration(df: pd.DataFrame) -> pd.DataFrame:
    """Communication time per iteration: the measured median over runs of each run's mean over
    the steps of a period (:func:`iteration_samples`), and the models' mean over the steps."""
    claims.require_columns(df, "world_size", "model", "topology", "time_s", "model_s")
    first = df if "run" not in df else df[df.run == df.run.min()]
    g = first.groupby(["world_size", "model", "topology"], sort=False)
    agg = {"model_s": ("model_s", "mean"), "steps": ("time_s", "size")}
    if "lockstep_s" in df:
        agg["lockstep_s"] = ("lockstep_s", "mean")
    out = g.agg(**agg).reset_index()
    samples = iteration_samples(df)
    out.insert(3, "measured_s", [float(np.median(samples[k])) for k in
                                 zip(out.world_size, out.model, out.topology)])
    out["runs"] = [len(samples[k]) for k in zip(out.world_size, out.model, out.topology)]
    if "spectral_gap" in df.columns:
        out["spectral_gap"] = g["spectral_gap"].first().to_numpy()
    out["error"] = (out.measured_s - out.model_s) / out.model_s
    return out


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Table 1: ms per iteration per topology (measured, model, error), per model and p."""
    t = per_iteration(df)
    t["topology"] = t.topology.map(lambda x: SHORT.get(x, x))
    return pd.DataFrame(
        {
            "p": t.world_size,
            "model": t.model,
            "topology": t.topology,
            "measured_ms": (t.measured_s * 1e3).round(1),
            "model_ms": (t.model_s * 1e3).round(1),
            "error": t.error.map(lambda e: f"{e:+.0%}"),
            **({"lockstep_ms": (t.lockstep_s * 1e3).round(1)} if "lockstep_s" in t else {}),
            **({"spectral_gap": t.spectral_gap.round(3)} if "spectral_gap" in t else {}),
        }
    )


def plot(df: pd.DataFrame, **params: Any):
    """Bars: measured ms per iteration per topology; black markers: the cost model."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    t = per_iteration(df)
    t["topology"] = t.topology.map(lambda x: SHORT.get(x, x))
    models = list(dict.fromkeys(t.model))
    worlds = sorted(t.world_size.unique())
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.8), squeeze=False)
    order = [SHORT[x] for x in TOPOLOGIES if SHORT[x] in set(t.topology)]
    for ax, model in zip(axes[0], models):
        sub = t[t.model == model]
        bars_with_markers(
            ax,
            sub.assign(ms=sub.measured_s * 1e3, model_ms=sub.model_s * 1e3),
            x="topology",
            y="ms",
            hue="world_size",
            order=order,
            hue_order=worlds,
            marker="model_ms",
            label="model",
        )
        ax.set(
            xlabel="topology",
            ylabel="communication per iteration (ms)",
            title=_model_title(model, sub),
        )
        ax.legend(title="p / model", fontsize=7)
    net = df.network.iloc[0] if "network" in df else "?"
    alg = df.algorithm.iloc[0] if "algorithm" in df else "ring"
    fig.suptitle(
        f"E10: gossip time per iteration (gloo, {alg} allreduce on each group, "
        f"p={', '.join(map(str, worlds))}; {net})",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


def _model_title(model: str, sub: pd.DataFrame) -> str:
    if "model_bytes" not in sub or "n_buckets" not in sub:
        return model
    return (
        f"{model}: {int(sub.n_buckets.iloc[0])} bucket(s), {sub.model_bytes.iloc[0] / 1024:.0f} KiB"
    )


# --------------------------------------------------------------------------- claims


def iteration_samples(df: pd.DataFrame) -> dict[tuple, list[float]]:
    """Per (world size, model, topology): the independent repeats of the communication time per
    iteration, one per run: the mean over the period's steps of each step's median in that run
    (data without a ``run`` column: one run, each call a repeat, as before).

    Example::

        >>> import pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("complete", 0.040), ("alternating-exp-ring", 0.021)]   # model s per iteration
        >>> df = pd.DataFrame([{"world_size": 8, "model": "mlp", "topology": top, "run": r,
        ...                     "model_s": s, "time_s": s * (1 + 0.01 * r),
        ...                     "times_s": stats.join_repeats([s * (1 + 0.01 * r)] * 3)}
        ...                    for top, s in cells for r in range(5)])                  # 5 runs
        >>> iteration_samples(df)[(8, "mlp", "alternating-exp-ring")]   # one value per run
        [0.021, 0.02121, 0.02142, 0.02163, 0.02184]
    """
    claims.require_columns(df, "world_size", "model", "topology", "times_s")
    out = {}
    for key, g in df.groupby(["world_size", "model", "topology"], sort=False):
        if "run" in g:
            per_run = g.assign(m=[float(np.median(stats.repeats(c))) for c in g.times_s])
            out[key] = per_run.groupby("run", sort=True).m.mean().tolist()
            continue
        reps = [stats.repeats(c) for c in g.times_s]
        n = min(len(r) for r in reps)
        out[key] = np.mean([r[:n] for r in reps], axis=0).tolist()
    return out


@claims.check("e10_within_model")
def check_within_model(df: pd.DataFrame, tolerance: float, may_miss: str | int
                       ) -> claims.Verdict:
    """Every topology, model and world size: signed error of the overlapped model's
    communication time per iteration (``model_s``) within ``tolerance``, on the interval of the
    measured median over independent runs, except for the allowance of ``may_miss`` points
    (:func:`pipecomm.lab.claims.allowance`).

    Example::

        >>> import pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("complete", 0.040), ("alternating-exp-ring", 0.021)]   # model s per iteration
        >>> df = pd.DataFrame([{"world_size": 8, "model": "mlp", "topology": top, "run": r,
        ...                     "model_s": s, "time_s": s * (1 + 0.01 * r),
        ...                     "times_s": stats.join_repeats([s * (1 + 0.01 * r)] * 3)}
        ...                    for top, s in cells for r in range(5)])                  # 5 runs
        >>> check_within_model(df, 0.25, "binomial").threshold
        '|error| <= 25% at all but 1 of 2 points (95% interval)'
    """
    t = per_iteration(df)
    if t.empty:
        raise ValueError("no measurements")
    samples = iteration_samples(df)
    keys = list(zip(t.world_size, t.model, t.topology))
    labels = [f"{SHORT.get(k[2], k[2])}, {k[1]}, p={int(k[0])}" for k in keys]
    return claims.model_points([samples[k] for k in keys], t.model_s.tolist(), labels, tolerance,
                               may_miss=may_miss)


@claims.prediction("e10_aer_below_complete")
def predict_aer_below_complete(df: pd.DataFrame, world_size: int) -> str:
    """C10.2's (superseded by C10.2b) prediction for the run: the model's AER / complete
    communication time per
    iteration at p = ``world_size``, per model (an error when the run lacks that p).

    Example::

        >>> import pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("complete", 0.040), ("alternating-exp-ring", 0.021)]   # model s per iteration
        >>> df = pd.DataFrame([{"world_size": 8, "model": "mlp", "topology": top, "run": r,
        ...                     "model_s": s, "time_s": s * (1 + 0.01 * r),
        ...                     "times_s": stats.join_repeats([s * (1 + 0.01 * r)] * 3)}
        ...                    for top, s in cells for r in range(5)])                  # 5 runs
        >>> predict_aer_below_complete(df, 8)
        'model AER/complete at p = 8: mlp 0.53'
    """
    t = per_iteration(df)
    t = t[t.world_size == world_size].set_index(["model", "topology"]).model_s
    parts = [f"{m} {t[(m, 'alternating-exp-ring')] / t[(m, 'complete')]:.2f}"
             for m in dict.fromkeys(t.index.get_level_values(0))
             if (m, "alternating-exp-ring") in t and (m, "complete") in t]
    if not parts:
        raise claims.NotDecidable(f"this run has no AER and complete at p = {world_size}")
    return f"model AER/complete at p = {world_size}: " + ", ".join(parts)


@claims.check("e10_aer_below_complete")
def check_aer_below_complete(df: pd.DataFrame, world_size: int,
                             max_ratio: float) -> claims.Verdict:
    """At ``world_size`` ranks, AER's communication time per iteration / complete's has its
    interval below ``max_ratio`` for every model.

    Example::

        >>> import pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("complete", 0.040), ("alternating-exp-ring", 0.021)]   # model s per iteration
        >>> df = pd.DataFrame([{"world_size": 8, "model": "mlp", "topology": top, "run": r,
        ...                     "model_s": s, "time_s": s * (1 + 0.01 * r),
        ...                     "times_s": stats.join_repeats([s * (1 + 0.01 * r)] * 3)}
        ...                    for top, s in cells for r in range(5)])                  # 5 runs
        >>> check_aer_below_complete(df, 8, 1.0)                   # doctest: +ELLIPSIS
        Verdict(measured='p=8: mlp: AER/complete 0.525 [0.51, 0.541]', threshold='AER / complete < 1 for every model (95% interval)', verdict='PASS', reason='95% interval [0.51, 0.541] at or below the threshold 1')
    """
    samples = iteration_samples(df)
    t = per_iteration(df)
    parts, verdicts = [], []
    for model in t[t.world_size == world_size].model.unique():
        aer = samples.get((world_size, model, "alternating-exp-ring"))
        com = samples.get((world_size, model, "complete"))
        if aer is None or com is None:
            continue
        r, lo, hi = claims.ratio(aer, com)
        verdicts.append(claims.at_most(lo, hi, max_ratio))
        parts.append(f"{model}: AER/complete {claims.fmt_ci(r, lo, hi)}")
    if not verdicts:
        raise claims.NotDecidable(f"need measurements of both 'alternating-exp-ring' and 'complete' at "
                         f"p={world_size}")
    return claims.Verdict(f"p={world_size}: " + "; ".join(parts),
                          f"AER / complete < {max_ratio:g} for every model (95% interval)",
                          claims.combine(verdicts))


@claims.prediction("e10_aer_below")
def predict_aer_below(df: pd.DataFrame, world_size: int, other: str) -> str:
    """C10.2b's prediction for the run: the overlapped model's AER / ``other`` communication
    time per iteration at p = ``world_size``, per model (an error when the run lacks them).

    Example::

        >>> import pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("one-peer-exp", 0.009), ("alternating-exp-ring", 0.024)]   # model s per iteration
        >>> df = pd.DataFrame([{"world_size": 8, "model": "mlp", "topology": top, "run": r,
        ...                     "model_s": s, "time_s": s * (1 + 0.01 * r),
        ...                     "times_s": stats.join_repeats([s * (1 + 0.01 * r)] * 3)}
        ...                    for top, s in cells for r in range(5)])                  # 5 runs
        >>> predict_aer_below(df, 8, "one-peer-exp")
        'model AER/one-peer-exp at p = 8: mlp 2.67'
    """
    t = per_iteration(df)
    t = t[t.world_size == world_size].set_index(["model", "topology"]).model_s
    name = SHORT.get(other, other)
    parts = [f"{m} {t[(m, 'alternating-exp-ring')] / t[(m, other)]:.2f}"
             for m in dict.fromkeys(t.index.get_level_values(0))
             if (m, "alternating-exp-ring") in t and (m, other) in t]
    if not parts:
        raise claims.NotDecidable(f"this run has no AER and {other} at p = {world_size}")
    return f"model AER/{name} at p = {world_size}: " + ", ".join(parts)


@claims.check("e10_aer_below")
def check_aer_below(df: pd.DataFrame, world_size: int, other: str,
                    max_ratio: float) -> claims.Verdict:
    """At ``world_size`` ranks, AER's communication time per iteration / topology ``other``'s
    has its interval below ``max_ratio`` for every model (medians over independent runs).

    Example::

        >>> import pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("one-peer-exp", 0.030), ("alternating-exp-ring", 0.021)]   # model s per iteration
        >>> df = pd.DataFrame([{"world_size": 8, "model": "mlp", "topology": top, "run": r,
        ...                     "model_s": s, "time_s": s * (1 + 0.01 * r),
        ...                     "times_s": stats.join_repeats([s * (1 + 0.01 * r)] * 3)}
        ...                    for top, s in cells for r in range(5)])                  # 5 runs
        >>> check_aer_below(df, 8, "one-peer-exp", 1.0).measured
        'p=8: mlp: AER/one-peer-exp 0.7 [0.68, 0.721]'
    """
    samples = iteration_samples(df)
    t = per_iteration(df)
    name = SHORT.get(other, other)
    parts, verdicts = [], []
    for model in t[t.world_size == world_size].model.unique():
        aer = samples.get((world_size, model, "alternating-exp-ring"))
        com = samples.get((world_size, model, other))
        if aer is None or com is None:
            continue
        r, lo, hi = claims.ratio(aer, com)
        verdicts.append(claims.at_most(lo, hi, max_ratio))
        parts.append(f"{model}: AER/{name} {claims.fmt_ci(r, lo, hi)}")
    if not verdicts:
        raise claims.NotDecidable(f"need measurements of both 'alternating-exp-ring' and {other!r} at "
                         f"p={world_size}")
    return claims.Verdict(f"p={world_size}: " + "; ".join(parts),
                          f"AER / {name} < {max_ratio:g} for every model (95% interval)",
                          claims.combine(verdicts))


if __name__ == "__main__":
    main(sys.modules[__name__])
