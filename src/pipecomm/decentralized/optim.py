"""AccumAdam and AccumAdamW (DAdam paper, Wang, Zhang, Wu, Johansson, ICLR 2025, Algorithm 4).

Decentralized training with small local batches feeds Adam's moments with noisy gradients.
AccumAdam keeps Adam's update at every step but commits to the moments only the gradient
*averaged over a window of K = accum_iter steps*. Per parameter, for steps t = 1, 2, ... with window
index k = ceil(t / K), committed moments M, V (zero at start) and accumulator A (zero at start):

    A += g / K
    m  = b1 * M + (1 - b1) * g
    v  = b2 * V + (1 - b2) * g^2
    x -= lr / (1 - b1^k) * m / (sqrt(v) / sqrt(1 - b2^k) + eps)
    if t % K == 0:
        M = b1 * M + (1 - b1) * A
        V = b2 * V + (1 - b2) * A^2
        A = 0

With K = 1 the two are exactly torch.optim.Adam and torch.optim.AdamW (amsgrad off). Weight
decay, the state per parameter, the cross-check against the authors' code: docs/update_rules.md,
"AccumAdam and AccumAdamW".

Example::

    >>> import torch
    >>> from pipecomm.decentralized import AccumAdam
    >>> model, loss_fn = torch.nn.Linear(2, 1), torch.nn.functional.mse_loss
    >>> x, y = torch.ones(4, 2), torch.zeros(4, 1)
    >>> opt = AccumAdam(model.parameters(), lr=1.5e-3, accum_iter=8)
    >>> loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

__all__ = ["AccumAdam", "AccumAdamW"]


def _check_hparams(group: dict[str, Any]) -> None:
    lr, betas, eps, wd, k = (group[key] for key in ("lr", "betas", "eps", "weight_decay",
                                                     "accum_iter"))
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", wd)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value}")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, numbers.Real):
            raise TypeError(f"betas[{i}] must be a real number, got {type(b).__name__}")
        if not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"accum_iter must be an int >= 1, got {type(k).__name__} ({k!r})")
    if k < 1:
        raise ValueError(f"accum_iter must be >= 1 (1 gives plain Adam), got {k}")


class AccumAdam(Optimizer):
    """Adam whose moments are fed with gradients averaged over windows of ``accum_iter`` steps.

    L2 weight decay (``weight_decay * x`` added to the gradient). See the module docstring for
    the equations. Arguments as torch.optim.Adam plus ``accum_iter`` (K >= 1); every parameter
    group may override any of them.

    Example::

        >>> model, loss_fn = torch.nn.Linear(2, 1), torch.nn.functional.mse_loss
        >>> batches = [(torch.ones(4, 2), torch.zeros(4, 1))] * 4
        >>> opt = AccumAdam(model.parameters(), lr=1e-3, betas=(0.9, 0.999), accum_iter=4)
        >>> for x, y in batches:
        ...     opt.zero_grad()
        ...     loss_fn(model(x), y).backward()
        ...     opt.step()
        >>> opt.param_groups[0]["accum_iter"]
        4
    """

    _decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        accum_iter: int = 4,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas) if isinstance(betas, list) else betas, eps=eps,
                        weight_decay=weight_decay, accum_iter=accum_iter)
        _check_hparams(defaults)
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (as torch.optim.Optimizer), checking its hyper-parameters.

        Example::

            >>> model, head = torch.nn.Linear(2, 2), torch.nn.Linear(2, 1)
            >>> opt = AccumAdam(model.parameters(), lr=1e-3)
            >>> opt.add_param_group({"params": head.parameters(), "lr": 1e-4, "accum_iter": 2})
            >>> [g["accum_iter"] for g in opt.param_groups]
            [4, 2]
        """
        super().add_param_group(param_group)
        _check_hparams(self.param_groups[-1])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step (Algorithm 4); returns ``closure()``'s loss if a closure is given.

        Example::

            >>> model, loss_fn = torch.nn.Linear(2, 1), torch.nn.functional.mse_loss
            >>> x, y = torch.ones(4, 2), torch.zeros(4, 1)
            >>> opt = AccumAdam(model.parameters(), lr=1e-3)
            >>> loss = opt.step(lambda: loss_fn(model(x), y))   # closure re-evaluates the loss
            >>> loss.dim()
            0
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr = float(group["lr"])
            beta1, beta2 = (float(b) for b in group["betas"])
            eps, wd = float(group["eps"]), float(group["weight_decay"])
            k_acc = int(group["accum_iter"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["accum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] = t = int(state["step"]) + 1
                big_m, big_v, acc = state["exp_avg"], state["exp_avg_sq"], state["accum"]

                if wd != 0.0:
                    if self._decoupled:
                        p.mul_(1.0 - lr * wd)
                    else:
                        grad = grad.add(p, alpha=wd)

                acc.add_(grad, alpha=1.0 / k_acc)
                m = big_m.mul(beta1).add_(grad, alpha=1.0 - beta1)
                v = big_v.mul(beta2).addcmul_(grad, grad, value=1.0 - beta2)
                window = -(-t // k_acc)  # ceil(t / K)
                bias1 = 1.0 - beta1**window
                bias2 = 1.0 - beta2**window
                denom = v.sqrt_().div_(math.sqrt(bias2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / bias1)

                if t % k_acc == 0:
                    big_m.mul_(beta1).add_(acc, alpha=1.0 - beta1)
                    big_v.mul_(beta2).addcmul_(acc, acc, value=1.0 - beta2)
                    acc.zero_()
        return loss


class AccumAdamW(AccumAdam):
    """AccumAdam with decoupled weight decay: ``x *= 1 - lr * weight_decay`` before the update.

    Example::

        >>> model = torch.nn.Linear(2, 1)
        >>> opt = AccumAdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.98), weight_decay=0.1,
        ...                  accum_iter=8)
        >>> opt.param_groups[0]["weight_decay"]
        0.1
    """

    _decoupled = True  # same constructor and state as AccumAdam; only the decay differs
