"""Orchestrator: option and parameter parsing, atomic results, reuse and resume."""

import importlib
import io
import subprocess
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from pipecomm.lab import artifact, claims, cli, execute, profiles, results, reuse

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "text, default, expected",
    [
        ("1048576", 65536, 1048576),
        ("0.5", 1.0, 0.5),
        ("2", 1.0, 2.0),
        ("true", False, True),
        ("off", True, False),
        ("[2, 4]", [2, 8], [2, 4]),
        ("4", [2, 8], [4]),
        ("ring", "lp", "ring"),
        ("None", None, None),
    ],
)
def test_parse_value_follows_the_default_type(text, default, expected):
    value = cli.parse_value(text, default)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("text, default", [("abc", 3), ("1.5", 3), ("maybe", True), ("x", [1])])
def test_parse_value_rejects_wrong_types(text, default):
    with pytest.raises(ValueError, match="expected"):
        cli.parse_value(text, default, "n")


def test_check_type():
    cli.check_type("a", 3, 1.0)
    with pytest.raises(ValueError, match="wrong type"):
        cli.check_type("a", "3", 1.0)
    with pytest.raises(ValueError, match="wrong type"):
        cli.check_type("a", True, 1)


def _main(*argv):
    with pytest.raises(SystemExit) as info:
        artifact.main(list(argv))
    return info.value.code


def test_unknown_experiment_is_a_usage_error(capsys):
    assert _main("--only", "E99") == 2
    assert "unknown experiment id(s) ['E99']" in capsys.readouterr().err


def test_a_profile_runs_only_the_experiments_it_names(capsys):
    cpu = profiles.load_profile("cpu", profiles.discover())
    shaped = profiles.load_profile("shaped", profiles.discover())
    assert "E14" not in cpu and "E14" in shaped and "E13" not in shaped and "E1" not in shaped
    assert "E14" not in profiles.load_profile("cpu-full", profiles.discover())
    assert _main("--profile", "cpu", "--only", "E14") == 2
    assert "not in profile 'cpu'" in capsys.readouterr().err
    assert profiles.profiles_of("E14") == ["shaped"]


def test_unknown_parameter_is_a_usage_error(capsys):
    assert _main("--only", "E0", "-p", "no_such_param=1") == 2
    assert "unknown parameter 'no_such_param'" in capsys.readouterr().err


def test_badly_typed_parameter_is_a_usage_error(capsys):
    assert _main("--only", "E0", "-p", "sizes_max=big") == 2
    assert "sizes_max" in capsys.readouterr().err


def test_unknown_option_is_a_usage_error(capsys):
    assert _main("--frobnicate") == 2


@pytest.mark.parametrize("eid, item, words", [
    ("E4", "world_size=0", ["E4:", "world_size", ">= 3", "got 0", "-p world_size=0"]),
    ("E4", "emu_bandwidth_Bps=-1e9", ["E4:", "emu_bandwidth_Bps", "-1000000000.0"]),
    ("E4", "block_range=0", ["E4:", "block_range", ">= 1", "got 0"]),
    ("E5", "bandwidth_Bps=-1e9", ["E5:", "bandwidth_Bps", "-1000000000.0"]),
])
def test_bad_values_are_refused_before_any_kernel(eid, item, words, capsys, monkeypatch):
    """A value the experiment's Params refuses is one usage line, before anything starts."""
    monkeypatch.setattr(execute, "ensure_kernel", lambda: pytest.fail("a kernel was started"))
    assert _main("--profile", "cpu", "--only", eid, "-p", item) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines


def test_gpu_profile_needs_two_gpus(capsys, monkeypatch):
    monkeypatch.setattr(profiles, "gpu_count", lambda: 0)
    monkeypatch.setattr(execute, "ensure_kernel", lambda: pytest.fail("a kernel was started"))
    assert _main("--profile", "gpu", "--only", "E1") == 2
    assert "profile 'gpu' needs at least 2 visible GPUs" in capsys.readouterr().err
    assert artifact.main(["--profile", "gpu", "--list", "--only", "E1"]) == 0  # listing is fine


def test_an_option_or_parameter_given_twice_is_an_error(capsys):
    assert _main("--profile", "cpu", "--profile", "cpu-full", "--list") == 2
    assert "--profile is given twice" in capsys.readouterr().err
    assert _main("--only", "E0", "-p", "sizes_max=1024", "-p", "sizes_max=2048") == 2
    assert "-p sizes_max is given twice" in capsys.readouterr().err
    assert _main("--only", "E0", "--only", "E1", "--list") == 2
    assert "--only is given twice (E0 and E1)" in capsys.readouterr().err


def test_list(capsys):
    assert artifact.main(["--list", "--profile", "cpu"]) == 0
    assert "E0" in capsys.readouterr().out


def test_run_all_help_and_bad_option():
    help_ = subprocess.run([str(ROOT / "run_all.sh"), "--help"], capture_output=True, text=True,
                           timeout=30)
    assert help_.returncode == 0 and "--only" in help_.stdout
    bad = subprocess.run([str(ROOT / "run_all.sh"), "--only", "E99"], capture_output=True,
                         text=True, timeout=120, env={"PIPECOMM_SKIP_INSTALL": "1", "PATH":
                         "/usr/bin:/bin"})
    assert bad.returncode == 2 and "E99" in bad.stderr


@pytest.mark.parametrize("argv", [["--only", "E4", "--tests"], ["--tests", "--only", "E4"],
                                  ["--tests", "--profile=cpu", "-k", "x"]])
def test_run_all_tests_with_run_options_is_refused(argv):
    """--tests and run options do not mix: refused before any set-up, not by pytest."""
    proc = subprocess.run([str(ROOT / "run_all.sh"), *argv], capture_output=True, text=True,
                          timeout=30, env={"PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "run option" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_python_versions_agree():
    """pyproject, run_all.sh and the README name the same oldest Python (the lock's numpy 2.4,
    pandas 3.1 and scipy 1.17 need 3.11)."""
    import tomllib

    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert spec["requires-python"] == ">=3.11"
    assert any(d.startswith("scipy") for d in spec["dependencies"])  # pipecomm.lab.measure.stats imports it
    assert "sys.version_info < (3, 11)" in (ROOT / "run_all.sh").read_text()
    readme = (ROOT / "README.md").read_text()
    assert "Python 3.11" in readme and "3.10+" not in readme


_SLOW = ("netem: this host cannot deliver the emulated network (emulated, single-port, 2.0 ms / "
         "50 MB/s) at p=8: a real ring step of 64 B takes 2.61 ms here but the emulated link "
         "gives it 2.0 ms; raise alpha_s to at least 2.48 ms (or lower bandwidth_Bps to at most "
         "1.234 MB/s)")


@pytest.mark.parametrize("eid, alpha, bandwidth", [("E0", "emu_alpha_s", "emu_bandwidth_Bps"),
                                                   ("E5", "alpha_s", "bandwidth_Bps"),
                                                   ("E10", "intra_alpha_s", "intra_bandwidth_Bps")])
def test_host_too_slow_names_the_experiments_parameter(eid, alpha, bandwidth, monkeypatch):
    """netem's advice in the experiment's own parameter names, with the -p that runs it here."""

    class Failed(Exception):  # what papermill raises for an exception in a cell
        ename, evalue = "HostTooSlow", _SLOW

    monkeypatch.setattr(profiles, "auto_profile", lambda: "cpu")
    exp = profiles.discover()[eid]
    line = artifact.failure_message(exp, Failed("86 hint = ...\n---> 87 raise"), {"iters": 3},
                                    "cpu")
    assert "\n" not in line and "---> 87" not in line
    assert f"raise {alpha} to at least 2.48 ms" in line
    assert f"lower {bandwidth} to at most 1.234 MB/s" in line
    assert line.endswith(f"./run_all.sh --only {eid} -p iters=3 -p {alpha}=0.0025")


def test_failure_message_is_the_notebooks_exception_only():
    class Failed(Exception):
        ename, evalue = "ValueError", "parameter x must be >= 1, got 0"

    line = artifact.failure_message(profiles.discover()["E4"], Failed("source lines"), {}, "cpu")
    assert line == "ValueError: parameter x must be >= 1, got 0"


def test_override_dirname_is_separate_from_default():
    assert profiles.override_dirname("E0", {}) == "E0"
    name = profiles.override_dirname("E0", {"sizes_max": 1048576, "iters": 2})
    assert name == "E0__iters=2,sizes_max=1048576"


def test_profiles_only_use_known_parameters():
    for profile in profiles.PROFILE_NAMES:
        profiles.load_profile(profile, profiles.discover())


class _ReachedRanks(Exception):
    pass


@pytest.mark.parametrize("eid", ["E0", "E5", "E7", "E8", "E9", "E13"])
def test_gpu_profile_nccl_parameters_pass_validation(eid, monkeypatch):
    """The gpu profile's NCCL experiments get as far as starting their NCCL pool (GPUs assumed)."""
    from pipecomm.lab.networks import launch
    from pipecomm.lab.workloads import data

    exp = profiles.load_profile("gpu", profiles.discover())[eid]
    module = importlib.import_module(f"pipecomm.lab.experiments.e{exp.notebook.stem}")
    params = {**module.DEFAULTS, **exp.profile_params}
    assert params["backend"] == "nccl"

    def fake_ranks(world_size, backend="gloo", network=None, **kw):
        assert backend == "nccl" and network is None
        assert world_size == params.get("world_size", 2)
        raise _ReachedRanks

    monkeypatch.setattr(launch, "check_gpus", lambda world_size: None)
    fetched = []
    monkeypatch.setattr(data, "fetch", lambda name, root: fetched.append((name, root)))
    monkeypatch.setattr(launch, "Ranks", fake_ranks)
    with pytest.raises(_ReachedRanks):
        module.run(**params)
    if params.get("dataset", "digits") != "digits":  # fetched (checksums) before ranks start,
        # into the repository's data/ (a relative data_root), not the kernel's notebooks/data/
        assert fetched == [(params["dataset"], str(ROOT / params["data_root"]))]


def test_cpu_budgets_fit_20_minutes():
    import yaml

    spec = yaml.safe_load((ROOT / "artifact/profiles/cpu.yaml").read_text())
    assert sum(e["budget_s"] for e in spec["experiments"].values()) <= 20 * 60


def test_notebooks_are_stored_without_outputs_and_mirror_defaults():
    import importlib

    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert notebooks
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, path.name
        params = profiles.notebook_parameters(path)
        assert params["out_dir"] is None and params["data_csv"] is None
        module = next(
            importlib.import_module(f"pipecomm.lab.experiments.{p.stem}")
            for p in (ROOT / "src/pipecomm/lab/experiments").glob("e*.py")
            if path.stem == importlib.import_module(f"pipecomm.lab.experiments.{p.stem}").NOTEBOOK
        )
        assert {k: v for k, v in params.items() if k not in profiles.RESERVED} == \
            results.json_roundtrip(module.DEFAULTS), f"{path.name}: run tools/make_notebooks.py"
        code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
        assert "_cli" not in code, f"{path.name}: notebooks use pipecomm.lab.notebook"
        last = [c for c in nb.cells if c.cell_type == "code"][-1].source
        if any(e["experiment"] == module.ID for e in claims.load_claims()):
            assert "nb.verdicts(E, df)" in last, f"{path.name}: the last cell shows the verdicts"


def test_thresholds_are_written_only_in_claims_yaml():
    """Notebook markdown and experiment docstrings do not restate a claim's threshold: the one
    place is artifact/claims.yaml (the verdict cell and ARTIFACT.md render it from there)."""
    import re

    pattern = re.compile(r"(within|at most|at least) \d+(\.\d+)?(%|x)")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "markdown":
                assert not pattern.search(cell.source), (path.name, pattern.search(cell.source))


def test_atomic_path_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "data.csv"
    with pytest.raises(RuntimeError), results.atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("interrupted")
    assert not target.exists() and list(tmp_path.iterdir()) == []
    results.write_csv(target, pd.DataFrame({"a": [1]}))
    assert target.read_text().startswith("a")


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(tmp_path, mask):
    """claims.md / claims.csv and every result file get the permissions the umask gives (the
    temporary file they are renamed from would be 0600)."""
    import os
    import stat

    old = os.umask(mask)
    try:
        results.write_text(tmp_path / "claims.md", "x")
        results.write_csv(tmp_path / "claims.csv", pd.DataFrame({"a": [1]}))
    finally:
        os.umask(old)
    for name in ("claims.md", "claims.csv"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~mask, name


def test_replace_dir(tmp_path):
    final, new = tmp_path / "E0", tmp_path / ".E0.tmp"
    final.mkdir()
    (final / "old").write_text("1")
    new.mkdir()
    (new / "data.csv").write_text("2")
    results.replace_dir(new, final)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["E0"]
    assert (final / "data.csv").exists() and not (final / "old").exists()


def test_reuse_requires_same_code_and_params(tmp_path):
    out = tmp_path / "E0"
    out.mkdir()
    (out / "data.csv").write_text("a\n1\n")
    (out / "notebook.ipynb").write_text("x")
    results.write_json(out / "params.json", {"a": [1, 2]})
    results.write_json(out / "env.json", {"git_commit": "other", "code_hash": "abc"})
    reuse.write_manifest(out, {})
    assert reuse.stale_reason(out, {"a": (1, 2)}, "abc", {}) is None  # another commit, same code
    assert "other parameters (a)" in reuse.stale_reason(out, {"a": (1, 3)}, "abc", {})
    assert "other code" in reuse.stale_reason(out, {"a": (1, 2)}, "def", {})
    assert "calibration" in reuse.stale_reason(out, {"a": (1, 2)}, "abc", {"calibration": "f0"})
    (out / "notebook.ipynb").unlink()
    assert reuse.stale_reason(out, {"a": (1, 2)}, "abc", {}) == "notebook.ipynb is missing"


def test_code_hash_follows_the_code_an_experiment_runs(tmp_path, monkeypatch):
    """E1's key covers its notebook and the pipecomm modules it imports, not docs, not E4."""
    exps = profiles.discover()
    files = {p.relative_to(ROOT).as_posix() for p in reuse.code_files(exps["E1"].notebook)}
    assert {"notebooks/01_lp_cost_model.ipynb", "src/pipecomm/lab/experiments/e01_lp_cost_model.py",
            "src/pipecomm/lab/networks/cost/__init__.py", "src/pipecomm/__init__.py"} <= files
    assert "src/pipecomm/lab/experiments/e04_lp_block_size.py" not in files
    assert not any(f.endswith(".md") for f in files)
    before = reuse.code_hash((exps["E1"]).notebook)
    assert before == reuse.code_hash((exps["E1"]).notebook) and len(before) == 16
    fake = tmp_path / "01_lp_cost_model.ipynb"  # the same experiment, its notebook changed
    fake.write_bytes(exps["E1"].notebook.read_bytes() + b" ")
    monkeypatch.setattr(exps["E1"], "notebook", fake)
    assert reuse.code_hash((exps["E1"]).notebook) != before


def test_list_is_a_table_of_the_selected_experiments(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    assert artifact.main(["--list", "--profile", "cpu", "--only", "E1"]) == 0
    out = capsys.readouterr().out
    assert "E1 " in out and "E0 " not in out and "E4 " not in out
    assert "result: none" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("alpha_s"))
    assert "1e-05" in row and "latency" in row  # name, value, meaning on one line


def test_every_parameter_has_a_meaning():
    from pipecomm.lab import meanings

    for exp in profiles.discover().values():
        module = profiles.experiment_module(exp)
        missing = [k for k in module.DEFAULTS if not meanings.meaning(exp.id, k)]
        assert not missing, f"{exp.id}: no meaning in experiments/meanings.py for {missing}"


def test_list_says_which_results_are_current(tmp_path, monkeypatch):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    exp = profiles.load_profile("cpu", profiles.discover())["E1"]
    out = tmp_path / "cpu" / "E1"
    out.mkdir(parents=True)
    for name in ("data.csv", "notebook.ipynb"):
        (out / name).write_text("x")
    results.write_json(out / "params.json", profiles.run_params(exp))
    results.write_json(out / "env.json", {"code_hash": reuse.code_hash((exp).notebook)})
    reuse.write_manifest(out, {})
    assert reuse.result_state(exp, "cpu") == "current"
    results.write_json(out / "env.json", {"code_hash": "0" * 16})
    assert reuse.result_state(exp, "cpu") == "stale: env.json changed since it was written " \
        "(sha256 differs)"
    assert "result: stale: env.json changed" in artifact.list_table([exp], "cpu")


def _failing_notebook(path: Path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "pipecomm", "language": "python", "display_name": "p"}
    cell = nbformat.v4.new_code_cell("out_dir = None\nx = 1")
    cell.metadata["tags"] = ["parameters"]
    nb.cells = [cell, nbformat.v4.new_code_cell(
        "import pathlib\n(pathlib.Path(out_dir) / 'data.csv').write_text('a\\n1\\n')\n"
        "raise RuntimeError('interrupted on purpose')")]
    nbformat.write(nb, path)


def test_interrupted_run_leaves_no_result(tmp_path):
    execute.ensure_kernel()
    nb = tmp_path / "99_fail.ipynb"
    _failing_notebook(nb)
    exp = profiles.Experiment("E99", nb, {"x": 1}, budget_s=30)
    out = tmp_path / "results" / "E99"
    with pytest.raises(Exception, match="interrupted on purpose"):
        execute.run_experiment(exp, "cpu", {"x": 1}, out)
    assert not out.exists()
    assert list((tmp_path / "results").iterdir()) == []


def test_interrupted_run_resumes_from_its_finished_training_runs(tmp_path):
    """results.Runs inside a notebook keeps each finished run under results/<profile>/.runs/
    while the experiment is unfinished; re-running with the same parameters skips them (other
    parameters start afresh); success removes them."""
    execute.ensure_kernel()
    nb = tmp_path / "98_runs.ipynb"
    book = nbformat.v4.new_notebook()
    book.metadata["kernelspec"] = {"name": "pipecomm", "language": "python", "display_name": "p"}
    cell = nbformat.v4.new_code_cell("out_dir = None\nflag = ''\ncounter = ''")
    cell.metadata["tags"] = ["parameters"]
    book.cells = [cell, nbformat.v4.new_code_cell(
        "import pathlib\nfrom pipecomm.lab import results\nruns = results.Runs(2)\n"
        "def work(i):\n    with open(counter, 'a') as f:\n        f.write('x')\n    return i * 10\n"
        "a = runs({'i': 0}, work, 0)\n"
        "if pathlib.Path(flag).exists():\n    raise RuntimeError('interrupted on purpose')\n"
        "b = runs({'i': 1}, work, 1)\n"
        "(pathlib.Path(out_dir) / 'data.csv').write_text(f'a,b\\n{a},{b}\\n')")]
    nbformat.write(book, nb)
    exp = profiles.Experiment("E98", nb, {}, budget_s=30)
    out, counter, flag = tmp_path / "results" / "E98", tmp_path / "calls.txt", tmp_path / "fail"
    params = {"flag": str(flag), "counter": str(counter)}
    flag.write_text("")
    with pytest.raises(Exception, match="interrupted on purpose"):
        execute.run_experiment(exp, "cpu", params, out)
    kept = list((tmp_path / "results" / ".runs").glob("E98-*/*.pkl"))
    assert not out.exists() and len(kept) == 1 and counter.read_text() == "x"
    kept[0].write_bytes(b"\x80\x04garbage")  # a damaged run is run again, never reused
    with pytest.raises(Exception, match="interrupted on purpose"):
        execute.run_experiment(exp, "cpu", params, out)
    assert counter.read_text() == "xx"
    flag.unlink()
    execute.run_experiment(exp, "cpu", params, out)
    assert counter.read_text() == "xxx"  # run 0 came from the run directory, only run 1 ran
    assert (out / "data.csv").read_text() == "a,b\n0,10\n"
    assert not (tmp_path / "results" / ".runs").exists()


def test_a_successful_run_logs_no_error_and_records_relative_paths(tmp_path, capfd):
    """No "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel" when nothing failed (the
    kernel is not sent SIGINT before its shutdown request)."""
    execute.ensure_kernel()
    book = nbformat.v4.new_notebook()
    book.metadata["kernelspec"] = {"name": "pipecomm", "language": "python", "display_name": "p"}
    cell = nbformat.v4.new_code_cell("out_dir = None")
    cell.metadata["tags"] = ["parameters"]
    book.cells = [cell, nbformat.v4.new_code_cell(
        "import pathlib\n(pathlib.Path(out_dir) / 'data.csv').write_text('a\\n1\\n')")]
    nb = tmp_path / "97_ok.ipynb"
    nbformat.write(book, nb)
    out = tmp_path / "results" / "E97"
    execute.run_experiment(profiles.Experiment("E97", nb, {}, budget_s=30), "cpu", {}, out)
    captured = capfd.readouterr()
    assert "ERROR" not in captured.out + captured.err, captured.out + captured.err
    text = (out / "notebook.ipynb").read_text()
    assert ".E97.tmp-" not in text  # the temporary directory it ran in is not recorded


def test_a_result_records_the_data_its_notebook_fetched(tmp_path):
    """An experiment that fetches its data set into data_root as it runs (E7, E9 of the gpu
    profile) is current afterwards: its manifest holds the files as the notebook left them, not
    the empty folder it started from (which made every next run stale)."""
    execute.ensure_kernel()
    book = nbformat.v4.new_notebook()
    book.metadata["kernelspec"] = {"name": "pipecomm", "language": "python", "display_name": "p"}
    cell = nbformat.v4.new_code_cell("out_dir = None\ndata_root = ''")
    cell.metadata["tags"] = ["parameters"]
    book.cells = [cell, nbformat.v4.new_code_cell(
        "import pathlib\n(pathlib.Path(data_root) / 'batch').write_text('fetched')\n"
        "(pathlib.Path(out_dir) / 'data.csv').write_text('a\\n1\\n')")]
    nb = tmp_path / "96_fetch.ipynb"
    nbformat.write(book, nb)
    (tmp_path / "data").mkdir()
    exp = profiles.Experiment("E96", nb, {}, budget_s=30)
    params, out = {"data_root": str(tmp_path / "data")}, tmp_path / "results" / "E96"
    execute.run_experiment(exp, "cpu", params, out)
    assert reuse.why_stale(exp, out, params) is None
    (tmp_path / "data" / "batch").write_text("another")
    assert "batch changed since it ran" in reuse.why_stale(exp, out, params)


def test_a_finished_kernel_is_not_interrupted_before_its_shutdown(monkeypatch):
    """jupyter_client sends SIGINT before every shutdown request; a kernel busy with a message
    then logs "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel" after a successful run.
    pipecomm's kernel manager skips that interrupt while shutting down, and only then."""
    import asyncio

    from jupyter_client.manager import AsyncKernelManager, KernelManager

    sent = []

    async def record(self):
        sent.append(self.shutting_down)

    monkeypatch.setattr(KernelManager, "_async_interrupt_kernel", record)
    monkeypatch.setattr(AsyncKernelManager, "interrupt_kernel", record)
    km = execute._ipc_kernel_manager()(kernel_name=execute.KERNEL)
    try:
        km.shutting_down = False
        asyncio.run(km.interrupt_kernel())  # a timeout's interrupt still reaches the kernel
        km.shutting_down = True
        asyncio.run(km._async_interrupt_kernel())  # the one before the shutdown request
    finally:
        import shutil

        shutil.rmtree(Path(km.ip).parent, ignore_errors=True)
    assert sent == [False]


def test_executed_notebooks_record_repository_relative_paths(tmp_path):
    """The injected parameters cell and papermill's metadata name the result directory relative
    to the repository, not the temporary directory on the machine that ran it."""
    exp = profiles.discover()["E4"]
    book = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell('# Parameters\nworld_size = 8\n'
                                     'out_dir = "/work/wt/results/cpu/.E4.tmp-13704"\n')
    cell.metadata["tags"] = ["injected-parameters"]
    book.cells = [cell]
    book.metadata["papermill"] = {
        "input_path": "/work/wt/notebooks/04_lp_block_size.ipynb", "cwd": "/work/wt/notebooks",
        "output_path": "/work/wt/results/cpu/.E4.tmp-13704/notebook.ipynb",
        "parameters": {"world_size": 8, "out_dir": "/work/wt/results/cpu/.E4.tmp-13704"}}
    path = tmp_path / "notebook.ipynb"
    nbformat.write(book, path)
    execute.relocate_notebook(path, profiles.RESULTS / "cpu" / "E4", exp.notebook)
    nb = nbformat.read(path, as_version=4)
    assert nb.cells[0].source == '# Parameters\nworld_size = 8\nout_dir = "../results/cpu/E4"\n'
    meta = nb.metadata["papermill"]
    assert meta["parameters"]["out_dir"] == "../results/cpu/E4"
    assert meta["input_path"] == "notebooks/04_lp_block_size.ipynb"
    assert meta["output_path"] == "results/cpu/E4/notebook.ipynb" and "cwd" not in meta
    assert "/work/wt" not in path.read_text()


def test_relocated_notebook_names_a_linked_venv_relative(tmp_path, monkeypatch):
    """A checkout whose .venv links to another checkout's (a worktree sharing one): a warning's
    file under the linked venv is shown as .venv/..., not by the other checkout's path."""
    import nbformat

    root, other = tmp_path / "wt", tmp_path / "main"
    (other / ".venv" / "lib").mkdir(parents=True)
    (root / "notebooks").mkdir(parents=True)
    (root / ".venv").symlink_to(other / ".venv")
    monkeypatch.setattr(profiles, "ROOT", root)
    monkeypatch.setattr(profiles, "NOTEBOOKS", root / "notebooks")
    book = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("import x")
    cell.outputs = [nbformat.v4.new_output(
        "stream", name="stderr", text=f"{other.resolve()}/.venv/lib/tqdm/auto.py:21: Warning\n")]
    book.cells = [cell]
    path = tmp_path / "notebook.ipynb"
    nbformat.write(book, path)
    execute.relocate_notebook(path, root / "results" / "cpu" / "E7")
    text = nbformat.read(path, as_version=4).cells[0].outputs[0]["text"]
    assert text == ".venv/lib/tqdm/auto.py:21: Warning\n"


def test_a_run_prints_only_its_experiments_claims():
    table = pd.DataFrame({"claim": ["C0.2", "C1.1", "C4.1", "C4.2"],
                          "experiment": ["E0", "E1", "E4", "E4"],
                          "statement": ["s" * 300] * 4, "measured": ["m", "", "", "x"],
                          "threshold": ["t"] * 4,
                          "verdict": ["PASS", "NOT RUN", "NOT RUN", "FAIL"]})
    text = artifact.claims_report(table, ["E0"])
    assert "C0.2" in text and "C1.1" not in text and "C4.1" not in text
    assert text.rstrip().endswith("3 claims of other experiments are not shown (2 of them NOT RUN)")


def test_reference_notebooks_record_no_machines_paths():
    """artifact/reference's executed notebooks name their results relative to the repository."""
    import re

    books = sorted((ROOT / "artifact" / "reference").glob("*/E*/notebook.ipynb"))
    assert books
    for path in books:
        text = path.read_text()
        assert not re.search(r"\.E\d+\.tmp-\d+", text), path
        assert "/work/" not in text and str(ROOT) not in text, path
        nb = nbformat.read(path, as_version=4)
        eid, profile = path.parent.name, path.parent.parent.name
        assert nb.metadata["papermill"]["parameters"]["out_dir"] == f"../results/{profile}/{eid}"


def test_a_run_with_a_current_result_reuses_it_and_says_where_it_is(tmp_path, capsys,
                                                                   monkeypatch):
    """No kernel for a current result; the run names its figure and data, prints E1's claims
    only and one line on the others."""
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    monkeypatch.setattr(execute, "run_experiment", lambda *a, **k: pytest.fail("it ran"))
    exp = profiles.load_profile("cpu", profiles.discover())["E1"]
    out = tmp_path / "cpu" / "E1"
    out.mkdir(parents=True)
    for name in ("data.csv", "notebook.ipynb", "figure.png"):
        (out / name).write_text("a\n1\n")
    results.write_json(out / "params.json", profiles.run_params(exp))
    results.write_json(out / "env.json", {"code_hash": reuse.code_hash((exp).notebook)})
    reuse.write_manifest(out, {})
    assert artifact.run("cpu", [exp], {}) == 0
    text = capsys.readouterr().out
    assert f"E1: current, reused: figure {out / 'figure.png'}, data {out / 'data.csv'}" in text
    rows = [line for line in text.splitlines() if line.startswith("| C")]
    assert rows and all(line.split(" | ")[1] == "E1" for line in rows)
    assert "experiments:" not in text  # not a terminal: no progress bar, one line per experiment
    assert "|---|" not in text and "## " not in text  # plain text, not markdown
    assert "claims of other experiments are not shown" in text
    assert (tmp_path / "cpu" / "claims.md").exists()
    assert artifact.run("cpu", [exp], {}, report_after=True) == 0  # a full run: its report too
    assert "report: " in capsys.readouterr().out
    page = (tmp_path / "cpu" / "report" / "E1.html").read_text()
    assert "notebook.ipynb cannot be rendered" in page  # this fake one is no notebook


def test_interrupted_line():
    assert artifact.interrupted_line("E4", []) == \
        "interrupted: E4; nothing was written; re-run to resume"
    assert artifact.interrupted_line("E4", ["E0", "E1"]) == (
        "interrupted: E4; nothing was written for it (E0, E1 finished and kept); re-run to resume")
    assert artifact.interrupted_line(None, ["E0"]) == \
        "interrupted: after E0 finished and kept; re-run to resume"
    assert artifact.interrupted_line(None, []) == \
        "interrupted: before the first experiment; nothing was written; re-run to resume"


def test_artifact_appendix_is_in_sync_with_claims_and_profiles():
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tools/make_artifact_md.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fake_results(src, eids, profile="cpu-full"):
    """A results directory with a minimal, current run of each experiment in ``eids`` (of
    ``profile``) and a claims table."""
    experiments = profiles.load_profile(profile, profiles.discover())
    for eid in eids:
        exp = experiments.get(eid) or profiles.discover()[eid]
        (src / eid).mkdir(parents=True)
        (src / eid / "data.csv").write_text("a\n1\n")
        nbformat.write(nbformat.v4.new_notebook(), src / eid / "notebook.ipynb")
        results.write_json(src / eid / "params.json", profiles.run_params(exp))
        results.write_json(src / eid / "env.json", {"code_hash": reuse.code_hash((exp).notebook)})
        reuse.write_manifest(src / eid, {})
    for name in ("claims.md", "claims.csv"):
        (src / name).write_text("x")
    return src


def test_save_reference_keeps_a_profiles_own_experiments(tmp_path):
    """cpu-full extends cpu: its reference holds E7, E9 and E13 only; cpu needs every one."""
    assert profiles.own_experiments("cpu-full") == ["E7", "E9", "E13"]
    assert profiles.own_experiments("cpu") is None
    src = _fake_results(tmp_path / "results", ["E7", "E9", "E13"])
    dest = artifact.save_reference("cpu-full", source=src, dest=tmp_path / "ref")
    assert sorted(p.name for p in dest.iterdir() if p.is_dir()) == ["E13", "E7", "E9"]
    with pytest.raises(profiles.UsageError, match="lacks results"):
        artifact.save_reference("cpu", source=src, dest=tmp_path / "ref-cpu")


def test_save_reference_of_a_self_contained_profile_keeps_what_it_runs(tmp_path):
    """shaped runs the network experiments and E14: its reference keeps those, nothing else."""
    runs = profiles.profile_runs("shaped")
    assert "E14" in runs and "E13" not in runs and "E1" not in runs
    src = _fake_results(tmp_path / "results", [*runs, "E13"], "shaped")  # E13: not kept
    dest = artifact.save_reference("shaped", source=src, dest=tmp_path / "ref")
    assert sorted(p.name for p in dest.iterdir() if p.is_dir()) == sorted(runs)
    (src / runs[-1] / "figure.png").write_text("a figure the run never made")
    with pytest.raises(profiles.UsageError, match=f"{runs[-1]}: stale: figure.png"):
        artifact.save_reference("shaped", source=src, dest=tmp_path / "ref2")


def test_claims_table_lists_the_profiles_own_claims(tmp_path, monkeypatch):
    """The cpu table has no row for E14 (profile shaped); the shaped table has its experiments'
    claims except those limited to other profiles (the real-backend host model, accuracy)."""
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    cpu = artifact.claims_table("cpu", write=False)
    shaped = artifact.claims_table("shaped", write=False)
    assert "E14" not in set(cpu.experiment) and {"E0", "E13"} <= set(cpu.experiment)
    assert {"C2.7", "C7.2b"} <= set(cpu.claim) and "C7.2" not in set(cpu.claim)  # superseded
    assert set(shaped.experiment) == set(profiles.profile_runs("shaped")) - {"E1"}
    assert {"C14.1", "C2.1", "C10.1"} <= set(shaped.claim)
    assert not {"C2.7", "C7.2b", "C7.3b", "C9.3"} & set(shaped.claim)
    assert set(shaped.verdict) <= {"NOT RUN", "MODEL (no verdict)"} and "network" in shaped.columns


def test_save_reference_keeps_independent_runs(tmp_path):
    """--runs N: run k >= 2 keeps its data, parameters and claims, not its notebooks."""
    src = _fake_results(tmp_path / "results", ["E7", "E9", "E13"])
    for k in (2, 3):
        _fake_results(src / f"run-{k}", ["E7", "E9", "E13"])
    dest = artifact.save_reference("cpu-full", source=src, dest=tmp_path / "ref")
    assert sorted(p.name for p in dest.iterdir() if p.is_dir()) == [
        "E13", "E7", "E9", "run-2", "run-3"]
    assert (dest / "run-3" / "E9" / "data.csv.gz").exists()
    assert (dest / "run-2" / "claims.csv").exists()
    assert not (dest / "run-2" / "E9" / "notebook.ipynb").exists()
    (src / "run-3" / "E9" / "data.csv").unlink()
    with pytest.raises(profiles.UsageError, match="run-3 lacks results for"):
        artifact.save_reference("cpu-full", source=src, dest=tmp_path / "ref2")


def test_claims_table_over_independent_runs(tmp_path, monkeypatch):
    """--runs 2: run 2 has its own table; the profile's table has a runs column."""
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    assert artifact.run_dir("cpu", 1) == tmp_path / "cpu"
    assert artifact.run_dir("cpu", 2) == tmp_path / "cpu" / "run-2"
    table = artifact.claims_table("cpu", write=True, runs=2)
    assert set(table.runs) == {"0/2 run", ""}  # illustrations: no runs
    assert (tmp_path / "cpu" / "run-2" / "claims.md").read_text().startswith(
        "# Claims, profile cpu, run 2 of 2")
    text = (tmp_path / "cpu" / "claims.md").read_text()
    assert text.startswith("# Claims, profile cpu, 2 independent runs")
    assert text.index("## The papers' claims") < text.index("## Method claims")
    with pytest.raises(ValueError, match="run must be"):
        artifact.run_dir("cpu", 0)


@pytest.mark.parametrize(("argv", "message"), [
    (["--runs", "0"], "argument --runs: must be a whole number >= 1, got '0'"),
    (["--runs", "2", "--only", "E4", "-p", "world_size=4"], "--runs repeats the profile's own"),
    (["--runs", "2", "--runs", "3"], "--runs is given twice"),
])
def test_runs_option_refuses_bad_use_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        artifact.main(["--profile", "cpu", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) <= 2 and message in err[-1]


def test_runs_without_overrides_is_accepted(capsys):
    """--runs N without -p is not an override: it lists (and would run) the profile N times."""
    assert artifact.main(["--profile", "cpu", "--runs", "2", "--list", "--only", "E1"]) == 0
    assert "E1" in capsys.readouterr().out


def test_save_reference_keeps_the_figure_inline_and_small(tmp_path):
    """The reference notebook shows its figure (a compact PNG in its plot cell), not a pointer;
    its text outputs are those of the run."""
    import base64

    from PIL import Image

    src = _fake_results(tmp_path / "results", ["E7", "E9", "E13"])
    Image.new("RGB", (1200, 600), (10, 120, 200)).save(src / "E7" / "figure.png", dpi=(120, 120))
    book = nbformat.v4.new_notebook()
    big = base64.b64encode((src / "E7" / "figure.png").read_bytes()).decode()
    book.cells = [nbformat.v4.new_code_cell("fig = E.plot(df, **params)", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="\rruns: 0/2\rruns: 2/2\n"),
        nbformat.v4.new_output("display_data", data={"image/png": big, "text/plain": "<Fig>"})])]
    nbformat.write(book, src / "E7" / "notebook.ipynb")
    reuse.write_manifest(src / "E7", {})
    dest = artifact.save_reference("cpu-full", source=src, dest=tmp_path / "ref")
    cell = nbformat.read(dest / "E7" / "notebook.ipynb", as_version=4).cells[0]
    assert [o.output_type for o in cell.outputs] == ["stream", "display_data"]
    assert cell.outputs[0].text == "runs: 2/2\n"  # the progress bar's last line
    png = base64.b64decode(cell.outputs[1].data["image/png"])
    assert Image.open(io.BytesIO(png)).size == (800, 400)  # 80 dpi
    assert (dest / "E7" / "figure.png").read_bytes() == (src / "E7" / "figure.png").read_bytes()


def test_report_option_writes_the_reference_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profiles, "REFERENCE", tmp_path)
    with pytest.raises(SystemExit) as exc:
        artifact.main(["--profile", "cpu", "--report", "--reference"])
    assert exc.value.code == 2 and "no claims table at" in capsys.readouterr().err
    (tmp_path / "cpu").mkdir()
    pd.DataFrame({"claim": ["C4.1"], "kind": ["method"], "experiment": ["E4"],
                  "measured": ["m"], "threshold": ["t"], "verdict": ["PASS"]}).to_csv(
        tmp_path / "cpu" / "claims.csv", index=False)
    assert artifact.main(["--profile", "cpu", "--report", "--reference"]) == 0
    assert (tmp_path / "cpu" / "report" / "index.html").exists()
    with pytest.raises(SystemExit) as exc:
        artifact.main(["--profile", "cpu", "--reference"])
    assert exc.value.code == 2 and "--reference goes with --report" in capsys.readouterr().err


def test_data_csv_is_read_relative_to_the_notebook(tmp_path, monkeypatch):
    """A relative data_csv is read from notebooks/ (where the notebook is), whatever the
    working directory; a wrong path says "no such file", not "run the experiment first"."""
    from pipecomm.lab import notebook as nb
    from pipecomm.lab.experiments import e03_collectives_vs_ranks as e3

    monkeypatch.chdir(tmp_path)
    assert len(nb.load_or_run(e3, e3.DEFAULTS, "../artifact/reference/cpu/E3")) > 0
    with pytest.raises(FileNotFoundError, match=r"^no such file: .*/nothere\.csv$"):
        nb.load_or_run(e3, e3.DEFAULTS, "../nothere.csv")
    with pytest.raises(FileNotFoundError, match="no data.csv in .*: run the experiment first"):
        results.load_csv(tmp_path)


def test_every_saved_figure_has_its_experiments_title():
    import matplotlib.pyplot as plt

    from pipecomm.lab import notebook as nb
    from pipecomm.lab.experiments import e12_dadam_scaling as e12

    fig = plt.figure()
    fig.add_subplot().plot([1, 2])
    assert nb.save(e12, None, pd.DataFrame(), fig, {}) is None
    assert fig.get_suptitle().startswith("E12 — per-iteration time vs world size")
    titled = plt.figure()
    titled.suptitle("E4 — its own")
    assert nb.titled(titled, e12).get_suptitle() == "E4 — its own"
    plt.close("all")


def _override_result(base, exp, own, data=None):
    """A current result of ``exp`` run with the overrides ``own`` under ``base`` (the
    profile's results folder), its data.csv ``data`` (a DataFrame) or a stub."""
    out = base / profiles.override_dirname(exp.id, own)
    out.mkdir(parents=True)
    if data is None:
        (out / "data.csv").write_text("a\n1\n")
    else:
        data.to_csv(out / "data.csv", index=False)
    nbformat.write(nbformat.v4.new_notebook(), out / "notebook.ipynb")
    results.write_json(out / "params.json", profiles.run_params(exp, own))
    results.write_json(out / "env.json", {"code_hash": reuse.code_hash((exp).notebook)})
    reuse.write_manifest(out, {})
    return out


def test_list_shows_every_override_result_with_its_state(tmp_path, monkeypatch):
    """After ``-p world_size=4`` ran, --list shows that result (current) beside the profile's
    (none here), and says why the others are stale: a file added, params that belong elsewhere."""
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    exp = profiles.load_profile("cpu", profiles.discover())["E4"]
    _override_result(tmp_path / "cpu", exp, {"world_size": 4})
    (_override_result(tmp_path / "cpu", exp, {"world_size": 5}) / "extra.txt").write_text("x")
    moved = _override_result(tmp_path / "cpu", exp, {"iters": 3})
    moved.rename(tmp_path / "cpu" / "E4__iters=4")
    lines = artifact.list_table([exp], "cpu").splitlines()
    assert any(line.startswith("E4 ") and line.endswith("result: none") for line in lines)
    shown = {line.split(":")[0].strip(): line for line in lines if "with -p" in line}
    assert shown["with -p world_size=4"].endswith(
        "result: current (" + str(tmp_path / "cpu" / "E4__world_size=4") + ")")
    assert "stale: extra.txt is not part of the result" in shown["with -p world_size=5"]
    assert "stale: its params.json holds iters=3, a run of which goes to E4__iters=3" in \
        shown["with -p iters=3"]
    assert reuse.override_state(exp, "cpu", tmp_path / "cpu" / "E4__world_size=4") == \
        ("current", {"world_size": 4})
    same = _override_result(tmp_path / "cpu", exp, {"world_size": 8})  # the profile's value
    assert reuse.override_state(exp, "cpu", same) == ("current", {"world_size": 8})
    older = _override_result(tmp_path / "cpu", exp, {"world_size": 6})
    results.write_json(older / "params.json", {**profiles.run_params(exp, {"world_size": 6}),
                                               "iters": 3})  # the profile's iters were 3 then
    reuse.write_manifest(older, {})
    assert reuse.override_state(exp, "cpu", older) == \
        ("stale: made with other parameters (iters)", {"world_size": 6})


def test_list_with_p_shows_that_runs_parameters_and_state(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    exp = profiles.load_profile("cpu", profiles.discover())["E4"]
    _override_result(tmp_path / "cpu", exp, {"world_size": 4})
    assert artifact.main(["--list", "--profile", "cpu", "--only", "E4", "-p",
                          "world_size=4"]) == 0
    out = capsys.readouterr().out
    assert "E4" in out and "with -p world_size=4: result: current" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("world_size"))
    assert row.split()[1:3] == ["4", "-p"] and "ranks" in row
    assert artifact.main(["--list", "--profile", "cpu", "--only", "E4", "-p",
                          "world_size=6"]) == 0
    assert "with -p world_size=6: result: none" in capsys.readouterr().out
    for bad in ("world_size=0", "world_sise=4"):  # one line per bad input, exit 2
        with pytest.raises(SystemExit) as exc:
            artifact.main(["--list", "--profile", "cpu", "--only", "E4", "-p", bad])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err


def test_override_claims_say_what_ran_and_which_reference(tmp_path, monkeypatch, capsys):
    """A run with ``-p world_size=4``: its claims rows name the parameters that ran, predict for
    them (from the run's data), prefix the statement, and mark the default run's reference."""
    monkeypatch.setattr(profiles, "RESULTS", tmp_path)
    monkeypatch.setattr(execute, "run_experiment", lambda *a, **k: pytest.fail("it ran"))
    exp = profiles.load_profile("cpu", profiles.discover())["E4"]
    data = results.load_csv(ROOT / "artifact/reference/cpu/E4").assign(world_size=4)
    own = {"world_size": 4}
    _override_result(tmp_path / "cpu", exp, own, data)
    assert artifact.run("cpu", [exp], {"E4": own}) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| C4.")]
    assert rows and all(" | world_size=4 | " in line for line in rows), rows
    written = tmp_path / "cpu" / "claims-E4__world_size=4.md"
    assert str(written) in text
    table = pd.read_csv(tmp_path / "cpu" / "claims-E4__world_size=4.csv", dtype=str).fillna("")
    c41 = table.set_index("claim").loc["C4.1"]
    assert c41.parameters == "world_size=4"
    assert c41.statement.startswith("[this run: -p world_size=4; the statement is for the ")
    assert "at p = 4" in c41.prediction and "p = 8" not in c41.prediction
    assert c41.reference.startswith("(default parameters) ") and "broadcast: best " in c41.reference
    assert table.set_index("claim").loc["C4.3"].reference == ""  # the reference measured nothing
    default = pd.read_csv(tmp_path / "cpu" / "claims.csv", dtype=str)
    assert "parameters" not in default.columns  # the profile's table is the default run's
