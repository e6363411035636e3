"""Every notebook runs top to bottom through papermill, as ``run_all.sh`` runs it, and shows its
figure without a progress bar or widget warning: in its experiment's tiny test
(tests/test_eNN_*.py, through the ``notebook_run`` fixture of tests/conftest.py, with the small
parameters ``TINY`` that test checks the data of), so that no experiment runs end to end twice.
Here: every notebook has such a test, and its own defaults (the quick configuration a reader
runs in JupyterLab) are valid parameters. Notebooks are stored without outputs (test_artifact)."""

import importlib
from pathlib import Path

import papermill as pm
import pytest

from pipecomm.lab import execute, profiles

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
TESTS = Path(__file__).resolve().parent


def _tiny_test(path: Path) -> Path:
    """The test module of the notebook's experiment (tests/test_eNN*.py)."""
    (found,) = TESTS.glob(f"test_e{path.stem[:2]}*.py")
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_defaults_are_valid_parameters(path):
    module = importlib.import_module(f"pipecomm.lab.experiments.e{path.stem}")
    defaults = {k: v for k, v in profiles.notebook_parameters(path).items()
                if k not in profiles.RESERVED}
    assert set(defaults) <= set(module.DEFAULTS), set(defaults) - set(module.DEFAULTS)
    module.Params.make(**defaults)  # types and the experiment's own checks: ValueError naming it


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_in_its_experiments_tiny_test(path):
    owner = _tiny_test(path)
    assert isinstance(importlib.import_module(owner.stem).TINY, dict), owner.name
    module = f"e{path.stem[:2].lstrip('0') or '0'}"
    assert f"notebook_run({module}, TINY" in owner.read_text(), f"{owner.name} does not run it"


def test_invalid_parameter_fails_with_a_clear_message(tmp_path):
    execute.ensure_kernel()
    path = next(p for p in NOTEBOOKS if p.stem == "00_calibrate")
    with pytest.raises(pm.PapermillExecutionError, match="sizes_max"):
        execute.execute_notebook(path, tmp_path / path.name, {"sizes_max": "big"}, timeout_s=120)
