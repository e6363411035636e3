"""E8 — Pipe-SGD iteration-time breakdown: compute, communication, compression, update.

Paper: Pipe-SGD — Li, Yu, Li, Avestimehr, Kim, Schwing, NeurIPS 2018 (arXiv 1811.03619). Its
reviewers asked where an iteration's time goes; the paper's model says the pipeline of width 2
hides the AllReduce behind compute (``max(C + U, A)`` instead of ``C + A + U``).

Measures ``sync``, ``sync+fp16``, ``sync+int8``, ``layerwise``, ``pipe``, ``pipe+fp16`` and
``pipe+int8`` (ring AllReduce) in ``runs`` interleaved short runs each on an emulated network
whose bandwidth makes the AllReduce ``comm_ratio`` x (C + U); :func:`breakdown` is the table the
reviewers asked for (compute, AllReduce or wait, compression, update). Claim C8.1
(artifact/claims.yaml): overlap is real -- pipe's iteration time against the bound
``max(C, M) + f min(C, M)`` from the sync run of the same pool.

Runs, the breakdown's columns, the GIL interval, C and M of the claim and the batch size:
docs/experiments.md, "E8: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e08_pipesgd_breakdown --out results/manual/E8
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import pandas as pd

from pipecomm.lab import claims
from pipecomm.lab.checks import positive_float, require
from pipecomm.lab.cli import main
from pipecomm.lab.training.pipesgd_analysis import run_medians, run_samples, steady
from pipecomm.lab.training.pipesgd_config import (
    CalibratedPoolParams,
    TrainConfig,
    config,
    parse_method,
    parse_methods,
)
from pipecomm.lab.training.pipesgd_training import TIMING_COLUMNS, calibrate_and_train

ID = "E8"
NOTEBOOK = "08_pipesgd_breakdown"


@dataclass(frozen=True)
class Params(CalibratedPoolParams):
    """E8's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them. The fields E7-E9 share are
    :class:`~pipecomm.lab.training.pipesgd_config.CalibratedPoolParams`'."""

    ALGORITHMS: ClassVar[tuple[str, ...]] = ("lp", "ring")
    ALGORITHMS_WHY: ClassVar[str] = " (the algorithms that compress)"

    methods: list[str] = field(default_factory=lambda:
        ["sync", "sync+fp16", "sync+int8", "layerwise", "pipe", "pipe+fp16", "pipe+int8"]
    )
    seed: int = 0
    runs: int = 5
    iterations: int = 10
    skip: int = 4
    batch_size: int = 192
    bucket_mb: float = 0.5

    def validate(self) -> None:
        super().validate()
        methods = list(self.methods)
        require(
            len(methods) >= 2
            and "sync" in methods
            and "pipe" in methods
            and len(set(methods)) == len(methods),
            "methods",
            methods,
            "must list distinct methods including 'sync' and 'pipe'",
        )
        modes = [mode for mode, _, _ in parse_methods(methods)]
        require("nocomm" not in modes, "methods", methods, "'nocomm' has nothing to break down")
        positive_float(self, "bucket_mb")
        require(isinstance(self.runs, int) and not isinstance(self.runs, bool)
                and self.runs >= 1, "runs", self.runs,
                f"must be an int >= 1 (claims need >= {claims.MIN_REPEATS})")
        _config(self, self.seed, "sync")  # a valid training configuration

DEFAULTS = Params.defaults()
PARTS = ("compute", "allreduce", "wait", "compression", "update", "other")


def _config(params: Params, seed: int, method: str) -> TrainConfig:
    return config(params, seed=seed, method=method)


def run(**params: Any) -> pd.DataFrame:
    """Compute timing, network choice, then ``runs`` interleaved rounds of one training run
    per method in one pool."""
    params = Params.make(**params)
    return calibrate_and_train(params, _config, list(params.methods), [params.seed],
                               repeats=params.runs)


# --------------------------------------------------------------------------- analysis


def breakdown(df: pd.DataFrame) -> pd.DataFrame:
    """Mean per-iteration time of each part, per method (steady iterations, all ranks and runs):
    ``compute`` (forward, backward and packing), ``allreduce`` (the blocking AllReduce of sync
    and layer-wise runs, minus the codec time inside it), ``wait`` (pipelined runs: time blocked
    on the AllReduce in flight, which runs on the communication thread), ``compression`` (codec
    time on the critical path), ``update``, ``other`` (the rest of the iteration) and
    ``total``; ``compression_background`` is the codec time on the communication thread.

    Example::

        >>> import pandas as pd
        >>> parts = {"sync": (0.020, 0.015, 0.037), "pipe": (0.020, 0.002, 0.024)}   # compute, comm, iteration s
        >>> df = pd.DataFrame([{"kind": "iteration", "method": m, "run": r, "iteration": i, "skip": 1,
        ...                     "compute_s": c, "launch_s": 0.0, "comm_s": w, "compress_s": 0.0,
        ...                     "update_s": 0.002, "iter_s": t * (1 + 0.01 * r), "loss": 1.0}
        ...                    for m, (c, w, t) in parts.items() for r in range(5) for i in range(3)])
        >>> breakdown(df).set_index("method").loc[["sync", "pipe"], ["compute", "allreduce", "wait"]]
                compute  allreduce   wait
        method
        sync       0.02      0.015  0.000
        pipe       0.02      0.000  0.002
    """
    skip = int(df["skip"].iloc[0])
    st = steady(df, skip)
    order = list(dict.fromkeys(st["method"]))
    rows = []
    for m in order:
        g = st[st["method"] == m]
        mode, _, codec = parse_method(m)
        mean = g[list(TIMING_COLUMNS)].mean()
        inline = mode != "pipe"  # the codec runs inside the waited-for AllReduce
        comp = mean["compress_s"] if inline else 0.0
        blocked = max(mean["comm_s"] - comp, 0.0)
        compute = mean["compute_s"] + mean["launch_s"]
        row = {
            "method": m,
            "compute": compute,
            "allreduce": blocked if inline else 0.0,
            "wait": 0.0 if inline else blocked,
            "compression": comp,
            "update": mean["update_s"],
            "compression_background": 0.0 if inline else mean["compress_s"],
            "total": mean["iter_s"],
        }
        row["other"] = max(row["total"] - compute - row["update"] - blocked - comp, 0.0)
        rows.append(row)
    return pd.DataFrame(rows)


def overlap_bound(df: pd.DataFrame, method: str = "pipe", tolerance: float = 0.25) -> dict:
    """C and M of the sync runs, the bound ``max(C, M) + tolerance * min(C, M)`` and the
    measured per-iteration time T of ``method`` (per run the median over steady steps, then the
    median over the runs; see the module docstring)."""
    med = run_medians(df, ["method"]).groupby("method")[["T", "C", "M"]].median()
    for m in ("sync", method):
        if m not in med.index:
            raise claims.NotDecidable(f"no steady iterations of {m!r} in the data")
    c, m_ = float(med.loc["sync", "C"]), float(med.loc["sync", "M"])
    return {
        "C": c,
        "M": m_,
        "bound": max(c, m_) + tolerance * min(c, m_),
        "T": float(med.loc[method, "T"]),
        "T_sync": float(med.loc["sync", "T"]),
    }


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """The per-iteration breakdown the reviewers asked for, per method, in ms: compute,
    AllReduce (blocking, sync and layer-wise), wait (blocked on the AllReduce in flight,
    pipelined), compression, update, other (means over steady iterations, ranks and runs, as
    measured in the run), the codec time on the communication thread, the total, the median
    iteration time over the independent runs and the speedup vs sync.

    Example::

        >>> import pandas as pd
        >>> parts = {"sync": (0.020, 0.015, 0.037), "pipe": (0.020, 0.002, 0.024)}   # compute, comm, iteration s
        >>> df = pd.DataFrame([{"kind": "iteration", "method": m, "run": r, "iteration": i, "skip": 1,
        ...                     "compute_s": c, "launch_s": 0.0, "comm_s": w, "compress_s": 0.0,
        ...                     "update_s": 0.002, "iter_s": t * (1 + 0.01 * r), "loss": 1.0}
        ...                    for m, (c, w, t) in parts.items() for r in range(5) for i in range(3)])
        >>> summary(df).set_index("method").loc[["sync", "pipe"], ["compute_ms", "allreduce_ms", "median_iter_ms"]]
                compute_ms  allreduce_ms  median_iter_ms
        method
        sync          20.0          15.0           37.74
        pipe          20.0           0.0           24.48
    """
    b = breakdown(df)
    rm = run_medians(df, ["method"])
    med = rm.groupby("method")["T"].median()
    out = pd.DataFrame({"method": b["method"]})
    for col in (*PARTS, "compression_background", "total"):
        out[f"{col}_ms"] = b[col] * 1e3
    out["runs"] = b["method"].map(rm.groupby("method")["run"].nunique())
    out["median_iter_ms"] = b["method"].map(med) * 1e3
    out["speedup_vs_sync"] = med.get("sync", np.nan) / b["method"].map(med)
    return out


def plot(df: pd.DataFrame, **params: Any):
    """Stacked bars of the critical path per method; codec work on the communication thread
    hatched beside them; the overlap bound and the model's sync/pipe times as lines."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    b = breakdown(df)
    fig, ax = plt.subplots(figsize=(10, 0.55 * len(b) + 2.2))
    y = np.arange(len(b))[::-1]
    left = np.zeros(len(b))
    colors = dict(zip(PARTS, sns.color_palette("deep", len(PARTS))))
    for part in PARTS:
        ax.barh(y, b[part] * 1e3, left=left, color=colors[part], label=part, height=0.6)
        left += b[part].to_numpy() * 1e3
    bg = b["compression_background"].to_numpy() * 1e3
    if bg.any():
        ax.barh(
            y - 0.38,
            bg,
            left=0,
            height=0.14,
            color=colors["compression"],
            hatch="///",
            alpha=0.6,
            label="compression on the comm thread (overlapped)",
        )
    ax.set_yticks(y, b["method"])
    cal = df[df["kind"] == "calibration"].iloc[0]
    try:
        ob = overlap_bound(df)
        ax.axvline(
            ob["bound"] * 1e3,
            color="k",
            ls="-",
            lw=1,
            label=f"bound max(C,M)+0.25 min(C,M) = {ob['bound'] * 1e3:.1f} ms",
        )
    except ValueError:
        pass
    ax.axvline(cal["model_sync_s"] * 1e3, color="0.4", ls="--", lw=1, label="model sync")
    ax.axvline(cal["model_pipe_s"] * 1e3, color="0.4", ls=":", lw=1, label="model pipe")
    ax.set(xlabel="ms per iteration (mean over steady iterations and ranks)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(
        f"E8 iteration breakdown: gloo, p={int(df['world_size'].iloc[0])}, "
        f"{df['algorithm'].iloc[0]} AllReduce, {df['network'].iloc[0]}\n"
        f"(bandwidth chosen for AllReduce/compute = {cal['comm_ratio_model']:.2f} by the "
        "model)",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


@claims.check("e8_overlap_bound")
def check_overlap_bound(df: pd.DataFrame, tolerance: float, method: str) -> claims.Verdict:
    """The interval of ``method``'s median iteration time over the independent runs lies at or
    below ``max(C, M) + tolerance * min(C, M)`` of the sync runs (:func:`overlap_bound`).

    Example::

        >>> import pandas as pd
        >>> parts = {"sync": (0.020, 0.015, 0.037), "pipe": (0.020, 0.002, 0.024)}   # compute, comm, iteration s
        >>> df = pd.DataFrame([{"kind": "iteration", "method": m, "run": r, "iteration": i, "skip": 1,
        ...                     "compute_s": c, "launch_s": 0.0, "comm_s": w, "compress_s": 0.0,
        ...                     "update_s": 0.002, "iter_s": t * (1 + 0.01 * r), "loss": 1.0}
        ...                    for m, (c, w, t) in parts.items() for r in range(5) for i in range(3)])
        >>> check_overlap_bound(df, 0.25, "pipe")              # doctest: +ELLIPSIS
        Verdict(measured='pipe 24.5 [24, 25] ms (5 runs) vs bound 26.5 ms (C 22.7 ms, M 15.0 ms, sync 37.7 ms)', threshold='<= max(C, M) + 0.25 min(C, M)', verdict='PASS', reason='95% interval [0.024, 0.025] at or below the threshold 0.0265')
    """
    claims.require_columns(df, "kind", "method", "iteration", "iter_s", "comm_s", "skip", "run")
    ob = overlap_bound(df, method, tolerance)
    samples = run_samples(df, method)
    t, lo, hi = claims.interval(samples)
    return claims.Verdict(
        f"{method} {claims.fmt_ci(t * 1e3, lo * 1e3, hi * 1e3)} ms ({len(samples)} runs) vs bound "
        f"{ob['bound'] * 1e3:.1f} ms (C {ob['C'] * 1e3:.1f} ms, M {ob['M'] * 1e3:.1f} ms, sync "
        f"{ob['T_sync'] * 1e3:.1f} ms)",
        f"<= max(C, M) + {tolerance:g} min(C, M)",
        claims.at_most(lo, hi, ob["bound"]),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
