"""Tidy tables of the lock-step models over sizes, rank counts, algorithms and port models, for
notebooks (E1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipecomm.lab.networks.cost.link import (
    LinkModel,
    _check_algorithm,
    _check_link,
    _check_op,
    as_count,
)
from pipecomm.lab.networks.cost.lockstep import collective_time, lp_optimal_block_bytes


def model_table(
    ops: Iterable[str],
    algorithms: Iterable[str],
    sizes: Iterable[int],
    ps: Iterable[int],
    link: LinkModel,
    ports: Iterable[str] | str | None = None,
    block_bytes: int | None = None,
) -> Any:
    """Tidy table of model times over every combination (notebook E1).

    Columns ``op, algorithm, nbytes, p, ports, time_s, block_bytes``; ``block_bytes`` is the LP
    block used (``lp_optimal_block_bytes`` unless ``block_bytes`` is given; capped at the message)
    and ``<NA>`` for the other algorithms. ``ports`` is one port model or several (default: the
    link's); each overrides ``link.ports``.

    Example::

        >>> link = LinkModel(alpha=10e-6, beta=1e-10)
        >>> df = model_table(["broadcast"], ["lp", "mst"], [2**20], [2, 64], link)
        >>> list(df.columns)
        ['op', 'algorithm', 'nbytes', 'p', 'ports', 'time_s', 'block_bytes']
        >>> len(df)
        4
    """
    import pandas as pd

    link = _check_link(link)
    if ports is None:
        ports = [link.ports]
    elif isinstance(ports, str):
        ports = [ports]
    ops, algorithms, sizes, ps, ports = (list(v) for v in (ops, algorithms, sizes, ps, ports))
    for op in ops:
        _check_op(op)
    for alg in algorithms:
        _check_algorithm(alg)
    rows = []
    for port in ports:
        lk = link.with_ports(port)
        for op in ops:
            for alg in algorithms:
                for p in ps:
                    for n in sizes:
                        n_ = as_count(n, "sizes", 0)
                        p_ = as_count(p, "ps", 1)
                        b = None
                        if alg == "lp":
                            b = (
                                lp_optimal_block_bytes(op, n_, p_, lk)
                                if block_bytes is None
                                else min(as_count(block_bytes, "block_bytes", 1), max(n_, 1))
                            )
                        t = collective_time(op, alg, n_, p_, lk, b)
                        rows.append((op, alg, n_, p_, port, t, b))
    df = pd.DataFrame(
        rows, columns=["op", "algorithm", "nbytes", "p", "ports", "time_s", "block_bytes"]
    )
    df["block_bytes"] = df["block_bytes"].astype("Int64")
    return df
