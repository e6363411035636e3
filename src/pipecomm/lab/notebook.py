"""What a notebook calls: its parameters, the run (or a finished run's data), saving, and the
verdicts of its experiment's claims. Public and small, so that a notebook reads as the science:
parameters, plan, table, figure, verdicts.

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

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import pandas as pd

from pipecomm.lab import claims
from pipecomm.lab.cli import load_or_run, notebook_params, save

__all__ = ["load_or_run", "parameters", "save", "verdicts"]


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


def verdicts(module: ModuleType, df: pd.DataFrame) -> claims.VerdictTable:
    """The claims of ``module``'s experiment (artifact/claims.yaml) evaluated on ``df``, with the
    prediction computed from the parameters that ran, what was measured with its interval, the
    threshold and PASS / FAIL / INCONCLUSIVE, every cell in full
    (:func:`pipecomm.lab.claims.experiment_verdicts`; an illustration shows no verdict, a check that
    cannot run on this data shows ERROR with the reason).

    Example::

        >>> from pipecomm.lab import results
        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> df = results.load_csv(results.REPO_ROOT / "artifact/reference/cpu/E3")
        >>> table = verdicts(E, df)[["claim", "measured", "threshold", "verdict"]]
        >>> all(c.startswith("C3.") for c in table["claim"])
        True
    """
    return claims.experiment_verdicts(module.ID, df)
