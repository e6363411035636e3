"""Collectives benchmark in the style of nccl-tests: pipecomm's algorithms against the built-in.

For every algorithm (``lp``, ``mst``, ``be``, ``ring`` and ``torch``, the backend's built-in),
op (``broadcast``, ``allreduce``, ``reduce``), world size p and message size it prints one line:
the time (median over ``--repeats`` repeats and its bootstrap 95% interval), algbw and busbw
(nccl-tests' definitions, :func:`pipecomm.lab.measure.bench.busbw`), ``#wrong`` (elements that differ from the
built-in's result on the same random input beyond float32 round-off; broadcast and integer-valued
results must match exactly) and the ratio of the median to the built-in's median measured in the
same run, with its bootstrap 95% interval (:func:`pipecomm.lab.measure.stats.ratio_ci`). LP rows also give
the default block size (:func:`pipecomm.collectives.lp.default_block_bytes`) and the host model's
prediction for it (:func:`pipecomm.lab.networks.cost.lp_time_on_host` on the link ``PIPECOMM_CALIBRATION``
names, else the fallback table), with its signed error.

Every repeat runs all selected algorithms back to back (so drifts of a shared machine hit all of
them alike; :func:`pipecomm.lab.measure.sweep.measure_points` with ``interleave=True``, the protocol of E2's
real section too), each timed by :func:`pipecomm.lab.measure.bench.time_fn`: all ranks start at one common instant
(an allreduce MAX of ``time.monotonic()`` plus a margin, then a sleep; ``CLOCK_MONOTONIC`` is
shared by the processes of one host) and a repeat's time is the last rank's end minus that start,
so barrier-exit skew is not measured. One pool of ``max(p)`` local gloo ranks serves every p; a
smaller p runs on the subgroup of ranks ``0..p-1`` (as experiment E2 does).

``paired`` (CSV columns ``pratio``, ``pratio_lo``, ``pratio_hi``): the median of the
per-repeat ratios to the built-in with its bootstrap interval over the repeats
(:func:`pipecomm.lab.measure.stats.paired_ratio_ci`; repeat ``i`` of every algorithm runs in one round, in
an order rotated from round to round), which a drift of the host between rounds does not widen.
It is reported beside the unpaired ratio; ``--targets`` decides with the unpaired one;
``--targets CSV --paired`` adds the same targets on the paired ratios as a secondary reading,
once the paired A/A rows pass their check (no more of their intervals excluding 1 than
:func:`pipecomm.lab.measure.stats.misses_allowed` allows for their number).

Every repeat also records the call's CPU time on every rank (``time.process_time``: all threads,
the backend's included), summed over the ranks (CSV ``cpu_s``, the median, ``cpu_times_s``
every repeat): its ratio to the built-in's (``cpu_ratio``, with a bootstrap 95% interval) and
the share of the host's core-seconds the call used (``busy``, :func:`pipecomm.lab.measure.bench.host_busy`).
With 8 ranks on 2 cores a call that keeps the cores busy takes its CPU divided by the cores;
a wall-time ratio above the CPU ratio means cores left idle (``--cpu-summary``).

``--aa`` times the built-in a second time in every repeat (rows ``torch-aa``): its ratio to the
built-in is an A/A comparison, the interval an algorithm exactly as fast as the built-in would get
on this host in this run -- the noise floor against which a target such as "at most 1.0x by the
interval's upper bound" is judged.

Usage::

    .venv/bin/python benchmarks/bench_collectives.py                       # everything
    .venv/bin/python benchmarks/bench_collectives.py --p 2 4 8 --sizes 16M 64M --csv out.csv
    .venv/bin/python benchmarks/bench_collectives.py --algorithms lp torch --ops broadcast \\
        --p 8 --sizes 64M --repeats 20
    .venv/bin/python benchmarks/bench_collectives.py --algorithms lp ring torch --aa  # + A/A
    .venv/bin/python benchmarks/bench_collectives.py --algorithms lp torch --lp-blocks 2 4 8
    .venv/bin/python benchmarks/bench_collectives.py --quick               # seconds: it runs
    .venv/bin/python benchmarks/bench_collectives.py --summary out.csv     # ARTIFACT.md's table
    .venv/bin/python benchmarks/bench_collectives.py --cpu-summary out.csv # wall vs CPU ratios
    .venv/bin/python benchmarks/bench_collectives.py --targets out.csv     # the loopback targets
    .venv/bin/python benchmarks/bench_collectives.py --targets out.csv --paired  # + paired reading

On a real, bandwidth-limited network: ``--cluster RATE`` (root) runs the same job on a virtual
cluster (:class:`pipecomm.lab.networks.cluster.VirtualCluster`: one network namespace per node, every node
link shaped to RATE bytes/s each way by tc tbf; ``--ranks-per-node 2`` for two-level nodes) and
adds each point's link limit (:func:`pipecomm.lab.measure.bench.link_limit_s`; CSV ``link_s``); the goals on
such a network are claims C15.1-C15.3 of E15 (profile ``shaped``). ``--check-cost`` times the ranks' agreement check
alone beside each call (rows ``check``; ``--check-summary CSV``), each call without it (rows
``unchecked:ALG``) and, with ``torch`` among the algorithms, the built-in behind torch's own
check (rows ``torch:detail``, a group made with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).
``--parity CSV``: LP broadcast at parity with the built-in, its interval inside the built-in's
A/A interval.

    .venv/bin/python benchmarks/bench_collectives.py --cluster 15M --p 8 --sizes 16M \
        --algorithms lp ring torch --ops broadcast allreduce --repeats 10 --csv shaped.csv
    .venv/bin/python benchmarks/bench_collectives.py --algorithms lp ring torch --ops allreduce \
        --p 2 4 8 --sizes 4K 1M 64M --check-cost --csv check.csv

``--algorithms ... auto`` times ``algorithm="auto"`` too: with ``--tune`` the ranks first
measure its table (:mod:`pipecomm.lab.measure.autotune`, for the run's ops, p and sizes) into
``--tune-file`` (else a temporary file), which they read as ``PIPECOMM_TUNE_FILE``;
``--auto-goals CSV`` decides its goals (:func:`auto_goals`)::

    .venv/bin/python benchmarks/bench_collectives.py --algorithms lp ring torch auto --aa --tune \
        --p 2 4 8 --sizes 1M 16M --csv auto_loopback.csv
    .venv/bin/python benchmarks/bench_collectives.py --auto-goals auto_loopback.csv

``--lp-blocks K [K ...]`` adds LP cut into K blocks (rows ``lp/K``, block ``ceil(n / K)`` bytes
rounded up to whole elements) next to LP's default block (rows ``lp``): how far the host model's
choice (:func:`pipecomm.collectives.lp.default_block_bytes`) is from the best block count measured
in the same rounds.

``--targets`` decides pipecomm's loopback targets on a CSV this script wrote, from its own ratio
columns (benchmark rows of ARTIFACT.md, not claims of a profile): ring allreduce and LP allreduce
at most :data:`TARGET_BOUNDS` times the built-in at every p and message >= 16 MiB, decided on each
point's 95% interval (PASS when every point's interval lies at or below its bound, FAIL when one
lies wholly above, else INCONCLUSIVE), and LP broadcast at parity with the built-in (``--parity``:
its interval inside the A/A interval of the same run at every point; needs ``--aa`` rows).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecomm.collectives import builtin
from pipecomm.lab import claims
from pipecomm.lab.measure import autotune, bench, stats, sweep
from pipecomm.lab.networks import cluster, cost, launch, netem

ALGORITHMS = ("lp", "mst", "be", "ring", "torch", "auto")  # auto: only when asked for
AA = "torch-aa"  # the built-in timed a second time in every repeat (``--aa``)
CHECK = "check"  # the ranks' agreement check alone (``--check-cost``)
UNCHECKED = "unchecked:"  # an algorithm's call without that check (``--check-cost``)
OPS = ("broadcast", "allreduce", "reduce")
DEFAULT_SIZES = tuple(64 * 1024 * 4**i for i in range(6))  # 64 KiB .. 64 MiB
COLUMNS = (
    "algorithm",
    "op",
    "p",
    "nbytes",
    "time_s",
    "ci_lo_s",
    "ci_hi_s",
    "algbw_GBps",
    "busbw_GBps",
    "wrong",
    "ratio",
    "ratio_lo",
    "ratio_hi",
    "pratio",
    "pratio_lo",
    "pratio_hi",
    "repeats",
    "times_s",
    "block_bytes",
    "model_s",
    "cpu_s",
    "busy",
    "cpu_ratio",
    "cpu_ratio_lo",
    "cpu_ratio_hi",
    "cpu_times_s",
    "link_s",
    "chose",
)


def parse_size(text: str) -> int:
    """``"64K"``, ``"16M"``, ``"1G"`` or a plain number of bytes.

    Example::

        parse_size("16M")   # 16777216
    """
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = units.get(t[-1:], 1)
    value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    if value <= 0 or value % 4:
        raise argparse.ArgumentTypeError(f"size must be a positive multiple of 4 bytes: {text!r}")
    return value


# --------------------------------------------------------------------------- on the ranks

_GROUPS: dict[int, Any] = {}


def _group(p: int):
    """The subgroup of ranks ``0..p-1`` (``None``: the world); created once, on every rank."""
    if p not in _GROUPS:
        _GROUPS[p] = None if p == dist.get_world_size() else dist.new_group(list(range(p)))
    return _GROUPS[p]


def _lp_block(n: int, k: int) -> int:
    """Bytes per block when ``n`` bytes of float32 are cut into ``k`` LP blocks."""
    return -(-n // (4 * k)) * 4


def _wrong(alg: str, op: str, n: int, group: Any, p: int, block: int | None = None) -> int:
    """Elements of ``alg``'s result that differ from the built-in's on the same random input
    (summed over the ranks that hold a result); ``block``: LP's block bytes."""
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(n, generator=gen)
    ref = x.clone()
    sweep.collective_call(op, alg, x, group, block)()
    sweep.collective_call(op, "torch", ref, group)()
    holds = op == "allreduce" or rank == 0
    bad = 0
    if holds and op == "broadcast":
        bad = int((x != ref).sum())
    elif holds:  # sums of p float32 values: both within p ulps of the exact sum
        tol = 4 * p * torch.finfo(torch.float32).eps * (ref.abs() + 1)
        bad = int(((x - ref).abs() > tol).sum())
    count = torch.tensor([bad], dtype=torch.int64)
    dist.all_reduce(count, group=group)
    return int(count)


def rank_bench(cfg: dict) -> list[dict]:
    """On every rank of the pool: all points of one p (ranks >= p only wait). Rank 0 returns rows.

    Example::

        ranks.run(rank_bench, {"p": 4, "ops": ["allreduce"], "algorithms": ["lp", "torch"],
                               "sizes": [1 << 20], "repeats": 10, "warmup": 2})
    """
    p = cfg["p"]
    labels = [*cfg["algorithms"], *(f"lp/{k}" for k in cfg.get("lp_blocks", ())),
              *([AA] if cfg.get("aa") else []), *([CHECK] if cfg.get("check") else []),
              *(f"{UNCHECKED}{a}" for a in cfg["algorithms"] if cfg.get("check") and a != "torch"),
              *([sweep.TORCH_DETAIL] if cfg.get("check") and "torch" in cfg["algorithms"] else [])]

    def point(op: str, n: int, label: str) -> dict:
        alg = "torch" if label == AA else label if label.startswith(UNCHECKED) else label.split("/")[0]
        pt = {"op": op, "algorithm": alg, "label": label, "nbytes": n, "p": p,
              "warmup": cfg["warmup"], "iters": cfg["repeats"]}
        if "/" in label:
            pt["block_bytes"] = _lp_block(n, int(label.split("/")[1]))
        return pt

    points = [point(op, n, label) for op in cfg["ops"] for n in cfg["sizes"] for label in labels]
    timed = sweep.measure_points(points, interleave=True, cpu=True)  # round-robin, common starts
    group = _group(p)
    wrong = {}
    if dist.get_rank() < p:
        wrong = {_what(pt): _wrong(pt["algorithm"], pt["op"], pt["nbytes"] // 4, group, p,
                                   pt.get("block_bytes"))
                 for pt in points if pt["label"] not in (AA, CHECK, sweep.TORCH_DETAIL)
                 and not pt["label"].startswith(UNCHECKED)}  # no call of their own
    dist.barrier()
    if dist.get_rank() != 0:
        return []
    shaped = cfg.get("shaped")  # (bandwidth_Bps, ranks_per_node, links) of a virtual cluster
    link = cost.host_link() if netem.current() is None and not shaped else None  # read once
    for r, pt in zip(timed, points):  # rank 0's rows come in point order
        r["algorithm"] = pt["label"]
    return [_row(r, wrong.get(_what(pt), 0), timed, link, shaped)
            for r, pt in zip(timed, points)]


def _what(pt: dict) -> tuple:
    """The call a point times: op, bytes, algorithm and LP's block (``None``: the default)."""
    return pt["op"], pt["nbytes"], pt["algorithm"], pt.get("block_bytes")


def _row(r: dict, wrong: int, timed: list[dict], link: Any, shaped: tuple | None = None) -> dict:
    op, n, p, alg = r["op"], r["nbytes"], r["world_size"], r["algorithm"]
    times, cpus = stats.repeats(r["times_s"]), stats.repeats(r["cpu_times_s"])
    row = {
        "algorithm": alg,
        "op": op,
        "p": p,
        "nbytes": n,
        "time_s": r["time_s"],
        "ci_lo_s": r["ci_lo_s"],
        "ci_hi_s": r["ci_hi_s"],
        "algbw_GBps": bench.algbw(n, r["time_s"]) / 1e9,
        "busbw_GBps": bench.busbw(op, n, r["time_s"], p) / 1e9,
        "wrong": wrong,
        "repeats": r["repeats"],
        "times_s": r["times_s"],
        "block_bytes": "",
        "model_s": float("nan"),
        "ratio": float("nan"),
        "ratio_lo": float("nan"),
        "ratio_hi": float("nan"),
        "pratio": float("nan"),
        "pratio_lo": float("nan"),
        "pratio_hi": float("nan"),
        "cpu_s": statistics.median(cpus),
        "busy": statistics.median(bench.host_busy(c, t) for c, t in zip(cpus, times)),
        "cpu_ratio": float("nan"),
        "cpu_ratio_lo": float("nan"),
        "cpu_ratio_hi": float("nan"),
        "cpu_times_s": r["cpu_times_s"],
        # the single-port limit; a per-neighbor network has none of that form
        "link_s": bench.link_limit_s(op, n, p, *shaped[:2]) if shaped and shaped[2] == "bridge"
        else float("nan"),
        "chose": r.get("chose") or "",
    }
    base = [b for b in timed if b["algorithm"] == "torch" and b["op"] == op and b["nbytes"] == n]
    if base:
        base_times = stats.repeats(base[0]["times_s"])
        row["ratio"], row["ratio_lo"], row["ratio_hi"] = stats.ratio_ci(times, base_times)
        row["pratio"], row["pratio_lo"], row["pratio_hi"] = stats.paired_ratio_ci(
            times, base_times)
        row["cpu_ratio"], row["cpu_ratio_lo"], row["cpu_ratio_hi"] = stats.ratio_ci(
            cpus, stats.repeats(base[0]["cpu_times_s"]))
    if r["block_bytes"] is not None and link is not None:  # LP rows
        row["block_bytes"] = r["block_bytes"]
        row["model_s"] = cost.lp_time_on_host(op, n, p, link, r["block_bytes"])
    return row


# --------------------------------------------------------------------------- driver


def _fmt_size(n: int) -> str:
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def print_header() -> None:
    print(
        f"#{'alg':>6} {'op':>10} {'p':>2} {'size':>6} {'time(ms)':>9} {'95% interval':>17} "
        f"{'algbw':>7} {'busbw':>7} {'#wrong':>6} {'vs torch':>8} {'95% interval':>13}"
    )
    print(
        f"#{'':>6} {'':>10} {'':>2} {'(B)':>6} {'median':>9} {'(ms)':>17} "
        f"{'(GB/s)':>7} {'(GB/s)':>7} {'':>6} {'ratio':>8} {'':>13}"
    )


def print_row(r: dict) -> None:
    ratio = (
        f"{r['ratio']:8.2f} [{r['ratio_lo']:5.2f}, {r['ratio_hi']:5.2f}]"
        if r["ratio"] == r["ratio"]
        else f"{'n/a':>8}"
    )
    paired = (f"  paired {r['pratio']:.2f} [{r['pratio_lo']:.2f}, {r['pratio_hi']:.2f}]"
              if r["pratio"] == r["pratio"] else "")
    paired += f"  cpu {r['cpu_s'] * 1e3:.1f} ms (busy {r['busy']:.2f})" + (
        f" {r['cpu_ratio']:.2f} [{r['cpu_ratio_lo']:.2f}, {r['cpu_ratio_hi']:.2f}]"
        if r["cpu_ratio"] == r["cpu_ratio"] else "")
    if r["link_s"] == r["link_s"]:
        paired += f"  link limit {r['link_s'] * 1e3:.0f} ms ({r['time_s'] / r['link_s']:.2f}x)"
    print(
        f" {r['algorithm']:>6} {r['op']:>10} {r['p']:2d} {_fmt_size(r['nbytes']):>6} "
        f"{r['time_s'] * 1e3:9.2f} [{r['ci_lo_s'] * 1e3:7.2f}, {r['ci_hi_s'] * 1e3:7.2f}] "
        f"{r['algbw_GBps']:7.3f} {r['busbw_GBps']:7.3f} {r['wrong']:6d} {ratio}{paired}"
        + (
            f"  host model {r['model_s'] * 1e3:.1f} ms ({r['time_s'] / r['model_s'] - 1:+.0%}),"
            f" block {_fmt_size(int(r['block_bytes']))}"
            if r["model_s"] == r["model_s"]
            else ""
        ),
        flush=True,
    )


def _rows(csv_path: Path, min_bytes: int = 0) -> list[dict]:
    """The rows of a CSV this script wrote, messages of at least ``min_bytes``."""
    with csv_path.open(newline="") as f:
        return [r for r in csv.DictReader(f) if int(r["nbytes"]) >= min_bytes]


def _table(csv_path: Path, min_bytes: int, head: Any, text: Any, base_head: str,
           base_text: Any) -> str:
    """A markdown table of a CSV this script wrote, messages of at least ``min_bytes``: one row
    per op, p and size, one column per algorithm but the built-in (``head(alg)`` over
    ``text(row)``), the built-in's ``base_text(row)`` last."""
    rows = _rows(csv_path, min_bytes)
    if not rows:
        raise ValueError(f"{csv_path}: no rows of {_fmt_size(min_bytes)} or more")
    labels = sorted({r["algorithm"] for r in rows if r["algorithm"].startswith("lp/")},
                    key=lambda a: int(a.split("/")[1]))
    algs = [a for a in (*ALGORITHMS, *labels, AA)
            if a != "torch" and any(r["algorithm"] == a for r in rows)]
    cell = {(r["op"], int(r["p"]), int(r["nbytes"]), r["algorithm"]): r for r in rows}
    keys = sorted({k[:3] for k in cell}, key=lambda k: (k[1], OPS.index(k[0]), k[2]))
    out = ["| op | p | size | " + " | ".join(head(a) for a in algs) + f" | {base_head} |",
           "|---|---|---|" + "---|" * (len(algs) + 1)]
    for op, q, n in keys:
        parts = [text(r) if (r := cell.get((op, q, n, a))) is not None else "" for a in algs]
        base = cell.get((op, q, n, "torch"))
        parts.append("" if base is None else base_text(base))
        out.append(f"| {op} | {q} | {_fmt_size(n).replace('M', ' MiB')} | " + " | ".join(parts)
                   + " |")
    return "\n".join(out)


def _ci(r: dict, key: str) -> str:
    return f"{float(r[key]):.2f} [{float(r[key + '_lo']):.2f}, {float(r[key + '_hi']):.2f}]"


def summary(csv_path: Path, min_bytes: int = 16 << 20) -> str:
    """A markdown table of the ratios to the built-in in a CSV this script wrote, for messages
    of at least ``min_bytes`` (the sizes the loopback targets name): one row per op, p and size,
    one column per algorithm (median ratio and its 95% interval; ``torch-aa``: the built-in
    against itself, the A/A noise floor), the built-in's median last.

    Example::

        print(summary(Path("artifact/reference/bench/collectives_cpu.csv")))
    """
    return _table(csv_path, min_bytes, str, lambda r: _ci(r, "ratio"), "built-in (ms)",
                  lambda r: f"{float(r['time_s']) * 1e3:.1f}")


def cpu_summary(csv_path: Path, min_bytes: int = 16 << 20) -> str:
    """Where the time goes on a host with fewer cores than ranks: per op, p and size (messages of
    at least ``min_bytes``), each algorithm's wall-time ratio to the built-in next to its CPU
    ratio (core-seconds per call summed over the ranks, every thread, with its 95% interval),
    and how busy each kept the host's cores (:func:`pipecomm.lab.measure.bench.host_busy`). A wall ratio
    above the CPU ratio means the algorithm left cores idle that the built-in kept busy (waits
    on its critical path); one below it, that it spent more core-seconds on cores the built-in
    left idle.

    Example::

        print(cpu_summary(Path("artifact/reference/bench/targets60_seventh_cpu.csv")))
    """
    with csv_path.open(newline="") as f:
        if "cpu_ratio" not in (csv.DictReader(f).fieldnames or ()):
            raise ValueError(f"{csv_path}: no CPU columns (cpu_*; a CSV written before they "
                             "were added)")
    return _table(csv_path, min_bytes, lambda a: f"{a}: wall / cpu ratio (busy)",
                  lambda r: f"{float(r['ratio']):.2f} / {_ci(r, 'cpu_ratio')} "
                            f"({float(r['busy']):.2f})",
                  "built-in: cpu ms (busy)",
                  lambda r: f"{float(r['cpu_s']) * 1e3:.1f} ({float(r['busy']):.2f})")


def check_cost(csv_path: Path) -> str:
    """The markdown table of the agreement check's cost in a CSV of a ``--check-cost`` run: per
    p and size, the check's median time alone, and per algorithm what the check adds to its
    call (the call's median over the same call without the check, minus 1) and the check's
    time alone as a share of the call, with bootstrap 95% intervals over the repeats of the
    same run; where the CSV has ``torch:detail`` rows, also what torch's own check
    (``TORCH_DISTRIBUTED_DEBUG=DETAIL``) adds to the built-in's call.

    Example::

        print(check_cost(Path("artifact/reference/bench/check_cost_cpu.csv")))
    """
    rows = _rows(csv_path)
    checks = [r for r in rows if r["algorithm"] == CHECK]
    if not checks:
        raise ValueError(f"{csv_path} has no '{CHECK}' rows (run with --check-cost)")
    algs = [a for a in ALGORITHMS if a != "torch" and any(r["algorithm"] == a for r in rows)]
    detail = any(r["algorithm"] == sweep.TORCH_DETAIL for r in rows)
    cell = {(r["algorithm"], r["op"], r["p"], r["nbytes"]): r for r in rows}
    out = ["| p | size | check alone (ms) | "
           + " | ".join(f"{a}: added by the check | {a}: check alone / call" for a in algs)
           + (" | torch: added by its own check (DETAIL)" if detail else "") + " |",
           "|---|---|---|" + "---|---|" * len(algs) + ("---|" if detail else "")]

    def added(call: dict | None, bare: dict | None) -> str:
        if call is None or bare is None:
            return ""
        v, lo, hi = stats.ratio_ci(stats.repeats(call["times_s"]), stats.repeats(bare["times_s"]))
        return f"{v - 1:+.1%} [{lo - 1:+.1%}, {hi - 1:+.1%}]"

    for c in checks:
        cells = []
        key = (c["op"], c["p"], c["nbytes"])
        for a in algs:
            call = cell.get((a, *key))
            cells.append(added(call, cell.get((f"{UNCHECKED}{a}", *key))))
            if call is None:
                cells.append("")
                continue
            v, lo, hi = stats.ratio_ci(stats.repeats(c["times_s"]), stats.repeats(call["times_s"]))
            cells.append(f"{v:.1%} [{lo:.1%}, {hi:.1%}]")
        if detail:
            cells.append(added(cell.get((sweep.TORCH_DETAIL, *key)), cell.get(("torch", *key))))
        out.append(f"| {c['p']} | {_fmt_size(int(c['nbytes']))} {c['op']} | "
                   f"{float(c['time_s']) * 1e3:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(out)


#: Issue 13's loopback targets against the built-in (benchmark rows, not claims; ``--targets``):
#: per op and algorithm, the largest time / built-in time allowed at every p and message of at
#: least :data:`TARGET_MIN_BYTES`, decided on the ratio's 95% interval ...
TARGET_BOUNDS = {("allreduce", "ring"): 1.15, ("allreduce", "lp"): 1.3}
#: ... and the point at parity with the built-in: its ratio interval inside the A/A interval.
TARGET_PARITY = ("broadcast", "lp")
TARGET_MIN_BYTES = 16 << 20


def _parity(csv_path: Path, alg: str, op: str, min_bytes: int,
            key: str = "ratio") -> tuple[int, int, str]:
    """How many points of ``alg``'s ``op`` (messages of at least ``min_bytes``) have their
    ``key`` interval (``ratio``; ``pratio``: the paired one) inside the A/A rows' interval of
    the same run: ``(met, points, text per point)``."""
    rows = _rows(csv_path, min_bytes)
    aa = {(r["op"], r["p"], r["nbytes"]): r for r in rows if r["algorithm"] == AA}
    pts = [r for r in rows if r["algorithm"] == alg and r["op"] == op]
    if not pts or not aa:
        raise ValueError(f"{csv_path}: needs {alg} {op} rows and {AA} rows (--aa) of "
                         f"{_fmt_size(min_bytes)} or more")
    out, met = [], 0
    for r in pts:
        a = aa.get((r["op"], r["p"], r["nbytes"]))
        if a is None:
            raise ValueError(f"{csv_path}: no {AA} row for {op} p={r['p']} "
                             f"{_fmt_size(int(r['nbytes']))}")
        inside = (float(a[key + "_lo"]) <= float(r[key + "_lo"])
                  and float(r[key + "_hi"]) <= float(a[key + "_hi"]))
        met += inside
        out.append(f"p={r['p']} {_fmt_size(int(r['nbytes']))}: {_ci(r, key)} inside A/A "
                   f"{_ci(a, key)}: {'yes' if inside else 'no'}")
    return met, len(pts), "; ".join(out)


def parity(csv_path: Path, alg: str = "lp", op: str = "broadcast",
           min_bytes: int = 16 << 20) -> str:
    """Whether ``alg``'s ``op`` is at parity with the built-in in a loopback CSV with A/A rows
    (``--aa``): met at a point when its ratio's 95% interval lies inside the built-in-against-
    itself interval of the same run (the A/A noise); messages of at least ``min_bytes``.

    Example::

        print(parity(Path("artifact/reference/bench/targets60_seventh_cpu.csv")))
    """
    met, n, text = _parity(csv_path, alg, op, min_bytes)
    return (f"{alg} {op} at parity with the built-in (inside the A/A interval) at {met} of "
            f"{n} points: " + text)


def _bound_verdict(csv_path: Path, op: str, alg: str, bound: float, key: str) -> str:
    """One bound of :data:`TARGET_BOUNDS` on the ``key`` intervals (``ratio`` or ``pratio``) of
    a CSV: the verdict, the points at or below and wholly above, the worst point."""
    from pipecomm.lab import claims

    rows = [r for r in _rows(csv_path, TARGET_MIN_BYTES) if r["algorithm"] == alg
            and r["op"] == op and r.get(key, "") not in ("", None)
            and float(r[key]) == float(r[key])]  # a number: the row had a built-in to compare
    if not rows:
        raise ValueError(f"{csv_path}: no {alg} {op} rows with a {key} to the built-in of "
                         f"{_fmt_size(TARGET_MIN_BYTES)} or more")
    verdicts = [claims.at_most(float(r[key + "_lo"]), float(r[key + "_hi"]), bound)
                for r in rows]
    w = max(rows, key=lambda r: float(r[key]))
    return (f"{claims.combine(verdicts)}: {verdicts.count(claims.PASS)} of {len(rows)} points "
            f"at or below, {verdicts.count(claims.FAIL)} wholly above; worst {_ci(w, key)} "
            f"(p={w['p']}, {_fmt_size(int(w['nbytes']))})")


def targets(csv_path: Path) -> str:
    """Issue 13's loopback targets on a CSV this script wrote (benchmark rows, not claims), from
    its own ratio columns: every bound of :data:`TARGET_BOUNDS` at every p and message of at
    least :data:`TARGET_MIN_BYTES` (PASS when every point's 95% interval lies at or below it,
    FAIL when one lies wholly above, else INCONCLUSIVE), then :data:`TARGET_PARITY` by
    :func:`parity` (met when every point is inside the A/A interval; not decided without
    ``torch-aa`` rows).

    Example::

        print(targets(Path("artifact/reference/bench/targets60_seventh_cpu.csv")))
    """
    out = [f"{alg} {op} <= {bound:g}x the built-in (every p, messages >= "
           f"{_fmt_size(TARGET_MIN_BYTES)}, 95% interval): "
           + _bound_verdict(csv_path, op, alg, bound, "ratio")
           for (op, alg), bound in TARGET_BOUNDS.items()]
    op, alg = TARGET_PARITY
    head = f"{alg} {op} at parity with the built-in (inside the A/A interval, every p, " \
           f"messages >= {_fmt_size(TARGET_MIN_BYTES)}): "
    if not any(r["algorithm"] == AA for r in _rows(csv_path, TARGET_MIN_BYTES)):
        return "\n".join([*out, head + f"not decided: no {AA} rows (run with --aa)"])
    met, n, text = _parity(csv_path, alg, op, TARGET_MIN_BYTES)
    return "\n".join([*out, head + f"{'MET' if met == n else 'NOT MET'} at {met} of {n} "
                       f"points: {text}"])


def paired_targets(csv_path: Path) -> str:
    """A secondary reading of :func:`targets` on the paired ratios (CSV columns ``pratio*``):
    the same bounds and rule, and parity against the A/A rows' paired intervals, applied to the
    median of the per-round ratios. First the method's own check on the ``torch-aa`` rows: it
    passes when no more of their paired intervals exclude 1 than
    :func:`pipecomm.lab.measure.stats.misses_allowed` allows; when it fails, the paired verdicts are
    printed as not usable. The targets themselves are decided by :func:`targets`.

    Example::

        print(paired_targets(Path("artifact/reference/bench/targets60_seventh_cpu.csv")))
    """
    import pandas as pd

    df = pd.read_csv(csv_path)
    if "pratio" not in df.columns:
        raise ValueError(f"{csv_path}: no paired ratios (columns pratio*; a CSV written before "
                         "they were added)")
    aa = df[(df.algorithm == AA) & (df.nbytes >= TARGET_MIN_BYTES)]  # the targets' A/A rows
    if aa.empty:
        raise ValueError(f"{csv_path}: no {AA} rows of {_fmt_size(TARGET_MIN_BYTES)} or more "
                         "(run with --aa)")
    misses = aa[(aa.pratio_lo > 1) | (aa.pratio_hi < 1)]
    allowed = stats.misses_allowed(len(aa))
    usable = len(misses) <= allowed
    where = ", ".join(f"{r.op} p={r.p} {_fmt_size(int(r.nbytes))} [{r.pratio_lo:.3f}, "
                      f"{r.pratio_hi:.3f}]" for r in misses.itertuples())
    out = [f"paired A/A check {'PASS' if usable else 'FAIL'}: {len(misses)} of {len(aa)} "
           f"intervals exclude 1 (at most {allowed} allowed){': ' + where if where else ''}"]
    for (op, alg), bound in TARGET_BOUNDS.items():
        text = _bound_verdict(csv_path, op, alg, bound, "pratio")
        out.append(f"{alg} {op} <= {bound:g}x paired "
                   + (text if usable else "not usable: " + text.split(": ", 1)[1]))
    op, alg = TARGET_PARITY
    met, n, text = _parity(csv_path, alg, op, TARGET_MIN_BYTES, key="pratio")
    verdict = ("MET" if met == n else "NOT MET") if usable else "not usable:"
    out.append(f"{alg} {op} at parity paired {verdict} at {met} of {n} points: {text}")
    return "\n".join(out)


#: auto's goals (``--auto-goals``): over loopback at most the built-in's A/A interval's upper
#: bound at every point; on a shaped network broadcast within this factor of LP, allreduce and
#: reduce within it of the faster of pipecomm's best algorithm and the built-in.
AUTO_FACTOR = 1.05


def auto_goals(csv_path: Path) -> str:
    """auto's goals on a CSV with ``auto`` rows, point by point: over loopback (rows without a
    link limit) auto's ratio to the built-in against the A/A rows' interval (met at or below its
    upper bound); on a shaped network (``link_s`` set) auto's median over LP's (broadcast) or
    over the fastest median of the other algorithms timed (allreduce, reduce), met at or below
    :data:`AUTO_FACTOR`, with the ratio's bootstrap 95% interval.

    Example::

        print(auto_goals(Path("auto_loopback.csv")))
    """
    rows = _rows(csv_path)
    cell = {(r["op"], r["p"], r["nbytes"], r["algorithm"]): r for r in rows}
    autos = [r for r in rows if r["algorithm"] == "auto"]
    if not autos:
        raise ValueError(f"{csv_path}: no auto rows (run with --algorithms ... auto)")
    out, met = [], 0
    for r in autos:
        key = (r["op"], r["p"], r["nbytes"])
        where = f"{r['op']} p={r['p']} {_fmt_size(int(r['nbytes']))}"
        if float(r["link_s"] or "nan") != float(r["link_s"] or "nan"):  # loopback
            aa = cell.get((*key, AA))
            if aa is None:
                raise ValueError(f"{csv_path}: no {AA} row for {where} (run with --aa)")
            ok = float(r["ratio"]) <= float(aa["ratio_hi"])
            out.append(f"{where}: auto ({r.get('chose') or '?'})/built-in {_ci(r, 'ratio')}, "
                       f"A/A {_ci(aa, 'ratio')}: {'met' if ok else 'NOT met'}")
        else:
            others = [cell[(*key, a)] for a in ALGORITHMS[:-1] if (*key, a) in cell]
            ref = cell.get((*key, "lp")) if r["op"] == "broadcast" else min(
                others, key=lambda x: float(x["time_s"]), default=None)
            if ref is None:
                raise ValueError(f"{csv_path}: nothing to compare auto with at {where}")
            v, lo, hi = stats.ratio_ci(stats.repeats(r["times_s"]), stats.repeats(ref["times_s"]))
            ok = v <= AUTO_FACTOR
            out.append(f"{where}: auto ({r.get('chose') or '?'})/{ref['algorithm']} {v:.2f} "
                       f"[{lo:.2f}, {hi:.2f}]: {'met' if ok else 'NOT met'}")
        met += ok
    allowed = stats.misses_allowed(len(autos), level=claims.FAMILY_ERROR)
    verdict = "PASS" if len(autos) - met <= allowed else "FAIL"
    return (f"auto's goals met at {met} of {len(autos)} points ({verdict}: at most {allowed} may "
            "miss, the binomial allowance fixed before the run)\n" + "\n".join(out))


def parse_rate(text: str) -> float:
    """``"15M"`` (bytes per second, K/M/G = 1e3/1e6/1e9) or a plain number.

    Example::

        parse_rate("15M")   # 15000000.0
    """
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    t = text.strip().upper().removesuffix("B/S")
    try:
        value = float(t[:-1]) * units[t[-1]] if t[-1:] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a rate in bytes/s such as 15M, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"the rate must be positive, got {text!r}")
    return value


@contextlib.contextmanager
def _cluster_ranks(net: Any) -> Iterator[Any]:
    """The ranks of one job on the virtual cluster ``net``, built and removed around it."""
    with net, net.job() as job:
        yield job


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS[:-1]), choices=ALGORITHMS)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--p", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=list(DEFAULT_SIZES),
        help="message sizes, e.g. 64K 1M 16M (default 64K..64M, factor 4)",
    )
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--csv", type=Path, default=None, help="also write the rows as CSV here")
    ap.add_argument("--aa", action="store_true",
                    help="also time the built-in a second time per repeat (rows torch-aa): "
                         "the A/A ratio interval, this run's noise floor")
    ap.add_argument("--lp-blocks", nargs="+", type=int, default=[], metavar="K",
                    help="also time LP cut into K blocks (rows lp/K) beside its default block")
    ap.add_argument("--check-cost", action="store_true",
                    help="also time the ranks' agreement check alone (rows check) and print "
                         "its share of each algorithm's call")
    ap.add_argument("--check-summary", type=Path, default=None, metavar="CSV",
                    help="print the check-cost table of a CSV with check rows and exit")
    ap.add_argument("--cluster", type=parse_rate, default=None, metavar="RATE",
                    help="run on a virtual cluster (root: network namespaces, tc tbf) whose "
                         "node links move RATE bytes/s each way, e.g. 15M")
    ap.add_argument("--ranks-per-node", type=int, default=1,
                    help="with --cluster: ranks sharing a node's link (two-level; default 1)")
    ap.add_argument("--links", choices=cluster.LINKS, default="bridge",
                    help="with --cluster: one link per node to a bridge (single-port, default) "
                         "or one shaped link per pair of nodes (per-neighbor)")
    ap.add_argument("--parity", type=Path, default=None, metavar="CSV",
                    help="LP broadcast at parity with the built-in (its interval inside the "
                         "A/A interval) on a loopback CSV with torch-aa rows, and exit")
    ap.add_argument("--tune-file", type=Path, default=None, metavar="JSON",
                    help="the table algorithm='auto' reads (PIPECOMM_TUNE_FILE of the ranks)")
    ap.add_argument("--tune", action="store_true",
                    help="first measure the table (pipecomm.lab.measure.autotune) on the same ranks, "
                         "for the run's ops, p and sizes, into --tune-file (default: a "
                         "temporary file)")
    ap.add_argument("--tune-repeats", type=int, default=7, help="with --tune (default 7)")
    ap.add_argument("--auto-goals", type=Path, default=None, metavar="CSV",
                    help="decide auto's goals against the built-in and pipecomm's best on a CSV "
                         "with auto rows, and exit")
    ap.add_argument("--quick", action="store_true", help="p 2, 64K and 1M, 3 repeats")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="limit per p")
    ap.add_argument("--summary", type=Path, default=None, metavar="CSV",
                    help="print the markdown table of ratios of a CSV and exit")
    ap.add_argument("--cpu-summary", type=Path, default=None, metavar="CSV",
                    help="print the markdown table of wall and CPU ratios of a CSV and exit")
    ap.add_argument("--min-size", type=parse_size, default=16 << 20,
                    help="smallest message in the --summary / --cpu-summary table (default 16M)")
    ap.add_argument("--targets", type=Path, default=None, metavar="CSV",
                    help="decide pipecomm's loopback targets against the built-in (ring / LP "
                         "allreduce bounds, LP broadcast parity) on a CSV and exit")
    ap.add_argument("--paired", action="store_true",
                    help="with --targets: also the secondary reading on the paired ratios, "
                         "after the paired A/A check (needs the CSV's torch-aa rows)")
    args = ap.parse_args(argv)
    if args.paired and args.targets is None:
        ap.error("--paired goes with --targets CSV")
    if args.targets is not None:
        try:
            print(targets(args.targets))
            if args.paired:
                print(paired_targets(args.targets))
        except (OSError, ValueError, KeyError) as exc:
            ap.error(f"--targets: {exc}")
        return 0
    for flag, path, table in (("--summary", args.summary,
                               lambda c: summary(c, args.min_size)),
                              ("--cpu-summary", args.cpu_summary,
                               lambda c: cpu_summary(c, args.min_size)),
                              ("--check-summary", args.check_summary, check_cost),
                              ("--parity", args.parity, parity),
                              ("--auto-goals", args.auto_goals, auto_goals)):
        if path is not None:
            try:
                print(table(path))
            except (OSError, ValueError, KeyError) as exc:
                ap.error(f"{flag}: {exc}")
            return 0
    if args.quick:
        args.p, args.sizes, args.repeats, args.warmup = [2], [64 << 10, 1 << 20], 3, 1
    if any(q < 2 for q in args.p) or args.repeats < 1 or args.warmup < 0:
        ap.error("--p values must be >= 2, --repeats >= 1, --warmup >= 0")
    if any(k < 1 for k in args.lp_blocks):
        ap.error("--lp-blocks: block counts must be >= 1")
    if args.aa and "torch" not in args.algorithms:
        ap.error("--aa compares the built-in with itself: include torch in --algorithms")
    rpn = args.ranks_per_node
    if rpn < 1 or (args.cluster is None and rpn != 1):
        ap.error("--ranks-per-node must be >= 1 and goes with --cluster")
    if args.links != "bridge" and args.cluster is None:
        ap.error("--links goes with --cluster")
    if args.cluster is not None:
        if any(q % rpn for q in args.p) or max(args.p) // rpn < 2:
            ap.error(f"--p values must be multiples of --ranks-per-node {rpn}, on >= 2 nodes")
        ok, why = cluster.available()
        if not ok:
            ap.error(f"--cluster: {why}")
    if args.tune and args.tune_file is None:
        args.tune_file = Path(tempfile.mkdtemp(prefix="pipecomm-tune-")) / "tune.json"
    if args.tune_file is not None:  # before the ranks start: they inherit it
        os.environ[builtin.ENV_TUNE_FILE] = str(args.tune_file.resolve())
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # the ranks import this module by name
        sys.path.insert(0, here)
    import bench_collectives as me

    rows: list[dict] = []
    if args.cluster is not None:
        net = cluster.VirtualCluster(max(args.p) // rpn, rpn, args.cluster, links=args.links)
        print(f"# {net.describe()}; each p runs on the ranks 0..p-1", flush=True)
        pool = _cluster_ranks(net)
    else:
        print("# gloo over loopback, local ranks on this host", flush=True)
        pool = launch.Ranks(max(args.p))
    print_header()
    with pool as ranks:
        if args.tune:
            cfg = {"ops": args.ops, "p": sorted(set(args.p)), "sizes": args.sizes,
                   "algorithms": ALGORITHMS[:-1], "repeats": args.tune_repeats,
                   "warmup": min(1, args.warmup), "link": None, "out": str(args.tune_file)}
            tuned = ranks.run(autotune.rank_tune, cfg, timeout_s=args.timeout_s)[0]
            print(f"# tuned in {tuned['doc']['seconds']} s: {tuned['path']}; fastest: "
                  + ", ".join(f"{op} p={q} {_fmt_size(n)} {best}"
                              for op, q, n, best, _ in tuned["choices"]), flush=True)
        for q in sorted(set(args.p)):
            cfg = {
                "p": q,
                "ops": args.ops,
                "algorithms": args.algorithms,
                "sizes": args.sizes,
                "repeats": args.repeats,
                "warmup": args.warmup,
                "aa": args.aa,
                "lp_blocks": args.lp_blocks,
                "check": args.check_cost,
                "shaped": None if args.cluster is None else (args.cluster, rpn, args.links),
            }
            out = ranks.run(me.rank_bench, cfg, timeout_s=args.timeout_s)[0]
            for r in out:
                print_row(r)
            rows += out
    if args.csv is not None:
        args.csv.parent.mkdir(parents=True, exist_ok=True)
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(rows)
        print(f"# wrote {len(rows)} rows to {args.csv}")
        if args.check_cost:
            print(check_cost(args.csv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
