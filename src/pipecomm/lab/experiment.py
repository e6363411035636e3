"""What an experiment is: the one shape every ``pipecomm.lab.experiments.eNN_*`` module follows.

An experiment module defines, in this order:

* ``ID`` (``"E3"``) and ``NOTEBOOK`` (the notebook's file stem under notebooks/);
* ``Params``, a frozen dataclass subclassing :class:`Params`: every parameter with its type and
  its quick default (the notebook's parameters cell), and ``validate()`` raising ``ValueError``
  that names the parameter; ``DEFAULTS = Params.defaults()`` (the plain dict the notebook, the
  command line and the profiles use);
* ``run(**params) -> pandas.DataFrame``: ``params = Params.make(**params)`` first (unknown
  names, wrong types and bad values fail before any rank starts; read by attribute,
  ``params.iters``), then the measurement; a tidy frame, one row per measured point, with every
  repeat of a timed point (``times_s``) and the network it ran on;
* ``summary(df)`` (the notebook's table) and ``plot(df, **params)`` (its figure);
* its claims' checks, registered with :func:`pipecomm.lab.claims.check` (thresholds come from
  artifact/claims.yaml only);
* ``if __name__ == "__main__": main(sys.modules[__name__])`` (the command line).

Experiments never import each other: what two share is a lab module of one concept
(docs/experiments.md, "The shape of an experiment", lists them). :func:`check_module` verifies
the shape (tests run it on every module).

Example::

    >>> from dataclasses import dataclass, field
    >>> from pipecomm.lab import experiment
    >>> @dataclass(frozen=True)
    ... class Params(experiment.Params):
    ...     world_sizes: list[int] = field(default_factory=lambda: [2, 4])
    ...     iters: int = 10
    ...
    ...     def validate(self) -> None:
    ...         if self.iters < 1:
    ...             raise ValueError(f"parameter iters must be >= 1, got {self.iters}")
    >>> DEFAULTS = Params.defaults()
    >>> params = Params.make(iters=5)
    >>> params.iters, params.asdict()["iters"]
    (5, 5)
    >>> Params.make(iters=0)
    Traceback (most recent call last):
    ValueError: parameter iters must be >= 1, got 0
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

__all__ = ["Params", "check_module"]

P = TypeVar("P", bound="Params")


def _conforms(value: Any, hint: Any) -> bool:
    """Whether ``value`` fits the annotation ``hint`` (int fits float; bool fits only bool)."""
    if hint is Any:
        return True
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_conforms(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)):
            return False
        return not args or args[0] is Ellipsis or all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True


@dataclasses.dataclass(frozen=True)
class Params:
    """Base of every experiment's parameters (see the module docstring).

    Subclasses are frozen dataclasses read by attribute (``params.iters``); :meth:`asdict` gives
    the plain dict that goes to params.json and to the ranks.
    """

    def validate(self) -> None:
        """Check value ranges and combinations; raise ValueError naming the parameter."""

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """The quick configuration as a plain dict (the notebook's parameters cell).

        Example::

            >>> from pipecomm.lab.experiments.e03_collectives_vs_ranks import Params
            >>> Params.defaults()["iters"]
            2
        """
        return dataclasses.asdict(cls())

    @classmethod
    def make(cls: type[P], **params: Any) -> P:
        """The defaults updated with ``params``: unknown names, values of the wrong type and
        values ``validate()`` refuses are a ValueError that names the parameter.

        Example::

            >>> from pipecomm.lab.experiments.e03_collectives_vs_ranks import Params
            >>> Params.make(iters=5).iters
            5
            >>> Params.make(iters="5")
            Traceback (most recent call last):
            ValueError: parameter iters='5' has the wrong type: expected int like the default 2
        """
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(params) - set(names))
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown}; known: {sorted(names)}")
        hints = typing.get_type_hints(cls)
        for name, value in params.items():
            if not _conforms(value, hints[name]):
                default = cls.defaults()[name]
                raise ValueError(f"parameter {name}={value!r} has the wrong type: expected "
                                 f"{_show(hints[name])} like the default {default!r}")
        made = cls(**params)
        made.validate()
        return made

    def asdict(self) -> dict[str, Any]:
        """The parameters as a plain dict (params.json, the ranks).

        Example::

            >>> from pipecomm.lab.experiments.e03_collectives_vs_ranks import Params
            >>> Params.make().asdict()["world_sizes"]
            [2, 3, 4]
        """
        return dataclasses.asdict(self)


def _show(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def check_module(module: types.ModuleType) -> None:
    """Raise AssertionError unless ``module`` follows the experiment shape.

    Example::

        >>> import importlib
        >>> check_module(importlib.import_module("pipecomm.lab.experiments.e03_collectives_vs_ranks"))
    """
    name = module.__name__
    for attr in ("ID", "NOTEBOOK", "Params", "DEFAULTS", "run", "summary", "plot"):
        assert hasattr(module, attr), f"{name} lacks {attr}"
    assert isinstance(module.Params, type) and issubclass(module.Params, Params), \
        f"{name}.Params must subclass pipecomm.lab.experiment.Params"
    assert module.Params.__dataclass_params__.frozen, f"{name}.Params must be frozen"
    assert isinstance(module.DEFAULTS, Mapping) and dict(module.DEFAULTS) == \
        module.Params.defaults(), f"{name}.DEFAULTS must be Params.defaults()"
    module.Params.make()  # the defaults validate
