"""benchmarks/plot_shaped.py draws the shaped-network figures from the committed CSVs and refuses
input it cannot draw."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import scripts

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "plot_shaped.py"
BENCH = ROOT / "artifact" / "reference" / "shaped-bench"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120)


def test_figures_from_the_reference_csvs(tmp_path):
    proc = _run("--collectives", str(BENCH / "collectives_sweep_15M.csv"), "--training",
                str(BENCH / "training_15M.csv"), "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    for name in ("collectives.png", "training.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def _main(capsys, *args: str) -> tuple[int, str]:
    """The script's ``main`` in this process: (exit code, stderr)."""
    code, _, err = scripts.call_main(scripts.load("benchmarks/plot_shaped.py").main, list(args),
                                     capsys)
    return code, err


def test_bad_input_is_one_line(tmp_path, capsys):
    code, err = _main(capsys, "--training", str(tmp_path / "none.csv"), "--out", str(tmp_path))
    assert code == 2 and "none.csv: no such file" in err
    no_ddp = tmp_path / "t.csv"
    no_ddp.write_text("strategy,seed,step_ms,tx_bytes_per_rank_step,error\nlp,0,1.0,5.0,\n")
    code, err = _main(capsys, "--training", str(no_ddp), "--out", str(tmp_path))
    assert code == 2 and "no stock DDP rows" in err
    assert len(err.strip().splitlines()) == 1
    assert _main(capsys, "--out", str(tmp_path))[0] == 2
