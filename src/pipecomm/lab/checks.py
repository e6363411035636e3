"""Parameter checks of the experiments: a bad value is a ValueError that names the parameter.

No paper equation: the validation helpers every ``Params.validate()`` of E5-E13 uses (one message
shape, ``parameter NAME=VALUE: WHAT``), so that a run fails before any rank starts.

Example::

    >>> import types
    >>> from pipecomm.lab import checks as C
    >>> self = types.SimpleNamespace(iterations=10, batch_size=32, skip=12)   # a Params
    >>> C.positive_int(self, "iterations", "batch_size")      # in a Params.validate()
    >>> C.require(0 <= self.skip < self.iterations, "skip", self.skip, "must be below iterations")
    Traceback (most recent call last):
    ValueError: parameter skip=12: must be below iterations
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pipecomm.lab.experiment import Params

__all__ = ["check_int", "check_world_sizes", "positive_float", "positive_int", "require"]


def require(cond: bool, name: str, value: Any, what: str) -> None:
    """Raise ``ValueError("parameter NAME=VALUE: WHAT")`` unless ``cond``.

    Example::

        >>> world_size = 1
        >>> require(world_size >= 2, "world_size", world_size, "needs >= 2 ranks")
        Traceback (most recent call last):
        ValueError: parameter world_size=1: needs >= 2 ranks
    """
    if not cond:
        raise ValueError(f"parameter {name}={value!r}: {what}")


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum`` (numpy integers too, never bools), else a ValueError
    naming the parameter.

    Example::

        >>> check_int("seeds", 0, minimum=0)
        0
    """
    require(
        not isinstance(value, bool)
        and isinstance(value, (int, np.integer))
        and value >= minimum,
        name,
        value,
        f"must be an int >= {minimum}",
    )
    return int(value)


def positive_int(params: Params, *names: str) -> None:
    """Each named parameter of ``params`` must be an int >= 1.

    Example::

        >>> import types
        >>> positive_int(types.SimpleNamespace(world_size=0, iterations=10), "world_size", "iterations")
        Traceback (most recent call last):
        ValueError: parameter world_size=0: must be an int >= 1
    """
    for n in names:
        check_int(n, getattr(params, n))


def positive_float(params: Params, *names: str) -> None:
    """Each named parameter of ``params`` must be a finite number > 0.

    Example::

        >>> import types
        >>> positive_float(types.SimpleNamespace(alpha_s=1e-3, timeout_s=float("inf")), "alpha_s", "timeout_s")
        Traceback (most recent call last):
        ValueError: parameter timeout_s=inf: must be a finite number > 0
    """
    for n in names:
        v = getattr(params, n)
        require(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
            n,
            v,
            "must be a finite number > 0",
        )


def check_world_sizes(name: str, values: Any, ranks_per_node: int) -> list[int]:
    """World sizes: a non-empty list of multiples of ``ranks_per_node`` with a power-of-two
    number of nodes (what every topology of E10-E13 accepts).

    Example::

        >>> check_world_sizes("world_sizes", [4, 8], 2)
        [4, 8]
    """
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(
            f"parameter {name} must be a non-empty list of world sizes, got {values!r}"
        )
    out = []
    for v in values:
        v = check_int(name, v, 2)
        nodes = v // ranks_per_node
        if v % ranks_per_node or nodes & (nodes - 1):
            raise ValueError(
                f"parameter {name}: world size {v} must be {ranks_per_node} ranks per node times "
                f"a power-of-two number of nodes (e.g. {2 * ranks_per_node}, {4 * ranks_per_node})"
            )
        out.append(v)
    return out
