"""Profiles and overrides: the experiments a profile runs, with what parameters.

An experiment ``E<k>`` is the notebook ``notebooks/<kk>_<name>.ipynb``; its parameters are the
notebook's parameters cell, updated by the profile (``artifact/profiles/<profile>.yaml``) and then
by ``-p NAME=VALUE`` overrides (each parsed to the type of the parameter's default; an unknown
name is an error, since papermill would silently accept it), every one checked against the
experiment's ``Params`` before any kernel starts.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from pipecomm.lab import rehearsal, results, schema
from pipecomm.lab.cli import parse_value

ROOT = results.REPO_ROOT


NOTEBOOKS = ROOT / "notebooks"


PROFILES = ROOT / "artifact" / "profiles"


PROFILE_NAMES = schema.PROFILE_NAMES


RESULTS = ROOT / "results"


REFERENCE = ROOT / "artifact" / "reference"


RESERVED = ("out_dir", "data_csv")  # notebook parameters the orchestrator sets itself


class UsageError(ValueError):
    """A bad command line: unknown option, experiment id or parameter."""


@dataclass
class Experiment:
    id: str
    notebook: Path
    defaults: dict[str, Any]
    budget_s: float = 60.0
    profile_params: dict[str, Any] = field(default_factory=dict)
    #: a rehearsal's replaced parameters: name -> {"gpu", "rehearsal", "rule"} (rehearsal.derive)
    replaced: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return self.notebook.stem


def notebook_parameters(path: Path) -> dict[str, Any]:
    """The literal assignments of a notebook's cell tagged ``parameters``."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            params = {}
            for node in ast.parse(cell.source).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(
                    node.targets[0], ast.Name
                ):
                    params[node.targets[0].id] = ast.literal_eval(node.value)
            return params
    raise ValueError(f"{path} has no cell tagged 'parameters'")


def discover() -> dict[str, Experiment]:
    """Experiments E<k> from notebooks/<kk>_<name>.ipynb, in order."""
    found = {}
    for nb in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")):
        eid = f"E{int(nb.name[:2])}"
        found[eid] = Experiment(eid, nb, notebook_parameters(nb))
    return found


def auto_profile() -> str:
    """``gpu`` when at least two GPUs are visible, else ``cpu``."""
    try:
        import torch

        return "gpu" if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else "cpu"
    except Exception:
        return "cpu"


def load_profile(name: str, experiments: dict[str, Experiment]) -> dict[str, Experiment]:
    """The experiments a profile runs (those it names), with its parameters and budgets;
    profile names are checked like ``-p``.

    A profile with ``extends: <other>`` starts from the other profile's experiments and replaces
    the budgets and parameters it names (``cpu-full`` extends ``cpu``). An experiment no profile
    entry names does not run in that profile (E14 needs the virtual cluster: it is in
    ``shaped`` only). ``gpu-rehearsal`` is the gpu profile's experiments with the rehearsal's
    parameters (:func:`pipecomm.lab.rehearsal.derive`)."""
    if rehearsal.is_rehearsal(name):
        return rehearsal.derive(load_profile(rehearsal.SOURCE, experiments),
                                data_root=shown_path(RESULTS / name / rehearsal.DATA))
    path = PROFILES / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in PROFILES.glob("*.yaml"))
        raise UsageError(f"unknown profile {name!r}; choose from {choices}")
    spec = read_profile(name)
    entries = {eid: entry or {} for eid, entry in spec["experiments"].items()}
    if spec.get("extends"):  # a profile that changes some experiments of another one
        parent = read_profile(spec["extends"])
        for eid, entry in parent["experiments"].items():
            entry, own = entry or {}, entries.get(eid) or {}
            entries[eid] = {**entry, **own,
                            "params": {**(entry.get("params") or {}), **(own.get("params") or {})}}
    for eid, entry in entries.items():
        if eid not in experiments:
            continue  # a profile may describe experiments whose notebooks are not here yet
        exp = experiments[eid]
        exp.budget_s = float(entry.get("budget_s", exp.budget_s))
        params = entry.get("params") or {}
        unknown = sorted(set(params) - set(exp.defaults))
        if unknown:
            raise schema.ConfigError(f"{shown_path(path)}: experiments.{eid}.params: unknown "
                                     f"parameter(s) {unknown} (allowed: the parameters of "
                                     f"{exp.notebook.name}; ./run_all.sh --list shows them)")
        exp.profile_params = params
    return {eid: exp for eid, exp in experiments.items() if eid in entries}


def profiles_of(eid: str) -> list[str]:
    """The profiles that run experiment ``eid``.

    Example::

        profiles_of("E14")   # ['shaped']
    """
    return [name for name in PROFILE_NAMES if eid in profile_runs(name)]


def profile_runs(name: str) -> list[str] | None:
    """The experiments profile ``name`` runs (None for a name without a profile file).

    Example::

        profile_runs("shaped")   # ['E14']
    """
    if not (PROFILES / f"{name}.yaml").exists() and not rehearsal.is_rehearsal(name):
        return None
    return list(load_profile(name, discover()))


def own_experiments(name: str) -> list[str] | None:
    """The experiments a profile that ``extends`` another sets itself (``cpu-full``: E7, E9,
    E13); None for a self-contained profile (all of them) and for a rehearsal."""
    if rehearsal.is_rehearsal(name):
        return None
    spec = read_profile(name)
    return list(spec["experiments"]) if spec.get("extends") else None


def read_profile(name: str) -> dict[str, Any]:
    """``artifact/profiles/<name>.yaml``, checked against :data:`pipecomm.lab.schema.PROFILE`
    (its ``profile:`` must name the file).

    Raises:
        pipecomm.lab.schema.ConfigError: one line naming the file, the key and what is allowed.
    """
    path = PROFILES / f"{name}.yaml"
    spec = schema.load(path, schema.PROFILE)
    if spec["profile"] != name:
        raise schema.ConfigError(f"{shown_path(path)}: profile: {spec['profile']!r} is not "
                                 f"allowed ({name!r}, the file's name)")
    return spec


def parse_overrides(items: list[str], selected: list[Experiment]) -> dict[str, dict[str, Any]]:
    """``NAME=VALUE`` strings -> per-experiment typed overrides; unknown names and a name given
    twice are errors (:class:`UsageError`)."""
    per_exp: dict[str, dict[str, Any]] = {e.id: {} for e in selected}
    seen: dict[str, str] = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"-p expects NAME=VALUE, got {item!r}")
        name, text = item.split("=", 1)
        if name in seen:
            raise UsageError(f"-p {name} is given twice ({name}={seen[name]} and {item}): "
                             f"give each parameter once")
        seen[name] = text
        owners = [e for e in selected if name in e.defaults and name not in RESERVED]
        if not owners:
            known = sorted({k for e in selected for k in e.defaults if k not in RESERVED})
            raise UsageError(
                f"unknown parameter {name!r} for {[e.id for e in selected]}; known: {known}"
            )
        for e in owners:
            try:
                per_exp[e.id][name] = parse_value(text, e.defaults[name], name)
            except ValueError as exc:
                raise UsageError(str(exc)) from exc
    return per_exp


def experiment_module(exp: Experiment) -> ModuleType | None:
    """The module ``pipecomm.lab.experiments.e<notebook stem>`` behind an experiment's notebook
    (None for a notebook without one, such as a test's).

    Example::

        experiment_module(discover()["E4"]).Params   # e04_lp_block_size.Params
    """
    try:
        return importlib.import_module(f"pipecomm.lab.experiments.e{exp.notebook.stem}")
    except ModuleNotFoundError:
        return None


def run_params(exp: Experiment, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The parameters a run of ``exp`` gets: notebook defaults, then the profile's, then
    ``overrides``; without the ones the orchestrator sets itself (:data:`RESERVED`)."""
    params = {**exp.defaults, **exp.profile_params, **(overrides or {})}
    return {k: v for k, v in params.items() if k not in RESERVED}


def check_params(selected: list[Experiment], overrides: dict[str, dict[str, Any]]) -> None:
    """Validate every selected experiment's parameters (profile and ``-p``) with its module's
    ``Params.make`` before any kernel starts; a refused value is a one-line :class:`UsageError`
    naming the experiment, the parameter, the value and what is allowed.

    Example::

        check_params([discover()["E4"]], {"E4": {"world_size": 0}})
        # UsageError: E4: parameter world_size must be an int >= 3 (...), got 0
    """
    for exp in selected:
        module = experiment_module(exp)
        if module is None:
            continue
        own = overrides.get(exp.id, {})
        try:
            module.Params.make(**run_params(exp, own))
        except ValueError as exc:
            text = " ".join(str(exc).split())
            given = [f"-p {k}={v}" for k, v in own.items() if re.search(rf"\b{k}\b", text)]
            source = f" (from {', '.join(given)})" if given else ""
            raise UsageError(f"{exp.id}: {text}{source}") from exc


def gpu_count() -> int:
    """GPUs torch sees here (0 without CUDA or without torch)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def check_profile_host(profile: str) -> None:
    """Refuse, before anything starts, a profile this machine cannot run: ``gpu`` needs at least
    two visible GPUs (NCCL places one rank per GPU)."""
    if profile == "gpu":
        have = gpu_count()
        if have < 2:
            raise UsageError(f"profile 'gpu' needs at least 2 visible GPUs (NCCL, one rank per "
                             f"GPU); this machine has {have}: use --profile cpu")


def override_dirname(eid: str, overrides: dict[str, Any]) -> str:
    """``E0__sizes_max=1048576`` — the directory of a run with overrides."""
    if not overrides:
        return eid
    parts = [f"{k}={v}" for k, v in sorted(overrides.items())]
    name = eid + "__" + ",".join(parts)
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "", name)[:200]


def shown_path(path: Path, start: Path = ROOT) -> str:
    """``path`` relative to ``start`` when it lies in the repository (``..`` allowed), else as
    it is."""
    try:
        path.resolve().relative_to(ROOT)
    except ValueError:
        return str(path)
    return os.path.relpath(path.resolve(), start.resolve())


def override_text(overrides: dict[str, Any]) -> str:
    """``-p`` overrides as the command line gives them, names sorted.

    Example::

        override_text({"world_size": 4, "iters": 5})   # 'iters=5, world_size=4'
    """
    return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items()))


def override_of(exp: Experiment, params: Any) -> dict[str, Any] | None:
    """The ``-p`` overrides that turn the profile's parameters (:func:`run_params`) into
    ``params`` (a result's params.json): every parameter whose value differs, and any the
    experiment no longer has; None when ``params`` is not a JSON object.

    Example::

        override_of(exp_e4, {**run_params(exp_e4), "world_size": 4})   # {'world_size': 4}
    """
    if not isinstance(params, dict):
        return None
    base = results.json_roundtrip(run_params(exp))
    return {k: v for k, v in params.items() if k not in base or base[k] != v}

