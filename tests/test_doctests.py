"""The docstring examples of the library run as doctests.

Every module of ``pipecomm`` outside ``pipecomm.lab`` (and the lab modules that
carry ``>>>`` examples) is run through :mod:`doctest`; a failing example fails
the test named after its module.
"""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"

LAB_WITH_EXAMPLES = [
    "pipecomm.lab.measure.autotune",
    "pipecomm.lab.measure.bench",
    "pipecomm.lab.measure.calibration",
    "pipecomm.lab.checks",
    "pipecomm.lab.claims",
    "pipecomm.lab.cli",
    "pipecomm.lab.networks.cluster.host",
    "pipecomm.lab.networks.cluster.job",
    "pipecomm.lab.networks.cluster.probes",
    "pipecomm.lab.networks.cluster.programs",
    "pipecomm.lab.networks.cluster.slurm",
    "pipecomm.lab.networks.cluster.virtual",
    "pipecomm.lab.workloads.corpus",
    "pipecomm.lab.networks.cost",
    "pipecomm.lab.networks.cost.calibration",
    "pipecomm.lab.networks.cost.host",
    "pipecomm.lab.networks.cost.link",
    "pipecomm.lab.networks.cost.lockstep",
    "pipecomm.lab.networks.cost.overlapped",
    "pipecomm.lab.networks.cost.tables",
    "pipecomm.lab.training.dadam_runtime_model",
    "pipecomm.lab.training.dadam_timing",
    "pipecomm.lab.workloads.data",
    "pipecomm.lab.workloads.download",
    "pipecomm.lab.experiment",
    "pipecomm.lab.experiments.e00_calibrate",
    "pipecomm.lab.experiments.e01_lp_cost_model",
    "pipecomm.lab.experiments.e02_collectives_vs_size",
    "pipecomm.lab.experiments.e03_collectives_vs_ranks",
    "pipecomm.lab.experiments.e04_lp_block_size",
    "pipecomm.lab.experiments.e05_bsp_sgd",
    "pipecomm.lab.experiments.e06_pipesgd_timing_model",
    "pipecomm.lab.experiments.e07_pipesgd_convergence",
    "pipecomm.lab.experiments.e08_pipesgd_breakdown",
    "pipecomm.lab.experiments.e09_layerwise_delayed",
    "pipecomm.lab.experiments.e10_topology_comm_time",
    "pipecomm.lab.experiments.e11_runtime_model",
    "pipecomm.lab.experiments.e12_dadam_scaling",
    "pipecomm.lab.experiments.e14_emulator_vs_shaped",
    "pipecomm.lab.guard",
    "pipecomm.lab.ledger",
    "pipecomm.lab.networks.launch.flight",
    "pipecomm.lab.networks.launch.rank",
    "pipecomm.lab.networks.launch.torchrun",
    "pipecomm.lab.networks.launch.worker",
    "pipecomm.lab.meanings",
    "pipecomm.lab.workloads.models",
    "pipecomm.lab.networks.netem.emulation",
    "pipecomm.lab.networks.netem.network",
    "pipecomm.lab.networks.netem.schedule",
    "pipecomm.lab.networks.kinds",
    "pipecomm.lab.notebook",
    "pipecomm.lab.paper_claims",
    "pipecomm.lab.training.pipesgd_config",
    "pipecomm.lab.training.pipesgd_timing_model",
    "pipecomm.lab.training.pipesgd_training",
    "pipecomm.lab.rehearsal",
    "pipecomm.lab.results",
    "pipecomm.lab.workloads.schedules",
    "pipecomm.lab.schema",
    "pipecomm.lab.workloads.sharding",
    "pipecomm.lab.measure.stats",
    "pipecomm.lab.measure.sweep",
    "pipecomm.lab.training.trainers",
    "pipecomm.lab.training.tuning",
    "pipecomm.lab.workloads.tasks",
    "pipecomm.lab.standin",
]

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _library_modules() -> list[str]:
    root = SRC / "pipecomm"
    names = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = rel.parts
        if parts[1:2] == ("lab",):
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


MODULES = _library_modules() + LAB_WITH_EXAMPLES


def _run(name: str) -> tuple[doctest.TestResults, str]:
    """Run the doctests of module ``name``; return the results and the failure report."""
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    report: list[str] = []
    for test in finder.find(module, name):
        runner.run(test, out=report.append)
    return doctest.TestResults(runner.failures, runner.tries), "".join(report)


@pytest.mark.parametrize("name", MODULES)
def test_module_doctests(name: str) -> None:
    result, report = _run(name)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctests of {name} failed:\n{report}"


def test_examples_exist() -> None:
    finder = doctest.DocTestFinder(exclude_empty=True)
    examples = sum(
        len(test.examples)
        for name in MODULES
        for test in finder.find(importlib.import_module(name), name)
    )
    assert examples > 0
