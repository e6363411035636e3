"""Argument checks shared by the public entry points, each message written once.

A wrong type raises ``TypeError``, a value out of range ``ValueError``; the message names the
entry point (``where``), the argument and what it must be. No paper equation: bookkeeping.

Example::

    >>> block_bytes(4096, "pipecomm.backend")
    4096
    >>> block_bytes(0, "pipecomm.backend")
    Traceback (most recent call last):
    ...
    ValueError: pipecomm.backend: block_bytes must be a positive int (bytes per LP block) or None, got 0
"""

from __future__ import annotations

import math
import numbers
from typing import Any


def _prefix(where: str) -> str:
    return f"{where}: " if where else ""


def flag(value: Any, name: str, where: str = "") -> bool:
    """``value`` itself once it is ``True`` or ``False``.

    Example::

        >>> flag(True, "async_op")
        True
    """
    if not isinstance(value, bool):
        raise TypeError(f"{_prefix(where)}{name} must be True or False, got {value!r}")
    return value


def positive_int(value: Any, name: str, where: str = "", what: str = "", *,
                 none: bool = False) -> int | None:
    """``value`` once it is an int > 0 (``none``: or ``None``); ``what`` says what it counts.

    Example::

        >>> positive_int(3, "chunk_size")
        3
    """
    if value is None and none:
        return None
    if value is not None and not isinstance(value, bool) and isinstance(value, int) and value > 0:
        return value
    error = TypeError if isinstance(value, bool) or not isinstance(value, int) else ValueError
    what = f" ({what})" if what else ""
    raise error(f"{_prefix(where)}{name} must be a positive int{what}{' or None' if none else ''}"
                f", got {value!r}")


def positive_number(value: Any, name: str, where: str = "", unit: str = "", *,
                    none: bool = False) -> float | None:
    """``value`` as a float once it is a finite real number > 0 (``none``: or ``None``);
    ``unit`` is what it is a number of.

    Example::

        >>> positive_number(2, "timeout_s", unit="seconds")
        2.0
    """
    if value is None and none:
        return None
    real = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if real and math.isfinite(value) and value > 0:
        return float(value)
    of = f" of {unit}" if unit else ""
    raise (ValueError if real else TypeError)(
        f"{_prefix(where)}{name} must be a positive, finite number{of}"
        f"{' or None' if none else ''}, got {value!r}"
    )


def block_bytes(value: Any, where: str = "") -> int | None:
    """LP's block size argument: a positive int of bytes, or ``None`` (the default block,
    :func:`pipecomm.collectives.lp.default_block_bytes`).

    Example::

        >>> block_bytes(None) is None
        True
    """
    return positive_int(value, "block_bytes", where, "bytes per LP block", none=True)


def timeout_s(value: Any, where: str = "") -> float | None:
    """A timeout argument: a positive, finite number of seconds, or ``None``.

    Example::

        >>> timeout_s(1.5)
        1.5
    """
    return positive_number(value, "timeout_s", where, "seconds", none=True)
