"""Run a training script that cannot be edited on pipecomm's backend.

``python -m pipecomm.run [--algorithm A] [--compression C] [--block-bytes B] SCRIPT [ARGS...]``
imports :mod:`pipecomm.backend` (which registers the ``torch.distributed`` backend name
``"pipecomm"``), sets what the options name in the environment (``PIPECOMM_ALGORITHM``,
``PIPECOMM_COMPRESSION``, ``PIPECOMM_BLOCK_BYTES``: the options of a group made by
``init_process_group(backend="pipecomm")``), and runs ``SCRIPT`` as ``__main__`` with
``sys.argv = [SCRIPT, *ARGS]`` (``-m MODULE`` runs a module instead, as ``python -m`` does). A
script that calls ``dist.init_process_group(backend=...)`` with a backend it takes from its
command line or environment then runs on pipecomm unchanged; one that hard-codes
``backend="gloo"`` still runs on gloo (the group's AllReduce is then gloo's).

Under torchrun (every rank)::

    torchrun --standalone --nproc-per-node 2 -m pipecomm.run --algorithm ring \\
        train.py --backend pipecomm --lr 3e-4

Example (in Python)::

    from pipecomm import run
    run.main(["--algorithm", "lp", "train.py", "--backend", "pipecomm"])
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from pipecomm import vocab

__all__ = ["main", "parse_args"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, then ``SCRIPT`` (or ``-m MODULE``) and its arguments, untouched.

    Example::

        >>> parse_args(["--algorithm", "ring", "train.py", "--lr", "3"]).args
        ['--lr', '3']
    """
    p = argparse.ArgumentParser(
        prog="python -m pipecomm.run",
        description="Run SCRIPT as __main__ with pipecomm's torch.distributed backend imported.",
    )
    p.add_argument("--algorithm", choices=vocab.ALGORITHM_CHOICES, default=None,
                   help=f"PIPECOMM_ALGORITHM (default: {vocab.DEFAULT_ALGORITHM})")  # fmt: skip
    p.add_argument("--compression", choices=vocab.CODECS, default=None,
                   help="PIPECOMM_COMPRESSION (lp / ring only; default none)")  # fmt: skip
    p.add_argument("--block-bytes", type=int, default=None,
                   help="PIPECOMM_BLOCK_BYTES (LP block; default the cost model's optimum)")  # fmt: skip
    p.add_argument("-m", dest="module", action="store_true",
                   help="SCRIPT is a module name (as python -m)")  # fmt: skip
    p.add_argument("script", help="the training script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    args = p.parse_args(argv)
    if args.compression is not None:
        algorithm = args.algorithm or os.environ.get("PIPECOMM_ALGORITHM") or vocab.DEFAULT_ALGORITHM
        try:
            vocab.check_compression(args.compression, algorithm=algorithm)
        except ValueError as exc:
            p.error(f"--compression: {exc}")
    if args.block_bytes is not None and args.block_bytes <= 0:
        p.error(f"--block-bytes must be a positive number of bytes, got {args.block_bytes}")
    return args


def main(argv: list[str] | None = None) -> None:
    """Set the environment, import the backend, run the script as ``__main__``.

    Example::

        main(["--algorithm", "ring", "train.py"])
    """
    args = parse_args(argv)
    # here, not at the top: --help and argument errors answer without torch's import (seconds)
    from pipecomm import backend  # registers the backend name "pipecomm"

    for env, value in (
        (backend.ENV_ALGORITHM, args.algorithm),
        (backend.ENV_COMPRESSION, args.compression),
        (backend.ENV_BLOCK_BYTES, args.block_bytes),
    ):
        if value is not None:
            os.environ[env] = str(value)
    sys.argv = [args.script, *args.args]
    if args.module:
        runpy.run_module(args.script, run_name="__main__", alter_sys=True)
        return
    if not os.path.isfile(args.script):
        raise SystemExit(f"python -m pipecomm.run: no such script: {args.script}")
    sys.path.insert(0, os.path.dirname(os.path.abspath(args.script)))  # as `python SCRIPT`
    runpy.run_path(args.script, run_name="__main__")


if __name__ == "__main__":
    main()
