"""pipecomm.pipesgd.PipeSGD: sync, layer-wise and pipelined (staleness k) SGD against oracles.

The oracle is a single-process float64 simulation of the rule in docs/update_rules.md: with g(w)
the gradient averaged over all ranks, ``w_{t+1} = step(w_t, g(w_{t-k}))`` for t >= k and
``w_{t+1} = w_t`` for t < k, checked after *every* step, on 1 (in this process), 2, 3 and 4
ranks, with SGD+momentum and Adam, several collective algorithms, finish(), resume from a
checkpoint taken with reductions in flight, compression (within a derived error bound), real
overlap under an emulated network, bad arguments, and the torch Optimizer interface (lr schedulers attached to the PipeSGD,
zero_grad, step(closure), state_dict, timing off by default).
"""

from __future__ import annotations

import io
import math
import warnings

import pytest
import rankfns_pipesgd as fns
import torch
from torch import nn

from pipecomm.lab.networks import netem
from pipecomm.pipesgd import TIMING_KEYS, PipeSGD

STEPS = 7
TIMEOUT = 120.0


# --------------------------------------------------------------------------- the oracle


def simulate(cfg: dict, p: int) -> dict:
    """Float64 single-process simulation of ``fns.train(cfg)`` on ``p`` ranks."""
    c = dict(cfg, dtype="float64")
    model = fns.make_model(c)
    opt = fns.make_optimizer(c, model)
    sched = fns.make_scheduler(c, opt)
    k = cfg.get("staleness")
    k = (1 if cfg["mode"] == "pipe" else 0) if k is None else k
    params = list(model.parameters())
    queue: list[list] = []
    out: dict = {"traj": [], "in_flight": []}

    def apply(grads: list) -> None:
        for prm, g in zip(params, grads):
            prm.grad = g
        opt.step()

    def iterate(t: int) -> None:
        total = [None] * len(params)
        for r in range(p):
            x, y = fns.batch(c, r, t)
            model.zero_grad()
            fns.loss_fn(model, x, y).backward()
            for j, prm in enumerate(params):
                if prm.grad is not None:
                    g = prm.grad.clone()
                    total[j] = g if total[j] is None else total[j] + g
        queue.append([None if g is None else g / p for g in total])
        if len(queue) > k:
            apply(queue.pop(0))
        if sched is not None:
            with warnings.catch_warnings():  # the bare optimizer is not stepped while t < k
                warnings.simplefilter("ignore", UserWarning)
                sched.step()
        out["traj"].append(fns.flat_params(model))
        out["in_flight"].append(len(queue))

    def finish() -> None:
        while queue:
            apply(queue.pop(0))

    for t in range(cfg["steps"]):
        iterate(t)
    finish()
    out["finished"] = fns.flat_params(model)
    for t in range(cfg["steps"], cfg["steps"] + cfg.get("extra_steps", 0)):
        iterate(t)
    finish()
    out["final"] = fns.flat_params(model)
    return out


def tolerance(cfg: dict) -> float:
    return 1e-10 if cfg.get("dtype", "float64") == "float64" else 2e-4


def assert_matches(got: dict, want: dict, cfg: dict, rank: int) -> None:
    tol = tolerance(cfg)
    assert len(got["traj"]) == len(want["traj"])
    for t, (a, b) in enumerate(zip(got["traj"], want["traj"])):
        err = (a - b).abs().max().item()
        assert err <= tol, f"{cfg} rank {rank}: w_{t + 1} differs from the oracle by {err:.3g}"
    for key in ("finished", "final"):
        err = (got[key] - want[key]).abs().max().item()
        assert err <= tol, f"{cfg} rank {rank}: {key} parameters differ by {err:.3g}"
    assert got["in_flight"] == want["in_flight"], cfg


def check_timings(res: dict, cfg: dict, p: int) -> None:
    k = cfg.get("staleness")
    k = (1 if cfg["mode"] == "pipe" else 0) if k is None else k
    step_recs = [r for r in res["timings"] if r["iteration"] is not None]
    n_steps = cfg["steps"] + cfg.get("extra_steps", 0)
    assert [r["iteration"] for r in step_recs] == list(range(n_steps))
    assert [r["applied"] for r in step_recs[: cfg["steps"]]] == [
        t >= k for t in range(cfg["steps"])
    ]
    for r in res["timings"]:
        assert set(r) == set(TIMING_KEYS)
        parts = r["compute_s"] + r["launch_s"] + r["comm_s"] + r["update_s"]
        assert all(r[key] >= 0 for key in TIMING_KEYS if key.endswith("_s"))
        assert parts <= r["iter_s"] * (1 + 1e-9) + 1e-6
    assert res["totals"]["iterations"] == n_steps
    assert res["totals"]["updates"] == res["updates"]
    if p > 1 and cfg["mode"] == "sync":
        assert res["totals"]["comm_s"] > 0


# --------------------------------------------------------------------------- configurations

BASE = {"steps": STEPS, "seed": 3, "dtype": "float64"}

CASES = {
    2: [
        dict(BASE, mode="pipe", staleness=1, algorithm="torch", opt="sgdm", extra_steps=3),
        dict(BASE, mode="layerwise", algorithm="torch", opt="adam", bucket_mb=1e-4),
        dict(
            BASE, mode="pipe", staleness=2, algorithm="lp", opt="sgdm", sched="step", timing=False
        ),
        dict(BASE, mode="layerwise", algorithm="lp", opt="adam", sched="lambda", closure=True),
        dict(BASE, mode="sync", algorithm="lp", opt="adam", dtype="float32"),
        dict(
            BASE,
            mode="pipe",
            staleness=2,
            algorithm="mst",
            opt="adam",
            extra_steps=3,
            set_to_none=False,
        ),
    ],
    3: [
        dict(BASE, mode="sync", algorithm="lp", opt="sgdm", unused=True),
        dict(BASE, mode="layerwise", algorithm="lp", opt="sgdm", unused=True, bucket_mb=1e-4),
        dict(BASE, mode="pipe", staleness=1, algorithm="lp", opt="adam", extra_steps=3),
        dict(BASE, mode="pipe", staleness=2, algorithm="ring", opt="sgdm", extra_steps=3),
        dict(BASE, mode="layerwise", algorithm="ring", opt="adam", set_to_none=False),
        dict(
            BASE,
            mode="pipe",
            staleness=1,
            algorithm="be",
            opt="sgdm",
            dtype="float32",
            extra_steps=2,
            set_to_none=False,
        ),
        dict(BASE, mode="pipe", staleness=0, algorithm="lp", opt="sgdm"),
        dict(BASE, mode="sync", algorithm="ring", opt="adam", sched="step", zero_grad="model"),
        dict(
            BASE, mode="pipe", staleness=1, algorithm="lp", opt="sgdm", sched="lambda", closure=True
        ),
    ],
    4: [
        dict(BASE, mode="pipe", staleness=2, algorithm="lp", opt="adam", extra_steps=3),
        dict(BASE, mode="layerwise", algorithm="lp", opt="adam", bucket_mb=2e-4),
        dict(BASE, mode="sync", algorithm="ring", opt="sgdm", block_bytes=40),
    ],
}


@pytest.mark.parametrize("p", sorted(CASES))
def test_trajectories_match_float64_simulation(pool, p):
    cfgs = CASES[p]
    results = pool(p).run(fns.train_many, cfgs, timeout_s=TIMEOUT)
    for cfg_index, cfg in enumerate(cfgs):
        want = simulate(cfg, p)
        per_rank = [results[r][cfg_index] for r in range(p)]
        for r, got in enumerate(per_rank):
            assert_matches(got, want, cfg, r)
            if cfg.get("timing", True):
                check_timings(got, cfg, p)
        # replicas stay bitwise identical
        for got in per_rank[1:]:
            assert all(torch.equal(a, b) for a, b in zip(got["traj"], per_rank[0]["traj"]))


@pytest.mark.parametrize(("p", "algorithm"), [(3, "lp"), (2, "ring"), (4, "lp")])
def test_layerwise_equals_sync(pool, p, algorithm):
    base = dict(BASE, algorithm=algorithm, opt="adam", unused=True)
    cfgs = [
        dict(base, mode="sync"),
        dict(base, mode="layerwise", bucket_mb=1e-4),
        dict(base, mode="layerwise"),
    ]
    sync, tiny_buckets, one_bucket = pool(p).run(fns.train_many, cfgs, timeout_s=TIMEOUT)[0]
    for other in (tiny_buckets, one_bucket):
        for a, b in zip(sync["traj"], other["traj"]):
            if algorithm == "lp":  # the chain adds every element in the same order: same bits
                assert torch.equal(a, b)
            else:
                assert (a - b).abs().max().item() <= 1e-12


def test_sync_changes_parameters(pool):
    """Guard against a vacuous oracle: the runs really move the parameters."""
    cfg = dict(BASE, mode="sync", algorithm="lp", opt="sgdm")
    res = pool(2).run(fns.train_many, [cfg], timeout_s=TIMEOUT)[0][0]
    start = fns.flat_params(fns.make_model(cfg))
    assert (res["final"] - start).abs().max().item() > 1e-2


# --------------------------------------------------------------------------- resume


@pytest.mark.parametrize(
    ("p", "cfg"),
    [
        (3, dict(BASE, mode="pipe", staleness=2, algorithm="lp", opt="adam", steps=9, ckpt_at=4)),
        (2, dict(BASE, mode="pipe", staleness=1, algorithm="ring", opt="sgdm", steps=8, ckpt_at=5)),
        (
            2,
            dict(
                BASE,
                mode="pipe",
                staleness=2,
                algorithm="lp",
                opt="adam",
                steps=8,
                ckpt_at=3,
                sched="step",
                timing=False,
            ),
        ),
        (
            3,
            dict(
                BASE,
                mode="layerwise",
                algorithm="lp",
                opt="adam",
                steps=7,
                ckpt_at=3,
                bucket_mb=1e-4,
            ),
        ),
    ],
)
def test_resume_with_reductions_in_flight(pool, p, cfg):
    results = pool(p).run(fns.resume, cfg, timeout_s=TIMEOUT)
    k = cfg.get("staleness") or 0
    want = simulate(cfg, p)
    for r, res in enumerate(results):
        assert res["in_flight_at_ckpt"] == k
        assert res["loaded_iteration"] == cfg["ckpt_at"]
        first, second = res["first"], res["second"]
        assert len(first["traj"]) == len(second["traj"]) == cfg["steps"] - cfg["ckpt_at"]
        for a, b in zip(first["traj"], second["traj"]):
            assert torch.equal(a, b), f"rank {r}: the resumed run diverged"
        assert torch.equal(first["finished"], second["finished"])
        for a, b in zip(second["traj"], want["traj"][cfg["ckpt_at"] :]):
            assert (a - b).abs().max().item() <= 1e-10


@pytest.mark.parametrize(
    ("serialize", "sched"), [(True, None), (False, None), (True, "step"), (False, "lambda")]
)
def test_resume_world_size_one(serialize, sched):
    cfg = dict(
        BASE,
        mode="pipe",
        staleness=2,
        opt="adam",
        steps=8,
        ckpt_at=3,
        serialize=serialize,
        sched=sched,
    )
    res = fns.resume(cfg)
    assert res["in_flight_at_ckpt"] == 2
    for a, b in zip(res["first"]["traj"], res["second"]["traj"]):
        assert torch.equal(a, b)
    assert torch.equal(res["first"]["finished"], res["second"]["finished"])


# --------------------------------------------------------------------------- compression

# Per encoding, ||decode(encode(x)) - x||_inf <= U * ||x||_inf + A (compress.py's documented
# bounds: fp16 and bf16 round to nearest, relative 2^-11 / 2^-8, fp16 subnormal spacing 2^-24;
# int8 per chunk max/254, plus float32 round-off of the scale arithmetic).
CODEC_BOUNDS = {
    "fp16": (2.0**-11, 2.0**-25),
    "bf16": (2.0**-8, 0.0),
    "int8": (1 / 254 + 2**-22, 0.0),
}


def hessian_inf_norm(cfg: dict, p: int, steps: int) -> float:
    """max over iterations of ||H_t||_inf for the rank-averaged MSE loss of the linear model
    (its gradient is affine in the parameters, so H_t is exact and constant in w)."""
    c = dict(cfg, dtype="float64")
    worst = 0.0
    for t in range(steps):
        batches = [fns.batch(c, r, t) for r in range(p)]

        def loss(v: torch.Tensor, batches=batches) -> torch.Tensor:
            w = v[: fns.D_OUT * fns.D_IN].view(fns.D_OUT, fns.D_IN)
            b = v[fns.D_OUT * fns.D_IN :]
            return sum(torch.nn.functional.mse_loss(x @ w.T + b, y) for x, y in batches) / p

        n = fns.D_OUT * fns.D_IN + fns.D_OUT
        h = torch.autograd.functional.hessian(loss, torch.zeros(n, dtype=torch.float64))
        worst = max(worst, h.abs().sum(dim=1).max().item())
    return worst


def compression_bound(cfg: dict, p: int, gmax_per_rank: list[list[float]]) -> list[float]:
    """Bound on ||w_hat_t - w_t||_inf after every step (see the derivation in the test)."""
    u, a = CODEC_BOUNDS[cfg["compression"]]
    k, lr, steps = cfg["staleness"], cfg["lr"], cfg["steps"]
    big_l = hessian_inf_norm(cfg, p, steps)
    # error of the averaged gradient of iteration s: the partial sums of every encoding are
    # bounded by S = sum_i |g_i| elementwise, ||S||_inf <= sum_i max|g_i|; at most 2p encodings,
    # each error divided by p in the average -> E_s <= 2 (u ||S||_inf + a).
    e = [2 * (u * sum(g[s] for g in gmax_per_rank) + a) * 1.01 for s in range(steps)]
    d, bounds = 0.0, []
    for t in range(steps):
        if t >= k:  # delta_{t+1} = delta_t - lr H (delta_{t-k}) - lr e_{t-k}; D = running max
            d = d * (1 + lr * big_l) + lr * e[t - k]
        bounds.append(d + 1e-12)
    return bounds


@pytest.mark.parametrize(
    ("compression", "algorithm", "staleness"),
    [("fp16", "lp", 1), ("int8", "ring", 1), ("int8", "lp", 2), ("bf16", "lp", 0)],
)
def test_compressed_trajectory_within_derived_bound(pool, compression, algorithm, staleness):
    """Derivation. Linear model, MSE, plain SGD: g(w) is affine, g(w') - g(w) = H_t (w' - w).
    With compression the applied gradient is g(w_hat_{t-k}) + e_{t-k}, so
    delta_{t+1} = delta_t - lr H_{t-k} delta_{t-k} - lr e_{t-k}, hence with D_t = max_{s<=t}
    ||delta_s||_inf:  D_{t+1} <= (1 + lr ||H||_inf) D_t + lr ||e_{t-k}||_inf, D_t = 0 for t <= k."""
    p = 3
    cfg = dict(
        BASE,
        model="linear",
        opt="sgd",
        lr=0.1,
        mode="pipe",
        staleness=staleness,
        algorithm=algorithm,
        compression=compression,
        steps=8,
    )
    results = pool(p).run(fns.train_many, [cfg], timeout_s=TIMEOUT)
    reference = simulate(dict(cfg, compression=None), p)
    bounds = compression_bound(cfg, p, [results[r][0]["gmax"] for r in range(p)])
    start = fns.flat_params(fns.make_model(cfg))
    moved = (reference["traj"][-1] - start).abs().max().item()
    assert bounds[-1] < 0.2 * moved, "the bound should be tight enough to mean something"
    for r in range(p):
        got = results[r][0]
        errs = [(a - b).abs().max().item() for a, b in zip(got["traj"], reference["traj"])]
        for t, (err, bound) in enumerate(zip(errs, bounds)):
            assert err <= bound, f"rank {r} step {t}: error {err:.3g} > bound {bound:.3g}"
        assert errs[-1] > 0, "compression had no effect: was it applied?"
        assert got["totals"]["compress_s"] > 0
        assert torch.equal(got["traj"][-1], results[0][0]["traj"][-1])  # replicas stay equal


# --------------------------------------------------------------------------- overlap


def test_pipe_really_overlaps_communication(pool):
    """Emulated 40 ms links (an LP allreduce of 2 ranks takes >= 2 steps, >= 80 ms) and an
    80 ms compute: sync costs about C + A per iteration, pipe about max(C, A)."""
    net = netem.Network(alpha_s=0.04, bandwidth_Bps=100e6, ports="single")
    cfg = {"compute_s": 0.08, "warmup": 2, "steps": 6, "seed": 0, "dtype": "float64"}
    res = pool(2, network=net).run(fns.overlap, cfg, timeout_s=TIMEOUT)
    for r in res:
        sync, pipe = r["sync"], r["pipe"]
        assert sync["totals"]["comm_s"] >= 0.9 * 0.08 * cfg["steps"]  # blocked for A each step
        assert pipe["totals"]["comm_s"] < 0.5 * sync["totals"]["comm_s"]
        assert pipe["elapsed"] < 0.8 * sync["elapsed"]
        assert sync["totals"]["compute_s"] >= 0.08 * cfg["steps"]


# --------------------------------------------------------------------------- errors on ranks


def test_layerwise_two_backward_passes_raise(pool):
    cfg = dict(BASE, mode="layerwise", algorithm="lp", bucket_mb=1e-4)
    messages = pool(2).run(fns.layerwise_double_backward, cfg, timeout_s=TIMEOUT)
    assert all("accumulated twice" in m for m in messages), messages


def test_mismatched_replicas_raise_everywhere(pool):
    messages = pool(2).run(fns.mismatched_replicas, dict(BASE), timeout_s=TIMEOUT)
    assert all("staleness" in m for m in messages), messages


def test_broadcast_of_initial_parameters(pool):
    flats = pool(3).run(fns.broadcast_init, dict(BASE, algorithm="ring"), timeout_s=TIMEOUT)
    want = fns.flat_params(fns.make_model(dict(BASE), seed=1000))
    for f in flats:
        assert torch.equal(f, want)


# --------------------------------------------------------------------------- world size 1


@pytest.mark.parametrize(
    "cfg",
    [
        dict(BASE, mode="sync", opt="adam", extra_steps=2),
        dict(BASE, mode="layerwise", opt="sgdm", unused=True),
        dict(BASE, mode="pipe", opt="sgdm", extra_steps=3, set_to_none=False),
        dict(BASE, mode="pipe", staleness=2, opt="adam", extra_steps=3),
        dict(BASE, mode="pipe", staleness=3, opt="sgdm", compression="int8"),
    ],
)
def test_world_size_one_keeps_staleness(cfg):
    got = fns.train(cfg)
    want = simulate(cfg, 1)
    for a, b in zip(got["traj"], want["traj"]):
        assert torch.equal(a, b)  # same operations in the same order: same bits
    assert torch.equal(got["final"], want["final"])
    assert got["in_flight"] == want["in_flight"]
    check_timings(got, cfg, 1)


def test_sync_world_size_one_equals_plain_loop():
    cfg = dict(BASE, mode="sync", opt="adam")
    got = fns.train(cfg)
    model = fns.make_model(cfg)
    opt = fns.make_optimizer(cfg, model)
    for t in range(cfg["steps"]):
        x, y = fns.batch(cfg, 0, t)
        opt.zero_grad()
        fns.loss_fn(model, x, y).backward()
        opt.step()
        assert torch.equal(fns.flat_params(model), got["traj"][t])


def test_grads_after_step_and_reset_timings():
    cfg = dict(BASE, mode="pipe", staleness=1, opt="sgd")
    model = fns.make_model(cfg)
    trainer = PipeSGD(model, fns.make_optimizer(cfg, model), mode="pipe", timing=True)
    x, y = fns.batch(cfg, 0, 0)
    fns.loss_fn(model, x, y).backward()
    g0 = [p.grad.clone() for p in model.parameters()]
    trainer.step()
    assert all(p.grad is None for p in model.parameters())  # nothing applied yet
    assert trainer.in_flight == 1 and trainer.updates == 0
    model.zero_grad()
    fns.loss_fn(model, x * 2, y).backward()
    trainer.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), g0))  # applied g_0
    assert len(trainer.timings) == 2
    trainer.reset_timings()
    assert len(trainer.timings) == 0 and trainer.timing_totals["iterations"] == 0
    trainer.finish()
    assert trainer.in_flight == 0 and trainer.updates == 2
    assert trainer.timings[-1]["iteration"] is None and trainer.timings[-1]["applied"]
    trainer.finish()  # nothing in flight: a no-op
    assert trainer.updates == 2


# --------------------------------------------------------------------------- bad arguments


def _model_opt():
    model = fns.make_model(dict(BASE))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "exc", "words"),
    [
        (dict(mode="async"), ValueError, "mode"),
        (dict(mode="pipe", staleness=-1), ValueError, "staleness"),
        (dict(mode="sync", staleness=1), ValueError, "staleness"),
        (dict(mode="layerwise", staleness=2), ValueError, "staleness"),
        (dict(mode="pipe", staleness=1.5), TypeError, "staleness"),
        (dict(mode="pipe", staleness=True), TypeError, "staleness"),
        (dict(algorithm="tree"), ValueError, "algorithm"),
        (dict(compression="fp8"), ValueError, "compression"),
        (dict(compression="fp16", algorithm="mst"), ValueError, "compression"),
        (dict(compression="int8", algorithm="be"), ValueError, "compression"),
        (dict(compression="bf16", algorithm="torch"), ValueError, "compression"),
        (dict(bucket_mb=0), ValueError, "bucket_mb"),
        (dict(bucket_mb=-1.0), ValueError, "bucket_mb"),
        (dict(bucket_mb=math.nan), ValueError, "bucket_mb"),
        (dict(bucket_mb="25"), TypeError, "bucket_mb"),
        (dict(block_bytes=0), ValueError, "block_bytes"),
        (dict(max_timings=-1), ValueError, "max_timings"),
        (dict(mode=None), ValueError, "mode must be one of"),
        (dict(algorithm="LP"), ValueError, "algorithm must be one of"),
        (dict(compression="none"), ValueError, "compression must be one of"),
        (dict(timing="yes"), TypeError, "timing"),
    ],
)
def test_bad_arguments(kwargs, exc, words):
    model, opt = _model_opt()
    with pytest.raises(exc, match=words):
        PipeSGD(model, opt, **kwargs)


def test_bad_model_optimizer_and_group():
    model, opt = _model_opt()
    with pytest.raises(TypeError, match="model"):
        PipeSGD(object(), opt)
    with pytest.raises(TypeError, match="optimizer"):
        PipeSGD(model, object())
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="not a parameter of model"):
        PipeSGD(model, torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1))
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        PipeSGD(frozen, torch.optim.SGD(frozen.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="group"):
        PipeSGD(model, opt, group=object())


@pytest.mark.parametrize("compression", [None, "fp16", "int8"])
def test_non_floating_parameters_rejected(compression):
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(3, dtype=torch.complex64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="floating-point"):
        PipeSGD(model, opt, mode="pipe", compression=compression)


def test_bad_state_dicts():
    model, opt = _model_opt()
    trainer = PipeSGD(model, opt, mode="pipe", staleness=1)
    x, y = fns.batch(dict(BASE), 0, 0)
    fns.loss_fn(model, x, y).backward()
    trainer.step()
    state = trainer.state_dict()
    assert len(state["in_flight"]) == 1
    buf = io.BytesIO()
    torch.save(state, buf)  # serialisable
    with pytest.raises(TypeError, match="state"):
        PipeSGD(*_model_opt(), mode="pipe").load_state_dict([1])
    with pytest.raises(ValueError, match="mode"):
        PipeSGD(*_model_opt(), mode="sync").load_state_dict(state)
    with pytest.raises(ValueError, match="staleness"):
        PipeSGD(*_model_opt(), mode="pipe", staleness=2).load_state_dict(state)
    with pytest.raises(ValueError, match="missing"):
        PipeSGD(*_model_opt(), mode="pipe").load_state_dict({"mode": "pipe"})
    with pytest.raises(ValueError, match="more than"):
        PipeSGD(*_model_opt(), mode="pipe").load_state_dict(
            dict(state, in_flight=state["in_flight"] * 2)
        )
    small = nn.Linear(2, 1).double()
    with pytest.raises(ValueError, match="shapes"):
        PipeSGD(small, torch.optim.SGD(small.parameters(), lr=0.1)).load_state_dict(state)
    with pytest.raises(RuntimeError, match="fresh"):
        trainer.load_state_dict(state)  # this one has a gradient in flight


# --------------------------------------------------------------------------- the Optimizer interface


def test_is_a_torch_optimizer_sharing_the_wrapped_state():
    model, inner = _model_opt()
    opt = PipeSGD(model, inner, mode="pipe")
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    assert opt.state is inner.state and opt.defaults is inner.defaults
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)  # reads defaults
    with pytest.raises(NotImplementedError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(TypeError, match="not a PipeSGD"):
        PipeSGD(model, opt)
    opt.load_state_dict(opt.state_dict())  # torch replaces inner.param_groups: still shared
    assert opt.param_groups is inner.param_groups


@pytest.mark.parametrize("sched", ["step", "lambda"])
@pytest.mark.parametrize(("mode", "closure"), [("sync", False), ("layerwise", True)])
def test_scheduler_changes_lr_as_with_the_bare_optimizer(sched, mode, closure):
    cfg = dict(BASE, mode=mode, opt="sgdm", sched=sched, closure=closure)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        got = fns.train(cfg)
    model = fns.make_model(cfg)
    opt = fns.make_optimizer(cfg, model)
    scheduler = fns.make_scheduler(cfg, opt)
    lrs = []
    for t in range(cfg["steps"]):
        x, y = fns.batch(cfg, 0, t)
        opt.zero_grad()
        fns.loss_fn(model, x, y).backward()
        opt.step()
        scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
        assert torch.equal(fns.flat_params(model), got["traj"][t])
    assert got["lrs"] == [g["lr"] for g in opt.param_groups]
    assert len(set(lrs)) > 1  # the schedule really changed the learning rate


def test_scheduler_with_staleness_applies_the_current_lr():
    """k = 2: the update applied at step t uses the learning rate in force at step t."""
    cfg = dict(BASE, mode="pipe", staleness=2, opt="sgd", sched="step", extra_steps=2)
    got = fns.train(cfg)
    want = simulate(cfg, 1)
    for a, b in zip(got["traj"], want["traj"]):
        assert torch.equal(a, b)
    assert torch.equal(got["final"], want["final"])


def test_zero_grad():
    model, inner = _model_opt()
    opt = PipeSGD(model, inner, mode="sync")
    x, y = fns.batch(dict(BASE), 0, 0)
    fns.loss_fn(model, x, y).backward()
    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    fns.loss_fn(model, x, y).backward()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_step_with_closure():
    cfg = dict(BASE, mode="pipe", staleness=1, opt="adam", extra_steps=2)
    plain, with_closure = fns.train(cfg), fns.train(dict(cfg, closure=True))
    for a, b in zip(plain["traj"], with_closure["traj"]):
        assert torch.equal(a, b)
    model, inner = _model_opt()
    start = fns.make_model(dict(BASE))
    opt = PipeSGD(model, inner, mode="sync")
    x, y = fns.batch(dict(BASE), 0, 0)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = fns.loss_fn(model, x, y)
        loss.backward()
        return loss

    with torch.no_grad():  # the closure still gets gradients
        loss = opt.step(closure)
    assert loss.item() == fns.loss_fn(start, x, y).item()
    assert not torch.equal(fns.flat_params(model), fns.flat_params(start))


def test_timing_is_opt_in(monkeypatch):
    from pipecomm.pipesgd import timing

    cfg = dict(BASE, mode="pipe", staleness=1, opt="sgdm", extra_steps=2)
    assert torch.equal(fns.train(cfg)["final"], fns.train(dict(cfg, timing=False))["final"])
    model, inner = _model_opt()
    opt = PipeSGD(model, inner, mode="pipe")
    assert opt.timing is False
    with pytest.raises(RuntimeError, match="timing=True"):
        opt.timings  # noqa: B018
    with pytest.raises(RuntimeError, match="timing=True"):
        opt.timing_totals  # noqa: B018
    calls = []
    monkeypatch.setattr(timing.time, "perf_counter", lambda: calls.append(1) or 0.0)
    monkeypatch.setattr(timing, "synchronize", lambda d: calls.append(d))
    x, y = fns.batch(dict(BASE), 0, 0)
    for _ in range(3):
        opt.zero_grad()
        fns.loss_fn(model, x, y).backward()
        opt.step()
    opt.reset_timings()
    opt.finish()
    assert calls == []  # no clock read, no device synchronisation


def test_context_manager_drains_the_pipeline():
    model, inner = _model_opt()
    x, y = fns.batch(dict(BASE), 0, 0)
    with PipeSGD(model, inner, mode="pipe", staleness=2) as opt:
        for _ in range(3):
            opt.zero_grad()
            fns.loss_fn(model, x, y).backward()
            opt.step()
        assert opt.in_flight == 2 and opt.updates == 1
    assert opt.in_flight == 0 and opt.updates == 3


def test_step_hooks_run_on_applied_updates():
    """register_step_pre_hook goes to the wrapped optimizer: it sees the averaged gradient that
    is applied (e.g. to clip it), and only when an update is applied."""
    model, inner = _model_opt()
    opt = PipeSGD(model, inner, mode="pipe", staleness=1)
    seen = []
    opt.register_step_pre_hook(
        lambda o, a, k: seen.append([p.grad.clone() for p in model.parameters()])
    )
    x, y = fns.batch(dict(BASE), 0, 0)
    grads = []
    for _ in range(3):
        opt.zero_grad()
        fns.loss_fn(model, x, y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    assert len(seen) == 2  # t = 0 filled the pipeline
    for applied, computed in zip(seen, grads):
        assert all(torch.equal(a, b) for a, b in zip(applied, computed))
