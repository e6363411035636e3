"""tools/crosscheck_accumadam.py: pipecomm's AccumAdam agrees with the DAdam authors' decent-dp.

The agreement tests install decent-dp (not a pipecomm dependency) with pip into a temporary
directory, as benchmarks/bench_decentdp.py does, and skip with pip's reason when no package
index answers. The argument tests need nothing installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "crosscheck_accumadam.py"


@pytest.fixture(scope="module")
def decent_dp_target() -> Path:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_decentdp import DEFAULT_TARGET, ensure_decent_dp
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    try:
        ensure_decent_dp(DEFAULT_TARGET, timeout_s=180)
    except SystemExit as exc:
        pytest.skip(f"decent-dp cannot be installed here: {exc}")
    return DEFAULT_TARGET


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _diffs(out: str) -> list[tuple[float, float]]:
    """(max |diff|, tolerance) of every comparison line."""
    found = re.findall(r"max \|diff\| (\S+), relative \S+, tolerance (\S+) ->", out)
    return [(float(d), float(t)) for d, t in found]


def test_optimizer_and_complete_topology_agree(decent_dp_target):
    """(a) alone, K = 2, 4, wd 0 and 0.01; (b) p = 2, complete: all agree within tolerance."""
    done = _run("--target", str(decent_dp_target), "--ranks", "2", "--steps", "20")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "all agree" in done.stdout
    diffs = _diffs(done.stdout)
    assert len(diffs) == 8  # 2 K x 2 wd, parts (a) and (b)
    assert all(d <= t for d, t in diffs)
    # the control (torch Adam) is far outside the tolerance: the check can see another rule
    controls = [float(c) for c in re.findall(r"control vs torch Adam (\S+)", done.stdout)]
    assert controls and min(controls) > 100 * max(t for _, t in diffs)


def test_aer_agrees_with_decent_dps_schedule_only(decent_dp_target):
    """(b) p = 4, AER: agree with decent-dp's mixing schedule, disagree with pipecomm's own."""
    common = ["--target", str(decent_dp_target), "--ranks", "4", "--topology",
              "alternating-exp-ring", "--k", "4", "--weight-decay", "0.01", "--steps", "12"]
    done = _run(*common)
    assert done.returncode == 0, done.stdout + done.stderr
    assert all(d <= t for d, t in _diffs(done.stdout))
    own = _run(*common, "--own-schedule")
    assert own.returncode == 1, own.stdout + own.stderr
    assert "DISAGREE" in own.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--steps", "1"], "--steps must be >= 2"),
        (["--k", "0"], "--k must be >= 1"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
        (["--ranks", "1"], "--ranks must be 0"),
        (["--topology", "alternating-exp-ring", "--ranks", "2"], "needs --ranks 4"),
        (["--dtype", "float16"], "--dtype"),
    ],
)
def test_argument_errors(args, message):
    done = _run(*args, timeout=60)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "error:" in last and message in last, done.stderr
    assert done.stdout == ""
