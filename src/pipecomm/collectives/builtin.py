"""``algorithm="torch"``: the backend's own collectives (gloo, NCCL); and ``algorithm="auto"``.

No paper equation for the built-in; it is the "built-in" line of the LP paper's comparisons and
the oracle of the tests. ``op="avg"`` is a sum, then a division by p (gloo has no AVG) by every
rank (allreduce) or by ``dst`` (reduce). ``auto`` (:func:`choose`) picks per call from a measured
table (``python -m pipecomm.lab.measure.autotune``), else the model on a set link, else the built-in.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import socket
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pipecomm import vocab
from pipecomm.collectives import lp, p2p

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
               "min": dist.ReduceOp.MIN}
#: ``ISSUING.on``: this thread is in :func:`start`'s ``torch.distributed`` call (a pipecomm
#: process group then runs it on its inner backend).
ISSUING = threading.local()


def start(kind: str, tensor: torch.Tensor, group: dist.ProcessGroup | None, op: str,
          root: int | None, async_op: bool) -> tuple[object | None, Callable[[int, bool], None]]:
    """Issue ``dist.all_reduce`` / ``broadcast`` / ``reduce`` on a contiguous ``tensor``.

    ``root`` is a global rank. Returns the backend's work (``None`` when synchronous) and the
    finishing step ``finish(p, is_root)`` (the ``avg`` division) to run once it has completed.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> flat = torch.full((4,), 2.0)
        >>> work, finish = start("allreduce", flat, None, "avg", None, async_op=False)
        >>> finish(dist.get_world_size(), False)
        >>> flat
        tensor([2., 2., 2., 2.])
        >>> dist.destroy_process_group()
    """
    ISSUING.on = True
    try:
        if kind == "allreduce":
            work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)
        elif kind == "broadcast":
            work = dist.broadcast(tensor, src=root, group=group, async_op=async_op)
        else:
            work = dist.reduce(tensor, dst=root, op=_REDUCE_OPS[op], group=group,
                               async_op=async_op)
    finally:
        ISSUING.on = False

    def finish(p: int, is_root: bool) -> None:
        if op == "avg" and (kind == "allreduce" or is_root):
            tensor.div_(p)

    return work, finish


# --------------------------------------------------------------------------- algorithm="auto"

ENV_TUNE_FILE, TUNE_FORMAT = "PIPECOMM_TUNE_FILE", "pipecomm-tune/1"
#: Variables, alike on every rank, that tell one network from another (:func:`fingerprint`).
NETWORK_ENV = ("PIPECOMM_NETWORK", "PIPECOMM_CLUSTER")
#: What the built-in runs, as the model prices it (gloo: a ring, a binomial tree, a chain) ...
BUILTIN_AS = {"allreduce": "ring", "broadcast": "mst", "reduce": "lp"}
MODEL_MARGIN = 0.8  # ... kept unless another is below this share of it (measured: TABLE_)
TABLE_MARGIN = 0.95
_LOG, _LOGGED = logging.getLogger("pipecomm"), set()


def fingerprint() -> str:
    """The network of this process, alike on every rank (16 hex digits): the host when all
    ranks are on one (``MASTER_ADDR`` loopback or ``LOCAL_WORLD_SIZE == WORLD_SIZE``), else the
    rendezvous address and socket interfaces; :data:`NETWORK_ENV` (these variables read once
    per process); an emulated network.

    Example::

        >>> len(fingerprint())
        16
    """
    return _digest(_network(), p2p.delaying())


@functools.lru_cache(maxsize=1)
def _network() -> tuple[str | None, ...]:
    env, master = os.environ, os.environ.get("MASTER_ADDR", "")
    if master in ("", "localhost", "::1") or master.startswith("127.") or env.get(
            "LOCAL_WORLD_SIZE", "") == env.get("WORLD_SIZE"):
        return socket.gethostname(), *map(env.get, NETWORK_ENV)
    return master, *map(env.get, ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", *NETWORK_ENV))


_digest = functools.lru_cache(maxsize=8)(
    lambda net, emulated: tune_digest([*net, emulated and emulated.describe()]))


def tune_digest(points: object) -> str:
    """16 hex digits of ``points`` as JSON: what a table file keeps of its points."""
    text = json.dumps(points, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tune_path(env: str | None = None, fp: str | None = None) -> Path | None:
    """Where auto reads its table: ``env`` (``None``: ``$PIPECOMM_TUNE_FILE``; ``off``:
    nowhere), else ``~/.cache/pipecomm/tune-<fp>.json`` (``fp`` ``None``: :func:`fingerprint`;
    ``$XDG_CACHE_HOME`` for ``~/.cache``).

    Example::

        >>> tune_path("", "0" * 16).name
        'tune-0000000000000000.json'
    """
    if env := os.environ.get(ENV_TUNE_FILE, "") if env is None else env:
        return None if env.lower() == "off" else Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache, "pipecomm", f"tune-{fp or fingerprint()}.json")


def tune_table() -> dict | None:
    """:func:`read_table` of :func:`tune_path`, as this process first found it (a later file
    waits for the next process: ranks started together choose alike)."""
    return _first_look(os.environ.get(ENV_TUNE_FILE, ""), fingerprint())


_first_look = functools.lru_cache(maxsize=8)(
    lambda env, fp: None if (path := tune_path(env, fp)) is None else read_table(path, fp))


def read_table(path: str | os.PathLike, fp: str | None = None) -> dict | None:
    """The table file at ``path``, verified for the network ``fp`` (``None``: this one):
    ``{"rows": {"op:device:p:dtype": [(nbytes, {algorithm: seconds})]}, "link", "digest"}``;
    ``None`` without a file, or with one warning when it is unreadable, of another format or
    network, damaged (its digest) or holds an unknown algorithm or a time <= 0.

    Example::

        >>> read_table("/nonexistent/tune.json") is None
        True
    """
    try:
        doc = json.loads(Path(path).read_text())
        rows = {key: sorted((int(n), {a: float(s) for a, s in times.items()})
                            for n, times in sizes.items()) for key, sizes in doc["points"].items()}
        link, fp = tuple(float(x) for x in doc["link"]), fp or fingerprint()
        why = next((w for bad, w in (
            (doc.get("format") != TUNE_FORMAT, f"of format {doc.get('format')!r}"),
            (doc.get("fingerprint") != fp, f"of network {doc.get('fingerprint')}, not {fp}"),
            (doc.get("digest") != tune_digest(doc["points"]), "damaged (digest)"),
            (any(a not in vocab.ALGORITHMS or not s > 0 for r in rows.values() for _, ts in r
                 for a, s in ts.items()), "an unknown algorithm or a time <= 0")) if bad), None)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        why = f"unreadable ({type(exc).__name__}: {exc})"
    if why:
        warnings.warn(f"pipecomm: ignoring the tuning table {path}: {why}; algorithm='auto' "
                      "uses the cost model or the built-in", RuntimeWarning, stacklevel=2)
        return None
    return {"rows": rows, "link": link, "digest": doc["digest"]}


def model_s(kind: str, algorithm: str, nbytes: int, p: int) -> float:
    """Seconds of ``algorithm``'s ``kind`` of ``nbytes`` over ``p`` ranks on
    :func:`pipecomm.collectives.lp.link`: docs/algorithms.md's lock-step alpha-beta model,
    single port, gamma 0.

    Example::

        >>> round(model_s("broadcast", "mst", 1 << 20, 8), 6)     # 3 rounds on DEFAULT_LINK
        0.001738
    """
    (a, bw), logp, ar = lp.link(), (p - 1).bit_length(), kind == "allreduce"
    n = nbytes / bw
    if nbytes == 0 or p < 2:
        return 0.0
    if algorithm == "lp":
        b = min(nbytes, lp.default_block_bytes(kind, nbytes, p))
        k, m = math.ceil(nbytes / b), (2 * p - 3 if ar else p - 2)
        # allreduce: in k - 1 steps a rank's one port carries both directions
        both = (nbytes - b if k > 3 else 2 * (nbytes - 2 * b) if k == 3 else 0) * (ar and p > 2)
        return (k + m) * a + (nbytes + m * b + both) / bw
    if algorithm == "mst":
        return logp * (1 + ar) * (a + n)
    if algorithm == "be":
        q = 1 << (p.bit_length() - 1)
        return 2 * (q.bit_length() - 1) * a + 2 * (q - 1) / q * n + (p > q) * (1 + ar) * (a + n)
    if ar:  # ring
        return 2 * (p - 1) * (a + n / p)
    return logp * a + (p - 1) / p * n + (p - 1) * (a + n / p)


def choose(kind: str, nbytes: int, p: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu", allowed: tuple[str, ...] = vocab.ALGORITHMS) -> str:
    """``algorithm="auto"``'s pick of ``allowed`` for ``kind`` of ``nbytes`` over ``p`` ranks: in
    :func:`tune_table` (this op, device, p, dtype or float32; LP only if timed on this LP link) the
    least worst ratio to the built-in over the sizes either side of ``nbytes`` (the built-in unless
    another is below :data:`TABLE_MARGIN` of it at both), else by :func:`model_s` if a link was set
    or the built-in is not allowed (as :data:`BUILTIN_AS`), else ``"torch"``; logged when new.

    Example::

        >>> choose("allreduce", 1 << 20, 8)     # nothing measured, no link set: the built-in
        'torch'
    """
    dt, where = str(dtype).removeprefix("torch."), (os.environ.get(ENV_TUNE_FILE, ""),
                                                    fingerprint())
    best, why = _pick(kind, nbytes, p, dt, device, allowed, lp.link(), where)
    if (key := (kind, nbytes.bit_length(), p, best)) not in _LOGGED:
        _LOGGED.add(key)
        _LOG.debug("algorithm='auto': %s of %d B over %d ranks (%s) -> %s (%s)", kind, nbytes, p,
                   dt, best, why)
    return best


@functools.lru_cache(maxsize=4096)
def _pick(kind: str, nbytes: int, p: int, dt: str, device: str, allowed: tuple[str, ...],
          link: tuple[float, float], where: tuple[str, str]) -> tuple[str, str]:
    table, why, times = _first_look(*where), "cost model", {}
    if rows := table and (table["rows"].get(f"{kind}:{device}:{p}:{dt}")
                          or table["rows"].get(f"{kind}:{device}:{p}:float32")):
        # the sizes either side (one at or past an end), each algorithm scored by its worse ratio
        # to the built-in (the fastest, if untimed): one crowned at one size only may lose between
        near = [r for r in rows if r[0] <= nbytes][-1:] + [r for r in rows if r[0] >= nbytes][:1]
        why = "measured at " + " and ".join(dict.fromkeys(f"{n} B" for n, _ in near))
        times = {a: max(ts[a] / ts.get("torch", min(ts.values())) for _, ts in near) * (
            TABLE_MARGIN if a == "torch" else 1) for a in near[0][1] if a in allowed and all(
            a in ts for _, ts in near) and (a != "lp" or table["link"] == link)}
    if not times and "torch" in allowed and link == lp.DEFAULT_LINK:
        times, why = {"torch": 0.0}, "nothing measured"
    elif not times:
        times = {a: model_s(kind, a, nbytes, p) for a in allowed if a != "torch"}
        if "torch" in allowed:
            times["torch"] = MODEL_MARGIN * model_s(kind, BUILTIN_AS[kind], nbytes, p)
    return min(times, key=lambda a: (times[a], a != "torch")), why
