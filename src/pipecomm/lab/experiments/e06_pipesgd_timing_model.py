"""E6 — Pipe-SGD timing model: predicted iteration time, sync vs pipelined, with measured points.

Paper: Pipe-SGD — Li, Yu, Li, Avestimehr, Kim, Schwing, NeurIPS 2018 (arXiv 1811.03619): a
timing model of AllReduce SGD from network latency, bandwidth, cluster size and compute time;
synchronous SGD costs ``C + A + U`` per iteration (compute, AllReduce, update) and the pipeline of
width 2 costs ``max(C + U, A)`` (:mod:`pipecomm.lab.training.pipesgd_timing_model`).

Measures, for each (world size p, emulated bandwidth) pair in ``pools`` and each batch size,
``PipeSGD(mode="sync")`` and ``PipeSGD(mode="pipe")`` iteration times over ``runs`` independent
short runs, beside the model's prediction from a separate compute-timing run (C, U), the
emulated link and the gradient bytes. Claim C6.1 (artifact/claims.yaml): the model's signed error
at every measured iteration time.

Protocol in detail (compute-timing run, rounds, GIL switch interval, parameter choice, the known
limit at p = 4 on 2 cores): docs/experiments.md, "E6: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e06_pipesgd_timing_model --out results/manual/E6
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm import vocab
from pipecomm.lab import claims
from pipecomm.lab.checks import require
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats
from pipecomm.lab.measure.calibration import rank_calibrate_step, summarize_step
from pipecomm.lab.networks import cost, netem
from pipecomm.lab.networks import kinds as network
from pipecomm.lab.training import pipesgd_timing_model as timing_model
from pipecomm.lab.training.pipesgd_analysis import per_iteration, steady
from pipecomm.lab.training.pipesgd_config import CalibratedParams, TrainConfig, config
from pipecomm.lab.training.pipesgd_training import iteration_rows, rounds, train_rank
from pipecomm.lab.workloads.tasks import check_batch_size, gradient_bytes

ID = "E6"
NOTEBOOK = "06_pipesgd_timing_model"


@dataclass(frozen=True)
class Params(CalibratedParams):
    """E6's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them. The fields E6-E9 share are
    :class:`~pipecomm.lab.training.pipesgd_config.CalibratedParams`'."""

    pools: list[Any] = field(default_factory=lambda: [[2, 30e6]])
    batch_sizes: list[int] = field(default_factory=lambda: [64])
    modes: list[str] = field(default_factory=lambda: ["sync", "pipe"])
    iterations: int = 5
    skip: int = 2
    runs: int = 5
    calib_iters: int = 6
    seed: int = 0
    timeout_s: float = 300.0

    def validate(self) -> None:
        super().validate()
        pools = self.pools
        require(
            len(pools) >= 1
            and all(
                isinstance(x, (list, tuple))
                and len(x) == 2
                and isinstance(x[0], int)
                and not isinstance(x[0], bool)
                and x[0] >= 2
                and isinstance(x[1], (int, float))
                and x[1] > 0
                for x in pools
            ),
            "pools",
            pools,
            "must be a list of [world_size >= 2, bandwidth_Bps > 0] pairs",
        )
        require(
            len(self.batch_sizes) >= 1
            and all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in self.batch_sizes
            ),
            "batch_sizes",
            self.batch_sizes,
            "must be a non-empty list of ints >= 1",
        )
        require(
            len(self.modes) >= 1 and set(self.modes) <= set(MODES),
            "modes",
            self.modes,
            f"must be a non-empty list from {MODES}",
        )
        require(isinstance(self.runs, int) and not isinstance(self.runs, bool)
                and self.runs >= 1, "runs", self.runs,
                f"must be an int >= 1 (claims need >= {claims.MIN_REPEATS})")
        for b in self.batch_sizes:
            _config(self, b, "sync")  # a valid training configuration
            for p, _ in pools:
                check_batch_size(b, p, name="batch_sizes")

DEFAULTS = Params.defaults()
MODES = tuple(m for m in vocab.MODES if m != "layerwise")  # E6 compares BSP-SGD and Pipe-SGD


def _config(params: Params, batch: int, mode: str) -> TrainConfig:
    return config(params, batch_size=batch, method=mode)


def predict(
    mode: str,
    compute_s: float,
    update_s: float,
    nbytes: int,
    p: int,
    link: cost.LinkModel,
    algorithm: str,
) -> float:
    """The timing model's steady-state iteration time (``timing_model.iteration_time``).

    Example::

        >>> round(predict("pipe", 0.02, 0.001, 830_000, 2, cost.LinkModel(1e-3, 1 / 60e6), "ring"), 4)
        0.021
    """
    return timing_model.iteration_time(
        mode,
        compute_s=compute_s,
        update_s=update_s,
        nbytes=nbytes,
        p=p,
        link=link,
        algorithm=algorithm,
    )


def run(**params: Any) -> pd.DataFrame:
    """For every (p, bandwidth) pool and batch size: compute timing, then sync and pipe runs."""
    params = Params.make(**params)
    frames = []
    for p, bw in params.pools:
        net = netem.Network(alpha_s=params.alpha_s, bandwidth_Bps=float(bw), ports=params.ports)
        link = cost.link_from_network(net)
        rows: list[dict[str, Any]] = []
        ring_chunk = gradient_bytes(_config(params, params.batch_sizes[0], "sync")) // p
        with network.emulated_pool(p, net, ring_chunk, timeout_s=params.timeout_s) as ranks:
            cals, points = {}, []
            for batch in params.batch_sizes:
                nbytes = gradient_bytes(_config(params, batch, "sync"))
                cals[batch] = summarize_step(
                    ranks.run(
                        rank_calibrate_step,
                        _config(params, batch, "sync"),
                        params.calib_iters,
                        3,
                        timeout_s=params.timeout_s,
                    )
                )
                meta = dict(bandwidth_Bps=float(bw), batch_size=batch, nbytes=nbytes)
                rows.append({"kind": "calibration", **meta, **cals[batch]})
                points += [(batch, mode) for mode in params.modes]
            its: dict[tuple[int, str], list[dict[str, Any]]] = {pt: [] for pt in points}
            for r, (batch, mode) in rounds(points, params.runs):
                res = ranks.run(train_rank, _config(params, batch, mode),
                                timeout_s=params.timeout_s)
                its[batch, mode] += iteration_rows(
                    res, mode=mode, run=r, bandwidth_Bps=float(bw), batch_size=batch,
                    nbytes=gradient_bytes(_config(params, batch, "sync")))
            for batch, mode in points:
                cal, it = cals[batch], its[batch, mode]
                nbytes = gradient_bytes(_config(params, batch, "sync"))
                meta = dict(bandwidth_Bps=float(bw), batch_size=batch, nbytes=nbytes)
                rows += it
                st = steady(pd.DataFrame(it), params.skip)
                per_run = per_iteration(st, ["mode", "run"]).groupby("run")["T"].median()
                rows.append(
                    {
                        "kind": "point",
                        "mode": mode,
                        **meta,
                        **cal,
                        "measured_s": float(per_run.median()),
                        "times_s": stats.join_repeats(per_run),
                        "runs": len(per_run),
                        "predicted_s": predict(
                            mode,
                            cal["compute_s"],
                            cal["update_s"],
                            nbytes,
                            p,
                            link,
                            params.algorithm,
                        ),
                    }
                )
        frames.append(
            pd.DataFrame(rows).assign(
                backend="gloo",
                world_size=p,
                network=net.describe(),
                alpha_s=params.alpha_s,
                ports=params.ports,
                algorithm=params.algorithm,
                gamma_s_per_byte=link.gamma,
            )
        )
    df = pd.concat(frames, ignore_index=True)
    return df


# --------------------------------------------------------------------------- analysis


def points(df: pd.DataFrame) -> pd.DataFrame:
    """The measured points with their predictions and relative errors."""
    pts = df[df["kind"] == "point"].copy()
    pts["error"] = stats.model_error(pts["measured_s"].to_numpy(), pts["predicted_s"].to_numpy())
    return pts


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per measured point: p, bandwidth, batch, C, U, measured vs predicted."""
    pts = points(df)
    return pd.DataFrame(
        {
            "p": pts["world_size"].astype(int),
            "bandwidth_MBps": pts["bandwidth_Bps"] / 1e6,
            "batch": pts["batch_size"].astype(int),
            "mode": pts["mode"],
            "C_ms": pts["compute_s"] * 1e3,
            "U_ms": pts["update_s"] * 1e3,
            "measured_ms": pts["measured_s"] * 1e3,
            "model_ms": pts["predicted_s"] * 1e3,
            "error": pts["error"].map(lambda e: f"{e:+.1%}"),
        }
    ).reset_index(drop=True)


def _link(row: pd.Series, bandwidth: float | None = None) -> cost.LinkModel:
    bw = row["bandwidth_Bps"] if bandwidth is None else bandwidth
    return cost.LinkModel.from_bandwidth(
        row["alpha_s"], bw, gamma=row["gamma_s_per_byte"], ports=row["ports"]
    )


def plot(df: pd.DataFrame, **params: Any):
    """Model curves over p, bandwidth and compute with measured points; predicted vs measured."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    pts = points(df)
    cal = df[df["kind"] == "calibration"]
    base = cal.iloc[0]
    p0, bw0, batch0 = int(base["world_size"]), base["bandwidth_Bps"], base["batch_size"]
    alg = base["algorithm"]
    colors = {"sync": sns.color_palette()[0], "pipe": sns.color_palette()[1]}
    kw = dict(update_s=base["update_s"], nbytes=int(base["nbytes"]), algorithm=alg)

    # (a) model only, over p, for each emulated bandwidth of the run
    ps = np.arange(1, 33)
    for bw, ls in zip(sorted(set(cal["bandwidth_Bps"])), ("-", "--", ":", "-.")):
        for mode in MODES:
            ys = [
                predict(mode, base["compute_s"], p=int(p), link=_link(base, bw), **kw)
                for p in ps
            ]
            axes[0].plot(
                ps, np.array(ys) * 1e3, ls, color=colors[mode], label=f"{mode}, {bw / 1e6:g} MB/s"
            )
    axes[0].set(
        xscale="log",
        xlabel="ranks p",
        ylabel="ms per iteration",
        title=f"model vs p (C={base['compute_s'] * 1e3:.1f} ms, U, bytes fixed)",
    )
    axes[0].legend(fontsize=8)

    # (b) over bandwidth at (p0, batch0)
    bws = np.geomspace(5e6, 2e9, 80)
    for mode in MODES:
        ys = [
            predict(mode, base["compute_s"], p=p0, link=_link(base, b), **kw) for b in bws
        ]
        axes[1].plot(bws / 1e6, np.array(ys) * 1e3, color=colors[mode], label=f"model {mode}")
        sel = pts[
            (pts["mode"] == mode) & (pts["world_size"] == p0) & (pts["batch_size"] == batch0)
        ]
        axes[1].plot(
            sel["bandwidth_Bps"] / 1e6,
            sel["measured_s"] * 1e3,
            "o",
            color=colors[mode],
            label=f"measured {mode}",
        )
    axes[1].set(
        xscale="log",
        xlabel="emulated bandwidth (MB/s)",
        ylabel="ms per iteration",
        title=f"vs bandwidth (p={p0}, batch {batch0})",
    )
    axes[1].legend(fontsize=8)

    # (c) over compute at (p0, the fastest bandwidth measured there: compute matters most)
    bw0 = cal.loc[cal["world_size"] == p0, "bandwidth_Bps"].max()
    base_c = cal[(cal["world_size"] == p0) & (cal["bandwidth_Bps"] == bw0)].iloc[0]
    sel_cal = cal[(cal["world_size"] == p0) & (cal["bandwidth_Bps"] == bw0)]
    cs = np.linspace(0, 3 * sel_cal["compute_s"].max(), 80)
    for mode in MODES:
        ys = [
            predict(
                mode, c, p=p0, link=_link(base_c), **{**kw, "update_s": base_c["update_s"]}
            )
            for c in cs
        ]
        axes[2].plot(cs * 1e3, np.array(ys) * 1e3, color=colors[mode], label=f"model {mode}")
        sel = pts[
            (pts["mode"] == mode) & (pts["world_size"] == p0) & (pts["bandwidth_Bps"] == bw0)
        ]
        axes[2].plot(
            sel["compute_s"] * 1e3,
            sel["measured_s"] * 1e3,
            "o",
            color=colors[mode],
            label=f"measured {mode}",
        )
    axes[2].set(
        xlabel="compute C per iteration (ms, from the compute-timing run)",
        ylabel="ms per iteration",
        title=f"vs compute (p={p0}, {bw0 / 1e6:g} MB/s)",
    )
    axes[2].legend(fontsize=8)

    # (d) predicted vs measured
    lim = max(pts["measured_s"].max(), pts["predicted_s"].max()) * 1e3 * 1.1
    xs = np.array([0, lim])
    axes[3].fill_between(xs, xs * 0.75, xs * 1.25, color="0.9", label="+-25%")
    axes[3].plot(xs, xs, "k-", lw=1)
    sns.scatterplot(
        data=pts.assign(
            measured_ms=pts["measured_s"] * 1e3,
            model_ms=pts["predicted_s"] * 1e3,
            p=pts["world_size"].astype(int),
        ),
        x="measured_ms",
        y="model_ms",
        hue="mode",
        style="p",
        ax=axes[3],
        s=60,
        palette=colors,
    )
    axes[3].set(
        xlim=(0, lim),
        ylim=(0, lim),
        xlabel="measured ms per iteration",
        ylabel="model ms per iteration",
        title="model vs measured, all points",
    )
    nets = sorted(set(df["network"]))
    fig.suptitle(
        f"E6 Pipe-SGD timing model, gloo, {alg} AllReduce, p in "
        f"{sorted(set(pts['world_size'].astype(int)))}, emulated: " + "; ".join(nets),
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


@claims.check("e6_model_within")
def check_model_within(df: pd.DataFrame, tolerance: float, max_p: int,
                       may_miss: str | int) -> claims.Verdict:
    """Every measured point with p <= ``max_p``: signed error of the timing model within
    ``tolerance``, decided on the interval of the median over the independent runs (``times_s``:
    each run's median steady iteration time), except for the allowance of ``may_miss`` points
    (:func:`pipecomm.lab.claims.allowance`).

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [("sync", 2, 0.030), ("pipe", 2, 0.021), ("sync", 4, 0.036), ("pipe", 4, 0.024)]
        >>> df = pd.DataFrame([{"kind": "point", "mode": m, "world_size": p, "bandwidth_Bps": 60e6,
        ...                     "batch_size": 32, "measured_s": s * 1.02, "predicted_s": s,
        ...                     "times_s": stats.join_repeats(s * 1.02 * np.linspace(0.99, 1.01, 5))}
        ...                    for m, p, s in cells])                   # 2% slower than the model
        >>> check_model_within(df, 0.25, 4, "none")             # doctest: +ELLIPSIS
        Verdict(measured='worst +2.0% [+1.0%, +3.0%] (sync, p=4, 60 MB/s, batch 32); bias +2.0%, 4/4 same sign; points: 4 PASS', threshold='|error| <= 25% at every point (95% interval)', verdict='PASS', reason='4 of 4 points PASS (0 may miss)')
    """
    claims.require_columns(df, "kind", "world_size", "measured_s", "predicted_s", "times_s")
    pts = points(df)
    pts = pts[pts["world_size"] <= max_p]
    if pts.empty:
        raise claims.NotDecidable(f"no measured points with p <= {max_p}")
    labels = [f"{r.mode}, p={int(r.world_size)}, {r.bandwidth_Bps / 1e6:g} MB/s, batch "
              f"{int(r.batch_size)}" for r in pts.itertuples()]
    return claims.model_points([stats.repeats(c) for c in pts.times_s],
                               pts.predicted_s.tolist(), labels, tolerance, may_miss=may_miss)


if __name__ == "__main__":
    main(sys.modules[__name__])
