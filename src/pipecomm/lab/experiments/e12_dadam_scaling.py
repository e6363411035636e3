"""E12 — per-iteration time vs world size: AllReduce vs decentralized topologies (DAdam, Figure 6).

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025), Figure 6: per-iteration time of a Transformer with AllReduce and with
decentralized training on AER, over the number of GPUs; on four-GPU nodes with 25 Gb/s Ethernet,
8 GPUs 166.1 vs 122.0 ms, 16: 195.5 vs 78.9, 32: 188.5 vs 67.9 (up to 2.78x); on InfiniBand about
1.2x. The claim reproduced: with several nodes on a slow inter-node network, AER is faster per
iteration than AllReduce.

Measures, on the same emulated two-level network and E11's timing workload, AllReduce training
(layer-wise ``PipeSGD``, ``ring``) and DAdam (``DecentralizedDataParallel`` + Adam, ``ring``
gossip) on complete, ring, one-peer-exp and AER, ``runs`` independent short runs per method,
beside the runtime model's prediction. Claims: C12.1 (the paper's) at p = 8 (4 nodes) AER is
faster per iteration than AllReduce; C12.2 (method) the speed-up agrees with the runtime model's.
The quick defaults use nodes of one rank (p = 2, 4).

The methods, workload, timing, model and network: docs/experiments.md, "E12: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e12_dadam_scaling --out results/manual/E12
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.lab import claims
from pipecomm.lab.checks import check_int, check_world_sizes
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats
from pipecomm.lab.measure.calibration import rank_calibrate_buckets, summarize_buckets
from pipecomm.lab.networks.kinds import TwoLevelParams, make_network, ranks_on
from pipecomm.lab.training.dadam_timing import (
    check_timing_workload,
    method_name,
    predict_training,
    rank_time_training,
)
from pipecomm.lab.training.pipesgd_training import rounds
from pipecomm.lab.workloads.tasks import timing_spec

ID = "E12"
NOTEBOOK = "12_dadam_scaling"
TOPOLOGIES = ["complete", "ring", "one-peer-exp", "alternating-exp-ring"]


@dataclass(frozen=True)
class Params(TwoLevelParams):
    """E12's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_sizes: list[int] = field(default_factory=lambda: [2, 4])
    ranks_per_node: int = 1
    topologies: list[str] = field(default_factory=lambda: ["alternating-exp-ring"])
    algorithm: str = "ring"
    width: int = 512
    layers: int = 2
    fwd_ms: float = 10.0
    bwd_ms: float = 20.0
    compute_cv: float = 0.0
    warmup: int = 2
    blocks: int = 1
    block_iters: int = 3
    calib_iters: int = 3
    runs: int = 5
    seed: int = 0
    timeout_s: float = 300.0

    def validate(self) -> None:
        rpn = check_int("ranks_per_node", self.ranks_per_node)
        check_world_sizes("world_sizes", self.world_sizes, rpn)
        if not isinstance(self.topologies, (list, tuple)):
            raise ValueError(f"parameter topologies must be a list, got {self.topologies!r}")
        for t in self.topologies:
            if t not in TOPOLOGIES:
                raise ValueError(f"parameter topologies: {t!r} is not one of {TOPOLOGIES}")
        check_timing_workload(self, "compute_cv")
        check_int("runs", self.runs)
        super().validate()  # the network's parameters


DEFAULTS = Params.defaults()


def run(**params: Any) -> pd.DataFrame:
    """For every world size: calibrate compute, then time AllReduce and every topology in
    ``runs`` interleaved runs (run ``r`` draws its compute factors with seed ``seed + r``)."""
    params = Params.make(**params)
    rpn = params.ranks_per_node
    net = make_network(params.asdict())
    methods = [("allreduce", None)] + [("decentralized", t) for t in params.topologies]
    rows = []
    for p in params.world_sizes:
        base = timing_spec(
            p,
            ranks_per_node=rpn,
            width=params.width,
            layers=params.layers,
            fwd_ms=params.fwd_ms,
            bwd_ms=params.bwd_ms,
            compute_cv=params.compute_cv,
            seed=params.seed,
            algorithm=params.algorithm,
            warmup=params.warmup,
            blocks=params.blocks,
            block_iters=params.block_iters,
            calib_iters=params.calib_iters,
        )
        layer_chunk = 4 * params.width ** 2 // p  # a ring chunk of one layer's gradient
        with ranks_on(params.network, p, net, layer_chunk, ranks_per_node=rpn,
                      timeout_s=params.timeout_s) as ranks:
            calib = summarize_buckets(
                ranks.run(rank_calibrate_buckets, base, timeout_s=params.timeout_s)
            )
            for run_id, (kind, topo) in rounds(methods, params.runs):
                spec = dict(base, kind=kind, topology=topo or "complete",
                            seed=params.seed + run_id)
                res = ranks.run(rank_time_training, spec, timeout_s=params.timeout_s)[0]
                pred = predict_training(spec, calib, ranks.net)
                rows.append(
                    {
                        "method": method_name(kind, topo),
                        "kind": kind,
                        "topology": topo,
                        "run": run_id,
                        "iteration_s": res["iteration_s"],
                        "predicted_s": pred["iteration_s"],
                        "lockstep_s": pred["lockstep_iteration_s"],
                        "block_s": " ".join(f"{b:.4f}" for b in res["block_s"]),
                        "times_s": res["times_s"],
                        "calibrated_compute_s": calib["compute_s"],
                        "compute_cv": params.compute_cv,
                        "algorithm": params.algorithm,
                        "ranks_per_node": rpn,
                        "nodes": p // rpn,
                        "world_size": p,
                        "backend": "gloo",
                        "network": ranks.text,
                        "network_kind": ranks.kind,
                    }
                )
    return pd.DataFrame(rows)


def per_method(df: pd.DataFrame) -> pd.DataFrame:
    """One row per world size and method: the independent repeats (one per run; data without a
    ``run`` column: its blocks), their median ``iteration_s`` and the models' medians.

    Example::

        >>> import pandas as pd
        >>> cells = [("AllReduce", "allreduce", None, 0.110, 0.115),      # model s: overlapped, lock-step
        ...          ("DAdam (AER)", "decentralized", "alternating-exp-ring", 0.040, 0.042)]
        >>> df = pd.DataFrame([{"world_size": 8, "method": m, "kind": k, "topology": top, "run": r,
        ...                     "iteration_s": s * (1 + 0.01 * r), "predicted_s": s, "lockstep_s": ls,
        ...                     "times_s": ""} for m, k, top, s, ls in cells for r in range(5)])
        >>> per_method(df)[["world_size", "method", "iteration_s", "predicted_s", "runs"]]
           world_size       method  iteration_s  predicted_s  runs
        0           8    AllReduce       0.1122         0.11     5
        1           8  DAdam (AER)       0.0408         0.04     5
    """
    claims.require_columns(df, "method", "kind", "world_size", "iteration_s", "times_s")
    rows = []
    for (p, method), g in df.groupby(["world_size", "method"], sort=False):
        reps = (g.sort_values("run").iteration_s.tolist() if "run" in g
                else stats.repeats(g.times_s.iloc[0]))
        row = {"world_size": p, "method": method, "kind": g.kind.iloc[0],
               "topology": g.topology.iloc[0] if "topology" in g else None,
               "repeats": reps, "runs": len(reps), "iteration_s": float(np.median(reps))}
        for col in ("predicted_s", "lockstep_s"):
            if col in g:
                row[col] = float(np.median(g[col]))
        for col in ("algorithm", "network"):
            if col in g:
                row[col] = g[col].iloc[0]
        rows.append(row)
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """ms per iteration per method and world size (median over runs), and the speedup over
    AllReduce."""
    df = per_method(df)
    ar = df[df.kind == "allreduce"].set_index("world_size").iteration_s
    out = pd.DataFrame(
        {
            "p": df.world_size,
            "method": df.method,
            "measured_ms": (df.iteration_s * 1e3).round(1),
            "predicted_ms": (df.predicted_s * 1e3).round(1) if "predicted_s" in df else None,
            **({"lockstep_ms": (df.lockstep_s * 1e3).round(1)} if "lockstep_s" in df else {}),
            "speedup_vs_AllReduce": [
                round(float(ar.get(w, float("nan")) / t), 2)
                for w, t in zip(df.world_size, df.iteration_s)
            ],
            "runs": df.runs,
        }
    )
    return out.sort_values(["p", "method"], kind="stable").reset_index(drop=True)


def plot(df: pd.DataFrame, **params: Any):
    """ms per iteration vs world size, one line per method; dashed: the runtime model."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    df = per_method(df)
    d = df.assign(ms=df.iteration_s * 1e3)
    methods = list(dict.fromkeys(d.method))
    palette = dict(zip(methods, sns.color_palette("deep", len(methods))))
    for m in methods:
        g = d[d.method == m].sort_values("world_size")
        ax.plot(g.world_size, g.ms, "o-", color=palette[m], label=m, lw=2)
        if "predicted_s" in g:
            ax.plot(g.world_size, g.predicted_s * 1e3, "--", color=palette[m], lw=1, alpha=0.8)
    ax.set_xticks(sorted(d.world_size.unique()))
    ax.set(
        xlabel="world size p (2 ranks per node)",
        ylabel="ms per iteration",
        title=f"E12: AllReduce vs decentralized (gloo, {d.algorithm.iloc[0]}; dashed: model)",
    )
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.005, f"emulated network: {d.network.iloc[0]}; compute emulated", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def _pair(df: pd.DataFrame, world_size: int) -> tuple[pd.Series, pd.Series]:
    t = per_method(df)
    at = t[t.world_size == world_size]
    ar = at[at.kind == "allreduce"]
    aer = at[(at.kind == "decentralized") & (at.topology == "alternating-exp-ring")]
    if ar.empty or aer.empty:
        raise claims.NotDecidable(f"need AllReduce and AER measurements at p={world_size}")
    return ar.loc[ar.iteration_s.idxmin()], aer.iloc[0]  # the best AllReduce measured


@claims.check("e12_aer_speedup_above")
def check_aer_speedup_above(df: pd.DataFrame, world_size: int, min_speedup: float
                            ) -> claims.Verdict:
    """At ``world_size`` ranks, AllReduce's / AER's iteration time (the speed-up: ratio of the
    medians over independent runs, with its 95% interval) is above ``min_speedup`` (PASS: the
    whole interval at or above it; FAIL: the whole interval below it).

    Example::

        >>> import pandas as pd
        >>> cells = [("AllReduce", "allreduce", None, 0.110, 0.115),      # model s: overlapped, lock-step
        ...          ("DAdam (AER)", "decentralized", "alternating-exp-ring", 0.040, 0.042)]
        >>> df = pd.DataFrame([{"world_size": 8, "method": m, "kind": k, "topology": top, "run": r,
        ...                     "iteration_s": s * (1 + 0.01 * r), "predicted_s": s, "lockstep_s": ls,
        ...                     "times_s": ""} for m, k, top, s, ls in cells for r in range(5)])
        >>> check_aer_speedup_above(df, 8, 1.0)              # doctest: +ELLIPSIS
        Verdict(measured='p=8: speedup 2.75 [2.67, 2.83]x (AllReduce 112.2 ms, AER 40.8 ms; 5 and 5 runs)', threshold='speedup >= 1 (95% interval)', verdict='PASS', reason='95% interval [2.67, 2.83] at or above the threshold 1')
    """
    ar, aer = _pair(df, world_size)
    r, lo, hi = claims.ratio(ar.repeats, aer.repeats)
    return claims.Verdict(
        f"p={world_size}: speedup {claims.fmt_ci(r, lo, hi)}x (AllReduce "
        f"{ar.iteration_s * 1e3:.1f} ms, AER {aer.iteration_s * 1e3:.1f} ms; {ar.runs} and "
        f"{aer.runs} runs)",
        f"speedup >= {min_speedup:g} (95% interval)",
        claims.at_least(lo, hi, min_speedup),
    )


@claims.prediction("e12_speedup_near_model")
def predict_speedup_near_model(df: pd.DataFrame, world_size: int) -> str:
    """The runtime model's (overlapped) AllReduce / AER speed-up at ``world_size`` on this run,
    and the lock-step form's.

    Example::

        >>> import pandas as pd
        >>> cells = [("AllReduce", "allreduce", None, 0.110, 0.115),      # model s: overlapped, lock-step
        ...          ("DAdam (AER)", "decentralized", "alternating-exp-ring", 0.040, 0.042)]
        >>> df = pd.DataFrame([{"world_size": 8, "method": m, "kind": k, "topology": top, "run": r,
        ...                     "iteration_s": s * (1 + 0.01 * r), "predicted_s": s, "lockstep_s": ls,
        ...                     "times_s": ""} for m, k, top, s, ls in cells for r in range(5)])
        >>> predict_speedup_near_model(df, 8)
        'model speedup 2.75x (lock-step 2.74x)'
    """
    ar, aer = _pair(df, world_size)
    text = f"model speedup {ar.predicted_s / aer.predicted_s:.2f}x"
    if "lockstep_s" in ar:
        text += f" (lock-step {ar.lockstep_s / aer.lockstep_s:.2f}x)"
    return text


@claims.check("e12_speedup_near_model")
def check_speedup_near_model(df: pd.DataFrame, world_size: int, tolerance: float
                             ) -> claims.Verdict:
    """At ``world_size`` ranks, AllReduce's / AER's iteration time (the speedup, with its
    interval over independent runs) agrees with the runtime model's speedup within
    ``tolerance`` (signed relative error), so both a smaller and a larger speedup than predicted
    fail.

    Example::

        >>> import pandas as pd
        >>> cells = [("AllReduce", "allreduce", None, 0.110, 0.115),      # model s: overlapped, lock-step
        ...          ("DAdam (AER)", "decentralized", "alternating-exp-ring", 0.040, 0.042)]
        >>> df = pd.DataFrame([{"world_size": 8, "method": m, "kind": k, "topology": top, "run": r,
        ...                     "iteration_s": s * (1 + 0.01 * r), "predicted_s": s, "lockstep_s": ls,
        ...                     "times_s": ""} for m, k, top, s, ls in cells for r in range(5)])
        >>> check_speedup_near_model(df, 8, 0.25).verdict
        'PASS'
    """
    claims.require_columns(df, "predicted_s")
    ar, aer = _pair(df, world_size)
    r, lo, hi = claims.ratio(ar.repeats, aer.repeats)
    model = float(ar.predicted_s / aer.predicted_s)
    e = [stats.model_error(v, model) for v in (r, lo, hi)]
    return claims.Verdict(
        f"p={world_size}: speedup {claims.fmt_ci(r, lo, hi)}x (AllReduce "
        f"{ar.iteration_s * 1e3:.1f} ms, AER {aer.iteration_s * 1e3:.1f} ms); "
        f"model {model:.2f}x, error {e[0]:+.1%} [{e[1]:+.1%}, {e[2]:+.1%}]",
        f"speedup within {tolerance:.0%} of the runtime model's",
        claims.within(e[1], e[2], tolerance),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
