"""Rank functions for tests/test_hooks.py (pipecomm.hooks).

Oracles: DDP's own averaging over gloo for :func:`pipecomm.hooks.allreduce_hook`,
:class:`pipecomm.pipesgd.PipeSGD` (``mode="pipe"``) for :func:`pipecomm.hooks.pipelined_hook`,
and for :func:`pipecomm.hooks.gossip_hook` a float64 simulation of all ranks in one process
(:func:`gossip_simulation`) and DecentralizedDataParallel.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipecomm import backend, hooks
from pipecomm.decentralized.topology import get_topology
from pipecomm.pipesgd import PipeSGD


class Net(nn.Module):
    """A small MLP with odd sizes (no buffers: PipeSGD and DDP treat buffers differently)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 11)
        self.fc3 = nn.Linear(11, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(9, 7, generator=g), torch.randn(9, 3, generator=g)


def _model(dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(dist.get_rank())  # different on every rank: construction broadcasts rank 0's
    return Net().to(dtype)


def _optimizer(params: Any, spec: tuple) -> torch.optim.Optimizer:
    name, lr, *rest = spec
    if name == "sgd":
        momentum, wd = rest
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=wd)
    return torch.optim.Adam(params, lr=lr, weight_decay=rest[0] if rest else 0.0)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def allreduce_hook_vs_ddp(algorithm: str, compression: str | None, steps: int = 5) -> dict:
    """DDP with allreduce_hook(CollectiveState(algorithm)) vs plain DDP (gloo's averaging)."""
    rank = dist.get_rank()
    out = {}
    for name in ("plain", "hook"):
        model = _model()
        ddp = DDP(model, bucket_cap_mb=0.0005)
        if name == "hook":
            hooks.register(ddp, hooks.CollectiveState(algorithm, compression), hooks.allreduce_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for step in range(steps):
            x, y = _batch(rank, step)
            opt.zero_grad()
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
        out[name] = _params(model)
    return out


def pipelined_vs_pipesgd(
    staleness: int,
    algorithm: str,
    optim: tuple,
    skip_filling: bool,
    steps: int = 6,
    compression: str | None = None,
    group_kind: str = "world",
    error_feedback: bool = False,
) -> dict:
    """Parameters after ``steps`` iterations: DDP + pipelined_hook vs PipeSGD(mode="pipe").

    ``skip_filling``: the loop skips ``opt.step()`` while ``state.filling``. ``group_kind``:
    ``"world"`` (DDP and the state on the default group) or ``"pipecomm"`` (both on a
    pipecomm.backend group of every rank).
    """
    rank = dist.get_rank()
    group = backend.new_group(algorithm="lp") if group_kind == "pipecomm" else None

    model = _model()
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.0005)  # several buckets, rebuilt
    state = hooks.PipelinedState(staleness, algorithm, compression, error_feedback=error_feedback)
    hooks.register(ddp, state, hooks.pipelined_hook)
    opt = _optimizer(model.parameters(), optim)
    filling = []
    for step in range(steps):
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        filling.append(state.filling)
        if not (skip_filling and state.filling):
            opt.step()
    state.wait()
    hook_params = _params(model)

    ref = _model()
    popt = PipeSGD(
        ref,
        _optimizer(ref.parameters(), optim),
        mode="pipe",
        staleness=staleness,
        algorithm=algorithm,
        compression=compression,
        group=group,
        error_feedback=error_feedback,
    )
    for step in range(steps):
        x, y = _batch(rank, step)
        popt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        popt.step()
    pipesgd_params = _params(ref)  # w_T, before finish() applies the last k averages
    popt.finish()
    return dict(
        hook=hook_params, pipesgd=pipesgd_params, filling=filling, iteration=state.iteration
    )


class FakeBucket:
    """What DDP passes to a hook: a flat buffer over some parameters."""

    def __init__(self, index: int, params: list[torch.Tensor], last: bool, scale: float) -> None:
        self._index, self._params, self._last = index, params, last
        self._buffer = torch.cat([p.detach().reshape(-1) for p in params]) * scale

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def is_last(self) -> bool:
        return self._last


def rebuilt_buckets(staleness: int) -> dict:
    """The hook called directly with buckets whose layout changes between iterations (as when
    DDP rebuilds its buckets): each parameter gets the average launched k iterations earlier."""
    rank, p = dist.get_rank(), dist.get_world_size()
    ps = [torch.full((n,), float(i + 1)) for i, n in enumerate((3, 5, 2, 4))]
    layouts = [
        [[0, 1], [2, 3]],
        [[3, 2, 1], [0]],
        [[0, 1, 2, 3]],
        [[1], [0], [3, 2]],
        [[2, 0], [3, 1]],
    ]
    state = hooks.PipelinedState(staleness, "lp")
    bad = []
    for t, layout in enumerate(layouts):
        scale = float(rank + 1) * (t + 1)
        for b, idx in enumerate(layout):
            bucket = FakeBucket(b, [ps[i] for i in idx], b == len(layout) - 1, scale)
            got = hooks.pipelined_hook(state, bucket).wait()
            if t < staleness:
                want = torch.zeros_like(bucket.buffer())
            else:
                mean_scale = sum(r + 1 for r in range(p)) / p * (t - staleness + 1)
                want = torch.cat([ps[i] * mean_scale for i in idx])
            if not torch.allclose(got, want):
                bad.append((t, b, got.tolist(), want.tolist()))
    state.wait()
    return dict(bad=bad, iteration=state.iteration)


def wrong_group() -> dict:
    """A state bound to another process group: register() refuses it on every rank, and the hook
    refuses it on a rank outside the state's group."""
    rank = dist.get_rank()
    only0 = dist.new_group([0])
    out: dict[str, str] = {}
    ddp = DDP(_model())
    for name, fn in (
        (
            "register",
            lambda: hooks.register(
                ddp, hooks.CollectiveState(process_group=only0), hooks.allreduce_hook
            ),
        ),
        (
            "hook",
            lambda: hooks.allreduce_hook(
                hooks.CollectiveState(process_group=only0),
                FakeBucket(0, [torch.ones(3)], True, 1.0),
            ),
        ),
        (
            "pipelined_hook",
            lambda: hooks.pipelined_hook(
                hooks.PipelinedState(process_group=only0), FakeBucket(0, [torch.ones(3)], True, 1.0)
            ),
        ),
        ("not_a_state", lambda: hooks.allreduce_hook(object(), None)),
    ):
        if name in ("hook", "pipelined_hook") and rank == 0:
            continue  # rank 0 is a member (a group of one: no communication)
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()
    return out


def pipelined_overlap(staleness: int, steps: int = 12, width: int = 512, batch: int = 64) -> dict:
    """Median iteration time of the bare model (no communication), plain DDP (gloo's built-in
    AllReduce, which the emulated network does not slow down), and DDP with allreduce_hook and
    pipelined_hook (pipecomm's ring, emulated when the ranks run under a network)."""
    rank = dist.get_rank()
    times: dict[str, float] = {}
    for name in ("local", "plain", "allreduce_hook", "pipelined_hook"):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 10))
        ddp = model if name == "local" else DDP(model)
        state = None
        if name == "allreduce_hook":
            hooks.register(ddp, hooks.CollectiveState("ring"), hooks.allreduce_hook)
        elif name == "pipelined_hook":
            state = hooks.PipelinedState(staleness, "ring")
            hooks.register(ddp, state, hooks.pipelined_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(batch, 64), torch.randint(0, 10, (batch,))
        per = []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            per.append(time.perf_counter() - t0)
        if state is not None:
            state.wait()
        per.sort()
        times[name] = per[len(per) // 2]
    return times


# --------------------------------------------------------------------------- issue 34


#: bucket layouts (parameter indices) per step: DDP's rebuild after step 0 and again later
EF_LAYOUTS = [
    [[0, 1], [2, 3]],
    [[3, 2, 1], [0]],
    [[3, 2, 1], [0]],
    [[0, 1, 2, 3]],
    [[1], [0, 3, 2]],
]
EF_SIZES = (300, 5, 70, 260)


def ef_gradient(rank: int, step: int, i: int) -> torch.Tensor:
    """Rank ``rank``'s gradient of parameter ``i`` at ``step`` (a fixed sequence)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + i)
    return torch.randn(EF_SIZES[i], generator=g) * (1 + i)


def error_feedback_hook(
    kind: str, algorithm: str, compression: str, staleness: int, stop: int | None = None
) -> dict:
    """The hook (``kind`` "allreduce" or "pipelined") called with the fixed gradients of
    :func:`ef_gradient` in the layouts of :data:`EF_LAYOUTS`: per step, its outputs (flat per
    parameter) and its residuals (per parameter index, from ``state_dict()``). With ``stop``,
    the state is saved before step ``stop`` (torch.save) and loaded into a fresh state."""
    import io

    rank = dist.get_rank()
    ps = [torch.zeros(n) for n in EF_SIZES]

    def fresh() -> Any:
        if kind == "allreduce":
            state: Any = hooks.CollectiveState(algorithm, compression, error_feedback=True)
        else:
            state = hooks.PipelinedState(staleness, algorithm, compression, error_feedback=True)
        state._params = ps  # what hooks.register records (no DDP model here)
        return state

    state = fresh()
    hook = hooks.allreduce_hook if kind == "allreduce" else hooks.pipelined_hook
    outputs, residuals = [], []
    for t, layout in enumerate(EF_LAYOUTS):
        if t == stop:
            buf = io.BytesIO()
            torch.save(state.state_dict(), buf)
            buf.seek(0)
            state = fresh()
            state.load_state_dict(torch.load(buf, weights_only=False))
        out: dict[int, torch.Tensor] = {}
        for b, idx in enumerate(layout):
            bucket = FakeBucket(b, [ps[i] for i in idx], b == len(layout) - 1, 1.0)
            bucket._buffer = torch.cat([ef_gradient(rank, t, i) for i in idx])
            got = hook(state, bucket).wait()
            off = 0
            for i in idx:
                out[i] = got[off : off + EF_SIZES[i]].clone()
                off += EF_SIZES[i]
        outputs.append([out[i] for i in range(len(ps))])
        residuals.append(state.state_dict()["residuals"])
    if kind != "allreduce":
        state.wait()
    return dict(outputs=outputs, residuals=residuals)


def _train_hooked(
    model: nn.Module,
    state: Any,
    steps: range,
    optim: tuple,
    opt_state: dict | None = None,
    hook_state: dict | None = None,
) -> tuple[dict, dict, dict]:
    """DDP + the pipelined hook for ``steps``; loads ``opt_state``/``hook_state`` first. Returns
    (model state, optimizer state, hook state), each through torch.save/torch.load."""
    import io

    rank = dist.get_rank()
    ddp = DDP(model, bucket_cap_mb=0.0005)
    hooks.register(ddp, state, hooks.pipelined_hook)
    opt = _optimizer(model.parameters(), optim)
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    if hook_state is not None:
        state.load_state_dict(hook_state)
    for step in steps:
        x, y = _batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(ddp(x), y).backward()
        if not state.filling:
            opt.step()
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    return loaded["model"], loaded["opt"], loaded["hook"]


def pipelined_resume(
    staleness: int,
    algorithm: str,
    compression: str | None,
    error_feedback: bool,
    stop: int,
    steps: int = 7,
) -> dict:
    """Parameters after ``steps`` iterations of DDP + pipelined_hook (Adam): uninterrupted, and
    stopped after ``stop`` iterations, checkpointed and resumed in a fresh DDP and state."""

    def state() -> hooks.PipelinedState:
        return hooks.PipelinedState(
            staleness, algorithm, compression, error_feedback=error_feedback
        )

    optim = ("adam", 0.01, 0.01)
    whole = _model()
    _train_hooked(whole, state(), range(steps), optim)
    first = _model()
    model_sd, opt_sd, hook_sd = _train_hooked(first, state(), range(stop), optim)
    second = _model()  # a fresh replica: rank-dependent init, overwritten by the checkpoint
    second.load_state_dict(model_sd)
    _train_hooked(second, state(), range(stop, steps), optim, opt_sd, hook_sd)
    fresh = _model()  # the old behaviour: a fresh hook state refills the pipeline
    fresh.load_state_dict(model_sd)
    _train_hooked(fresh, state(), range(stop, steps), optim, opt_sd, None)
    return dict(
        whole=_params(whole),
        resumed=_params(second),
        refilled=_params(fresh),
        in_flight=len(hook_sd["in_flight"]),
        residuals=len(hook_sd["residuals"]),
    )


# --------------------------------------------------------------------------- gossip_hook


def gossip_topology(spec: Any, world: int) -> Any:
    """A topology name, or ``("aer", ranks_per_node)`` (an AlternatingExpRingTopology)."""
    if isinstance(spec, str):
        return spec
    return get_topology("alternating-exp-ring", world, ranks_per_node=spec[1])


def _gossip_loss(model: nn.Module, rank: int, step: int, m: int, accum: int) -> torch.Tensor:
    x, y = _batch(rank, 10 * step + m)
    return nn.functional.mse_loss(model(x.double()), y.double()) / accum


def _train_gossip(
    model: nn.Module, state: hooks.GossipState, steps: range, optim: tuple, accum: int = 1,
    plain: bool = False, resume: tuple | None = None,
) -> tuple[list, torch.optim.Optimizer]:
    """DDP + gossip_hook (several buckets, rebuilt after the first iteration); ``accum``
    micro-batches per step, all but the last under ``no_sync``; ``plain``: registered with
    ``register_comm_hook`` itself; ``resume``: (optimizer state, hook state) to load first, DDP
    built without its broadcast (every rank holds its own replica). The trajectory."""
    rank = dist.get_rank()
    ddp = DDP(model, bucket_cap_mb=0.0005, init_sync=resume is None)
    if plain:
        ddp.register_comm_hook(state, hooks.gossip_hook)
    else:
        hooks.register(ddp, state, hooks.gossip_hook)
    opt = _optimizer(model.parameters(), optim)
    if resume is not None:
        opt.load_state_dict(resume[0])
        state.load_state_dict(resume[1])
    traj = []
    for step in steps:
        opt.zero_grad()
        for m in range(accum):
            with ddp.no_sync() if m < accum - 1 else contextlib.nullcontext():
                _gossip_loss(ddp, rank, step, m, accum).backward()
        opt.step()
        traj.append(_params(model))
    return traj, opt


def gossip_vs_simulation(cases: list[tuple]) -> list[dict]:
    """Per case ``(topology, mix, algorithm, optim, accum, plain)``: this rank's parameters
    after every step of DDP + gossip_hook (float64), and the hook's iteration; with
    ``mix="parameters"`` also DecentralizedDataParallel's on the same data (the same rule)."""
    from pipecomm.decentralized import DecentralizedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for topology, mix, algorithm, optim, accum, plain in cases:
        state = hooks.GossipState(gossip_topology(topology, world), mix, algorithm)
        traj, _ = _train_gossip(_model(torch.float64), state, range(GOSSIP_STEPS), optim,
                                accum, plain)
        res = dict(traj=traj, iteration=state.iteration)
        if mix == "parameters" and accum == 1:
            model = _model(torch.float64)
            wrapper = DecentralizedDataParallel(
                model, _optimizer(model.parameters(), optim), gossip_topology(topology, world),
                bucket_mb=1e-6, algorithm=algorithm)
            res["decentralized"] = []
            for step in range(GOSSIP_STEPS):
                _gossip_loss(wrapper, rank, step, 0, 1).backward()  # mixes and steps inside
                res["decentralized"].append(_params(model))
            wrapper.close()
        out.append(res)
    return out


GOSSIP_STEPS = 5


def gossip_simulation(topology: Any, mix: str, optim: tuple, accum: int, world: int) -> list:
    """The oracle: all ranks in one process, float64, from ``W_t = mixing_matrix(t)``. Per step
    every rank's gradient ``g_i`` (at its own ``x_i``, summed over micro-batches), then
    ``mix="gradients"``: ``x_i <- step(x_i, sum_j (W_t)_ij g_j)``; ``mix="parameters"``:
    ``x_i <- step(sum_j (W_t)_ij x_j, g_i)``. Every rank's trajectory."""
    topo = get_topology(gossip_topology(topology, world), world)
    torch.manual_seed(0)  # rank 0's replica, which DDP broadcasts
    start = Net().to(torch.float64)
    models = [Net().to(torch.float64) for _ in range(world)]
    for m in models:
        m.load_state_dict(start.state_dict())
    opts = [_optimizer(m.parameters(), optim) for m in models]
    traj: list[list] = [[] for _ in range(world)]
    for t in range(GOSSIP_STEPS):
        grads = []
        for i, m in enumerate(models):
            m.zero_grad()
            for mb in range(accum):
                _gossip_loss(m, i, t, mb, accum).backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        w = torch.from_numpy(topo.mixing_matrix(t))
        xs = [torch.stack([list(m.parameters())[k].detach() for m in models])
              for k in range(len(grads[0]))]
        gs = [torch.stack([g[k] for g in grads]) for k in range(len(grads[0]))]
        for i, m in enumerate(models):
            with torch.no_grad():
                for k, p in enumerate(m.parameters()):
                    if mix == "parameters":
                        p.copy_(torch.tensordot(w[i], xs[k], dims=1))
                        p.grad = grads[i][k]
                    else:
                        p.grad = torch.tensordot(w[i], gs[k], dims=1)
            opts[i].step()
            traj[i].append(_params(m))
    return traj


def gossip_resume(topology: Any, mix: str, stop: int, steps: int = 6) -> dict:
    """Parameters after ``steps`` iterations of DDP + gossip_hook (Adam): uninterrupted, and
    stopped after ``stop``, every rank's model, optimizer and hook state saved and loaded into a
    fresh model, DDP and state; and resumed without the hook state (its step restarts at 0)."""
    import io

    world, optim = dist.get_world_size(), ("adam", 0.01)

    def state() -> hooks.GossipState:
        return hooks.GossipState(gossip_topology(topology, world), mix, "lp")

    whole, _ = _train_gossip(_model(torch.float64), state(), range(steps), optim)
    first = _model(torch.float64)
    hook_state = state()
    _, opt = _train_gossip(first, hook_state, range(stop), optim)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt.state_dict(),
                "hook": hook_state.state_dict()}, buf)
    out = dict(whole=whole[-1], saved_iteration=hook_state.iteration)
    for name in ("resumed", "fresh_state"):
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        model = _model(torch.float64)  # a rank-dependent replica, overwritten by this rank's own
        model.load_state_dict(ckpt["model"])
        hook = ckpt["hook"] if name == "resumed" else state().state_dict()
        traj, _ = _train_gossip(model, state(), range(stop, steps), optim,
                                resume=(ckpt["opt"], hook))
        out[name] = traj[-1]
    return out


def gossip_refusals() -> dict[str, str]:
    """What the hook refuses on the ranks: a topology that does not fit the world size (at
    register), a state of another kind."""
    out = {}
    for name, fn in (
        ("ring", lambda: hooks.register(DDP(_model()), hooks.GossipState("ring"),
                                        hooks.gossip_hook)),
        ("one-peer-exp", lambda: hooks.register(DDP(_model()), hooks.GossipState(),
                                                hooks.gossip_hook)),
        ("not_a_state", lambda: hooks.gossip_hook(hooks.CollectiveState(), None)),
    ):
        try:
            fn()
            out[name] = "no error"
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
    return out
