"""Shared fixtures: rank pools kept alive for the whole session (starting ranks costs seconds),
and each experiment's notebook run once per session."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from pipecomm.lab import execute, profiles, report, results
from pipecomm.lab.networks import launch

# algorithm="auto" reads no table the machine may hold (tests that want one name their own);
# set before any pool starts, so every rank inherits it
os.environ.setdefault("PIPECOMM_TUNE_FILE", "off")

# What only a quiet host delivers: the emulator's host probe (HostTooSlow) and the shaped
# cluster's check that the host carries every node link at once. A test that meets one of them
# on a busy host is skipped with the probe's reason instead of failing (pytest -ra lists it).
_BUSY_HOST = ("HostTooSlow", "this host cannot carry")


def busy_host_reason(exc: BaseException) -> str | None:
    """The host probe's one-line reason when ``exc`` (raised directly, by a rank or inside a
    notebook) says the host is too busy for the test's network, else None."""
    text = f"{type(exc).__name__}: {exc} {getattr(exc, 'ename', '')} {getattr(exc, 'evalue', '')}"
    if not any(mark in text for mark in _BUSY_HOST):
        return None
    line = next((ln for ln in text.splitlines() if any(m in ln for m in _BUSY_HOST)), text)
    return line.strip()[:300]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report_ = outcome.get_result()
    if report_.when == "call" and report_.failed and call.excinfo is not None:
        why = busy_host_reason(call.excinfo.value)
        if why:
            report_.outcome = "skipped"
            report_.longrepr = (str(item.path), item.location[1] or 0,
                                f"Skipped: the host is too busy for this test's network: {why}")


# --------------------------------------------------------------------------- two workers

#: ``./run_all.sh --tests`` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup
#: --no-loadscope-reorder``): a module is one group, run by one worker (its module fixtures and
#: session pools built once); the modules that build a shaped virtual cluster form one group, so
#: two clusters never compete for the host's links (their check would skip them as "this host
#: cannot carry"); the longest groups go first, so that no worker is left with a long tail.
SHAPED_MODULES = ("test_cluster", "test_network_kinds", "test_e14_emulator_vs_shaped",
                  "test_e15_against_builtin", "test_slurm")
LONGEST_FIRST = ("shaped-network", "test_faults", "test_collectives", "test_artifact",
                 "test_rehearsal", "test_survives", "test_crosscheck_accumadam", "test_examples",
                 "test_netem", "test_run", "test_backend")


def worker_group(module: str) -> str:
    """The xdist group of a test module: ``"shaped-network"`` for :data:`SHAPED_MODULES`, else
    the module's own name."""
    return "shaped-network" if module in SHAPED_MODULES else module


def pytest_collection_modifyitems(config, items):
    order = {g: i for i, g in enumerate(LONGEST_FIRST)}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(worker_group(item.module.__name__)))
    items.sort(key=lambda it: order.get(worker_group(it.module.__name__), len(order)))


_POOLS: dict[tuple, launch.Ranks] = {}


@pytest.fixture(scope="session")
def pool():
    """``pool(world_size, network=None, ranks_per_node=None)`` -> a live, reused ``Ranks``.

    Rank functions must live in an importable module (``tests/rankfns_*.py``).
    A pool whose run failed restarts by itself on its next run.
    """

    def get(world_size: int, network=None, ranks_per_node: int | None = None) -> launch.Ranks:
        key = (world_size, repr(network), ranks_per_node)
        if key not in _POOLS:
            _POOLS[key] = launch.Ranks(world_size, network=network, ranks_per_node=ranks_per_node)
        return _POOLS[key]

    yield get
    for ranks in _POOLS.values():
        ranks.close()
    _POOLS.clear()


# --------------------------------------------------------------------------- notebook runs


@dataclass
class NotebookRun:
    """One experiment's notebook, executed as ``run_all.sh`` executes it."""

    out: Path  # its result directory: data.csv, figure, notebook.ipynb, params.json, env.json
    df: pd.DataFrame  # its data.csv, read back as a notebook with ``data_csv`` reads it
    notebook: nbformat.NotebookNode  # the executed notebook


_NOTEBOOK_RUNS: dict[str, tuple[dict, dict, NotebookRun]] = {}


@pytest.fixture(scope="session")
def notebook_run(tmp_path_factory):
    """``notebook_run(module, params, env=None)`` -> :class:`NotebookRun`: the experiment's
    notebook executed by papermill on the pipecomm kernel with ``params`` over its defaults
    (``execute.run_experiment``, the path of ``run_all.sh``), with ``env`` set for the kernel;
    its finished training runs stay in ``out.parent / ".runs"``.

    Once per session: each experiment runs end to end once, in its tiny test (tests/test_eNN_*.py,
    which owns ``params``), and the run checks that the notebook shows its figure without a
    progress bar or widget warning.
    """

    def get(module, params: dict, env: dict | None = None) -> NotebookRun:
        eid, env = module.ID, dict(env or {})
        if eid in _NOTEBOOK_RUNS:
            first_params, first_env, run = _NOTEBOOK_RUNS[eid]
            assert (first_params, first_env) == (params, env), f"{eid} asked for twice, differently"
            return run
        execute.ensure_kernel()
        exp = profiles.discover()[eid]
        full = {k: v for k, v in {**exp.defaults, **params}.items() if k not in profiles.RESERVED}
        out = tmp_path_factory.mktemp(eid) / "cpu" / eid
        with pytest.MonkeyPatch.context() as mp:  # the environment as it was, afterwards
            for k, v in env.items():
                mp.setenv(k, v)
            mp.delenv(results.RUNS_ENV, raising=False)  # run_experiment sets it, then drops it
            execute.run_experiment(exp, "cpu", full, out, keep_runs=True)
        run = NotebookRun(out, results.load_csv(out), nbformat.read(out / "notebook.ipynb", 4))
        # it shows its figure, and no progress bar or widget warning
        cell = report.plot_cell(run.notebook)
        assert cell is not None and any("image/png" in o.get("data", {}) for o in cell.outputs)
        streams = [o.text for c in run.notebook.cells for o in c.get("outputs", [])
                   if o.output_type == "stream"]
        assert not any("\r" in t or "TqdmWarning" in t for t in streams), streams
        _NOTEBOOK_RUNS[eid] = (params, env, run)
        return run

    return get
