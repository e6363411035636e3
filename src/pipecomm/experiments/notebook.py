"""What a notebook calls: its parameters, the run (or a finished run's data), saving, and the
verdicts of its experiment's claims. Public and small, so that a notebook reads as the science:
parameters, plan, table, figure, verdicts.

Example (the cells of every notebook under notebooks/)::

    from pipecomm.experiments import e03_collectives_vs_ranks as E
    from pipecomm.experiments import notebook as nb

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

from pipecomm import claims
from pipecomm.experiments._cli import load_or_run, notebook_params, save

__all__ = ["load_or_run", "parameters", "save", "verdicts"]


def parameters(namespace: Mapping[str, Any], module: ModuleType) -> dict[str, Any]:
    """The notebook's parameters (the names of ``module.DEFAULTS``) from its globals, each
    checked against the type of its default.

    Example::

        params = parameters(globals(), E)
    """
    return notebook_params(namespace, module)


def verdicts(module: ModuleType, df: pd.DataFrame) -> pd.DataFrame:
    """The claims of ``module``'s experiment (artifact/claims.yaml) evaluated on ``df``: the
    prediction, what was measured with its interval, the threshold and PASS / FAIL /
    INCONCLUSIVE (an illustration shows no verdict; a check that cannot run on this data, for
    example a quick configuration without the claim's world size, shows ERROR with the reason).

    Example::

        verdicts(E, df)[["claim", "measured", "threshold", "verdict"]]
    """
    rows = []
    for entry in claims.load_claims():
        if entry["experiment"] != module.ID:
            continue
        row = {"claim": entry["id"], "prediction": entry.get("prediction", ""),
               "measured": "", "threshold": "", "verdict": claims.MODEL}
        if entry["kind"] == "claim":
            try:
                v = claims.run_check(entry, df)
                row.update(measured=v.measured, threshold=v.threshold, verdict=v.verdict)
            except Exception as exc:  # shown, not hidden: the table says why
                row.update(measured=f"{type(exc).__name__}: {exc}", verdict=claims.ERROR)
        rows.append(row)
    return pd.DataFrame(rows, columns=["claim", "prediction", "measured", "threshold", "verdict"])
