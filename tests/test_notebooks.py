"""Every notebook runs top to bottom with its own defaults (the quick configuration), exactly as
in JupyterLab: no injected parameters. Notebooks are stored without outputs (test_artifact)."""

from pathlib import Path

import nbformat
import papermill as pm
import pytest

from pipecomm.lab import artifact, cluster, report

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.fixture(scope="module", autouse=True)
def kernel():
    artifact.ensure_kernel()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_with_its_defaults(path, tmp_path):
    if path.stem == "14_emulator_vs_shaped":  # needs the virtual cluster (root, ip, tc tbf)
        ok, why = cluster.available()
        if not ok:
            pytest.skip(f"shaped network unavailable: {why}")
    artifact.execute_notebook(path, tmp_path / path.name, timeout_s=240)
    done = nbformat.read(tmp_path / path.name, as_version=4)
    cell = report.plot_cell(done)  # it shows its figure, and no progress bar or widget warning
    assert cell is not None and any("image/png" in o.get("data", {}) for o in cell.outputs)
    streams = [o.text for c in done.cells for o in c.get("outputs", []) if o.output_type == "stream"]
    assert not any("\r" in t or "TqdmWarning" in t for t in streams), streams


def test_invalid_parameter_fails_with_a_clear_message(tmp_path):
    path = next(p for p in NOTEBOOKS if p.stem == "00_calibrate")
    with pytest.raises(pm.PapermillExecutionError, match="sizes_max"):
        artifact.execute_notebook(path, tmp_path / path.name, {"sizes_max": "big"}, timeout_s=120)
