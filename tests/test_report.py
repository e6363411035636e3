"""What a reader looks at (issue 46): stored notebooks show their figure, their streams hold no
progress-bar redraws or widget warnings, and the report (index.html: the claims with their
reasons, linked to each experiment's rendered notebook) is made from a results folder."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from PIL import Image

from pipecomm.lab import claims, report

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "artifact" / "reference"


def _png(path: Path, size: tuple[int, int] = (240, 120)) -> Path:
    Image.new("RGB", size, (200, 30, 30)).save(path, dpi=(120, 120))
    return path


def _notebook(figure_output: dict) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# E4 — a test"),
        nbformat.v4.new_code_cell("df = nb.load_or_run(E, params, data_csv)", outputs=[
            nbformat.v4.new_output("stream", name="stderr", text=".venv/tqdm/auto.py:21: "
                                   "TqdmWarning: IProgress not found. Please update\n  from "
                                   ".autonotebook import tqdm as notebook_tqdm\n"),
            nbformat.v4.new_output("stream", name="stdout", text="\rE4 runs:   0%| 0/2"),
            nbformat.v4.new_output("stream", name="stdout", text="\rE4 runs: 100%| 2/2\n"),
            nbformat.v4.new_output("execute_result", data={"text/plain": "measured 1.23"},
                                   execution_count=1)]),
        nbformat.v4.new_code_cell("fig = E.plot(df, **params)\nnb.save(E, out_dir, df, fig)",
                                  outputs=[nbformat.v4.new_output(
                                      "execute_result", data={"text/plain": "PosixPath('x')"},
                                      execution_count=2), figure_output]),
    ]
    return nb


POINTER = nbformat.v4.new_output("display_data", data={"text/plain": report.PLACEHOLDER})


def test_a_stored_notebook_gets_its_figure_back_and_keeps_its_text(tmp_path):
    nb = _notebook(POINTER)
    text_before = [[o for o in c.get("outputs", []) if o.get("data", {}).get("text/plain") !=
                    report.PLACEHOLDER] for c in nb.cells]
    assert report.inline_figure(nb, _png(tmp_path / "figure.png"))
    outputs = nb.cells[2].outputs
    assert [o.output_type for o in outputs] == ["execute_result", "display_data"]
    image = Image.open(io.BytesIO(base64.b64decode(outputs[1].data["image/png"])))
    assert image.size == (160, 80)  # 120 dpi -> 80 dpi
    assert [[o for o in c.get("outputs", []) if "image/png" not in o.get("data", {})]
            for c in nb.cells] == text_before  # every text output as the run left it
    assert report.inline_figure(nb, tmp_path / "figure.png")  # again: still one image
    assert sum("image/png" in o.get("data", {}) for o in nb.cells[2].outputs) == 1


def test_streams_keep_what_a_terminal_shows():
    nb = _notebook(POINTER)
    assert report.tidy_streams(nb) == 2  # the warning stream, one redraw
    streams = [o for o in nb.cells[1].outputs if o.output_type == "stream"]
    assert [(o.name, o.text) for o in streams] == [("stdout", "E4 runs: 100%| 2/2\n")]
    assert nb.cells[1].outputs[-1].data["text/plain"] == "measured 1.23"


@pytest.mark.parametrize("profile", ["cpu", "cpu-full", "shaped"])
def test_every_reference_notebook_shows_its_figure_in_its_plot_cell(profile):
    books = sorted((REFERENCE / profile).glob("E*/notebook.ipynb"))
    assert books
    for path in books:
        nb = nbformat.read(path, as_version=4)
        cell = report.plot_cell(nb)
        assert cell is not None and "E.plot(" in cell.source, path
        images = [o for o in cell.outputs if "image/png" in o.get("data", {})]
        assert len(images) == 1, f"{path}: no figure in its plot cell"
        assert len(images[0].data["image/png"]) < 200_000, f"{path}: figure too large"
        text = path.read_text()
        assert "TqdmWarning" not in text and "\\r" not in text, f"{path}: progress noise"


def _claims_csv(base: Path) -> None:
    pd.DataFrame({
        "claim": ["C4.9", "C4.8", "C1.9"], "kind": ["method", "paper", "illustration"],
        "experiment": ["E4", "E4", "E1"], "statement": ["s method", "s paper", "s model"],
        "measured": ["x 1.3 [0.9, 1.8]", "y 2 [1.9, 2.1]", ""],
        "threshold": ["x <= 1.2", "y >= 1", ""],
        "verdict": [claims.INCONCLUSIVE, claims.PASS, claims.MODEL],
    }).to_csv(base / "claims.csv", index=False)


def test_report_links_each_claim_to_its_rendered_notebook(tmp_path):
    base = tmp_path / "cpu"
    (base / "E4").mkdir(parents=True)
    _claims_csv(base)
    nbformat.write(_notebook(POINTER), base / "E4" / "notebook.ipynb")
    _png(base / "E4" / "figure.png")
    index = report.build(base, title="profile cpu")
    assert index == base / "report" / "index.html"
    page = index.read_text()
    assert page.index("The papers' claims") < page.index("Method claims")
    assert page.index("C4.8") < page.index("C4.9")  # the paper's claim first
    assert '<a href="E4.html">C4.9</a>' in page and "<th>why</th>" in page
    assert "neither meet nor miss the threshold (x &lt;= 1.2)" in page  # an INCONCLUSIVE's why
    assert 'src="../E4/figure.png"' in page  # figures inline, linked, not copied
    e4 = (base / "report" / "E4.html").read_text()
    assert 'src="../E4/figure.png"' in e4 and "measured 1.23" in e4
    assert report.PLACEHOLDER not in e4 and 'href="../E4/notebook.ipynb"' in e4
    assert not (base / "report" / "E1.html").exists()  # no notebook, no page


def test_a_report_without_a_claims_table_says_run_first(tmp_path):
    with pytest.raises(FileNotFoundError, match="no claims table at .*: run the profile first"):
        report.build(tmp_path)


def test_the_committed_reference_report_is_current():
    """artifact/reference/cpu/report/ holds a page per experiment and the claims with reasons
    (./run_all.sh --profile cpu --report --reference rewrites it)."""
    index = (REFERENCE / "cpu" / "report" / "index.html").read_text()
    table = pd.read_csv(REFERENCE / "cpu" / "claims.csv", dtype=str)
    for eid in sorted(set(table.experiment)):
        if (REFERENCE / "cpu" / eid / "notebook.ipynb").exists():
            assert f'href="{eid}.html"' in index and (REFERENCE / "cpu" / "report" /
                                                       f"{eid}.html").exists()
    assert "independent runs disagree" in index and "protocol gate closed" in index
