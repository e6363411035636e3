"""A rehearsal of the gpu profile on CPUs: every experiment, parameter, data path and claim of
``artifact/profiles/gpu.yaml`` executed end to end in minutes. It rehearses and decides nothing.

``./run_all.sh --profile gpu --rehearse`` runs the gpu profile's experiments with parameters
derived from the profile mechanically (:func:`rehearse`, one rule per parameter name in
:data:`RULES`): world sizes capped at the :data:`~pipecomm.lab.standin.GPUS` stand-in GPUs,
message sizes, iterations, repeats, seeds and rate grids shrunk, batches divided; rates, links,
models, methods and every non-numeric value kept as the profile gives them. The experiments keep
their NCCL code paths (``backend="nccl"``); underneath, :mod:`pipecomm.lab.standin` starts gloo
ranks on the CPU for them and stands a generated CIFAR-10 (:func:`write_cifar10_standin`, in the
official "python" batch format, with its own checksums) in for the real one, read through the
real loader (:func:`pipecomm.lab.workloads.data.fetch` verifies the archive and every batch, extracts it,
:func:`pipecomm.lab.workloads.data.load_cifar10` reads and normalises it). A numeric parameter without a
rule is an error (:class:`RehearsalError`): the rehearsal cannot tell a size to shrink from a
rate to keep, and it never drops a parameter silently.

What it writes goes to ``results/gpu-rehearsal/`` only (:data:`NAME`), never to
``results/gpu/``: each experiment's ``env.json`` records ``rehearsal`` (every replaced parameter,
its gpu value, its rehearsal value and the rule), its figure carries a REHEARSAL mark
(:func:`mark_figure`), and its claims are shown as REHEARSED (the check ran on the rehearsal's
data; its verdict is withheld) or NOT DECIDED (the experiment has no result, or the check could
not run: the reason is the finding), never PASS or FAIL (:func:`withhold`). A rehearsal says
nothing about the claims: only the gpu profile's run on GPUs decides them.

Example::

    >>> from pipecomm.lab import rehearsal
    >>> params, replaced = rehearsal.rehearse("E5", {"world_size": 16, "iterations": 12,
    ...                                              "lr": 0.05, "backend": "nccl"})
    >>> params["world_size"], params["iterations"], params["lr"], params["backend"]
    (8, 6, 0.05, 'nccl')
    >>> sorted(replaced)
    ['backend', 'iterations', 'world_size']
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import gzip
import hashlib
import io
import json
import os
import pickle
import re
import tarfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipecomm.lab import results, standin
from pipecomm.lab.workloads.download import CIFAR10_DIR

__all__ = [
    "BANNER",
    "NAME",
    "NOT_DECIDED",
    "REHEARSED",
    "RULES",
    "SOURCE",
    "RehearsalError",
    "derive",
    "findings",
    "is_rehearsal",
    "mark_figure",
    "prepare",
    "record",
    "rehearse",
    "replaced_markdown",
    "session",
    "withhold",
    "write_cifar10_standin",
]

#: The profile a rehearsal rehearses, and the name of the rehearsal (its results directory).
SOURCE = "gpu"
NAME = "gpu-rehearsal"
#: What every table, summary and figure of a rehearsal says.
BANNER = (f"REHEARSAL of the {SOURCE} profile: scaled-down parameters, gloo on CPU for NCCL, a "
          f"generated stand-in for CIFAR-10 -- it decides nothing")
#: The verdicts a rehearsal shows instead of PASS / FAIL / INCONCLUSIVE.
REHEARSED, NOT_DECIDED = "REHEARSED", "NOT DECIDED"
#: Each experiment's time budget in a rehearsal (seconds; the hard limit is five times it).
BUDGET_S = 90.0
#: Experiments without ranks (the analytic cost model): rehearsed with the profile's parameters.
ANALYTIC = ("E1",)
#: The folder (relative to the results directory) a rehearsal's data stand-ins are written to.
DATA = "data"
#: The stand-in CIFAR-10: images per training batch (5 batches) and in the test batch.
CIFAR10_STANDIN = {"per_batch": 200, "test": 400}


class RehearsalError(ValueError):
    """A parameter the rehearsal cannot map: one line naming the experiment, the parameter, its
    value and what to do."""


# --------------------------------------------------------------------------- the rules


@dataclass(frozen=True)
class Rule:
    """How one parameter is rehearsed: ``apply(value)`` gives the rehearsal's value, ``text``
    says what it does (recorded with every replaced value)."""

    text: str
    apply: Callable[[Any], Any]


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def cap(limit: int | float) -> Rule:
    """At most ``limit`` (a smaller value, 0 or None is kept).

    Example::

        >>> cap(4).apply(8), cap(4).apply(2), cap(4).apply(None)
        (4, 2, None)
    """
    shown = f"{limit:,}" if isinstance(limit, int) else f"{limit:g}"
    return Rule(f"at most {shown}", lambda v: min(v, limit) if _number(v) else v)


def cap_each(limit: int) -> Rule:
    """Every entry of a list at most ``limit``, duplicates dropped, in order.

    Example::

        >>> cap_each(4).apply([2, 4, 6, 8])
        [2, 4]
    """
    def apply(v: Any) -> Any:
        if not isinstance(v, list):
            return v
        return list(dict.fromkeys(min(x, limit) if _number(x) else x for x in v))

    return Rule(f"each at most {limit}, duplicates dropped", apply)


def first(k: int) -> Rule:
    """The first ``k`` entries of a list.

    Example::

        >>> first(2).apply([0, 1, 2, 3])
        [0, 1]
    """
    return Rule(f"the first {k}", lambda v: list(v[:k]) if isinstance(v, list) else v)


def _smaller_batch(b: Any) -> Any:
    return max(min(b, 8), b // 8) if _number(b) else b


#: A batch divided by 8, but at least 8 images (or the batch itself when smaller).
BATCH = Rule("divided by 8, at least 8", _smaller_batch)
BATCHES = Rule("each divided by 8, at least 8, duplicates dropped",
               lambda v: list(dict.fromkeys(_smaller_batch(b) for b in v))
               if isinstance(v, list) else v)


def keep(why: str) -> Rule:
    """The profile's value, unchanged (``why``: the reason, in words).

    Example::

        >>> keep("a rate").apply(0.05)
        0.05
    """
    return Rule(f"kept ({why})", lambda v: v)


def _narrower(v: Any) -> Any:
    if _number(v) and not isinstance(v, float):
        return max(4, v // 8) if v > 4 else v
    if isinstance(v, list):
        return [_narrower(x) for x in v]
    if isinstance(v, dict):
        return {k: _narrower(x) for k, x in v.items()}
    return v


#: A model's keywords with every width divided by 8 (at least 4): the same layers, fewer units.
NARROWER = Rule("every width divided by 8, at least 4: the same layers, fewer units", _narrower)


def _pools(v: Any) -> Any:
    if not isinstance(v, list):
        return v
    out = []
    for pool in v:
        pool = [min(pool[0], standin.GPUS), *pool[1:]] if isinstance(pool, list) and pool \
            and _number(pool[0]) else pool
        if pool not in out:
            out.append(pool)
    return out


_RANKS = standin.GPUS
_BYTES_MAX = 1 << 20
_BYTES_MIN = 256 << 10
#: Parameter name (or ``fnmatch`` pattern) -> its rule; a name is looked up before the patterns.
#: A numeric parameter that matches none is a :class:`RehearsalError`.
RULES: dict[str, Rule] = {
    # ranks: at most the stand-in GPUs (gloo ranks on 2 cores)
    "world_size": cap(_RANKS),
    "world_sizes": cap_each(_RANKS),
    "*_world_sizes": cap_each(_RANKS),
    "host_world_size": cap(_RANKS),
    "pools": Rule(f"each pool's world size at most {_RANKS}, duplicates dropped", _pools),
    "ranks_per_node": keep("the nodes' shape"),
    # message sizes (bytes)
    "nbytes": cap(_BYTES_MAX),
    "*sizes_max": cap(_BYTES_MAX),
    "*sizes_min": cap(_BYTES_MIN),
    "gamma_bytes": cap(_BYTES_MAX),
    "host_bytes": cap(_BYTES_MAX),
    "large_bytes": keep("a threshold: sizes from it on get iters_large repeats"),
    "fit_min_bytes": keep("a threshold: the fit uses sizes from it on"),
    "size_factor": keep("the step between sizes"),
    "block_range": keep("the block sizes' span around the optimum"),
    "steps_per_octave": cap(1),
    # repeats, iterations and steps
    "iters": cap(2),
    "*_iters": cap(2),
    "iters_large": cap(2),
    "calib_iters": cap(3),
    "warmup": cap(1),
    "*_warmup": cap(1),
    "warmup_steps": cap(1),
    "runs": cap(2),
    "timing_runs": cap(2),
    "ablation_runs": cap(2),
    "blocks": cap(1),
    "ablation_blocks": cap(1),
    "host_messages": cap(2),
    "iterations": cap(6),
    "*_iterations": cap(6),
    "timing_iterations": cap(4),
    "nocomm_iterations": cap(4),
    "skip": cap(2),
    "eval_every": cap(3),
    # seeds and learning-rate grids
    "seeds": first(2),
    "*_seeds": first(2),
    "selection_seeds": first(1),
    "selection_sets": cap(1),  # one selection seed: one set
    "control_seeds": cap(2),
    "seed": keep("which seed"),
    "lrs": first(3),  # 3: the fewest a claim's rate sweep accepts (claims.yaml min_lrs)
    "*_lrs": first(3),
    "max_extend": cap(1),
    "accum_iters": keep("the configurations compared"),
    # batches
    "batch_size": BATCH,
    "batch_sizes": BATCHES,
    "*_batch": BATCH,
    "seq_len": keep("the model's context"),
    # rates, links, models and times: what is rehearsed, as the profile gives it
    "lr": keep("a rate"),
    "momentum": keep("a rate"),
    "momenta": keep("the momenta compared"),
    "control_lr": keep("a rate"),
    "min_lr_ratio": keep("a rate"),
    "warmup_fraction": keep("a fraction"),
    "target_acc": keep("a threshold"),
    "target_fraction": keep("a fraction"),
    "comm_ratio": keep("a ratio"),
    "bucket_mb": keep("the buckets' size"),
    "switch_interval_s": keep("a setting of the interpreter"),
    "compute_cv": keep("a spread"),
    "compute_cvs": keep("the spreads compared"),
    "compute_scales": keep("the compute factors compared"),
    "alpha_s": keep("a link"),
    "bandwidth_Bps": keep("a link"),
    "*_alpha_s": keep("a link"),
    "*_bandwidth_Bps": keep("a link"),
    "gamma_s_per_byte": keep("a link"),
    "fwd_ms": keep("the emulated compute"),
    "bwd_ms": keep("the emulated compute"),
    "width": keep("the timing model's size"),
    "layers": keep("the timing model's size"),
    "model_kw": NARROWER,
    "max_point_s": keep("a limit"),
    "timeout_s": keep("a limit"),
}


def rule_for(name: str) -> Rule | None:
    """The rule of parameter ``name``: its own entry of :data:`RULES`, else the first pattern
    that matches it, else None.

    Example::

        >>> rule_for("lm_iterations").text, rule_for("digits_seeds").text
        ('at most 6', 'the first 2')
    """
    if name in RULES:
        return RULES[name]
    return next((r for pattern, r in RULES.items()
                 if any(c in pattern for c in "*?[") and fnmatch.fnmatchcase(name, pattern)),
                None)


def _numeric(value: Any) -> bool:
    """Whether ``value`` holds a number anywhere (a number, a list or dict of them)."""
    if _number(value):
        return True
    if isinstance(value, (list, tuple)):
        return any(_numeric(v) for v in value)
    if isinstance(value, dict):
        return any(_numeric(v) for v in value.values())
    return False


#: The data sets a rehearsal has a stand-in for.
STANDINS = ("cifar10",)


def rehearse(eid: str, params: Mapping[str, Any], data_root: str = f"results/{NAME}/{DATA}"
             ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The rehearsal's parameters of experiment ``eid`` from the profile's ``params`` (the run's
    whole parameters: notebook defaults, then the profile's; a ``data_root`` becomes
    ``data_root``, the folder of the stand-ins), and what it replaced: name ->
    ``{"gpu": value, "rehearsal": value, "rule": text}``, for every parameter whose value
    changed and for those that keep their value over a stand-in (``backend="nccl"``: gloo ranks
    on CPU; a data set with a stand-in).

    Raises:
        RehearsalError: a numeric parameter without a rule, a data set without a stand-in, a
            backend other than gloo and nccl.

    Example::

        >>> params, replaced = rehearse("E7", {"dataset": "cifar10", "data_root": "data",
        ...                                    "seeds": [0, 1, 2, 3, 4]})
        >>> params["data_root"], params["seeds"]
        ('results/gpu-rehearsal/data', [0, 1])
        >>> replaced["dataset"]["rule"]
        'kept; its files are a generated stand-in in the official format (checksums, splits, normalisation as for the real one)'
    """
    if eid in ANALYTIC:
        return dict(params), {}
    out: dict[str, Any] = {}
    replaced: dict[str, Any] = {}
    for name, value in params.items():
        rule = _special(eid, name, value, data_root)
        if rule is None:
            rule = rule_for(name)
        if rule is None:
            if _numeric(value):
                raise RehearsalError(
                    f"{eid}: parameter {name}={value!r} has no rehearsal rule: the rehearsal "
                    f"cannot tell a size or count to shrink from a rate to keep; give it one "
                    f"in pipecomm.lab.rehearsal.RULES")
            rule = keep("not a number")
        new = rule.apply(value)
        out[name] = new
        if new != value or rule.text.startswith("stand-in") or name == "dataset" \
                and value in STANDINS:
            replaced[name] = {"gpu": value, "rehearsal": new, "rule": rule.text}
    return out, replaced


def _special(eid: str, name: str, value: Any, data_root: str) -> Rule | None:
    """The rules of the parameters a stand-in serves: backend, dataset, data_root."""
    if name == "backend":
        if value not in ("gloo", "nccl"):
            raise RehearsalError(f"{eid}: parameter backend={value!r}: a rehearsal rehearses "
                                 f"'nccl' (on gloo ranks) and 'gloo'")
        if value == "nccl":
            return Rule("stand-in: 'nccl' kept, so the experiment takes its NCCL code path; its "
                        "ranks run gloo on CPU (pipecomm.lab.standin)", lambda v: v)
        return None
    if name == "dataset":
        if value in STANDINS:
            return Rule("kept; its files are a generated stand-in in the official format "
                        "(checksums, splits, normalisation as for the real one)", lambda v: v)
        if value not in ("digits", "teacher"):
            raise RehearsalError(f"{eid}: parameter dataset={value!r} has no stand-in for a "
                                 f"rehearsal (there are stand-ins for {list(STANDINS)}; "
                                 f"'digits' ships with scikit-learn)")
        return None
    if name == "data_root" and isinstance(value, str):
        return Rule("the folder of the rehearsal's stand-ins (relative to the repository when "
                    "it lies there, as the profile's relative data_root is)", lambda v: data_root)
    return None


def derive(experiments: Mapping[str, Any], data_root: str = f"results/{NAME}/{DATA}"
           ) -> dict[str, Any]:
    """The rehearsal's experiments from the profile's (``pipecomm.lab.profiles.Experiment``s):
    copies whose ``profile_params`` are :func:`rehearse`'s parameters (``data_root``: where the
    data stand-ins are), whose ``replaced`` records what it replaced and whose budget is
    :data:`BUDGET_S` (or the profile's, when smaller).

    Example::

        derive(profiles.load_profile("gpu", profiles.discover()))["E7"].replaced["seeds"]
        # {'gpu': [0, 1, 2, 3, 4], 'rehearsal': [0, 1], 'rule': 'the first 2'}
    """
    out = {}
    for eid, exp in experiments.items():
        full = {**exp.defaults, **exp.profile_params}
        full = {k: v for k, v in full.items() if k not in ("out_dir", "data_csv")}
        params, replaced = rehearse(eid, full, data_root)
        out[eid] = dataclasses.replace(exp, profile_params=params, replaced=replaced,
                                       budget_s=min(exp.budget_s, BUDGET_S))
    return out


def is_rehearsal(profile: str) -> bool:
    """Whether ``profile`` names a rehearsal's results (:data:`NAME`).

    Example::

        >>> is_rehearsal("gpu-rehearsal"), is_rehearsal("gpu")
        (True, False)
    """
    return profile == NAME


def record(exp: Any) -> dict[str, Any]:
    """What a rehearsal's ``env.json`` says of it under ``rehearsal``: of which profile, that it
    decides nothing, every parameter it replaced.

    Example::

        record(derive(experiments)["E7"])["replaced"]["seeds"]
        # {'gpu': [0, 1, 2, 3, 4], 'rehearsal': [0, 1], 'rule': 'the first 2'}
    """
    return {"of_profile": SOURCE, "decides_nothing": True, "note": BANNER,
            "stand_in_gpus": standin.GPUS, "replaced": getattr(exp, "replaced", {})}


def replaced_markdown(experiments: Mapping[str, Any]) -> str:
    """The claims.md section that lists, per experiment, every parameter the rehearsal
    replaced: the gpu profile's value, the rehearsal's, the rule.

    Example::

        print(replaced_markdown(derive(experiments)))
    """
    found = findings(experiments)
    head = ["## What the rehearsal found in the profile itself", "",
            *(f"* {f}" for f in found), ""] if found else []
    lines = [*head, "## What the rehearsal replaced", "",
             "Every parameter whose value the rehearsal changed, or that it kept over a "
             "stand-in; all others ran as the gpu profile gives them.", "",
             "| experiment | parameter | gpu | rehearsal | rule |", "|---|---|---|---|---|"]
    for eid, exp in experiments.items():
        for name, r in getattr(exp, "replaced", {}).items():
            cells = [eid, name, json.dumps(r["gpu"]), json.dumps(r["rehearsal"]), r["rule"]]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines) + "\n"


#: The parameter that counts the repeats of an experiment's timed claims (a run's median is one
#: repeat where there are runs). The rehearsal shrinks repeats, so its own data cannot show that
#: the profile gives too few; :func:`findings` checks the profile's values instead.
REPEATS: dict[str, str] = {"E0": "iters", "E2": "real_iters", "E3": "iters", "E4": "iters",
                           "E5": "runs", "E6": "runs", "E7": "timing_runs", "E8": "runs",
                           "E9": "timing_runs", "E10": "runs", "E11": "runs", "E12": "runs"}


def findings(experiments: Mapping[str, Any]) -> list[str]:
    """What the rehearsal finds in the profile itself, before anything runs: every experiment
    whose timed claims get fewer repeats from the profile (:data:`REPEATS`) than the
    :data:`pipecomm.lab.claims.MIN_REPEATS` that decide one (its claims would be INCONCLUSIVE on
    GPUs by construction). ``experiments``: :func:`derive`'s.

    Example::

        findings(derive(profiles.load_profile("gpu", profiles.discover())))
        # [] (or 'gpu profile, E3: iters=2 gives its timed claims 2 repeats, fewer than ...')
    """
    from pipecomm.lab import claims

    out = []
    for eid, exp in experiments.items():
        name = REPEATS.get(eid)
        params = getattr(exp, "profile_params", {})
        if name is None or name not in params:
            continue
        value = getattr(exp, "replaced", {}).get(name, {}).get("gpu", params[name])
        if _number(value) and value < claims.MIN_REPEATS:
            out.append(f"{SOURCE} profile, {eid}: {name}={value} gives its timed claims {value} "
                       f"repeats, fewer than the {claims.MIN_REPEATS} that decide one (they "
                       f"would be INCONCLUSIVE on GPUs)")
    return out


# --------------------------------------------------------------------------- verdicts


_VERDICT_WORD = re.compile(r"\b(PASS|FAIL|INCONCLUSIVE|UNSTABLE)\b")


def withhold(table: Any, ran: set[str] | None = None) -> Any:
    """A claims table (or a notebook's verdict table) as a rehearsal shows it: REHEARSED where
    the check ran on the rehearsal's data (PASS, FAIL, INCONCLUSIVE, UNSTABLE; an illustration
    whose experiment ran, ``ran``), NOT DECIDED elsewhere (no result; a check that could not
    run, whose reason is kept: that is what a rehearsal finds); ``measured`` marked as the
    rehearsal's, ``why`` saying what the verdict would need.

    Example::

        >>> import pandas as pd
        >>> t = withhold(pd.DataFrame({"claim": ["C1", "C2"], "experiment": ["E7", "E9"],
        ...     "verdict": ["PASS", "ERROR"], "measured": ["1.2", ""],
        ...     "why": ["measured meets the threshold", "the check cannot run: KeyError"]}))
        >>> list(t.verdict)
        ['REHEARSED', 'NOT DECIDED']
    """
    from pipecomm.lab import claims

    t = table.copy()
    checked = (claims.PASS, claims.FAIL, claims.INCONCLUSIVE, claims.UNSTABLE)
    verdicts, whys, measured = [], [], []
    experiments = t["experiment"] if "experiment" in t.columns else [None] * len(t)
    for v, why, m, eid in zip(t["verdict"], t.get("why", [""] * len(t)),
                              t.get("measured", [""] * len(t)), experiments):
        v, why = str(v), str(why)
        m = _VERDICT_WORD.sub("(withheld)", str(m))  # a check's text may give per-part verdicts
        if v in checked or (v == claims.MODEL and (ran is None or eid in ran)):
            verdicts.append(REHEARSED)
            whys.append("the check ran on the rehearsal's data; its verdict is withheld: only "
                        "the gpu profile's run on GPUs decides it" if v != claims.MODEL else
                        "an illustration: its experiment ran in the rehearsal")
            measured.append(f"(rehearsal) {m}" if m else m)
        else:
            verdicts.append(NOT_DECIDED)
            whys.append(why or "no result in the rehearsal")
            measured.append(m)
    t["verdict"] = verdicts
    if "why" in t.columns:
        t["why"] = whys
    if "measured" in t.columns:
        t["measured"] = measured
    return t


def mark_figure(fig: Any) -> Any:
    """``fig`` with a REHEARSAL mark across it (every figure a rehearsal saves).

    Example::

        >>> import matplotlib
        >>> matplotlib.use("Agg")
        >>> import matplotlib.pyplot as plt
        >>> fig = mark_figure(plt.figure())
        >>> fig.texts[-1].get_text()
        'REHEARSAL: decides nothing'
    """
    if fig is not None:
        fig.text(0.5, 0.5, "REHEARSAL: decides nothing", ha="center", va="center",
                 rotation=25, fontsize=28, color="#b00020", alpha=0.25, zorder=1000)
    return fig


# --------------------------------------------------------------------------- the stand-ins


def _standin_cifar10(per_batch: int, test: int, seed: int = 0) -> dict[str, dict]:
    """The batches of a stand-in CIFAR-10: name -> the dict its pickle holds (as the official
    files: ``batch_label``, ``labels``, ``data`` uint8 [N, 3072], ``filenames``; ``batches.meta``).
    Every class has its own colour and stripes under noise, so a model can learn it."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:32, 0:32]
    patterns = []
    for c in range(10):
        colour = rng.uniform(40, 215, size=3)
        stripes = np.sin((xx * np.cos(c * 0.314) + yy * np.sin(c * 0.314)) * (0.3 + 0.05 * c))
        patterns.append(colour[:, None, None] + 35 * stripes[None])

    def batch(n: int, label: str, first: int) -> dict:
        labels = rng.integers(0, 10, size=n)
        x = np.stack([patterns[k] for k in labels]) + rng.normal(0, 30, size=(n, 3, 32, 32))
        data = np.clip(x, 0, 255).astype(np.uint8).reshape(n, 3072)
        return {b"batch_label": label.encode(), b"labels": [int(k) for k in labels],
                b"data": data,
                b"filenames": [f"standin_{first + i:05d}.png".encode() for i in range(n)]}

    out = {f"data_batch_{i}": batch(per_batch, f"training batch {i} of 5 (stand-in)",
                                    (i - 1) * per_batch) for i in range(1, 6)}
    out["test_batch"] = batch(test, "testing batch 1 of 1 (stand-in)", 5 * per_batch)
    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
             "truck"]
    out["batches.meta"] = {b"num_cases_per_batch": per_batch, b"num_vis": 3072,
                           b"label_names": [n.encode() for n in names]}
    return out


def write_cifar10_standin(root: Path, per_batch: int = CIFAR10_STANDIN["per_batch"],
                          test: int = CIFAR10_STANDIN["test"]) -> dict[str, Any]:
    """Write a generated stand-in for CIFAR-10 as ``root/cifar-10-python.tar.gz``: the official
    archive's layout (``cifar-10-batches-py/`` with ``data_batch_1`` .. ``data_batch_5``,
    ``test_batch``, ``batches.meta``, each a protocol-2 pickle), ``per_batch`` training images
    per batch and ``test`` test images, byte for byte the same on every call (fixed seed, fixed
    times in the archive). :func:`pipecomm.lab.workloads.data.fetch` then verifies and extracts it as it
    does the real archive, with the checksums returned here: ``{"root": ..., "archive": [name,
    ["md5", digest]], "files": {batch: ["md5", digest]}}``.

    Example::

        >>> import tempfile
        >>> from pathlib import Path
        >>> entry = write_cifar10_standin(Path(tempfile.mkdtemp()), per_batch=4, test=4)
        >>> entry["archive"][0], sorted(entry["files"])[:2]
        ('cifar-10-python.tar.gz', ['data_batch_1', 'data_batch_2'])
    """
    root.mkdir(parents=True, exist_ok=True)
    members = {name: pickle.dumps(obj, protocol=2)
               for name, obj in _standin_cifar10(per_batch, test).items()}
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        folder = tarfile.TarInfo(CIFAR10_DIR)
        folder.type, folder.mode, folder.mtime = tarfile.DIRTYPE, 0o755, 0
        tar.addfile(folder)
        for name, raw in members.items():
            info = tarfile.TarInfo(f"{CIFAR10_DIR}/{name}")
            info.size, info.mode, info.mtime = len(raw), 0o644, 0
            tar.addfile(info, io.BytesIO(raw))
    archive = io.BytesIO()
    with gzip.GzipFile(fileobj=archive, mode="wb", mtime=0) as gz:
        gz.write(tar_bytes.getvalue())
    name = "cifar-10-python.tar.gz"
    raw = archive.getvalue()
    path = root / name
    if not path.is_file() or path.read_bytes() != raw:
        results.write_bytes(path, raw)
    files = {f: ["md5", hashlib.md5(raw_f).hexdigest()] for f, raw_f in members.items()
             if f != "batches.meta"}
    return {"root": str(root.resolve()), "archive": [name, ["md5", hashlib.md5(raw).hexdigest()]],
            "files": files, "train": 5 * per_batch, "test": test}


def prepare(base: Path) -> Path:
    """Write the rehearsal's stand-ins under ``base`` (``results/gpu-rehearsal``): the CIFAR-10
    stand-in in ``base/data`` and ``base/rehearsal.json``, the record :mod:`pipecomm.lab.standin`
    reads (the file :data:`pipecomm.lab.standin.ENV` names); returns that file.

    Example::

        prepare(RESULTS / "gpu-rehearsal")   # results/gpu-rehearsal/rehearsal.json
    """
    entry = write_cifar10_standin(base / DATA)
    path = base / "rehearsal.json"
    results.write_json(path, {"of_profile": SOURCE, "note": BANNER, "gpus": standin.GPUS,
                              "datasets": {"cifar10": entry}})
    return path


@contextlib.contextmanager
def session(base: Path) -> Iterator[Path]:
    """The stand-ins switched on for this process and what it starts (notebook kernels, their
    ranks): :data:`pipecomm.lab.standin.ENV` names ``base/rehearsal.json`` inside the block
    (:func:`prepare` writes it), and the probe of the host before an emulated network is
    skipped (``PIPECOMM_SKIP_HOST_CHECK=1``: it guards timings, which a rehearsal does not
    use, and a loaded 2-core host fails it at p = 8); both as they were afterwards.

    Example::

        with session(RESULTS / "gpu-rehearsal") as manifest:
            prepare(RESULTS / "gpu-rehearsal"); run_the_notebooks()
    """
    from pipecomm.lab.networks import netem

    path = base / "rehearsal.json"
    wanted = {standin.ENV: str(path), netem.SKIP_CHECK_ENV: "1"}
    old = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield path
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
