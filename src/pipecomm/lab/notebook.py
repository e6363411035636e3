"""What a notebook calls: its parameters, the run (or a finished run's data), saving, its tables
and the verdicts of its experiment's claims. Public and small, so that a notebook reads as the
science: parameters, plan, table, figure, verdicts.

Importing it sets the inline figure resolution of the notebook (:data:`INLINE_DPI`): the figure
shows in the executed notebook at a modest size; ``figure.png`` beside it keeps its own, and a
saved figure shows as that file (:func:`show_saved`), drawn once for both.

Example (the cells of every notebook under notebooks/)::

    from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
    from pipecomm.lab import notebook as nb

    params = nb.parameters(globals(), E)
    df = nb.load_or_run(E, params, data_csv)
    fig = E.plot(df, **params)
    nb.save(E, out_dir, df, fig, params)
    nb.verdicts(E, df)
"""

from __future__ import annotations

import html
import os
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import matplotlib as mpl
import pandas as pd

from pipecomm.lab import claims, cli, results
from pipecomm.lab.cli import notebook_params

__all__ = ["load_or_run", "parameters", "per_task", "save", "show_saved", "table", "titled",
           "verdicts"]

NOTEBOOKS = results.REPO_ROOT / "notebooks"
#: Resolution of the figure a notebook shows inline (figure.png is saved at its own, 120 dpi).
INLINE_DPI = 80
mpl.rcParams["figure.dpi"] = INLINE_DPI


def parameters(namespace: Mapping[str, Any], module: ModuleType) -> dict[str, Any]:
    """The notebook's parameters (the names of ``module.DEFAULTS``) from its globals, each
    checked against the type of its default.

    Example::

        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> notebook_globals = dict(E.DEFAULTS, iters=3)         # globals() after the parameters cell
        >>> params = parameters(notebook_globals, E)
        >>> params["iters"], params["op"]
        (3, 'broadcast')
    """
    return notebook_params(namespace, module)


def data_path(data_csv: str | os.PathLike) -> Path:
    """Where a notebook's ``data_csv`` points: a relative path is read from the notebooks'
    directory (where the notebook is, and what ``out_dir = "../results/cpu/E4"`` is relative
    to), whatever the kernel's working directory.

    Example::

        >>> data_path("../artifact/reference/cpu/E3") == results.REPO_ROOT / "artifact/reference/cpu/E3"
        True
    """
    path = Path(data_csv).expanduser()
    return path if path.is_absolute() else (NOTEBOOKS / path).resolve()


def load_or_run(module: ModuleType, params: Mapping[str, Any],
                data_csv: str | os.PathLike | None = None) -> pd.DataFrame:
    """A finished run's data.csv when ``data_csv`` is given (relative to the notebook,
    :func:`data_path`; a wrong path is "no such file"), else ``module.run(**params)``.

    Example::

        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> df = load_or_run(E, E.DEFAULTS, "../artifact/reference/cpu/E3")   # plot, no run
        >>> len(df) > 0
        True
    """
    return cli.load_or_run(module, params, str(data_path(data_csv)) if data_csv else None)


def titled(fig: Any, module: ModuleType) -> Any:
    """``fig`` with the experiment's title ("E8 — Pipe-SGD iteration-time breakdown: ...", the
    first line of ``module``'s docstring) above it when its plot gave it none.

    Example::

        >>> import matplotlib.pyplot as plt
        >>> from pipecomm.lab.experiments import e08_pipesgd_breakdown as E
        >>> titled(plt.figure(), E).get_suptitle().startswith("E8 — Pipe-SGD")
        True
    """
    if fig is None or fig.get_suptitle():
        return fig
    fig.suptitle((module.__doc__ or module.ID).strip().splitlines()[0].rstrip("."), fontsize=9)
    if not fig.get_constrained_layout():
        fig.tight_layout()
    return fig


def save(module: ModuleType, out_dir: Any, df: pd.DataFrame, fig: Any = None,
         params: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> Any:
    """Write the run's files to ``out_dir`` (nothing when it is None;
    :func:`pipecomm.lab.cli.save`), the figure titled "EN — ..." first (:func:`titled`) and, in
    a rehearsal of the gpu profile, marked as one (:func:`pipecomm.lab.rehearsal.mark_figure`).

    Example::

        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> save(E, None, pd.DataFrame({"time_s": [0.1]}), None, E.DEFAULTS) is None
        True
    """
    from pipecomm.lab import standin

    fig = titled(fig, module)
    if standin.active():  # a rehearsal's figure says so (pipecomm.lab.rehearsal)
        from pipecomm.lab import rehearsal

        fig = rehearsal.mark_figure(fig)
    out = cli.save(module, out_dir, df, fig, params, extra)
    if out is not None and fig is not None:
        show_saved(fig, Path(out) / "figure.png")
    return out


def show_saved(fig: Any, png: Path) -> bool:
    """In a notebook kernel, show ``fig`` as the ``png`` just saved, at the inline size
    (:data:`INLINE_DPI`), and close it: the inline backend would draw it once more. Elsewhere
    (a script, a test) nothing; returns whether it showed.

    Example::

        >>> import matplotlib.pyplot as plt
        >>> show_saved(plt.figure(), Path("figure.png"))   # not in a kernel
        False
    """
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    if get_ipython() is None or not png.is_file():
        return False
    import matplotlib.pyplot as plt
    from IPython.display import Image, display

    data = png.read_bytes()
    pixels = int.from_bytes(data[16:20], "big")  # the PNG header's width
    plt.close(fig)
    display(Image(data=data, format="png", width=round(pixels * INLINE_DPI / results.FIGURE_DPI)))
    return True


class Note:
    """One line a notebook shows in place of a table (why it is empty).

    Example::

        Note("no learning-rate sweep: every grid held one rate")
    """

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def _repr_html_(self) -> str:
        return f"<p><em>{html.escape(self.text)}</em></p>"


def table(frame: pd.DataFrame, empty: str) -> pd.DataFrame | Note:
    """``frame``, or the one line ``empty`` saying why there is nothing to show when it has no
    rows or no columns.

    Example::

        >>> table(pd.DataFrame(), "no learning-rate sweep in this run (one rate per grid)")
        no learning-rate sweep in this run (one rate per grid)
    """
    return Note(empty) if frame.empty or frame.shape[1] == 0 else frame


class Tables:
    """Several titled tables shown one after the other (HTML in JupyterLab, text elsewhere).

    Example::

        Tables({"digits": df1, "lm": df2})
    """

    def __init__(self, parts: Mapping[str, pd.DataFrame]) -> None:
        self.parts = dict(parts)

    def __repr__(self) -> str:
        return "\n\n".join(f"{k}:\n{v.to_string()}" for k, v in self.parts.items())

    def _repr_html_(self) -> str:
        return "".join(f"<h4>{html.escape(str(k))}</h4>{v.to_html()}"
                       for k, v in self.parts.items())


def per_task(frame: pd.DataFrame, level: int | str = 0) -> Tables | pd.DataFrame:
    """A wide table indexed by task (its first index level) as one table per task, each without
    the columns that are empty for it (a table of two tasks with their own metrics is otherwise
    half NaN).

    Example::

        >>> wide = pd.DataFrame({"acc": [0.9, None], "loss": [None, 2.3]},
        ...                     index=pd.MultiIndex.from_tuples([("digits", 0), ("lm", 0)]))
        >>> print(per_task(wide))
        digits:
           acc
        0  0.9
        <BLANKLINE>
        lm:
           loss
        0   2.3
    """
    if frame.empty or not isinstance(frame.index, pd.MultiIndex):
        return frame
    keys = frame.index.get_level_values(level).unique()
    return Tables({k: frame.xs(k, level=level).dropna(axis=1, how="all") for k in keys})


def verdicts(module: ModuleType, df: pd.DataFrame) -> claims.VerdictTable:
    """The claims of ``module``'s experiment (artifact/claims.yaml) evaluated on ``df``, with the
    prediction computed from the parameters that ran, what was measured with its interval, the
    threshold, PASS / FAIL / INCONCLUSIVE and why, every cell in full
    (:func:`pipecomm.lab.claims.experiment_verdicts`; an illustration shows no verdict, a check that
    cannot run on this data shows ERROR with the reason). In a rehearsal of the gpu profile
    every verdict is withheld (:func:`pipecomm.lab.rehearsal.withhold`).

    Example::

        >>> from pipecomm.lab import results
        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> df = results.load_csv(results.REPO_ROOT / "artifact/reference/cpu/E3")
        >>> table = verdicts(E, df)[["claim", "measured", "threshold", "verdict", "why"]]
        >>> all(c.startswith("C3.") for c in table["claim"])
        True
    """
    from pipecomm.lab import standin

    table = claims.experiment_verdicts(module.ID, df)
    if standin.active():  # a rehearsal decides nothing: REHEARSED or NOT DECIDED
        from pipecomm.lab import rehearsal

        table = claims.VerdictTable(rehearsal.withhold(table))
    return table
