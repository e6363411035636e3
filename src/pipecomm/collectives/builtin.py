"""``algorithm="torch"``: the backend's own collectives (gloo, NCCL); and ``algorithm="auto"``,
which chooses per call between them and pipecomm's own.

No paper equation for the built-in; it is the "built-in" line of the LP paper's comparisons and
the oracle of the tests. ``op="avg"`` is a sum followed by a division by p (gloo has no AVG), done
by every rank (allreduce) or by ``dst`` (reduce).

``auto`` (:func:`choose`) takes, for the call's op, bytes, group size, dtype and device, the fastest
algorithm of a table a short measurement wrote (``python -m pipecomm.lab.tune``; the JSON file
:func:`tune_path`, verified on read, its ``fingerprint`` that of :func:`fingerprint`), else the
alpha-beta model of docs/algorithms.md on the link of :func:`pipecomm.collectives.lp.set_link`
(when one was set), else the built-in. Every input is alike on every rank; the ranks check once per
group that they read the same table (:func:`pipecomm.collectives.agreement.check_tuning`).
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
import zlib
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from pipecomm import vocab
from pipecomm.collectives import lp, p2p

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_ISSUING = threading.local()


def issuing() -> bool:
    """Whether this thread is inside :func:`start`'s call of ``torch.distributed`` (a pipecomm
    process group then runs it on its inner backend)."""
    return getattr(_ISSUING, "on", False)


def start(
    kind: str,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: str,
    root: int | None,
    async_op: bool,
) -> tuple[object | None, Callable[[int, bool], None]]:
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
    _ISSUING.on = True
    try:
        if kind == "allreduce":
            work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], group=group, async_op=async_op)
        elif kind == "broadcast":
            work = dist.broadcast(tensor, src=root, group=group, async_op=async_op)
        else:
            work = dist.reduce(tensor, dst=root, op=_REDUCE_OPS[op], group=group,
                               async_op=async_op)
    finally:
        _ISSUING.on = False

    def finish(p: int, is_root: bool) -> None:
        if op == "avg" and (kind == "allreduce" or is_root):
            tensor.div_(p)

    return work, finish


# --------------------------------------------------------------------------- algorithm="auto"

ENV_TUNE_FILE = "PIPECOMM_TUNE_FILE"
TUNE_FORMAT = "pipecomm-tune/1"
#: Variables, alike on every rank, that tell one network from another (:func:`fingerprint`).
NETWORK_ENV = ("PIPECOMM_NETWORK", "PIPECOMM_CLUSTER")
#: What the built-in runs, as the model prices it (gloo: a ring, a binomial tree, a chain).
BUILTIN_AS = {"allreduce": "ring", "broadcast": "mst", "reduce": "lp"}
#: The model prefers one of pipecomm's schedules to the built-in only below this share of it.
MODEL_MARGIN = 0.8
_LOG = logging.getLogger("pipecomm")
_LOGGED: set[tuple] = set()


def fingerprint() -> str:
    """The network this process talks over, alike on every rank, as 16 hex digits: the host
    when all ranks are on one (``MASTER_ADDR`` a loopback address, or ``LOCAL_WORLD_SIZE`` =
    ``WORLD_SIZE``), else the rendezvous address and ``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``; then :data:`NETWORK_ENV` and an emulated network
    (:func:`pipecomm.collectives.p2p.delaying`).

    Example::

        >>> len(fingerprint())
        16
    """
    env, emulated = os.environ, p2p.delaying()
    master = env.get("MASTER_ADDR", "")
    if (master in ("", "localhost", "::1") or master.startswith("127.")
            or env.get("LOCAL_WORLD_SIZE", "") == env.get("WORLD_SIZE")):
        where = [socket.gethostname()]
    else:
        where = [master, env.get("GLOO_SOCKET_IFNAME", ""), env.get("NCCL_SOCKET_IFNAME", "")]
    return _hash("|".join([*where, *(env.get(k, "") for k in NETWORK_ENV),
                           emulated.describe() if emulated else ""]))


def _hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def tune_digest(points: dict) -> str:
    """The digest a table file keeps of its ``points`` (verified on read)."""
    return _hash(json.dumps(points, sort_keys=True, separators=(",", ":")))


def tune_path() -> Path | None:
    """Where auto reads its table: ``$PIPECOMM_TUNE_FILE`` (``off``: none), else
    ``~/.cache/pipecomm/tune-<fingerprint>.json`` (``$XDG_CACHE_HOME`` for ``~/.cache``).

    Example::

        >>> os.environ.get("PIPECOMM_TUNE_FILE") == "off" or tune_path().suffix == ".json"
        True
    """
    env = os.environ.get(ENV_TUNE_FILE, "")
    if env:
        return None if env.lower() == "off" else Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache, "pipecomm", f"tune-{fingerprint()}.json")


def tune_table() -> dict | None:
    """The table at :func:`tune_path`, as :func:`read_table` found it on the first look of this
    process (later changes of the file wait for the next process, so that ranks started
    together choose alike)."""
    path = tune_path()
    return None if path is None else _first_look(str(path), fingerprint())


@functools.lru_cache(maxsize=8)
def _first_look(path: str, fp: str) -> dict | None:
    return read_table(path, fp)


def read_table(path: str | os.PathLike, fp: str | None = None) -> dict | None:
    """The table file at ``path`` once verified against the network ``fp`` (``None``:
    :func:`fingerprint`): ``{"rows": {"op:device:p:dtype": [(nbytes, {algorithm: seconds})]},
    "link", "digest"}``; ``None`` when there is none, or, with a warning, when it is unreadable,
    of another format or network, or its digest does not match its points (damaged).

    Example::

        >>> read_table("/nonexistent/tune.json") is None
        True
    """
    fp = fingerprint() if fp is None else fp
    try:
        doc = json.loads(Path(path).read_text())
        points, why = doc["points"], None
        if doc.get("format") != TUNE_FORMAT:
            why = f"format {doc.get('format')!r}, not {TUNE_FORMAT!r}"
        elif doc.get("fingerprint") != fp:
            why = f"measured on network {doc.get('fingerprint')!r}, this is {fp!r}"
        elif doc.get("digest") != tune_digest(points):
            why = "its digest does not match its points (damaged)"
        rows = {key: sorted((int(n), {a: float(s) for a, s in times.items()})
                            for n, times in sizes.items()) for key, sizes in points.items()}
        if not why and any(a not in vocab.ALGORITHMS or not s > 0 for r in rows.values()
                           for _, times in r for a, s in times.items()):
            why = "an unknown algorithm or a time that is not positive"
        link = tuple(float(x) for x in doc["link"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        why = f"unreadable ({type(exc).__name__}: {exc})"
    if why:
        warnings.warn(f"pipecomm: ignoring the tuning table {path}: {why}; algorithm='auto' "
                      "uses the cost model or the built-in", RuntimeWarning, stacklevel=2)
        return None
    return {"rows": rows, "link": link, "digest": doc["digest"]}


def tuning_digest(table: dict | None = None) -> int:
    """What auto's choices depend on beyond the call, as an int (checked alike on every member
    of a group): the table's digest, a set LP link, an emulated network."""
    link = lp.link() if lp.link() != lp.DEFAULT_LINK else None
    return zlib.crc32(f"{table and table['digest']}|{link}|{p2p.delaying() is None}".encode())


def model_s(kind: str, algorithm: str, nbytes: int, p: int) -> float:
    """The alpha-beta time of ``algorithm``'s ``kind`` of ``nbytes`` over ``p`` ranks on
    :func:`pipecomm.collectives.lp.link`, single port, lock-step (docs/algorithms.md, gamma 0).

    Example::

        >>> round(model_s("broadcast", "mst", 1 << 20, 8), 6)     # 3 rounds on DEFAULT_LINK
        0.001738
    """
    a, bw = lp.link()
    n, logp = nbytes / bw, (p - 1).bit_length()
    if nbytes == 0 or p < 2:
        return 0.0
    if algorithm == "lp":
        b = min(nbytes, lp.default_block_bytes(kind, nbytes, p))
        k, m = math.ceil(nbytes / b), (2 * p - 3 if kind == "allreduce" else p - 2)
        both = kind == "allreduce" and p > 2  # in k - 1 steps one port carries both ways
        extra = (nbytes - b if k > 3 else 2 * (nbytes - 2 * b) if k == 3 else 0) if both else 0
        return (k + m) * a + (nbytes + m * b + extra) / bw
    if algorithm == "mst":
        return logp * (2 if kind == "allreduce" else 1) * (a + n)
    if algorithm == "be":
        q = 1 << (p.bit_length() - 1)
        rest = (2 if kind == "allreduce" else 1) * (a + n) if p > q else 0.0
        return 2 * (q.bit_length() - 1) * a + 2 * (q - 1) / q * n + rest
    if kind == "allreduce":  # ring
        return 2 * (p - 1) * (a + n / p)
    return logp * a + (p - 1) / p * n + (p - 1) * (a + n / p)


def choose(kind: str, nbytes: int, p: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu", allowed: tuple[str, ...] = vocab.ALGORITHMS) -> str:
    """``algorithm="auto"``'s algorithm (one of ``allowed``) for ``kind`` of ``nbytes`` over
    ``p`` ranks: the fastest measured in :func:`tune_table` at the nearest size (log scale) for
    this op, device, p and dtype (else float32; LP's times only on the LP link they were
    measured with), else the fastest by :func:`model_s` (the built-in priced as
    :data:`BUILTIN_AS`, kept unless another is below :data:`MODEL_MARGIN` of it) when a link was
    set or the built-in is not allowed, else ``"torch"``. A debug line of the ``"pipecomm"``
    logger says each new choice.

    Example::

        >>> choose("allreduce", 1 << 20, 8)     # nothing measured, no link set: the built-in
        'torch'
    """
    table, why = tune_table(), "cost model"
    dt = str(dtype).removeprefix("torch.")
    rows = table and (table["rows"].get(f"{kind}:{device}:{p}:{dt}")
                      or table["rows"].get(f"{kind}:{device}:{p}:float32"))
    times = {}
    if rows:
        size, measured = min(rows, key=lambda r: abs(math.log2(max(nbytes, 1) / r[0])))
        times = {a: s for a, s in measured.items() if a in allowed
                 and (a != "lp" or table["link"] == lp.link())}
        why = f"measured at {size} B"
    if not times and "torch" in allowed and lp.link() == lp.DEFAULT_LINK:
        times, why = {"torch": 0.0}, "nothing measured"
    elif not times:
        times = {a: model_s(kind, a, nbytes, p) for a in allowed if a != "torch"}
        if "torch" in allowed:
            times["torch"] = MODEL_MARGIN * model_s(kind, BUILTIN_AS[kind], nbytes, p)
    best = min(times, key=lambda a: (times[a], a != "torch"))
    if (key := (kind, nbytes.bit_length(), p, best)) not in _LOGGED:
        _LOGGED.add(key)
        _LOG.debug("algorithm='auto': %s of %d B over %d ranks (%s) -> %s (%s)", kind, nbytes, p,
                   dt, best, why)
    return best
