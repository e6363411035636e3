"""pipecomm.lab.workloads.schedules against the closed form, and its argument errors."""

import math

import pytest
import torch

from pipecomm.lab.workloads import schedules


def _closed_form(step: int, total: int, warmup: int, lo: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    return lo + (1 - lo) * (1 + math.cos(math.pi * t)) / 2


@pytest.mark.parametrize("total,warmup,lo", [(100, 10, 0.1), (7, 0, 0.0), (5, 5, 0.5), (1, 0, 0.0)])
def test_warmup_cosine_follows_closed_form(total, warmup, lo):
    w = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([w], lr=0.2)
    sched = schedules.build(opt, "warmup-cosine", total_steps=total, warmup_steps=warmup, min_ratio=lo)
    got = []
    for _ in range(total + 3):
        got.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    want = [0.2 * _closed_form(s, total, warmup, lo) for s in range(total + 3)]
    assert got == pytest.approx(want, rel=1e-12)
    if warmup:
        assert got[warmup - 1] == pytest.approx(0.2)  # peak reached at the end of warm-up
    assert got[total - 1] == pytest.approx(0.2 * (lo if total - 1 > warmup else 1.0))
    assert all(a >= b - 1e-15 for a, b in zip(got[warmup:], got[warmup + 1:]))  # never rises after


def test_constant_keeps_the_rate():
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([w], lr=3e-3)
    sched = schedules.build(opt, "constant", total_steps=10)
    for _ in range(12):
        assert opt.param_groups[0]["lr"] == 3e-3
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    "args,name",
    [
        (("cosine", 10, 0, 0.0), "schedule"),
        (("warmup-cosine", -1, 0, 0.0), "total_steps"),
        (("warmup-cosine", 10, 1.5, 0.0), "warmup_steps"),
        (("warmup-cosine", 10, 11, 0.0), "warmup_steps"),
        (("warmup-cosine", 10, 2, 1.5), "min_ratio"),
        (("warmup-cosine", 10, 2, True), "min_ratio"),
        (("warmup-cosine", True, 2, 0.0), "total_steps"),
    ],
)
def test_bad_arguments_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        schedules.check(*args)
    w = torch.nn.Parameter(torch.zeros(1))
    with pytest.raises(ValueError, match=name):
        schedules.build(torch.optim.SGD([w], lr=0.1), args[0], total_steps=args[1],
                        warmup_steps=args[2], min_ratio=args[3])


def test_describe():
    assert schedules.describe("constant", 0, 0.0) == "constant"
    assert schedules.describe("warmup-cosine", 50, 0.1) == "warmup-cosine(warmup=50,min=0.1)"


def test_step_is_silent_when_the_optimizer_has_not_stepped_yet():
    """A pipelined optimizer skips its first step (the pipeline fills); the schedule still counts
    it, and torch's order warning is not shown."""
    import warnings

    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = schedules.build(opt, "warmup-cosine", total_steps=10, warmup_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schedules.step(sched)  # no optimizer.step() before it
    assert opt.param_groups[0]["lr"] == pytest.approx(1.0)  # step 1: end of warm-up
