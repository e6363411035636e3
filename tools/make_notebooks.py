"""Write notebooks/NN_name.ipynb from the experiment modules (dev tool; run after editing).

Each notebook is thin: a markdown cell (what the figure shows, which claim it tests), a parameters
cell that mirrors the module's DEFAULTS (the quick configuration) plus ``out_dir`` and
``data_csv``, a call, a table, a plot, and a sentence on what to see. Stored without outputs.

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


def build(module) -> nbformat.NotebookNode:
    text = module.NOTEBOOK_TEXT
    lines = ["# Parameters: the quick configuration (artifact/profiles/*.yaml hold the real runs')"]
    lines += [f"{k} = {v!r}" for k, v in module.DEFAULTS.items()]
    lines += [
        "out_dir = None  # directory for data.csv, figure, params.json, env.json (None: no files)",
        "data_csv = None  # path of a finished run's data.csv: plot it instead of measuring",
    ]
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "pipecomm", "display_name": "Python (pipecomm)",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    params = nbformat.v4.new_code_cell("\n".join(lines))
    params.metadata["tags"] = ["parameters"]
    name = module.__name__.rsplit(".", 1)[1]
    nb.cells = [
        nbformat.v4.new_markdown_cell(text["intro"].strip()),
        params,
        nbformat.v4.new_code_cell(
            f"from pipecomm.experiments import {name} as E\n"
            "from pipecomm.experiments._cli import load_or_run, notebook_params, save\n\n"
            "params = notebook_params(globals(), E)\n"
            "df = load_or_run(E, params, data_csv)\n"
            "E.summary(df)"
        ),
        nbformat.v4.new_code_cell("fig = E.plot(df, **params)\nsave(E, out_dir, df, fig, params)"),
        nbformat.v4.new_markdown_cell(text["outro"].strip()),
    ]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"
    return nb


def main(only: list[str]) -> None:
    import pipecomm.experiments as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"pipecomm.experiments.{info.name}")
        if only and module.ID not in only:
            continue
        path = ROOT / "notebooks" / f"{module.NOTEBOOK}.ipynb"
        nbformat.write(build(module), path)
        print("wrote", path.relative_to(ROOT))


if __name__ == "__main__":
    main(sys.argv[1:])
