"""Rank functions and the float64 oracle for tests/test_ddp.py (DecentralizedDataParallel).

``train(cfg)`` runs on every rank and returns its parameter trajectory; ``simulate(cfg)`` runs in
the test process and computes all ranks' trajectories from the rule of docs/update_rules.md
("Decentralized training") with ``topology.mixing_matrix``: ``y_i^k = sum_j (W_k)_ij x_j^k``,
local step from ``y_i^k`` with the gradient at ``x_i^k`` (zero for parameters without a gradient), and
the training-loop features: gradients summed over ``accum`` micro-batches (``no_sync``), a StepLR
schedule ``sched = (step_size, gamma)``, clipping ``clip = (max_norm, "global" | "bucket")``, a
GradScaler (``scaler``: initial scale; ``inf_at``: ``(rank, k)`` whose loss is made infinite),
``autocast`` (``"bf16"``/``"fp16"``), ``group`` (global ranks that train), ``checkpoint_at``.

A configuration is a dict with keys: ``world``, ``topology`` (a name, or ``("aer", rpn)``,
``("random-matching", seed)``, ``("singletons",)``), ``optim`` (``("sgd", lr, momentum)`` or
``("adam", lr)``), ``bucket_mb``, ``algorithm``, ``iters``, ``dtype``, ``branch`` (None: the
branch layer is absent; an int ``o``: rank ``i`` uses it at iteration ``k`` iff
``(k + i + o) % 3 == 0``), ``seed``, ``tied`` (a layer applied twice per forward), ``averages`` ({iteration: "copy" | "inplace" | "context"}:
calls between iterations, before iteration ``k``).
"""

from __future__ import annotations

import contextlib
import functools
import io
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from pipecomm.decentralized.topology import Topology, get_topology

DTYPES = {"float64": torch.float64, "float32": torch.float32}


class Net(nn.Module):
    """A small MLP with odd sizes, buffers, an optional branch layer and a layer used twice."""

    def __init__(self, branch: bool = False, hidden: int = 7, tied: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(5, hidden)
        self.sq = nn.Linear(hidden, hidden) if tied else None  # used twice per forward
        self.fc2 = nn.Linear(hidden, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.extra = nn.Linear(hidden, hidden) if branch else None
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("shift", torch.zeros(3))

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        if self.sq is not None:
            h = torch.tanh(self.sq(torch.tanh(self.sq(h))))
        if use_branch:
            h = h + torch.tanh(self.extra(h))
        return self.fc2(h) * self.scale + self.shift


class SingletonTopology(Topology):
    """4 ranks; even steps (0,1) and singletons 2, 3; odd steps (1,2), (0,3) alone... period 2."""

    period = 2

    def _partition(self, step: int):
        if step % 2 == 0:
            return [(0, 1), (2,), (3,)]
        return [(0,), (1, 2), (3,)]


def make_topology(spec: Any, world: int) -> Any:
    if isinstance(spec, str):
        return spec
    if spec[0] == "aer":
        return get_topology("alternating-exp-ring", world, ranks_per_node=spec[1])
    if spec[0] == "random-matching":
        return get_topology("random-matching", world, seed=spec[1])
    if spec[0] == "singletons":
        return SingletonTopology(world)
    raise ValueError(spec)


def sim_topology(spec: Any, world: int, ranks_per_node: int | None = None) -> Topology:
    t = make_topology(spec, world)
    return get_topology(t, world, ranks_per_node=ranks_per_node) if isinstance(t, str) else t


def make_model(cfg: dict, rank: int) -> Net:
    torch.manual_seed(cfg["seed"] + 17 * rank)  # different on every rank: the broadcast matters
    net = Net(branch=cfg["branch"] is not None, tied=cfg.get("tied", False))
    return net.to(DTYPES[cfg["dtype"]])


def make_optim(spec: tuple, named: list) -> torch.optim.Optimizer:
    """``("sgd", lr, momentum)``, ``("adam", lr)`` or ``("adamw-groups", lr)`` (two groups)."""
    params = [p for _, p in named]
    if spec[0] == "sgd":
        return torch.optim.SGD(params, lr=spec[1], momentum=spec[2])
    if spec[0] == "adam":
        return torch.optim.Adam(params, lr=spec[1])
    if spec[0] == "adamw-groups":  # weight decay on matrices only, as nanoGPT
        decay = [p for _, p in named if p.dim() >= 2]
        rest = [p for _, p in named if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=spec[1])
    raise ValueError(spec)


def make_scheduler(cfg: dict, opt: torch.optim.Optimizer) -> Any:
    if cfg.get("sched") is None:
        return None
    step_size, gamma = cfg["sched"]
    return torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=gamma)


def batch(cfg: dict, rank: int, k: int, m: int = 0) -> tuple[torch.Tensor, torch.Tensor, bool]:
    g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + rank * 1009 + k + 7919 * m)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, generator=g, dtype=torch.float64)
    use = cfg["branch"] is not None and (k + rank + cfg["branch"]) % 3 == 0
    return x, y, use


def loss_of(model: nn.Module, cfg: dict, rank: int, k: int, m: int = 0) -> torch.Tensor:
    """Loss of micro-batch ``m`` of iteration ``k`` (divided by the number of micro-batches)."""
    x, y, use = batch(cfg, rank, k, m)
    dtype = DTYPES[cfg["dtype"]]
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.get("autocast"))
    ctx = torch.autocast("cpu", dtype=half) if half else contextlib.nullcontext()
    with ctx:
        out = model(x.to(dtype), use_branch=use)
    loss = ((out.to(dtype) - y.to(dtype)) ** 2).mean() / cfg.get("accum", 1)
    if (rank, k) in cfg.get("inf_at", ()) and m == 0:
        loss = loss * float("inf")
    return loss


def snapshot(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().to(torch.float64).numpy().copy() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- on the ranks


def _wrap(cfg: dict, model: nn.Module, group: Any, world: int, init_sync: bool = True) -> Any:
    from pipecomm.decentralized import DecentralizedDataParallel

    named = list(model.named_parameters())
    opt: Any = make_optim(cfg["optim"], named)
    if cfg.get("optim_fn"):
        opt = functools.partial(make_optim, cfg["optim"])
    scaler = None
    if cfg.get("scaler") is not None:
        scaler = torch.amp.GradScaler("cpu", init_scale=cfg["scaler"], growth_interval=2)
    clip = cfg.get("clip") or (None, "bucket")
    return DecentralizedDataParallel(
        model,
        opt,
        topology=make_topology(cfg["topology"], world),
        bucket_mb=cfg["bucket_mb"],
        algorithm=cfg["algorithm"],
        process_group=group,
        max_grad_norm=clip[0],
        grad_norm_scope=clip[1],
        grad_scaler=scaler,
        init_sync=init_sync,
    )


def _iteration(ddp: Any, cfg: dict, rank: int, k: int) -> None:
    """One iteration: ``accum`` micro-batches, all but the last without synchronising."""
    accum = cfg.get("accum", 1)
    for m in range(accum):
        last = m == accum - 1
        if last:
            ctx: Any = contextlib.nullcontext()
        elif k % 2 == 0:
            ctx = ddp.no_sync()
        else:  # nanoGPT's way
            ddp.require_backward_grad_sync = False
            ctx = contextlib.nullcontext()
        with ctx:
            loss = loss_of(ddp, cfg, rank, k, m)
            (ddp.grad_scaler.scale(loss) if ddp.grad_scaler is not None else loss).backward()
        ddp.require_backward_grad_sync = True
        if not last:
            assert ddp.step_count == k and ddp.module.fc1.weight.grad is not None


def train(cfg: dict) -> dict | None:
    """Train with DecentralizedDataParallel; return this rank's trajectory and bookkeeping.

    ``cfg["group"]``: train on these global ranks only (others return None);
    ``cfg["checkpoint_at"]``: save model + optimizer (+ scheduler) state after that many
    iterations, drop everything and resume from the saved state in a new model and wrapper.
    """
    world = dist.get_world_size()
    group = None
    if cfg.get("group") is not None:
        group = dist.new_group(cfg["group"])
        if dist.get_rank() not in cfg["group"]:
            return None
        world = len(cfg["group"])
    rank = dist.get_rank() if group is None else cfg["group"].index(dist.get_rank())
    model = make_model(cfg, rank)
    ddp = _wrap(cfg, model, group, world)
    sched = make_scheduler(cfg, ddp.optimizer)
    initial = snapshot(model)
    traj, averages, lrs, scales = [], {}, [], []
    for k in range(cfg["iters"]):
        if k == cfg.get("checkpoint_at"):
            buf = io.BytesIO()
            torch.save(
                {
                    "model": ddp.state_dict(),
                    "optimizer": ddp.optimizer.state_dict(),
                    "sched": sched.state_dict() if sched is not None else None,
                    "scaler": ddp.grad_scaler.state_dict() if ddp.grad_scaler else None,
                },
                buf,
            )
            ddp.close()
            del model, ddp, sched
            ckpt = torch.load(io.BytesIO(buf.getvalue()), weights_only=False)
            model = make_model(dict(cfg, seed=cfg["seed"] + 1), rank)  # other values
            if cfg.get("resume_style") == "before-wrap":  # nanoGPT: load, then wrap
                model.load_state_dict(ckpt["model"])
                ddp = _wrap(cfg, model, group, world, init_sync=False)
            else:
                ddp = _wrap(cfg, model, group, world)
                ddp.load_state_dict(ckpt["model"])
            ddp.optimizer.load_state_dict(ckpt["optimizer"])
            assert ddp.step_count == k
            sched = make_scheduler(cfg, ddp.optimizer)
            if sched is not None:
                sched.load_state_dict(ckpt["sched"])
            if ddp.grad_scaler is not None:
                ddp.grad_scaler.load_state_dict(ckpt["scaler"])
        how = cfg.get("averages", {}).get(k)
        if how == "copy":
            averages[k] = {n: v.to(torch.float64).numpy() for n, v in ddp.global_average().items()}
            # the model holds the average until the next forward
            assert all(np.array_equal(averages[k][n], v) for n, v in snapshot(model).items())
        elif how == "inplace":
            ddp.global_average(inplace=True)
        elif how == "context":
            before = snapshot(model)
            with ddp.averaged() as m:
                averages[k] = snapshot(m)
            assert all(np.array_equal(before[n], v) for n, v in snapshot(model).items())
        lrs.append([g["lr"] for g in ddp.optimizer.param_groups])
        _iteration(ddp, cfg, rank, k)
        if sched is not None:
            sched.step()
        assert ddp.step_count == k + 1
        assert all(p.grad is None for p in model.parameters())
        traj.append(snapshot(model))
        scales.append(ddp.grad_scaler.get_scale() if ddp.grad_scaler is not None else None)
    ddp.finish()
    out = {
        "initial": initial,
        "traj": traj,
        "averages": averages,
        "buckets": ddp.bucket_names,
        "n_optimizers": len(ddp.optimizers),
        "timing": dict(ddp.timing),
        "lrs": lrs,
        "scales": scales,
        "grad_norm": None if ddp.grad_norm is None else float(ddp.grad_norm),
        # storages per bucket (1: the parameters are views of one block) and whether the
        # model's parameters are still the wrapper's objects
        "storages": [len({p.untyped_storage().data_ptr() for p in b.params})
                     for b in ddp._buckets],
        "same_objects": all(a is b for a, b in zip(model.parameters(), ddp.parameters())),
    }
    ddp.close()
    return out


def train_many(cfgs: list[dict]) -> list[dict | None]:
    return [train(c) for c in cfgs]


# --------------------------------------------------------------------------- the oracle


def simulate(cfg: dict, ranks_per_node: int | None = None, buckets: list | None = None) -> dict:
    """All ranks in one process, float64, straight from the rule with ``mixing_matrix``.

    Gradients are summed over ``accum`` micro-batches; ``clip`` clips by the global norm or by
    every bucket's (``buckets``: lists of parameter names); a rank with ``(rank, k)`` in
    ``inf_at`` skips its step (it still mixes); ``sched`` steps a StepLR on every rank.
    """
    world = len(cfg["group"]) if cfg.get("group") is not None else cfg["world"]
    topo = sim_topology(cfg["topology"], world, ranks_per_node)
    sim_cfg = dict(cfg, dtype="float64" if cfg.get("autocast") is None else cfg["dtype"])
    start = make_model(sim_cfg, 0)  # rank 0's parameters are broadcast at construction
    models = []
    for _ in range(world):
        m = make_model(sim_cfg, 0)
        m.load_state_dict(start.state_dict())
        models.append(m)
    optims = [make_optim(cfg["optim"], list(m.named_parameters())) for m in models]
    scheds = [make_scheduler(cfg, o) for o in optims]
    names = [n for n, _ in models[0].named_parameters()]
    traj: list[list[dict]] = [[] for _ in range(world)]
    averages = {}
    for k in range(cfg["iters"]):
        how = cfg.get("averages", {}).get(k)
        if how is not None:
            mean = {n: np.mean([snapshot(m)[n] for m in models], axis=0) for n in names}
            averages[k] = mean
            if how == "inplace":
                for m in models:
                    with torch.no_grad():
                        for n, p in m.named_parameters():
                            p.copy_(torch.from_numpy(mean[n]))
        grads = []
        for i, m in enumerate(models):
            m.zero_grad(set_to_none=True)
            for mb in range(cfg.get("accum", 1)):
                loss_of(m, sim_cfg, i, k, mb).backward()
            grads.append(
                {
                    n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                    for n, p in m.named_parameters()
                }
            )
        w = torch.from_numpy(topo.mixing_matrix(k)).to(DTYPES[sim_cfg["dtype"]])
        xs = {
            n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]) for n in names
        }
        for i, m in enumerate(models):
            params = dict(m.named_parameters())
            with torch.no_grad():
                for n, p in params.items():
                    p.copy_(torch.tensordot(w[i], xs[n], dims=1))
                    p.grad = grads[i][n]
            if (i, k) not in cfg.get("inf_at", ()):
                if cfg.get("clip") is not None:
                    max_norm, scope = cfg["clip"]
                    for b in [names] if scope == "global" else buckets:
                        torch.nn.utils.clip_grad_norm_([params[n] for n in b], max_norm)
                optims[i].step()
            if scheds[i] is not None:
                scheds[i].step()
            traj[i].append(snapshot(m))
    return {"traj": traj, "averages": averages, "start": snapshot(start)}


# --------------------------------------------------------------------------- other checks


def mismatch(kind: str) -> str:
    """Build a model that differs on the last rank; return the construction error's text."""
    from pipecomm.decentralized import DecentralizedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    if kind == "shape":
        model = Net(hidden=8 if odd else 7)
    elif kind == "missing":
        model = Net(branch=odd)
    elif kind == "dtype":
        model = Net().to(torch.float64 if odd else torch.float32)
    else:
        raise ValueError(kind)
    try:
        DecentralizedDataParallel(model, lambda named: torch.optim.SGD([p for _, p in named], 0.1))
    except ValueError as exc:
        return str(exc)
    return "no error"


def bad_arguments() -> dict[str, str]:
    """Construct with bad arguments; return {case: 'ExceptionType: message'}.

    Every case fails before any communication: no rank waits for another.
    """
    from pipecomm.decentralized import DecentralizedDataParallel

    world = dist.get_world_size()

    def opt(named):
        return torch.optim.SGD([p for _, p in named], lr=0.1)

    cases = {
        "unknown topology": dict(topology="torus"),
        "topology type": dict(topology=3),
        "topology world size": dict(topology=get_topology("ring", world + 2)),
        "bucket_mb zero": dict(bucket_mb=0),
        "bucket_mb negative": dict(bucket_mb=-1.0),
        "bucket_mb nan": dict(bucket_mb=float("nan")),
        "bucket_mb str": dict(bucket_mb="25"),
        "bucket_mb bool": dict(bucket_mb=True),
        "algorithm": dict(algorithm="tree"),
        "optim_fn": dict(optim_fn=None),
        "model": dict(model="not a model"),
        "optim_fn result": dict(optim_fn=lambda named: "sgd"),
        "optim_fn params": dict(
            optim_fn=lambda named: torch.optim.SGD([nn.Parameter(torch.ones(1))], 0.1)
        ),
        "optimizer missing params": dict(optim_fn=torch.optim.SGD([nn.Parameter(torch.ones(1))])),
        "max_grad_norm zero": dict(max_grad_norm=0.0),
        "max_grad_norm inf": dict(max_grad_norm=float("inf")),
        "max_grad_norm str": dict(max_grad_norm="1"),
        "grad_norm_scope": dict(max_grad_norm=1.0, grad_norm_scope="layer"),
        "grad_scaler": dict(grad_scaler="fp16"),
        "grad_scaler float16 parameters": dict(
            model=Net().half(), grad_scaler=torch.amp.GradScaler("cpu")
        ),
        "process_group": dict(process_group="world"),
        "init_sync": dict(init_sync=1),
    }
    out = {}
    for name, kw in cases.items():
        args = {"model": Net(), "optim_fn": opt, **kw}
        try:
            DecentralizedDataParallel(args.pop("model"), args.pop("optim_fn"), **args)
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
    # wrapping a model twice without close()
    model = Net()
    first = DecentralizedDataParallel(model, opt)
    try:
        DecentralizedDataParallel(model, opt)
    except ValueError as exc:
        out["wrapped twice"] = f"ValueError: {exc}"
    else:
        out["wrapped twice"] = "no error"
    first.close()
    DecentralizedDataParallel(model, opt).close()  # fine after close()
    return out


def misuse() -> dict[str, str]:
    """no_sync and checkpoint misuse: {case: 'ExceptionType: message'} (raised locally)."""
    from pipecomm.decentralized import DecentralizedDataParallel

    out: dict[str, str] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            fn()
        except (ValueError, TypeError, RuntimeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"

    ddp = DecentralizedDataParallel(
        Net(), lambda named: torch.optim.SGD([p for _, p in named], 0.1), topology="ring"
    )
    x = torch.ones(2, 5)
    with ddp.no_sync():
        ddp(x).sum().backward()
        attempt("global_average inside no_sync", ddp.global_average)
    attempt("global_average with accumulated gradients", ddp.global_average)
    ddp(x).sum().backward()  # applies them
    ddp.global_average()  # fine now
    ddp.require_backward_grad_sync = 1
    attempt("require_backward_grad_sync not a bool", lambda: ddp(x))
    ddp.require_backward_grad_sync = True
    other = ddp.optimizer.state_dict()
    other["decentralized_data_parallel"] = dict(other["decentralized_data_parallel"], rank=7)
    attempt("optimizer state of another rank", lambda: ddp.optimizer.load_state_dict(other))
    state = ddp.optimizer.state_dict()
    ddp(x).sum().backward()
    attempt("optimizer state of an older iteration", lambda: ddp.optimizer.load_state_dict(state))
    ddp.optimizer.load_state_dict(ddp.optimizer.state_dict())  # same iteration: fine

    def enter_no_sync():
        with ddp.no_sync():
            pass

    ddp.close()
    attempt("no_sync after close", enter_no_sync)
    return out


def torch_under_emulation() -> str:
    from pipecomm.decentralized import DecentralizedDataParallel

    try:
        DecentralizedDataParallel(
            Net(), lambda named: torch.optim.SGD([p for _, p in named], 0.1), algorithm="torch"
        )
    except ValueError as exc:
        return str(exc)
    return "no error"


def train_emulated(cfg: dict) -> dict:
    from pipecomm.lab.networks import netem

    netem.reset_stats()
    out = train(cfg)
    out["stats"] = netem.stats()
    return out


def state_dict_keys() -> dict:
    """Keys and names of the wrapper vs the model; load_state_dict round trip."""
    from pipecomm.decentralized import DecentralizedDataParallel

    model = Net(branch=True)
    ddp = DecentralizedDataParallel(
        model, lambda named: torch.optim.SGD([p for _, p in named], 0.1), bucket_mb=1e-6
    )
    before = ddp.state_dict()
    ddp(torch.ones(2, 5), use_branch=True).sum().backward()
    changed = {k: v.clone() for k, v in ddp.state_dict().items()}
    ddp.load_state_dict(before)
    restored = all(torch.equal(v, before[k]) for k, v in ddp.state_dict().items())
    ddp.load_state_dict(changed)
    try:
        ddp.load_state_dict(before, assign=True)
        assign = "no error"
    except ValueError as exc:
        assign = str(exc)
    out = {
        "ddp_keys": list(ddp.state_dict().keys()),
        "model_keys": list(model.state_dict().keys()),
        "ddp_params": [n for n, _ in ddp.named_parameters()],
        "model_params": [n for n, _ in model.named_parameters()],
        "ddp_buffers": [n for n, _ in ddp.named_buffers()],
        "model_buffers": [n for n, _ in model.named_buffers()],
        "same_objects": all(a is b for a, b in zip(ddp.parameters(), model.parameters())),
        "restored": restored,
        "assign": assign,
    }
    ddp.close()
    return out


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise FloatingPointError("boom")


def interrupted_backward() -> str:
    """A backward that fails midway; the next backward must say so instead of going on."""
    from pipecomm.decentralized import DecentralizedDataParallel

    model = Net()
    ddp = DecentralizedDataParallel(
        model, lambda named: torch.optim.SGD([p for _, p in named], 0.1)
    )
    h = torch.tanh(model.fc1(torch.ones(2, 5)))
    with contextlib.suppress(FloatingPointError):  # fc2 and scale get their gradients first
        (model.fc2(_Boom.apply(h)) * model.scale).sum().backward()
    try:
        ddp(torch.ones(2, 5)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    finally:
        ddp.close()
    return "no error"
