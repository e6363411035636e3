"""E3 — measured collective time vs number of ranks p at a large message: LP flat, MST growing.

Paper: Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural
Networks" (arXiv 1611.04255): "the cost of LP is invariant to P", while minimum-spanning-tree
(MST, binomial tree) collectives grow like ``log2 p``. In the alpha-beta model LP broadcast costs
``(p + k - 2)(alpha + b beta)`` -- with the optimal block count ``k* = sqrt((p-2) n beta / alpha)``
only the short pipeline fill grows with p -- and MST ``ceil(log2 p)(alpha + n beta)``.

Measures pipecomm's collectives (``algorithms``, op ``op``) of one ``nbytes`` message on an
emulated network for every p in ``world_sizes``, each point with the model's time beside it.
Claims (artifact/claims.yaml C3.*): LP's broadcast time barely grows from the smallest to the
largest p (the paper's "invariant to P"); MST's grows like ceil(log2 p); the growth of both
against the model's growth (a method claim).

Subgroups, timing, the model and the shaped variant: docs/experiments.md, "E3: protocol in
detail".

Run::

    python -m pipecomm.lab.experiments.e03_collectives_vs_ranks --out results/manual/E3
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.lab import claims, experiment
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats
from pipecomm.lab.measure.sweep import (
    ALG_COLORS,
    check_link_params,
    measure_points,
    network,
)
from pipecomm.lab.networks import cost
from pipecomm.lab.networks.kinds import check_network_kind, ranks_on

ID = "E3"
NOTEBOOK = "03_collectives_vs_ranks"


@dataclass(frozen=True)
class Params(experiment.Params):
    """E3's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_sizes: list[int] = field(default_factory=lambda: [2, 3, 4])
    nbytes: int = 1 << 20
    op: str = "broadcast"
    algorithms: list[str] = field(default_factory=lambda: ["lp", "mst", "be", "ring"])
    # netem.check_host's margin at p = 4 on 2 cores (docs/network_model.md, "Quick defaults"):
    emu_alpha_s: float = 2e-3
    emu_bandwidth_Bps: float = 100e6
    ports: str = "single"
    iters: int = 2
    warmup: int = 0
    timeout_s: float = 600.0
    network: str = "emulated"  # "emulated" or "shaped" (network.ranks_on)

    def validate(self) -> None:
        check_network_kind(self.network)
        ws = self.world_sizes
        if (
            not isinstance(ws, (list, tuple))
            or not ws
            or any(isinstance(p, bool) or not isinstance(p, int) or p < 2 for p in ws)
        ):
            raise ValueError(f"parameter world_sizes must be a non-empty list of ints >= 2, got {ws!r}")
        for name, minimum in (("nbytes", 4), ("iters", 1), ("warmup", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise ValueError(f"parameter {name} must be an int >= {minimum}, got {v!r}")
        if self.op not in cost.OPS:
            raise ValueError(f"parameter op must be one of {cost.OPS}, got {self.op!r}")
        algs = self.algorithms
        if (
            not isinstance(algs, (list, tuple))
            or not algs
            or any(a not in cost.ALGORITHMS for a in algs)
        ):
            raise ValueError(
                f"parameter algorithms must list entries of {cost.ALGORITHMS} (the "
                f"built-in cannot be emulated), got {algs!r}"
            )
        check_link_params(self)


DEFAULTS = Params.defaults()
_POOL_START_S = 3.0  # rough start-up cost of an 8-rank pool on a quiet 2-core machine


def expected_runtime_s(**params: Any) -> dict[str, float]:
    """Model estimate of ``run``'s wall time: emulated transfers and the pool start (seconds).

    Example::

        >>> round(expected_runtime_s(world_sizes=[2, 4, 6, 8], nbytes=64 << 20)["total_s"], 1)
        38.7
    """
    params = Params.make(**params)
    link = cost.link_from_network(network(params))
    reps = params.warmup + params.iters
    emulated = sum(
        cost.collective_time(params.op, a, params.nbytes, p, link) * reps
        + cost.collective_time(params.op, a, 4096, p, link)
        for p in params.world_sizes
        for a in params.algorithms
    )
    starts = _POOL_START_S * max(1.0, max(params.world_sizes) / 8)
    return {"emulated_s": emulated, "starts_s": starts, "total_s": emulated + starts}


def run(**params: Any) -> pd.DataFrame:
    """Measure ``op`` of ``nbytes`` for every algorithm and p; one row per (algorithm, p).

    Columns: ``op``, ``algorithm``, ``nbytes``, ``world_size``, ``ports``, ``time_s`` (median of
    the max over ranks), ``min_s``, ``max_s``, ``warmup``, ``iters``, ``block_bytes`` (LP),
    ``model_s``, ``emu_alpha_s``, ``emu_bandwidth_Bps``, ``model_gamma_s_per_byte``, ``backend``,
    ``network``.

    Example::

        df = run(world_sizes=[2, 4], nbytes=1 << 20)
    """
    params = Params.make(**params)
    net = network(params)
    link = cost.link_from_network(net)
    ws = sorted(set(params.world_sizes))
    points = [
        {
            "op": params.op,
            "algorithm": a,
            "nbytes": params.nbytes,
            "p": p,
            "warmup": params.warmup,
            "iters": params.iters,
            "first_warmup": True,
        }
        for p in ws
        for a in params.algorithms
    ]
    smallest = min(params.nbytes // max(ws),  # a BE / ring chunk, or LP's block
                   cost.lp_optimal_block_bytes(params.op, params.nbytes, max(ws), link))
    with ranks_on(params.network, max(ws), net, smallest, timeout_s=params.timeout_s) as ranks:
        out = ranks.run(measure_points, points, timeout_s=params.timeout_s)
    link = cost.link_from_network(ranks.net)  # a shaped network's calibrated link
    h = float(cost.calibrated_link().alpha)  # host cost per LP block: E0's per-message latency
    df = pd.DataFrame(out[0])
    blocks = [None if pd.isna(b) else int(b) for b in df.block_bytes]
    df["model_s"] = [
        cost.overlapped_time(o, a, int(n), int(p), link, b, host_block_s=h)
        for o, a, n, p, b in zip(df.op, df.algorithm, df.nbytes, df.world_size, blocks)
    ]
    df["model_lockstep_s"] = [
        cost.collective_time(o, a, int(n), int(p), link, b)
        for o, a, n, p, b in zip(df.op, df.algorithm, df.nbytes, df.world_size, blocks)
    ]
    return df.assign(
        model_host_block_s=h,
        ports=params.ports,
        backend="gloo",
        network=ranks.text,
        network_kind=ranks.kind,
        emu_alpha_s=link.alpha,
        emu_bandwidth_Bps=link.bandwidth_Bps,
        model_gamma_s_per_byte=link.gamma,
    )


def growth(df: pd.DataFrame) -> pd.DataFrame:
    """Per algorithm: measured and modelled time relative to the smallest p.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> growth(df)[growth(df).algorithm == "lp"]      # time(p) / time(p_min) for each p
          algorithm  world_size  measured     model
        0        lp           2  1.000000  1.000000
        1        lp           8  1.076923  1.076923
    """
    d = df.sort_values("world_size")
    rows = []
    for alg, g in d.groupby("algorithm"):
        t0, m0 = float(g.time_s.iloc[0]), float(g.model_s.iloc[0])
        for r in g.itertuples():
            rows.append(
                {
                    "algorithm": alg,
                    "world_size": r.world_size,
                    "measured": r.time_s / t0,
                    "model": r.model_s / m0,
                }
            )
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per algorithm and p: measured and modelled time (ms), model error, growth vs smallest p.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> summary(df).columns.tolist()       # per algorithm and p; summary(run())
        ['algorithm', 'world_size', 'measured ms', 'model ms', 'model error', 'growth (measured)', 'growth (model)']
    """
    g = growth(df).set_index(["algorithm", "world_size"])
    d = df.set_index(["algorithm", "world_size"])
    out = pd.DataFrame(
        {
            "measured ms": d.time_s * 1e3,
            "model ms": d.model_s * 1e3,
            "model error": (d.model_s - d.time_s) / d.time_s,
            "growth (measured)": g.measured,
            "growth (model)": g.model,
        }
    )
    return out.round(3).reset_index()


def plot(df: pd.DataFrame, **params: Any):
    """Left: time vs p (measured dots, model lines); right: growth relative to the smallest p.

    Example::

        fig = plot(run()); fig.savefig("e3.png")
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    op, n, ports = df.op.iloc[0], int(df.nbytes.iloc[0]), df.ports.iloc[0]
    link = cost.LinkModel.from_bandwidth(
        float(df.emu_alpha_s.iloc[0]),
        float(df.emu_bandwidth_Bps.iloc[0]),
        gamma=float(df.model_gamma_s_per_byte.iloc[0]),
        ports=ports,
    )
    ps = np.arange(int(df.world_size.min()), int(df.world_size.max()) + 1)
    gr = growth(df)
    for alg, g in df.groupby("algorithm"):
        c = ALG_COLORS.get(alg)
        model = np.array([cost.collective_time(op, alg, n, int(p), link) for p in ps])
        axes[0].plot(g.world_size, g.time_s, "o", color=c, label=alg)
        axes[0].plot(ps, model, "-", color=c, lw=1, alpha=0.7)
        gg = gr[gr.algorithm == alg]
        axes[1].plot(gg.world_size, gg.measured, "o-", color=c, label=alg)
        axes[1].plot(ps, model / model[0], ":", color=c, lw=1)
    axes[0].set(
        xlabel="ranks p",
        ylabel="time (s)",
        title=f"{op} of {n / 2**20:g} MiB",
        xticks=sorted(set(df.world_size)),
    )
    axes[0].legend(fontsize=8, title="measured (dots), model (lines)", title_fontsize=7)
    axes[1].set(
        xlabel="ranks p",
        ylabel=f"time / time at p={int(df.world_size.min())}",
        title="growth with p (dotted: model)",
        xticks=sorted(set(df.world_size)),
    )
    axes[1].legend(fontsize=8)
    fig.suptitle(
        f"E3 — gloo, p = {', '.join(str(p) for p in sorted(set(df.world_size)))} "
        f"(subgroups of one pool), {df.network.iloc[0]}",
        fontsize=9,
    )
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def _run_link(df: pd.DataFrame) -> tuple[cost.LinkModel, float]:
    """The run's link and host cost per LP block, from its own columns."""
    claims.require_columns(df, "nbytes", "emu_alpha_s", "emu_bandwidth_Bps")
    r = df.iloc[0]
    gamma = float(r["model_gamma_s_per_byte"]) if "model_gamma_s_per_byte" in df else 0.0
    link = cost.LinkModel.from_bandwidth(float(r["emu_alpha_s"]), float(r["emu_bandwidth_Bps"]),
                                         0.0 if math.isnan(gamma) else gamma,
                                         str(r["ports"]) if "ports" in df else "single")
    h = float(r["model_host_block_s"]) if "model_host_block_s" in df else 0.0
    return link, 0.0 if math.isnan(h) else h


def _model_growth(df: pd.DataFrame, alg: str, op: str, p_lo: int, p_hi: int) -> float:
    """The model's time of ``alg`` at ``p_hi`` over that at ``p_lo`` (LP: overlapped, with
    the default block at each p), at the run's largest message."""
    link, h = _run_link(df)
    n = int(df.nbytes.max())
    return (cost.overlapped_time(op, alg, n, p_hi, link, host_block_s=h)
            / cost.overlapped_time(op, alg, n, p_lo, link, host_block_s=h))


def _growth_samples(df: pd.DataFrame, alg: str, op: str, p: int) -> list[float]:
    claims.require_columns(df, "op", "algorithm", "nbytes", "world_size", "times_s")
    d = df[(df.op == op) & (df.nbytes == df.nbytes.max()) & (df.algorithm == alg)
           & (df.world_size == p)]
    if d.empty:
        raise claims.NotDecidable(f"no {alg} {op} measured at p={p}")
    return [t for c in d.times_s for t in stats.repeats(c)]


@claims.prediction("e3_lp_invariant")
def predict_lp_invariant(df: pd.DataFrame, op: str, p_lo: int, p_hi: int) -> str:
    """C3.1's prediction for the run: the overlapped model's growth of LP ``op`` from ``p_lo``
    to ``p_hi`` at the run's largest message.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> predict_lp_invariant(df, "broadcast", 2, 16)
        'model LP growth p = 2 -> 16: 1.165x (broadcast of 64 MiB)'
    """
    return (f"model LP growth p = {p_lo} -> {p_hi}: {_model_growth(df, 'lp', op, p_lo, p_hi):.3f}x "
            f"({op} of {int(df.nbytes.max()) / 2**20:g} MiB)")


@claims.check("e3_lp_invariant")
def check_lp_invariant(df: pd.DataFrame, op: str, p_lo: int, p_hi: int,
                       max_growth: float) -> claims.Verdict:
    """LP's cost is nearly invariant to p: at the largest message, LP ``op``'s time at
    ``p_hi`` over its time at ``p_lo`` lies at or below ``max_growth`` (its interval).

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> check_lp_invariant(df, "broadcast", 2, 8, 1.25)
        Verdict(measured='LP p=2->8: x1.08 [1.07, 1.09]', threshold='growth <= x1.25', verdict='PASS', reason='95% interval [1.07, 1.09] at or below the threshold 1.25')
    """
    r = claims.ratio(_growth_samples(df, "lp", op, p_hi), _growth_samples(df, "lp", op, p_lo))
    return claims.Verdict(f"LP p={p_lo}->{p_hi}: x{claims.fmt_ci(*r)}",
                          f"growth <= x{max_growth:g}", claims.at_most(r[1], r[2], max_growth))


@claims.prediction("e3_mst_log_growth")
def predict_mst_log(df: pd.DataFrame, op: str, p_lo: int) -> str:
    """C3.2's (superseded by C3.2b) prediction for the run: MST's growth from ``p_lo`` in the
    model, against
    ceil(log2 p) / ceil(log2 p_lo), at every p of the run.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> predict_mst_log(df, "broadcast", 2)
        'model MST growth from p = 2: p=8 3.00x (ceil(log2 p) ratios)'
    """
    ps = sorted(p for p in set(df.world_size) if p > p_lo)
    parts = [f"p={p} {_model_growth(df, 'mst', op, p_lo, int(p)):.2f}x" for p in ps]
    return f"model MST growth from p = {p_lo}: " + ", ".join(parts) + " (ceil(log2 p) ratios)"


@claims.check("e3_mst_log_growth")
def check_mst_log(df: pd.DataFrame, op: str, p_lo: int, tolerance: float,
                  may_miss: str | int) -> claims.Verdict:
    """MST grows like log p: at every measured p above ``p_lo``, MST ``op``'s time over its
    time at ``p_lo`` lies within ``tolerance`` (signed relative error, on its interval) of
    ``ceil(log2 p) / ceil(log2 p_lo)``, but the allowance of ``may_miss`` points.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> check_mst_log(df, "broadcast", 2, 0.15, "none").verdict
        'PASS'
    """
    claims.require_columns(df, "world_size")
    ps = sorted(int(p) for p in set(df[df.algorithm == "mst"].world_size) if p > p_lo)
    if not ps:
        raise claims.NotDecidable(f"no MST {op} measured above p={p_lo}")
    base = _growth_samples(df, "mst", op, p_lo)
    verdicts, parts = [], []
    for p in ps:
        r = claims.ratio(_growth_samples(df, "mst", op, p), base)
        target = math.ceil(math.log2(p)) / math.ceil(math.log2(p_lo))
        e = [stats.model_error(v, target) for v in r]
        verdicts.append(claims.within(e[1], e[2], tolerance))
        parts.append(f"p={p} x{claims.fmt_ci(*r)} (log x{target:g}, {e[0]:+.1%})")
    allowed = claims.allowance(len(verdicts), may_miss)
    return claims.Verdict(f"MST from p={p_lo}: " + "; ".join(parts)
                          + f"; {claims.missed(verdicts, allowed)}",
                          f"within {tolerance:.0%} of ceil(log2 p) / ceil(log2 {p_lo}) at every "
                          f"p but {allowed}", claims.combine(verdicts, allowed))


SHAPES = ("log", "linear")  # MST growth t(p) / t(p_lo) fitted by a + b ceil(log2 p), a + b p


def fit_residuals(ps: list[int], growth: np.ndarray) -> np.ndarray:
    """The largest relative residual ``|fit - g| / g`` of the least-squares lines ``g = a + b
    ceil(log2 p)`` and ``g = a + b p`` through the growths ``g`` at ranks ``ps`` (one row per
    sample of growths, or one vector): column 0 the log fit's, column 1 the linear fit's. The
    free ``a`` and ``b`` absorb a constant factor and a constant overhead per step, so only
    the shape decides.

    Example::

        >>> import numpy as np
        >>> fit_residuals([2, 4, 8, 16], np.array([1.0, 2.0, 3.0, 4.0])).round(2)   # log growth
        array([0. , 0.4])
        >>> fit_residuals([2, 4, 8, 16], np.array([1.0, 3.0, 7.0, 15.0])).round(2)  # linear
        array([1.4, 0. ])
    """
    g = np.atleast_2d(np.asarray(growth, dtype=float))
    out = []
    for x in (np.array([math.ceil(math.log2(p)) for p in ps], float), np.array(ps, float)):
        dx = x - x.mean()
        b = ((g - g.mean(axis=1, keepdims=True)) * dx).sum(axis=1, keepdims=True) / (dx @ dx)
        a = g.mean(axis=1, keepdims=True) - b * x.mean()
        out.append(np.max(np.abs(a + b * x - g) / g, axis=1))
    res = np.stack(out, axis=1)
    return res[0] if np.ndim(growth) == 1 else res


def _shape_ranks(df: pd.DataFrame, alg: str, op: str, p_lo: int) -> list[int]:
    claims.require_columns(df, "op", "algorithm", "nbytes", "world_size", "times_s")
    d = df[(df.op == op) & (df.algorithm == alg)]
    ps = sorted(int(p) for p in set(d.world_size) if p >= p_lo)
    if len(ps) < 3 or ps[0] != p_lo or len({math.ceil(math.log2(p)) for p in ps}) < 2:
        raise claims.NotDecidable(f"a shape needs {alg} {op} at p={p_lo} and at >= 2 larger p spanning "
                         f">= 2 values of ceil(log2 p); measured p={ps}")
    return ps


@claims.prediction("e3_mst_log_shape")
def predict_mst_log_shape(df: pd.DataFrame, op: str, p_lo: int) -> str:
    """C3.2b's prediction for the run: the fits of :func:`fit_residuals` to the model's MST
    times at the run's ranks and largest message.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("mst", p, 1.3 * k) for p, k in ((2, 1), (4, 2), (8, 3), (16, 4))]
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> predict_mst_log_shape(df, "broadcast", 2)
        'model MST growth from p = 2 at p = 4, 8, 16: x2.00, x3.00, x4.00; log fit residual 0.0%, linear fit 40.0%'
    """
    ps = _shape_ranks(df, "mst", op, p_lo)
    d = df[(df.op == op) & (df.algorithm == "mst") & (df.nbytes == df.nbytes.max())]
    model = np.array([float(d[d.world_size == p].model_s.median()) for p in ps])
    g = model / model[0]
    r_log, r_lin = fit_residuals(ps, g)
    return (f"model MST growth from p = {p_lo} at p = {', '.join(map(str, ps[1:]))}: "
            + ", ".join(f"x{v:.2f}" for v in g[1:])
            + f"; log fit residual {r_log:.1%}, linear fit {r_lin:.1%}")


@claims.check("e3_mst_log_shape")
def check_mst_log_shape(df: pd.DataFrame, op: str, p_lo: int,
                        tolerance: float) -> claims.Verdict:
    """MST grows like log p and not like p, whatever the constant factor: at the largest
    message, MST ``op``'s growth ``t(p) / t(p_lo)`` over every measured p is fitted by ``a + b
    ceil(log2 p)`` and by ``a + b p`` (:func:`fit_residuals`); the largest relative residual of
    each fit has a bootstrap interval (each p's repeats resampled, the growth of their medians
    refitted). PASS when the log fit's interval lies within ``tolerance`` and the linear fit's
    above it (the log shape fits, the linear one is rejected); FAIL when the log fit's lies
    above ``tolerance`` (the growth is not log-shaped); INCONCLUSIVE otherwise -- also when both
    fit, where the ranks measured cannot tell the two shapes apart.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("mst", p, 0.1 + 1.3 * k) for p, k in ((2, 1), (4, 2), (8, 3), (16, 4))]
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> check_mst_log_shape(df, "broadcast", 2, 0.1).verdict
        'PASS'
    """
    ps = _shape_ranks(df, "mst", op, p_lo)
    d = df[(df.op == op) & (df.algorithm == "mst") & (df.nbytes == df.nbytes.max())]
    samples = [np.array([t for c in d[d.world_size == p].times_s for t in stats.repeats(c)])
               for p in ps]
    if any(s.size == 0 for s in samples):
        raise claims.NotDecidable(f"no MST {op} repeats at some p of {ps} at the largest message")
    medians = np.array([claims.interval(list(s))[0] for s in samples])
    est = fit_residuals(ps, medians / medians[0])
    if min(s.size for s in samples) < claims.MIN_REPEATS:
        spans = [(0.0, math.inf), (0.0, math.inf)]
    else:
        rng = np.random.default_rng(stats.BOOTSTRAP_SEED)
        boots = np.stack([np.median(s[rng.integers(0, s.size, (stats.N_BOOT, s.size))], axis=1)
                          for s in samples], axis=1)
        res = fit_residuals(ps, boots / boots[:, :1])
        tail = (1 - stats.CONFIDENCE) / 2
        spans = [tuple(float(q) for q in np.quantile(res[:, k], [tail, 1 - tail]))
                 for k in range(2)]
    log_v = claims.at_most(*spans[0], tolerance)
    lin_v = claims.at_least(*spans[1], tolerance)
    t = f"{tolerance:.0%}"
    if log_v == claims.FAIL:
        verdict = claims.Decision(claims.FAIL, f"the log fit misses by more than {t}: "
                                  + log_v.reason)
    elif log_v == claims.PASS and lin_v == claims.PASS:
        verdict = claims.Decision(claims.PASS, f"the log fit holds within {t} ({log_v.reason}); "
                                  f"the linear fit misses by more ({lin_v.reason})")
    elif log_v == claims.PASS and lin_v == claims.FAIL:
        verdict = claims.Decision(claims.INCONCLUSIVE, f"both shapes fit within {t}: these "
                                  f"ranks cannot tell log p from p ({lin_v.reason})")
    else:
        undecided = log_v if log_v == claims.INCONCLUSIVE else lin_v
        verdict = claims.Decision(claims.INCONCLUSIVE, undecided.reason)
    g = medians / medians[0]
    return claims.Verdict(
        f"MST from p={p_lo} at {int(d.nbytes.max()) / 2**20:g} MiB: "
        + ", ".join(f"p={p} x{v:.3g}" for p, v in zip(ps[1:], g[1:]))
        + f"; largest residual: log fit {est[0]:.1%} [{spans[0][0]:.1%}, {spans[0][1]:.1%}], "
        f"linear fit {est[1]:.1%} [{spans[1][0]:.1%}, {spans[1][1]:.1%}]",
        f"log fit within {t}, linear fit off by more than {t} (95% intervals)", verdict)


@claims.prediction("e3_lp_flat_mst_grows")
def predict_lp_flat(df: pd.DataFrame, p_lo: int, p_hi: int, op: str) -> str:
    """C3.3's prediction for the run: the model's growth of LP's and MST's ``op`` time from
    ``p_lo`` to ``p_hi`` ranks (LP by the overlapped model) at the run's largest message on the run's link (the model
    needs no measurement at those p).

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> predict_lp_flat(df, 2, 16, "broadcast")
        'model growth p = 2 -> 16: LP 1.16x, MST 4.00x (broadcast of 64 MiB, 2 ms, 50 MB/s)'
    """
    link, _ = _run_link(df)
    n = int(df.nbytes.max())
    growth = [f"{alg.upper()} {_model_growth(df, alg, op, p_lo, p_hi):.2f}x"
              for alg in ("lp", "mst")]
    return (f"model growth p = {p_lo} -> {p_hi}: {', '.join(growth)} ({op} of {n / 2**20:g} MiB, "
            f"{link.alpha * 1e3:g} ms, {link.bandwidth_Bps / 1e6:.3g} MB/s)")


@claims.check("e3_lp_flat_mst_grows")
def check_lp_flat(df: pd.DataFrame, p_lo: int, p_hi: int, op: str,
                  tolerance: float) -> claims.Verdict:
    """At the largest message, the growth of LP's and of MST's ``op`` time from ``p_lo`` to
    ``p_hi`` ranks each agree with the model's growth: signed error of the measured growth
    ratio (with its interval) within ``tolerance``. The model has LP nearly flat and MST
    growing like ``ceil(log2 p)``, so a flat MST or a growing LP fails.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("lp", 2, 1.30), ("lp", 8, 1.40), ("mst", 2, 1.30), ("mst", 8, 3.90)]   # seconds
        >>> df = pd.DataFrame([{"op": "broadcast", "algorithm": a, "nbytes": 64 << 20, "world_size": p,
        ...                     "time_s": s, "model_s": s, "emu_alpha_s": 2e-3, "emu_bandwidth_Bps": 50e6,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for a, p, s in rows])
        >>> check_lp_flat(df, 2, 8, "broadcast", 0.15).measured   # doctest: +NORMALIZE_WHITESPACE
        'p=2->8 at 64 MiB: LP x1.08 [1.07, 1.09] (model x1.08, +0.0%); MST x3 [2.97, 3.03] (model x3.00, +0.0%)'
    """
    claims.require_columns(df, "op", "algorithm", "nbytes", "world_size", "times_s", "model_s")
    d = df[(df.op == op) & (df.nbytes == df.nbytes.max())]

    def at(alg: str, p: int) -> pd.DataFrame:
        v = d[(d.algorithm == alg) & (d.world_size == p)]
        if v.empty:
            raise claims.NotDecidable(f"no {alg} {op} measured at p={p}")
        return v

    parts, verdicts = [], []
    for alg in ("lp", "mst"):
        hi_rows, lo_rows = at(alg, p_hi), at(alg, p_lo)
        r = claims.ratio([t for c in hi_rows.times_s for t in stats.repeats(c)],
                         [t for c in lo_rows.times_s for t in stats.repeats(c)])
        model = float(hi_rows.model_s.median() / lo_rows.model_s.median())
        e = [stats.model_error(v, model) for v in r]
        verdicts.append(claims.within(e[1], e[2], tolerance))
        parts.append(f"{alg.upper()} x{claims.fmt_ci(*r)} (model x{model:.2f}, {e[0]:+.1%})")
    n = int(d.nbytes.max())
    return claims.Verdict(
        f"p={p_lo}->{p_hi} at {n / 2**20:g} MiB: " + "; ".join(parts),
        f"growth within {tolerance:.0%} of the model's, LP and MST",
        claims.combine(verdicts),
    )

if __name__ == "__main__":
    main(sys.modules[__name__])
