"""E0 — calibration: alpha, beta of the backend and of the emulated network; gamma.

The alpha-beta(-gamma) model (Hockney; Thakur, Rabenseifner & Gropp 2005) that every cost model
of the LP paper uses: a message of n bytes costs ``alpha + n * beta``; reducing n bytes costs
``n * gamma``. Ping-pong between two ranks over message sizes gives the one-way time,
``cost.fit_alpha_beta`` fits alpha and beta, and ``gamma`` is the time of an in-place float32
add per byte. A host section measures ``host_links`` (how many lone loopback links' worth of
bytes the host moves at once) for the real backend's LP model. With an emulated network
(``pipecomm.lab.networks.netem``) the same ping-pong measures the emulated alpha and bandwidth: claim C0.2
(artifact/claims.yaml). ``network="shaped"`` runs that section on a shaped real network,
``backend="nccl"`` (gpu profile) the ping-pong between two GPUs.

Fit range, host section, the shaped and NCCL variants: docs/experiments.md, "E0: protocol in
detail".

Run::

    python -m pipecomm.lab.experiments.e00_calibrate --out results/manual/E0
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from pipecomm.collectives.p2p import exchange
from pipecomm.lab import claims, experiment, results
from pipecomm.lab.cli import check_backend, main
from pipecomm.lab.measure import bench, stats
from pipecomm.lab.measure.sweep import message_sizes
from pipecomm.lab.networks import cost, launch
from pipecomm.lab.networks.kinds import NETWORK_KINDS, check_network_kind, ranks_on

ID = "E0"
NOTEBOOK = "00_calibrate"


@dataclass(frozen=True)
class Params(experiment.Params):
    """E0's parameters with their quick defaults (the notebook's parameters cell); the
    profiles in artifact/profiles/*.yaml override them."""

    sizes_min: int = 4
    sizes_max: int = 16 << 20
    size_factor: int = 4
    iters: int = 5
    warmup: int = 2
    gamma_bytes: int = 16 << 20
    host_world_size: int = 4  # 0: no host section
    host_bytes: int = 4 << 20
    host_messages: int = 4  # messages per link of the host probe's stream
    fit_min_bytes: int = 64 << 10
    emulated: bool = True
    emu_world_sizes: list[int] = field(default_factory=lambda: [2])
    emu_alpha_s: float = 0.002
    emu_bandwidth_Bps: float = 50e6
    emu_sizes_max: int = 4 << 20
    backend: str = "gloo"
    timeout_s: float = 300.0
    network: str = "emulated"  # where the emu_* section runs: "emulated" or "shaped"

    def validate(self) -> None:
        check_network_kind(self.network)
        message_sizes(self.sizes_min, self.sizes_max, self.size_factor)
        message_sizes(self.sizes_min, self.emu_sizes_max, self.size_factor)
        for name, minimum in (("iters", 1), ("warmup", 0), ("gamma_bytes", 0),
                              ("fit_min_bytes", 1)):
            value = getattr(self, name)
            if value < minimum:
                raise ValueError(f"parameter {name} must be >= {minimum}, got {value!r}")
        for name in ("emu_alpha_s", "emu_bandwidth_Bps", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"parameter {name} must be > 0, got {getattr(self, name)!r}")
        if self.host_world_size != 0 and self.host_world_size < 3:
            raise ValueError(f"parameter host_world_size must be 0 (no host section) or >= 3 "
                             f"(a chain of 2 links or more), got {self.host_world_size!r}")
        for name in ("host_bytes", "host_messages"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter {name} must be >= 1, got {getattr(self, name)!r}")
        if any(w < 2 or w % 2 for w in self.emu_world_sizes):
            raise ValueError(f"parameter emu_world_sizes must list even world sizes >= 2 (ranks "
                             f"ping-pong in pairs), got {self.emu_world_sizes!r}")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"parameter backend must be 'gloo' or 'nccl', got {self.backend!r}")


DEFAULTS = Params.defaults()


def _pingpong(sizes: list[int], iters: int, warmup: int) -> list[dict[str, Any]]:
    """On every rank: ranks (2i, 2i+1) ping-pong concurrently; the even rank reports."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = launch.device()
    peer = rank + 1 if rank % 2 == 0 else rank - 1
    rows = []
    if peer < world:  # open the connection before the first timed size
        for _ in range(3):
            exchange([(torch.zeros(1, dtype=torch.uint8, device=device), peer)],
                     [(torch.empty(1, dtype=torch.uint8, device=device), peer)])
    for n in sizes:
        buf = torch.zeros(n, dtype=torch.uint8, device=device)
        times = []
        for i in range(warmup + iters):
            dist.barrier()
            start = time.perf_counter()
            if peer < world:
                if rank % 2 == 0:
                    exchange([(buf, peer)], [])
                    exchange([], [(buf, peer)])
                else:
                    exchange([], [(buf, peer)])
                    exchange([(buf, peer)], [])
            bench.synchronize(device)
            if i >= warmup:
                times.append((time.perf_counter() - start) / 2)
        if rank % 2 == 0 and peer < world:
            rows.append({"pair": f"{rank}-{peer}", "nbytes": n, "iters": iters,
                         **stats.summarise(times)})
    return rows


def _gamma(nbytes: int, iters: int) -> list[dict[str, Any]]:
    """Time of ``a += b`` on float32 tensors of ``nbytes`` each, on rank 0."""
    rows = []
    if dist.get_rank() == 0:
        device = launch.device()
        a = torch.ones(max(1, nbytes // 4), device=device)
        b = torch.ones_like(a)
        for _ in range(2):
            a.add_(b)
        times = []
        for _ in range(iters):
            bench.synchronize(device)
            start = time.perf_counter()
            a.add_(b)
            bench.synchronize(device)
            times.append(time.perf_counter() - start)
        rows.append({"nbytes": a.numel() * 4, "time_s": float(np.median(times)), "iters": iters})
    dist.barrier()
    return rows


def _measure_rank(sizes, iters, warmup, gamma_bytes) -> list[dict[str, Any]]:
    rows = [dict(r, section="real") for r in _pingpong(sizes, iters, warmup)]
    if gamma_bytes:
        rows += [dict(r, section="reduction") for r in _gamma(gamma_bytes, max(iters, 5))]
    return rows


def _host_rank(nbytes: int, iters: int, messages: int) -> list[dict[str, Any]]:
    """On every rank of a local pool: one link alone, then every hop of the chain streaming
    ``messages`` messages at once."""
    from pipecomm.lab.networks import cluster

    lone = cluster.link_bandwidth([nbytes], iters)
    per_link = cluster.chain_bandwidth(nbytes, iters, messages=messages)
    if dist.get_rank() != 0:
        return []
    flows = dist.get_world_size() - 1
    return [{"flows": 1, "nbytes": nbytes, "messages": 1,
             "bandwidth_Bps": lone[-1]["bandwidth_Bps"]},
            {"flows": flows, "nbytes": nbytes, "messages": messages, "bandwidth_Bps": per_link}]


def host_links(df: pd.DataFrame) -> float | None:
    """``(p - 1) x`` the chain's rate per link over one link's rate alone (section ``host``), or
    ``None`` without that section. One link's rate is the ping-pong's at its largest size
    (section ``real``: the per-size table the LP model reads, whose
    :attr:`pipecomm.lab.networks.cost.HostLink.rate_Bps` the model multiplies by ``host_links``) when it was
    measured, else the host section's own lone link.

    Example::

        >>> import pandas as pd
        >>> df = pd.DataFrame({"section": ["real", "host", "host"], "nbytes": [1 << 20] * 3,
        ...                    "time_s": [0.002, None, None], "flows": [1, 1, 7],
        ...                    "bandwidth_Bps": [None, 500e6, 100e6]})   # run(host_world_size=8)
        >>> round(host_links(df), 2)      # lone links' worth the host streams at once
        1.34
    """
    host = df[df.section == "host"]
    if host.empty:
        return None
    chain = host[host.flows > 1].iloc[0]  # a Series: chain.nbytes would be its memory size
    real = df[df.section == "real"]
    if len(real):
        largest = real[real.nbytes == real.nbytes.max()]
        lone = float(largest.nbytes.iloc[0] / largest.time_s.median())
    else:
        lone = float(host[host.flows == 1].bandwidth_Bps.iloc[0])
    return float(chain.flows * chain.bandwidth_Bps / lone)


def run(**params: Any) -> pd.DataFrame:
    """Measure ping-pong on the real backend (2 ranks), gamma, and the emulated network."""
    params = Params.make(**params)
    sizes = message_sizes(params.sizes_min, params.sizes_max, params.size_factor)
    check_backend(params.backend, 2, emulated=params.emulated)
    if params.emulated and launch.under_torchrun():
        raise ValueError("under torchrun only the real section runs: pass -p emulated=false")
    frames = []
    with launch.pool(2, backend=params.backend) as ranks:
        per_rank = ranks.run(_measure_rank, sizes, params.iters, params.warmup, params.gamma_bytes,
                             timeout_s=params.timeout_s)
    frames.append(pd.DataFrame([r for rows in per_rank for r in rows])
                  .assign(world_size=2, backend=params.backend, network="real"))
    if params.host_world_size and params.backend == "gloo" and not launch.under_torchrun():
        with launch.Ranks(params.host_world_size) as ranks:
            rows = ranks.run(_host_rank, params.host_bytes, params.iters, params.host_messages,
                             timeout_s=params.timeout_s)
        frames.append(pd.DataFrame(rows[0]).assign(section="host", backend="gloo",
                                                   world_size=params.host_world_size,
                                                   network="real"))
    if params.emulated:
        from pipecomm.lab.networks import netem

        net = netem.Network(alpha_s=params.emu_alpha_s, bandwidth_Bps=params.emu_bandwidth_Bps)
        emu_sizes = message_sizes(params.sizes_min, params.emu_sizes_max, params.size_factor)
        for p in params.emu_world_sizes:
            with ranks_on(params.network, p, net, min(emu_sizes),
                          timeout_s=params.timeout_s) as ranks:
                per_rank = ranks.run(_measure_rank, emu_sizes, params.iters, params.warmup, 0,
                                     timeout_s=params.timeout_s)
            frames.append(pd.DataFrame([r for rows in per_rank for r in rows]).assign(
                section=ranks.kind, world_size=p, backend="gloo", network=ranks.text,
                emu_alpha_s=ranks.net.alpha_s, emu_bandwidth_Bps=ranks.net.bandwidth_Bps))
    return pd.concat(frames, ignore_index=True)


def fit(df: pd.DataFrame, min_bytes: int = DEFAULTS["fit_min_bytes"]) -> dict[str, float]:
    """alpha, beta from the real ping-pong at sizes >= ``min_bytes`` (relative least squares),
    the small-message latency (median one-way time below 1 KiB), gamma and, with a host
    section, :func:`host_links`.

    Loopback transports switch protocol for small messages (eager copies), so one straight line
    cannot serve 4 B and 64 MiB alike; the fit covers the range the collectives' blocks use.
    """
    real = df[df.section == "real"]
    large = real[real.nbytes >= min_bytes]
    if len(large) < 2:
        raise ValueError(f"need >= 2 real ping-pong sizes >= fit_min_bytes={min_bytes} to fit")
    alpha, beta = cost.fit_alpha_beta(large.nbytes.to_numpy(), large.time_s.to_numpy())
    small = real[real.nbytes < 1024]
    red = df[df.section == "reduction"]
    gamma = float((red.time_s / red.nbytes).median()) if len(red) else float("nan")
    table = real.groupby("nbytes").time_s.median()
    links = host_links(df)
    return {"alpha_s": float(alpha), "beta_s_per_byte": float(beta), "gamma_s_per_byte": gamma,
            "bandwidth_Bps": 1.0 / beta if beta > 0 else float("inf"),
            "small_message_latency_s": float(small.time_s.median()) if len(small) else None,
            "fit_min_bytes": int(min_bytes),
            **({} if links is None else {"host_links": links}),
            # the calibration record: one-way time per message size, as measured (no fit)
            "per_size": {"nbytes": [int(n) for n in table.index],
                         "one_way_s": [float(t) for t in table.to_numpy()],
                         "bandwidth_Bps": [float(n / t) for n, t in table.items()]}}


def fit_emulated(df: pd.DataFrame, min_bytes: int = 64 << 10) -> pd.DataFrame:
    """Per world size: the emulated alpha and bandwidth fitted from messages >= min_bytes."""
    rows = []
    emu = df[df.section.isin(NETWORK_KINDS) & (df.nbytes >= min_bytes)]
    for p, g in emu.groupby("world_size"):
        a, b = cost.fit_alpha_beta(g.nbytes.to_numpy(), g.time_s.to_numpy())
        rows.append({"world_size": p, "alpha_s": a, "bandwidth_Bps": 1 / b if b > 0 else float("inf"),
                     "config_alpha_s": g.emu_alpha_s.iloc[0],
                     "config_bandwidth_Bps": g.emu_bandwidth_Bps.iloc[0]})
    return pd.DataFrame(rows)


def _real_link(df: pd.DataFrame) -> str:
    backend = df[df.section == "real"].backend.iloc[0]
    return "NCCL between two GPUs" if backend == "nccl" else "gloo over loopback"


def summary(df: pd.DataFrame, fit_min_bytes: int = DEFAULTS["fit_min_bytes"]) -> pd.DataFrame:
    """One row per fitted link: real backend and each emulated world size."""
    f = fit(df, fit_min_bytes)
    rows = [{"link": f"{_real_link(df)} (real)", "alpha_us": f["alpha_s"] * 1e6,
             "bandwidth_MBps": f["bandwidth_Bps"] / 1e6,
             "gamma_GBps": 1e-9 / f["gamma_s_per_byte"]}]
    kind = df[df.section.isin(NETWORK_KINDS)].section
    for _, r in fit_emulated(df).iterrows():
        rows.append({"link": f"{kind.iloc[0]}, p={int(r.world_size)} (its link: "
                             f"{r.config_alpha_s * 1e3:g} ms, {r.config_bandwidth_Bps / 1e6:g} MB/s)",
                     "alpha_us": r.alpha_s * 1e6, "bandwidth_MBps": r.bandwidth_Bps / 1e6,
                     "gamma_GBps": float("nan")})
    host = df[df.section == "host"]
    if len(host):
        chain = host[host.flows > 1].iloc[0]
        rows.append({"link": f"{_real_link(df)}, {int(chain.flows)} links at once (host_links "
                             f"{host_links(df):.2f})", "alpha_us": float("nan"),
                     "bandwidth_MBps": chain.bandwidth_Bps / 1e6, "gamma_GBps": float("nan")})
    return pd.DataFrame(rows)


def plot(df: pd.DataFrame, **params: Any):
    """Log-log one-way time vs message size: measured points, fitted / configured model lines."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    sns.set_theme(style="whitegrid", context="paper")
    emulated = df[df.section.isin(NETWORK_KINDS)]
    ncols = 2 if len(emulated) else 1
    fig, axes = plt.subplots(1, ncols, figsize=(5.5 * ncols, 4), squeeze=False)
    real = df[df.section == "real"]
    f = fit(df, params.get("fit_min_bytes", DEFAULTS["fit_min_bytes"]))
    ax = axes[0, 0]
    ax.loglog(real.nbytes, real.time_s, "o", label="measured (median one-way)")
    xs = np.geomspace(f["fit_min_bytes"], real.nbytes.max(), 100)
    ax.loglog(xs, f["alpha_s"] + xs * f["beta_s_per_byte"], "-",
              label=f"fit (>= {f['fit_min_bytes'] // 1024} KiB): alpha={f['alpha_s'] * 1e6:.0f} us,"
                    f" B={f['bandwidth_Bps'] / 1e9:.2f} GB/s")
    ax.set(xlabel="message size (bytes)", ylabel="one-way time (s)",
           title=f"real: {_real_link(df)}, p=2 (not emulated)")
    ax.legend(fontsize=8)
    if len(emulated):
        ax = axes[0, 1]
        for p, g in emulated.groupby("world_size"):
            ax.loglog(g.nbytes, g.time_s, "o", alpha=0.7, label=f"measured, p={p}")
        a, bw = emulated.emu_alpha_s.iloc[0], emulated.emu_bandwidth_Bps.iloc[0]
        xs = np.geomspace(emulated.nbytes.min(), emulated.nbytes.max(), 100)
        shaped = emulated.section.iloc[0] == "shaped"
        ax.loglog(xs, a + xs / bw, "k-", label=f"{'calibrated' if shaped else 'configured'}: "
                  f"{a * 1e3:.3g} ms + n / {bw / 1e6:.3g} MB/s")
        ax.set(xlabel="message size (bytes)", ylabel="one-way time (s)",
               title=f"{emulated.section.iloc[0]} network (gloo underneath)\n"
                     f"{emulated.network.iloc[0]}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save(out_dir, df, fig=None, params=None, extra=None):
    """results.save plus ``calibration.json`` (the fit the cost models read)."""
    out = results.save(out_dir, df, fig, params, extra)
    if out is not None:
        min_bytes = (params or {}).get("fit_min_bytes", DEFAULTS["fit_min_bytes"])
        results.write_json(Path(out) / "calibration.json", fit(df, min_bytes))
    return out


# --------------------------------------------------------------------------- claims


@claims.check("e0_emulated_within")
def check_emulated_within(df: pd.DataFrame, min_bytes: int, tolerance: float,
                          abs_tolerance_s: float, world_sizes: list[int],
                          may_miss: str | int) -> claims.Verdict:
    """Every emulated message >= ``min_bytes`` of every world size in ``world_sizes`` takes the
    configured ``alpha + n / B``: signed error within ``tolerance`` (or ``abs_tolerance_s``,
    when larger), decided on the interval of each pair's median (:func:`claims.model_points`),
    but the :func:`claims.allowance` of ``may_miss`` points.

    Example::

        >>> import numpy as np, pandas as pd
        >>> from pipecomm.lab.measure import stats
        >>> points = [(p, pair, n) for p in (2, 8) for pair in range(p // 2) for n in (65536, 1 << 20)]
        >>> df = pd.DataFrame([{"section": "emulated", "world_size": p, "pair": pair, "nbytes": n,
        ...                     "emu_alpha_s": 1e-3, "emu_bandwidth_Bps": 50e6, "time_s": 1e-3 + n / 50e6,
        ...                     "times_s": stats.join_repeats((1e-3 + n / 50e6) * np.linspace(0.99, 1.01, 10))}
        ...                    for p, pair, n in points])          # measured = alpha + n / B
        >>> check_emulated_within(df, 65536, 0.1, 0.001, [2, 8], "binomial").verdict
        'PASS'
    """
    claims.require_columns(df, "section", "nbytes", "time_s", "times_s", "world_size",
                           "emu_alpha_s", "emu_bandwidth_Bps", "pair")
    emu = df[df.section.isin(NETWORK_KINDS) & (df.nbytes >= min_bytes)]
    missing = sorted(set(world_sizes) - set(emu.world_size.tolist()))
    if missing:
        raise claims.NotDecidable(f"no emulated measurements for world sizes {missing}")
    emu = emu[emu.world_size.isin(world_sizes)]
    model = emu.emu_alpha_s + emu.nbytes / emu.emu_bandwidth_Bps
    labels = [f"p={int(r.world_size)}, pair {r.pair}, {int(r.nbytes) >> 10} KiB"
              for r in emu.itertuples()]
    return claims.model_points([stats.repeats(c) for c in emu.times_s], model.tolist(), labels,
                               tolerance, abs_tolerance_s, may_miss=may_miss)


if __name__ == "__main__":
    main(sys.modules[__name__])
