"""Functions executed on ranks by test_pipesgd.py (importable by the rank processes).

Models, optimizers and data are built deterministically from a config dict, so the test process
can rebuild them and simulate the rule of docs/update_rules.md ("Pipelined SGD with staleness k")
in float64 (the oracle). Each rank's batch of iteration t depends only on (seed, rank, t).
"""

from __future__ import annotations

import io
import time

import torch
import torch.distributed as dist
from torch import nn

from pipecomm.pipesgd import PipeSGD

D_IN, D_HID, D_OUT, BATCH = 5, 7, 3, 4


class TinyMLP(nn.Module):
    """Linear-Tanh-Linear; with ``unused`` a parameter that never gets a gradient."""

    def __init__(self, unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_OUT)
        self.unused = nn.Parameter(torch.ones(2, 3)) if unused else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


DTYPES = {"float32": torch.float32, "float64": torch.float64}


def make_model(cfg: dict, seed: int | None = None) -> nn.Module:
    """Same initial values for every dtype: built in float32 from the seed, then cast."""
    torch.manual_seed(cfg.get("seed", 0) if seed is None else seed)
    if cfg.get("model", "mlp") == "linear":
        model = nn.Linear(D_IN, D_OUT)
    else:
        model = TinyMLP(unused=cfg.get("unused", False))
    return model.to(DTYPES[cfg.get("dtype", "float64")])


def make_optimizer(cfg: dict, model: nn.Module) -> torch.optim.Optimizer:
    name = cfg.get("opt", "sgdm")
    params = [p for p in model.parameters()]
    if name == "sgd":
        return torch.optim.SGD(params, lr=cfg.get("lr", 0.1))
    if name == "sgdm":
        return torch.optim.SGD(params, lr=cfg.get("lr", 0.05), momentum=0.9)
    if name == "adam":
        return torch.optim.Adam(params, lr=cfg.get("lr", 0.02))
    raise ValueError(name)


def make_scheduler(cfg: dict, opt: torch.optim.Optimizer) -> object | None:
    """``cfg["sched"]``: None, ``"step"`` (StepLR, halves every 2 steps) or ``"lambda"``
    (LambdaLR, a linear warm-up over 3 steps); attached to ``opt`` (a PipeSGD or the bare one)."""
    name = cfg.get("sched")
    if name is None:
        return None
    if name == "step":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: min(1.0, (t + 1) / 3))
    raise ValueError(name)


def batch(cfg: dict, rank: int, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of iteration ``t`` (float32 values, cast to the run's dtype)."""
    g = torch.Generator().manual_seed(cfg.get("seed", 0) * 1_000_003 + rank * 10_007 + t)
    x = torch.randn(BATCH, D_IN, generator=g)
    y = torch.randn(BATCH, D_OUT, generator=g)
    dtype = DTYPES[cfg.get("dtype", "float64")]
    return x.to(dtype), y.to(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).to(torch.float64) for p in model.parameters()])


def _trainer(cfg: dict, model: nn.Module, opt: torch.optim.Optimizer) -> PipeSGD:
    return PipeSGD(
        model,
        opt,
        mode=cfg["mode"],
        staleness=cfg.get("staleness"),
        algorithm=cfg.get("algorithm", "lp"),
        compression=cfg.get("compression"),
        bucket_mb=cfg.get("bucket_mb", 25.0),
        block_bytes=cfg.get("block_bytes"),
        timing=cfg.get("timing", True),
    )


def _iterate(cfg: dict, model, trainer, t: int, out: dict, sched=None) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    x, y = batch(cfg, rank, t)

    def closure() -> torch.Tensor:
        if cfg.get("zero_grad", "opt") == "model":
            model.zero_grad(set_to_none=cfg.get("set_to_none", True))
        else:
            trainer.zero_grad(set_to_none=cfg.get("set_to_none", True))
        loss = loss_fn(model, x, y)
        loss.backward()
        out["gmax"].append(
            max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None)
        )
        return loss

    if cfg.get("closure"):
        loss = trainer.step(closure)
        assert loss is not None and loss.requires_grad
    else:
        closure()
        assert trainer.step() is None
    if sched is not None:
        sched.step()
    out["traj"].append(flat_params(model))
    out["in_flight"].append(trainer.in_flight)


def train(cfg: dict) -> dict:
    """Train ``cfg["steps"]`` iterations; parameters after every step (and after finish())."""
    model = make_model(cfg)
    opt = make_optimizer(cfg, model)
    trainer = _trainer(cfg, model, opt)
    sched = make_scheduler(cfg, trainer)
    out: dict = {"traj": [], "gmax": [], "in_flight": []}
    for t in range(cfg["steps"]):
        _iterate(cfg, model, trainer, t, out, sched)
    trainer.finish()
    out["finished"] = flat_params(model)
    out["in_flight_after_finish"] = trainer.in_flight
    # a second pipeline after finish(): the first k steps of it apply nothing again
    for t in range(cfg["steps"], cfg["steps"] + cfg.get("extra_steps", 0)):
        _iterate(cfg, model, trainer, t, out, sched)
    trainer.finish()
    out["final"] = flat_params(model)
    out["updates"] = trainer.updates
    out["timings"] = list(trainer.timings) if trainer.timing else []
    out["totals"] = dict(trainer.timing_totals) if trainer.timing else {}
    out["lrs"] = [g["lr"] for g in trainer.param_groups]
    trainer.remove_hooks()
    return out


def train_many(cfgs: list[dict]) -> list[dict]:
    return [train(cfg) for cfg in cfgs]


def resume(cfg: dict) -> dict:
    """Checkpoint after ``cfg["ckpt_at"]`` steps (reductions in flight), continue to
    ``cfg["steps"]``; then restore into a fresh model/optimizer/trainer and redo the rest."""
    steps, m = cfg["steps"], cfg["ckpt_at"]
    model = make_model(cfg)
    opt = make_optimizer(cfg, model)
    trainer = _trainer(cfg, model, opt)
    sched = make_scheduler(cfg, trainer)
    out: dict = {"traj": [], "gmax": [], "in_flight": []}
    blob = snapshot = None
    for t in range(steps):
        _iterate(cfg, model, trainer, t, out, sched)
        if t == m - 1:
            snapshot = {"model": model.state_dict(), "trainer": trainer.state_dict()}
            if sched is not None:
                snapshot["sched"] = sched.state_dict()
            if cfg.get("serialize", True):
                buf = io.BytesIO()
                torch.save(snapshot, buf)
                blob = buf.getvalue()
            else:  # keep the live dicts: state_dict() must be a snapshot, not a view
                snapshot["model"] = {k: v.clone() for k, v in snapshot["model"].items()}
            out["in_flight_at_ckpt"] = trainer.in_flight
    trainer.finish()
    first = {"traj": out["traj"][m:], "finished": flat_params(model)}

    model2 = make_model(cfg, seed=cfg.get("seed", 0) + 101)  # different values before loading
    opt2 = make_optimizer(cfg, model2)
    trainer2 = _trainer(cfg, model2, opt2)
    sched2 = make_scheduler(cfg, trainer2)
    ckpt = torch.load(io.BytesIO(blob)) if blob is not None else snapshot  # weights_only works
    model2.load_state_dict(ckpt["model"])
    trainer2.load_state_dict(ckpt["trainer"])
    if sched2 is not None:
        sched2.load_state_dict(ckpt["sched"])
    out2: dict = {"traj": [], "gmax": [], "in_flight": []}
    loaded_iteration = trainer2.iteration
    for t in range(m, steps):
        _iterate(cfg, model2, trainer2, t, out2, sched2)
    trainer2.finish()
    return {
        "first": first,
        "second": {"traj": out2["traj"], "finished": flat_params(model2)},
        "in_flight_at_ckpt": out["in_flight_at_ckpt"],
        "loaded_iteration": loaded_iteration,
    }


def layerwise_double_backward(cfg: dict) -> str:
    """Two backward passes before step() in layer-wise mode: step() must raise, not hang."""
    model = make_model(cfg)
    trainer = _trainer(cfg, model, make_optimizer(cfg, model))
    x, y = batch(cfg, dist.get_rank(), 0)
    model.zero_grad()
    loss_fn(model, x, y).backward()
    loss_fn(model, x, y).backward()
    try:
        trainer.step()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = "no error"
    # the trainer is still usable afterwards
    model.zero_grad()
    loss_fn(model, x, y).backward()
    trainer.step()
    trainer.remove_hooks()
    return message


def mismatched_replicas(cfg: dict) -> str:
    """Rank 1 passes a different staleness: construction must fail on every rank."""
    model = make_model(cfg)
    opt = make_optimizer(cfg, model)
    k = 1 if dist.get_rank() == 0 else 2
    try:
        PipeSGD(model, opt, mode="pipe", staleness=k, algorithm=cfg.get("algorithm", "lp"))
    except ValueError as exc:
        return str(exc)
    return "no error"


def broadcast_init(cfg: dict) -> torch.Tensor:
    """Replicas built from different seeds end equal to rank 0's after construction."""
    model = make_model(cfg, seed=1000 + dist.get_rank())
    PipeSGD(model, make_optimizer(cfg, model), mode="sync", algorithm=cfg.get("algorithm", "lp"))
    return flat_params(model)


class _SleepyMLP(TinyMLP):
    """Forward sleeps ``compute_s`` (releases the GIL like real kernels): a controlled compute."""

    compute_s = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.compute_s)
        return super().forward(x)


def overlap(cfg: dict) -> dict:
    """Iteration times of sync and pipe under an emulated network with a sleeping compute."""
    result = {}
    for mode in ("sync", "pipe"):
        torch.manual_seed(0)
        model = _SleepyMLP().double()
        model.compute_s = cfg["compute_s"]
        trainer = PipeSGD(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            mode=mode,
            algorithm=cfg.get("algorithm", "lp"),
            block_bytes=cfg.get("block_bytes"),
            timing=True,
        )
        x, y = batch(cfg, dist.get_rank(), 0)
        for t in range(cfg["warmup"] + cfg["steps"]):
            if t == cfg["warmup"]:
                dist.barrier()
                trainer.reset_timings()
                start = time.perf_counter()
            model.zero_grad()
            loss_fn(model, x, y).backward()
            trainer.step()
        elapsed = time.perf_counter() - start
        trainer.finish()
        result[mode] = {"elapsed": elapsed, "totals": dict(trainer.timing_totals)}
    return result
