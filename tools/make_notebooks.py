"""Keep each notebook's parameters cell in sync with its experiment module's DEFAULTS.

The notebooks under notebooks/ are the source of truth for everything a reader sees (the
markdown, the cells; edit them in JupyterLab). Only the cell tagged ``parameters`` is generated:
it mirrors the module's DEFAULTS (the quick configuration) plus ``out_dir`` and ``data_csv``.
Outputs are stripped. tests/test_artifact.py fails when a notebook is out of sync or has outputs.

    .venv/bin/python tools/make_notebooks.py            # all
    .venv/bin/python tools/make_notebooks.py E0 E3      # some
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]


def parameters_source(module) -> str:
    lines = ["# Parameters: the quick configuration (artifact/profiles/*.yaml hold the real runs')"]
    lines += [f"{k} = {v!r}" for k, v in module.DEFAULTS.items()]
    lines += [
        "out_dir = None  # directory for data.csv, figure, params.json, env.json (None: no files)",
        "data_csv = None  # path of a finished run's data.csv: plot it instead of measuring",
    ]
    return "\n".join(lines)


def sync(path: Path, module) -> None:
    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise SystemExit(f"{path}: expected one cell tagged 'parameters', found {len(cells)}")
    cells[0].source = parameters_source(module)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, path)


def main(only: list[str]) -> None:
    import pipecomm.lab.experiments as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if not info.name.startswith("e"):
            continue
        module = importlib.import_module(f"pipecomm.lab.experiments.{info.name}")
        if only and module.ID not in only:
            continue
        path = ROOT / "notebooks" / f"{module.NOTEBOOK}.ipynb"
        sync(path, module)
        print("synced", path.relative_to(ROOT))


if __name__ == "__main__":
    main(sys.argv[1:])
