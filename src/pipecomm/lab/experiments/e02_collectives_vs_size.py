"""E2 — measured collective time vs message size: emulated network (model overlaid) and real backend.

Paper: Wang, Wu, Bosilca, Vuduc, Xu, "Efficient Communications in Training Large Scale Neural
Networks" (arXiv 1611.04255): linear pipelining (LP) is faster than minimum-spanning-tree (MST)
and bidirectional-exchange (BE) collectives for the large messages of data-parallel training, "up
to 2x" the bandwidth of BE; its allreduce uses both directions of every link of the chain.

Two sections, one tidy table (column ``section``): ``emulated`` -- lp, mst, be and ring on
``world_size`` ranks over the emulated network (:mod:`pipecomm.lab.networks.netem`; ``emu_cases`` maps
``"ports/op"`` to the algorithms), every point with the alpha-beta-gamma model beside it
(``model_s``, ``model_lockstep_s``), or with ``network="shaped"`` on a virtual cluster of
tc-shaped links (section ``shaped``); ``real`` -- no emulation (loopback gloo, or NCCL on the
gpu profile), lp, mst, be, ring and the built-in ``torch``, time, busbw and the ratio to the
built-in. Claims C2.* in artifact/claims.yaml.

Sections, timing protocol and claims in detail: docs/experiments.md, "E2 -- collectives vs
message size". Expected running time: :func:`expected_runtime_s`.

Run::

    python -m pipecomm.lab.experiments.e02_collectives_vs_size --out results/manual/E2
    torchrun --nproc-per-node 8 -m pipecomm.lab.experiments.e02_collectives_vs_size --out DIR \\
        -p backend=nccl -p 'emu_cases={}'        # real section only, on the job's ranks
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm import collectives
from pipecomm.lab import checks, claims, experiment
from pipecomm.lab.cli import main
from pipecomm.lab.measure import bench, stats
from pipecomm.lab.measure.sweep import (
    ALG_COLORS,
    measure_points,
    measured_crossover_bytes,
    message_sizes,
    model_crossover_bytes,
    network,
)
from pipecomm.lab.networks import cost, launch
from pipecomm.lab.networks.kinds import NETWORK_KINDS, check_network_kind, ranks_on

ID = "E2"
NOTEBOOK = "02_collectives_vs_size"


@dataclass(frozen=True)
class Params(experiment.Params):
    """E2's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    world_size: int = 4
    # netem.check_host's margin at p = 4 on 2 cores (docs/network_model.md, "Quick defaults"):
    emu_alpha_s: float = 3e-3
    emu_bandwidth_Bps: float = 100e6
    emu_cases: dict[str, Any] = field(default_factory=lambda: {
        "single/broadcast": ["lp", "mst", "be", "ring"],
        "single/allreduce": ["lp", "mst", "be", "ring"],
        "per-neighbor/allreduce": ["lp", "be"],
    })
    sizes_min: int = 16384
    sizes_max: int = 1 << 20
    size_factor: int = 4
    iters: int = 3
    warmup: int = 1
    large_bytes: int = 16 << 20
    iters_large: int = 2
    max_point_s: float = 5.0
    real_world_sizes: list[int] = field(default_factory=lambda: [2])
    real_algorithms: list[str] = field(default_factory=lambda: ["lp", "mst", "be", "ring", "torch"])
    real_ops: list[str] = field(default_factory=lambda: ["broadcast", "allreduce"])
    real_sizes_min: int = 1 << 20
    real_sizes_max: int = 4 << 20
    real_iters: int = 3
    real_warmup: int = 1
    backend: str = "gloo"
    timeout_s: float = 900.0
    network: str = "emulated"  # where emu_cases run: "emulated" or "shaped" (_network.ranks_on)

    def validate(self) -> None:
        check_network_kind(self.network)
        _check_int("world_size", self.world_size, 2)
        for name in ("iters", "iters_large", "real_iters"):
            _check_int(name, getattr(self, name), 1)
        for name in ("warmup", "real_warmup"):
            _check_int(name, getattr(self, name), 0)
        for name in ("sizes_min", "sizes_max", "real_sizes_min", "real_sizes_max", "large_bytes"):
            _check_int(name, getattr(self, name), 4)
        for name in ("emu_alpha_s", "max_point_s", "timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"parameter {name} must be a number >= 0, got {v!r}")
        checks.positive_float(self, "timeout_s")
        bw = self.emu_bandwidth_Bps
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not bw > 0:
            raise ValueError(f"parameter emu_bandwidth_Bps must be > 0, got {bw!r}")
        parse_cases(self.emu_cases)
        ws = self.real_world_sizes
        if not isinstance(ws, (list, tuple)) or any(
            isinstance(p, bool) or not isinstance(p, int) or p < 2 for p in ws
        ):
            raise ValueError(
                f"parameter real_world_sizes must list ints >= 2 (may be empty), got {ws!r}"
            )
        for name, allowed in (("real_algorithms", collectives.ALGORITHMS), ("real_ops", OPS)):
            v = getattr(self, name)
            if not isinstance(v, (list, tuple)) or any(a not in allowed for a in v):
                raise ValueError(f"parameter {name} must list entries of {allowed}, got {v!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"parameter backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and self.emu_cases:
            raise ValueError(
                "the emulated network is a gloo (cpu profile) tool: with backend='nccl' "
                "pass emu_cases={} (real section only)"
            )


DEFAULTS = Params.defaults()

OPS = ("broadcast", "reduce", "allreduce")
PORTS = ("single", "per-neighbor")
_POOL_START_S = 3.0  # rough start-up cost of one pool on a quiet 2-core machine


# --------------------------------------------------------------------------- parameters


def parse_cases(cases: Any) -> list[tuple[str, str, list[str]]]:
    """``{"ports/op": [algorithms]}`` -> ``[(ports, op, algorithms)]``, checked.

    Example::

        >>> parse_cases({"single/broadcast": ["lp", "be"]})
        [('single', 'broadcast', ['lp', 'be'])]
    """
    if not isinstance(cases, dict):
        raise ValueError(
            f"parameter emu_cases must be a dict {{'ports/op': [algorithms]}}, got {cases!r}"
        )
    out = []
    for key, algs in cases.items():
        parts = str(key).split("/")
        if len(parts) != 2 or parts[0] not in PORTS or parts[1] not in OPS:
            raise ValueError(
                f"emu_cases key {key!r} must be 'ports/op' with ports in {PORTS} and op in {OPS}"
            )
        if (
            not isinstance(algs, (list, tuple))
            or not algs
            or any(a not in cost.ALGORITHMS for a in algs)
        ):
            raise ValueError(
                f"emu_cases[{key!r}] must be a non-empty list of {cost.ALGORITHMS} "
                f"(the built-in cannot be emulated), got {algs!r}"
            )
        out.append((parts[0], parts[1], list(algs)))
    return out


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"parameter {name} must be an int >= {minimum}, got {value!r}")
    return value


def plan(**params: Any) -> pd.DataFrame:
    """The emulated points ``run`` measures, in order, with modelled time and repetitions.

    Columns ``ports, op, algorithm, nbytes, model_s, warmup, iters, measure`` (``measure`` is
    False where ``model_s > max_point_s``).

    Example::

        >>> df = plan(world_size=8, sizes_max=64 << 20)
        >>> len(df), bool(df.query("measure").model_s.sum() > 0)   # the model's seconds to measure
        (70, True)
    """
    params = Params.make(**params)
    sizes = message_sizes(params.sizes_min, params.sizes_max, params.size_factor)
    rows = []
    for ports, op, algs in parse_cases(params.emu_cases):
        link = cost.link_from_network(network(params, ports))
        for alg in algs:
            for n in sizes:
                t = cost.collective_time(op, alg, n, params.world_size, link)
                large = n >= params.large_bytes
                rows.append(
                    {
                        "ports": ports,
                        "op": op,
                        "algorithm": alg,
                        "nbytes": n,
                        "model_s": t,
                        "warmup": 0 if large else params.warmup,
                        "iters": params.iters_large if large else params.iters,
                        "measure": t <= params.max_point_s,
                    }
                )
    return pd.DataFrame(
        rows,
        columns=["ports", "op", "algorithm", "nbytes", "model_s", "warmup", "iters", "measure"],
    )


def expected_runtime_s(**params: Any) -> dict[str, float]:
    """Model estimate of ``run``'s wall time (seconds): emulated sweep, real sweep, pool starts.

    The emulated part is exact up to the emulator's overheads (a few percent); the real part
    uses the calibrated link (``cost.calibrated_link``), scaled by ranks per core -- rough.

    Example::

        >>> sorted(expected_runtime_s(world_size=8, sizes_max=64 << 20))    # ["total_s"]: seconds
        ['emulated_s', 'real_s', 'starts_s', 'total_s']
    """
    params = Params.make(**params)
    pl = plan(**params.asdict())
    m = pl[pl.measure]
    emulated = float((m.model_s * (m.warmup + m.iters)).sum())
    emulated += float(pl.groupby(["ports", "op", "algorithm"]).model_s.min().sum())  # warm-up
    real = 0.0
    link = cost.calibrated_link()
    cores = os.cpu_count() or 1
    for pt in _real_points(params, list(params.real_world_sizes)):
        a = "ring" if pt["algorithm"] == "torch" else pt["algorithm"]
        t = cost.collective_time(pt["op"], a, pt["nbytes"], pt["p"], link)
        real += t * max(1.0, pt["p"] / cores) * (pt["warmup"] + pt["iters"])
    pools = len({ports for ports, _, _ in parse_cases(params.emu_cases)})
    pools += 1 if params.real_world_sizes else 0
    starts = pools * _POOL_START_S * max(1.0, params.world_size / 8)
    return {
        "emulated_s": emulated,
        "real_s": real,
        "starts_s": starts,
        "total_s": emulated + real + starts,
    }


# --------------------------------------------------------------------------- on the ranks


def _real_points(params: Params, world_sizes: list[int]) -> list[dict[str, Any]]:
    sizes = message_sizes(params.real_sizes_min, params.real_sizes_max, params.size_factor)
    return [
        {
            "op": op,
            "algorithm": alg,
            "nbytes": n,
            "p": p,
            "warmup": params.real_warmup,
            "iters": params.real_iters,  # real calls cost milliseconds: no iters_large here
        }
        for p in sorted(world_sizes)
        for op in params.real_ops
        for n in sizes
        for alg in params.real_algorithms  # one comparison, timed round-robin (interleave=True)
    ]


_EMULATED_COLUMNS = (
    "ports",
    "model_s",
    "model_lockstep_s",
    "model_host_block_s",
    "emu_alpha_s",
    "emu_bandwidth_Bps",
    "model_gamma_s_per_byte",
)


def _add_bandwidths(df: pd.DataFrame) -> pd.DataFrame:
    """algbw and busbw columns; the emulated section's columns (empty) when it did not run."""
    df["algbw_Bps"] = [bench.algbw(n, t) for n, t in zip(df.nbytes, df.time_s)]
    df["busbw_Bps"] = [
        bench.busbw(o, n, t, p) for o, n, t, p in zip(df.op, df.nbytes, df.time_s, df.world_size)
    ]
    for col in _EMULATED_COLUMNS:
        if col not in df:
            df[col] = np.nan
    return df


# --------------------------------------------------------------------------- run


def run(**params: Any) -> pd.DataFrame:
    """Measure the emulated and the real sections; one row per (section, case, algorithm, size).

    Columns: ``section`` ("emulated" or "real"), ``ports`` (emulated), ``op``, ``algorithm``,
    ``nbytes``, ``world_size``, ``time_s`` (median over iterations of the max over ranks),
    ``min_s``, ``max_s``, ``warmup``, ``iters``, ``block_bytes`` (LP), ``algbw_Bps``,
    ``busbw_Bps``, ``model_s`` (emulated; the host model for real gloo LP rows), the emulated
    link (``emu_alpha_s``, ``emu_bandwidth_Bps``, ``model_gamma_s_per_byte``), the real gloo
    section's ``host_links`` and ``host_links_measured`` (from E0, else the default),
    ``backend`` and ``network``.

    Example::

        df = run(world_size=4, sizes_max=1 << 20, real_world_sizes=[2])
    """
    params = Params.make(**params)
    frames = []
    if launch.under_torchrun():  # a torchrun job: the real section on the job's own ranks
        if params.emu_cases:
            raise ValueError("under torchrun only the real section runs: pass emu_cases={}")
        info = launch.init_from_env(params.backend)
        ws = [p for p in params.real_world_sizes if p <= info.world_size] or [info.world_size]
        rows = measure_points(_real_points(params, ws),
                              info.device if info.backend == "nccl" else None, interleave=True)
        if not rows:  # ranks other than 0
            return pd.DataFrame()
        return _add_bandwidths(
            pd.DataFrame(rows).assign(section="real", backend=info.backend, network="real")
        )

    pl = plan(**params.asdict())
    for ports in [q for q in PORTS if q in set(pl.ports)]:
        net = network(params, ports)
        todo = pl[(pl.ports == ports) & pl.measure]
        points = [
            {
                "op": r.op,
                "algorithm": r.algorithm,
                "nbytes": int(r.nbytes),
                "p": params.world_size,
                "warmup": int(r.warmup),
                "iters": int(r.iters),
                "first_warmup": True,
            }
            for r in todo.itertuples()
        ]
        if not points:
            continue
        smallest = min(pt["nbytes"] for pt in points) // params.world_size  # a BE / ring chunk
        with ranks_on(params.network, params.world_size, net, smallest,
                      timeout_s=params.timeout_s) as ranks:
            out = ranks.run(measure_points, points, timeout_s=params.timeout_s)
        link = cost.link_from_network(ranks.net)  # a shaped network's calibrated link
        h = host_block_s()
        d = pd.DataFrame(out[0])
        blocks = [None if pd.isna(b) else int(b) for b in d.block_bytes]
        d["model_s"] = [
            cost.overlapped_time(o, a, int(n), int(p), link, b, host_block_s=h)
            for o, a, n, p, b in zip(d.op, d.algorithm, d.nbytes, d.world_size, blocks)
        ]
        d["model_lockstep_s"] = [
            cost.collective_time(o, a, int(n), int(p), link, b)
            for o, a, n, p, b in zip(d.op, d.algorithm, d.nbytes, d.world_size, blocks)
        ]
        frames.append(
            d.assign(
                model_host_block_s=h,
                section=ranks.kind,
                ports=ports,
                backend="gloo",
                network=ranks.text,
                emu_alpha_s=link.alpha,
                emu_bandwidth_Bps=link.bandwidth_Bps,
                model_gamma_s_per_byte=link.gamma,
            )
        )

    ws = list(params.real_world_sizes)
    if ws and params.backend == "nccl":
        have = launch.gpu_count()
        ws = [p for p in ws if p <= have]
    if ws and params.real_algorithms and params.real_ops:
        device = "cuda" if params.backend == "nccl" else None
        with launch.Ranks(max(ws), backend=params.backend) as ranks:
            out = ranks.run(_measure_real, _real_points(params, ws), device,
                            timeout_s=params.timeout_s)
        real = pd.DataFrame(out[0])
        if params.backend == "gloo":
            link = cost.host_link()
            real["model_s"] = _host_model(real, link)
            real["host_links"] = link.host_links
            real["host_links_measured"] = link.host_links_measured
        frames.append(real.assign(section="real", backend=params.backend, network="real"))
    if not frames:
        raise ValueError(
            "nothing to measure: emu_cases and real_world_sizes are both empty "
            "(or no GPU for backend='nccl')"
        )
    return _add_bandwidths(pd.concat(frames, ignore_index=True))


def host_block_s() -> float:
    """The host's cost of one LP block on the critical path, for the overlapped model
    (:func:`pipecomm.lab.networks.cost.lp_overlapped_time`): E0's per-message latency of the real backend
    (``cost.calibrated_link().alpha``; its documented fallback without E0).

    Example::

        >>> 0 < host_block_s() < 1e-3   # 0.00016 with the reference E0
        True
    """
    return float(cost.calibrated_link().alpha)


def _host_model(real: pd.DataFrame, link: cost.HostLink) -> list[float]:
    """LP rows of the real gloo section: :func:`pipecomm.lab.networks.cost.lp_time_on_host` on this host's
    ``link`` (E0's per-size table and ``host_links`` when the artifact set
    ``PIPECOMM_CALIBRATION``) with the block the collective used; NaN for the other
    algorithms."""
    return [
        cost.lp_time_on_host(o, int(n), int(p), link, int(b)) if a == "lp" and pd.notna(b)
        else float("nan")
        for o, a, n, p, b in zip(real.op, real.algorithm, real.nbytes, real.world_size,
                                 real.block_bytes)
    ]


def _measure_real(points: list[dict[str, Any]], device: str | None) -> list[dict]:
    if device == "cuda":  # this rank's GPU (the CPU where a rehearsal runs gloo for NCCL)
        here = launch.device()
        device = str(here) if here.type == "cuda" else None
    return measure_points(points, device, interleave=True)


# --------------------------------------------------------------------------- analysis


def _emulated(df: pd.DataFrame, op: str, ports: str) -> pd.DataFrame:
    claims.require_columns(df, "section", "ports", "op", "algorithm", "nbytes", "time_s")
    d = df[df.section.isin(NETWORK_KINDS) & (df.ports == ports) & (df.op == op)]
    if d.empty:
        raise claims.NotDecidable(f"no emulated {op} measurements with {ports!r} ports")
    return d


def _times_at(d: pd.DataFrame, nbytes: int, algorithms: tuple[str, ...]) -> dict[str, float]:
    at = d[d.nbytes == nbytes].groupby("algorithm").time_s.median()
    missing = [a for a in algorithms if a not in at.index]
    if missing:
        raise claims.NotDecidable(f"no measurement of {missing} at {nbytes} B (the largest message)")
    return {a: float(at[a]) for a in at.index}


def _link_of(d: pd.DataFrame, ports: str) -> cost.LinkModel:
    claims.require_columns(d, "emu_alpha_s", "emu_bandwidth_Bps", "model_gamma_s_per_byte")
    return cost.LinkModel.from_bandwidth(
        float(d.emu_alpha_s.iloc[0]),
        float(d.emu_bandwidth_Bps.iloc[0]),
        gamma=float(d.model_gamma_s_per_byte.iloc[0]),
        ports=ports,
    )


def _host_block_of(d: pd.DataFrame) -> float:
    """The run's host cost per LP block (``model_host_block_s``; 0 in data from before it)."""
    if "model_host_block_s" not in d or d.model_host_block_s.isna().all():
        return 0.0
    return float(d.model_host_block_s.dropna().iloc[0])


def _mib(n: float) -> str:
    return f"{n / 2**20:.3g} MiB"


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per section, setting, op and size (>= 1 MiB): measured time (ms) per algorithm; for the
    emulated section also the model (ms), for the real section each algorithm's time over the
    built-in's.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> summary(df).columns.tolist()       # measured (and model) ms per algorithm; summary(run())
        ['section', 'setting', 'op', 'MiB', 'metric', 'lp', 'mst', 'be', 'ring']
    """
    df = df.assign(**{c: np.nan for c in _EMULATED_COLUMNS if c not in df})
    rows = []
    emu = (
        df[df.section.isin(NETWORK_KINDS) & (df.nbytes >= (1 << 20))]
        if "section" in df
        else df.iloc[:0]
    )
    for (kind, ports, op, n), g in emu.groupby(["section", "ports", "op", "nbytes"]):
        base = {
            "section": kind,
            "setting": f"{ports} ports, p={int(g.world_size.iloc[0])}",
            "op": op,
            "MiB": n / 2**20,
        }
        rows.append(
            base | {"metric": "measured ms"} | {a: t * 1e3 for a, t in zip(g.algorithm, g.time_s)}
        )
        rows.append(
            base | {"metric": "model ms"} | {a: t * 1e3 for a, t in zip(g.algorithm, g.model_s)}
        )
    real = df[df.section == "real"] if "section" in df else df.iloc[:0]
    for (p, op, n), g in real.groupby(["world_size", "op", "nbytes"]):
        base = {
            "section": "real",
            "setting": f"{g.backend.iloc[0]}, p={p}",
            "op": op,
            "MiB": n / 2**20,
        }
        times = dict(zip(g.algorithm, g.time_s))
        rows.append(base | {"metric": "measured ms"} | {a: t * 1e3 for a, t in times.items()})
        if "torch" in times:
            rows.append(
                base
                | {"metric": "time / built-in"}
                | {a: t / times["torch"] for a, t in times.items()}
            )
    out = pd.DataFrame(rows)
    cols = ["section", "setting", "op", "MiB", "metric"]
    algs = [a for a in collectives.ALGORITHMS if a in out.columns]
    return out[cols + algs].round(3) if len(out) else out


def plot(df: pd.DataFrame, **params: Any):
    """Row 1: emulated time vs size per case, model lines; row 2: real busbw and ratios.

    Example::

        fig = plot(run()); fig.savefig("e2.png")
    """
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    df = df.assign(**{c: np.nan for c in _EMULATED_COLUMNS if c not in df})
    emu = df[df.section.isin(NETWORK_KINDS)]
    real = df[df.section == "real"]
    if len(real) and "busbw_Bps" not in real:
        real = _add_bandwidths(real.copy())
    cases = [(pt, op) for pt in PORTS for op in OPS if len(emu[(emu.ports == pt) & (emu.op == op)])]
    real_ops = [op for op in OPS if op in set(real.op)]
    ncols = max(len(cases), len(real_ops) + (1 if len(real_ops) else 0), 1)
    nrows = int(bool(cases)) + int(bool(real_ops))
    fig, axes = plt.subplots(
        max(nrows, 1), ncols, figsize=(4.6 * ncols, 4.2 * max(nrows, 1)), squeeze=False
    )
    row = 0
    if cases:
        for j, (ports, op) in enumerate(cases):
            ax, g = axes[row, j], emu[(emu.ports == ports) & (emu.op == op)]
            link, p = _link_of(g, ports), int(g.world_size.iloc[0])
            xs = np.unique(np.geomspace(g.nbytes.min(), g.nbytes.max(), 60).astype(np.int64))
            for alg, ga in g.groupby("algorithm"):
                ax.loglog(ga.nbytes, ga.time_s, "o", color=ALG_COLORS[alg], label=f"{alg}")
                ax.loglog(
                    xs,
                    [cost.overlapped_time(op, alg, int(n), p, link,
                                          host_block_s=_host_block_of(g)) for n in xs],
                    "-",
                    color=ALG_COLORS[alg],
                    lw=1,
                    alpha=0.7,
                )
            ax.set(
                xlabel="message size (bytes)",
                ylabel="time (s)",
                title=f"{op}, {ports} ports, p={p}, {g.section.iloc[0]}",
            )
            ax.legend(fontsize=7, title="measured (dots), model (lines)", title_fontsize=7)
        for j in range(len(cases), ncols):
            axes[row, j].axis("off")
        row += 1
    if real_ops:
        qmax = int(real.world_size.max())
        for j, op in enumerate(real_ops):
            ax, g = axes[row, j], real[(real.op == op) & (real.world_size == qmax)]
            for alg, ga in g.groupby("algorithm"):
                ax.semilogx(
                    ga.nbytes,
                    ga.busbw_Bps / 1e9,
                    "o-",
                    color=ALG_COLORS.get(alg),
                    label="torch (built-in)" if alg == "torch" else alg,
                )
            ax.set(
                xlabel="message size (bytes)",
                ylabel="busbw (GB/s)",
                title=f"{op}, real {g.backend.iloc[0]} (no emulation), p={qmax}",
            )
            ax.legend(fontsize=7)
        ax = axes[row, len(real_ops)]
        nmax = real.nbytes.max()
        at = real[real.nbytes == nmax]
        markers = {"broadcast": "o", "reduce": "s", "allreduce": "^"}
        for (op, alg), g in at[at.algorithm != "torch"].groupby(["op", "algorithm"]):
            base = at[(at.op == op) & (at.algorithm == "torch")].set_index("world_size").time_s
            if base.empty:
                continue
            r = base / g.set_index("world_size").time_s
            ax.plot(
                r.index,
                r.values,
                marker=markers[op],
                color=ALG_COLORS.get(alg),
                ls="-" if op == "broadcast" else "--",
                label=f"{op} {alg}",
            )
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(sorted(set(at.world_size)))
        ax.set(
            xlabel="ranks p",
            ylabel="built-in time / algorithm time (>1: faster)",
            title=f"speed relative to the built-in, {_mib(nmax)}, real "
            f"{at.backend.iloc[0] if len(at) else ''}",
        )
        ax.legend(fontsize=6, ncol=2)
        for j in range(len(real_ops) + 1, ncols):
            axes[row, j].axis("off")
    backend = ", ".join(sorted(set(df.backend)))
    parts = ["measured, with the alpha-beta-gamma model of its link overlaid, on\n"
             + "\n".join(sorted(set(emu.network)))] if len(emu) else []
    parts += ["real backend"] if len(real) else []
    rows = ["top: ", "bottom: "] if len(parts) == 2 else [""]
    fig.suptitle(f"E2 — collectives vs message size ({backend})\n"
                 + "\n".join(r + t for r, t in zip(rows, parts)), fontsize=9)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


def _samples(d: pd.DataFrame, nbytes: int, alg: str) -> list[float]:
    """Every repeat of ``alg`` at ``nbytes`` (rows of the same point pooled)."""
    claims.require_columns(d, "times_s")
    rows = d[(d.nbytes == nbytes) & (d.algorithm == alg)]
    if rows.empty:
        raise claims.NotDecidable(f"no measurement of {alg!r} at {nbytes} B")
    return [t for cell in rows.times_s for t in stats.repeats(cell)]


def _model_at(d: pd.DataFrame, nbytes: int, alg: str) -> float:
    claims.require_columns(d, "model_s")
    return float(d[(d.nbytes == nbytes) & (d.algorithm == alg)].model_s.median())


def _where(d: pd.DataFrame, n: int) -> str:
    """``"at 64 MiB, p = 8"``: the point of a run a prediction is for."""
    return f"at {_mib(n)}, p = {int(d.world_size.iloc[0])}"


@claims.prediction("e2_lp_fastest_broadcast")
def predict_lp_fastest_broadcast(df: pd.DataFrame, ports: str, algorithms: list[str]) -> str:
    """C2.1's prediction for the run: the model's broadcast time of each algorithm over LP's at
    the run's largest emulated message.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> predict_lp_fastest_broadcast(df, "single", ["lp", "mst", "be", "ring"])
        'model at 64 MiB, p = 8: MST/LP ..., BE/LP ..., ring/LP ...'
    """
    d = _emulated(df, "broadcast", ports)
    n = int(d.nbytes.max())
    lp = _model_at(d, n, "lp")
    ratios = [f"{a if a == 'ring' else a.upper()}/LP {_model_at(d, n, a) / lp:.2f}"
              for a in algorithms if a != "lp"]
    return f"model {_where(d, n)}: " + ", ".join(ratios)


@claims.prediction("e2_crossover_vs_model")
def predict_crossover(df: pd.DataFrame, ports: str, other: str) -> str:
    """C2.2's prediction for the run: the model's LP / ``other`` broadcast crossover on the
    run's link, within its measured sizes (LP by the overlapped model).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> predict_crossover(df, "single", "be")
        'model crossover ... MiB (3 ms, 100 MB/s, p = 8)'
    """
    d = _emulated(df, "broadcast", ports)
    sizes = sorted(set(d.nbytes))
    link = _link_of(d, ports)
    p = int(d.world_size.iloc[0])
    x = model_crossover_bytes("broadcast", other, p, link, sizes[0], sizes[-1],
                              host_block_s=_host_block_of(d))
    where = f"({link.alpha * 1e3:g} ms, {link.bandwidth_Bps / 1e6:.3g} MB/s, p = {p})"
    if not math.isfinite(x):
        return f"model: no crossover between {_mib(sizes[0])} and {_mib(sizes[-1])} {where}"
    return f"model crossover {_mib(x)} {where}"


@claims.prediction("e2_allreduce_port_model")
def predict_allreduce_ports(df: pd.DataFrame) -> str:
    """C2.3's prediction for the run: the model's BE/LP allreduce time per port model at the
    largest per-neighbor message.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> predict_allreduce_ports(df)
        'model BE/LP: per-neighbor ..., single-port ... at 64 MiB, p = 8'
    """
    d = _emulated(df, "allreduce", "per-neighbor")
    n = int(d.nbytes.max())
    parts = [f"per-neighbor {_model_at(d, n, 'be') / _model_at(d, n, 'lp'):.2f}"]
    s = df[df.section.isin(NETWORK_KINDS) & (df.ports == "single") & (df.op == "allreduce")]
    if {"lp", "be"} <= set(s[s.nbytes == n].algorithm):
        parts.append(f"single-port {_model_at(s, n, 'be') / _model_at(s, n, 'lp'):.2f}")
    return f"model BE/LP: {', '.join(parts)} {_where(d, n)}"


@claims.check("e2_lp_fastest_broadcast")
def check_lp_fastest_broadcast(df: pd.DataFrame, ports: str,
                               algorithms: list[str]) -> claims.Verdict:
    """At the largest emulated message, LP is the fastest broadcast: every other/LP time
    ratio's interval lies above 1 (the paper's comparison; the ratios against the model are
    :func:`check_ratio_vs_model`'s).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_lp_fastest_broadcast(df, "single", ["lp", "mst", "be", "ring"]).verdict
        'PASS'
    """
    d = _emulated(df, "broadcast", ports)
    n = int(d.nbytes.max())
    _times_at(d, n, tuple(algorithms))
    lp = _samples(d, n, "lp")
    parts, verdicts = [], []
    for alg in algorithms:
        if alg == "lp":
            continue
        r, lo, hi = claims.ratio(_samples(d, n, alg), lp)
        verdicts.append(claims.at_least(lo, hi, 1.0))
        parts.append(f"{alg.upper()}/LP {claims.fmt_ci(r, lo, hi)}")
    return claims.Verdict(f"{'; '.join(parts)} at {_mib(n)}", "every other/LP > 1",
                          claims.combine(verdicts))


@claims.prediction("e2_ratio_vs_model")
def predict_ratio_vs_model(df: pd.DataFrame, op: str, ports: str, other: str) -> str:
    """C2.8's prediction for the run: the model's ``other``/LP time ratio at the largest
    emulated message (LP by the overlapped model).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> predict_ratio_vs_model(df, "broadcast", "single", "be")
        'model BE/LP ... at 64 MiB, p = 8'
    """
    d = _emulated(df, op, ports)
    n = int(d.nbytes.max())
    return (f"model {other.upper()}/LP {_model_at(d, n, other) / _model_at(d, n, 'lp'):.2f} "
            f"{_where(d, n)}")


@claims.check("e2_ratio_vs_model")
def check_ratio_vs_model(df: pd.DataFrame, op: str, ports: str, other: str,
                         tolerance: float) -> claims.Verdict:
    """At the largest emulated message, the measured ``other``/LP time ratio of ``op`` agrees
    with the model's ratio (``model_s``) within ``tolerance``: signed relative error, decided on
    the ratio's interval.

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_ratio_vs_model(df, "broadcast", "single", "be", 0.15).verdict
        'PASS'
    """
    d = _emulated(df, op, ports)
    n = int(d.nbytes.max())
    _times_at(d, n, ("lp", other))
    r, lo, hi = claims.ratio(_samples(d, n, other), _samples(d, n, "lp"))
    model = _model_at(d, n, other) / _model_at(d, n, "lp")
    e = [stats.model_error(v, model) for v in (r, lo, hi)]
    return claims.Verdict(
        f"{other.upper()}/LP {claims.fmt_ci(r, lo, hi)} at {_mib(n)} vs model {model:.2f}: "
        f"{e[0]:+.1%} [{e[1]:+.1%}, {e[2]:+.1%}]",
        f"within {tolerance:.0%} of the model's ratio", claims.within(e[1], e[2], tolerance))


@claims.check("e2_ratio_above")
def check_ratio_above(df: pd.DataFrame, op: str, ports: str, other: str,
                      min_ratio: float) -> claims.Verdict:
    """At the largest emulated message, the ``other``/LP time ratio of ``op`` lies above
    ``min_ratio`` (its interval; ``other``/LP > 1: LP faster).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_ratio_above(df, "broadcast", "single", "be", 1.0).threshold
        'BE/LP > 1'
    """
    measured, lo, hi = _ratio_at_largest(df, op, ports, other)
    return claims.Verdict(measured, f"{other.upper()}/LP > {min_ratio:g}",
                          claims.at_least(lo, hi, min_ratio))


@claims.check("e2_ratio_below")
def check_ratio_below(df: pd.DataFrame, op: str, ports: str, other: str,
                      max_ratio: float) -> claims.Verdict:
    """At the largest emulated message, the ``other``/LP time ratio of ``op`` lies below
    ``max_ratio`` (its interval; ``other``/LP < 1: LP slower).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_ratio_below(df, "allreduce", "single", "be", 1.0).verdict
        'PASS'
    """
    measured, lo, hi = _ratio_at_largest(df, op, ports, other)
    return claims.Verdict(measured, f"{other.upper()}/LP < {max_ratio:g}",
                          claims.at_most(lo, hi, max_ratio))


def _ratio_at_largest(df: pd.DataFrame, op: str, ports: str,
                      other: str) -> tuple[str, float, float]:
    """The ``other``/LP time ratio of ``op`` at the largest emulated message: its text and
    interval."""
    d = _emulated(df, op, ports)
    n = int(d.nbytes.max())
    _times_at(d, n, ("lp", other))
    r, lo, hi = claims.ratio(_samples(d, n, other), _samples(d, n, "lp"))
    return f"{other.upper()}/LP {claims.fmt_ci(r, lo, hi)} at {_mib(n)}", lo, hi


@claims.check("e2_crossover_vs_model")
def check_crossover(df: pd.DataFrame, ports: str, other: str, factor: float) -> claims.Verdict:
    """The measured size where LP broadcast overtakes ``other`` is within ``factor`` of the
    modelled one (LP by the overlapped model with the run's host cost per block). The crossover's interval comes from the timing intervals: the earliest
    crossing (LP at its interval's low end, ``other`` at its high end) and the latest.

    Example::

        check_crossover(df, "single", "be", 2.0)
    """
    d = _emulated(df, "broadcast", ports)
    sizes = sorted(set(d[d.algorithm == "lp"].nbytes) & set(d[d.algorithm == other].nbytes))
    if len(sizes) < 2:
        raise claims.NotDecidable(f"need emulated lp and {other} broadcasts at >= 2 sizes")
    ci = {a: [claims.interval(_samples(d, n, a)) for n in sizes] for a in ("lp", other)}
    med = measured_crossover_bytes(sizes, [c[0] for c in ci["lp"]], [c[0] for c in ci[other]])
    early = measured_crossover_bytes(sizes, [c[1] for c in ci["lp"]], [c[2] for c in ci[other]])
    late = measured_crossover_bytes(sizes, [c[2] for c in ci["lp"]], [c[1] for c in ci[other]])
    p = int(d.world_size.iloc[0])
    modelled = model_crossover_bytes("broadcast", other, p, _link_of(d, ports), sizes[0],
                                     sizes[-1], host_block_s=_host_block_of(d))

    def off(x: float) -> float:  # factor between a crossover and the model's (inf: none)
        if not (math.isfinite(x) and math.isfinite(modelled) and x > 0):
            return math.inf
        return max(x / modelled, modelled / x)

    offs = [off(x) for x in (med, early, late)]
    if max(offs) <= factor:
        verdict = claims.PASS
    elif (early > modelled * factor) or (math.isfinite(late) and late < modelled / factor) \
            or not math.isfinite(early):
        verdict = claims.FAIL
    else:
        verdict = claims.INCONCLUSIVE
    return claims.Verdict(
        f"measured {_mib(med)} [{_mib(early)}, {_mib(late)}], model {_mib(modelled)} "
        f"(x{offs[0]:.2f})",
        f"within x{factor:g}",
        verdict,
    )


@claims.check("e2_allreduce_port_model")
def check_allreduce_ports(df: pd.DataFrame, min_ratio: float) -> claims.Verdict:
    """Per-neighbor: the BE/LP allreduce time ratio's interval lies above ``min_ratio`` at the
    largest message (the single-port ratio is claim C2.9's, :func:`check_ratio_below`).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_allreduce_ports(df, 1.0).verdict
        'PASS'
    """
    d = _emulated(df, "allreduce", "per-neighbor")
    n = int(d.nbytes.max())
    _times_at(d, n, ("lp", "be"))
    r, lo, hi = claims.ratio(_samples(d, n, "be"), _samples(d, n, "lp"))
    text = f"per-neighbor BE/LP {claims.fmt_ci(r, lo, hi)} at {_mib(n)}"
    return claims.Verdict(text, f"per-neighbor BE/LP > {min_ratio:g}",
                          claims.at_least(lo, hi, min_ratio))


@claims.check("e2_model_within")
def check_model_within(df: pd.DataFrame, min_bytes: int, tolerance: float,
                       may_miss: str | int) -> claims.Verdict:
    """Signed model error ``(measured - model) / model`` within ``tolerance`` at every emulated
    point >= ``min_bytes`` but the :func:`pipecomm.lab.claims.allowance` of ``may_miss``
    (:func:`pipecomm.lab.claims.model_points`; ``model_s``: LP by the overlapped model).

    Example::

        >>> import numpy as np
        >>> from pipecomm.lab.measure import stats
        >>> df = plan(world_size=8, sizes_max=64 << 20)     # the model's points, measured = model here
        >>> df = df.assign(section="emulated", world_size=8, time_s=df.model_s, emu_alpha_s=3e-3,
        ...                emu_bandwidth_Bps=100e6, model_gamma_s_per_byte=0.0,
        ...                model_host_block_s=host_block_s(),
        ...                times_s=[stats.join_repeats(s * np.linspace(0.99, 1.01, 10)) for s in df.model_s])
        >>> check_model_within(df, 1 << 20, 0.25, "binomial").threshold
        '|error| <= 25% at all but 4 of 40 points (95% interval)'
    """
    claims.require_columns(df, "section", "nbytes", "time_s", "model_s", "times_s")
    d = df[df.section.isin(NETWORK_KINDS) & (df.nbytes >= min_bytes)]
    if d.empty:
        raise claims.NotDecidable(f"no emulated measurements >= {min_bytes} B")
    labels = [f"{r.op} {r.algorithm}, {r.ports}, {_mib(r.nbytes)}" for r in d.itertuples()]
    return claims.model_points([stats.repeats(c) for c in d.times_s], d.model_s.tolist(),
                               labels, tolerance, may_miss=may_miss)


@claims.check("e2_real_host_model")
def check_real_host_model(df: pd.DataFrame, op: str, world_size: int,
                          tolerance: float) -> claims.Verdict:
    """Real gloo backend: LP ``op`` at ``world_size`` and the largest message measured, with its
    default block, takes the host model's time (``model_s`` of the real section) within
    ``tolerance``, decided on the interval of the measured median.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> cells = [(op, a, base * f) for op, base in (("broadcast", 0.050), ("allreduce", 0.100))
        ...          for a, f in (("lp", 0.9), ("ring", 1.05), ("torch", 1.0))]    # real section, p = 8
        >>> df = pd.DataFrame([{"section": "real", "op": op, "algorithm": a, "nbytes": 16 << 20,
        ...                     "world_size": 8, "time_s": s, "model_s": s, "block_bytes": 4 << 20,
        ...                     "host_links": 1.4, "host_links_measured": True,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.99, 1.01, 10))}
        ...                    for op, a, s in cells])
        >>> check_real_host_model(df, "broadcast", 8, 0.25).verdict     # model_s = measured here
        'PASS'
    """
    claims.require_columns(df, "section", "op", "algorithm", "nbytes", "world_size", "times_s",
                           "model_s", "block_bytes")
    d = df[(df.section == "real") & (df.op == op) & (df.algorithm == "lp")
           & (df.world_size == world_size) & df.model_s.notna()]
    if d.empty:
        raise claims.NotDecidable(f"no real LP {op} at p = {world_size} with a host model (gloo only)")
    r = d[d.nbytes == d.nbytes.max()].iloc[0]  # a Series: r.nbytes would be its memory size
    label = f"LP {op}, p={world_size}, {_mib(r['nbytes'])}, block {_mib(r['block_bytes'])}"
    v = claims.model_points([stats.repeats(r["times_s"])], [float(r["model_s"])], [label],
                            tolerance)
    if "host_links_measured" in d and not bool(r["host_links_measured"]):
        return claims.Verdict(
            f"{v.measured} -- cannot decide: the host model used the default host_links "
            f"({float(r['host_links']):g}, the core count), not E0's measurement (run E0 into the "
            "same results folder first, as ./run_all.sh does)",
            v.threshold, claims.INCONCLUSIVE)
    return v


if __name__ == "__main__":
    main(sys.modules[__name__])
