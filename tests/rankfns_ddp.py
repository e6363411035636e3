"""Rank functions and the float64 oracle for tests/test_ddp.py (DecentralizedDataParallel).

``train(cfg)`` runs on every rank and returns its parameter trajectory; ``simulate(cfg)`` runs in
the test process and computes all ranks' trajectories from the rule of docs/update_rules.md
("Decentralized training") with ``topology.mixing_matrix``: ``y_i^k = sum_j (W_k)_ij x_j^k``,
local step from ``y_i^k`` with the gradient at ``x_i^k`` (zero for parameters without a gradient).

A configuration is a dict with keys: ``world``, ``topology`` (a name, or ``("aer", rpn)``,
``("random-matching", seed)``, ``("singletons",)``), ``optim`` (``("sgd", lr, momentum)`` or
``("adam", lr)``), ``bucket_mb``, ``algorithm``, ``iters``, ``dtype``, ``branch`` (None: the
branch layer is absent; an int ``o``: rank ``i`` uses it at iteration ``k`` iff
``(k + i + o) % 3 == 0``), ``seed``, ``tied`` (a layer applied twice per forward), ``averages`` ({iteration: "copy" | "inplace" | "context"}:
calls between iterations, before iteration ``k``).
"""

from __future__ import annotations

import contextlib
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


def make_optim(spec: tuple, params: list) -> torch.optim.Optimizer:
    if spec[0] == "sgd":
        return torch.optim.SGD(params, lr=spec[1], momentum=spec[2])
    if spec[0] == "adam":
        return torch.optim.Adam(params, lr=spec[1])
    raise ValueError(spec)


def batch(cfg: dict, rank: int, k: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    g = torch.Generator().manual_seed(cfg["seed"] * 100_003 + rank * 1009 + k)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    y = torch.randn(4, 3, generator=g, dtype=torch.float64)
    use = cfg["branch"] is not None and (k + rank + cfg["branch"]) % 3 == 0
    return x, y, use


def loss_of(model: Net, cfg: dict, rank: int, k: int) -> torch.Tensor:
    x, y, use = batch(cfg, rank, k)
    dtype = DTYPES[cfg["dtype"]]
    return ((model(x.to(dtype), use_branch=use) - y.to(dtype)) ** 2).mean()


def snapshot(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().to(torch.float64).numpy().copy() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- on the ranks


def train(cfg: dict) -> dict:
    """Train with DecentralizedDataParallel; return this rank's trajectory and bookkeeping."""
    from pipecomm.decentralized import DecentralizedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(cfg, rank)
    ddp = DecentralizedDataParallel(
        model,
        lambda named: make_optim(cfg["optim"], [p for _, p in named]),
        topology=make_topology(cfg["topology"], world),
        bucket_mb=cfg["bucket_mb"],
        algorithm=cfg["algorithm"],
    )
    initial = snapshot(model)
    traj, averages = [], {}
    for k in range(cfg["iters"]):
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
        loss_of(ddp, cfg, rank, k).backward()
        assert ddp.step_count == k + 1
        assert all(p.grad is None for p in model.parameters())
        traj.append(snapshot(model))
    ddp.finish()
    out = {
        "initial": initial,
        "traj": traj,
        "averages": averages,
        "buckets": ddp.bucket_names,
        "n_optimizers": len(ddp.optimizers),
        "timing": dict(ddp.timing),
    }
    ddp.close()
    return out


def train_many(cfgs: list[dict]) -> list[dict]:
    return [train(c) for c in cfgs]


# --------------------------------------------------------------------------- the oracle


def simulate(cfg: dict, ranks_per_node: int | None = None) -> dict:
    """All ranks in one process, float64, straight from the rule with ``mixing_matrix``."""
    world = cfg["world"]
    topo = sim_topology(cfg["topology"], world, ranks_per_node)
    sim_cfg = dict(cfg, dtype="float64")
    start = make_model(sim_cfg, 0)  # rank 0's parameters are broadcast at construction
    models = []
    for _ in range(world):
        m = make_model(sim_cfg, 0)
        m.load_state_dict(start.state_dict())
        models.append(m)
    optims = [make_optim(cfg["optim"], list(m.parameters())) for m in models]
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
            loss_of(m, sim_cfg, i, k).backward()
            grads.append(
                {
                    n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
                    for n, p in m.named_parameters()
                }
            )
        w = torch.from_numpy(topo.mixing_matrix(k))
        xs = {
            n: torch.stack([dict(m.named_parameters())[n].detach() for m in models]) for n in names
        }
        for i, m in enumerate(models):
            with torch.no_grad():
                for n, p in m.named_parameters():
                    y = torch.tensordot(w[i], xs[n], dims=1)
                    p.copy_(y)
                    p.grad = grads[i][n]
            optims[i].step()
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
    """Construct with bad arguments; return {case: 'ExceptionType: message'}."""
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
    # optim_fn returning something else / an optimizer over other parameters: first backward
    for name, fn in (
        ("optim_fn result", lambda named: "sgd"),
        ("optim_fn params", lambda named: torch.optim.SGD([nn.Parameter(torch.ones(1))], 0.1)),
    ):
        ddp = DecentralizedDataParallel(Net(), fn)
        try:
            ddp(torch.ones(2, 5)).sum().backward()
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
        ddp.close()
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
    from pipecomm import netem

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
