"""E4 — LP time vs block size: the measured optimum against the model's optimum.

Paper: Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural
Networks" (arXiv 1611.04255). Linear pipelining cuts an n-byte message into k blocks of b bytes;
in the paper's lock-step model its broadcast costs ``(p + k - 2)(alpha + b beta)``, optimum
``k* = sqrt((p - 2) n beta / alpha)`` (``pipecomm.lab.networks.cost.lp_optimal_block_bytes``). pipecomm's
progress engine overlaps a block's latency with the next block's bytes, so its broadcast costs
``(p - 1) alpha + (n + (p - 2) b) beta + k h`` with ``h`` the host's cost per block (E0's
per-message latency): the optimum is ``k* = sqrt((p - 2) n beta / h)``
(``pipecomm.lab.networks.cost.lp_overlapped_block_bytes``; docs/algorithms.md, "LP as the engine runs it").
The grid is centred on that optimum; ``model_s`` is the overlapped model, ``model_lockstep_s``
and ``lockstep_block_bytes`` the paper's.

Measures pipecomm's LP ``ops`` of one ``nbytes`` message on ``world_size`` ranks over an
emulated network with explicit ``block_bytes`` on a geometric grid around the modelled optimum.
Claims (artifact/claims.yaml C4.*): the measured best block size against the modelled optimum;
the cost of blocks 8x smaller and 8x larger than the optimum against the model's penalty.

The grid, timing, the shaped variant and the cpu profile's optimum: docs/experiments.md, "E4:
protocol in detail".

Run::

    python -m pipecomm.lab.experiments.e04_lp_block_size --out results/manual/E4
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
from pipecomm.lab.measure.sweep import ALG_COLORS, check_link_params, network
from pipecomm.lab.networks import cost
from pipecomm.lab.networks.kinds import check_network_kind, ranks_on

ID = "E4"
NOTEBOOK = "04_lp_block_size"


@dataclass(frozen=True)
class Params(experiment.Params):
    """E4's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_size: int = 4
    nbytes: int = 4 << 20
    ops: list[str] = field(default_factory=lambda: ["broadcast"])
    # netem.check_host's margin at p = 4 on 2 cores (docs/network_model.md, "Quick defaults"):
    emu_alpha_s: float = 2e-3
    emu_bandwidth_Bps: float = 100e6
    ports: str = "single"
    block_range: float = 8.0
    steps_per_octave: int = 2
    iters: int = 2
    warmup: int = 1
    timeout_s: float = 600.0
    network: str = "emulated"  # "emulated" or "shaped" (network.ranks_on)

    def validate(self) -> None:
        check_network_kind(self.network)
        for name, minimum in (
            ("world_size", 3),
            ("nbytes", 64),
            ("steps_per_octave", 1),
            ("iters", 1),
            ("warmup", 0),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                hint = " (LP pipelines only with p >= 3)" if name == "world_size" else ""
                raise ValueError(f"parameter {name} must be an int >= {minimum}{hint}, got {v!r}")
        ops = self.ops
        if not isinstance(ops, (list, tuple)) or not ops or any(o not in cost.OPS for o in ops):
            raise ValueError(f"parameter ops must list entries of {cost.OPS}, got {ops!r}")
        br = self.block_range
        if isinstance(br, bool) or not isinstance(br, (int, float)) or not br >= 1:
            raise ValueError(f"parameter block_range must be a number >= 1, got {br!r}")
        check_link_params(self)


DEFAULTS = Params.defaults()
_POOL_START_S = 3.0
_OP_COLORS = {"broadcast": "C0", "reduce": "C5", "allreduce": "C3"}


def block_grid(
    optimum: int, nbytes: int, block_range: float, steps_per_octave: int
) -> list[tuple[float, int]]:
    """``(factor, block_bytes)`` pairs around ``optimum``: factors ``2**(j / steps_per_octave)``
    up to ``block_range`` either way, blocks rounded to multiples of 8 bytes (at least 8) and
    capped at ``nbytes``; a block that equals the previous one is dropped.

    Example::

        >>> block_grid(1024, 1 << 20, 2.0, 1)
        [(0.5, 512), (1.0, 1024), (2.0, 2048)]
    """
    jmax = int(math.floor(math.log2(block_range) * steps_per_octave + 1e-9))
    out: list[tuple[float, int]] = []
    for j in range(-jmax, jmax + 1):
        f = 2.0 ** (j / steps_per_octave)
        b = min(nbytes, max(8, int(round(optimum * f / 8)) * 8))
        if out and out[-1][1] == b:
            continue
        out.append((f, b))
    return out


def optimum(op: str, nbytes: int, p: int, link: cost.LinkModel, host_block_s: float) -> int:
    """The modelled optimal LP block (bytes), a multiple of 8: the overlapped model's
    (:func:`pipecomm.lab.networks.cost.lp_overlapped_block_bytes`, ``host_block_s`` host seconds per block).

    Example::

        >>> optimum("broadcast", 4 << 20, 8, cost.LinkModel.from_bandwidth(2e-3, 50e6), 124e-6)
        65536
    """
    return int(cost.lp_overlapped_block_bytes(op, nbytes, p, link, host_block_s))


def host_block_s() -> float:
    """The host's cost of one LP block on the critical path: E0's per-message latency of the
    real backend (``cost.calibrated_link().alpha``; its fallback without E0).

    Example::

        >>> 0 < host_block_s() < 1e-3   # 0.00016 with the reference E0
        True
    """
    return float(cost.calibrated_link().alpha)


def plan(**params: Any) -> pd.DataFrame:
    """The points ``run`` measures: op, block factor, block bytes, modelled time.

    Example::

        >>> df = plan(world_size=8, nbytes=4 << 20)
        >>> len(df), list(df.op.unique())                # model_s.sum(): the model's seconds
        (13, ['broadcast'])
    """
    params = Params.make(**params)
    return _plan(params, cost.link_from_network(network(params)), host_block_s())


def _plan(params: Params, link: cost.LinkModel, h: float) -> pd.DataFrame:
    rows = []
    n, p = params.nbytes, params.world_size
    for op in params.ops:
        b_opt = optimum(op, n, p, link, h)
        b_lock = int(cost.lp_optimal_block_bytes(op, n, p, link))
        for f, b in block_grid(b_opt, n, params.block_range, params.steps_per_octave):
            rows.append(
                {
                    "op": op,
                    "block_factor": f,
                    "block_bytes": b,
                    "optimal_block_bytes": b_opt,
                    "lockstep_block_bytes": b_lock,
                    "model_s": cost.lp_overlapped_time(op, n, p, link, b, h),
                    "model_lockstep_s": cost.collective_time(op, "lp", n, p, link, b),
                }
            )
    return pd.DataFrame(rows)


def expected_runtime_s(**params: Any) -> dict[str, float]:
    """Model estimate of ``run``'s wall time: emulated transfers and the pool start (seconds).

    Example::

        >>> expected_runtime_s(world_size=8, nbytes=4 << 20)["total_s"] < 60
        True
    """
    params = Params.make(**params)
    emulated = float(plan(**params.asdict()).model_s.sum()) * (params.warmup + params.iters)
    starts = _POOL_START_S * max(1.0, params.world_size / 8)
    return {"emulated_s": emulated, "starts_s": starts, "total_s": emulated + starts}


def measure_blocks(
    points: list[dict[str, Any]], nbytes: int, warmup: int, iters: int
) -> list[dict]:
    """On every rank: time LP ``op`` of ``nbytes`` with each point's ``block_bytes``.

    Rank 0 returns one row per point (median, min, max of the max over ranks); others ``[]``.

    Example::

        pts = [{"op": "broadcast", "block_bytes": b} for b in (65536, 262144)]
        rows = ranks.run(measure_blocks, pts, 4 << 20, 1, 3)[0]
    """
    import torch
    import torch.distributed as dist

    from pipecomm import collectives
    from pipecomm.lab.measure import bench

    t = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    rows = []
    for pt in points:
        op, b = pt["op"], int(pt["block_bytes"])
        if op == "broadcast":

            def fn(b=b):
                collectives.broadcast(t, 0, algorithm="lp", block_bytes=b)
        elif op == "reduce":

            def fn(b=b):
                collectives.reduce(t, 0, algorithm="lp", block_bytes=b)
        else:

            def fn(b=b):
                collectives.allreduce(t, algorithm="lp", block_bytes=b)

        stats = bench.time_fn(fn, warmup=warmup, repeats=iters)
        if dist.get_rank() == 0:
            rows.append(
                {
                    **pt,
                    **bench.columns(stats),
                }
            )
    return rows


def run(**params: Any) -> pd.DataFrame:
    """Measure LP time for every op and block size; one row per (op, block size).

    Columns: ``op``, ``algorithm`` ("lp"), ``nbytes``, ``world_size``, ``ports``,
    ``block_factor`` (block / modelled optimum, before rounding), ``block_bytes``,
    ``optimal_block_bytes``, ``time_s``, ``min_s``, ``max_s``, ``model_s``, ``warmup``, ``iters``,
    ``emu_alpha_s``, ``emu_bandwidth_Bps``, ``model_gamma_s_per_byte``, ``backend``, ``network``.

    Example::

        df = run(world_size=4, nbytes=1 << 20, block_range=4.0)
    """
    params = Params.make(**params)
    net = network(params)
    smallest = int(plan(**params.asdict()).block_bytes.min())
    with ranks_on(params.network, params.world_size, net, smallest,
                  timeout_s=params.timeout_s) as ranks:
        link = cost.link_from_network(ranks.net)  # a shaped network's calibrated link
        h = host_block_s()
        pl = _plan(params, link, h)  # the block grid around the optimum on that link
        points = pl.drop(columns=["model_s", "model_lockstep_s"]).to_dict("records")
        out = ranks.run(
            measure_blocks, points, params.nbytes, params.warmup, params.iters,
            timeout_s=params.timeout_s,
        )
    df = pd.DataFrame(out[0])
    df["model_s"] = pl.model_s.to_numpy()
    df["model_lockstep_s"] = pl.model_lockstep_s.to_numpy()
    return df.assign(
        model_host_block_s=h,
        algorithm="lp",
        nbytes=params.nbytes,
        world_size=params.world_size,
        ports=params.ports,
        warmup=params.warmup,
        iters=params.iters,
        backend="gloo",
        network=ranks.text,
        network_kind=ranks.kind,
        emu_alpha_s=link.alpha,
        emu_bandwidth_Bps=link.bandwidth_Bps,
        model_gamma_s_per_byte=link.gamma,
    )


def best_blocks(df: pd.DataFrame) -> pd.DataFrame:
    """Per op: modelled optimum, measured best block, their ratio, and the measured cost of
    blocks 8x smaller and 8x larger than the optimum (relative to the time at the optimum).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, nbytes=4 << 20)     # the model's points, measured = model here
        >>> df = df.assign(time_s=df.model_s, nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3,
        ...                emu_bandwidth_Bps=100e6, model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> b = best_blocks(df).loc["broadcast"]
        >>> bool(b["measured_best_bytes"] == b["optimal_block_bytes"])
        True
    """
    rows = []
    for op, g in df.groupby("op"):
        g = g.sort_values("block_bytes")
        best = g.loc[g.time_s.idxmin()]
        at = {}
        for f in (0.125, 1.0, 8.0):
            m = g[np.isclose(g.block_factor, f, rtol=1e-6)]
            at[f] = float(m.time_s.iloc[0]) if len(m) else math.nan
        b_opt = int(g.optimal_block_bytes.iloc[0])
        rows.append(
            {
                "op": op,
                "optimal_block_bytes": b_opt,
                "measured_best_bytes": int(best["block_bytes"]),
                "best_over_optimum": best["block_bytes"] / b_opt,
                "time_at_optimum_s": at[1.0],
                "best_time_s": float(best["time_s"]),
                "cost_8x_smaller": at[0.125] / at[1.0] - 1,
                "cost_8x_larger": at[8.0] / at[1.0] - 1,
            }
        )
    return pd.DataFrame(rows).set_index("op")


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per op and block size: measured and modelled time (ms), relative to the optimum's.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, nbytes=4 << 20)     # the model's points, measured = model here
        >>> df = df.assign(time_s=df.model_s, nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3,
        ...                emu_bandwidth_Bps=100e6, model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> summary(df).columns.tolist()       # per op and block size; summary(run())
        ['op', 'block KiB', 'x optimum', 'measured ms', 'model ms', 'measured / at optimum', 'model / model optimum']
    """
    rows = []
    for op, g in df.groupby("op"):
        g = g.sort_values("block_bytes")
        t_opt = g[np.isclose(g.block_factor, 1.0)].time_s
        t0 = float(t_opt.iloc[0]) if len(t_opt) else float(g.time_s.min())
        m0 = float(g.model_s.min())
        for r in g.itertuples():
            rows.append(
                {
                    "op": op,
                    "block KiB": r.block_bytes / 1024,
                    "x optimum": r.block_factor,
                    "measured ms": r.time_s * 1e3,
                    "model ms": r.model_s * 1e3,
                    "measured / at optimum": r.time_s / t0,
                    "model / model optimum": r.model_s / m0,
                }
            )
    return pd.DataFrame(rows).round(3)


def plot(df: pd.DataFrame, **params: Any):
    """Time vs block size per op: measured dots, model line, modelled optimum, measured best.

    Example::

        fig = plot(run()); fig.savefig("e4.png")
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    ops = [o for o in cost.OPS if o in set(df.op)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5.2 * len(ops), 4.2), squeeze=False)
    n, p, ports = int(df.nbytes.iloc[0]), int(df.world_size.iloc[0]), df.ports.iloc[0]
    link = cost.LinkModel.from_bandwidth(
        float(df.emu_alpha_s.iloc[0]),
        float(df.emu_bandwidth_Bps.iloc[0]),
        gamma=float(df.model_gamma_s_per_byte.iloc[0]),
        ports=ports,
    )
    best = best_blocks(df)
    for ax, op in zip(axes[0], ops):
        g = df[df.op == op].sort_values("block_bytes")
        c = _OP_COLORS.get(op, ALG_COLORS["lp"])
        xs = np.unique(
            (np.geomspace(g.block_bytes.min(), g.block_bytes.max(), 80) // 8 * 8).astype(np.int64)
        )
        h = float(g.model_host_block_s.iloc[0]) if "model_host_block_s" in g else 0.0
        ax.loglog(xs, [cost.lp_overlapped_time(op, n, p, link, int(b), h) for b in xs], "-",
                  color=c, lw=1, alpha=0.7, label="overlapped model")
        ax.loglog(xs, [cost.collective_time(op, "lp", n, p, link, int(b)) for b in xs], "--",
                  color="grey", lw=0.8, alpha=0.7, label="lock-step model (paper)")
        ax.loglog(g.block_bytes, g.time_s, "o", color=c, label="measured")
        b_opt, b_best = best.loc[op, "optimal_block_bytes"], best.loc[op, "measured_best_bytes"]
        ax.axvline(b_opt, color="k", ls="--", lw=0.8, label=f"model optimum {b_opt / 1024:.0f} KiB")
        ax.axvline(b_best, color=c, ls=":", lw=1.2, label=f"measured best {b_best / 1024:.0f} KiB")
        ax.set(
            xlabel="LP block size (bytes)",
            ylabel="time (s)",
            title=f"LP {op} of {n / 2**20:g} MiB, p={p}",
        )
        ax.legend(fontsize=7)
    fig.suptitle(f"E4 — gloo, p={p}, {df.network.iloc[0]}", fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def _block_samples(df: pd.DataFrame, op: str) -> pd.DataFrame:
    claims.require_columns(df, "op", "block_factor", "block_bytes", "optimal_block_bytes",
                           "times_s", "model_s")
    g = df[df.op == op].sort_values("block_bytes")
    if g.empty:
        raise claims.NotDecidable(f"no LP {op} measurements over block sizes")
    return g


def _run_model(df: pd.DataFrame, op: str) -> tuple[int, int, int, cost.LinkModel, float]:
    """The run's ``(b*, nbytes, p, link, host_block_s)`` for ``op``, from its own columns."""
    claims.require_columns(df, "op", "optimal_block_bytes", "nbytes", "world_size",
                           "emu_alpha_s", "emu_bandwidth_Bps")
    g = df[df.op == op]
    if g.empty:
        raise claims.NotDecidable(f"no LP {op} measurements over block sizes")
    r = g.iloc[0]
    gamma = float(r["model_gamma_s_per_byte"]) if "model_gamma_s_per_byte" in g else 0.0
    ports = str(r["ports"]) if "ports" in g else "single"
    link = cost.LinkModel.from_bandwidth(float(r["emu_alpha_s"]), float(r["emu_bandwidth_Bps"]),
                                         0.0 if math.isnan(gamma) else gamma, ports)
    h = float(r["model_host_block_s"]) if "model_host_block_s" in g else 0.0
    return (int(r["optimal_block_bytes"]), int(r["nbytes"]), int(r["world_size"]), link,
            0.0 if math.isnan(h) else h)


def _model_ratio(op: str, n: int, p: int, link: cost.LinkModel, h: float, b_opt: int,
                 f: float) -> float:
    """The overlapped model's time of blocks ``f`` times the optimum against the optimum's."""
    b = min(n, max(8, int(round(b_opt * f / 8)) * 8))
    return (cost.lp_overlapped_time(op, n, p, link, b, h)
            / cost.lp_overlapped_time(op, n, p, link, b_opt, h))


@claims.prediction("e4_best_block_near_model")
def predict_best_block(df: pd.DataFrame, op: str) -> str:
    """C4.1's prediction for the run's parameters: the modelled optimum, its block count and
    what blocks 2x off cost in the model.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, nbytes=4 << 20)     # the model's points, measured = model here
        >>> df = df.assign(time_s=df.model_s, nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3,
        ...                emu_bandwidth_Bps=100e6, model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> predict_best_block(df, "broadcast")
        'overlapped model optimum ... KiB (k = ...) for broadcast of 4 MiB at p = 8, 2 ms, 100 MB/s, ...'
    """
    b_opt, n, p, link, h = _run_model(df, op)
    worse = max(_model_ratio(op, n, p, link, h, b_opt, f) for f in (0.5, 2.0)) - 1
    return (f"overlapped model optimum {b_opt / 1024:.0f} KiB (k = {math.ceil(n / b_opt)}) for "
            f"{op} of {n / 2**20:g} MiB at p = {p}, {link.alpha * 1e3:g} ms, "
            f"{link.bandwidth_Bps / 1e6:.3g} MB/s, host {h * 1e6:.0f} us per block; blocks 2x "
            f"off cost {worse:.1%} more in the model")


@claims.prediction("e4_off_optimum_penalty")
def predict_penalty(df: pd.DataFrame, op: str) -> str:
    """C4.2's prediction for the run's parameters: the model's time of blocks 8x smaller and
    8x larger than the optimum, relative to the optimum's.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, nbytes=4 << 20)     # the model's points, measured = model here
        >>> df = df.assign(time_s=df.model_s, nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3,
        ...                emu_bandwidth_Bps=100e6, model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> predict_penalty(df, "broadcast")
        "model: 8x smaller ...x, 8x larger ...x the optimum's time (broadcast of 4 MiB at p = 8, ...)"
    """
    b_opt, n, p, link, h = _run_model(df, op)
    small, large = (_model_ratio(op, n, p, link, h, b_opt, f) for f in (0.125, 8.0))
    return (f"model: 8x smaller {small:.2f}x, 8x larger {large:.2f}x the optimum's time "
            f"({op} of {n / 2**20:g} MiB at p = {p}, optimum {b_opt / 1024:.0f} KiB)")


@claims.check("e4_best_block_near_model")
def check_best_block(df: pd.DataFrame, op: str, factor: float) -> claims.Verdict:
    """The measured best block size is within ``factor`` of the modelled optimum. Every block
    whose time interval overlaps the fastest block's interval could be the best: PASS when all
    of them are within ``factor``, FAIL when none is, INCONCLUSIVE otherwise.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, nbytes=4 << 20)     # the model's points, measured = model here
        >>> df = df.assign(time_s=df.model_s, nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3,
        ...                emu_bandwidth_Bps=100e6, model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_best_block(df, "broadcast", 2.0).verdict
        'PASS'
    """
    g = _block_samples(df, op)
    ci = [claims.interval(stats.repeats(c)) for c in g.times_s]
    best = int(np.argmin([c[0] for c in ci]))
    plausible = [i for i, c in enumerate(ci) if c[1] <= ci[best][2]]
    b_opt = float(g.optimal_block_bytes.iloc[0])
    off = [max(b / b_opt, b_opt / b) for b in g.block_bytes.iloc[plausible]]
    inside = [o <= factor for o in off]
    verdict = claims.PASS if all(inside) else claims.FAIL if not any(inside) else \
        claims.INCONCLUSIVE
    kib = ", ".join(f"{int(b) >> 10}" for b in g.block_bytes.iloc[plausible])
    return claims.Verdict(
        f"{op}: best {int(g.block_bytes.iloc[best]) >> 10} KiB (x{off[plausible.index(best)]:.2f} "
        f"the model's {int(b_opt) >> 10} KiB); blocks as fast within the interval: {kib} KiB",
        f"within x{factor:g}",
        verdict,
    )


@claims.check("e4_off_optimum_penalty")
def check_penalty(df: pd.DataFrame, op: str, tolerance: float) -> claims.Verdict:
    """Blocks 8x smaller and 8x larger than the modelled optimum cost at least what the model
    predicts for them, discounted by the model's stated accuracy ``tolerance`` (C2.4): the time
    ratio to the optimum must be >= ``model_ratio * (1 - tolerance) / (1 + tolerance)``
    (decided on the ratio's interval).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, nbytes=4 << 20)     # the model's points, measured = model here
        >>> df = df.assign(time_s=df.model_s, nbytes=4 << 20, world_size=8, emu_alpha_s=2e-3,
        ...                emu_bandwidth_Bps=100e6, model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_penalty(df, "broadcast", 0.25).verdict
        'PASS'
    """
    g = _block_samples(df, op)
    at = {}
    for f in (0.125, 1.0, 8.0):
        m = g[np.isclose(g.block_factor, f, rtol=1e-6)]
        if m.empty:
            raise claims.NotDecidable("the block grid lacks b*/8, b* or 8 b*: use block_range >= 8 and "
                             "an integer steps_per_octave")
        at[f] = m.iloc[0]
    parts, verdicts = [], []
    for f, name in ((0.125, "8x smaller"), (8.0, "8x larger")):
        r, lo, hi = claims.ratio(stats.repeats(at[f].times_s), stats.repeats(at[1.0].times_s))
        model = float(at[f].model_s / at[1.0].model_s)
        bound = model * (1 - tolerance) / (1 + tolerance)
        verdicts.append(claims.at_least(lo, hi, bound))
        parts.append(f"{name} x{claims.fmt_ci(r, lo, hi)} (model x{model:.2f}, bound "
                     f"x{bound:.2f})")
    return claims.Verdict(f"{op}: " + "; ".join(parts),
                          f"time / optimum >= model ratio x (1 - {tolerance:g}) / "
                          f"(1 + {tolerance:g}) each", claims.combine(verdicts))

if __name__ == "__main__":
    main(sys.modules[__name__])
