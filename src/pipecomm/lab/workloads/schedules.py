"""Learning-rate schedules of the papers' training recipes: constant, or linear warm-up then
cosine decay (the DAdam paper's Transformer and ResNet recipes, and decent-dp's defaults).

One formula, used by every training loop of the experiments; it returns a stock
``torch.optim.lr_scheduler.LambdaLR``, so it attaches to any torch optimizer -- the one inside
:class:`pipecomm.pipesgd.PipeSGD`, or ``DecentralizedDataParallel.optimizer`` -- and checkpoints
with it. Call ``scheduler.step()`` once after every optimizer step.

Example::

    >>> from pipecomm.lab.workloads import schedules
    >>> model = torch.nn.Linear(2, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    >>> sched = schedules.build(opt, "warmup-cosine", total_steps=1000, warmup_steps=50)
    >>> for step in range(1000):
    ...     opt.step(); sched.step()
    >>> round(opt.param_groups[0]["lr"], 6)        # decayed to min_ratio x lr
    0.0
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

SCHEDULES = ("constant", "warmup-cosine")


def factor(step: int, *, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """The multiplier of the base learning rate before optimizer step ``step`` (0-based):
    ``(step + 1) / warmup_steps`` during warm-up, then cosine from 1 down to ``min_ratio`` at
    ``total_steps - 1``; ``min_ratio`` after that.

    Example::

        >>> factor(0, total_steps=100, warmup_steps=10, min_ratio=0.1)
        0.1
        >>> factor(99, total_steps=100, warmup_steps=10, min_ratio=0.1)
        0.1
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, total_steps - 1 - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build(
    optimizer: torch.optim.Optimizer,
    schedule: str,
    *,
    total_steps: int,
    warmup_steps: int = 0,
    min_ratio: float = 0.0,
) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` for ``schedule`` ("constant" or "warmup-cosine", see :func:`factor`).

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> sched = build(opt, "warmup-cosine", total_steps=1000, warmup_steps=50, min_ratio=0.1)
        >>> opt.param_groups[0]["lr"]                  # warm-up starts at lr / warmup_steps
        0.002
    """
    check(schedule, total_steps, warmup_steps, min_ratio)
    if schedule == "constant":
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _step: 1.0)
    fn = functools.partial(
        factor, total_steps=total_steps, warmup_steps=warmup_steps, min_ratio=min_ratio
    )
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def step(scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
    """``scheduler.step()`` without torch's warning that it ran before ``optimizer.step()``: a
    pipelined optimizer (``PipeSGD`` with staleness k) applies nothing during its first k
    iterations while the pipeline fills, yet the schedule counts every iteration.

    Example::

        >>> opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
        >>> sched = build(opt, "warmup-cosine", total_steps=1000, warmup_steps=50, min_ratio=0.1)
        >>> for _ in range(50):
        ...     step(sched)                          # no optimizer.step() yet: no warning
        >>> opt.param_groups[0]["lr"]
        0.1
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)`")
        scheduler.step()


def check(schedule: str, total_steps: int, warmup_steps: int, min_ratio: float) -> None:
    """ValueError naming the argument for a schedule that cannot run.

    Example::

        >>> check("warmup-cosine", 1000, 50, 0.1)
        >>> check("warmup-cosine", 10, 50, 0.1)
        Traceback (most recent call last):
        ValueError: warmup_steps=50 exceeds total_steps=10
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    for name, v in (("total_steps", total_steps), ("warmup_steps", warmup_steps)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"{name} must be an int >= 0, got {v!r}")
    if warmup_steps > total_steps:
        raise ValueError(f"warmup_steps={warmup_steps} exceeds total_steps={total_steps}")
    if isinstance(min_ratio, bool) or not isinstance(min_ratio, (int, float)) or not (
        0.0 <= min_ratio <= 1.0
    ):
        raise ValueError(f"min_ratio must be a number in [0, 1], got {min_ratio!r}")


def describe(schedule: str, warmup_steps: int, min_ratio: float) -> str:
    """The schedule as recorded in data.csv, e.g. ``"warmup-cosine(warmup=50,min=0.1)"``."""
    if schedule == "constant":
        return "constant"
    return f"{schedule}(warmup={warmup_steps},min={min_ratio:g})"
