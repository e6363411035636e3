"""E5 — BSP-SGD with each collective: identical training curves, measured vs modelled AllReduce.

Paper: LP — Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale
Neural Networks" (arXiv 1611.04255): BSP-SGD (one AllReduce of all gradients per iteration)
converges unchanged when its collective is LP, and LP relieves BSP-SGD's communication
bottleneck: faster than the minimum-spanning-tree (MST) and bidirectional-exchange (BE)
collectives.

Trains the same model from the same seed with ``PipeSGD(mode="sync")`` over lp, mst, be and ring
on an emulated network, per port model of ``port_models``, in ``runs`` interleaved short runs (one
repeat each), beside the cost model's AllReduce time. Claims (artifact/claims.yaml): C5.2 each
algorithm's measured communication time per iteration against the model; C5.3 LP's AllReduce
faster than MST's (single-port); C5.4 the paper's statement, LP faster than each of MST, BE and
ring on both port models. That the loss curves agree to float32 round-off is checked by the tests.

Runs, timing and the model's inputs: docs/experiments.md, "E5: protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e05_bsp_sgd --out results/manual/E5
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
from pipecomm.lab.networks import cost, netem
from pipecomm.lab.networks.kinds import network_and_link, ranks_on
from pipecomm.lab.training.pipesgd_analysis import steady
from pipecomm.lab.training.pipesgd_config import (
    TrainConfig,
    TrainingParams,
    check_pool,
    check_pool_backend,
    config,
)
from pipecomm.lab.training.pipesgd_training import iteration_rows, rounds, train_rank
from pipecomm.lab.workloads.tasks import fetch_data, gradient_bytes

ID = "E5"
NOTEBOOK = "05_bsp_sgd"


@dataclass(frozen=True)
class Params(TrainingParams):
    """E5's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them. The fields E5-E9 share are
    :class:`~pipecomm.lab.training.pipesgd_config.TrainingParams`'; the pool's (``world_size`` to
    ``network``) are those of
    :class:`~pipecomm.lab.training.pipesgd_config.CalibratedPoolParams`, checked alike
    (:func:`~pipecomm.lab.training.pipesgd_config.check_pool`). ``port_models`` replaces the
    shared ``ports`` (unused here): one pool per port model."""

    world_size: int = 2
    batch_size: int = 32
    bandwidth_Bps: float | None = 50e6
    backend: str = "gloo"
    dataset: str = "digits"
    data_root: str | None = None
    network: str = "emulated"  # "emulated" or "shaped" (network.ranks_on; gloo only)
    algorithms: list[str] = field(default_factory=lambda: ["lp", "mst", "be", "ring"])
    port_models: list[str] = field(default_factory=lambda: ["single", "per-neighbor"])
    runs: int = 5
    model: str = "mlp"
    model_kw: dict[str, Any] = field(default_factory=lambda: {"hidden": [256, 256]})
    lr: float = 0.05
    momentum: float = 0.9
    iterations: int = 6
    skip: int = 2
    seed: int = 0
    timeout_s: float = 300.0

    def validate(self) -> None:
        check_pool_backend(self)
        super().validate()
        check_pool(self, bandwidth_optional=False)
        algs = list(self.algorithms)
        require(
            len(algs) >= 2 and len(set(algs)) == len(algs) and set(algs) <= set(ALGORITHMS),
            "algorithms",
            algs,
            f"must be >= 2 distinct names from {ALGORITHMS}",
        )
        ports = list(self.port_models)
        require(len(ports) >= 1 and len(set(ports)) == len(ports)
                and set(ports) <= set(netem.PORTS), "port_models", ports,
                f"must be >= 1 distinct names from {netem.PORTS}")
        require(isinstance(self.runs, int) and not isinstance(self.runs, bool)
                and self.runs >= 1, "runs", self.runs,
                f"must be an int >= 1 (claims need >= {claims.MIN_REPEATS})")
        _config(self, algs[0])  # a valid training configuration

DEFAULTS = Params.defaults()
ALGORITHMS = vocab.MODELLED_ALGORITHMS  # the algorithms that run over the emulated network


def _config(params: Params, algorithm: str) -> TrainConfig:
    return config(params, method="sync", algorithm=algorithm, barrier_before_step=True)


def run(**params: Any) -> pd.DataFrame:
    """Per port model one emulated-network pool; in it ``runs`` interleaved rounds of one short
    BSP-SGD run per algorithm; tidy per-iteration rows with the ``run`` column."""
    params = Params.make(**params)
    fetch_data(params)
    nbytes = gradient_bytes(_config(params, "lp"))
    frames = []
    for ports in params.port_models:
        net, link = network_and_link(
            params,
            lambda ports=ports: netem.Network(params.alpha_s, params.bandwidth_Bps, ports=ports),
        )
        rows: list[dict[str, Any]] = []
        with ranks_on(params.network, params.world_size, net, backend=params.backend,
                      timeout_s=params.timeout_s) as ranks:
            if ranks.net is not None:  # a shaped network: the model's link is its calibration
                link = cost.link_from_network(ranks.net)
            model = {a: cost.allreduce_time(a, nbytes, params.world_size, link)
                     for a in params.algorithms}
            for r, alg in rounds(list(params.algorithms), params.runs):
                res = ranks.run(train_rank, _config(params, alg), timeout_s=params.timeout_s)
                rows += iteration_rows(res, algorithm=alg, run=r, nbytes=nbytes,
                                       model_comm_s=model[alg])
        frames.append(pd.DataFrame(rows).assign(
            ports=ports, network=ranks.text, network_kind=ranks.kind,
            gamma_s_per_byte=link.gamma))
    return pd.concat(frames, ignore_index=True).assign(
        backend=params.backend,
        world_size=params.world_size,
        skip=params.skip,
    )


# --------------------------------------------------------------------------- analysis


def _ports(df: pd.DataFrame) -> pd.Series:
    """The port model of each row (data without the column: single-port)."""
    return df["ports"] if "ports" in df else pd.Series("single", index=df.index)


def loss_curves(df: pd.DataFrame) -> pd.DataFrame:
    """Loss per algorithm and iteration (mean of the ranks' local losses, over every run and
    port model: each run trains from the same seed)."""
    it = df[(df["kind"] == "iteration") & (df["iteration"] >= 0)]
    return it.groupby(["algorithm", "iteration"], as_index=False)["loss"].mean()


def loss_differences(df: pd.DataFrame) -> pd.DataFrame:
    """``|loss(algorithm) - loss(reference)|`` per iteration; the reference is the first
    algorithm of the run (lp by default)."""
    curves = loss_curves(df).pivot(index="iteration", columns="algorithm", values="loss")
    order = list(dict.fromkeys(df["algorithm"].dropna()))
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


def run_times(df: pd.DataFrame) -> pd.DataFrame:
    """Per port model, algorithm and run (one independent repeat each): the median over the
    run's steady iterations of the max over ranks of ``comm_s`` (the AllReduce) and of the
    iteration's other parts, with the model's AllReduce time.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> run_times(df).groupby(["ports", "algorithm"]).comm_s.median()
        ports   algorithm
        single  be           0.08160
                lp           0.07344
                mst          0.10200
                ring         0.07956
        Name: comm_s, dtype: float64
    """
    claims.require_columns(df, "kind", "algorithm", "iteration", "run", "comm_s",
                           "model_comm_s")
    skip = int(df["skip"].iloc[0]) if "skip" in df else 0
    st = steady(df, skip)
    st = st.assign(ports=_ports(st))
    per_it = st.groupby(["ports", "algorithm", "run", "iteration"], as_index=False,
                        sort=False).agg(
        comm_s=("comm_s", "max"),
        compute_s=("compute_s", "max"),
        update_s=("update_s", "max"),
        launch_s=("launch_s", "max"),
        iter_s=("iter_s", "max"),
        model_comm_s=("model_comm_s", "first"),
    )
    return per_it.groupby(["ports", "algorithm", "run"], as_index=False, sort=False).median(
        numeric_only=True).drop(columns=["iteration"])


def comm_times(df: pd.DataFrame) -> pd.DataFrame:
    """Per port model and algorithm: measured AllReduce time (median over the runs of each
    run's median, :func:`run_times`), the model's, the signed error, the number of runs, and
    the steady iteration's other parts."""
    rt = run_times(df)
    out = rt.groupby(["ports", "algorithm"], as_index=False, sort=False).median(
        numeric_only=True).drop(columns=["run"])
    out["runs"] = rt.groupby(["ports", "algorithm"], sort=False)["run"].nunique().to_numpy()
    out["error"] = (out["comm_s"] - out["model_comm_s"]) / out["model_comm_s"]
    return out


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """One row per port model and algorithm: AllReduce measured vs model, LP's speed-up over
    it, iteration parts, final loss."""
    ct = comm_times(df)
    curves = loss_curves(df)
    last = curves[curves["iteration"] == curves["iteration"].max()].set_index("algorithm")["loss"]
    diffs = loss_differences(df).groupby("algorithm")["abs_diff"].max()
    rows = []
    for _, r in ct.iterrows():
        lp = ct[(ct["ports"] == r["ports"]) & (ct["algorithm"] == "lp")]["comm_s"]
        rows.append(
            {
                "ports": r["ports"],
                "algorithm": r["algorithm"],
                "runs": int(r["runs"]),
                "allreduce_ms (measured)": r["comm_s"] * 1e3,
                "allreduce_ms (model)": r["model_comm_s"] * 1e3,
                "error": f"{r['error']:+.1%}",
                "time / lp": r["comm_s"] / float(lp.iloc[0]) if len(lp) else np.nan,
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
    algorithm and port model measured (bars: median over runs, whiskers: the runs' range) vs
    modelled (markers)."""
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
    rt = run_times(df)
    ports = list(dict.fromkeys(ct["ports"]))
    algs = list(dict.fromkeys(ct["algorithm"]))
    width = 0.8 / len(ports)
    for j, port in enumerate(ports):
        c = ct[ct["ports"] == port].set_index("algorithm").loc[algs]
        g = rt[rt["ports"] == port].groupby("algorithm")["comm_s"]
        lo = (c["comm_s"] - g.min().loc[algs]) * 1e3
        hi = (g.max().loc[algs] - c["comm_s"]) * 1e3
        x = np.arange(len(algs)) + (j - (len(ports) - 1) / 2) * width
        axes[2].bar(x, c["comm_s"] * 1e3, width, yerr=[lo, hi], capsize=2,
                    color=sns.color_palette()[j], label=f"measured, {port}")
        axes[2].plot(x, c["model_comm_s"] * 1e3, "kD", label="cost model" if j == 0 else None)
    axes[2].set_xticks(np.arange(len(algs)), algs)
    axes[2].set(ylabel="ms per iteration",
                title=f"AllReduce of the gradients (median of {int(ct['runs'].min())}+ runs)")
    axes[2].legend(fontsize=8)
    p = int(df["world_size"].iloc[0])
    fig.suptitle(
        f"E5 BSP-SGD, {df['backend'].iloc[0]}, p={p}, "
        + "; ".join(dict.fromkeys(df["network"].dropna()))
        + f" (gradients {int(df['nbytes'].iloc[0]) / 1e6:.2f} MB)", fontsize=9
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def comm_samples(df: pd.DataFrame) -> dict[tuple[str, str], list[float]]:
    """Per (port model, algorithm): the AllReduce time of every independent run (the run's
    median over its steady iterations of the max over ranks of ``comm_s``), the repeats behind
    :func:`comm_times`' medians.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> [round(t, 5) for t in comm_samples(df)["single", "lp"]]   # one value per run
        [0.072, 0.07272, 0.07344, 0.07416, 0.07488]
    """
    rt = run_times(df)
    return {(port, alg): g["comm_s"].tolist()
            for (port, alg), g in rt.groupby(["ports", "algorithm"], sort=False)}


def _model(df: pd.DataFrame) -> dict[tuple[str, str], float]:
    ct = comm_times(df)
    return {(r.ports, r.algorithm): float(r.model_comm_s) for r in ct.itertuples()}


@claims.prediction("e5_comm_within_model")
def predict_comm(df: pd.DataFrame) -> str:
    """C5.2's prediction for the run: the model's AllReduce time per iteration of each
    algorithm and port model, for the run's model, network and world size.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> predict_comm(df)
        'model single: lp 72, mst 100, be 80, ring 78 ms per iteration'
    """
    model = _model(df)
    ports = list(dict.fromkeys(k[0] for k in model))
    return "model " + "; ".join(
        f"{port}: " + ", ".join(f"{a} {t * 1e3:.3g}" for (q, a), t in model.items() if q == port)
        + " ms" for port in ports) + " per iteration"


@claims.prediction("e5_lp_below_mst")
def predict_lp_below_mst(df: pd.DataFrame, ports: str) -> str:
    """C5.3's prediction for the run: the model's MST / LP AllReduce time.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> predict_lp_below_mst(df, "single")
        'model mst/lp = 1.39 (single)'
    """
    model = _model(df)
    return f"model mst/lp = {model[ports, 'mst'] / model[ports, 'lp']:.2f} ({ports})"


@claims.prediction("e5_lp_fastest")
def predict_lp_fastest(df: pd.DataFrame, others: list[str], port_models: list[str]) -> str:
    """C5.4's prediction for the run: the model's other / LP AllReduce time per port model.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> predict_lp_fastest(df, ["mst", "be"], ["single"])
        'model other/lp: single mst 1.39, be 1.11'
    """
    model = _model(df)
    return "model other/lp: " + "; ".join(
        f"{port} " + ", ".join(f"{o} {model[port, o] / model[port, 'lp']:.2f}" for o in others)
        for port in port_models)


@claims.check("e5_comm_within_model")
def check_comm_within_model(df: pd.DataFrame, tolerance: float,
                            may_miss: str | int) -> claims.Verdict:
    """Every algorithm's AllReduce time per iteration, on every port model, agrees with the
    cost model: signed error within ``tolerance`` on the interval of the median over the
    independent runs, except for the allowance of ``may_miss`` points
    (:func:`pipecomm.lab.claims.allowance`).

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> check_comm_within_model(df, 0.25, "binomial").threshold
        '|error| <= 25% at all but 1 of 4 points (95% interval)'
    """
    samples = comm_samples(df)
    model = _model(df)
    keys = list(samples)
    return claims.model_points([samples[k] for k in keys], [model[k] for k in keys],
                               [f"{a}, {port}" for port, a in keys], tolerance,
                               may_miss=may_miss)


def _ratio(samples: dict, port: str, other: str) -> tuple[float, float, float]:
    for key in ((port, other), (port, "lp")):
        if key not in samples:
            raise claims.NotDecidable(f"no measurements of {key[1]} on {key[0]} links")
    return claims.ratio(samples[port, other], samples[port, "lp"])


@claims.check("e5_lp_below_mst")
def check_lp_below_mst(df: pd.DataFrame, min_ratio: float, ports: str) -> claims.Verdict:
    """MST's AllReduce time / LP's on ``ports`` links (medians over the independent runs) lies
    above ``min_ratio``.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> check_lp_below_mst(df, 1.0, "single")             # doctest: +ELLIPSIS
        Verdict(measured='mst/lp 1.39 [1.35, 1.43] (model 1.39; lp 73.4 ms, mst 102.0 ms; single; 5 runs)', threshold='mst/lp > 1', verdict='PASS', reason='95% interval [1.35, 1.43] at or above the threshold 1')
    """
    samples = comm_samples(df)
    r, lo, hi = _ratio(samples, ports, "mst")
    model = _model(df)
    return claims.Verdict(
        f"mst/lp {claims.fmt_ci(r, lo, hi)} (model {model[ports, 'mst'] / model[ports, 'lp']:.2f}"
        f"; lp {np.median(samples[ports, 'lp']) * 1e3:.1f} ms, mst "
        f"{np.median(samples[ports, 'mst']) * 1e3:.1f} ms; {ports}; "
        f"{len(samples[ports, 'lp'])} runs)",
        f"mst/lp > {min_ratio:g}",
        claims.at_least(lo, hi, min_ratio),
    )


@claims.check("e5_lp_fastest")
def check_lp_fastest(df: pd.DataFrame, min_ratio: float, others: list[str],
                     port_models: list[str], may_miss: str | int) -> claims.Verdict:
    """The paper's statement: on every port model of ``port_models`` each of ``others``'
    AllReduce time / LP's (medians over the independent runs) lies above ``min_ratio``, except
    for the allowance of ``may_miss`` ratios; every ratio is reported with its interval and the
    model's.

    Example::

        >>> import pandas as pd
        >>> model = {"lp": 0.072, "mst": 0.100, "be": 0.080, "ring": 0.078}     # AllReduce s, single-port
        >>> df = pd.DataFrame([{"kind": "iteration", "algorithm": a, "ports": "single", "run": r,
        ...                     "iteration": i, "skip": 1, "comm_s": m * (1 + 0.01 * r),
        ...                     "model_comm_s": m, "compute_s": 0.01, "update_s": 0.001,
        ...                     "launch_s": 0.0, "iter_s": m + 0.011, "loss": 2.0}
        ...                    for a, m in model.items() for r in range(5) for i in range(3)])
        >>> check_lp_fastest(df, 1.0, ["mst", "be", "ring"], ["single"], "none").verdict   # and "per-neighbor"
        'PASS'
    """
    samples = comm_samples(df)
    model = _model(df)
    parts, verdicts = [], []
    for port in port_models:
        cells = []
        for other in others:
            r, lo, hi = _ratio(samples, port, other)
            verdicts.append(claims.at_least(lo, hi, min_ratio))
            cells.append(f"{other}/lp {claims.fmt_ci(r, lo, hi)} (model "
                         f"{model[port, other] / model[port, 'lp']:.2f})")
        parts.append(f"{port}: " + ", ".join(cells))
    allowed = claims.allowance(len(verdicts), may_miss)
    return claims.Verdict(
        "; ".join(parts) + f"; {claims.missed(verdicts, allowed)}",
        f"every other/lp > {min_ratio:g} (95% interval), {allowed} may miss",
        claims.combine(verdicts, allowed),
    )


if __name__ == "__main__":
    main(sys.modules[__name__])
