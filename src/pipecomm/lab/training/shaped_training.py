"""Whole training steps on a virtual cluster: ``examples/train_gpt.py`` per (strategy, seed).

Each run is one ``torchrun`` job of ``examples/train_gpt.py`` (a nanoGPT-style GPT on pydoc
text) with one agent per node of a :class:`pipecomm.lab.networks.cluster.VirtualCluster`. A strategy is
``NAME[:ALGORITHM][+CODEC]`` (:func:`strategy_args`): ``ddp`` is torch's DDP on gloo, ``ddp+fp16``
the same with torch's own ``fp16_compress_hook``, ``ddp+int8`` with the algorithm of its
experimental ``quantization_pertensor_hook`` (uint8 allgathered; train_gpt.py's port, as torch
2.13's fails on gloo); ``ddp-pipecomm:ring`` DDP over pipecomm's
process group; ``ddp-pipelined-hook:ring`` Pipe-SGD inside DDP; ``pipesgd:ring``;
``decentralized`` (DecentralizedDataParallel); ``ddp-gossip-hook`` (its rule inside DDP, with
``pipecomm.hooks.gossip_hook``).

A run's row (:data:`COLUMNS`): rank 0's median step time over the steps after ``warmup_steps``
(a run is the unit of repeat: its seed makes it independent of the others), the last step's
loss, the validation loss, and the bytes each rank sent per step (the node interfaces' transmit
counters over the whole run -- rendezvous and evaluation included -- over the node's ranks and
the steps). :func:`run_rounds` runs every strategy once per seed, in an order rotated from seed
to seed; a run that fails becomes a row with its ``error``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import tempfile
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from pipecomm.lab import results
from pipecomm.lab.measure import stats, sweep
from pipecomm.lab.networks import cluster

__all__ = ["COLUMNS", "NAMES", "SCRIPT", "check_strategy", "is_stock", "run_once",
           "run_or_error", "run_rounds", "step_table", "strategy_args"]

SCRIPT = results.REPO_ROOT / "examples" / "train_gpt.py"
NAMES = ("ddp", "ddp-pipecomm", "ddp-pipelined-hook", "pipesgd", "decentralized",
         "ddp-gossip-hook")
COLUMNS = ("strategy", "seed", "nodes", "ranks_per_node", "bandwidth_Bps", "steps", "step_ms",
           "step_times_ms", "loss", "val_loss", "tx_bytes_per_rank_step", "attempts",
           "exit_abort", "error")
_ABORT = "exitcode : -6"  # this torch build's gloo sometimes aborts a rank at exit: run again


def strategy_args(spec: str) -> list[str]:
    """``train_gpt.py`` arguments of a strategy ``NAME[:ALGORITHM][+CODEC]``.

    Example::

        >>> strategy_args("ddp-pipecomm:ring+fp16")
        ['--strategy', 'ddp-pipecomm', '--algorithm', 'ring', '--compression', 'fp16']
    """
    head, _, codec = spec.partition("+")
    name, _, algorithm = head.partition(":")
    out = ["--strategy", name]
    if algorithm:
        out += ["--algorithm", algorithm]
    if codec:
        out += ["--compression", codec]
    return out


def is_stock(spec: str) -> bool:
    """Whether ``spec`` is torch's own DDP (``ddp``; ``ddp+fp16``, ``ddp+int8`` with torch's fp16
    and uint8 quantization hooks): the baselines, drawn apart from pipecomm's strategies.

    Example::

        >>> [is_stock(s) for s in ("ddp", "ddp+fp16", "ddp-pipecomm:ring")]
        [True, True, False]
    """
    return spec.partition("+")[0] == "ddp"


def check_strategy(spec: str) -> None:
    """Raise ValueError unless ``spec`` names a strategy of ``train_gpt.py``.

    Example::

        >>> check_strategy("ddp+fp16")
        >>> check_strategy("dp")
        Traceback (most recent call last):
        ...
        ValueError: unknown strategy 'dp': NAME[:ALGORITHM][+CODEC] with NAME in ddp, ddp-pipecomm, ddp-pipelined-hook, pipesgd, decentralized, ddp-gossip-hook
    """
    if not isinstance(spec, str) or strategy_args(spec)[1] not in NAMES:
        raise ValueError(f"unknown strategy {spec!r}: NAME[:ALGORITHM][+CODEC] with NAME in "
                         f"{', '.join(NAMES)}")


def _tx_bytes(net: Any) -> list[int]:
    """Bytes each node's interface has sent so far."""
    out = []
    for i in range(net.nodes):
        text = subprocess.run(net.exec_argv(i, ["cat", f"/sys/class/net/{cluster.IFNAME}/"
                                                   "statistics/tx_bytes"]),
                              capture_output=True, text=True, timeout=20, check=True).stdout
        out.append(int(text.strip()))
    return out


def run_once(net: Any, spec: str, seed: int, config: dict[str, Any]) -> dict[str, Any]:
    """One training run of ``spec`` at ``seed`` on the started cluster ``net``: its row.

    ``config``: ``steps``, ``warmup_steps``, ``n_layer``, ``n_embd``, ``batch_size``,
    ``block_size``, ``timeout_s``. This torch build's gloo sometimes aborts a rank (signal 6):
    after rank 0 logged every step and the validation loss the run is kept (``exit_abort``),
    before that it is started again once (``attempts``). Raises :class:`pipecomm.lab.networks.cluster.ClusterError` or
    TimeoutError when it fails.
    """
    if not SCRIPT.exists():
        raise FileNotFoundError(f"{SCRIPT} is missing: the training runs need the repository's "
                                "examples/ (an editable install of a clone)")
    for attempt in (1, 2):
        with tempfile.TemporaryDirectory(prefix="train") as out:
            before = _tx_bytes(net)
            argv = [str(SCRIPT), *strategy_args(spec), "--seed", str(seed), "--out", out,
                    "--max-iters", str(config["steps"]), "--n-layer", str(config["n_layer"]),
                    "--n-embd", str(config["n_embd"]), "--batch-size", str(config["batch_size"]),
                    "--block-size", str(config["block_size"]), "--eval-iters", "2",
                    "--timeout", str(config["timeout_s"])]
            aborted = False
            try:
                net.torchrun(argv, timeout_s=config["timeout_s"], cwd=str(results.REPO_ROOT))
            except cluster.ClusterError as exc:
                if _ABORT not in " ".join(str(exc).split()):
                    raise
                aborted = _finished(Path(out) / "log.jsonl", config["steps"])
                if not aborted:  # died before its last record: start it again, once
                    if attempt == 1:
                        continue
                    raise
            sent = [b - a for a, b in zip(before, _tx_bytes(net))]
            log = [json.loads(line) for line in (Path(out) / "log.jsonl").read_text().splitlines()]
        steps = [r for r in log if "dt_ms" in r]
        timed = [r["dt_ms"] for r in steps[config["warmup_steps"]:]]
        val = [r["val_loss"] for r in log if "val_loss" in r]
        return {"strategy": spec, "seed": seed, "nodes": net.nodes,
                "ranks_per_node": net.ranks_per_node, "bandwidth_Bps": net.bandwidth_Bps,
                "steps": len(steps), "step_ms": statistics.median(timed),
                "step_times_ms": ";".join(f"{t:.2f}" for t in timed), "loss": steps[-1]["loss"],
                "val_loss": val[-1] if val else float("nan"),
                "tx_bytes_per_rank_step": statistics.mean(sent) / net.ranks_per_node / len(steps),
                "attempts": attempt, "exit_abort": aborted, "error": ""}
    raise AssertionError("unreachable")


def _finished(log_path: Path, steps: int) -> bool:
    """Whether rank 0's log holds every step and the final validation loss: a run that gloo
    aborted after that (at exit) measured everything."""
    if not log_path.exists():
        return False
    log = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    return sum("dt_ms" in r for r in log) == steps and any("val_loss" in r for r in log)


def run_or_error(net: Any, spec: str, seed: int, config: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_once`, or the row of its failure (``strategy``, ``seed`` and ``error``: the end
    of the failing node's output) when the cluster or the time limit stops it."""
    try:
        return run_once(net, spec, seed, config)
    except (cluster.ClusterError, TimeoutError) as exc:
        return {"strategy": spec, "seed": seed, "error": " ".join(str(exc).split())}


def run_rounds(net: Any, specs: Sequence[str], seeds: Sequence[int], config: dict[str, Any],
               done: Collection[tuple[str, int]] = (),
               on_row: Callable[[dict[str, Any]], None] | None = None,
               runs: Any = None) -> list[dict[str, Any]]:
    """Every strategy of ``specs`` once per seed on the started cluster ``net``, the order
    rotated from seed to seed (:func:`pipecomm.lab.measure.sweep.rotated`); ``done``: (strategy, seed)
    pairs to skip; ``on_row`` sees each row as it comes; ``runs``: a
    :class:`pipecomm.lab.results.Runs` that keeps each finished run (an interrupted sweep
    resumes) and shows the progress. A failed run is a row with its ``error``; the others go on.

    Example::

        rows = run_rounds(net, ["ddp", "ddp-pipecomm:ring"], [0, 1], config)
    """
    rows = []
    for i, seed in enumerate(seeds):
        for spec in sweep.rotated(list(specs), i):
            if (spec, seed) in done:
                continue
            if runs is None:
                row = run_or_error(net, spec, seed, config)
            else:
                key = {"strategy": spec, "seed": seed, "nodes": net.nodes,
                       "ranks_per_node": net.ranks_per_node,
                       "bandwidth_Bps": net.bandwidth_Bps, **config}
                row = runs(key, run_or_error, net, spec, seed, config)
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows


def step_table(rows: pd.DataFrame, base: str = "ddp") -> pd.DataFrame:
    """Per strategy of ``rows`` (the runs of one configuration, failed runs left out): the median
    over seeds of the runs' step times with its bootstrap 95% interval, the ratio to ``base``
    (median of the per-seed ratios, bootstrap interval over the seeds), MB sent per rank per
    step, and the final training and validation losses (mean, and spread = max - min over seeds).

    Example::

        >>> rows = pd.DataFrame({"strategy": ["ddp", "ddp", "x", "x"], "seed": [0, 1, 0, 1],
        ...                      "step_ms": [400.0, 420.0, 200.0, 220.0], "loss": [2.0, 2.2, 2.1, 2.2],
        ...                      "val_loss": [2.5, 2.5, 2.6, 2.6], "tx_bytes_per_rank_step": [5e6] * 4})
        >>> step_table(rows)[["strategy", "step_ms", "ratio", "ratio_lo", "ratio_hi"]].round(3)
          strategy  step_ms  ratio  ratio_lo  ratio_hi
        0      ddp    410.0  1.000       1.0     1.000
        1        x    210.0  0.512       0.5     0.524
    """
    ok = rows[rows.get("error", pd.Series("", index=rows.index)).astype(object).fillna("").eq("")]
    base_ms = ok[ok.strategy == base].set_index("seed").step_ms
    out = []
    for spec, g in ok.groupby("strategy", sort=False):
        g = g.sort_values("seed")
        mid, lo, hi = stats.median_ci(g.step_ms.tolist())
        common = [s for s in g.seed if s in base_ms.index]
        ratio = (float("nan"),) * 3
        if common:
            ratio = stats.paired_ratio_ci(g.set_index("seed").step_ms[common].tolist(),
                                          base_ms[common].tolist())
        out.append({"strategy": spec, "seeds": len(g), "step_ms": mid, "step_lo": lo,
                    "step_hi": hi, "ratio": ratio[0], "ratio_lo": ratio[1], "ratio_hi": ratio[2],
                    "MB_per_rank_step": g.tx_bytes_per_rank_step.mean() / 1e6,
                    "loss": g.loss.mean(), "loss_spread": g.loss.max() - g.loss.min(),
                    "val_loss": g.val_loss.mean()})
    return pd.DataFrame(out)
