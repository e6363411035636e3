"""Give the committed reference notebooks their figure back, without re-running anything.

``artifact/reference/<profile>/<E>/notebook.ipynb`` was stored with its image outputs replaced by
a pointer to the ``figure.png`` beside it. This tool puts that stored figure.png into the plot
cell as one compact ``image/png`` output (:func:`pipecomm.lab.report.inline_figure`: 80 dpi, a
64-colour palette); every text output -- the tables, the verdicts -- stays exactly as the run
wrote it, so the notebook shows what was measured and nothing re-computed. Progress bars redrawn
with carriage returns keep their final line and tqdm's widget warning is dropped
(:func:`pipecomm.lab.report.tidy_streams`). Notebooks that
already show their figure are re-rendered the same way (idempotent). ``--report`` then writes
each profile's browsable report (``artifact/reference/<profile>/report/``).

Usage::

    .venv/bin/python tools/render_reference.py                   # cpu, cpu-full, shaped
    .venv/bin/python tools/render_reference.py cpu --report      # and cpu's report
    .venv/bin/python tools/render_reference.py --check           # exit 1 if one lacks its figure
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

from pipecomm.lab import report
from pipecomm.lab.results import REPO_ROOT

REFERENCE = REPO_ROOT / "artifact" / "reference"
PROFILES = ("cpu", "cpu-full", "shaped")


def notebooks(profile: str) -> list[Path]:
    """The reference notebooks of ``profile`` that have a figure.png beside them.

    Example::

        notebooks("cpu")[0]   # artifact/reference/cpu/E0/notebook.ipynb
    """
    found = sorted((REFERENCE / profile).glob("E*/notebook.ipynb"),
                   key=lambda p: int(p.parent.name[1:]))
    return [p for p in found if (p.parent / "figure.png").exists()]


def render(path: Path) -> int:
    """Put ``path``'s figure.png into its plot cell (text outputs untouched); the size of the
    notebook written, in bytes.

    Example::

        render(REFERENCE / "cpu/E4/notebook.ipynb")   # 31000
    """
    nb = nbformat.read(path, as_version=4)
    if not report.inline_figure(nb, path.parent / "figure.png"):
        raise SystemExit(f"{path}: no plot cell (a cell calling E.plot)")
    report.tidy_streams(nb)
    nbformat.write(nb, path)
    return path.stat().st_size


def main(argv: list[str] | None = None) -> int:
    """The command line; 0 when every notebook shows its figure."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("profiles", nargs="*", default=list(PROFILES), help="reference profiles")
    p.add_argument("--report", action="store_true", help="also write each profile's report/")
    p.add_argument("--check", action="store_true", help="write nothing: list notebooks without "
                   "their figure and exit 1 if there is one")
    args = p.parse_args(argv)
    missing = []
    for profile in args.profiles:
        for path in notebooks(profile):
            shown = path.relative_to(REPO_ROOT)
            if args.check:
                if not report.figure_outputs(path):
                    missing.append(str(shown))
                continue
            size = render(path)
            print(f"{shown}: {size / 1024:.0f} KiB, figure in cell {report.figure_outputs(path)}")
        if args.report and not args.check:
            print(f"wrote {report.build(REFERENCE / profile, title=f'reference run, profile {profile}').relative_to(REPO_ROOT)}")
    if missing:
        print("without their figure:", *missing, sep="\n  ", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
