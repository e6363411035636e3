"""Orchestration behind ``run_all.sh``: profiles, papermill runs, result reuse, the claims table.

Each experiment ``E<k>`` is the notebook ``notebooks/<kk>_<name>.ipynb``. Its parameters are the
notebook's parameters cell (the quick configuration), updated by the profile
(``artifact/profiles/<profile>.yaml``) and then by ``-p NAME=VALUE`` overrides (each parsed to the
type of the parameter's default; unknown names are an error, since papermill would silently accept
them). Results go to ``results/<profile>/<E>/``, or, with overrides, to
``results/<profile>/<E>__<name>=<value>.../`` so the default result is never overwritten. A result
is reused when its git commit and parameters match (``--force`` re-runs). Each run is assembled in
a temporary directory and renamed into place: an interrupted run leaves nothing half-written, and
running again resumes with the experiments still missing.

Usage::

    python -m pipecomm.artifact                   # every experiment, automatic profile
    python -m pipecomm.artifact --only E0 E3 -p sizes_max=1048576
    python -m pipecomm.artifact --list
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pipecomm import claims, results
from pipecomm.experiments._cli import parse_value

ROOT = results.REPO_ROOT
NOTEBOOKS = ROOT / "notebooks"
PROFILES = ROOT / "artifact" / "profiles"
PROFILE_NAMES = ["cpu", "cpu-full", "gpu", "shaped"]
RESULTS = ROOT / "results"
REFERENCE = ROOT / "artifact" / "reference"
KERNEL = "pipecomm"
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

    @property
    def title(self) -> str:
        return self.notebook.stem


# --------------------------------------------------------------------------- discovery


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
    ``shaped`` only)."""
    path = PROFILES / f"{name}.yaml"
    if not path.exists():
        choices = sorted(p.stem for p in PROFILES.glob("*.yaml"))
        raise UsageError(f"unknown profile {name!r}; choose from {choices}")
    spec = yaml.safe_load(path.read_text()) or {}
    entries = dict(spec.get("experiments") or {})
    if spec.get("extends"):  # a profile that changes some experiments of another one
        parent = yaml.safe_load((PROFILES / f"{spec['extends']}.yaml").read_text()) or {}
        for eid, entry in (parent.get("experiments") or {}).items():
            own = entries.get(eid) or {}
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
            raise ValueError(f"{path}: {eid} sets unknown parameter(s) {unknown}")
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
    if not (PROFILES / f"{name}.yaml").exists():
        return None
    return list(load_profile(name, discover()))


def own_experiments(name: str) -> list[str] | None:
    """The experiments a profile that ``extends`` another sets itself (``cpu-full``: E7, E9,
    E13); None for a self-contained profile (all of them)."""
    spec = yaml.safe_load((PROFILES / f"{name}.yaml").read_text()) or {}
    return list(spec.get("experiments") or {}) if spec.get("extends") else None


def parse_overrides(items: list[str], selected: list[Experiment]) -> dict[str, dict[str, Any]]:
    """``NAME=VALUE`` strings -> per-experiment typed overrides; unknown names are errors."""
    per_exp: dict[str, dict[str, Any]] = {e.id: {} for e in selected}
    for item in items:
        if "=" not in item:
            raise UsageError(f"-p expects NAME=VALUE, got {item!r}")
        name, text = item.split("=", 1)
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


def override_dirname(eid: str, overrides: dict[str, Any]) -> str:
    """``E0__sizes_max=1048576`` — the directory of a run with overrides."""
    if not overrides:
        return eid
    parts = [f"{k}={v}" for k, v in sorted(overrides.items())]
    name = eid + "__" + ",".join(parts)
    return re.sub(r"[^A-Za-z0-9_.,=+-]", "", name)[:200]


# --------------------------------------------------------------------------- running


def ensure_kernel() -> None:
    """Register the ``pipecomm`` Jupyter kernel inside this interpreter's prefix if missing."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL)
        if Path(spec.argv[0]).resolve() == Path(sys.executable).resolve():
            return
    except NoSuchKernel:
        pass
    from ipykernel.kernelspec import install

    install(kernel_name=KERNEL, display_name="Python (pipecomm)", prefix=sys.prefix)


def _ipc_kernel_manager():
    """A kernel manager whose kernel talks over local IPC sockets instead of TCP ports."""
    import tempfile

    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.transport = "ipc"  # sockets are files in a private temporary directory
            self.ip = str(Path(tempfile.mkdtemp(prefix="pipecomm-kernel-")) / "kernel")

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)
            if not restart:
                shutil.rmtree(Path(self.ip).parent, ignore_errors=True)

        cleanup_resources = _async_cleanup_resources

    return IPCKernelManager


def execute_notebook(path: Path, output: Path, parameters: dict[str, Any] | None = None,
                     timeout_s: float = 600.0) -> None:
    """papermill on the ``pipecomm`` kernel (IPC transport), from the notebooks' directory.

    Example::

        execute_notebook(Path("notebooks/01_lp_cost_model.ipynb"), Path("/tmp/out.ipynb"))
    """
    import papermill as pm

    pm.execute_notebook(
        str(path), str(output), parameters=parameters or {}, kernel_name=KERNEL,
        cwd=str(path.parent), execution_timeout=int(timeout_s), progress_bar=False,
        report_mode=False, kernel_manager_class=_ipc_kernel_manager(),
    )


def is_reusable(out: Path, params: dict[str, Any], commit: str) -> bool:
    """A finished result with the same parameters and git commit (a dirty tree's commit string
    carries a hash of its diff, so reuse there also means the same code)."""
    try:
        env = results.read_json(out / "env.json")
        old = results.read_json(out / "params.json")
    except (OSError, ValueError):
        return False
    done = (out / "data.csv").exists() and (out / "notebook.ipynb").exists()
    same = results.json_roundtrip(params) == old
    return done and same and env.get("git_commit") == commit


def run_experiment(exp: Experiment, profile: str, params: dict[str, Any], out: Path,
                   timeout_factor: float = 3.0) -> float:
    """Execute the notebook into a temporary directory, then rename it to ``out``."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    limit = max(120.0, exp.budget_s * timeout_factor)
    # finished training runs survive an interruption here (results.Runs): re-running resumes
    runs_dir = out.parent / ".runs" / f"{out.name}-{results.git_commit()[:12]}"
    os.environ[results.RUNS_ENV] = str(runs_dir)
    start = time.perf_counter()
    try:
        results.write_json(tmp / "env.json", {"profile": profile})
        with _run_progress(runs_dir, exp.id):
            execute_notebook(exp.notebook, tmp / "notebook.ipynb",
                             {**params, "out_dir": str(tmp)}, timeout_s=limit)
        wall = time.perf_counter() - start
        if not (tmp / "data.csv").exists():
            raise RuntimeError(f"{exp.id}: the notebook finished without writing data.csv")
        env = results.read_json(tmp / "env.json")
        env |= {"profile": profile, "wall_time_s": wall, "budget_s": exp.budget_s,
                "within_budget": wall <= exp.budget_s, "notebook": exp.notebook.name}
        results.write_json(tmp / "env.json", env)
        results.replace_dir(tmp, out)
        shutil.rmtree(runs_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            runs_dir.parent.rmdir()  # only when no other experiment keeps runs there
        return wall
    finally:
        os.environ.pop(results.RUNS_ENV, None)
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def _run_progress(runs_dir: Path, eid: str, every_s: float = 2.0):
    """A progress bar of an experiment's training runs (done, total, time remaining), read from
    the ``progress.json`` that :class:`pipecomm.results.Runs` writes inside the notebook."""
    import threading

    from tqdm.auto import tqdm

    stop = threading.Event()

    def poll() -> None:
        bar = None
        while not stop.wait(every_s):
            try:
                prog = results.read_json(runs_dir / "progress.json")
            except (OSError, ValueError):
                continue
            if bar is None:
                bar = tqdm(total=prog["total"], desc=f"{eid} runs", unit="run", file=sys.stdout,
                           leave=False)
            bar.n = prog["done"]
            bar.set_postfix_str(f"~{prog['remaining_s'] / 60:.1f} min left")
        if bar is not None:
            bar.close()

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=5)


def reference_values(profile: str) -> dict[str, str] | None:
    path = REFERENCE / profile / "claims.csv"
    if not path.exists():
        return None
    import pandas as pd

    ref = pd.read_csv(path, dtype=str).fillna("")
    return dict(zip(ref["claim"], ref["measured"] + " (" + ref["verdict"] + ")"))


def claims_table(profile: str, dirs: dict[str, Path] | None = None, write: bool = True):
    """Evaluate every claim of the profile's experiments on ``results/<profile>``; write
    claims.md and claims.csv (the claims of experiments another profile runs, such as E14's in
    the cpu profile, and claims limited to other ``profiles`` in claims.yaml, are not listed)."""
    runs = profile_runs(profile)
    entries = [e for e in claims.load_claims() if (runs is None or e["experiment"] in runs)
               and (e["profiles"] is None or profile in e["profiles"])]
    table = claims.evaluate(entries, RESULTS / profile, dirs=dirs,
                            reference=reference_values(profile))
    if write:
        results.write_text(RESULTS / profile / "claims.md",
                           f"# Claims, profile {profile}\n\n" + claims.to_markdown(table))
        results.write_csv(RESULTS / profile / "claims.csv", table)
    return table


def save_reference(profile: str, source: Path | None = None, dest: Path | None = None) -> Path:
    """Copy a complete run of ``profile`` into ``artifact/reference/<profile>/``, compactly (a
    profile that extends another keeps only the experiments it changes, :func:`own_experiments`):
    data.csv gzipped, figure.png, the executed notebook without its image outputs (the PNG is
    beside it), params.json, env.json, and the claims table (claims.md, claims.csv).

    Example::

        python -m pipecomm.artifact --profile cpu --save-reference
    """
    import gzip

    import nbformat

    source = source or RESULTS / profile
    dest = dest or REFERENCE / profile
    runs = profile_runs(profile)
    wanted = own_experiments(profile) if runs is not None else None
    if wanted is None:  # a self-contained profile keeps every experiment it runs
        wanted = runs if runs is not None else list(discover())
    missing = [e for e in wanted if not (source / e / "data.csv").exists()]
    if missing:
        raise UsageError(f"{source} lacks results for {missing}: run them first")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for eid in wanted:
        src, out = source / eid, tmp / eid
        out.mkdir(parents=True)
        with gzip.open(out / "data.csv.gz", "wb", compresslevel=9) as f:
            f.write((src / "data.csv").read_bytes())
        for name in ("figure.png", "params.json", "env.json", "calibration.json"):
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        nb = nbformat.read(src / "notebook.ipynb", as_version=4)
        for cell in nb.cells:
            for output in cell.get("outputs", []):
                data = output.get("data", {})
                if "image/png" in data or "application/pdf" in data:
                    output["data"] = {"text/plain": "[figure: see figure.png beside this notebook]"}
        nbformat.write(nb, out / "notebook.ipynb")
    for name in ("claims.md", "claims.csv"):
        shutil.copy2(source / name, tmp / name)
    results.replace_dir(tmp, dest)
    return dest


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_all.sh",
        description="Reproduce the pipecomm experiments (notebooks executed with papermill) "
        "and check every claim.",
    )
    p.add_argument("--profile", choices=PROFILE_NAMES, default=None,
                   help="parameter set (default: gpu if >= 2 GPUs are visible, else cpu)")
    p.add_argument("--only", nargs="+", metavar="E", default=None,
                   help="run only these experiments (e.g. E0 E3)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="override a parameter (repeatable); written to its own directory")
    p.add_argument("--force", action="store_true", help="re-run even if a result matches")
    p.add_argument("--list", action="store_true", help="list experiments, budgets, parameters")
    p.add_argument("--save-reference", action="store_true",
                   help="copy results/<profile> to artifact/reference/<profile> (maintainers)")
    p.add_argument("--timeout-factor", type=float, default=3.0,
                   help="hard limit per experiment = factor x budget (min 120 s)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    profile = args.profile or auto_profile()
    try:
        experiments = load_profile(profile, discover())
        if args.only:
            bad = [e for e in args.only if e.upper() not in experiments]
            elsewhere = {e: profiles_of(e.upper()) for e in bad}
            unknown = [e for e in bad if not elsewhere[e]]
            if unknown:
                raise UsageError(f"unknown experiment id(s) {unknown}; available: "
                                 f"{list(experiments)}")
            if bad:
                raise UsageError(f"experiment(s) {bad} are not in profile {profile!r}; the "
                                 f"profiles that run them: {elsewhere}")
            selected = [experiments[e.upper()] for e in args.only]
        else:
            selected = list(experiments.values())
        overrides = parse_overrides(args.param, selected)
    except UsageError as exc:
        parser.error(str(exc))
    if args.save_reference:
        try:
            print(f"wrote {save_reference(profile).relative_to(ROOT)}")
        except UsageError as exc:
            parser.error(str(exc))
        return 0
    if args.list:
        for e in experiments.values():
            params = {**e.defaults, **e.profile_params}
            shown = {k: v for k, v in params.items() if k not in RESERVED}
            print(f"{e.id:4} {e.title:28} budget {e.budget_s:5.0f} s  {shown}")
        return 0
    return run(profile, selected, overrides, force=args.force,
               timeout_factor=args.timeout_factor)


def run(profile: str, selected: list[Experiment], overrides: dict[str, dict[str, Any]],
        force: bool = False, timeout_factor: float = 3.0) -> int:
    from tqdm.auto import tqdm

    ensure_kernel()
    commit = results.git_commit()
    base = RESULTS / profile
    calibration = base / "E0" / "calibration.json"
    failures, dirs, total = [], {}, sum(e.budget_s for e in selected)
    print(f"profile {profile}: {len(selected)} experiment(s), budget {total / 60:.1f} min "
          f"(commit {commit[:12]})", flush=True)
    bar = tqdm(selected, desc="experiments", unit="exp", file=sys.stdout)
    for exp in bar:
        bar.set_postfix_str(exp.id)
        params = {**exp.defaults, **exp.profile_params, **overrides.get(exp.id, {})}
        for key in RESERVED:
            params.pop(key, None)
        out = base / override_dirname(exp.id, overrides.get(exp.id, {}))
        dirs[exp.id] = out
        if calibration.exists():
            os.environ["PIPECOMM_CALIBRATION"] = str(calibration)
        if not force and is_reusable(out, params, commit):
            tqdm.write(f"{exp.id}: reusing {out.relative_to(ROOT)} (same commit and parameters)")
            continue
        try:
            wall = run_experiment(exp, profile, params, out, timeout_factor)
            note = "" if wall <= exp.budget_s else f"  OVER BUDGET ({exp.budget_s:.0f} s)"
            tqdm.write(f"{exp.id}: done in {wall:.1f} s -> {out.relative_to(ROOT)}{note}")
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            failures.append(exp.id)
            msg = str(exc).strip().splitlines()
            tqdm.write(f"{exp.id}: FAILED: {' | '.join(msg[-6:])}")
    bar.close()
    default_dirs = {k: v for k, v in dirs.items() if v.name == k}
    table = claims_table(profile, write=True)
    print()
    print(claims.to_markdown(table))
    print(f"(written to {(base / 'claims.md').relative_to(ROOT)})")
    extra = {k: v for k, v in dirs.items() if k not in default_dirs}
    if extra:
        sub = claims_table(profile, dirs=extra, write=False)
        sub = sub[sub.experiment.isin(list(extra))]
        print("\nClaims on the runs with overridden parameters:\n")
        print(claims.to_markdown(sub))
    if failures:
        print(f"experiments that failed: {failures}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
