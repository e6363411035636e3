"""E1 — the LP paper's analysis: modelled time of LP, MST, BE and ring collectives.

Paper: Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural
Networks" (arXiv 1611.04255). Its analysis compares linear pipelining (LP) with minimum-spanning-
tree (MST, binomial tree) and bidirectional-exchange (BE) collectives in the alpha-beta(-gamma)
model: LP broadcast costs ``(p + k - 2)(alpha + b beta)`` -- almost independent of the number of
ranks p once the message is cut into ``k* = sqrt((p - 2) n beta / alpha)`` blocks -- while MST
costs ``ceil(log2 p)(alpha + n beta)`` and BE ``2 log2 p alpha + 2 (p - 1)/p n beta``.

Nothing is measured here: every number is :mod:`pipecomm.lab.networks.cost` evaluated for the schedules that
pipecomm implements (``cost.model_table``), for every algorithm (lp, mst, be, ring), op
(broadcast, reduce, allreduce) and port model ("single": one full-duplex port per rank;
"per-neighbor": one link per pair -- only LP allreduce, which sends both ways along the chain at
once, depends on it). Three sweeps: time vs message size (at each p of ``size_sweep_p``), time vs
p (at ``ranks_sweep_bytes``), and the optimal LP block size vs message size (the block sizes the
size sweep used; ``cost.lp_optimal_block_bytes``, beside the paper's continuous formula).

Nothing here is measured, so nothing here is a claim with a verdict: artifact/claims.yaml lists
C1.1 and C1.2 as model illustrations (kind: illustration), and E2-E4 test the same models against
measurements.

Run::

    python -m pipecomm.lab.experiments.e01_lp_cost_model --out results/manual/E1
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.lab import experiment
from pipecomm.lab.cli import main
from pipecomm.lab.measure.sweep import ALG_COLORS, message_sizes
from pipecomm.lab.networks import cost

ID = "E1"
NOTEBOOK = "01_lp_cost_model"


@dataclass(frozen=True)
class Params(experiment.Params):
    """E1's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    alpha_s: float = 10e-6
    bandwidth_Bps: float = 10e9
    gamma_s_per_byte: float = 1e-11
    sizes_min: int = 1024
    sizes_max: int = 1 << 30
    size_factor: int = 4
    size_sweep_p: list[int] = field(default_factory=lambda: [8, 64])
    world_sizes: list[int] = field(default_factory=lambda:
        [2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    )
    ranks_sweep_bytes: int = 1 << 28
    ops: list[str] = field(default_factory=lambda: ["broadcast", "reduce", "allreduce"])
    algorithms: list[str] = field(default_factory=lambda: ["lp", "mst", "be", "ring"])
    ports: list[str] = field(default_factory=lambda: ["single", "per-neighbor"])

    def validate(self) -> None:
        for name in ("alpha_s", "bandwidth_Bps", "gamma_s_per_byte"):
            v = getattr(self, name)
            if not np.isfinite(v) or v < 0:
                raise ValueError(f"parameter {name} must be a finite number >= 0, got {v!r}")
        if self.bandwidth_Bps <= 0:
            raise ValueError(f"parameter bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")
        _check_list("ops", self.ops, cost.OPS)
        _check_list("algorithms", self.algorithms, cost.ALGORITHMS)
        _check_list("ports", self.ports, cost.PORTS)
        _check_ranks("size_sweep_p", self.size_sweep_p)
        _check_ranks("world_sizes", self.world_sizes)
        if self.ranks_sweep_bytes < 1:
            raise ValueError(f"parameter ranks_sweep_bytes must be a positive int, got "
                             f"{self.ranks_sweep_bytes!r}")
        message_sizes(self.sizes_min, self.sizes_max, self.size_factor)


DEFAULTS = Params.defaults()

PORT_STYLES = {"single": "-", "per-neighbor": "--"}
#: The optimal-block panel draws one curve per op: colours no algorithm uses (ALG_COLORS).
OP_COLORS = {"broadcast": "C5", "reduce": "C6", "allreduce": "C9"}
OP_MARKERS = {8: "x"}  # the broadcast at p = 8 beside the largest p's curves


def link_label(alpha_s: float, bandwidth_Bps: float, gamma_s_per_byte: float) -> str:
    """Text naming the modelled link, for figures and the ``network`` column.

    Example::

        >>> link_label(10e-6, 10e9, 1e-11)
        'analytic model (no network): alpha 10 us, 10 GB/s, reduction 100 GB/s'
    """
    red = (
        "no reduction cost"
        if gamma_s_per_byte == 0
        else f"reduction {1e-9 / gamma_s_per_byte:.3g} GB/s"
    )
    return (
        f"analytic model (no network): alpha {alpha_s * 1e6:.3g} us, "
        f"{bandwidth_Bps / 1e9:.3g} GB/s, {red}"
    )


def _check_list(name: str, value: Any, allowed: tuple[str, ...] | None = None) -> list:
    if not isinstance(value, (list, tuple)) or len(value) == 0:
        raise ValueError(f"parameter {name} must be a non-empty list, got {value!r}")
    if allowed is not None:
        bad = [v for v in value if v not in allowed]
        if bad:
            raise ValueError(f"parameter {name} has unknown entries {bad}; choose from {allowed}")
    return list(value)


def _check_ranks(name: str, value: Any) -> list[int]:
    value = _check_list(name, value)
    if any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in value):
        raise ValueError(f"parameter {name} must list positive integers, got {value!r}")
    return sorted(set(value))


def run(**params: Any) -> pd.DataFrame:
    """Evaluate the cost models; one row per (sweep, op, algorithm, size, p, port model).

    Columns: ``sweep`` ("size" or "ranks"), ``op``, ``algorithm``, ``nbytes``, ``world_size``,
    ``ports``, ``time_s``, ``block_bytes`` (LP's optimal block, else empty),
    ``analytic_block_bytes`` (the continuous optimum ``sqrt(n alpha / d)``), the link
    (``alpha_s``, ``bandwidth_Bps``, ``gamma_s_per_byte``), ``backend`` ("model") and
    ``network`` (the link in words).

    Example::

        >>> df = run(sizes_max=1 << 20, world_sizes=[2, 64])     # the cost model only: no ranks
        >>> sorted(set(df.algorithm)), sorted(set(df.world_size))
        (['be', 'lp', 'mst', 'ring'], [2, 8, 64])
    """
    params = Params.make(**params)
    ops, algorithms, ports = list(params.ops), list(params.algorithms), list(params.ports)
    size_ps, world_sizes = sorted(set(params.size_sweep_p)), sorted(set(params.world_sizes))
    nb = params.ranks_sweep_bytes
    sizes = message_sizes(params.sizes_min, params.sizes_max, params.size_factor)

    link = cost.LinkModel.from_bandwidth(
        params.alpha_s, params.bandwidth_Bps, gamma=params.gamma_s_per_byte
    )
    by_size = cost.model_table(ops, algorithms, sizes, size_ps, link, ports=ports)
    by_ranks = cost.model_table(ops, algorithms, [nb], world_sizes, link, ports=ports)
    df = pd.concat(
        [by_size.assign(sweep="size"), by_ranks.assign(sweep="ranks")], ignore_index=True
    ).rename(columns={"p": "world_size"})
    analytic = []
    for r in df.itertuples():
        if r.algorithm != "lp" or r.nbytes == 0 or r.world_size < 2:
            analytic.append(np.nan)
            continue
        b = cost.lp_analytic_block_bytes(r.op, r.nbytes, r.world_size, link.with_ports(r.ports))
        analytic.append(b if np.isfinite(b) else np.nan)
    df["analytic_block_bytes"] = analytic
    return df.assign(
        alpha_s=float(params.alpha_s),
        bandwidth_Bps=float(params.bandwidth_Bps),
        gamma_s_per_byte=float(params.gamma_s_per_byte),
        backend="model",
        network=link_label(params.alpha_s, params.bandwidth_Bps, params.gamma_s_per_byte),
    )


def _same_as_single(g: pd.DataFrame, gp: pd.DataFrame, x: str) -> bool:
    single = g[g.ports == "single"].set_index(x).time_s
    other = gp.set_index(x).time_s
    common = single.index.intersection(other.index)
    return len(common) == len(other) and bool(
        np.allclose(single[common], other[common], rtol=1e-9, atol=0)
    )


def _ratio(df: pd.DataFrame, op: str, alg: str, other: str, ports: str = "single") -> pd.Series:
    """``time(other) / time(alg)`` per world size in the ranks sweep."""
    d = df[(df.sweep == "ranks") & (df.op == op) & (df.ports == ports)]
    piv = d.pivot_table(index="world_size", columns="algorithm", values="time_s")
    return piv[other] / piv[alg]


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Modelled times (ms) of every algorithm at the ranks sweep's message, per op, port model
    and p (the smallest, 8, 64 and the largest of the sweep), with LP's block size and the ratios
    of the others' times to LP's.

    Example::

        >>> s = summary(run(sizes_max=1 << 20, world_sizes=[2, 64]))   # one row per op, port model and p
        >>> s.set_index(["op", "ports", "world_size"]).loc[("allreduce", "single", 64), ["mst/lp", "be/lp"]].tolist()
        [4.872, 0.801]
    """
    d = df[df.sweep == "ranks"]
    if len(d):
        shown = {int(d.world_size.min()), int(d.world_size.max())} | ({8, 64} & set(d.world_size))
        d = d[d.world_size.isin(shown)]
    piv = (
        d.pivot_table(index=["op", "ports", "world_size"], columns="algorithm", values="time_s")
        * 1e3
    )
    piv.columns = [f"{c} ms" for c in piv.columns]
    if "lp ms" in piv:
        for other in ("mst", "be", "ring"):
            if f"{other} ms" in piv:
                piv[f"{other}/lp"] = piv[f"{other} ms"] / piv["lp ms"]
        blocks = d[d.algorithm == "lp"].set_index(["op", "ports", "world_size"]).block_bytes
        piv["lp block KiB"] = blocks.astype(float) / 1024
    return piv.round(3).reset_index()


def plot(df: pd.DataFrame, **params: Any):
    """Time vs size (row 1) and vs p (row 2) per op; optimal LP block; speedup ratios.

    Example::

        fig = plot(run()); fig.savefig("e1.png")
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    ops = [o for o in cost.OPS if o in set(df.op)]
    fig, axes = plt.subplots(2, len(ops) + 1, figsize=(4.2 * (len(ops) + 1), 7.5), squeeze=False)
    size_df, ranks_df = df[df.sweep == "size"], df[df.sweep == "ranks"]
    p_show = int(size_df.world_size.max()) if len(size_df) else None
    nb = int(ranks_df.nbytes.iloc[0]) if len(ranks_df) else None
    for j, op in enumerate(ops):
        for row, (d, x) in enumerate(
            (
                (size_df[(size_df.op == op) & (size_df.world_size == p_show)], "nbytes"),
                (ranks_df[ranks_df.op == op], "world_size"),
            )
        ):
            for alg, g in d.groupby("algorithm"):
                for ports in sorted(set(g.ports), key=lambda s: s != "single"):
                    gp = g[g.ports == ports].sort_values(x)
                    if ports != "single" and _same_as_single(g, gp, x):
                        continue  # the port model does not change this schedule
                    axes[row, j].plot(
                        gp[x],
                        gp.time_s,
                        PORT_STYLES.get(ports, ":"),
                        color=ALG_COLORS.get(alg),
                        marker="." if row else None,
                        label=f"{alg} ({ports})",
                    )
        axes[0, j].set(
            xscale="log",
            yscale="log",
            xlabel="message size (bytes)",
            ylabel="modelled time (s)",
            title=f"{op}, p={p_show}",
        )
        axes[1, j].set(
            xscale="log",
            xlabel="ranks p",
            ylabel="modelled time (s)",
            title=f"{op}, {nb / 2**20:g} MiB" if nb else op,
        )
        axes[1, j].xaxis.set_major_formatter(plt.ScalarFormatter())
        for row in (0, 1):  # every panel names its curves, one colour per algorithm throughout
            axes[row, j].legend(fontsize=7)
    # optimal block size vs message size
    ax = axes[0, -1]
    lp = size_df[size_df.algorithm == "lp"]
    for (op, ports, p), g in lp.groupby(["op", "ports", "world_size"]):
        if (op == "allreduce" or ports == "single") and (p == p_show or op == "broadcast"):
            ax.loglog(
                g.nbytes,
                g.block_bytes.astype(float),
                PORT_STYLES.get(ports, ":"),
                color=OP_COLORS.get(op),
                marker=OP_MARKERS.get(int(p), "."),
                label=f"{op}, {ports}, p={p}",
            )
    bc = lp[(lp.op == "broadcast") & (lp.ports == "single")]
    for _, g in bc.groupby("world_size"):
        ax.loglog(g.nbytes, g.analytic_block_bytes, "k:", lw=0.8)
    ax.set(
        xlabel="message size (bytes)",
        ylabel="optimal LP block (bytes)",
        title="optimal LP block size (exact discrete optimum)\n"
        "dotted: sqrt(n alpha / ((p-2) beta)), broadcast",
    )
    ax.legend(fontsize=7)
    # ratios vs p (the claims)
    ax = axes[1, -1]
    if (
        len(ranks_df)
        and {"lp", "mst", "be"} <= set(ranks_df.algorithm)
        and "broadcast" in set(ranks_df.op)
    ):
        for other, ls in (("mst", "-"), ("be", "--"), ("ring", ":")):
            if other in set(ranks_df.algorithm):
                r = _ratio(ranks_df, "broadcast", "lp", other, ranks_df.ports.iloc[0])
                ax.plot(
                    r.index,
                    r.values,
                    ls,
                    color=ALG_COLORS[other],
                    marker=".",
                    label=f"{other} / lp",
                )
        lp_b = ranks_df[
            (ranks_df.op == "broadcast")
            & (ranks_df.algorithm == "lp")
            & (ranks_df.ports == ranks_df.ports.iloc[0])
        ].sort_values("world_size")
        ax.plot(
            lp_b.world_size,
            lp_b.time_s / lp_b.time_s.iloc[0],
            "-",
            color=ALG_COLORS["lp"],
            marker=".",
            label="lp(p) / lp(p=2)",
        )
        ax.set(
            xscale="log",
            xlabel="ranks p",
            ylabel="ratio",
            title=f"broadcast, {nb / 2**20:g} MiB: ratios",
        )
        ax.xaxis.set_major_formatter(plt.ScalarFormatter())
        ax.legend(fontsize=7)
    fig.suptitle(
        f"E1 — {df.network.iloc[0]}; both port models "
        "(solid: single-port, dashed: per-neighbor where it differs); no backend, nothing measured",
        fontsize=9,
    )
    fig.tight_layout()
    return fig

if __name__ == "__main__":
    main(sys.modules[__name__])
