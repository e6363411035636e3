"""Bucketing: which parameters are packed into one flat buffer and communicated together.

One rule serves PipeSGD's layer-wise units, DecentralizedDataParallel's buckets, the hooks and
the experiments' models of them. It is the gradient bucketing of torch DDP (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, Section 3.2.3:
parameters visited in (approximately) backward order, a bucket is closed once it holds
``bucket_cap_mb``):

* parameters are visited in ``order`` (``"reverse"``: reverse registration order, the order in
  which a feed-forward model's gradients become ready in backward; ``"forward"``; or an explicit
  permutation, such as an observed gradient-ready order);
* a bucket holds one (dtype, device) kind only, and is closed as soon as it holds at least
  ``bucket_bytes`` bytes (``None``: never; a tiny value gives one parameter per bucket; a
  parameter larger than the cap gets a bucket of its own, never split);
* ``kinds="consecutive"``: one bucket is open at a time, and a parameter of another kind closes
  it (DecentralizedDataParallel's rule); ``kinds="interleaved"``: one bucket is open per kind, so
  parameters of another kind in between do not close it (torch DDP's and PipeSGD's rule);
* buckets are listed in the order they become complete: by the position, in the visit order, of
  their last parameter (for ``"consecutive"`` that is also the order they were opened in).

Example::

    >>> import torch
    >>> from pipecomm.bucketing import bucket_indices, bucket_nbytes
    >>> params = [torch.zeros(256), torch.zeros(256), torch.zeros(512)]   # 1, 1, 2 KiB
    >>> bucket_indices(params, 2048)
    [[2], [1, 0]]
    >>> bucket_indices(params, 2048, order="forward")
    [[0, 1], [2]]
    >>> bucket_nbytes(params, [[2], [1, 0]])
    [2048, 2048]
    >>> # one bucket per kind, kinds in order of first appearance (PipeSGD's unbucketed modes)
    >>> sorted(bucket_indices(params, None, order="forward", kinds="interleaved"))
    [[0, 1, 2]]
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Sequence
from typing import Any

import torch

from pipecomm import checks

__all__ = ["KINDS", "ORDERS", "bucket_bytes", "bucket_indices", "bucket_nbytes"]

#: Named visit orders of :func:`bucket_indices` (an explicit permutation is accepted too).
ORDERS = ("reverse", "forward")
#: How :func:`bucket_indices` treats parameters of several (dtype, device) kinds.
KINDS = ("consecutive", "interleaved")


def bucket_bytes(bucket_mb: Any, *, where: str = "") -> float:
    """``bucket_mb`` MiB in bytes, after checking it is a positive, finite number.

    ``where`` prefixes the error message (e.g. the class that received the argument).

    Example::

        >>> bucket_bytes(25.0)
        26214400.0
    """
    return checks.positive_number(bucket_mb, "bucket_mb", where, "MiB") * 2**20


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _visit_order(n: int, order: Any) -> list[int]:
    if isinstance(order, str):
        if order not in ORDERS:
            raise ValueError(f"bucket_indices: order must be one of {ORDERS} or a permutation "
                             f"of the parameter indices, got {order!r}")
        return list(reversed(range(n))) if order == "reverse" else list(range(n))
    if not isinstance(order, Sequence):
        raise TypeError(f"bucket_indices: order must be one of {ORDERS} or a sequence of "
                        f"parameter indices, got {type(order).__name__}")
    visit = []
    for i in order:
        if isinstance(i, bool):
            raise TypeError(f"bucket_indices: order holds a bool ({i!r}), not an index")
        try:
            visit.append(operator.index(i))
        except TypeError:
            raise TypeError(
                f"bucket_indices: order must hold ints, got {type(i).__name__} ({i!r})"
            ) from None
    if sorted(visit) != list(range(n)):
        missing = sorted(set(range(n)) - set(visit))
        extra = sorted({i for i in visit if not 0 <= i < n or visit.count(i) > 1})
        raise ValueError(f"bucket_indices: order must be a permutation of range({n}) (every "
                         f"parameter exactly once); missing {missing}, out of range or repeated "
                         f"{extra}")
    return visit


def bucket_indices(
    params: Sequence[torch.Tensor],
    bucket_bytes: float | None,
    *,
    order: str | Sequence[int] = "reverse",
    kinds: str = "consecutive",
) -> list[list[int]]:
    """Buckets of indices into ``params`` (the rule of the module docstring).

    Args:
        params: the tensors (parameters) to bucket; only their size, dtype and device matter.
        bucket_bytes: a bucket is closed once it holds at least this many bytes; ``None`` or
            ``math.inf``: never (one bucket per kind, or per run of a kind).
        order: ``"reverse"`` (default), ``"forward"``, or a permutation of
            ``range(len(params))``: the order parameters are visited (and listed in buckets).
        kinds: ``"consecutive"`` (one open bucket; a change of dtype or device closes it) or
            ``"interleaved"`` (one open bucket per dtype and device).

    Returns:
        Every index exactly once; each bucket's indices in visit order; buckets in the order they
        complete (position of their last index in the visit order). ``[]`` for no parameters.

    Example::

        >>> ps = [torch.zeros(3), torch.zeros(5, dtype=torch.float64), torch.zeros(4)]
        >>> bucket_indices(ps, None, order="forward")
        [[0], [1], [2]]
        >>> bucket_indices(ps, None, order="forward", kinds="interleaved")
        [[1], [0, 2]]
    """
    if isinstance(params, torch.Tensor) or not isinstance(params, Sequence):
        raise TypeError(
            "bucket_indices: params must be a sequence of tensors (e.g. list(model.parameters()))"
            f", got {type(params).__name__}"
        )
    for i, p in enumerate(params):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"bucket_indices: params[{i}] is a {type(p).__name__}, not a tensor")
    if bucket_bytes is None:
        cap = math.inf
    else:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, numbers.Real):
            raise TypeError(
                "bucket_indices: bucket_bytes must be a positive number of bytes or None, got "
                f"{type(bucket_bytes).__name__} ({bucket_bytes!r})"
            )
        cap = float(bucket_bytes)
        if math.isnan(cap) or cap <= 0:
            raise ValueError(
                f"bucket_indices: bucket_bytes must be > 0 (or None: no limit), got {bucket_bytes!r}"
            )
    if kinds not in KINDS:
        raise ValueError(f"bucket_indices: kinds must be one of {KINDS}, got {kinds!r}")
    visit = _visit_order(len(params), order)

    done: list[list[int]] = []
    open_: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    size: dict[tuple[torch.dtype, torch.device], int] = {}
    for i in visit:
        p = params[i]
        key = (p.dtype, p.device)
        if kinds == "consecutive" and open_ and key not in open_:
            done.extend(open_.values())
            open_.clear()
        if key not in open_:
            open_[key], size[key] = [], 0
        open_[key].append(i)
        size[key] += _nbytes(p)
        if size[key] >= cap:
            done.append(open_.pop(key))
    done.extend(open_.values())
    position = {i: n for n, i in enumerate(visit)}
    done.sort(key=lambda idx: position[idx[-1]])
    return done


def bucket_nbytes(params: Sequence[torch.Tensor], buckets: Sequence[Sequence[int]]) -> list[int]:
    """Bytes of every bucket of ``buckets`` (indices into ``params``), in the same order.

    Example::

        >>> bucket_nbytes([torch.zeros(3), torch.zeros(5)], [[1], [0]])
        [20, 12]
    """
    return [sum(_nbytes(params[i]) for i in idx) for idx in buckets]
