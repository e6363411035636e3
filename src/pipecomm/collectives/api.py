"""Public entry points: ``allreduce``, ``broadcast``, ``reduce`` — validation and dispatch.

Runs the schedule (``"lp"`` — linear pipelining, Wang et al., arXiv 1611.04255; ``"mst"``,
``"be"``, ``"ring"``; ``"torch"``, the backend's built-in; ``"auto"``, per call one of them,
:func:`.builtin.choose`) after checking every argument, on a flat contiguous view of the tensor
(a non-contiguous one in a contiguous copy, copied back), now or with ``async_op=True`` on the
communication thread (:mod:`.async_`). ``group`` is any process group (``None``: the world),
``src``/``dst`` *global* ranks of it; a non-member returns at once, its tensor unchanged (as in
``torch.distributed``); a group of one rank and an empty tensor move nothing.

Every member first checks that all made the same call (:mod:`.agreement`: op, algorithm, root,
numel, dtype, LP block, codec, auto's tuning), else all raise
:class:`~pipecomm.collectives.agreement.MismatchError` before any data moves. The built-in is
left to the backend's own checks (auto's ranks check once per group that they read alike).
"""

from __future__ import annotations

import functools
import operator
import zlib
from typing import Any

import torch
import torch.distributed as dist

from pipecomm import checks, compress, observe, vocab
from pipecomm.collectives import agreement, async_, be, builtin, lp, mst, p2p, ring
from pipecomm.collectives._group import make_comm, members_of
from pipecomm.collectives._reduce import OPS, SUPPORTED_DTYPES
from pipecomm.collectives.async_ import CompletedHandle, Handle, WorkHandle, submit

ALGORITHMS: tuple[str, ...] = vocab.ALGORITHMS
COMPRESSIONS: tuple[str, ...] = vocab.CODECS
_SCHEDULES = {"lp": lp, "mst": mst, "be": be, "ring": ring}

Result = torch.Tensor | Handle


# --------------------------------------------------------------------------- argument checks


def _check_tensor(fn: str, t: Any) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn}: t must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{fn}: t must be a dense (strided) tensor, got layout {t.layout}")
    if t.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
        raise TypeError(f"{fn}: t has dtype {t.dtype}; supported dtypes are {names}")


def check_algorithm(algorithm: Any, where: str) -> str:
    """``algorithm`` if it is ``"auto"`` or one of :data:`ALGORITHMS` and can run here: the
    backend's built-in (``"torch"``) is refused while an emulated network delays pipecomm's
    messages (:func:`pipecomm.collectives.p2p.delaying`), else a ValueError naming ``where``.

    Example::

        >>> check_algorithm("lp", "allreduce")
        'lp'
    """
    vocab.check_algorithm(algorithm, allowed=vocab.ALGORITHM_CHOICES, where=where)
    emulated = p2p.delaying()
    if algorithm == "torch" and emulated is not None:
        raise ValueError(
            f"{where}: algorithm='torch' (the backend's built-in) cannot be emulated: it cannot "
            f"run on the emulated network ({emulated.describe()}); choose one of pipecomm's own "
            f"algorithms {ALGORITHMS[:-1]}, or start the ranks without network=")
    return algorithm


def _check_op(fn: str, op: Any, t: torch.Tensor) -> None:
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"{fn}: op must be one of {OPS}, got {op!r}")
    if op == "avg" and not t.dtype.is_floating_point:
        raise TypeError(
            f"{fn}: op='avg' needs a floating-point tensor, got {t.dtype}; use op='sum' and "
            "divide, or convert the tensor to a floating dtype")


def _codec(fn: str, compression: Any, algorithm: str, t: torch.Tensor) -> Any:
    if compression is None:
        return None
    if isinstance(compression, str) and compression not in COMPRESSIONS:
        raise ValueError(
            f"{fn}: compression must be None or one of {COMPRESSIONS}, got {compression!r}")
    if not isinstance(compression, str) and not all(
        hasattr(compression, a) for a in ("encode", "decode", "payload_nbytes")
    ):
        raise ValueError(
            f"{fn}: compression must be None, one of {COMPRESSIONS} or a codec object, "
            f"got {compression!r}")
    if algorithm not in vocab.COMPRESSING_ALGORITHMS:
        raise ValueError(f"{fn}: compression={getattr(compression, 'name', compression)!r} needs "
                         f"algorithm 'lp' or 'ring' (compression happens inside their transfers), "
                         f"got algorithm={algorithm!r}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{fn}: compression applies to floating-point tensors only, got {t.dtype}; "
                        "pass compression=None")
    if not isinstance(compression, str):
        return compression
    return compress.get_codec(compression)


def _check_call(fn: str, t: Any, algorithm: Any, op: Any, block_bytes: Any, async_op: Any) -> None:
    """The checks every public entry point makes first (broadcast passes ``op="sum"``)."""
    _check_tensor(fn, t)
    check_algorithm(algorithm, fn)
    _check_op(fn, op, t)
    checks.block_bytes(block_bytes, fn)
    checks.flag(async_op, "async_op", fn)


def _root_index(fn: str, name: str, root: Any, members: tuple[int, ...]) -> int:
    try:
        value = operator.index(root)
    except TypeError:
        raise TypeError(f"{fn}: {name} must be an int (a global rank), got {root!r}") from None
    if isinstance(root, bool) or value not in members:
        raise ValueError(
            f"{fn}: {name}={root!r} is not a member of the group (its global ranks are "
            f"{list(members)}); {name} is a global rank, as in torch.distributed")
    return members.index(value)


# --------------------------------------------------------------------------- algorithm="auto"

_AGREED: set[tuple] = set()  # (members, tuning) of groups whose ranks were found to agree


def auto_choice(kind: str, t: torch.Tensor, *_: Any, group: Any = None,
                compression: Any = None, **__: Any) -> str:
    """What ``algorithm="auto"`` runs for ``kind`` of ``t`` on ``group``: :func:`.builtin.choose`
    of values alike on every member (a codec needs LP or ring, an emulated network pipecomm's).

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        >>> auto_choice("allreduce", torch.ones(4)); dist.destroy_process_group()   # p = 1
        'torch'
    """
    p = len(members_of(group) or ())
    allowed = ALGORITHMS if compression is None else vocab.COMPRESSING_ALGORITHMS
    if p2p.delaying() is not None:
        allowed = tuple(a for a in allowed if a != "torch")
    if p < 2:  # nothing to move
        return allowed[-1]
    return builtin.choose(kind, t.numel() * t.element_size(), p, t.dtype, t.device.type, allowed)


def tuning() -> int:
    """What ``algorithm="auto"``'s choices depend on beyond the call, as an int the ranks
    compare (:class:`.agreement.Call`): the table's digest, a set LP link, an emulated network.

    Example::

        >>> tuning() == tuning() != 0
        True
    """
    table, link = builtin.tune_table(), lp.link()
    return _tuning(table and table["digest"], link != lp.DEFAULT_LINK and link,
                   p2p.delaying() is None)


_tuning = functools.lru_cache(maxsize=64)(lambda *what: zlib.crc32(repr(what).encode()) or 1)


# --------------------------------------------------------------------------- execution


def _block_elems(kind: str, t: torch.Tensor, p: int, block_bytes: int | None, codec: Any) -> int:
    """Elements per LP block: ``block_bytes`` rounded down to whole elements (at least one)."""
    if block_bytes is None:
        ratio = 1.0
        if codec is not None and hasattr(codec, "ratio"):
            ratio = max(1.0, float(codec.ratio(t.dtype)))
        block_bytes = lp.default_block_bytes(kind, t.numel() * t.element_size(), p, ratio)
    return max(1, block_bytes // t.element_size())


def _transport(group: dist.ProcessGroup | None, async_op: bool) -> dist.ProcessGroup | None:
    """The process group the p2p operations run on: the user's, or for asynchronous operations
    the communication thread's world-wide duplicate (p2p addresses global ranks, so it serves any
    subgroup). Called on every rank, members of ``group`` or not: the first call may create
    that group, a collective. A pipecomm process group (:mod:`pipecomm.backend`) that is not the
    world carries its own messages until that group exists.
    """
    if not async_op:
        return group
    if (not async_.has_comm_group() and group is not None and group is not dist.group.WORLD
            and dist.get_backend(group) == vocab.BACKEND_NAME):
        return group
    return async_.comm_group()


def _execute(kind: str, t: Any, algorithm: Any, op: Any, group: dist.ProcessGroup | None,
             block_bytes: Any, async_op: Any, compression: Any = None,
             root: tuple[str, Any] | None = None) -> Result:
    """Every public entry point: the checks, ``"auto"``'s choice, the call on this rank (now or
    on the communication thread); ``root`` is ``("src" | "dst", global rank)`` of a rooted op."""
    _check_call(kind, t, algorithm, op, block_bytes, async_op)
    auto = algorithm == vocab.AUTO
    algorithm = auto_choice(kind, t, group=group, compression=compression) if auto else algorithm
    codec = _codec(kind, compression, algorithm, t)
    members = members_of(group)
    transport = _transport(group, async_op)
    if members is None:
        return CompletedHandle(t, kind) if async_op else t
    root = None if root is None else _root_index(kind, *root, members)
    p = len(members)
    what = f"{kind}(algorithm={algorithm!r}, op={op!r}, numel={t.numel()}, group size {p})"
    tune = tuning() if auto else 0
    if tune and algorithm == "torch" and p > 1 and (members, tune) not in _AGREED:
        # once per group: the built-in has no check of its own to see the ranks disagree
        job = functools.partial(agreement.check, agreement.Call.of(
            kind, t, algorithm, op, root, 0, None, tune), make_comm(members, transport), t)
        submit(job, t, what).wait() if async_op else job()
        _AGREED.add((members, tune))
    if p == 1 or (t.numel() == 0 and algorithm == "torch"):
        return CompletedHandle(t, what) if async_op else t
    data = t.detach()
    contiguous = data.is_contiguous()

    if algorithm == "torch":
        buf = data if contiguous else data.contiguous()
        root_global = None if root is None else members[root]
        work, finish = builtin.start(kind, buf, group, op, root_global, async_op)
        is_root = root_global == dist.get_rank()

        def finalize() -> None:
            finish(p, is_root)
            if not contiguous:
                data.copy_(buf)

        if async_op:
            return WorkHandle(work, finalize, t, what)
        finalize()
        return t

    schedule = _SCHEDULES[algorithm]
    kwargs: dict[str, Any] = {}
    if algorithm == "lp":
        kwargs["block_elems"] = _block_elems(kind, t, p, block_bytes, codec) if t.numel() else 0
    if codec is not None:
        kwargs["codec"] = codec
    comm = make_comm(members, transport)
    call = agreement.Call.of(kind, t, algorithm, op, root, kwargs.get("block_elems", 0), codec,
                             tune)

    def body() -> None:
        agreement.check(call, comm, t)  # every rank raises, before any data moves
        if data.numel() == 0:
            return
        flat = data.view(-1) if contiguous else data.contiguous().view(-1)
        if kind == "allreduce":
            schedule.allreduce(flat, comm, op, **kwargs)
        elif kind == "broadcast":
            schedule.broadcast(flat, comm, root, **kwargs)
        else:
            schedule.reduce(flat, comm, root, op, **kwargs)
        if not contiguous:
            data.copy_(flat.view_as(data))

    if async_op:
        return submit(body, t, what)
    body()
    return t


# --------------------------------------------------------------------------- public API


@observe.ranged("allreduce", choose=functools.partial(auto_choice, "allreduce"))
def allreduce(t: torch.Tensor, *, algorithm: str = vocab.DEFAULT_ALGORITHM, op: str = "sum",
              group: dist.ProcessGroup | None = None, block_bytes: int | None = None,
              async_op: bool = False, compression: str | None = None) -> Result:
    """Reduce ``t`` over the ranks of ``group`` in place; every member ends with the result.

    Args:
        t: the tensor (float16/bfloat16/float32/float64/int32/int64, any shape, may be empty).
        algorithm: ``"auto"`` (default: per call the fastest, :func:`auto_choice`), ``"lp"``
            (linear pipelining), ``"mst"``, ``"be"``, ``"ring"`` or ``"torch"`` (the built-in).
        op: ``"sum"``, ``"avg"`` (floating tensors only), ``"max"`` or ``"min"``.
        group: process group (``None``: all ranks).
        block_bytes: LP block size, rounded down to whole elements (at least one); ``None``
            takes the cost model's optimum. Ignored by the other algorithms.
        async_op: return a :class:`Handle` at once and run on the communication thread.
        compression: ``None``, ``"fp16"``, ``"bf16"`` or ``"int8"`` (Pipe-SGD's light
            compression of every transfer; ``"lp"`` and ``"ring"`` only, floating tensors only).

    Returns ``t`` (or a handle whose ``wait()`` returns ``t``).

    Example::

        >>> from pipecomm import collectives
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> g = torch.full((1000,), float(dist.get_rank()))
        >>> collectives.allreduce(g, op="avg")[:3]                 # every rank: (p - 1) / 2
        tensor([0., 0., 0.])
        >>> h = collectives.allreduce(g, algorithm="ring", async_op=True)
        >>> h.wait() is g
        True
        >>> dist.destroy_process_group()
    """
    return _execute("allreduce", t, algorithm, op, group, block_bytes, async_op, compression)


@observe.ranged("broadcast", choose=functools.partial(auto_choice, "broadcast"))
def broadcast(t: torch.Tensor, src: int = 0, *, algorithm: str = vocab.DEFAULT_ALGORITHM,
              group: dist.ProcessGroup | None = None, block_bytes: int | None = None,
              async_op: bool = False) -> Result:
    """Copy ``t`` of global rank ``src`` into ``t`` of every member of ``group``, in place.

    Arguments as in :func:`allreduce`; ``src`` is a global rank and must belong to ``group``.

    Example::

        >>> from pipecomm import collectives
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> model_weights = torch.arange(4.0)
        >>> w = model_weights if dist.get_rank() == 0 else torch.empty_like(model_weights)
        >>> collectives.broadcast(w, src=0, algorithm="lp", block_bytes=1 << 16)
        tensor([0., 1., 2., 3.])
        >>> dist.destroy_process_group()
    """
    return _execute("broadcast", t, algorithm, "sum", group, block_bytes, async_op,
                    root=("src", src))


@observe.ranged("reduce", choose=functools.partial(auto_choice, "reduce"))
def reduce(t: torch.Tensor, dst: int = 0, *, algorithm: str = vocab.DEFAULT_ALGORITHM,
           op: str = "sum", group: dist.ProcessGroup | None = None,
           block_bytes: int | None = None, async_op: bool = False) -> Result:
    """Reduce ``t`` over ``group`` into ``t`` of global rank ``dst``; other ranks' ``t`` is
    left with unspecified values (it serves as the working buffer).

    Arguments as in :func:`allreduce`; ``dst`` is a global rank and must belong to ``group``.

    Example::

        >>> from pipecomm import collectives
        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> loss_sum = torch.tensor([0.5])
        >>> collectives.reduce(loss_sum, dst=0, op="sum", algorithm="mst")   # valid on rank 0
        tensor([0.5000])
        >>> dist.destroy_process_group()
    """
    return _execute("reduce", t, algorithm, op, group, block_bytes, async_op, root=("dst", dst))
