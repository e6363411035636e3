"""Every experiment module follows the one shape of pipecomm.lab.experiment, and no
experiment imports another (what two experiments share lives in a library module)."""

import ast
import importlib
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import pipecomm.lab.experiments as pkg
from pipecomm.lab import experiment

MODULES = sorted(i.name for i in pkgutil.iter_modules(pkg.__path__) if i.name[:1] == "e"
                 and i.name[1:3].isdigit())


@pytest.mark.parametrize("name", MODULES)
def test_module_follows_the_shape(name):
    experiment.check_module(importlib.import_module(f"pipecomm.lab.experiments.{name}"))


@pytest.mark.parametrize("name", MODULES)
def test_no_experiment_imports_another(name):
    tree = ast.parse(Path(pkg.__path__[0], f"{name}.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for n in names:
            leaf = n.rsplit(".", 1)[-1]
            assert not (leaf[:1] == "e" and leaf[1:3].isdigit() and leaf != name), (name, n)


@dataclass(frozen=True)
class _P(experiment.Params):
    n: int = 3
    rate: float = 0.5
    names: list[str] = field(default_factory=lambda: ["a"])
    root: str | None = None

    def validate(self) -> None:
        if self.n < 1:
            raise ValueError(f"parameter n must be >= 1, got {self.n}")


def test_params_make_checks_names_types_and_values():
    params = _P.make(n=4, rate=1, root="x")
    assert params.n == 4 and params.rate == 1 and params.asdict()["root"] == "x"
    with pytest.raises(TypeError):
        params["n"]  # read by attribute only
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['m'\]"):
        _P.make(m=1)
    with pytest.raises(ValueError, match="parameter n=2.5 has the wrong type"):
        _P.make(n=2.5)
    with pytest.raises(ValueError, match="parameter n=True"):
        _P.make(n=True)
    with pytest.raises(ValueError, match="names"):
        _P.make(names=["a", 1])
    with pytest.raises(ValueError, match="parameter n must be >= 1"):
        _P.make(n=0)
    assert _P.defaults() == {"n": 3, "rate": 0.5, "names": ["a"], "root": None}
