"""What a reader looks at without running anything: the figure inside each executed notebook, and
a static report of a profile's results to browse (``results/<profile>/report/index.html``, or
``artifact/reference/<profile>/report/`` for a reference run).

The report is plain HTML files, no service: ``index.html`` holds the claims table (the papers'
claims first, the verdict of every run, the reason of every verdict) and every experiment's
figure; each claim links to its experiment's page ``<E>.html``, the executed notebook rendered
by nbconvert (inputs, text outputs and the figure, which is the ``figure.png`` beside the
notebook, linked, not copied). :func:`inline_figure` gives a reference notebook (whose image
outputs were stripped) its figure back from the stored ``figure.png``, at a modest resolution
(:data:`INLINE_DPI`), without touching any text output.

Example::

    from pipecomm.lab import report
    report.build(Path("results/cpu"), title="profile cpu")   # results/cpu/report/index.html
"""

from __future__ import annotations

import base64
import html
import io
import os
from pathlib import Path
from typing import Any

import nbformat
import pandas as pd
from PIL import Image

from pipecomm.lab import claims, results

#: Resolution of the figure inside a stored notebook (figure.png beside it has 120 dpi).
INLINE_DPI = 80
#: Colours of the compact inline PNG (a palette image: plots have few colours).
INLINE_COLORS = 64
PLACEHOLDER = "[figure: see figure.png beside this notebook]"
IMAGE_KEYS = ("image/png", "application/pdf", "image/svg+xml", "image/jpeg")

# --------------------------------------------------------------------------- notebook figures


def compact_png(path: Path, dpi: float = INLINE_DPI, colors: int = INLINE_COLORS) -> bytes:
    """``path`` (a PNG saved at its own dpi) resampled to ``dpi`` and reduced to a palette of
    ``colors``: the figure a stored notebook shows (about 15-90 KB).

    Example::

        len(compact_png(Path("artifact/reference/cpu/E4/figure.png")))   # ~16000
    """
    with Image.open(path) as im:
        scale = dpi / float((im.info.get("dpi") or (120.0,))[0])
        size = (max(1, round(im.width * scale)), max(1, round(im.height * scale)))
        small = im.convert("RGB").resize(size, Image.Resampling.LANCZOS)
    small = small.quantize(colors=colors, method=Image.Quantize.MEDIANCUT,
                           dither=Image.Dither.NONE)
    out = io.BytesIO()
    small.save(out, "PNG", optimize=True, dpi=(dpi, dpi))
    return out.getvalue()


def _is_figure(output: dict[str, Any]) -> bool:
    data = output.get("data", {})
    return any(k in data for k in IMAGE_KEYS) or data.get("text/plain") == PLACEHOLDER


def plot_cell(nb: Any) -> Any | None:
    """The cell of ``nb`` that shows its figure: one with an image output (or the pointer
    :data:`PLACEHOLDER` that replaced it), else the code cell that calls ``E.plot``.

    Example::

        plot_cell(nbformat.read("notebooks/04_lp_block_size.ipynb", 4)).source   # 'fig = E.plot(...'
    """
    code = [c for c in nb.cells if c.cell_type == "code"]
    shown = [c for c in code if any(_is_figure(o) for o in c.get("outputs", []))]
    if shown:
        return shown[0]
    return next((c for c in code if "E.plot(" in c.source), None)


def inline_figure(nb: Any, png: Path) -> bool:
    """Give ``nb``'s plot cell (:func:`plot_cell`) its figure as one ``image/png`` output made
    from ``png`` (:func:`compact_png`), in place of its image outputs or the pointer to
    figure.png; every other output stays as the run left it. False when there is no plot cell.

    Example::

        nb = nbformat.read(path, 4); inline_figure(nb, path.parent / "figure.png")
    """
    cell = plot_cell(nb)
    if cell is None:
        return False
    outputs = cell.get("outputs", [])
    at = next((i for i, o in enumerate(outputs) if _is_figure(o)), len(outputs))
    label = "<Figure: figure.png beside this notebook>"
    image = nbformat.v4.new_output(
        "display_data", data={"image/png": base64.b64encode(compact_png(png)).decode(),
                              "text/plain": label})
    cell["outputs"] = [o for o in outputs[:at] if not _is_figure(o)] + [image] + \
        [o for o in outputs[at:] if not _is_figure(o)]
    return True


#: Lines of a stream output that are noise, not results: tqdm's notebook-widget fallback.
NOISE = ("TqdmWarning: IProgress not found", "from .autonotebook import tqdm as notebook_tqdm")


def _as_shown(text: str) -> str:
    """``text`` as a terminal shows it: of each line, what follows its last carriage return;
    without the :data:`NOISE` lines."""
    lines = [line.rsplit("\r", 1)[-1] for line in text.split("\n")]
    return "\n".join(line for line in lines if not any(n in line for n in NOISE))


def tidy_streams(nb: Any) -> int:
    """Merge each cell's consecutive stream outputs of one name and keep what a terminal would
    show (a progress bar redrawn with carriage returns becomes its final line), without tqdm's
    widget warning (:data:`NOISE`); every other output is untouched. Returns how many outputs
    were removed.

    Example::

        tidy_streams(nbformat.read("artifact/reference/cpu/E13/notebook.ipynb", 4))   # 31
    """
    removed = 0
    for cell in nb.cells:
        outputs, kept = cell.get("outputs", []), []
        for o in outputs:
            if o.get("output_type") == "stream" and kept and \
                    kept[-1].get("output_type") == "stream" and kept[-1]["name"] == o["name"]:
                kept[-1]["text"] += o["text"]
            else:
                kept.append(o)
        for o in kept:
            if o.get("output_type") == "stream":
                o["text"] = _as_shown(o["text"])
        kept = [o for o in kept if o.get("output_type") != "stream" or o["text"].strip()]
        if "outputs" in cell:
            removed += len(outputs) - len(kept)
            cell["outputs"] = kept
    return removed


def figure_outputs(path: Path) -> list[int]:
    """The indexes of the cells of notebook ``path`` that hold an ``image/png`` output.

    Example::

        figure_outputs(Path("artifact/reference/cpu/E4/notebook.ipynb"))   # [6]
    """
    nb = nbformat.read(path, as_version=4)
    return [i for i, c in enumerate(nb.cells)
            if any("image/png" in o.get("data", {}) for o in c.get("outputs", []))]


# --------------------------------------------------------------------------- the report

_CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1400px;
       padding: 0 1em; color: #222 }
h1 { font-size: 1.6em } h2 { font-size: 1.25em; margin-top: 1.6em } a { color: #0645ad }
table { border-collapse: collapse; margin: .5em 0 } td, th { border: 1px solid #ccc;
  padding: .3em .5em; vertical-align: top; text-align: left }
th { background: #f3f3f3 } td.v { white-space: nowrap; font-weight: 600 }
.PASS { color: #176b1e } .FAIL { color: #b00020 } .INCONCLUSIVE, .UNSTABLE { color: #8a5a00 }
.ERROR { color: #b00020 } .small { color: #555; font-size: .9em }
img.fig { max-width: 100%; border: 1px solid #eee } .fig-box { margin: 1.2em 0 }
div.input_area, pre { background: #f7f7f7; padding: .4em; overflow-x: auto }
div.output_area pre { background: none } .prompt { display: none }
div.output_stderr { display: none } .rendered_html table { font-size: .9em }
div.cell { margin: 1em 0 } div.output_subarea { overflow-x: auto; max-width: 100% }
"""


def _page(title: str, body: str, extra_css: str = "") -> str:
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}{extra_css}</style></head>"
            f"<body>\n{body}\n</body></html>\n")


def _cell(value: Any) -> str:
    text = "" if value is None or (isinstance(value, float) and pd.isna(value)) else str(value)
    return html.escape(text, quote=False)


def reasons(table: pd.DataFrame, base: Path) -> list[str]:
    """The ``why`` of each row of a claims table read from ``base/claims.csv``: its own
    column when it has one; for a table written before reasons were recorded, the reason of
    the same check on the same stored data (``base/<E>/data.csv[.gz]``) when that gives the
    table's verdict and measured value again, else what the row itself says
    (:func:`pipecomm.lab.claims.explain_row`).

    Example::

        reasons(pd.read_csv("artifact/reference/cpu/claims.csv"), Path("artifact/reference/cpu"))
    """
    if "why" in table.columns:
        return [str(w) if isinstance(w, str) else "" for w in table["why"]]
    entries = {e["id"]: e for e in claims.load_claims(superseded=True)}
    data: dict[str, pd.DataFrame | None] = {}
    out = []
    for _, row in table.iterrows():
        entry, exp = entries.get(row["claim"]), row.get("experiment", "")
        why = claims.explain_row(row)
        if entry is not None and row["verdict"] in (claims.PASS, claims.FAIL, claims.INCONCLUSIVE):
            if exp not in data:
                try:
                    data[exp] = results.load_csv(base / exp)
                except (OSError, ValueError):
                    data[exp] = None
            if data[exp] is not None:
                try:
                    v = claims.run_check(entry, data[exp])
                except Exception:  # the stored row explains itself
                    v = None
                if v is not None and v.verdict == row["verdict"] and \
                        v.measured == str(row["measured"]):
                    why = v.reason
        out.append(why)
    return out


def claims_html(table: pd.DataFrame, link: dict[str, str]) -> str:
    """The claims table as HTML sections (the papers' claims first): claim and experiment
    (linked to its page, ``link``), the verdict, the runs' verdicts, why, what was measured, the
    threshold and the statement.

    Example::

        claims_html(table, {"E4": "E4.html"})
    """
    cols = [c for c in ("claim", "experiment", "verdict", "runs", "why", "measured",
                        "threshold", "statement", "result") if c in table.columns]
    parts = []
    for kind, title in claims.SECTIONS:
        sub = table[table["kind"] == kind] if "kind" in table.columns else table
        if sub.empty:
            continue
        rows = ["<tr>" + "".join(f"<th>{c}</th>" for c in cols) + "</tr>"]
        for _, r in sub.iterrows():
            cells = []
            for c in cols:
                v = _cell(r[c])
                if c in ("claim", "experiment") and r["experiment"] in link:
                    v = f'<a href="{link[r["experiment"]]}">{v}</a>'
                cls = f' class="v {html.escape(str(r[c]).split()[0])}"' if c == "verdict" and \
                    str(r[c]) else ""
                cells.append(f"<td{cls}>{v}</td>")
            rows.append("<tr>" + "".join(cells) + "</tr>")
        parts.append(f"<h2>{html.escape(title, quote=False)}</h2>\n<table>{''.join(rows)}</table>")
        if "kind" not in table.columns:
            break
    return "\n".join(parts) + f"\n<p class=\"small\">{_cell(claims.count_line(table))}</p>"


def notebook_html(nb_path: Path, figure: str | None) -> tuple[str, str]:
    """An executed notebook as an HTML fragment (nbconvert's basic template) and its styles:
    inputs and text outputs as the run left them, stderr streams hidden, the figure shown from
    ``figure`` (a relative link to the figure.png beside the notebook) in place of any image
    output.

    Example::

        body, css = notebook_html(Path("results/cpu/E4/notebook.ipynb"), "../E4/figure.png")
    """
    from nbconvert import HTMLExporter  # imports in seconds: only when a report is made
    from pygments.formatters import HtmlFormatter

    nb = nbformat.read(nb_path, as_version=4)
    cell = plot_cell(nb)
    if cell is not None and figure is not None:
        img = (f'<img class="fig" src="{html.escape(figure)}" alt="figure of this '
               f'experiment">')
        kept = [o for o in cell.get("outputs", []) if not _is_figure(o)]
        cell["outputs"] = [*kept, nbformat.v4.new_output("display_data",
                                                         data={"text/html": img})]
    body, _ = HTMLExporter(template_name="basic").from_notebook_node(nb)
    return body, HtmlFormatter().get_style_defs(".highlight")


def _rel(path: Path, start: Path) -> str:
    return Path(os.path.relpath(path, start)).as_posix()


def experiment_page(base: Path, eid: str, out: Path, table: pd.DataFrame) -> str | None:
    """Write ``out/<eid>.html`` (its claims, links to its files, the rendered notebook); the
    file name, or None when ``base/<eid>`` has no executed notebook.

    Example::

        experiment_page(Path("results/cpu"), "E4", Path("results/cpu/report"), table)
    """
    src = base / eid
    if not (src / "notebook.ipynb").exists():
        return None
    fig = _rel(src / "figure.png", out) if (src / "figure.png").exists() else None
    try:
        body, css = notebook_html(src / "notebook.ipynb", fig)
    except Exception as exc:  # a damaged notebook: the page says so, the report still builds
        body, css = (f"<p>notebook.ipynb cannot be rendered: {_cell(type(exc).__name__)}: "
                     f"{_cell(exc)}</p>"), ""
    files = [n for n in ("notebook.ipynb", "figure.png", "figure.pdf", "data.csv", "data.csv.gz",
                         "params.json", "env.json") if (src / n).exists()]
    links = " &middot; ".join(f'<a href="{_rel(src / n, out)}">{n}</a>' for n in files)
    mine = table[table["experiment"] == eid] if "experiment" in table.columns else table[:0]
    head = (f'<p><a href="index.html">&larr; all claims</a></p><h1>{eid}</h1>'
            f'<p class="small">files: {links}</p>')
    verdicts = claims_html(mine, {}) if len(mine) else "<p>(no claims)</p>"
    page = _page(f"{eid} — {base.name}", f"{head}\n{verdicts}\n<h2>The executed notebook</h2>"
                 f"\n{body}", css)
    name = f"{eid}.html"
    results.write_text(out / name, page)
    return name


def _experiments(base: Path) -> list[str]:
    found = [d.name for d in base.glob("E*") if d.is_dir() and d.name[1:].isdigit()]
    return sorted(found, key=lambda e: int(e[1:]))


def build(base: Path, out: Path | None = None, title: str | None = None) -> Path:
    """Write the report of the results in ``base`` (``results/<profile>`` or
    ``artifact/reference/<profile>``) to ``out`` (default ``base/report``): ``index.html``
    with the claims table of ``base/claims.csv`` and every figure, and one page per experiment
    (:func:`experiment_page`); returns the index.

    Raises:
        FileNotFoundError: ``base`` has no claims.csv (run the profile first).

    Example::

        build(Path("artifact/reference/cpu"))   # artifact/reference/cpu/report/index.html
    """
    out = base / "report" if out is None else out
    csv = base / "claims.csv"
    if not csv.exists():
        raise FileNotFoundError(f"no claims table at {csv}: run the profile first")
    table = pd.read_csv(csv, dtype=str, keep_default_na=False)
    table["why"] = reasons(table, base)
    pages = {eid: page for eid in _experiments(base)
             if (page := experiment_page(base, eid, out, table)) is not None}
    figures = "".join(
        f'<div class="fig-box"><h3><a href="{pages.get(eid, "")}">{eid}</a></h3>'
        f'<img class="fig" src="{_rel(base / eid / "figure.png", out)}" alt="{eid} figure">'
        f"</div>" for eid in _experiments(base) if (base / eid / "figure.png").exists())
    title = title or base.name
    head = (f"<h1>pipecomm: claims and figures, {html.escape(title)}</h1>"
            f'<p class="small">Made from {html.escape(_rel(csv, out))} and the executed '
            f"notebooks beside it. Each claim links to its experiment's page (the notebook "
            f"as it ran); <em>why</em> gives the rule that decided each verdict or did not "
            f"decide it.</p>")
    body = f"{head}\n{claims_html(table, pages)}\n<h2>Figures</h2>\n{figures}"
    index = out / "index.html"
    results.write_text(index, _page(f"pipecomm {title}", body))
    return index
