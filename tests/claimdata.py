"""Synthetic repeats for claim tests: a timed point's ``times_s`` cell around its median."""

import numpy as np
import pandas as pd

from pipecomm.lab.measure import stats


def repeats_around(median: float, spread: float, n: int = 10) -> str:
    """``n`` repeats spread evenly over ``median * (1 +- spread)`` (median exactly ``median``)."""
    return stats.join_repeats(median * (1 + np.linspace(-spread, spread, n)))


def with_repeats(df: pd.DataFrame, spread: float = 0.01, n: int = 10,
                 col: str = "time_s") -> pd.DataFrame:
    """``df`` with a ``times_s`` column of ``n`` repeats around each row's ``col``."""
    out = df.copy()
    out["times_s"] = [repeats_around(float(t), spread, n) for t in out[col]]
    return out
