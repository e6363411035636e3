"""E14 — the emulated network checked against a real shaped one: same collectives, same p.

Every network-dependent result of the cpu profile runs on :mod:`pipecomm.lab.networks.netem`, pipecomm's own
model of the network (per-message deadlines ``alpha + n / B`` on single-port ranks). This
experiment carries the same bytes over a network pipecomm does not model itself -- the kernel's
TCP stack and its token-bucket shaper -- and compares the same collective points on
``shaped``, a :class:`pipecomm.lab.networks.cluster.VirtualCluster` of ``world_size`` single-port nodes
whose link is calibrated first, and ``emulated``, a local pool of the same p on
:class:`pipecomm.lab.networks.netem.Network` configured with that link's *fitted* alpha and bandwidth.

Claim C14.1 (artifact/claims.yaml) compares every bandwidth-dominated point (at least
``min_bytes``): signed error ``emulated / shaped - 1`` on its interval. Needs root, iproute2 and
the tbf qdisc (:func:`pipecomm.lab.networks.cluster.available`); without them it stops with that reason.
Its profile is ``shaped`` (``./run_all.sh --profile shaped``), not the quick cpu run.

The two networks, the link calibration and the host check: docs/experiments.md, "E14: protocol
in detail".

Run::

    python -m pipecomm.lab.experiments.e14_emulator_vs_shaped --out results/manual/E14
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from pipecomm.lab import checks, claims, experiment
from pipecomm.lab.cli import main
from pipecomm.lab.measure import stats, sweep
from pipecomm.lab.networks import cluster, cost, netem
from pipecomm.lab.networks import kinds as network
from pipecomm.lab.networks.kinds import ranks_on

ID = "E14"
NOTEBOOK = "14_emulator_vs_shaped"
OPS = ("broadcast", "allreduce")
ALGORITHMS = ("lp", "mst", "be", "ring")


@dataclass(frozen=True)
class Params(experiment.Params):
    """E14's parameters with their quick defaults (the notebook's parameters cell); the
    ``shaped`` profile in artifact/profiles/ overrides them."""

    world_size: int = 4
    bandwidth_Bps: float = 20e6  # what 2 cores carry on every link at once (see shaped.yaml)
    sizes: list[int] = field(default_factory=lambda: [512 << 10, 1 << 20])
    cases: dict[str, list[str]] = field(default_factory=lambda: {
        "broadcast": ["lp", "mst", "be", "ring"], "allreduce": ["lp", "be", "ring"]})
    iters: int = 3
    warmup: int = 1
    link_sizes: list[int] = field(default_factory=lambda: [4 << 10, 1 << 20, 4 << 20])
    # the host check takes the best of these: fewer refuse a host by chance (all node links busy
    # kept 94-99% of a lone link at 5, 96-99% at 10, in 20 runs each at 20 MB/s on 4 nodes;
    # docs/network_model.md, "Quick defaults")
    link_iters: int = 10
    min_block_bytes: int = 256 << 10
    timeout_s: float = 600.0

    def validate(self) -> None:
        if not 2 <= self.world_size <= cluster.MAX_NODES:
            raise ValueError(f"parameter world_size must be in [2, {cluster.MAX_NODES}] (one "
                             f"node per rank), got {self.world_size!r}")
        if not 1e5 <= self.bandwidth_Bps <= 1e10:
            raise ValueError(f"parameter bandwidth_Bps must be in [1e5, 1e10] B/s, got "
                             f"{self.bandwidth_Bps!r}")
        for name in ("sizes", "link_sizes"):
            vals = getattr(self, name)
            if not vals or any(n < 1024 for n in vals):
                raise ValueError(f"parameter {name} must list message sizes >= 1024 bytes, got "
                                 f"{vals!r}")
        if len(self.link_sizes) < 2:
            raise ValueError(f"parameter link_sizes needs >= 2 sizes to fit alpha and beta, got "
                             f"{self.link_sizes!r}")
        if not self.cases or any(op not in OPS for op in self.cases):
            raise ValueError(f"parameter cases must map ops from {OPS} to algorithms, got "
                             f"{self.cases!r}")
        for op, algs in self.cases.items():
            if not algs or any(a not in ALGORITHMS for a in algs):
                raise ValueError(f"parameter cases[{op!r}] must list algorithms from "
                                 f"{ALGORITHMS}, got {algs!r}")
        for name, minimum in (("iters", 1), ("warmup", 0), ("link_iters", 1),
                              ("min_block_bytes", 1024)):
            value = getattr(self, name)
            if value < minimum:
                raise ValueError(f"parameter {name} must be >= {minimum}, got {value!r}")
        checks.positive_float(self, "timeout_s")


DEFAULTS = Params.defaults()


def plan(params: Params) -> list[dict[str, Any]]:
    """The timed points: every op x algorithm x size at p = ``world_size``, in a fixed order.

    Example::

        >>> len(plan(Params.make()))
        14
    """
    return [{"op": op, "algorithm": alg, "nbytes": n, "p": params.world_size,
             "warmup": params.warmup, "iters": params.iters, "first_warmup": True}
            for op, algs in params.cases.items() for alg in algs for n in params.sizes]


def with_blocks(points: list[dict[str, Any]], alpha_s: float, bandwidth_Bps: float,
                min_block_bytes: int) -> list[dict[str, Any]]:
    """The points with LP's block size: the alpha-beta optimum on the fitted link, at least
    ``min_block_bytes`` (the same on both networks, so both run the same schedule; the floor
    keeps every message bandwidth-dominated and within what the host can deliver at p = 8).

    Example::

        >>> with_blocks(plan(Params.make()), 1e-4, 47e6, 256 << 10)[0]["block_bytes"]
        262144
    """
    link = cost.LinkModel.from_bandwidth(alpha_s, bandwidth_Bps)
    return [dict(pt, block_bytes=cost.lp_optimal_block_bytes(
        pt["op"], pt["nbytes"], pt["p"], link, min_bytes=min_block_bytes))
        if pt["algorithm"] == "lp" else dict(pt) for pt in points]


def run(**params: Any) -> pd.DataFrame:
    """Calibrate and time the collectives on the shaped cluster, then on the emulator
    configured from that calibration (module docstring)."""
    params = Params.make(**params)
    ok, why = cluster.available()
    if not ok:
        raise RuntimeError(f"E14 needs the virtual cluster (root, iproute2, tc tbf): {why}")
    points = plan(params)
    with ranks_on("shaped", params.world_size, netem.Network(0.0, params.bandwidth_Bps), None,
                  timeout_s=params.timeout_s, calibration_sizes=params.link_sizes,
                  calibration_iters=params.link_iters) as shaped_ranks:
        cal = shaped_ranks.calibration
        alpha_s, bandwidth_Bps = cal["inter"]["alpha_s"], cal["inter"]["bandwidth_Bps"]
        blocked = with_blocks(points, alpha_s, bandwidth_Bps, params.min_block_bytes)
        shaped = shaped_ranks.run(sweep.measure_points, blocked, timeout_s=params.timeout_s)[0]
        where = shaped_ranks.text
    net = netem.Network(alpha_s=alpha_s, bandwidth_Bps=bandwidth_Bps, ports="single")
    smallest = min(min(pt.get("block_bytes") or pt["nbytes"], pt["nbytes"] // params.world_size)
                   for pt in blocked)
    with network.emulated_pool(params.world_size, net, smallest,
                               timeout_s=params.timeout_s) as ranks:
        emulated = ranks.run(sweep.measure_points, blocked, timeout_s=params.timeout_s)[0]
    common = {"bandwidth_Bps": params.bandwidth_Bps, "fit_alpha_s": alpha_s,
              "fit_bandwidth_Bps": bandwidth_Bps, "chain_Bps": cal["chain_Bps"]}
    link = pd.DataFrame(cal["inter"]["rows"]).rename(columns={"bandwidth_Bps": "achieved_Bps"})
    frames = [
        link.assign(section="link", world_size=2, network=where, **common),
        pd.DataFrame(shaped).assign(section="collective", network_kind="shaped",
                                              network=where, **common),
        pd.DataFrame(emulated).assign(section="collective", network_kind="emulated",
                                      network=net.describe(), **common),
    ]
    return pd.concat(frames, ignore_index=True)


def size_text(nbytes: float) -> str:
    """``"4 KiB"``, ``"16 MiB"``: a message size for tables.

    Example::

        >>> size_text(1 << 20)
        '1 MiB'
    """
    n = int(nbytes)
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n / 1024:g} KiB"


def compare(df: pd.DataFrame, min_bytes: int = 0) -> pd.DataFrame:
    """One row per point on both networks: medians, ``emulated / shaped`` with its 95% interval
    (:func:`pipecomm.lab.claims.ratio`) and the signed error ``ratio - 1``.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("emulated", 0.0105), ("shaped", 0.0100)]      # one point, median seconds
        >>> df = pd.DataFrame([{"section": "collective", "op": "broadcast", "algorithm": "lp",
        ...                     "nbytes": 1 << 20, "world_size": 4, "network_kind": k, "time_s": s,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.98, 1.02, 10))}
        ...                    for k, s in rows])
        >>> compare(df)[["op", "algorithm", "nbytes", "error", "error_lo", "error_hi"]].round(3)
                  op algorithm   nbytes  error  error_lo  error_hi
        0  broadcast        lp  1048576   0.05     0.032     0.069
    """
    col = df[(df.section == "collective") & (df.nbytes >= min_bytes)]
    keys = ["op", "algorithm", "nbytes", "world_size"]
    rows = []
    for key, g in col.groupby(keys, sort=True):
        by = {r.network_kind: r for r in g.itertuples()}
        if {"shaped", "emulated"} - set(by):
            continue
        emu, shp = stats.repeats(by["emulated"].times_s), stats.repeats(by["shaped"].times_s)
        r, lo, hi = claims.ratio(emu, shp)
        rows.append({**dict(zip(keys, key)), "shaped_s": by["shaped"].time_s,
                     "emulated_s": by["emulated"].time_s, "ratio": r, "error": r - 1,
                     "error_lo": lo - 1, "error_hi": hi - 1})
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """The link record (achieved vs configured rate per size) and the per-point comparison."""
    link = df[df.section == "link"]
    rec = pd.DataFrame({
        "what": [f"link {size_text(n)}" for n in link.nbytes],
        "value": [f"{a / 1e6:.1f} MB/s of {c / 1e6:.0f} ({a / c:.3f})"
                  for a, c in zip(link.achieved_Bps, link.bandwidth_Bps)]})
    cmp = compare(df)
    pts = pd.DataFrame({
        "what": [f"{r.op} {r.algorithm} {size_text(r.nbytes)}, p={int(r.world_size)}"
                 for r in cmp.itertuples()],
        "value": [f"shaped {r.shaped_s * 1e3:.1f} ms, emulated {r.emulated_s * 1e3:.1f} ms, "
                  f"error {claims.fmt_ci(r.error, r.error_lo, r.error_hi, '+.1%')}"
                  for r in cmp.itertuples()]})
    return pd.concat([rec, pts], ignore_index=True)


def plot(df: pd.DataFrame, **params: Any):
    """Left: achieved vs configured link rate per size. Right panels, one per op: time vs size
    per algorithm, shaped (solid) and emulated (dashed), medians with 95% intervals."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    col = df[df.section == "collective"]
    ops = [op for op in OPS if op in set(col.op)]
    fig, axes = plt.subplots(1, 1 + len(ops), figsize=(4.6 * (1 + len(ops)), 4), squeeze=False)
    link = df[df.section == "link"].sort_values("nbytes")
    ax = axes[0, 0]
    ax.semilogx(link.nbytes, link.achieved_Bps / 1e6, "o-", label="achieved (TCP payload)")
    ax.axhline(link.bandwidth_Bps.iloc[0] / 1e6, color="k", ls="--", label="configured (tbf)")
    ax.axhline(link.fit_bandwidth_Bps.iloc[0] / 1e6, color="C3", ls=":",
               label="fitted B (emulator's)")
    ax.set(xlabel="message size (bytes)", ylabel="MB/s", title="shaped link, node 0 -> node 1",
           ylim=(0, None))
    ax.legend(fontsize=7)
    for ax, op in zip(axes[0, 1:], ops):
        for alg, g in col[col.op == op].groupby("algorithm"):
            color = sweep.ALG_COLORS.get(alg)
            for kind, style in (("shaped", "-o"), ("emulated", "--s")):
                h = g[g.network_kind == kind].sort_values("nbytes")
                if h.empty:
                    continue
                err = np.vstack([h.time_s - h.ci_lo_s, h.ci_hi_s - h.time_s])
                ax.errorbar(h.nbytes, h.time_s, yerr=err, fmt=style, color=color, ms=4,
                            capsize=2, label=f"{alg}, {kind}")
        ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="time (s)",
               title=f"{op}, p={int(col.world_size.max())}, single-port")
        ax.legend(fontsize=6, ncol=2)
    shaped = col[col.network_kind == "shaped"].network.iloc[0] if len(col) else ""
    fig.suptitle(f"E14 — solid: {shaped}\ndashed: emulated: pipecomm.lab.networks.netem with the fitted link",
                 fontsize=8)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- claims


@claims.check("e14_emulator_matches_shaped")
def check_emulator_matches_shaped(df: pd.DataFrame, min_bytes: int, tolerance: float,
                                  may_miss: str | int) -> claims.Verdict:
    """Every point of at least ``min_bytes``: the emulated time is within ``tolerance`` of the
    shaped network's (signed error ``emulated / shaped - 1``, decided on its 95% interval),
    except for the allowance of ``may_miss`` points (:func:`pipecomm.lab.claims.allowance`).
    Reports the worst error with its interval, the mean signed bias and the same-sign count.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> rows = [("emulated", 0.0105), ("shaped", 0.0100)]      # one point, median seconds
        >>> df = pd.DataFrame([{"section": "collective", "op": "broadcast", "algorithm": "lp",
        ...                     "nbytes": 1 << 20, "world_size": 4, "network_kind": k, "time_s": s,
        ...                     "times_s": stats.join_repeats(s * np.linspace(0.98, 1.02, 10))}
        ...                    for k, s in rows])
        >>> check_emulator_matches_shaped(df, 1 << 20, 0.15, "binomial")     # doctest: +ELLIPSIS
        Verdict(measured='worst +5.0% [+3.2%, +6.9%] (broadcast lp, 1 MiB, p=4); bias +5.0%, 1/1 same sign; points: 1 PASS', threshold='|emulated / shaped - 1| <= 15% at every point (95% interval)', verdict='PASS', reason='95% interval [0.0316, 0.0688] inside +-0.15')
    """
    claims.require_columns(df, "section", "network_kind", "op", "algorithm", "nbytes",
                           "world_size", "time_s", "times_s")
    cmp = compare(df, min_bytes)
    if cmp.empty:
        raise claims.NotDecidable(f"no point of >= {min_bytes} bytes was measured on both networks")
    spans = list(zip(cmp.error_lo, cmp.error_hi))
    verdicts = [claims.within(lo, hi, tolerance) for lo, hi in spans]
    labels = [f"{r.op} {r.algorithm}, {size_text(r.nbytes)}, p={int(r.world_size)}"
              for r in cmp.itertuples()]
    text = claims.error_report(cmp.error.tolist(), spans, labels, verdicts)
    allowed = claims.allowance(len(verdicts), may_miss)
    where = "at every point" if not allowed else f"at all but {allowed} of {len(verdicts)} points"
    if allowed:
        text += f"; {claims.missed(verdicts, allowed)}"
    return claims.Verdict(text, f"|emulated / shaped - 1| <= {tolerance:.0%} {where} "
                          "(95% interval)", claims.combine(verdicts, allowed))


if __name__ == "__main__":
    main(sys.modules[__name__])
