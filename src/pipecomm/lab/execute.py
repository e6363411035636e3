"""Executing a notebook: the kernel, papermill with a time limit, and the atomic move of a
finished run into ``results/<profile>/<E>/`` (an interrupted run leaves nothing half-written).
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pipecomm.lab import guard, profiles, rehearsal, results, reuse

KERNEL = "pipecomm"


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
    """A kernel manager whose kernel talks over local IPC sockets instead of TCP ports; its
    sockets and connection file share one private directory (:func:`guard.kernel_dir`)."""
    from jupyter_client.manager import AsyncKernelManager

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            private = guard.kernel_dir()
            self.transport = "ipc"  # sockets are files in a private temporary directory
            self.ip = str(private / "kernel")
            self.connection_file = str(private / "connection.json")

        async def _async_start_kernel(self, **kw: Any) -> None:
            await super()._async_start_kernel(**kw)
            _LIVE_KERNELS.add(self)  # Ctrl-C stops it (stop_kernels)
            pid = getattr(getattr(self.provisioner, "process", None), "pid", None)
            if pid:  # after a kill -9 of this process the next run stops its session
                (Path(self.ip).parent / "kernel.pid").write_text(str(pid))

        start_kernel = _async_start_kernel

        async def _async_interrupt_kernel(self) -> None:
            if getattr(self, "shutting_down", False):
                return  # a SIGINT before the shutdown request only logs an ERROR in the kernel
            await super()._async_interrupt_kernel()

        interrupt_kernel = _async_interrupt_kernel

        async def _async_cleanup_resources(self, restart: bool = False) -> None:
            await super()._async_cleanup_resources(restart=restart)
            if not restart:
                _LIVE_KERNELS.discard(self)
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


def relocate_notebook(path: Path, out: Path, notebook: Path | None = None) -> None:
    """Rewrite an executed notebook's recorded paths (the injected parameters cell's
    ``out_dir``, papermill's metadata, outputs that print them or a file of this checkout) from
    the temporary directory it ran in to ``out``, relative to the repository: ``out_dir`` as the
    notebook opens it from notebooks/ (``"../results/cpu/E4"``), papermill's input and output
    paths and other files from the repository root.

    Example::

        relocate_notebook(RESULTS / "cpu/E4/notebook.ipynb", RESULTS / "cpu/E4")
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    out_dir = profiles.shown_path(out, profiles.NOTEBOOKS)
    ran_in = None  # the directory it ran in, as the parameters cell recorded it
    for cell in nb.cells:
        if "injected-parameters" in cell.get("metadata", {}).get("tags", []):
            found = re.search(r"(?m)^out_dir = (.*)$", cell.source)
            with contextlib.suppress(ValueError, SyntaxError):
                ran_in = ast.literal_eval(found.group(1)) if found else None
            cell.source = re.sub(r"(?m)^out_dir = .*$", lambda _: f"out_dir = {json.dumps(out_dir)}",
                                 cell.source)
    swaps = [(ran_in, out_dir)] if isinstance(ran_in, str) and ran_in else []
    swaps.append((f"{profiles.ROOT}/", ""))  # a warning's source file: relative to the repository
    venv = (profiles.ROOT / ".venv").resolve()  # where a linked .venv lives (a worktree sharing one)
    if venv != profiles.ROOT / ".venv":
        swaps.append((f"{venv}/", ".venv/"))

    def relative(text: str) -> str:
        for old, new in swaps:
            text = text.replace(old, new)
        return text

    for cell in nb.cells:  # outputs that show a path (a printed out_dir, a warning's file)
        for output in cell.get("outputs", []):
            if isinstance(output.get("text"), str):
                output["text"] = relative(output["text"])
            for key, value in output.get("data", {}).items():
                if isinstance(value, str) and key.startswith("text/"):
                    output["data"][key] = relative(value)
    meta = nb.metadata.get("papermill")
    if meta is not None:
        if "out_dir" in (meta.get("parameters") or {}):
            meta["parameters"]["out_dir"] = out_dir
        if notebook is not None:
            meta["input_path"] = profiles.shown_path(notebook)
        elif meta.get("input_path"):  # recorded on another machine: the same notebook here
            meta["input_path"] = f"notebooks/{Path(meta['input_path']).name}"
        meta["output_path"] = profiles.shown_path(out / path.name)
        meta.pop("cwd", None)
    nbformat.write(nb, path)


def run_experiment(exp: profiles.Experiment, profile: str, params: dict[str, Any], out: Path,
                   timeout_factor: float = 3.0, code: str | None = None,
                   keep_runs: bool = False) -> float:
    """Execute the notebook into a temporary directory, record what it consists of and the
    inputs it read, as they are after it ran (:func:`pipecomm.lab.reuse.write_manifest`), then
    rename it to ``out``.

    Args:
        exp: the experiment (its notebook and budget).
        profile: recorded in env.json.
        params: the notebook's parameters (``out_dir`` is set here).
        out: the final result directory.
        timeout_factor: hard limit = factor x budget (at least 120 s).
        code: the :func:`code_hash` recorded in env.json (computed when None).
        keep_runs: keep the finished training runs (``.runs/`` beside ``out``) after success,
            as an interruption keeps them (tests re-run from them).

    Returns the wall time in seconds.
    """
    code = code if code is not None else reuse.code_hash(exp.notebook)
    inputs = reuse.inputs(exp.id, params, reuse.calibration_of(out.parent))
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    limit = max(120.0, exp.budget_s * timeout_factor)
    # finished training runs survive an interruption here (results.Runs): re-running resumes
    # them while the code, the parameters and the inputs are the same
    key = hashlib.sha256(json.dumps([code, results.json_roundtrip(params), inputs],
                                    sort_keys=True).encode()).hexdigest()
    runs_dir = out.parent / ".runs" / f"{out.name}-{key[:12]}"
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
                "within_budget": wall <= exp.budget_s, "notebook": exp.notebook.name,
                "code_hash": code}
        if rehearsal.is_rehearsal(profile):  # what it replaced; that it decides nothing
            env["rehearsal"] = rehearsal.record(exp)
        results.write_json(tmp / "env.json", env)
        relocate_notebook(tmp / "notebook.ipynb", out, exp.notebook)
        if not (tmp / "params.json").exists():  # the key of its reuse, whatever the notebook wrote
            results.write_json(tmp / "params.json", params)
        # the inputs as the notebook left them: an experiment that fetches its data set (E7, E9
        # of the gpu profile) finds an empty data_root before it runs and the files after
        reuse.write_manifest(tmp, reuse.inputs(exp.id, params, reuse.calibration_of(out.parent)))
        results.replace_dir(tmp, out)
        if not keep_runs:
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
    the ``progress.json`` that :class:`pipecomm.lab.results.Runs` writes inside the notebook."""
    import threading

    from tqdm.std import tqdm

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
                           leave=False, disable=not is_terminal())
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


_LIVE_KERNELS: set[Any] = set()


def stop_kernels() -> bool:
    """Kill every kernel this process runs, with its process group (the kernel's ranks and fork
    server); True when there was one."""
    stopped = False
    for km in list(_LIVE_KERNELS):
        proc = getattr(getattr(km, "provisioner", None), "process", None)
        pid = getattr(proc, "pid", None)
        if pid:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)  # the kernel leads its own session
            stopped = True
    return stopped


def is_terminal() -> bool:
    """Whether stdout is a terminal: progress bars only there (a log gets one line per
    experiment, the lines :func:`run` prints)."""
    try:
        return sys.stdout.isatty()
    except (AttributeError, ValueError):
        return False

