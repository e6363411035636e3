"""E5 — BSP-SGD with each collective: identical training curves, measured vs modelled AllReduce.

Paper: LP — Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale
Neural Networks" (arXiv 1611.04255): BSP-SGD (one AllReduce of all gradients per iteration)
converges unchanged when its collective is LP, and LP communicates faster than the
minimum-spanning-tree (MST) collectives.

How it is measured: one pool of ``world_size`` ranks on an emulated network (``netem``:
``alpha_s``, ``bandwidth_Bps``, port model ``ports``; gloo underneath). For each algorithm
(lp, mst, be, ring) the same model is trained from the same seed on the same shards with
``PipeSGD(mode="sync")``; a barrier before every ``step()`` aligns the ranks so that PipeSGD's
``comm_s`` is the AllReduce itself (per iteration the max over ranks, then the median over the
steady iterations, as :mod:`pipecomm.lab.bench` does). The cost model's prediction is
``cost.allreduce_time(algorithm, gradient bytes, p, link)`` on the emulated link (reduction cost
``gamma`` from E0's calibration; LP with the model's optimal block, which is what the ranks use).

Claims (artifact/claims.yaml, with thresholds and the model's predictions): C5.2 each
algorithm's measured communication time per iteration against the model (signed error); C5.3
LP's AllReduce takes less time than MST's. That the loss curves of all algorithms agree to
float32 round-off is checked by the tests.

The time budget of each profile is in ``artifact/profiles/<profile>.yaml``; a run's wall time
is in its ``env.json``.

Run::

    python -m pipecomm.lab.experiments.e05_bsp_sgd --out results/manual/E5
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm import cost, netem, vocab
from pipecomm.lab import claims
from pipecomm.lab.checks import require
from pipecomm.lab.cli import main
from pipecomm.lab.network import network_and_link, ranks_on
from pipecomm.lab.pipesgd_analysis import steady
from pipecomm.lab.pipesgd_config import PoolParams, check_config, config
from pipecomm.lab.pipesgd_training import iteration_rows, train_rank
from pipecomm.lab.workloads import fetch_data, gradient_bytes

ID = "E5"
NOTEBOOK = "05_bsp_sgd"


@dataclass(frozen=True)
class Params(PoolParams):
    """E5's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them. The fields E5-E9 share are
    :class:`~pipecomm.lab.pipesgd_config.PoolParams`'."""

    algorithms: list[str] = field(default_factory=lambda: ["lp", "mst", "be", "ring"])
    model: str = "mlp"
    model_kw: dict[str, Any] = field(default_factory=lambda: {"hidden": [256, 256]})
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    iterations: int = 10
    skip: int = 2
    seed: int = 0
    bandwidth_Bps: float | None = 50e6
    timeout_s: float = 300.0

    def validate(self) -> None:
        super().validate()
        p = self
        algs = list(p["algorithms"])
        require(
            len(algs) >= 2 and len(set(algs)) == len(algs) and set(algs) <= set(ALGORITHMS),
            "algorithms",
            algs,
            f"must be >= 2 distinct names from {ALGORITHMS}",
        )
        check_config(_config(p, algs[0]))

DEFAULTS = Params.defaults()
ALGORITHMS = vocab.MODELLED_ALGORITHMS  # the algorithms that run over the emulated network


def _config(p: dict[str, Any], algorithm: str) -> dict[str, Any]:
    return config(p, method="sync", algorithm=algorithm, barrier_before_step=True)


def run(**params: Any) -> pd.DataFrame:
    """Train BSP-SGD once per algorithm on one emulated-network pool; tidy per-iteration rows."""
    p = Params.make(**params)
    net, link = network_and_link(
        p, lambda: netem.Network(p["alpha_s"], p["bandwidth_Bps"], ports=p["ports"])
    )
    fetch_data(p)
    nbytes = gradient_bytes(_config(p, "lp"))
    rows: list[dict[str, Any]] = []
    with ranks_on(p["network"], p["world_size"], net, backend=p["backend"],
                  timeout_s=p["timeout_s"]) as ranks:
        if ranks.net is not None:  # a shaped network: the model's link is its calibration
            link = cost.link_from_network(ranks.net)
        for alg in p["algorithms"]:
            model_s = cost.allreduce_time(alg, nbytes, p["world_size"], link)
            res = ranks.run(train_rank, _config(p, alg), timeout_s=p["timeout_s"])
            rows += iteration_rows(res, algorithm=alg, nbytes=nbytes, model_comm_s=model_s)
    df = pd.DataFrame(rows)
    return df.assign(
        backend=p["backend"],
        world_size=p["world_size"],
        network=ranks.text,
        network_kind=ranks.kind,
        skip=p["skip"],
        gamma_s_per_byte=link.gamma,
    )


# --------------------------------------------------------------------------- analysis


def loss_curves(df: pd.DataFrame) -> pd.DataFrame:
    """Loss per algorithm and iteration (mean of the ranks' local losses)."""
    it = df[(df["kind"] == "iteration") & (df["iteration"] >= 0)]
    return it.groupby(["algorithm", "iteration"], as_index=False)["loss"].mean()


def loss_differences(df: pd.DataFrame) -> pd.DataFrame:
    """``|loss(algorithm) - loss(reference)|`` per iteration; the reference is the first
    algorithm of the run (lp by default)."""
    curves = loss_curves(df).pivot(index="iteration", columns="algorithm", values="loss")
    order = list(dict.fromkeys(df["algorithm"]))
    ref = order[0]
    out = []
    for alg in order[1:]:
        diff = (curves[alg] - curves[ref]).abs()
        out.append(
            pd.DataFrame(
                {
                    "iteration": diff.index,
                    "algorithm": alg,
                    "reference": ref,
                    "abs_diff": diff.to_numpy(),
                }
            )
        )
    return (
        pd.concat(out, ignore_index=True)
        if out
        else pd.DataFrame(columns=["iteration", "algorithm", "reference", "abs_diff"])
    )


def comm_times(df: pd.DataFrame) -> pd.DataFrame:
    """Per algorithm: measured AllReduce time (median over steady iterations of the max over
    ranks of ``comm_s``), the model's, and the steady iteration's other parts."""
    skip = int(df["skip"].iloc[0]) if "skip" in df else 0
    st = steady(df, skip)
    per_it = st.groupby(["algorithm", "iteration"], as_index=False).agg(
        comm_s=("comm_s", "max"),
        compute_s=("compute_s", "max"),
        update_s=("update_s", "max"),
        launch_s=("launch_s", "max"),
        iter_s=("iter_s", "max"),
        model_comm_s=("model_comm_s", "first"),
    )
    out = per_it.groupby("algorithm", as_index=False, sort=False).median(numeric_only=True)
    out = out.drop(columns=["iteration"])
    out["error"] = (out["comm_s"] - out["model_comm_s"]) / out["model_comm_s"]
    order = list(dict.fromkeys(df["algorithm"]))
    return out.set_index("algorithm").loc[order].reset_index()


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per algorithm: AllReduce measured vs model, iteration parts, final loss."""
    ct = comm_times(df)
    curves = loss_curves(df)
    last = curves[curves["iteration"] == curves["iteration"].max()].set_index("algorithm")["loss"]
    diffs = loss_differences(df).groupby("algorithm")["abs_diff"].max()
    rows = []
    for _, r in ct.iterrows():
        rows.append(
            {
                "algorithm": r["algorithm"],
                "allreduce_ms (measured)": r["comm_s"] * 1e3,
                "allreduce_ms (model)": r["model_comm_s"] * 1e3,
                "error": f"{r['error']:+.1%}",
                "compute+barrier_ms": r["compute_s"] * 1e3,
                "update_ms": r["update_s"] * 1e3,
                "iteration_ms": r["iter_s"] * 1e3,
                "final_loss": float(last.get(r["algorithm"], np.nan)),
                "max |loss - ref|": float(diffs.get(r["algorithm"], 0.0)),
            }
        )
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, **params: Any):
    """Loss curves (overlaid), their differences to the reference, and the AllReduce time per
    algorithm measured (bars) vs modelled (markers)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    curves = loss_curves(df)
    sns.lineplot(
        data=curves,
        x="iteration",
        y="loss",
        hue="algorithm",
        style="algorithm",
        ax=axes[0],
        markers=False,
        linewidth=1.5,
    )
    axes[0].set(title="training loss (mean over ranks)", ylabel="cross-entropy")
    diffs = loss_differences(df)
    if len(diffs):
        d = diffs.assign(abs_diff=diffs["abs_diff"].clip(lower=1e-12))
        sns.lineplot(data=d, x="iteration", y="abs_diff", hue="algorithm", ax=axes[1], marker="o")
        axes[1].set_yscale("log")
        axes[1].set(
            title=f"|loss - loss({diffs['reference'].iloc[0]})| (1e-12 = identical)",
            ylabel="absolute difference",
        )
    ct = comm_times(df)
    x = np.arange(len(ct))
    axes[2].bar(x, ct["comm_s"] * 1e3, color=sns.color_palette()[0], label="measured AllReduce")
    axes[2].plot(x, ct["model_comm_s"] * 1e3, "kD", label="cost model")
    axes[2].set_xticks(x, ct["algorithm"])
    axes[2].set(ylabel="ms per iteration", title="AllReduce of the gradients (median)")
    axes[2].legend()
    p = int(df["world_size"].iloc[0])
    fig.suptitle(
        f"E5 BSP-SGD, {df['backend'].iloc[0]}, p={p}, {df['network'].iloc[0]} "
        f"(gradients {int(df['nbytes'].iloc[0]) / 1e6:.2f} MB)"
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def comm_samples(df: pd.DataFrame) -> dict[str, list[float]]:
    """Per algorithm: the AllReduce time of every steady iteration (max over ranks of
    ``comm_s``), the repeats behind :func:`comm_times`' medians.

    Example::

        comm_samples(df)["lp"][:3]
    """
    skip = int(df["skip"].iloc[0]) if "skip" in df else 0
    st = steady(df, skip)
    per_it = st.groupby(["algorithm", "iteration"], sort=False).comm_s.max().reset_index()
    return {alg: g.comm_s.tolist() for alg, g in per_it.groupby("algorithm", sort=False)}


@claims.prediction("e5_comm_within_model")
def predict_comm(df: pd.DataFrame) -> str:
    """C5.2's prediction for the run: the model's AllReduce time per iteration of each
    algorithm, for the run's model, network and world size.

    Example::

        predict_comm(df)   # 'model lp 74, mst 103, be 41, ring 43 ms per iteration'
    """
    claims.require_columns(df, "kind", "algorithm", "iteration", "comm_s", "model_comm_s")
    ct = comm_times(df).set_index("algorithm")
    return "model " + ", ".join(f"{a} {ct.loc[a, 'model_comm_s'] * 1e3:.3g}" for a in ct.index) \
        + " ms per iteration"


@claims.prediction("e5_lp_below_mst")
def predict_lp_below_mst(df: pd.DataFrame) -> str:
    """C5.3's prediction for the run: the model's MST / LP AllReduce time.

    Example::

        predict_lp_below_mst(df)   # 'model mst/lp = 1.38'
    """
    claims.require_columns(df, "kind", "algorithm", "iteration", "comm_s", "model_comm_s")
    ct = comm_times(df).set_index("algorithm")
    return f"model mst/lp = {ct.loc['mst', 'model_comm_s'] / ct.loc['lp', 'model_comm_s']:.2f}"


@claims.check("e5_comm_within_model")
def check_comm_within_model(df: pd.DataFrame, tolerance: float) -> claims.Verdict:
    """Every algorithm's AllReduce time per iteration agrees with the cost model: signed error
    within ``tolerance`` on the interval of the median over steady iterations.

    Example::

        check_comm_within_model(df, 0.25)
    """
    claims.require_columns(df, "kind", "algorithm", "iteration", "comm_s", "model_comm_s")
    samples = comm_samples(df)
    ct = comm_times(df).set_index("algorithm")
    algs = list(samples)
    return claims.model_points([samples[a] for a in algs],
                               [float(ct.loc[a, "model_comm_s"]) for a in algs], algs, tolerance)


@claims.check("e5_lp_below_mst")
def check_lp_below_mst(df: pd.DataFrame, min_ratio: float) -> claims.Verdict:
    """MST's AllReduce time / LP's (medians over steady iterations) lies above ``min_ratio``.

    Example::

        check_lp_below_mst(df, 1.0)
    """
    claims.require_columns(df, "kind", "algorithm", "iteration", "comm_s", "model_comm_s")
    samples = comm_samples(df)
    missing = {"lp", "mst"} - set(samples)
    if missing:
        raise ValueError(f"no measurements for {sorted(missing)}")
    r, lo, hi = claims.ratio(samples["mst"], samples["lp"])
    ct = comm_times(df).set_index("algorithm")
    model = ct.loc["mst", "model_comm_s"] / ct.loc["lp", "model_comm_s"]
    return claims.Verdict(
        f"mst/lp {claims.fmt_ci(r, lo, hi)} (model {model:.2f}; lp "
        f"{ct.loc['lp', 'comm_s'] * 1e3:.1f} ms, mst {ct.loc['mst', 'comm_s'] * 1e3:.1f} ms)",
        f"mst/lp > {min_ratio:g}",
        claims.at_least(lo, hi, min_ratio),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
