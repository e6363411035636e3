"""Construction checks of DecentralizedDataParallel: arguments, group, equal replicas, optimizer.

Every check names the argument and the fix. :func:`check_same` (how ranks' replicas differ) and
:func:`broadcast_state` (make them equal) also serve PipeSGD; :func:`make_optimizer` builds or
checks the one optimizer over all parameters.

Example::

    >>> from pipecomm.decentralized.replicas import check_max_norm
    >>> check_max_norm(1.0, "bucket")
    1.0
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecomm import checks, collectives

__all__ = ["NORM_SCOPES", "broadcast_state", "check_max_norm", "check_same", "check_scaler",
           "describe_mismatch", "group_members", "make_optimizer", "model_signature"]

_NAME = "DecentralizedDataParallel"
#: values of ``grad_norm_scope``
NORM_SCOPES = ("bucket", "global")


def check_max_norm(max_grad_norm: Any, scope: Any) -> float | None:
    """``max_grad_norm`` as a float (``None`` stays ``None``) if positive and finite, and
    ``scope`` one of :data:`NORM_SCOPES`; else TypeError / ValueError.

    Example::

        >>> check_max_norm(1.0, "bucket")
        1.0
    """
    if scope not in NORM_SCOPES:
        raise ValueError(f"{_NAME}: grad_norm_scope must be one of {NORM_SCOPES}, got {scope!r}")
    if max_grad_norm is None:
        return None
    return checks.positive_number(max_grad_norm, "max_grad_norm", _NAME)


def check_scaler(grad_scaler: Any, params: list[nn.Parameter]) -> torch.amp.GradScaler | None:
    """``grad_scaler`` if it is an enabled ``torch.amp.GradScaler`` that can unscale
    ``params``' gradients (float32 parameters on the scaler's device); ``None`` when none or
    disabled.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> scaler = torch.amp.GradScaler("cpu")
        >>> check_scaler(scaler, list(model.parameters())) is scaler
        True
    """
    if grad_scaler is None:
        return None
    if not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(f"{_NAME}: grad_scaler must be a torch.amp.GradScaler or None, got "
                        f"{type(grad_scaler).__name__}")
    if not grad_scaler.is_enabled():
        return None
    half = [p for p in params if p.dtype == torch.float16]
    if half:
        raise ValueError(f"{_NAME}: grad_scaler with float16 parameters: torch's GradScaler "
                         "cannot unscale float16 gradients; keep the parameters in float32 and "
                         "run the forward under torch.autocast(device_type, dtype=torch.float16)")
    devices = {p.device.type for p in params}
    scaler_device = getattr(grad_scaler, "_device", None)
    if scaler_device is not None and devices != {scaler_device}:
        raise ValueError(f"{_NAME}: grad_scaler is for device {scaler_device!r} but the "
                         f"parameters are on {sorted(devices)}; make it with "
                         f"torch.amp.GradScaler({sorted(devices)[0]!r})")
    return grad_scaler


def group_members(process_group: Any, where: str = _NAME, name: str = "process_group"
                  ) -> tuple[dist.ProcessGroup | None, tuple[int, ...]]:
    """``(process group, its global ranks)`` of ``process_group`` (``None``: the world), refused
    unless this rank is one of them; ``(None, (0,))`` without torch.distributed. ``where`` and
    ``name`` (the argument's) go into the messages.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> pg, members = group_members(None)   # (WORLD, (0, 1, 2, 3)) with p = 4
        >>> pg is dist.group.WORLD, members
        (True, (0,))
        >>> dist.destroy_process_group()
    """
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError(f"{where}: {name} was given but torch.distributed is not initialised; "
                             "start ranks with pipecomm.lab.networks.launch, or pass "
                             f"{name}=None for single-process training")
        return None, (0,)
    if process_group is None:
        process_group = dist.group.WORLD
    if process_group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{where}: {name}: rank {dist.get_rank()} is not a member of it; "
                         f"construct {where} on the group's ranks only")
    if not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"{where}: {name} must be a torch.distributed ProcessGroup or None, got "
                        f"{type(process_group).__name__}")
    members = tuple(dist.get_process_group_ranks(process_group))
    if dist.get_rank() not in members:
        raise ValueError(f"{where}: {name}: rank {dist.get_rank()} is not one of its ranks "
                         f"{members}; construct {where} on the group's ranks only")
    return process_group, members


def model_signature(model: nn.Module, params: list | None = None) -> list[tuple]:
    """``(kind, name, shape, dtype, requires_grad)`` of every parameter and buffer of ``model``
    in registration order (``params`` given: of those parameters only, no buffer).

    Example::

        >>> model_signature(torch.nn.Linear(2, 1))[0]
        ('parameter', 'weight', (1, 2), 'torch.float32', True)
    """
    keep = None if params is None else {id(p) for p in params}
    sig = [("parameter", n, tuple(p.shape), str(p.dtype), p.requires_grad)
           for n, p in model.named_parameters() if keep is None or id(p) in keep]
    if keep is None:
        sig += [("buffer", n, tuple(b.shape), str(b.dtype), False) for n, b in model.named_buffers()]
    return sig


def describe_mismatch(sig0: list, sig: list, rank: int) -> str:
    """How rank ``rank``'s :func:`model_signature` ``sig`` differs from rank 0's ``sig0``.

    Example::

        >>> from collections import OrderedDict
        >>> fc = torch.nn.Linear(2, 1)
        >>> sig0 = model_signature(torch.nn.Sequential(OrderedDict(fc=fc)))
        >>> fc.register_parameter("bias", None)
        >>> sig = model_signature(torch.nn.Sequential(OrderedDict(fc=fc)))
        >>> describe_mismatch(sig0, sig, 1)
        "parameter 'fc.bias' exists on rank 0 but not on rank 1"
    """
    names0, names = {e[1]: e for e in sig0}, {e[1]: e for e in sig}
    for kind, name, *_ in sig0:
        if name not in names:
            return f"{kind} {name!r} exists on rank 0 but not on rank {rank}"
    for kind, name, *_ in sig:
        if name not in names0:
            return f"{kind} {name!r} exists on rank {rank} but not on rank 0"
    for e0 in sig0:
        e = names[e0[1]]
        for what, i in (("kind", 0), ("shape", 2), ("dtype", 3), ("requires_grad", 4)):
            if e0[i] != e[i]:
                return f"{e0[0]} {e0[1]!r} has {what} {e0[i]} on rank 0 and {e[i]} on rank {rank}"
    return f"the parameters and buffers are registered in a different order on rank {rank}"


def check_same(model: nn.Module, settings: dict[str, Any], group: Any, where: str,
               params: list | None = None) -> None:
    """ValueError on every member of ``group`` unless all have the same
    :func:`model_signature` (of ``params`` where given) and ``settings``; it names the first
    difference (a mismatch would otherwise hang a collective or train different models).

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> check_same(torch.nn.Linear(2, 1), {"staleness": 1}, None, "PipeSGD")
        >>> dist.destroy_process_group()
    """
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (model_signature(model, params), settings), group=group)
    sig0, settings0 = gathered[0]
    for r, (sig, mine) in enumerate(gathered):
        bad = [f"{k} is {v!r} on rank 0 and {mine.get(k)!r} on rank {r}"
               for k, v in settings0.items() if mine.get(k) != v]
        if sig != sig0:
            bad.append(describe_mismatch(sig0, sig, r))
        if bad:
            raise ValueError(f"{where}: the replicas differ across ranks: {'; '.join(bad)}. "
                             f"Build the same model and pass the same {where} arguments on "
                             "every rank")


@torch.no_grad()
def broadcast_state(model: nn.Module, src: int, group: Any, algorithm: str | None = None) -> None:
    """Copy global rank ``src``'s parameters and buffers into every member's ``model``, one
    message per (device, dtype): ``collectives.broadcast`` with ``algorithm`` (of its dtypes),
    or ``dist.broadcast`` (every dtype) when ``None``.

    Example::

        >>> dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())   # p = 1
        >>> broadcast_state(torch.nn.Linear(2, 1), 0, None, "ring")
        >>> dist.destroy_process_group()
    """
    by_key: dict[tuple, list[torch.Tensor]] = {}
    for t in (*model.parameters(), *model.buffers()):
        if t.numel() > 0 and (algorithm is None or t.dtype in collectives.SUPPORTED_DTYPES):
            by_key.setdefault((t.device, t.dtype), []).append(t)
    for same in by_key.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        if algorithm is None:
            dist.broadcast(flat, src=src, group=group)
        else:
            collectives.broadcast(flat, src, algorithm=algorithm, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def make_optimizer(optimizer: Any, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
    """The optimizer ``optimizer`` is or builds from ``named`` (``optim_fn``), checked to hold
    exactly the parameters of ``named``, each once.

    Example::

        >>> named = list(torch.nn.Linear(2, 1).named_parameters())
        >>> opt = make_optimizer(lambda named: torch.optim.SGD([p for _, p in named], lr=0.1), named)
        >>> type(opt).__name__, len(opt.param_groups[0]["params"])
        ('SGD', 2)
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        opt = optimizer
    elif callable(optimizer):
        opt = optimizer(list(named))
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"{_NAME}: optimizer (a function) must return a "
                            f"torch.optim.Optimizer, got {type(opt).__name__}")
    else:
        raise TypeError(f"{_NAME}: optimizer must be a torch.optim.Optimizer over the model's "
                        "parameters or a function optim_fn(list of (name, parameter)) -> "
                        f"optimizer, got {type(optimizer).__name__}")
    seen: dict[int, int] = {}
    for g in opt.param_groups:
        for p in g["params"]:
            seen[id(p)] = seen.get(id(p), 0) + 1
    want = {id(p): n for n, p in named}
    missing = [n for n, p in named if id(p) not in seen]
    if missing or set(seen) != set(want) or any(v > 1 for v in seen.values()):
        raise ValueError(f"{_NAME}: the optimizer must hold exactly the model's parameters that "
                         f"require grad, each once (missing: {missing[:5]}, others: "
                         f"{len(set(seen) - set(want))}); build it from model.parameters() or, in "
                         "optim_fn, from [p for _, p in named]")
    return opt
