"""``python -m pipecomm.lab.measure.autotune``: which algorithm is fastest here, for ``algorithm="auto"``.

Times every algorithm (``lp``, ``mst``, ``be``, ``ring`` and ``torch``, the backend's built-in) on
the ranks of one pool -- local gloo ranks over loopback, or with ``--cluster RATE`` the shaped
virtual cluster (:class:`pipecomm.lab.networks.cluster.VirtualCluster`, root) -- for each op, group size p
and message size, interleaved round by round (:func:`pipecomm.lab.measure.sweep.measure_points`, common
starts), and writes the medians as the table that :func:`pipecomm.collectives.builtin.choose`
reads: a small JSON file at :func:`pipecomm.collectives.builtin.tune_path` (``PIPECOMM_TUNE_FILE``,
else ``~/.cache/pipecomm/tune-<fingerprint>.json``; the fingerprint of the network, as rank 0
computes it), written atomically (a temporary file renamed over it) and read back before the
command reports success.

The default points (3 ops x p 2, 4, 8 x 4 KiB, 64 KiB, 1 MiB, 16 MiB x 5 algorithms, 7 repeats
after 1 warm-up) took 38 s over loopback (8 ranks on a busy 2-core host); LP's blocks are
planned on :data:`pipecomm.collectives.lp.DEFAULT_LINK` (what a script that never calls
``set_link`` uses; ``--link ALPHA_S BANDWIDTH_BPS`` for another: auto uses LP's times only on
that link).

Usage::

    python -m pipecomm.lab.measure.autotune                          # loopback, the defaults
    python -m pipecomm.lab.measure.autotune --p 2 4 --sizes 1M 16M 64M --repeats 7 --out tune.json
    python -m pipecomm.lab.measure.autotune --cluster 15M --p 8 --sizes 1M 16M --repeats 3   # root
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pipecomm import collectives
from pipecomm.collectives import builtin, lp
from pipecomm.lab.measure import sweep
from pipecomm.lab.networks import cluster, launch

OPS = ("allreduce", "broadcast", "reduce")
DEFAULT_P = (2, 4, 8)
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)


def points_of(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """The sweep points of a tuning: every op, p, size and algorithm of ``cfg``.

    Example::

        >>> len(points_of({"ops": ["allreduce"], "p": [2, 4], "sizes": [4096],
        ...                "algorithms": ["lp", "torch"], "repeats": 3, "warmup": 1}))
        4
    """
    return [{"op": op, "algorithm": alg, "nbytes": n, "p": q, "warmup": cfg["warmup"],
             "iters": cfg["repeats"]}
            for q in cfg["p"] for op in cfg["ops"] for n in cfg["sizes"]
            for alg in cfg["algorithms"]]


def table_of(rows: list[dict[str, Any]], fingerprint: str, link: tuple[float, float],
             device: str = "cpu", **about: Any) -> dict[str, Any]:
    """The table document of measured ``rows`` (``op``, ``world_size``, ``nbytes``,
    ``algorithm``, ``time_s``; float32): its points, the network's ``fingerprint``, LP's
    ``link`` and their digest, plus ``about`` (how it was measured).

    Example::

        >>> doc = table_of([{"op": "allreduce", "world_size": 2, "nbytes": 4096,
        ...                  "algorithm": "ring", "time_s": 1e-4}], "f" * 16, (1e-4, 1e9))
        >>> doc["points"]
        {'allreduce:cpu:2:float32': {'4096': {'ring': 0.0001}}}
    """
    points: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        key = f"{r['op']}:{device}:{r['world_size']}:float32"
        points.setdefault(key, {}).setdefault(str(r["nbytes"]), {})[r["algorithm"]] = float(
            r["time_s"])
    return {"format": builtin.TUNE_FORMAT, "fingerprint": fingerprint, "link": list(link),
            "points": points, "digest": builtin.tune_digest(points), **about}


def write_table(doc: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``doc`` to ``path`` atomically (a temporary file beside it, renamed over it), so a
    reader sees the old table or the new one, never half of one.

    Example::

        write_table(table_of(rows, builtin.fingerprint(), lp.link()), builtin.tune_path())
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def rank_tune(cfg: dict[str, Any]) -> dict[str, Any] | None:
    """On every rank of a pool of ``max(cfg["p"])`` ranks: time the points of ``cfg``
    (:func:`points_of`) with LP planned on ``cfg["link"]`` (``None``: the rank's link), then
    :func:`rank_write` the table.

    Example::

        ranks.run(rank_tune, {"ops": ["allreduce"], "p": [2], "sizes": [1 << 20],
                              "algorithms": ["lp", "ring", "torch"], "repeats": 3,
                              "warmup": 1, "link": None, "out": "tune.json"})
    """
    if cfg.get("link") is not None:
        lp.set_link(*cfg["link"])
    start = time.monotonic()
    rows = sweep.measure_points(points_of(cfg), interleave=True)
    return rank_write(rows, cfg, time.monotonic() - start)


def rank_write(rows: list[dict[str, Any]], cfg: dict[str, Any],
               seconds: float) -> dict[str, Any] | None:
    """On every rank, once the points of ``cfg`` took ``seconds`` and rank 0 holds their
    ``rows``: rank 0 writes the table to ``cfg["out"]`` (``None``: its
    :func:`~pipecomm.collectives.builtin.tune_path`), reads it back and returns where and what;
    the other ranks return ``None``, after a barrier, so that no rank reads it before it exists.

    Example::

        rows = ranks.run(sweep.measure_points, points_of(cfg), None, True)[0]   # one job
        ranks.run(rank_write, rows, cfg, 60.0)                                   # the next
    """
    if cfg.get("link") is not None:
        lp.set_link(*cfg["link"])
    out = None
    if dist.get_rank() == 0:
        path = cfg.get("out") or builtin.tune_path()
        if path is None:
            raise ValueError(f"{builtin.ENV_TUNE_FILE}=off: nowhere to write the table; pass "
                             f"--out")
        about = {"created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                 "host": socket.gethostname(), "repeats": cfg["repeats"],
                 "seconds": round(seconds, 1)}
        doc = table_of(rows, builtin.fingerprint(), lp.link(), **about)
        write_table(doc, path)
        if builtin.read_table(path) is None:
            raise RuntimeError(f"the table written to {path} does not read back")
        out = {"path": str(path), "doc": doc, "choices": choices(doc)}
    dist.barrier()
    return out


def choices(doc: dict[str, Any]) -> list[tuple[str, int, int, str, float]]:
    """Per point of a table document: ``(op, p, nbytes, auto's pick, its time over the
    built-in's)`` (:func:`pipecomm.collectives.builtin.choose`'s rule, every algorithm allowed).

    Example::

        >>> doc = {"points": {"broadcast:cpu:8:float32": {"16777216": {"lp": 1.0, "torch": 4.0}}}}
        >>> choices(doc)
        [('broadcast', 8, 16777216, 'lp', 0.25)]
    """
    out = []
    for key, sizes in sorted(doc["points"].items()):
        op, _, p, _ = key.split(":")
        for n, times in sorted(sizes.items(), key=lambda kv: int(kv[0])):
            best = min(times, key=lambda a: (times[a] * (builtin.TABLE_MARGIN if a == "torch"
                                                         else 1), a != "torch"))
            base = times.get("torch", float("nan"))
            out.append((op, int(p), int(n), best, times[best] / base))
    return out


def _amount(text: str, units: dict[str, float]) -> float:
    t = text.strip().upper().removesuffix("B/S").removesuffix("IB").removesuffix("B")
    try:
        value = float(t[:-1]) * units[t[-1]] if t[-1:] in units else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 16M, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
    return value


def _size(text: str) -> int:
    """``"64K"``, ``"16M"`` (K/M/G = 2^10/2^20/2^30 bytes), a whole number of float32s."""
    n = int(_amount(text, {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}))
    if n % 4:
        raise argparse.ArgumentTypeError(f"a size must be a multiple of 4 bytes, got {text!r}")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipecomm.lab.measure.autotune",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    ap.add_argument("--p", nargs="+", type=int, default=list(DEFAULT_P),
                    help="group sizes (ranks 0..p-1 of one pool of max(p) ranks)")
    ap.add_argument("--sizes", nargs="+", type=_size, default=list(DEFAULT_SIZES),
                    help="message sizes, e.g. 4K 1M 16M")
    ap.add_argument("--algorithms", nargs="+", default=list(collectives.ALGORITHMS),
                    choices=collectives.ALGORITHMS)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--link", nargs=2, type=float, default=list(lp.DEFAULT_LINK),
                    metavar=("ALPHA_S", "BANDWIDTH_BPS"),
                    help="the LP link to plan LP's blocks on (default: lp.DEFAULT_LINK)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"the table file (default: ${builtin.ENV_TUNE_FILE}, else "
                         "~/.cache/pipecomm/tune-<fingerprint>.json)")
    ap.add_argument("--cluster", type=lambda t: _amount(t, {"K": 1e3, "M": 1e6, "G": 1e9}),
                    default=None, metavar="RATE",
                    help="measure on the shaped virtual cluster (root), RATE bytes/s per node")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    args = ap.parse_args(argv)
    if any(q < 2 for q in args.p) or args.repeats < 1 or args.warmup < 0:
        ap.error("--p values must be >= 2, --repeats >= 1, --warmup >= 0")
    cfg = {"ops": args.ops, "p": sorted(set(args.p)), "sizes": sorted(set(args.sizes)),
           "algorithms": args.algorithms, "repeats": args.repeats, "warmup": args.warmup,
           "link": tuple(args.link), "out": None if args.out is None else str(args.out)}
    if args.cluster is not None:
        ok, why = cluster.available()
        if not ok:
            ap.error(f"--cluster: {why}")
        net = cluster.VirtualCluster(max(args.p), 1, args.cluster)
        with net, net.job() as job:
            out = job.run(rank_tune, cfg, timeout_s=args.timeout_s)[0]
    else:
        with launch.Ranks(max(args.p)) as ranks:
            out = ranks.run(rank_tune, cfg, timeout_s=args.timeout_s)[0]
    print(f"# wrote {out['path']} (fingerprint {out['doc']['fingerprint']}, "
          f"{out['doc']['seconds']} s)")
    print(f"#{'op':>9} {'p':>2} {'bytes':>9} {'fastest':>7} {'vs torch':>8}")
    for op, q, n, best, ratio in out["choices"]:
        print(f" {op:>9} {q:2d} {n:9d} {best:>7} {ratio:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
