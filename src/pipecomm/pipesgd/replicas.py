"""Construction of PipeSGD: argument checks, the trained parameters (then, shared with
DecentralizedDataParallel in :mod:`pipecomm.decentralized.replicas`: the group, equal replicas).

One concept: what must hold before the first iteration of data-parallel training (no paper
equation: the preconditions of the rule in ``docs/update_rules.md``). Every argument is checked
before any communication.

Example::

    >>> import torch
    >>> from pipecomm.pipesgd.replicas import check_arguments, select_params
    >>> model = torch.nn.Linear(2, 1)
    >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> check_arguments(model, optimizer, 25.0, None, False, None)
    >>> len(select_params(model, optimizer, None))
    2
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import nn

from pipecomm import checks

__all__ = [
    "check_arguments",
    "check_staleness",
    "select_params",
]

_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_arguments(
    model: Any, optimizer: Any, bucket_mb: Any, block_bytes: Any, timing: Any, max_timings: Any
) -> None:
    """TypeError/ValueError naming the first bad one of PipeSGD's plain arguments.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> check_arguments(model, optimizer, 25.0, None, False, 100)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    checks.positive_number(bucket_mb, "bucket_mb", unit="MiB")
    checks.block_bytes(block_bytes)
    checks.flag(timing, "timing")
    if max_timings is not None and (
        isinstance(max_timings, bool) or not isinstance(max_timings, int) or max_timings < 0
    ):
        raise ValueError(f"max_timings must be a non-negative int or None, got {max_timings!r}")


def check_staleness(mode: str, staleness: Any) -> int:
    """k for ``mode``: ``None`` gives 1 for ``"pipe"`` and 0 otherwise; only ``"pipe"`` takes
    k > 0.

    Example::

        >>> check_staleness("pipe", None)
        1
    """
    if staleness is None:
        return 1 if mode == "pipe" else 0
    if isinstance(staleness, bool):
        raise TypeError(f"staleness must be an int or None, got {staleness!r}")
    try:
        k = operator.index(staleness)
    except TypeError:
        raise TypeError(f"staleness must be an int or None, got {type(staleness).__name__}") from None
    if k < 0:
        raise ValueError(f"staleness must be >= 0 (iterations of delay), got {k}")
    if mode != "pipe" and k != 0:
        raise ValueError(f"mode={mode!r} has zero staleness; got staleness={k}. Use mode='pipe' "
                         "for delayed updates (staleness >= 1), or staleness=None/0")
    return k


def select_params(
    model: nn.Module, optimizer: torch.optim.Optimizer, compression: str | None
) -> list[nn.Parameter]:
    """The parameters of ``model``, in its order, that require grad and ``optimizer`` updates
    (floating-point and dense; an optimizer parameter outside ``model`` is a ValueError).

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> [tuple(p.shape) for p in select_params(model, torch.optim.SGD(model.parameters(), lr=0.1), None)]
        [(1, 2), (1,)]
    """
    in_model = {id(p) for p in model.parameters()}
    in_opt = set()
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in in_model:
                raise ValueError(f"optimizer holds a parameter of shape {tuple(p.shape)} that is "
                                 "not a parameter of model; build the optimizer from "
                                 "model.parameters()")
            in_opt.add(id(p))
    params = [p for p in model.parameters() if p.requires_grad and id(p) in in_opt]
    if not params:
        raise ValueError("model has no trainable parameter that optimizer updates; nothing to train")
    for p in params:
        if p.dtype not in _PARAM_DTYPES:
            what = "compression" if compression is not None else "PipeSGD"
            raise TypeError(f"{what} needs floating-point parameters (float16, bfloat16, "
                            f"float32, float64); got a parameter of dtype {p.dtype} and shape "
                            f"{tuple(p.shape)}")
        if p.layout != torch.strided:
            raise TypeError(f"parameters must be dense (strided), got layout {p.layout}")
    return params
