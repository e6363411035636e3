"""The rehearsal of the gpu profile (``./run_all.sh --profile gpu --rehearse``): its parameters,
its stand-ins, its withheld verdicts, its refusals, and one experiment run end to end.

The whole rehearsal (every gpu experiment) takes minutes; the end-to-end test here runs E7, the
experiment that reaches every stand-in (NCCL's ranks on gloo, the CIFAR-10 stand-in fetched and
verified, the notebook, its claims), and ``test_every_gpu_experiment_is_rehearsed`` checks that
every other one's rehearsed parameters pass its experiment's checks.
"""

from __future__ import annotations

import json
import os
import re

import nbformat
import pandas as pd
import pytest

from pipecomm.lab import artifact, execute, profiles, rehearsal, standin
from pipecomm.lab.networks import launch
from pipecomm.lab.workloads import data, download


def _main(*argv: str) -> int:
    with pytest.raises(SystemExit) as info:
        artifact.main(list(argv))
    return info.value.code


def test_every_gpu_experiment_is_rehearsed(monkeypatch):
    """Every experiment of the gpu profile, with parameters its checks accept (NCCL's on
    stand-in GPUs): world sizes at most the stand-in GPUs, NCCL kept, CIFAR-10 read from the
    rehearsal's folder, and every replaced parameter recorded with its gpu value."""
    gpu = profiles.load_profile("gpu", profiles.discover())
    rehearsed = profiles.load_profile(rehearsal.NAME, profiles.discover())
    assert list(rehearsed) == list(gpu)
    monkeypatch.setenv(standin.ENV, "unused.json")
    for eid, exp in rehearsed.items():
        profiles.check_params([exp], {})  # NCCL's own checks, on the stand-in GPUs
        params, before = profiles.run_params(exp), profiles.run_params(gpu[eid])
        assert set(params) == set(before)
        for name, entry in exp.replaced.items():
            assert entry["gpu"] == before[name] and entry["rehearsal"] == params[name], name
        changed = {k for k in params if params[k] != before[k]}
        assert changed <= set(exp.replaced), eid  # nothing replaced silently
        if eid in rehearsal.ANALYTIC:  # no ranks: its world sizes are the model's
            continue
        for key in ("world_size", "host_world_size"):
            assert params.get(key, 0) <= standin.GPUS
        for key in ("world_sizes", "real_world_sizes"):
            assert all(p <= standin.GPUS for p in params.get(key, []))
        if before.get("backend") == "nccl":
            assert params["backend"] == "nccl" and "backend" in exp.replaced
        if before.get("dataset") == "cifar10":
            assert params["data_root"] == f"results/{rehearsal.NAME}/data"
        assert exp.budget_s <= rehearsal.BUDGET_S
    assert rehearsed["E1"].replaced == {}  # analytic: the profile's own parameters


def test_a_numeric_parameter_without_a_rule_is_one_line(monkeypatch, capsys):
    """The rehearsal cannot tell a size from a rate: a number without a rule is an error, never
    kept or dropped silently; a string without one is kept."""
    with pytest.raises(rehearsal.RehearsalError, match="E5: parameter new_knob=3 has no rehearsal"):
        rehearsal.rehearse("E5", {"new_knob": 3})
    assert rehearsal.rehearse("E5", {"new_mode": "fast"})[0] == {"new_mode": "fast"}
    with pytest.raises(rehearsal.RehearsalError, match="dataset='mnist' has no stand-in"):
        rehearsal.rehearse("E7", {"dataset": "mnist"})
    monkeypatch.delitem(rehearsal.RULES, "world_size")  # the whole profile is derived first
    assert _main("--rehearse", "--list", "--only", "E4") == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "E2: parameter world_size=4 has no rehearsal rule" in lines[0]


@pytest.mark.parametrize(("argv", "words"), [
    (["--rehearse", "--profile", "cpu"], "--rehearse rehearses the gpu profile only"),
    (["--profile", "shaped", "--rehearse", "--list"], "not --profile shaped"),
    (["--rehearse", "--report", "--reference"], "never a reference"),
    (["--rehearse", "--save-reference"], "never a reference"),
    (["--rehearse", "--runs", "2"], "it takes no --runs"),
])
def test_bad_use_of_rehearse_is_one_line(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(execute, "ensure_kernel", lambda: pytest.fail("a kernel was started"))
    assert _main(*argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines
    assert standin.ENV not in os.environ


def test_the_cifar10_stand_in_goes_through_the_real_loader(tmp_path, monkeypatch):
    """fetch verifies the stand-in's archive and every batch with its own checksums (in the
    rehearsal's folder only), extracts it; load_cifar10 reads the official format."""
    root = tmp_path / "data"
    entry = rehearsal.write_cifar10_standin(root, per_batch=20, test=30)
    assert rehearsal.write_cifar10_standin(root, per_batch=20, test=30) == entry  # same bytes
    assert sorted(p.name for p in root.iterdir()) == ["cifar-10-python.tar.gz"]
    manifest = tmp_path / "rehearsal.json"
    manifest.write_text(json.dumps({"datasets": {"cifar10": entry}}))
    assert download._cifar10_checksums(root)[0] == download._CIFAR10_ARCHIVE  # no rehearsal
    monkeypatch.setenv(standin.ENV, str(manifest))
    assert download._cifar10_checksums(tmp_path / "other")[0] == download._CIFAR10_ARCHIVE
    folder = data.fetch("cifar10", root)
    assert folder == root / download.CIFAR10_DIR
    assert sorted(p.name for p in folder.iterdir()) == [
        "batches.meta", "data_batch_1", "data_batch_2", "data_batch_3", "data_batch_4",
        "data_batch_5", "test_batch"]
    X, y = data.load_dataset("cifar10", root=root, split="train")
    Xt, yt = data.load_dataset("cifar10", root=root, split="test")
    assert X.shape == (100, 3, 32, 32) and Xt.shape == (30, 3, 32, 32) and len(yt) == 30
    assert abs(float(X.mean())) < 1.5 and set(y.tolist()) <= set(range(10))
    (folder / "data_batch_3").write_bytes(b"damaged")  # a damaged batch: extracted again
    data.fetch("cifar10", root)
    assert download.file_digest(folder / "data_batch_3", "md5") == entry["files"][
        "data_batch_3"][1]


def test_stand_ins_only_while_a_rehearsal_runs(monkeypatch):
    monkeypatch.delenv(standin.ENV, raising=False)
    assert standin.process_backend("nccl") == "nccl" and standin.gpu_count() is None
    monkeypatch.setenv(standin.ENV, "x.json")
    assert standin.process_backend("nccl") == "gloo" and standin.process_backend("gloo") == "gloo"
    assert launch.gpu_count() == standin.GPUS and standin.checksums("cifar10", ".") is None
    launch.check_gpus(standin.GPUS)
    with pytest.raises(ValueError, match=f"needs {standin.GPUS + 1} visible GPUs"):
        launch.check_gpus(standin.GPUS + 1)


def test_a_rehearsal_shows_no_verdict():
    table = pd.DataFrame({
        "claim": ["C1", "C2", "C3", "C4", "C5", "C6"],
        "experiment": ["E7", "E7", "E7", "E9", "E1", "E4"],
        "verdict": ["PASS", "FAIL", "INCONCLUSIVE", "ERROR", "MODEL (no verdict)", "NOT RUN"],
        "measured": ["1.2 [1.1, 1.3]", "0.5", "1 [0, inf]", "", "", ""],
        "why": ["measured meets the threshold (x)", "misses", "unbounded",
                "the check cannot run on this data: KeyError: 'x'", "", "E4 has no data.csv"]})
    shown = rehearsal.withhold(table, ran={"E7", "E9", "E1"})
    assert list(shown.verdict) == ["REHEARSED"] * 3 + ["NOT DECIDED", "REHEARSED", "NOT DECIDED"]
    assert not shown.why.str.contains("meets|misses").any()
    assert "KeyError" in shown.why.iloc[3]  # what the rehearsal found is kept
    assert shown.measured.iloc[0] == "(rehearsal) 1.2 [1.1, 1.3]"
    from pipecomm.lab import claims

    assert claims.count_line(shown) == "4 REHEARSED, 2 NOT DECIDED"


def _gpu_e7_on(world_size: int):
    """``profiles.read_profile`` whose gpu profile runs E7 on ``world_size`` ranks."""
    read = profiles.read_profile

    def patched(name: str) -> dict:
        spec = read(name)
        if name == "gpu":
            spec["experiments"]["E7"]["params"]["world_size"] = world_size
        return spec

    return patched


def test_the_rehearsal_of_e7_runs_end_to_end(tmp_path, monkeypatch, capsys):
    """``--rehearse --only E7``: NCCL's code path on gloo ranks, the CIFAR-10 stand-in fetched
    and read, the notebook, figure and claims, all in results/gpu-rehearsal/ and all saying it
    decides nothing; a second run reuses the result (its inputs, the stand-in's files, as it
    read them). On 2 ranks instead of the profile's 8 (a quarter of the time on 2 cores; the
    rehearsal's cap at the stand-in GPUs is test_every_gpu_experiment_is_rehearsed's)."""
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    monkeypatch.setattr(profiles, "read_profile", _gpu_e7_on(2))
    assert artifact.main(["--profile", "gpu", "--rehearse", "--only", "E7"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(rehearsal.BANNER) and text.rstrip().endswith("(rehearsal)")
    assert "E7: done in" in text and "PASS" not in text and "FAIL" not in text
    assert not (tmp_path / "gpu").exists() and standin.ENV not in os.environ
    base = tmp_path / rehearsal.NAME
    out = base / "E7"
    env = json.loads((out / "env.json").read_text())
    assert env["profile"] == rehearsal.NAME and env["rehearsal"]["decides_nothing"] is True
    replaced = env["rehearsal"]["replaced"]
    assert replaced["seeds"] == {"gpu": [0, 1, 2, 3, 4], "rehearsal": [0, 1],
                                 "rule": "the first 2"}
    assert replaced["backend"]["gpu"] == "nccl" and "gloo" in replaced["backend"]["rule"]
    params = json.loads((out / "params.json").read_text())
    assert params["backend"] == "nccl" and params["data_root"] == str(base / "data")
    df = pd.read_csv(out / "data.csv")
    assert set(df.network.dropna()) == {"real"} and set(df.backend.dropna()) == {"nccl"}  # NCCL's
    assert (df.kind == "sweep").any()  # the rate selection ran, on the stand-in too
    assert (base / "data" / download.CIFAR10_DIR / "test_batch").is_file()  # fetched, verified
    verdicts = "".join(o.get("data", {}).get("text/plain", "") for o in
                       nbformat.read(out / "notebook.ipynb", 4).cells[-1].outputs)
    assert "REHEARSED" in verdicts and not re.search(r"\b(PASS|FAIL|INCONCLUSIVE)\b", verdicts)
    claims_md = (base / "claims.md").read_text()
    assert claims_md.startswith(f"# Claims, {rehearsal.BANNER}")
    assert "## What the rehearsal replaced" in claims_md
    table = pd.read_csv(base / "claims.csv").fillna("")
    mine = table[table.experiment == "E7"]
    assert len(mine) and set(mine.verdict) <= {rehearsal.REHEARSED, rehearsal.NOT_DECIDED}
    assert set(table.verdict) <= {rehearsal.REHEARSED, rehearsal.NOT_DECIDED}
    assert artifact.main(["--rehearse", "--only", "E7"]) == 0
    assert "E7: current, reused" in capsys.readouterr().out
