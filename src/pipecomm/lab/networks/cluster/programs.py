"""The torchrun program of a profile's experiment: what one node runs (``artifact/slurm/node.sh``).

Example::

    >>> from pipecomm.lab.networks.cluster import programs
    >>> programs.program_args("gpu", "E13", "results/gpu/E13", world_size=8, ranks_per_node=4)[:2]
    ['-m', 'pipecomm.lab.experiments.e13_dadam_convergence']
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

__all__ = ["experiment_module", "profile_args", "program_args"]


def experiment_module(experiment: str) -> str:
    """Module name of an experiment id (``"E13"`` -> ``pipecomm.lab.experiments.e13_...``).

    Example::

        >>> experiment_module("E0")
        'pipecomm.lab.experiments.e00_calibrate'
    """
    m = re.fullmatch(r"E(\d+)", str(experiment))
    found = sorted((Path(__file__).parents[2] / "experiments").glob(
        f"e{int(m.group(1)):02d}_*.py")) if m else []
    if not found:
        raise ValueError(f"experiment={experiment!r} is not an experiment id like 'E13'")
    return f"pipecomm.lab.experiments.{found[0].stem}"


def profile_args(profile: str, experiment: str) -> list[str]:
    """``-p NAME=VALUE`` arguments of ``experiment`` in ``artifact/profiles/<profile>.yaml``.

    Example::

        >>> profile_args("gpu", "E13")[:2]   # ['-p', 'backend=nccl', '-p', 'world_size=4', ...]
        ['-p', 'backend=nccl']
    """
    import yaml

    path = Path(__file__).resolve().parents[5] / "artifact" / "profiles" / f"{profile}.yaml"
    if not path.exists():
        raise ValueError(f"profile={profile!r}: no file {path.name} in artifact/profiles")
    exps = yaml.safe_load(path.read_text())["experiments"]
    if experiment not in exps:
        raise ValueError(f"experiment={experiment!r} is not in profile {profile!r}: {sorted(exps)}")
    out = []
    for name, value in (exps[experiment].get("params") or {}).items():
        out += ["-p", f"{name}={value if isinstance(value, str) else repr(value)}"]
    return out


def program_args(
    profile: str,
    experiment: str,
    out: str,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    overrides: Sequence[str] = (),
) -> list[str]:
    """torchrun's program for one experiment of a profile: ``-m <module> --out <out>``, the
    profile's parameters, the job's ``world_size`` / ``ranks_per_node`` where the experiment
    has them, then ``overrides`` (``-p NAME=VALUE`` items; the last value of a name wins).

    Example::

        >>> argv = program_args("gpu", "E13", "results/gpu/E13", world_size=8, ranks_per_node=4)
        >>> argv[:4], argv[-4:]
        (['-m', 'pipecomm.lab.experiments.e13_dadam_convergence', '--out', 'results/gpu/E13'], ['-p', 'world_size=8', '-p', 'ranks_per_node=4'])
    """
    import importlib

    module = experiment_module(experiment)
    defaults = importlib.import_module(module).DEFAULTS
    args = ["-m", module, "--out", str(out), *profile_args(profile, experiment)]
    for name, value in (("world_size", world_size), ("ranks_per_node", ranks_per_node)):
        if value is not None and name in defaults:
            args += ["-p", f"{name}={int(value)}"]
    return args + list(overrides)
