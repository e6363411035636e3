"""Tests of AccumAdam / AccumAdamW against a float64 reference of docs/update_rules.md."""

from __future__ import annotations

import copy
import io
import math

import numpy as np
import pytest
import torch

from pipecomm.decentralized import AccumAdam, AccumAdamW

SHAPES = [(3, 4), (7,), (), (0,), (2, 0, 3), (5, 1)]


class Reference:
    """Algorithm 4 of docs/update_rules.md in float64 numpy, one parameter array at a time."""

    def __init__(self, x, lr, betas, eps, wd, k, decoupled):
        self.x = np.array(x, dtype=np.float64)
        self.lr, (self.b1, self.b2), self.eps, self.wd, self.k = lr, betas, eps, wd, k
        self.decoupled = decoupled
        self.t = 0
        self.M = np.zeros_like(self.x)
        self.V = np.zeros_like(self.x)
        self.A = np.zeros_like(self.x)

    def step(self, g):
        g = np.array(g, dtype=np.float64)
        self.t += 1
        window = math.ceil(self.t / self.k)
        if self.wd and not self.decoupled:
            g = g + self.wd * self.x
        if self.wd and self.decoupled:
            self.x = self.x * (1 - self.lr * self.wd)
        self.A = self.A + g / self.k
        m = self.b1 * self.M + (1 - self.b1) * g
        v = self.b2 * self.V + (1 - self.b2) * g * g
        self.x = self.x - self.lr / (1 - self.b1**window) * m / (
            np.sqrt(v) / np.sqrt(1 - self.b2**window) + self.eps
        )
        if self.t % self.k == 0:
            self.M = self.b1 * self.M + (1 - self.b1) * self.A
            self.V = self.b2 * self.V + (1 - self.b2) * self.A**2
            self.A = np.zeros_like(self.A)


def _params(dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
        for s in SHAPES
    ]


@pytest.mark.parametrize("cls", [AccumAdam, AccumAdamW])
@pytest.mark.parametrize("k", [1, 3, 4])
@pytest.mark.parametrize("wd", [0.0, 0.05])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_float64_reference(cls, k, wd, dtype):
    lr, betas, eps = 0.01, (0.8, 0.95), 1e-6
    params = _params(dtype)
    refs = [
        Reference(p.detach().double().numpy(), lr, betas, eps, wd, k, cls is AccumAdamW)
        for p in params
    ]
    opt = cls(params, lr=lr, betas=betas, eps=eps, weight_decay=wd, accum_iter=k)
    rng = np.random.default_rng(1)
    steps = 3 * k + 2  # three full windows and a partial one
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-6)
    for _ in range(steps):
        for p, ref in zip(params, refs):
            g = np.asarray(rng.standard_normal(p.shape) * rng.choice([1e-3, 1.0, 10.0]))
            p.grad = torch.from_numpy(g).to(dtype)
            ref.step(g)
        opt.step()
        for p, ref in zip(params, refs):
            assert p.dtype == dtype
            np.testing.assert_allclose(p.detach().double().numpy(), ref.x, **tol)
    # committed state equals the reference's (M, V, A)
    for p, ref in zip(params, refs):
        st = opt.state[p]
        assert st["step"] == steps
        np.testing.assert_allclose(st["exp_avg"].double().numpy(), ref.M, **tol)
        np.testing.assert_allclose(st["exp_avg_sq"].double().numpy(), ref.V, **tol)
        np.testing.assert_allclose(st["accum"].double().numpy(), ref.A, **tol)


def test_moments_committed_only_at_window_ends():
    p = torch.zeros(5, requires_grad=True)
    opt = AccumAdam([p], lr=0.1, betas=(0.5, 0.75), accum_iter=3)
    grads = [torch.full((5,), float(v)) for v in (1.0, 2.0, 6.0, -3.0)]
    for t, g in enumerate(grads, start=1):
        p.grad = g.clone()
        opt.step()
        st = opt.state[p]
        if t < 3:
            assert torch.count_nonzero(st["exp_avg"]) == 0
            assert torch.count_nonzero(st["exp_avg_sq"]) == 0
        if t == 3:  # A = (1 + 2 + 6) / 3 = 3 -> M = 0.5 * 3, V = 0.25 * 9
            torch.testing.assert_close(st["exp_avg"], torch.full((5,), 1.5))
            torch.testing.assert_close(st["exp_avg_sq"], torch.full((5,), 2.25))
            assert torch.count_nonzero(st["accum"]) == 0
        if t == 4:  # a new window: A = -3 / 3, moments unchanged
            torch.testing.assert_close(st["accum"], torch.full((5,), -1.0))
            torch.testing.assert_close(st["exp_avg"], torch.full((5,), 1.5))


@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize(
    "ours,theirs", [(AccumAdam, torch.optim.Adam), (AccumAdamW, torch.optim.AdamW)]
)
def test_k1_is_torch_adam(ours, theirs, wd):
    """With accum_iter=1, AccumAdam is torch.optim.Adam (L2) and AccumAdamW is AdamW."""
    a = _params(torch.float64, seed=3)
    b = [p.detach().clone().requires_grad_() for p in a]
    kw = dict(lr=0.02, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd)
    opt_a, opt_b = ours(a, accum_iter=1, **kw), theirs(b, **kw)
    rng = np.random.default_rng(4)
    for _ in range(12):
        for pa, pb in zip(a, b):
            g = torch.from_numpy(np.asarray(rng.standard_normal(pa.shape)))
            pa.grad, pb.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
        for pa, pb in zip(a, b):
            torch.testing.assert_close(pa, pb, rtol=1e-12, atol=1e-14)
    for pa, pb in zip(a, b):
        torch.testing.assert_close(opt_a.state[pa]["exp_avg"], opt_b.state[pb]["exp_avg"])


def test_k_gt_1_differs_from_adam():
    a = [torch.ones(4, requires_grad=True)]
    b = [torch.ones(4, requires_grad=True)]
    opt_a, opt_b = AccumAdam(a, lr=0.1, accum_iter=2), torch.optim.Adam(b, lr=0.1)
    for g in (1.0, -1.0, 2.0):
        a[0].grad, b[0].grad = torch.full((4,), g), torch.full((4,), g)
        opt_a.step()
        opt_b.step()
    assert not torch.allclose(a[0], b[0])


def test_adamw_decay_is_decoupled():
    """Zero gradient: AccumAdamW only shrinks x by (1 - lr*wd); AccumAdam's L2 term moves it by
    an Adam step of the gradient wd*x (sign of x, magnitude about lr)."""
    lr, wd = 0.01, 0.5
    x0 = torch.tensor([2.0, -4.0, 0.5], dtype=torch.float64)
    pw = x0.clone().requires_grad_()
    pl = x0.clone().requires_grad_()
    ow = AccumAdamW([pw], lr=lr, weight_decay=wd, accum_iter=2)
    ol = AccumAdam([pl], lr=lr, weight_decay=wd, accum_iter=2)
    pw.grad = torch.zeros_like(x0)
    pl.grad = torch.zeros_like(x0)
    ow.step()
    ol.step()
    torch.testing.assert_close(pw.detach(), x0 * (1 - lr * wd))
    # L2: g = wd*x, m/(sqrt(v)/sqrt(1-b2)) = sign(g) up to eps at the first step
    torch.testing.assert_close(pl.detach(), x0 - lr * torch.sign(x0), rtol=1e-6, atol=1e-8)
    # AccumAdamW's accumulator never sees the decay
    assert torch.count_nonzero(ow.state[pw]["accum"]) == 0
    torch.testing.assert_close(ol.state[pl]["accum"], wd * x0 / 2)


def test_params_without_grad_skipped_and_zero_grad_stepped():
    p_none = torch.randn(3, requires_grad=True)
    p_zero = torch.randn(3, requires_grad=True)
    p_live = torch.randn(3, requires_grad=True)
    before = [p.detach().clone() for p in (p_none, p_zero, p_live)]
    opt = AccumAdam([p_none, p_zero, p_live], lr=0.1, accum_iter=2)
    p_zero.grad = torch.zeros(3)
    p_live.grad = torch.ones(3)
    opt.step()
    assert p_none not in opt.state or len(opt.state[p_none]) == 0
    torch.testing.assert_close(p_none.detach(), before[0])
    # a zero gradient with zero moments is a step of size zero, but a step nonetheless
    torch.testing.assert_close(p_zero.detach(), before[1])
    assert opt.state[p_zero]["step"] == 1
    torch.testing.assert_close(p_live.detach(), before[2] - 0.1, rtol=1e-5, atol=1e-6)
    # the step counter of a parameter without a gradient does not advance
    p_none.grad = torch.ones(3)
    p_live.grad = None
    opt.step()
    assert opt.state[p_none]["step"] == 1 and opt.state[p_live]["step"] == 1


def _run(opt, params, grads):
    for g in grads:
        for p, gi in zip(params, g):
            p.grad = gi.clone()
        opt.step()


@pytest.mark.parametrize("cls", [AccumAdam, AccumAdamW])
@pytest.mark.parametrize("split", [1, 4, 5])
def test_state_dict_resume_identical(cls, split):
    """Stop mid-window, save, load into a fresh optimizer: the trajectory is the same."""
    kw = dict(lr=0.05, betas=(0.9, 0.98), weight_decay=0.01, accum_iter=3)
    gen = torch.Generator().manual_seed(7)
    grads = [[torch.randn(s, generator=gen) for s in ((4, 3), (2,))] for _ in range(10)]
    a = [
        torch.randn(4, 3, generator=gen).requires_grad_(),
        torch.randn(2, generator=gen).requires_grad_(),
    ]
    b = [p.detach().clone().requires_grad_() for p in a]

    opt_a = cls(a, **kw)
    _run(opt_a, a, grads)

    opt_b = cls(b, **kw)
    _run(opt_b, b, grads[:split])
    buf = io.BytesIO()
    torch.save({"params": [p.detach() for p in b], "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    c = [p.clone().requires_grad_() for p in saved["params"]]
    opt_c = cls(c, lr=1.0, accum_iter=1)  # hyper-parameters come from the state dict
    opt_c.load_state_dict(saved["opt"])
    assert opt_c.param_groups[0]["accum_iter"] == 3
    _run(opt_c, c, grads[split:])
    for pa, pc in zip(a, c):
        torch.testing.assert_close(pa, pc, rtol=0, atol=0)
    # the state dict carries step, M, V, A
    st = copy.deepcopy(opt_a.state_dict())["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq", "accum"} and st["step"] == 10


def test_param_groups_own_hyperparameters():
    p1 = torch.zeros(2, requires_grad=True)
    p2 = torch.zeros(2, requires_grad=True)
    opt = AccumAdam([{"params": [p1]}, {"params": [p2], "lr": 0.5, "accum_iter": 1}], lr=0.1)
    assert opt.param_groups[0]["accum_iter"] == 4 and opt.param_groups[1]["accum_iter"] == 1
    p1.grad, p2.grad = torch.ones(2), torch.ones(2)
    opt.step()
    torch.testing.assert_close(p1.detach(), torch.full((2,), -0.1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(p2.detach(), torch.full((2,), -0.5), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="accum_iter must be >= 1"):
        opt.add_param_group({"params": [torch.zeros(1, requires_grad=True)], "accum_iter": 0})


def test_closure_returns_loss():
    p = torch.ones(3, requires_grad=True)
    opt = AccumAdam([p], lr=0.1, accum_iter=2)

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(3.0)
    assert (p < 1).all()


def test_bfloat16_params_keep_dtype():
    p = torch.randn(8, dtype=torch.bfloat16, requires_grad=True)
    opt = AccumAdamW([p], lr=0.01, accum_iter=2)
    for _ in range(3):
        p.grad = torch.randn(8, dtype=torch.bfloat16)
        opt.step()
    assert p.dtype == torch.bfloat16 and opt.state[p]["exp_avg"].dtype == torch.bfloat16
    assert torch.isfinite(p).all()


@pytest.mark.parametrize(
    "kw,exc,match",
    [
        (dict(lr=-1e-3), ValueError, "lr must be finite and >= 0"),
        (dict(lr=float("nan")), ValueError, "lr must be finite"),
        (dict(lr="1e-3"), TypeError, "lr must be a real number"),
        (dict(betas=(1.0, 0.999)), ValueError, r"betas\[0\] must be in \[0, 1\)"),
        (dict(betas=(0.9, -0.1)), ValueError, r"betas\[1\] must be in \[0, 1\)"),
        (dict(betas=(0.9,)), ValueError, "betas must be a pair"),
        (dict(eps=-1.0), ValueError, "eps must be finite and >= 0"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay must be finite and >= 0"),
        (dict(accum_iter=0), ValueError, r"accum_iter must be >= 1"),
        (dict(accum_iter=2.5), TypeError, "accum_iter must be an int"),
        (dict(accum_iter=True), TypeError, "accum_iter must be an int"),
    ],
)
@pytest.mark.parametrize("cls", [AccumAdam, AccumAdamW])
def test_bad_arguments(cls, kw, exc, match):
    with pytest.raises(exc, match=match):
        cls([torch.zeros(2, requires_grad=True)], **kw)


def test_sparse_gradient_rejected():
    p = torch.zeros(3, requires_grad=True)
    opt = AccumAdam([p])
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()


def test_defaults_match_design():
    p = torch.zeros(1, requires_grad=True)
    for cls in (AccumAdam, AccumAdamW):
        d = cls([p]).defaults
        assert d == dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, accum_iter=4)
