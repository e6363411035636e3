"""What the orchestrator survives (docs/survives.md): damaged, stale and half-written results,
changed inputs, bad configuration, SIGTERM, killed runs' debris, a second run, write errors."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml

from pipecomm.lab import artifact, claims, execute, guard, profiles, results, reuse, schema

ROOT = Path(__file__).resolve().parents[1]


def _notebook(path: Path, body: str) -> Path:
    book = nbformat.v4.new_notebook()
    book.metadata["kernelspec"] = {"name": "pipecomm", "language": "python", "display_name": "p"}
    cell = nbformat.v4.new_code_cell("out_dir = None\nrows = 10")
    cell.metadata["tags"] = ["parameters"]
    book.cells = [cell, nbformat.v4.new_code_cell(body)]
    nbformat.write(book, path)
    return path


_WRITES = ("import pathlib\nout = pathlib.Path(out_dir)\n"
           "(out / 'data.csv').write_text('a,b\\n' + ''.join(f'{i},{i * i}\\n' "
           "for i in range(rows)))\n(out / 'figure.png').write_bytes(b'\\x89PNG not really')\n")


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """One real run of a small experiment through papermill, kept as the pristine copy."""
    execute.ensure_kernel()
    tmp = tmp_path_factory.mktemp("finished")
    exp = profiles.Experiment("E98", _notebook(tmp / "98_tiny.ipynb", _WRITES), {"rows": 10},
                              budget_s=30)
    out = tmp / "cpu" / "E98"
    execute.run_experiment(exp, "cpu", {"rows": 10}, out)
    return exp, out


def _copy(finished, tmp_path: Path) -> tuple[profiles.Experiment, Path]:
    exp, out = finished
    mine = tmp_path / "cpu" / "E98"
    shutil.copytree(out, mine)
    return exp, mine


def _state(exp, out: Path) -> str:
    return reuse.result_state(exp, "cpu", out, {"rows": 10})


def test_a_finished_result_records_what_it_consists_of(finished):
    exp, out = finished
    manifest = results.read_json(out / "manifest.json")
    assert set(reuse.REQUIRED) | {"figure.png"} <= set(manifest["files"])
    assert manifest["files"]["data.csv"]["bytes"] == (out / "data.csv").stat().st_size
    assert manifest["rows"] == {"data.csv": 10} and manifest["inputs"] == {}
    assert _state(exp, out) == "current"


def _cut_to_lines(path: Path, n: int) -> None:
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:n]))


DAMAGE = {  # what happened to the result -> the words its one line must hold
    "data cut to 5 lines": (lambda o: _cut_to_lines(o / "data.csv", 5), "data.csv has"),
    "data cut mid-row": (lambda o: o.joinpath("data.csv").write_bytes(
        o.joinpath("data.csv").read_bytes()[:-3]), "data.csv has"),
    "data empty": (lambda o: o.joinpath("data.csv").write_text(""), "data.csv has 0 bytes"),
    "data random bytes": (lambda o: o.joinpath("data.csv").write_bytes(
        os.urandom(o.joinpath("data.csv").stat().st_size)), "data.csv changed"),
    "figure deleted": (lambda o: o.joinpath("figure.png").unlink(), "figure.png is missing"),
    "notebook garbage": (lambda o: o.joinpath("notebook.ipynb").write_text("garbage"),
                         "notebook.ipynb has"),
    "manifest deleted": (lambda o: o.joinpath("manifest.json").unlink(), "no valid manifest"),
    "manifest garbage": (lambda o: o.joinpath("manifest.json").write_text("[1, 2"),
                         "no valid manifest"),
    "params any shape": (lambda o: o.joinpath("params.json").write_text("[1, 2]"),
                         "params.json has"),
}


@pytest.mark.parametrize("what", list(DAMAGE))
def test_a_damaged_result_is_stale_with_one_line_naming_the_file(finished, tmp_path, what):
    exp, out = _copy(finished, tmp_path)
    damage, words = DAMAGE[what]
    damage(out)
    state = _state(exp, out)
    assert state.startswith("stale: ") and words in state, state
    assert "\n" not in state


@pytest.mark.parametrize("text", ["[1, 2]", '"x"', "null", "{", "\x00\xff"])
def test_env_or_params_json_of_any_shape_never_crash_the_list(tmp_path, monkeypatch, text):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    exp = profiles.load_profile("cpu", profiles.discover())["E1"]
    out = tmp_path / "cpu" / "E1"
    out.mkdir(parents=True)
    for name in ("data.csv", "notebook.ipynb"):
        (out / name).write_text("a\n1\n")
    for name in ("env.json", "params.json"):
        (out / name).write_text(text)
    reuse.write_manifest(out, {})
    assert reuse.result_state(exp, "cpu").startswith("stale: ")
    assert "result: stale: " in artifact.list_table([exp], "cpu")
    (out / "manifest.json").write_text(text)
    assert "result: stale: " in artifact.list_table([exp], "cpu")


def test_a_damaged_result_runs_again(finished, tmp_path, monkeypatch, capsys):
    """The orchestrator says which file and runs it again; the new result is current."""
    exp, out = _copy(finished, tmp_path)
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    _cut_to_lines(out / "data.csv", 5)
    assert artifact.run("cpu", [exp], {}) == 0
    text = capsys.readouterr().out
    assert "E98: stale: data.csv has" in text and "; running it again" in text
    assert _state(exp, out) == "current" and reuse.csv_rows(out / "data.csv") == 10


def test_an_input_from_another_result_enters_the_key(finished, tmp_path):
    """Re-running E0 (a new calibration.json) makes every result that read the old one stale."""
    exp, out = _copy(finished, tmp_path)
    calibration = out.parent / "E0" / "calibration.json"
    calibration.parent.mkdir()
    results.write_json(calibration, {"alpha_s": 1e-4})
    assert "calibration.json changed" in _state(exp, out)  # it ran without one
    reuse.write_manifest(out, reuse.inputs(exp.id, {"rows": 10}, calibration))
    assert _state(exp, out) == "current"
    results.write_json(calibration, {"alpha_s": 2e-4})
    assert _state(exp, out) == "stale: its input E0's calibration.json changed since it ran"
    assert reuse.inputs("E0", {}, calibration) == {}  # E0 writes it; it does not read it


def test_a_data_directorys_files_enter_the_key(tmp_path):
    (tmp_path / "cifar").mkdir()
    (tmp_path / "cifar" / "batch_1").write_bytes(b"1234")
    (tmp_path / "README.md").write_text("how to fetch")
    before = reuse.inputs("E5", {"data_root": str(tmp_path)}, None)
    assert len(before) == 1 and next(iter(before)).endswith("cifar/batch_1")
    (tmp_path / "cifar" / "batch_1").write_bytes(b"1235")
    assert reuse.inputs("E5", {"data_root": str(tmp_path)}, None) != before


# --------------------------------------------------------------------------- the claims table


def _fake_result(tmp_path: Path, eid: str = "E4") -> tuple[profiles.Experiment, Path]:
    exp = profiles.load_profile("cpu", profiles.discover())[eid]
    out = tmp_path / "cpu" / eid
    out.mkdir(parents=True)
    for name in ("data.csv", "notebook.ipynb"):
        (out / name).write_text("a\n1\n")
    results.write_json(out / "params.json", profiles.run_params(exp))
    results.write_json(out / "env.json", {"code_hash": reuse.code_hash((exp).notebook)})
    reuse.write_manifest(out, {})
    return exp, out


def test_claims_from_an_old_result_after_a_failed_rerun_say_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    exp, _ = _fake_result(tmp_path)

    def fails(*args, **kwargs):
        raise RuntimeError("the re-run broke")

    monkeypatch.setattr(execute, "run_experiment", fails)
    assert artifact.run("cpu", [exp], {}, force=True) == 1  # non-zero, after the table
    captured = capsys.readouterr()
    assert "E4: FAILED: RuntimeError: the re-run broke" in captured.out
    rows = [line for line in captured.out.splitlines()
            if line.startswith("| C4.") and "MODEL (no verdict) |" not in line]
    assert rows and all("old result: its re-run failed" in line for line in rows)
    assert "decided on results that are not current" in captured.out
    assert "experiments that failed: E4" in captured.err
    table = pd.read_csv(tmp_path / "cpu" / "claims.csv", dtype=str).fillna("")
    assert set(table.loc[table.experiment == "E4", "result"]) - {""} == \
        {"old result: its re-run failed"}


def test_claims_from_a_stale_result_say_why(tmp_path, monkeypatch):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    _, out = _fake_result(tmp_path)
    results.write_json(out / "params.json", {"alpha_s": 1.0})
    table = artifact.claims_table("cpu", write=False)
    e4 = table[(table.experiment == "E4") & (table.verdict != claims.MODEL)]
    assert len(e4) and all(r.startswith("stale: params.json") for r in e4.result)
    assert "stale" in claims.to_markdown(table)


def test_a_result_column_over_independent_runs():
    one = pd.DataFrame({"claim": ["C1"], "verdict": ["PASS"], "measured": ["1"],
                        "result": ["current"]})
    two = one.assign(result=["stale: figure.png is missing"])
    assert claims.combine_runs([one, one])["result"].tolist() == ["current"]
    assert claims.combine_runs([one, two])["result"].tolist() == [
        "run 2: stale: figure.png is missing"]


# --------------------------------------------------------------------------- configuration

BAD_PROFILES = {  # an edit of cpu.yaml -> what its one line must say
    "yaml syntax": (lambda t: t.replace("budget_s: 35", "budget_s: [35"), "YAML syntax error at"),
    "thresholdd": (lambda t: t.replace("budget_s: 35", "budget_s: 35\n    thresholdd: 1"),
                   "experiments.E0: unknown key 'thresholdd' (allowed: budget_s, params)"),
    "parms": (lambda t: t.replace("params:", "parms:", 1), "unknown key 'parms'"),
    "profile typo": (lambda t: t.replace("profile: cpu", "profile: cpux"),
                     "profile: 'cpux' is not allowed (one of cpu, cpu-full, gpu, shaped)"),
    "profile of another file": (lambda t: t.replace("profile: cpu", "profile: gpu"),
                                "profile: 'gpu' is not allowed ('cpu', the file's name)"),
    "negative budget": (lambda t: t.replace("budget_s: 35", "budget_s: -35"),
                        "experiments.E0.budget_s: -35 is not allowed (a number > 0)"),
    "budget of the wrong type": (lambda t: t.replace("budget_s: 35", "budget_s: soon"),
                                 "'soon' is not allowed (a value of type number)"),
    "unknown parameter": (lambda t: t.replace("sizes_max: 67108864", "sizes_maxx: 1", 1),
                          "experiments.E0.params: unknown parameter(s) ['sizes_maxx']"),
}


@pytest.mark.parametrize("what", list(BAD_PROFILES))
def test_a_bad_profile_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, what):
    for path in profiles.PROFILES.glob("*.yaml"):
        shutil.copy(path, tmp_path / path.name)
    edit, words = BAD_PROFILES[what]
    (tmp_path / "cpu.yaml").write_text(edit((tmp_path / "cpu.yaml").read_text()))
    monkeypatch.setattr(profiles, "PROFILES", tmp_path)
    monkeypatch.setattr(artifact, "run", lambda *a, **k: pytest.fail("it ran"))
    with pytest.raises(SystemExit) as stop:
        artifact.main(["--profile", "cpu", "--only", "E1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "cpu.yaml" in err and words in err, err


BAD_CLAIMS = {
    "yaml syntax": (lambda t: t.replace("kind: method", "kind: [method", 1),
                    "YAML syntax error at line"),
    "thresholdd": (lambda t: t.replace("  check: e0_emulated_within",
                                       "  check: e0_emulated_within\n  thresholdd: 1", 1),
                   "claim C0.2: unknown key 'thresholdd'"),
    "kind": (lambda t: t.replace("kind: method", "kind: methd", 1),
             "claim C0.2.kind: 'methd' is not allowed (one of paper, method, illustration)"),
    "experiment of the wrong type": (lambda t: t.replace("experiment: E0", "experiment: 0", 1),
                                     "claim C0.2.experiment: 0 is not allowed (a value of type "
                                     "string)"),
}


@pytest.mark.parametrize("what", list(BAD_CLAIMS))
def test_a_bad_claims_file_is_one_line_before_any_work(tmp_path, monkeypatch, capsys, what):
    edit, words = BAD_CLAIMS[what]
    path = tmp_path / "claims.yaml"
    path.write_text(edit(claims.CLAIMS_FILE.read_text()))
    monkeypatch.setattr(claims, "CLAIMS_FILE", path)
    monkeypatch.setattr(artifact, "run", lambda *a, **k: pytest.fail("it ran"))
    with pytest.raises(SystemExit) as stop:
        artifact.main(["--profile", "cpu", "--only", "E1"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "claims.yaml" in err and words in err, err


def test_the_shipped_configuration_passes_its_schemas():
    assert len(schema.load(claims.CLAIMS_FILE, schema.CLAIMS)) > 40
    for name in schema.PROFILE_NAMES:
        assert profiles.read_profile(name)["profile"] == name


# --------------------------------------------------------------------------- signals and debris

_ORCHESTRATOR = """
import pathlib, sys
from pipecomm.lab import artifact, profiles
profiles.RESULTS = pathlib.Path(sys.argv[1])
exp = profiles.Experiment("E98", pathlib.Path(sys.argv[2]), {}, budget_s=30)
sys.exit(artifact.run("cpu", [exp], {}))
"""


def _start_sleeping_run(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    execute.ensure_kernel()
    marker = tmp_path / "started"
    nb = _notebook(tmp_path / "98_sleep.ipynb",
                   "import pathlib, subprocess, time\nchild = subprocess.Popen(['sleep', '300'])\n"
                   f"pathlib.Path({str(marker)!r}).write_text(str(child.pid))\ntime.sleep(300)")
    proc = subprocess.Popen([sys.executable, "-c", _ORCHESTRATOR, str(tmp_path / "results"),
                             str(nb)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "the notebook did not start"
    return proc, marker


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if guard.session_of(str(pid)) is None:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.parametrize(("signum", "status", "word"), [
    (signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")])
def test_a_signal_is_one_line_and_nothing_is_left(tmp_path, signum, status, word):
    """Ctrl-C (SIGINT) and what SLURM and Kubernetes send (SIGTERM): one line, exit 128 + the
    signal, no traceback or ERROR; the kernel and what it started stopped; no result, no kernel
    directory in the temporary directory."""
    proc, marker = _start_sleeping_run(tmp_path)
    kernel_dirs = [p for p in guard.kernel_dirs() if p.name.startswith(
        f"pipecomm-kernel-{proc.pid}-")]
    assert len(kernel_dirs) == 1 and (kernel_dirs[0] / "connection.json").exists()
    os.killpg(proc.pid, signum)  # Ctrl-C in a terminal signals the whole process group
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, out + err
    assert out.rstrip().splitlines()[-1] == f"{word}: E98; nothing was written; re-run to resume"
    assert "Traceback" not in out + err and "ERROR" not in out + err, out + err
    assert not err.strip(), err
    assert _gone(int(marker.read_text()))
    assert not kernel_dirs[0].exists()
    cpu = tmp_path / "results" / "cpu"
    assert sorted(p.name for p in cpu.iterdir()) == [".lock"]


def test_after_kill_9_the_next_run_removes_the_debris(tmp_path):
    """kill -9 of the orchestrator leaves a half-assembled result, a kernel directory and the
    kernel's children; the next run stops and removes them before it starts."""
    proc, marker = _start_sleeping_run(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)  # its kernel's children still hold its pipes: no communicate()
    proc.stdout.close()
    proc.stderr.close()
    cpu = tmp_path / "results" / "cpu"
    assert [p.name for p in cpu.glob(".E98.tmp-*")] == [f".E98.tmp-{proc.pid}"]
    left = [p for p in guard.kernel_dirs() if p.name.startswith(f"pipecomm-kernel-{proc.pid}-")]
    assert len(left) == 1
    (cpu / ".data.csv.abc123.tmp").write_text("half")  # a partial write of another kind
    with guard.locked(cpu):
        assert sorted(guard.remove_debris(cpu)) == [".E98.tmp-" + str(proc.pid),
                                                    ".data.csv.abc123.tmp"]
        assert left[0].name in guard.remove_dead_kernel_dirs()
    assert _gone(int(marker.read_text())), "the dead run's kernel left its child running"
    assert not left[0].exists()
    assert sorted(p.name for p in cpu.iterdir()) == [".lock"]


def test_a_second_run_on_the_same_results_refuses_naming_the_first(tmp_path, monkeypatch,
                                                                   capsys):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    exp, _ = _fake_result(tmp_path)
    with guard.locked(tmp_path / "cpu"):
        assert artifact.run("cpu", [exp], {}) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert f"is in use by another run (pid {os.getpid()})" in err
    assert artifact.run("cpu", [exp], {}) == 0  # released with its holder


# --------------------------------------------------------------------------- write errors


def test_an_unwritable_results_directory_is_one_line_before_the_first_experiment(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(profiles, "RESULTS", tmp_path / "file")
    monkeypatch.setattr(execute, "run_experiment", lambda *a, **k: pytest.fail("it ran"))
    exp = profiles.load_profile("cpu", profiles.discover())["E1"]
    assert artifact.run("cpu", [exp], {}) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"cannot write results to {tmp_path}" in err


def test_a_write_error_names_the_file(tmp_path, monkeypatch):
    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", full)
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device: '.*data.csv'"):
        results.write_csv(tmp_path / "E4" / "data.csv", pd.DataFrame({"a": [1]}))
    assert list((tmp_path / "E4").iterdir()) == []


def test_yaml_and_schema_errors_name_line_and_key(tmp_path):
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({"profile": "cpu", "experiments": {"E4": {"budget": 1}}}))
    with pytest.raises(schema.ConfigError, match=r"experiments.E4: unknown key 'budget'"):
        schema.load(path, schema.PROFILE)
    path.write_text("profile: cpu\nexperiments:\n  E4: {budget_s: 1\n")
    with pytest.raises(schema.ConfigError, match=r"YAML syntax error at line \d+, column \d+"):
        schema.load(path, schema.PROFILE)
