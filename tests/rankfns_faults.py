"""Rank functions and a torchrun script for tests/test_faults.py (issue 42: dead and stuck peers).

One small training loop per strategy (:data:`STRATEGIES`); at step ``fault_step`` the
``fault_rank`` either sleeps (``"sleep"``: a stuck peer) or exits (``"exit"``: ``os._exit(1)``, a
dead peer), and every healthy rank must then fail with a Python error within a bounded time.

Each rank records what happened in ``record`` (a directory), one file per rank, one line::

    FAULT <fault> <time.time()>                       the faulty rank, before it sleeps / exits
    FAILED <time.time()> <seconds since the fault step began> <type>: <message, one line>
    DONE <time.time()>                                a rank that finished every step

Under torchrun (``torchrun --standalone --nproc-per-node 2 tests/rankfns_faults.py STRATEGY
--timeout 4 --fault sleep --record DIR``) the script initialises ``torch.distributed`` itself
with ``timeout=``, as a user's script does (its rendezvous store waits longer, so that ranks
starting on a loaded host do not fail before the fault); :func:`train` is the same loop for
``pipecomm.lab.networks.launch`` pools (``launch.spawn(train, 2, ..., pg_timeout_s=4)``).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from pipecomm import backend, hooks
from pipecomm.collectives import p2p
from pipecomm.decentralized import DecentralizedDataParallel
from pipecomm.lab.networks import launch
from pipecomm.pipesgd import PipeSGD

#: strategy -> the backend the world is initialised with under torchrun
STRATEGIES = {
    "ddp": "gloo",  # stock DDP over gloo: the reference
    "pipesgd": "gloo",  # PipeSGD(mode="pipe", algorithm="lp")
    "hook": "gloo",  # stock DDP + hooks.pipelined_hook (ring)
    "decentralized": "gloo",  # DecentralizedDataParallel (lp gossip)
    "ddp-lp": "gloo",  # stock DDP over pipecomm.backend.new_group(algorithm="lp")
    "ddp-pipecomm": "gloo",  # stock DDP over dist.new_group(backend="pipecomm")
    "backend": "pipecomm",  # init_process_group("pipecomm"), stock DDP on the world
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(32, 256)
        self.fc2 = nn.Linear(256, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _record(record: str | None, line: str) -> None:
    print(line, flush=True)
    if record is not None:
        Path(record, f"rank{dist.get_rank()}.txt").write_text(line + "\n")


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' | '.join(str(exc).splitlines())[:1500]}"


def _trainer(strategy: str, model: nn.Module) -> Any:
    """``step(x, y)``: one iteration of ``strategy`` on ``model``."""
    loss_fn = nn.functional.mse_loss
    if strategy == "pipesgd":
        opt = PipeSGD(model, torch.optim.SGD(model.parameters(), lr=0.01), mode="pipe",
                      staleness=1, algorithm="lp")

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

        return step
    if strategy == "decentralized":
        ddp = DecentralizedDataParallel(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                        topology="complete")
        return lambda x, y: loss_fn(ddp(x), y).backward()
    if strategy == "hook":
        ddp = DDP(model)
        hooks.register(ddp, hooks.PipelinedState(staleness=1, algorithm="ring"),
                       hooks.pipelined_hook)
    elif strategy == "ddp-lp":
        ddp = DDP(model, process_group=backend.new_group(algorithm="lp"))
    elif strategy == "ddp-pipecomm":
        ddp = DDP(model, process_group=dist.new_group(backend="pipecomm"))
    else:  # "ddp", "backend": DDP on the world's group
        ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss_fn(ddp(x), y).backward()
        opt.step()

    return step


def train(strategy: str, fault: str, record: str | None = None, fault_rank: int = 1,
          fault_step: int = 5, steps: int = 40) -> str:
    """Train ``strategy`` for ``steps`` steps; ``fault_rank`` sleeps 600 s or exits at
    ``fault_step``. A healthy rank that fails records ``FAILED`` and re-raises."""
    faulthandler.enable()
    rank = dist.get_rank()
    torch.manual_seed(0)
    step = _trainer(strategy, Net())
    g = torch.Generator().manual_seed(rank)
    started = time.monotonic()
    for i in range(steps):
        if i == fault_step:
            started = time.monotonic()
            if rank == fault_rank:
                _record(record, f"FAULT {fault} {time.time():.3f}")
                if fault == "exit":
                    os._exit(1)
                time.sleep(600)
        try:
            step(torch.randn(16, 32, generator=g), torch.randn(16, 4, generator=g))
        except BaseException as exc:
            _record(record, f"FAILED {time.time():.3f} {time.monotonic() - started:.2f} "
                            f"{_one_line(exc)}")
            raise
    _record(record, f"DONE {time.time():.3f}")
    return "done"


def transfers_after_peer_left() -> str | None:
    """Rank 1 exits half a second after returning (a dead peer whose result the pool already
    has); rank 0's receive from it, posted before, and a direct one posted after, fail: what
    each raised, one line each (rank 1: None)."""
    group = launch.comm_group()
    dist.barrier()
    if dist.get_rank() == 1:
        threading.Timer(0.5, os._exit, (0,)).start()
        return None
    lines, buf = [], torch.empty(4)
    pending = p2p.post_recv(buf, 1, group)
    for name, wait in (("post_recv", pending.wait),
                       ("direct recv", lambda: p2p.direct(buf, 1, group, 0, False)(buf).wait())):
        try:
            wait()
            lines.append(f"{name}: no error")
        except RuntimeError as exc:
            lines.append(f"{name}: {_one_line(exc)}")
    return "\n".join(lines)


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("strategy", choices=sorted(STRATEGIES))
    parser.add_argument("--fault", choices=("sleep", "exit"), default="sleep")
    parser.add_argument("--timeout", type=float, default=4.0, help="the world's timeout (s)")
    parser.add_argument("--record", default=None, help="directory of the per-rank records")
    parser.add_argument("--fault-step", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=False, timeout=datetime.timedelta(seconds=120))
    # every rank arrives before the world's short timeout starts to count: the ranks of seven
    # jobs starting at once on 2 cores reached init_process_group more than 4 s apart
    store.set(f"arrived/{rank}", "1")
    store.wait([f"arrived/{r}" for r in range(world)])
    dist.init_process_group(STRATEGIES[args.strategy], store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.timeout))
    train(args.strategy, args.fault, args.record, fault_step=args.fault_step, steps=args.steps)
    dist.destroy_process_group()


if __name__ == "__main__":
    _main()
