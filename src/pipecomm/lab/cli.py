"""Shared command line and notebook glue for experiment modules.

Every experiment module ``pipecomm.lab.experiments.eNN_name`` follows the shape of
:mod:`pipecomm.lab.experiment` (``ID``, ``NOTEBOOK``, a ``Params`` dataclass and its
``DEFAULTS``, ``run``, ``summary``, ``plot``, its claims' checks) and ends with
``if __name__ == "__main__": main(sys.modules[__name__])`` so it runs without a notebook::

    python -m pipecomm.lab.experiments.e00_calibrate --out results/manual/E0 -p sizes_max=1048576
    torchrun --nproc-per-node 8 -m pipecomm.lab.experiments.e13_dadam_convergence --out DIR \
        -p backend=nccl -p world_size=8

Under torchrun the experiments that measure the real network (E0, E2, E5, E7-E9, E13) run on the
job's ranks (:func:`pipecomm.lab.networks.launch.pool`); the others need the emulated network of local ranks
and say so.
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from pipecomm.lab import results


def parse_value(text: str, default: Any, name: str = "parameter") -> Any:
    """Parse ``text`` to the type of ``default`` (bool, int, float, str, list, dict, None).

    Example::

        >>> parse_value("1048576", 65536) == 1048576
        True
        >>> parse_value("[2, 4]", [2, 4, 8]) == [2, 4]
        True
        >>> parse_value("x", 1, "iters")
        Traceback (most recent call last):
        ValueError: iters='x': expected a int like 1
    """
    if isinstance(default, bool):
        lowered = text.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={text!r}: expected a boolean (true/false)")
    if isinstance(default, str):
        return text
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError) as exc:
        if default is None:
            return text
        raise ValueError(
            f"{name}={text!r}: expected a {type(default).__name__} like {default!r}"
        ) from exc
    if default is None:
        return value
    if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(default, (list, tuple)) and isinstance(value, (int, float, str)):
        value = [value]
    if isinstance(default, (list, tuple)) and isinstance(value, tuple):
        value = list(value)
    if not isinstance(value, type(default)):
        raise ValueError(f"{name}={text!r}: expected a {type(default).__name__} like {default!r}")
    return value


def merge_params(defaults: Mapping[str, Any], overrides: Mapping[str, Any],
                 where: str = "") -> dict[str, Any]:
    """``defaults`` updated with ``overrides``; an unknown name is a ValueError."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {unknown}{where}; known: {sorted(defaults)}"
        )
    return {**defaults, **overrides}


def check_type(name: str, value: Any, default: Any) -> None:
    """Raise ValueError unless ``value`` has the type of ``default`` (int is fine for float)."""
    if default is None or value is None and default is None:
        return
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, (list, tuple)):
        ok = isinstance(value, (list, tuple))
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise ValueError(
            f"parameter {name}={value!r} has the wrong type: expected a "
            f"{type(default).__name__} like the default {default!r}"
        )


def check_backend(backend: Any, world_size: int, *, emulated: bool) -> None:
    """Validate an experiment's ``backend`` parameter: ``"gloo"`` (CPU ranks, cpu profile) or
    ``"nccl"`` (one visible GPU per rank, no emulated network, gpu profile).

    Example::

        >>> check_backend("gloo", 2, emulated=True)
        >>> check_backend("nccl", 2, emulated=True)        # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: the emulated network is a gloo (cpu profile) tool: with backend='nccl' ...
    """
    from pipecomm.lab.networks import launch

    if backend not in ("gloo", "nccl"):
        raise ValueError(f"parameter backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl":
        if emulated:
            raise ValueError(
                "the emulated network is a gloo (cpu profile) tool: with backend='nccl' the "
                "real interconnect is measured; set the emulated network off or use 'gloo'"
            )
        if not launch.under_torchrun():  # torchrun places its ranks on the nodes' GPUs
            launch.check_gpus(world_size)


def notebook_params(namespace: Mapping[str, Any], module: ModuleType) -> dict[str, Any]:
    """Collect a notebook's parameters (the names in ``module.DEFAULTS``) from its globals,
    checking each against the type of its default.

    Example (in a notebook)::

        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> params = notebook_params(dict(E.DEFAULTS, iters=3), E)     # globals()
        >>> params["iters"]
        3
    """
    params = {}
    for name, default in module.DEFAULTS.items():
        if name not in namespace:
            raise ValueError(f"parameter {name!r} is missing from the parameters cell")
        check_type(name, namespace[name], default)
        params[name] = namespace[name]
    return params


def save(module: ModuleType, out_dir: Any, df: Any, fig: Any = None,
         params: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> Any:
    """The module's own ``save`` if it has one (E0 adds calibration.json), else results.save.

    Example (in a notebook)::

        >>> import pandas as pd
        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> out_dir, df, fig, params = None, pd.DataFrame({"time_s": [0.1]}), None, E.DEFAULTS
        >>> save(E, out_dir, df, fig, params) is None   # nothing is written when out_dir is None
        True
    """
    return getattr(module, "save", results.save)(out_dir, df, fig, params, extra)


def load_or_run(module: ModuleType, params: Mapping[str, Any], data_csv: str | None = None):
    """A finished run's data.csv when ``data_csv`` is given, else ``module.run(**params)``.

    Example::

        >>> from pipecomm.lab.experiments import e03_collectives_vs_ranks as E
        >>> path = results.REPO_ROOT / "artifact/reference/cpu/E3"   # results/cpu/E3/data.csv
        >>> df = load_or_run(E, E.DEFAULTS, str(path))                # plot without running
        >>> len(df) > 0
        True
    """
    if data_csv:
        return results.load_csv(data_csv)
    return module.run(**params)


def main(module: ModuleType, argv: list[str] | None = None) -> None:
    """``python -m pipecomm.lab.experiments.<module> --out DIR [-p NAME=VALUE ...]``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {module.__name__}", description=(module.__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", required=True, help="directory for data.csv, figure, env.json")
    parser.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                        help="override a parameter (repeatable)")
    parser.add_argument("--no-plot", action="store_true", help="write data.csv only")
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.param:
        if "=" not in item:
            parser.error(f"-p expects NAME=VALUE, got {item!r}")
        name, text = item.split("=", 1)
        if name not in module.DEFAULTS:
            parser.error(f"unknown parameter {name!r}; known: {sorted(module.DEFAULTS)}")
        overrides[name] = parse_value(text, module.DEFAULTS[name], name)
    params = merge_params(module.DEFAULTS, overrides)
    start = time.perf_counter()
    df = module.run(**params)
    wall = time.perf_counter() - start
    rank = _rank()
    if rank == 0:  # under torchrun only rank 0 writes
        fig = None if args.no_plot else module.plot(df, **params)
        save(module, args.out, df, fig, params, extra={"wall_time_s": wall})
        print(f"{module.ID}: wrote {args.out} ({len(df)} rows, {wall:.1f} s)")
    _leave_job()


def _leave_job() -> None:
    """Under torchrun: wait until rank 0 has written its files, then exit at once. Exiting through
    the interpreter's shutdown (with or without ``destroy_process_group``) aborted a rank in about
    one run of ten here ("terminate called without an active exception" in a backend thread's
    destructor); local pool ranks leave the same way (:mod:`pipecomm.lab.networks.launch`)."""
    from pipecomm.lab.networks import launch

    if launch.under_torchrun():
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _rank() -> int:
    try:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit("run an experiment module, e.g. python -m pipecomm.lab.experiments.e00_calibrate --out DIR")
