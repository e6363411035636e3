"""E11 — the runtime model vs measured per-iteration time, with a sweep of each of its factors.

Wang, Zhang, Wu, Johansson, "From Promise to Practice: Realizing High-performance Decentralized
Training" (ICLR 2025) explain when decentralized training is faster per iteration than AllReduce
with a runtime model of three factors: (1) overlap of communication with computation, (2)
heterogeneous intra- vs inter-node links, (3) sensitivity to varying compute times. Their equations
(appendix A.5) could not be recovered; ``pipecomm.lab.training.dadam_runtime_model.simulate`` is this
artifact's discrete-event version. This experiment checks its predictions against measured
training iterations, sweeping each factor:

* overlap: emulated compute per iteration x0.5, x1, x2 (communication-bound to compute-bound);
* links: the two-level network vs the same network with inter-node links as fast as intra-node;
* varying compute: every rank's compute of every iteration times a log-normal factor (mean 1,
  coefficient of variation ``compute_cvs``), drawn per rank per iteration;
* the overlap ablation (factor 1 directly, ``ablation_runs`` rounds after the sweeps, base
  configuration): each method with its overlap against the same method without it --
  AllReduce's buckets all-reduced during backward against the same buckets after backward,
  DAdam's gossip overlapping the next forward against the same gossip waited for at the end of
  its iteration (:func:`pipecomm.lab.training.trainers.make_trainer`, ``overlap=False``).

Measures AllReduce training (layer-wise ``PipeSGD``) and DAdam (AER, ``ring`` gossip) on the
emulated two-level network, ``runs`` independent short runs per configuration, beside the
model's prediction from a separate compute-only run. Claims C11.1-C11.4 and C11.2b (the
ablation; artifact/claims.yaml).

Workload, timing, the model's inputs and the network: docs/experiments.md, "E11: protocol in
detail".

Run::

    python -m pipecomm.lab.experiments.e11_runtime_model --out results/manual/E11
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.lab import claims, experiment
from pipecomm.lab.checks import check_int, check_world_sizes
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats
from pipecomm.lab.measure.calibration import rank_calibrate_buckets, summarize_buckets
from pipecomm.lab.networks.kinds import (
    DEFAULT_NETWORK,
    FLAT_NETWORK,
    check_network_kind,
    make_network,
    ranks_on,
)
from pipecomm.lab.training.dadam_timing import (
    bars_with_markers,
    check_timing_workload,
    method_name,
    predict_training,
    rank_time_training,
)
from pipecomm.lab.training.pipesgd_training import rounds
from pipecomm.lab.workloads.tasks import timing_spec

ID = "E11"
NOTEBOOK = "11_runtime_model"
NETWORKS = {"two-level": DEFAULT_NETWORK, "flat": FLAT_NETWORK}
#: the ``factor`` of the overlap ablation's rows (left out of the sweeps' claims C11.1-C11.4)
ABLATION = "overlap ablation"
#: the ablation's arms, ``(kind, overlap)``, in the order of its first round
ABLATION_ARMS = [("allreduce", True), ("allreduce", False),
                 ("decentralized", True), ("decentralized", False)]


@dataclass(frozen=True)
class Params(experiment.Params):
    """E11's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_size: int = 4
    ranks_per_node: int = 2
    compute_scales: list[float] = field(default_factory=lambda: [0.5, 1.0])
    compute_cvs: list[float] = field(default_factory=lambda: [0.5])
    networks: list[str] = field(default_factory=lambda: ["two-level", "flat"])
    topology: str = "alternating-exp-ring"
    algorithm: str = "ring"
    width: int = 512
    layers: int = 2
    fwd_ms: float = 10.0
    bwd_ms: float = 20.0
    warmup: int = 2
    blocks: int = 2
    block_iters: int = 3
    calib_iters: int = 4
    runs: int = 5
    ablation_runs: int = 5  # rounds of the overlap ablation (0: none)
    ablation_blocks: int = 1  # timed blocks per ablation run: shorter repeats, more of them
    seed: int = 0
    timeout_s: float = 300.0
    network: str = "emulated"  # "emulated" or "shaped" (network.ranks_on)
    inter_bandwidth_Bps: float | None = None  # None: each network's own inter-node bandwidth

    def validate(self) -> None:
        check_network_kind(self.network)
        rpn = check_int("ranks_per_node", self.ranks_per_node)
        check_world_sizes("world_size", [self.world_size], rpn)
        for key in ("compute_scales", "compute_cvs"):
            v = getattr(self, key)
            if not isinstance(v, (list, tuple)) or any(
                isinstance(x, bool) or not isinstance(x, (int, float)) or x < 0 for x in v
            ):
                raise ValueError(f"parameter {key} must be a list of numbers >= 0, got {v!r}")
        if not self.compute_scales or any(x <= 0 for x in self.compute_scales):
            raise ValueError(
                f"parameter compute_scales must be non-empty and > 0, got {self.compute_scales!r}"
            )
        if not isinstance(self.networks, (list, tuple)) or not self.networks:
            raise ValueError(f"parameter networks must be a non-empty list, got {self.networks!r}")
        for n in self.networks:
            if n not in NETWORKS:
                raise ValueError(
                    f"parameter networks: unknown network {n!r}; choose from {list(NETWORKS)}"
                )
        bw = self.inter_bandwidth_Bps
        if bw is not None and not (isinstance(bw, (int, float)) and bw > 0):
            raise ValueError(f"parameter inter_bandwidth_Bps must be None or > 0, got {bw!r}")
        check_timing_workload(self)
        check_int("runs", self.runs)
        check_int("ablation_runs", self.ablation_runs, 0)
        check_int("ablation_blocks", self.ablation_blocks)


DEFAULTS = Params.defaults()


def cases(params: Params) -> list[dict[str, Any]]:
    """The configurations measured: the base case (scale 1, cv 0, first network), then one sweep
    per factor, each changing only that factor.

    Example::

        >>> [c["factor"] for c in cases(Params.make())]
        ['base', 'overlap', 'varying compute', 'links']
    """
    base_net = params.networks[0]
    out = [{"factor": "base", "compute_scale": 1.0, "compute_cv": 0.0, "net": base_net}]
    out += [
        {"factor": "overlap", "compute_scale": float(s), "compute_cv": 0.0, "net": base_net}
        for s in params.compute_scales
        if float(s) != 1.0
    ]
    out += [
        {
            "factor": "varying compute",
            "compute_scale": 1.0,
            "compute_cv": float(cv),
            "net": base_net,
        }
        for cv in params.compute_cvs
        if float(cv) != 0.0
    ]
    out += [
        {"factor": "links", "compute_scale": 1.0, "compute_cv": 0.0, "net": n}
        for n in params.networks[1:]
    ]
    return out


def _spec(params: Params, case: dict[str, Any], kind: str, run: int = 0,
          overlap: bool = True, blocks: int | None = None) -> dict[str, Any]:
    return timing_spec(
        params.world_size,
        ranks_per_node=params.ranks_per_node,
        width=params.width,
        layers=params.layers,
        fwd_ms=params.fwd_ms,
        bwd_ms=params.bwd_ms,
        compute_scale=case["compute_scale"],
        compute_cv=case["compute_cv"],
        seed=params.seed + run,
        kind=kind,
        topology=params.topology,
        algorithm=params.algorithm,
        warmup=params.warmup,
        blocks=params.blocks if blocks is None else blocks,
        block_iters=params.block_iters,
        calib_iters=params.calib_iters,
        overlap=overlap,
    )


def ablation_method(kind: str, topology: str | None, overlap: bool) -> str:
    """Display name of an arm of the overlap ablation: the method's, marked where it does not
    overlap.

    Example::

        >>> [ablation_method(k, "alternating-exp-ring", o) for k, o in ABLATION_ARMS]
        ['AllReduce', 'AllReduce, after backward', 'DAdam (AER)', 'DAdam (AER), waited']
    """
    name = method_name(kind, topology)
    if overlap:
        return name
    return f"{name}, {'after backward' if kind == 'allreduce' else 'waited'}"


def _measure(params: Params, ranks: Any, net_name: str, calib: dict[float, dict[str, Any]],
             case: dict[str, Any], kind: str, run_id: int, overlap: bool) -> dict[str, Any]:
    """One independent run of ``kind`` in ``case`` on ``ranks`` and the model's prediction of
    it: one row of data.csv."""
    p, rpn = params.world_size, params.ranks_per_node
    scale = case["compute_scale"]
    blocks = params.ablation_blocks if case["factor"] == ABLATION else None
    spec = _spec(params, case, kind, run_id, overlap, blocks)
    res = ranks.run(rank_time_training, spec, timeout_s=params.timeout_s)[0]
    pred = predict_training(spec, calib[scale], ranks.net)
    return {
        "factor": case["factor"],
        "network_name": net_name,
        "compute_scale": scale,
        "compute_cv": case["compute_cv"],
        "kind": kind,
        "method": ablation_method(kind, params.topology, overlap),
        "topology": None if kind == "allreduce" else params.topology,
        "overlap": overlap,
        "run": run_id,
        "measured_s": res["iteration_s"],
        "predicted_s": pred["iteration_s"],
        "lockstep_s": pred["lockstep_iteration_s"],
        "calibrated_compute_s": calib[scale]["compute_s"],
        "model_comm_s": pred["comm_s"],
        "block_s": " ".join(f"{b:.4f}" for b in res["block_s"]),
        "times_s": res["times_s"],
        "algorithm": params.algorithm,
        "ranks_per_node": rpn,
        "world_size": p,
        "backend": "gloo",
        "network": ranks.text,
        "network_kind": ranks.kind,
    }


def run(**params: Any) -> pd.DataFrame:
    """Calibrate compute, then measure (``runs`` interleaved runs) and predict every case for
    AllReduce and DAdam; then, on the first network, the overlap ablation (``ablation_runs``
    interleaved rounds of :data:`ABLATION_ARMS` at the base configuration, each run timing
    ``ablation_blocks`` blocks)."""
    params = Params.make(**params)
    rpn, p = params.ranks_per_node, params.world_size
    todo = cases(params)
    calib: dict[float, dict[str, Any]] = {}
    rows = []
    for net_name in dict.fromkeys(c["net"] for c in todo):
        over = {} if params.inter_bandwidth_Bps is None else {
            "inter_bandwidth_Bps": params.inter_bandwidth_Bps}
        net = make_network({**NETWORKS[net_name], **over})
        layer_chunk = 4 * params.width ** 2 // p  # a ring chunk of one layer's gradient
        with ranks_on(params.network, p, net, layer_chunk, ranks_per_node=rpn,
                      timeout_s=params.timeout_s) as ranks:
            mine = [c for c in todo if c["net"] == net_name]
            for case in mine:
                scale = case["compute_scale"]
                if scale not in calib:  # a separate, compute-only run (no communication)
                    spec = _spec(params, case, "allreduce")
                    calib[scale] = summarize_buckets(
                        ranks.run(rank_calibrate_buckets, spec, timeout_s=params.timeout_s)
                    )
            items = [(i, kind) for i in range(len(mine))
                     for kind in ("allreduce", "decentralized")]
            for run_id, (i, kind) in rounds(items, params.runs):
                rows.append(_measure(params, ranks, net_name, calib, mine[i], kind, run_id,
                                     True))
            if net_name == todo[0]["net"] and params.ablation_runs:
                # after this network's sweeps, whose runs and order stay as they were
                base = {**todo[0], "factor": ABLATION}
                for run_id, (kind, overlap) in rounds(ABLATION_ARMS, params.ablation_runs):
                    rows.append(_measure(params, ranks, net_name, calib, base, kind, run_id,
                                         overlap))
    df = pd.DataFrame(rows)
    df["error"] = stats.model_error(df.measured_s.to_numpy(), df.predicted_s.to_numpy())
    return df


CASE_KEYS = ["factor", "network_name", "compute_scale", "compute_cv", "method"]


def points(df: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration and method: the independent repeats (one per run: that run's
    ``measured_s``; data without a ``run`` column: its blocks), their median, and the models'
    predictions (median over the runs' predictions: each run draws its own compute factors).

    Example::

        >>> import pandas as pd
        >>> cells = [(0.5, "allreduce", 0.060), (0.5, "decentralized", 0.030),
        ...          (2.0, "allreduce", 0.110), (2.0, "decentralized", 0.090)]   # model seconds
        >>> df = pd.DataFrame([{"factor": "base", "network_name": "two-level", "compute_scale": s,
        ...                     "compute_cv": 0.0, "method": k, "kind": k, "run": r, "times_s": "",
        ...                     "measured_s": t * (1 + 0.01 * (r if k == "allreduce" else 4 - r)),
        ...                     "predicted_s": t} for s, k, t in cells for r in range(5)])
        >>> points(df)[["method", "compute_scale", "measured_s", "predicted_s", "runs"]]
                  method  compute_scale  measured_s  predicted_s  runs
        0      allreduce            0.5      0.0612         0.06     5
        1  decentralized            0.5      0.0306         0.03     5
        2      allreduce            2.0      0.1122         0.11     5
        3  decentralized            2.0      0.0918         0.09     5
    """
    claims.require_columns(df, *CASE_KEYS, "measured_s", "predicted_s", "times_s")
    rows = []
    for key, g in df.groupby(CASE_KEYS, sort=False, dropna=False):
        reps = (g.sort_values("run").measured_s.tolist() if "run" in g
                else stats.repeats(g.times_s.iloc[0]))
        row = dict(zip(CASE_KEYS, key))
        row.update(kind=g.kind.iloc[0] if "kind" in g else "", repeats=reps,
                   runs=len(reps), measured_s=float(np.median(reps)),
                   predicted_s=float(np.median(g.predicted_s)))
        if "lockstep_s" in g:
            row["lockstep_s"] = float(np.median(g.lockstep_s))
        if "calibrated_compute_s" in g:
            row["calibrated_compute_s"] = float(g.calibrated_compute_s.iloc[0])
        for col in ("world_size", "ranks_per_node", "algorithm", "network"):
            if col in g:
                row[col] = g[col].iloc[0]
        rows.append(row)
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Predicted (overlapped and lock-step) vs measured ms per iteration (median over runs) for
    every case and method."""
    df = points(df)
    return pd.DataFrame(
        {
            "factor": df.factor,
            "network": df.network_name,
            "compute x": df.compute_scale,
            "cv": df.compute_cv,
            "method": df.method,
            "measured_ms": (df.measured_s * 1e3).round(1),
            "predicted_ms": (df.predicted_s * 1e3).round(1),
            "error": ((df.measured_s - df.predicted_s) / df.predicted_s).map(
                lambda e: f"{e:+.0%}"),
            **({"lockstep_ms": (df.lockstep_s * 1e3).round(1)} if "lockstep_s" in df else {}),
            "runs": df.runs,
            "compute_ms (calibrated)": (df.calibrated_compute_s * 1e3).round(1),
        }
    )


def plot(df: pd.DataFrame, **params: Any):
    """Left: predicted vs measured (y = x, +-20%); right: per case, measured bars and predicted
    markers for AllReduce and DAdam."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    df = points(df)
    fig, (ax0, ax1) = plt.subplots(
        1, 2, figsize=(11.5, 4.2), gridspec_kw={"width_ratios": [1, 1.8]}
    )
    d = df.assign(measured_ms=df.measured_s * 1e3, predicted_ms=df.predicted_s * 1e3)
    d["case"] = [_case_label(r) for _, r in d.iterrows()]
    sns.scatterplot(
        data=d, x="measured_ms", y="predicted_ms", hue="method", style="factor", s=60, ax=ax0
    )
    hi = 1.15 * float(max(d.measured_ms.max(), d.predicted_ms.max()))
    xs = np.linspace(0, hi, 10)
    ax0.plot(xs, xs, "k-", lw=1, label="y = x")
    ax0.fill_between(xs, 0.8 * xs, 1.2 * xs, color="grey", alpha=0.2, label="+-20%")
    ax0.set(
        xlim=(0, hi),
        ylim=(0, hi),
        xlabel="measured ms / iteration",
        ylabel="predicted ms / iteration",
        title="runtime model vs measurement",
    )
    ax0.legend(fontsize=7)
    cases_order = list(dict.fromkeys(d.case))
    methods = list(dict.fromkeys(d.method))
    bars_with_markers(
        ax1,
        d,
        x="case",
        y="measured_ms",
        hue="method",
        order=cases_order,
        hue_order=methods,
        marker="predicted_ms",
        label="predicted",
    )
    ax1.set(xlabel="", ylabel="ms / iteration", title="the three factors (bars: measured)")
    ax1.tick_params(axis="x", labelsize=7, rotation=15)
    ax1.legend(fontsize=7)
    p = int(df.world_size.iloc[0])
    fig.suptitle(
        f"E11: runtime model, AllReduce vs DAdam, gloo, p={p} "
        f"({int(df.ranks_per_node.iloc[0])} ranks/node), {df.algorithm.iloc[0]}; "
        f"{df.network.iloc[0]} (links case: inter = intra); "
        "compute emulated",
        fontsize=8,
    )
    fig.tight_layout()
    return fig


def _case_label(r: pd.Series) -> str:
    if r.factor == "overlap":
        return f"compute x{r.compute_scale:g}"
    if r.factor == "varying compute":
        return f"cv {r.compute_cv:g}"
    if r.factor == "links":
        return f"{r.network_name} links"
    if r.factor == ABLATION:
        return "ablation"
    return "base"


def sweeps(df: pd.DataFrame) -> pd.DataFrame:
    """The rows of the three sweeps: ``df`` without the overlap ablation's (claims C11.1-C11.4
    decide on these only, as before the ablation was added).

    Example::

        >>> import pandas as pd
        >>> len(sweeps(pd.DataFrame({"factor": ["base", ABLATION, "overlap"]})))
        2
    """
    return df[df.factor != ABLATION] if "factor" in df else df


@claims.check("e11_prediction_within")
def check_prediction_within(df: pd.DataFrame, tolerance: float, may_miss: str | int
                            ) -> claims.Verdict:
    """Every configuration: signed error of the runtime model's (overlapped) per-iteration time
    within ``tolerance``, on the interval of the measured median over independent runs, except
    for the allowance of ``may_miss`` points (:func:`pipecomm.lab.claims.allowance`).

    Example::

        >>> import pandas as pd
        >>> cells = [(0.5, "allreduce", 0.060), (0.5, "decentralized", 0.030),
        ...          (2.0, "allreduce", 0.110), (2.0, "decentralized", 0.090)]   # model seconds
        >>> df = pd.DataFrame([{"factor": "base", "network_name": "two-level", "compute_scale": s,
        ...                     "compute_cv": 0.0, "method": k, "kind": k, "run": r, "times_s": "",
        ...                     "measured_s": t * (1 + 0.01 * (r if k == "allreduce" else 4 - r)),
        ...                     "predicted_s": t} for s, k, t in cells for r in range(5)])
        >>> check_prediction_within(df, 0.2, "binomial").threshold
        '|error| <= 20% at all but 1 of 4 points (95% interval)'
    """
    t = points(sweeps(df))
    if t.empty:
        raise ValueError("no measurements")
    labels = [f"{r.method}, {_case_label(r)}" for _, r in t.iterrows()]
    return claims.model_points(t.repeats.tolist(), t.predicted_s.tolist(), labels, tolerance,
                               may_miss=may_miss)


def _select(df: pd.DataFrame, case: dict[str, Any], what: str) -> pd.DataFrame:
    if not isinstance(case, dict) or not case:
        raise ValueError(f"{what} must be a non-empty mapping of column to value, got {case!r}")
    claims.require_columns(df, *case)
    sel = df
    for col, value in case.items():
        sel = sel[sel[col] == value]
    if sel.empty:
        raise claims.NotDecidable(f"{what}: no measurement with {case}")
    return sel


def speedups(df: pd.DataFrame, case: dict[str, Any], what: str = "case") -> dict[int, float]:
    """DAdam's speed-up over AllReduce in each run of the configuration ``case`` (column
    values): AllReduce's iteration time / DAdam's, run by run (runs interleave, so the two of a
    run were measured close in time).

    Example::

        >>> import pandas as pd
        >>> cells = [(0.5, "allreduce", 0.060), (0.5, "decentralized", 0.030),
        ...          (2.0, "allreduce", 0.110), (2.0, "decentralized", 0.090)]   # model seconds
        >>> df = pd.DataFrame([{"factor": "base", "network_name": "two-level", "compute_scale": s,
        ...                     "compute_cv": 0.0, "method": k, "kind": k, "run": r, "times_s": "",
        ...                     "measured_s": t * (1 + 0.01 * (r if k == "allreduce" else 4 - r)),
        ...                     "predicted_s": t} for s, k, t in cells for r in range(5)])
        >>> s = speedups(df, {"network_name": "two-level", "compute_scale": 0.5, "compute_cv": 0.0})
        >>> {run: round(x, 2) for run, x in s.items()}
        {0: 1.92, 1: 1.96, 2: 2.0, 3: 2.04, 4: 2.08}
    """
    claims.require_columns(df, "run", "kind", "measured_s")
    sel = _select(sweeps(df), case, what)
    ar = sel[sel.kind == "allreduce"].groupby("run").measured_s.median()
    de = sel[sel.kind == "decentralized"].groupby("run").measured_s.median()
    runs = sorted(set(ar.index) & set(de.index))
    if not runs:
        raise claims.NotDecidable(f"{what}: no run with both AllReduce and DAdam for {case}")
    return {int(r): float(ar[r] / de[r]) for r in runs}


def _model_speedup(df: pd.DataFrame, case: dict[str, Any], what: str) -> float:
    sel = _select(sweeps(df), case, what)
    return float(sel[sel.kind == "allreduce"].predicted_s.median()
                 / sel[sel.kind == "decentralized"].predicted_s.median())


@claims.prediction("e11_speedup_grows")
def predict_speedup_grows(df: pd.DataFrame, when: dict[str, Any], against: dict[str, Any]
                          ) -> str:
    """The overlapped model's speed-ups at ``when`` and ``against`` and their ratio on this run.

    Example::

        >>> import pandas as pd
        >>> cells = [(0.5, "allreduce", 0.060), (0.5, "decentralized", 0.030),
        ...          (2.0, "allreduce", 0.110), (2.0, "decentralized", 0.090)]   # model seconds
        >>> df = pd.DataFrame([{"factor": "base", "network_name": "two-level", "compute_scale": s,
        ...                     "compute_cv": 0.0, "method": k, "kind": k, "run": r, "times_s": "",
        ...                     "measured_s": t * (1 + 0.01 * (r if k == "allreduce" else 4 - r)),
        ...                     "predicted_s": t} for s, k, t in cells for r in range(5)])
        >>> predict_speedup_grows(df, {"compute_scale": 0.5}, {"compute_scale": 2.0})
        'model speed-up 2.00x vs 1.22x: ratio 1.64'
    """
    a, b = _model_speedup(df, when, "when"), _model_speedup(df, against, "against")
    return f"model speed-up {a:.2f}x vs {b:.2f}x: ratio {a / b:.2f}"


@claims.check("e11_speedup_grows")
def check_speedup_grows(df: pd.DataFrame, when: dict[str, Any], against: dict[str, Any],
                        min_ratio: float) -> claims.Verdict:
    """DAdam's speed-up over AllReduce is larger in configuration ``when`` than in ``against``
    (each a mapping of column to value): the ratio of the median per-run speed-ups, with its
    95% interval (:func:`pipecomm.lab.claims.ratio`), at least ``min_ratio`` (PASS: the whole
    interval at or above it; FAIL: the whole interval below it).

    Example::

        >>> import pandas as pd
        >>> cells = [(0.5, "allreduce", 0.060), (0.5, "decentralized", 0.030),
        ...          (2.0, "allreduce", 0.110), (2.0, "decentralized", 0.090)]   # model seconds
        >>> df = pd.DataFrame([{"factor": "base", "network_name": "two-level", "compute_scale": s,
        ...                     "compute_cv": 0.0, "method": k, "kind": k, "run": r, "times_s": "",
        ...                     "measured_s": t * (1 + 0.01 * (r if k == "allreduce" else 4 - r)),
        ...                     "predicted_s": t} for s, k, t in cells for r in range(5)])
        >>> check_speedup_grows(df, {"compute_scale": 0.5}, {"compute_scale": 2.0}, 1.0).verdict
        'PASS'
    """
    a = list(speedups(df, when, "when").values())
    b = list(speedups(df, against, "against").values())
    r, lo, hi = claims.ratio(a, b)
    text = (f"speed-up {float(np.median(a)):.2f}x ({_fmt_case(when)}) vs "
            f"{float(np.median(b)):.2f}x ({_fmt_case(against)}): ratio {claims.fmt_ci(r, lo, hi)}"
            f" ({len(a)} and {len(b)} runs)")
    return claims.Verdict(text, f"ratio >= {min_ratio:g} (95% interval)",
                          claims.at_least(lo, hi, min_ratio))


def _fmt_case(case: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in case.items())


def _ablation_arms(df: pd.DataFrame, kind: str) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The overlapped and the non-overlapped rows of ``kind`` in the overlap ablation."""
    claims.require_columns(df, "factor", "kind", "run", "measured_s")
    if kind not in ("allreduce", "decentralized"):
        raise ValueError(f"kinds: 'allreduce' or 'decentralized', got {kind!r}")
    sel = df[(df.factor == ABLATION) & (df.kind == kind)]
    if sel.empty:
        raise claims.NotDecidable(f"no overlap ablation of {kind} in this run (ablation_runs = 0, or "
                         f"data from an E11 that had none)")
    claims.require_columns(sel, "overlap")
    overlapped = sel.overlap.map(lambda v: str(v).strip().lower() in ("true", "1", "1.0"))
    on, off = sel[overlapped], sel[~overlapped]
    if on.empty or off.empty:
        raise claims.NotDecidable(f"the overlap ablation of {kind} lacks an arm: it needs both")
    return on, off


def example_ablation() -> pd.DataFrame:
    """A synthetic overlap ablation for the claims' examples: ten runs of each arm at the
    model's cpu-profile times (AllReduce 197 ms overlapped, 219 after backward; DAdam 71 ms
    overlapped, 102 waited; run r 1% slower per r), ``predicted_s`` the arm's time.

    Example::

        >>> len(example_ablation()), sorted(example_ablation().kind.unique())
        (40, ['allreduce', 'decentralized'])
    """
    arms = {("allreduce", True): 0.197, ("allreduce", False): 0.219,
            ("decentralized", True): 0.071, ("decentralized", False): 0.102}
    return pd.DataFrame([{"factor": ABLATION, "kind": k, "overlap": o, "run": r,
                          "measured_s": t * (1 + 0.01 * r), "predicted_s": t}
                         for (k, o), t in arms.items() for r in range(10)])


@claims.prediction("e11_overlap_hides")
def predict_overlap_hides(df: pd.DataFrame, kinds: list[str]) -> str:
    """The runtime model's time per iteration of each ablation arm (overlapped and not) and
    their ratio, on this run's calibration and network.

    Example::

        >>> df = example_ablation()
        >>> predict_overlap_hides(df, ["allreduce", "decentralized"])
        'model AllReduce 219 ms after backward vs 197 overlapped: x1.11; DAdam 102 ms waited vs 71 overlapped: x1.44'
    """
    out = []
    for kind in kinds:
        on, off = _ablation_arms(df, kind)
        a, b = float(off.predicted_s.median()), float(on.predicted_s.median())
        name, how = ("AllReduce", "after backward") if kind == "allreduce" else ("DAdam", "waited")
        out.append(f"{name} {a * 1e3:.0f} ms {how} vs {b * 1e3:.0f} overlapped: x{a / b:.2f}")
    return "model " + "; ".join(out)


@claims.check("e11_overlap_hides")
def check_overlap_hides(df: pd.DataFrame, kinds: list[str], min_ratio: float
                        ) -> claims.Verdict:
    """The overlap ablation: for each of ``kinds``, the method's time per iteration without
    its overlap (AllReduce after backward; DAdam waiting for its gossip before the next
    forward) over its time with it -- the ratio of the medians over independent runs, with its
    95% interval (:func:`pipecomm.lab.claims.ratio`) -- at least ``min_ratio``. Every kind must
    hold: FAIL when any interval lies wholly below ``min_ratio``, PASS when every one lies at
    or above it, INCONCLUSIVE otherwise (an interval straddling it). The measured text gives
    each arm's median and the time overlap saved.

    Example::

        >>> df = example_ablation()
        >>> v = check_overlap_hides(df, ["allreduce", "decentralized"], 1.05)
        >>> v.verdict, v.threshold
        ('PASS', 'no overlap / overlap >= 1.05 for each of 2 (95% interval)')
    """
    if not kinds:
        raise ValueError("kinds: name at least one of 'allreduce', 'decentralized'")
    parts, verdicts = [], []
    for kind in kinds:
        on, off = _ablation_arms(df, kind)
        a, b = off.sort_values("run").measured_s.tolist(), on.sort_values("run").measured_s.tolist()
        r, lo, hi = claims.ratio(a, b)
        ma, mb = float(np.median(a)), float(np.median(b))
        name, how = ("AllReduce", "after backward") if kind == "allreduce" else ("DAdam", "waited")
        parts.append(f"{name}: {ma * 1e3:.1f} ms {how} vs {mb * 1e3:.1f} overlapped, "
                     f"x{claims.fmt_ci(r, lo, hi)}, saves {(ma - mb) * 1e3:.1f} ms "
                     f"({len(a)} and {len(b)} runs)")
        verdicts.append(claims.at_least(lo, hi, min_ratio))
    return claims.Verdict("; ".join(parts),
                          f"no overlap / overlap >= {min_ratio:g} for each of {len(kinds)} "
                          f"(95% interval)", claims.combine(verdicts))


if __name__ == "__main__":
    main(sys.modules[__name__])
