"""The repository's scripts (benchmarks/, examples/) as modules in the test process, and their
``main(argv)`` called there: refusals and summaries need no process of their own."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load(path: str) -> ModuleType:
    """The script at ``path`` (relative to the repository, e.g. ``"benchmarks/bench_training.py"``)
    as a module named after its file."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def call_main(main: Callable[[list[str]], int], argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` here: (its exit code, a SystemExit's included; stdout; stderr)."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err
