"""Every notebook runs top to bottom through papermill, as ``run_all.sh`` runs it, and shows its
figure without a progress bar or widget warning. Each runs once in the session: with the small
parameters its experiment's tiny test (tests/test_eNN_*.py, ``TINY``) checks the data of, so
that no experiment runs end to end twice. Its own defaults (the quick configuration a reader
runs in JupyterLab) are checked as parameters: the experiment's validation accepts them.
Notebooks are stored without outputs (test_artifact)."""

import importlib
from pathlib import Path

import papermill as pm
import pytest

from pipecomm.lab import artifact, cluster, report

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))
TESTS = Path(__file__).resolve().parent


def _tiny_test(path: Path):
    """The test module owning the notebook's experiment (tests/test_eNN*.py)."""
    (found,) = TESTS.glob(f"test_e{path.stem[:2]}*.py")
    return importlib.import_module(found.stem)


def _experiment(path: Path):
    return importlib.import_module(f"pipecomm.lab.experiments.e{path.stem}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_defaults_are_valid_parameters(path):
    module = _experiment(path)
    defaults = {k: v for k, v in artifact.notebook_parameters(path).items()
                if k not in artifact.RESERVED}
    assert set(defaults) <= set(module.DEFAULTS), set(defaults) - set(module.DEFAULTS)
    module.Params.make(**defaults)  # types and the experiment's own checks: ValueError naming it


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_and_shows_its_figure(path, notebook_run):
    if path.stem == "14_emulator_vs_shaped":  # needs the virtual cluster (root, ip, tc tbf)
        ok, why = cluster.available()
        if not ok:
            pytest.skip(f"shaped network unavailable: {why}")
    owner = _tiny_test(path)
    done = notebook_run(_experiment(path), owner.TINY, getattr(owner, "TINY_ENV", None)).notebook
    cell = report.plot_cell(done)
    assert cell is not None and any("image/png" in o.get("data", {}) for o in cell.outputs)
    streams = [o.text for c in done.cells for o in c.get("outputs", []) if o.output_type == "stream"]
    assert not any("\r" in t or "TqdmWarning" in t for t in streams), streams


def test_invalid_parameter_fails_with_a_clear_message(tmp_path):
    artifact.ensure_kernel()
    path = next(p for p in NOTEBOOKS if p.stem == "00_calibrate")
    with pytest.raises(pm.PapermillExecutionError, match="sizes_max"):
        artifact.execute_notebook(path, tmp_path / path.name, {"sizes_max": "big"}, timeout_s=120)
