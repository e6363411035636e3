"""The command line behind ``run_all.sh``: it selects a profile's experiments
(:mod:`pipecomm.lab.profiles`), runs or reuses each (:mod:`pipecomm.lab.execute`,
:mod:`pipecomm.lab.reuse`), and writes the claims tables, the reference and the report.

Each experiment ``E<k>`` is the notebook ``notebooks/<kk>_<name>.ipynb``. Its parameters are the
notebook's parameters cell (the quick configuration), updated by the profile
(``artifact/profiles/<profile>.yaml``) and then by ``-p NAME=VALUE`` overrides (each parsed to the
type of the parameter's default; unknown names are an error, since papermill would silently accept
them). Results go to ``results/<profile>/<E>/``, or, with overrides, to
``results/<profile>/<E>__<name>=<value>.../`` so the default result is never overwritten. Every
override is checked against the experiment's ``Params`` before any kernel starts. A result is
reused when its parameters and the hash of the code it runs (:func:`pipecomm.lab.reuse.code_hash`: its notebook and
the pipecomm modules its module imports) match (``--force`` re-runs). Each run is assembled in a
temporary directory and renamed into place: an interrupted run (Ctrl-C: one line, exit status
130) leaves nothing half-written, and running again resumes with the experiments still missing.

Usage::

    python -m pipecomm.lab.artifact                   # every experiment, automatic profile
    python -m pipecomm.lab.artifact --only E0 E3 -p sizes_max=1048576
    python -m pipecomm.lab.artifact --list
    python -m pipecomm.lab.artifact --report          # results/<profile>/report/index.html
    python -m pipecomm.lab.artifact --profile cpu --report --reference   # the reference's
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

from pipecomm.lab import claims, execute, guard, profiles, rehearsal, report, results, reuse, schema


def reference_values(profile: str) -> dict[str, str] | None:
    """Claim id -> the reference run's measured value and verdict (``"1.52 [1.5, 1.54]
    (PASS)"``) from ``artifact/reference/<profile>/claims.csv``; None without one.

    Example::

        reference_values("cpu")["C5.3"]   # 'mst/lp 1.52 [1.5, 1.54] (...) (PASS)'
    """
    path = profiles.REFERENCE / profile / "claims.csv"
    if not path.exists():
        return None
    import pandas as pd

    ref = pd.read_csv(path, dtype=str).fillna("")
    return dict(zip(ref["claim"], ref["measured"] + " (" + ref["verdict"] + ")"))


def reference_params(profile: str, eid: str) -> Any:
    """The parameters the reference run of ``eid`` ran with (its ``params.json`` in
    ``artifact/reference/<profile>/<E>/``), None where the reference has none (a profile that
    extends another keeps only the experiments it changes)."""
    try:
        return results.read_json(profiles.REFERENCE / profile / eid / "params.json")
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def override_rows(table: Any, profile: str, exp: profiles.Experiment, own: dict[str, Any]) -> Any:
    """The claims rows of ``exp`` decided on its run with the overrides ``own``, saying so: a
    ``parameters`` column (``world_size=4``), the statement prefixed with what ran (the
    statement itself is claims.yaml's, for the profile's parameters; the prediction is the
    run's own, :func:`pipecomm.lab.claims.predict`), and ``reference`` marked ``(default
    parameters)`` unless the reference run had this run's parameters (blank where the
    reference measured nothing).

    Example::

        override_rows(table, "cpu", exp_e4, {"world_size": 4}).reference.iloc[0]
        # '(default parameters) broadcast: best 47 KiB ... (PASS)'
    """
    rows = table[table.experiment == exp.id].copy()
    text = profiles.override_text(own)
    rows.insert(list(rows.columns).index("experiment") + 1, "parameters", text)
    rows["statement"] = [f"[this run: -p {text}; the statement is for the profile's "
                         f"parameters] {s}" for s in rows["statement"]]
    if "reference" in rows.columns:
        same = results.json_roundtrip(profiles.run_params(exp, own)) == reference_params(profile, exp.id)
        rows["reference"] = [_reference_for(str(v), same) for v in rows["reference"].fillna("")]
    return rows


def override_claims(profile: str, selected: list[profiles.Experiment],
                    overrides: dict[str, dict[str, Any]], dirs: dict[str, Path],
                    states: dict[str, str]) -> dict[Path, Any]:
    """The claims of runs with overrides, each decided on its own directory ``dirs[E]``
    (:func:`override_rows`: they say which parameters ran and which reference they are compared
    with), each written to ``results/<profile>/claims-<E>__<NAME=VALUE>.md`` (and ``.csv``)
    beside the profile's ``claims.md``; returns those paths with their rows.

    Example::

        override_claims("cpu", [exp_e4], {"E4": {"world_size": 4}},
                        {"E4": RESULTS / "cpu/E4__world_size=4"}, {"E4": "current"})
        # {PosixPath('results/cpu/claims-E4__world_size=4.md'): <rows of C4.1, C4.2, C4.3>}
    """
    sub = claims_table(profile, dirs=dirs, write=False, states=[states])
    found = {}
    for exp in selected:
        rows = override_rows(sub, profile, exp, overrides[exp.id])
        name = f"claims-{dirs[exp.id].name}"
        _write_claims(profiles.RESULTS / profile, f"profile {profile}, {exp.id} with -p "
                      f"{profiles.override_text(overrides[exp.id])}", rows, name)
        found[profiles.RESULTS / profile / f"{name}.md"] = rows
    return found


def _reference_for(value: str, same: bool) -> str:
    """A reference cell of an override run's row: blank where the reference measured nothing
    (``" (NOT RUN)"``), as it is when the reference ran the same parameters, else marked
    ``(default parameters)``."""
    if not value or value.startswith(" ("):
        return ""
    return value if same else f"(default parameters) {value}"


def run_dir(profile: str, run: int = 1) -> Path:
    """Where run ``run`` of a profile writes: ``results/<profile>/`` for the first (the default
    results), ``results/<profile>/run-<k>/`` for the independent repeats of ``--runs``.

    Example::

        run_dir("cpu", 2)   # results/cpu/run-2
    """
    if isinstance(run, bool) or not isinstance(run, int) or run < 1:
        raise ValueError(f"run must be an int >= 1, got {run!r}")
    return profiles.RESULTS / profile if run == 1 else profiles.RESULTS / profile / f"run-{run}"


def profile_claims(profile: str) -> list[dict[str, Any]]:
    """The claims a profile's table lists: those of the experiments it runs (E14's claims are
    not in the cpu profile's table), less those that claims.yaml limits to other profiles (a
    rehearsal lists the claims of the profile it rehearses)."""
    runs = profiles.profile_runs(profile)
    own = rehearsal.SOURCE if rehearsal.is_rehearsal(profile) else profile
    return [e for e in claims.load_claims() if (runs is None or e["experiment"] in runs)
            and (e["profiles"] is None or own in e["profiles"])]


def claims_table(profile: str, dirs: dict[str, Path] | None = None, write: bool = True,
                 runs: int = 1, states: list[dict[str, str]] | None = None):
    """Evaluate every claim of the profile's experiments (:func:`profile_claims`) on
    ``results/<profile>`` and write claims.md and claims.csv there. With ``runs`` > 1 every
    run's directory (:func:`run_dir`) is evaluated too, each run k >= 2 gets its own table in
    its directory, and ``results/<profile>/claims.md`` is the table over all runs
    (:func:`pipecomm.lab.claims.combine_runs`: a ``runs`` column, UNSTABLE where they disagree).

    The ``result`` column says how the result each claim was decided on stands: ``states[k]``
    gives it for the experiments a run just ran or reused (``current``, ``old result: its
    re-run failed``); the others are looked up (:func:`result_state`: ``stale: <why>`` where
    the profile's parameters, the code or an input changed since). A rehearsal's tables show
    no verdict (:func:`pipecomm.lab.rehearsal.withhold`: REHEARSED or NOT DECIDED), and its
    claims.md says what it replaced.
    """
    entries = profile_claims(profile)
    reference = reference_values(profile)
    experiments = profiles.load_profile(profile, profiles.discover())
    tables = []
    for k in range(1, runs + 1):
        known = states[k - 1] if states and k <= len(states) else {}
        own = {}
        for eid, exp in experiments.items():
            out = dirs[eid] if dirs and k == 1 and eid in dirs else run_dir(profile, k) / eid
            own[eid] = known.get(eid) or reuse.result_state(exp, profile, out)
        table = claims.evaluate(entries, run_dir(profile, k), dirs=dirs if k == 1 else None,
                                reference=reference, states=own)
        if rehearsal.is_rehearsal(profile):  # the checks ran; their verdicts decide nothing
            where = {eid: dirs[eid] if dirs and k == 1 and eid in dirs else run_dir(profile, k) / eid
                     for eid in experiments}
            table = rehearsal.withhold(table, {e for e, d in where.items()
                                               if (d / "data.csv").exists()})
        tables.append(table)
    table = tables[0] if runs == 1 else claims.combine_runs(tables)
    if write:
        for k, own in enumerate(tables[1:], start=2):
            _write_claims(run_dir(profile, k), f"profile {profile}, run {k} of {runs}", own)
        title = f"profile {profile}" + (f", {runs} independent runs" if runs > 1 else "")
        extra = ""
        if rehearsal.is_rehearsal(profile):
            title = f"{rehearsal.BANNER} (results/{profile})"
            extra = rehearsal.replaced_markdown(experiments)
        _write_claims(profiles.RESULTS / profile, title, table, extra=extra)
    return table


def _write_claims(folder: Path, title: str, table: Any, name: str = "claims",
                  extra: str = "") -> None:
    text = f"# Claims, {title}\n\n" + claims.to_markdown(table) + (f"\n{extra}" if extra else "")
    results.write_text(folder / f"{name}.md", text)
    results.write_csv(folder / f"{name}.csv", table)


def save_reference(profile: str, source: Path | None = None, dest: Path | None = None) -> Path:
    """Copy a complete run of ``profile`` into ``artifact/reference/<profile>/``, compactly (a
    profile that extends another keeps only the experiments it changes, :func:`own_experiments`):
    data.csv gzipped, figure.png, the executed notebook with its figure as one compact PNG
    (:func:`pipecomm.lab.report.inline_figure`), params.json, env.json, and the claims table
    (claims.md, claims.csv); the
    independent repeats of ``--runs`` (``run-<k>/``) keep their data, params, env and claims.
    Refuses a result that is not current (:func:`result_state`).

    Example::

        python -m pipecomm.lab.artifact --profile cpu --save-reference
    """
    import gzip

    import nbformat

    source = source or profiles.RESULTS / profile
    dest = dest or profiles.REFERENCE / profile
    runs = profiles.profile_runs(profile)
    wanted = profiles.own_experiments(profile) if runs is not None else None
    if wanted is None:  # a self-contained profile keeps every experiment it runs
        wanted = runs if runs is not None else list(profiles.discover())
    missing = [e for e in wanted if not (source / e / "data.csv").exists()]
    if missing:
        raise profiles.UsageError(f"{source} lacks results for {missing}: run them first")
    repeats = sorted((d for d in source.glob("run-*") if (d / "claims.csv").exists()),
                     key=lambda d: int(d.name.split("-")[1]))
    for d in repeats:
        lacking = [e for e in wanted if not (d / e / "data.csv").exists()]
        if lacking:
            raise profiles.UsageError(f"{d} lacks results for {lacking}: finish the run (--runs) first")
    experiments = profiles.load_profile(profile, profiles.discover()) if runs is not None else profiles.discover()
    for d in [source, *repeats]:  # a reference is made of current results only
        for eid in wanted:
            state = reuse.result_state(experiments[eid], profile, d / eid)
            if state != "current":
                raise profiles.UsageError(f"{profiles.shown_path(d / eid)}: {state}: run it again first")
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    for d in repeats:  # independent repeats: their data and claims, no notebooks or figures
        for eid in wanted:
            (tmp / d.name / eid).mkdir(parents=True)
            with gzip.open(tmp / d.name / eid / "data.csv.gz", "wb", compresslevel=9) as f:
                f.write((d / eid / "data.csv").read_bytes())
            for name in ("params.json", "env.json", "calibration.json"):
                if (d / eid / name).exists():
                    shutil.copy2(d / eid / name, tmp / d.name / eid / name)
        for name in ("claims.md", "claims.csv"):
            shutil.copy2(d / name, tmp / d.name / name)
    for eid in wanted:
        src, out = source / eid, tmp / eid
        out.mkdir(parents=True)
        with gzip.open(out / "data.csv.gz", "wb", compresslevel=9) as f:
            f.write((src / "data.csv").read_bytes())
        for name in ("figure.png", "params.json", "env.json", "calibration.json"):
            if (src / name).exists():
                shutil.copy2(src / name, out / name)
        nb = nbformat.read(src / "notebook.ipynb", as_version=4)
        if (src / "figure.png").exists():  # its figure inline, small: figure.png is beside it
            report.inline_figure(nb, src / "figure.png")
        report.tidy_streams(nb)  # a progress bar's redraws: its last line
        nbformat.write(nb, out / "notebook.ipynb")
        execute.relocate_notebook(out / "notebook.ipynb", source / eid)  # no machine's paths
    for name in ("claims.md", "claims.csv"):
        shutil.copy2(source / name, tmp / name)
    results.replace_dir(tmp, dest)
    return dest


class _Parser(argparse.ArgumentParser):
    """A refused option is one line, naming it (``./run_all.sh --help`` shows the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _Once(argparse.Action):
    """An option that may be given once (a second ``--profile`` is an error, not the winner)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if getattr(namespace, f"_{self.dest}_given", False):
            def show(v: Any) -> str:
                return " ".join(v) if isinstance(v, list) else str(v)

            parser.error(f"{option_string} is given twice ({show(getattr(namespace, self.dest))} "
                         f"and {show(values)}): give it once")
        setattr(namespace, f"_{self.dest}_given", True)
        setattr(namespace, self.dest, values)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The options of ``run_all.sh`` / ``python -m pipecomm.lab.artifact``."""
    p = _Parser(
        prog="run_all.sh",
        description="Reproduce the pipecomm experiments (notebooks executed with papermill) "
        "and check every claim.",
    )
    p.add_argument("--profile", choices=profiles.PROFILE_NAMES, default=None, action=_Once,
                   help="parameter set (default: gpu if >= 2 GPUs are visible, else cpu)")
    p.add_argument("--only", nargs="+", metavar="E", default=None, action=_Once,
                   help="run (or --list) only these experiments (e.g. E0 E3)")
    p.add_argument("-p", "--param", action="append", default=[], metavar="NAME=VALUE",
                   help="override a parameter (once per name); written to its own directory")
    p.add_argument("--force", action="store_true", help="re-run even if a result matches")
    p.add_argument("--runs", type=_positive_int, default=1, action=_Once, metavar="N",
                   help="run the profile N times, independently (results/<profile>/run-<k>/ "
                   "for k >= 2); the claims table gets a runs column and UNSTABLE where the "
                   "runs disagree")
    p.add_argument("--list", action="store_true",
                   help="list experiments: budget, parameters, whether each result (the "
                   "profile's and every -p run's) is current; with -p: that run's")
    p.add_argument("--save-reference", action="store_true",
                   help="copy results/<profile> to artifact/reference/<profile> (maintainers)")
    p.add_argument("--report", action="store_true",
                   help="write results/<profile>/report/index.html (claims, figures, rendered "
                   "notebooks) from the results there, running nothing; a full run writes it too")
    p.add_argument("--reference", action="store_true",
                   help="with --report: the report of the committed reference run, "
                   "artifact/reference/<profile>/report/")
    p.add_argument("--rehearse", action="store_true",
                   help="with --profile gpu (the default with it): rehearse the gpu profile on "
                   "CPUs -- every experiment with scaled-down parameters, gloo on CPU for NCCL, "
                   "a generated stand-in for CIFAR-10 -- into results/gpu-rehearsal/; it "
                   "decides nothing")
    p.add_argument("--timeout-factor", type=float, default=3.0,
                   help="hard limit per experiment = factor x budget (min 120 s)")
    return p


def select(experiments: dict[str, profiles.Experiment], only: list[str] | None,
           profile: str) -> list[profiles.Experiment]:
    """The experiments ``--only`` names (all of the profile's without it); an id no profile
    has, or one another profile runs, is a :class:`UsageError`."""
    if not only:
        return list(experiments.values())
    bad = [e for e in only if e.upper() not in experiments]
    elsewhere = {e: profiles.profiles_of(e.upper()) for e in bad}
    unknown = [e for e in bad if not elsewhere[e]]
    if unknown:
        raise profiles.UsageError(f"unknown experiment id(s) {unknown}; available: {list(experiments)}")
    if bad:
        raise profiles.UsageError(f"experiment(s) {bad} are not in profile {profile!r}; the profiles "
                         f"that run them: {elsewhere}")
    return [experiments[e.upper()] for e in dict.fromkeys(only)]


def _short(value: Any, width: int = 28) -> str:
    text = repr(value) if not isinstance(value, float) else f"{value:g}"
    return text if len(text) <= width else text[: width - 3] + "..."


def _param_rows(exp: profiles.Experiment, own: dict[str, Any]) -> list[str]:
    """``--list``'s parameter rows of ``exp`` run with the overrides ``own``: name, value, a
    mark (``*`` the profile changes the notebook's default, ``-p`` the command line does),
    meaning."""
    from pipecomm.lab import meanings

    params = profiles.run_params(exp, own)
    width = max((len(k) for k in params), default=0)
    rows = []
    for name, value in params.items():
        changed = "*" if results.json_roundtrip(value) != results.json_roundtrip(
            exp.defaults.get(name)) else " "
        mark = "-p" if name in own else f"{changed} "
        rows.append(f"     {name:{width}}  {_short(value):28}{mark} "
                    f"{meanings.meaning(exp.id, name)}")
    return rows


def _list_entry(exp: profiles.Experiment, profile: str, own: dict[str, Any]) -> list[str]:
    """``--list``'s lines for one experiment: its result with the profile's parameters and
    every override result (without ``-p``), or the result of the run with ``own``."""
    head = f"\n{exp.id:4} {exp.title:26} budget {exp.budget_s:5.0f} s   "
    if own:
        out = profiles.RESULTS / profile / profiles.override_dirname(exp.id, own)
        state = reuse.result_state(exp, profile, out, profiles.run_params(exp, own))
        where = f" ({profiles.shown_path(out)})" if state != "none" else ""
        return [f"{head}with -p {profiles.override_text(own)}: result: {state}{where}",
                *_param_rows(exp, own)]
    state = reuse.result_state(exp, profile)
    where = f" ({profiles.shown_path(profiles.RESULTS / profile / exp.id)})" if state != "none" else ""
    lines = [f"{head}result: {state}{where}"]
    for out in reuse.override_dirs(exp, profile):
        other, params = reuse.override_state(exp, profile, out)
        shown = profiles.override_text(params) if params else out.name.split("__", 1)[-1]
        lines.append(f"     with -p {shown}: result: {other} ({profiles.shown_path(out)})")
    return lines + _param_rows(exp, {})


def list_table(selected: list[profiles.Experiment], profile: str,
               overrides: dict[str, dict[str, Any]] | None = None) -> str:
    """``--list``: per experiment its budget and how ``results/<profile>/<E>/`` stands
    (:func:`result_state`), one line per override result ``<E>__.../`` (:func:`override_state`),
    then one row per parameter: name, the profile's value, meaning. With ``overrides`` (``--list
    -p NAME=VALUE``) an experiment they change shows that run instead: its parameters and how
    its result stands.

    Example::

        print(list_table([discover()["E4"]], "cpu", {"E4": {"world_size": 4}}))
    """
    lines = [f"profile {profile}: experiment, budget, result; its parameters (default in this "
             f"profile, * where the profile changes the notebook's quick default, -p where the "
             f"command line does; meaning)"]
    for exp in selected:
        lines += _list_entry(exp, profile, (overrides or {}).get(exp.id, {}))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status (2: usage, 1: an experiment failed, 130:
    interrupted)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.rehearse:
        return _main(parser, args, args.profile or profiles.auto_profile())
    try:
        check_rehearse_options(args)
    except profiles.UsageError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    # a loaded 2-core host: a rehearsal's hard limit is at least 5 x its budget
    args.timeout_factor = max(args.timeout_factor, 5.0)
    with rehearsal.session(profiles.RESULTS / rehearsal.NAME):  # the stand-ins, for check and run
        return _main(parser, args, rehearsal.NAME)


def check_rehearse_options(args: argparse.Namespace) -> None:
    """Refuse (:class:`UsageError`) what ``--rehearse`` cannot go with: another profile than
    gpu (the only one it rehearses), ``--save-reference`` and ``--reference`` (a rehearsal is
    never a reference), ``--runs`` (it decides nothing, so repeating it decides nothing either).

    Example::

        check_rehearse_options(build_parser().parse_args(["--rehearse", "--profile", "cpu"]))
        # UsageError: --rehearse rehearses the gpu profile only, not --profile cpu ...
    """
    if args.profile not in (None, rehearsal.SOURCE):
        raise profiles.UsageError(f"--rehearse rehearses the {rehearsal.SOURCE} profile only, not "
                         f"--profile {args.profile} (which runs on this machine as it is): use "
                         f"--profile {rehearsal.SOURCE} --rehearse")
    if args.save_reference or args.reference:
        raise profiles.UsageError("a rehearsal is never a reference run: --rehearse takes no "
                         "--save-reference or --reference")
    if args.runs > 1:
        raise profiles.UsageError("--rehearse runs once (it decides nothing, so repeats decide nothing "
                         "either): it takes no --runs")


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace, profile: str) -> int:
    """:func:`main` for ``profile`` (``gpu-rehearsal`` with ``--rehearse``)."""
    try:
        claims.load_claims()  # a broken claims.yaml is one line now, not after hours of runs
        experiments = profiles.load_profile(profile, profiles.discover())
        selected = select(experiments, args.only, profile)
        overrides = profiles.parse_overrides(args.param, selected)
        if args.list:
            if args.param:  # a refused value is one line, as for a run
                profiles.check_params(selected, overrides)
            print(list_table(selected, profile, overrides))
            return 0
        if args.runs > 1 and args.param:
            raise profiles.UsageError("--runs repeats the profile's own parameters; it takes no -p")
        if args.reference and not args.report:
            raise profiles.UsageError("--reference goes with --report (the reference run's report)")
        if args.report:
            if args.param or args.only:
                raise profiles.UsageError("--report shows a whole profile; it takes no --only or -p")
            print(f"wrote {profiles.shown_path(write_report(profile, reference=args.reference))}")
            return 0
        if args.save_reference:  # then its report, which the copy replaced
            print(f"wrote {save_reference(profile).relative_to(profiles.ROOT)}")
            print(f"wrote {profiles.shown_path(write_report(profile, reference=True))}")
            return 0
        profiles.check_profile_host(profile)
        profiles.check_params(selected, overrides)
    except (profiles.UsageError, schema.ConfigError, rehearsal.RehearsalError) as exc:  # one line
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    return run(profile, selected, overrides, force=args.force,
               timeout_factor=args.timeout_factor, runs=args.runs,
               report_after=not args.only and not args.param)


def write_report(profile: str, reference: bool = False) -> Path:
    """The report of ``results/<profile>`` (or of ``artifact/reference/<profile>``) in its
    ``report/`` folder (:func:`pipecomm.lab.report.build`); returns its index.html.

    Raises:
        UsageError: there is no claims table to report (run the profile first).

    Example::

        write_report("cpu", reference=True)   # artifact/reference/cpu/report/index.html
    """
    base = (profiles.REFERENCE if reference else profiles.RESULTS) / profile
    title = f"{'reference run, ' if reference else ''}profile {profile}"
    if rehearsal.is_rehearsal(profile):
        title = f"{rehearsal.BANNER} (results/{profile})"
    try:
        return report.build(base, title=title)
    except FileNotFoundError as exc:
        raise profiles.UsageError(str(exc)) from exc


_UNITS = {"ms": 1e-3, "us": 1e-6, "s": 1.0, "B/s": 1.0, "MB/s": 1e6, "GB/s": 1e9}


_ADVICE = re.compile(r"(raise|lower) (\w+) to at (least|most) ([0-9.]+(?:e[+-]?\d+)?) "
                     r"(ms|us|s|B/s|MB/s|GB/s)")


def _round(value: float, up: bool) -> float:
    """``value`` to two significant digits, rounded up (``up``) or down."""
    if value <= 0 or not math.isfinite(value):
        return value
    scale = 10 ** (math.floor(math.log10(value)) - 1)
    return (math.ceil if up else math.floor)(value / scale - 1e-9 * up) * scale


def host_too_slow_advice(exp: profiles.Experiment, text: str, overrides: dict[str, Any],
                         profile: str) -> str:
    """netem's HostTooSlow message in the terms of ``exp``'s parameters (``alpha_s`` of E0's
    network is ``emu_alpha_s``; of E10-E13's, ``intra_alpha_s``), ending with the command that
    runs it on this host.

    Example::

        host_too_slow_advice(discover()["E0"], "...; raise alpha_s to at least 2.48 ms", {},
                             "cpu")   # '...; raise emu_alpha_s ...: ./run_all.sh ... -p emu_alpha_s=0.0025'
    """
    names = set(exp.defaults) - set(profiles.RESERVED)
    fixes: list[str] = []

    def rename(match: re.Match) -> str:
        verb, name, bound, number, unit = match.groups()
        own = next((c for c in (name, f"emu_{name}", f"intra_{name}") if c in names), name)
        value = _round(float(number) * _UNITS[unit], up=verb == "raise")
        if not fixes and own in names:
            fixes.append(f"-p {own}={value:.2g}")
        return f"{verb} {own} to at {bound} {number} {unit}"

    text = _ADVICE.sub(rename, text)
    if not fixes:
        return text
    given = [f"-p {shlex.quote(f'{k}={v}')}" for k, v in overrides.items()
             if not fixes[0].startswith(f"-p {k}=")]
    prof = "" if profile == profiles.auto_profile() else f" --profile {profile}"
    load = ""
    with contextlib.suppress(OSError, AttributeError):
        load = f" (load average now {os.getloadavg()[0] / (os.cpu_count() or 1):.1f} per core)"
    return (f"{text}{load}; to run it here: ./run_all.sh{prof} --only {exp.id} "
            f"{' '.join([*given, fixes[0]])}")


def failure_message(exp: profiles.Experiment, exc: BaseException, overrides: dict[str, Any],
                    profile: str) -> str:
    """One line on why an experiment failed: the notebook's exception (papermill's ``ename``
    and ``evalue``), without its source lines; a HostTooSlow names the experiment's parameter
    and the ``-p`` to pass (:func:`host_too_slow_advice`)."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        lines = str(exc).strip().splitlines()
        evalue = " | ".join(lines[-6:])
    text = " ".join(str(evalue).split())
    if ename == "HostTooSlow":
        text = host_too_slow_advice(exp, text, overrides, profile)
    return f"{ename}: {text}"


class _Interrupt:
    """SIGINT (Ctrl-C) or SIGTERM (what SLURM and Kubernetes send) while experiments run: with
    a kernel running, kill it (the notebook then fails quietly and :func:`run` reports);
    otherwise raise KeyboardInterrupt. ``signum`` says which came (the exit status is 128 +
    it: 130, 143)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def interrupted(self) -> bool:
        return self.signum is not None

    def __call__(self, signum: int, frame: Any) -> None:
        import logging

        self.signum = signum
        logging.disable(logging.CRITICAL)  # the notebook's failure is ours: no tracebacks
        if not execute.stop_kernels():
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def installed(self):
        """This handler for :data:`SIGNALS` inside the block (in the main thread; elsewhere
        unchanged)."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        old = {sig: signal.signal(sig, self) for sig in self.SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)


@contextlib.contextmanager
def _quiet():
    """Silence stderr and logging while an interrupted run cleans up (asyncio's "Task exception
    was never retrieved", nbclient's dead-kernel errors)."""
    import logging

    old_level = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    devnull = open(os.devnull, "w")  # noqa: SIM115
    old_err, sys.stderr = sys.stderr, devnull
    try:
        yield
    finally:
        sys.stderr = old_err
        devnull.close()
        logging.disable(old_level)


def interrupted_line(current: str | None, finished: list[str], word: str = "interrupted") -> str:
    """What a Ctrl-C (``word`` "interrupted") or a SIGTERM ("terminated") prints (one line).

    Example::

        interrupted_line("E4", [])   # 'interrupted: E4; nothing was written; re-run to resume'
    """
    kept = f"{', '.join(finished)} finished and kept" if finished else ""
    if current is None:
        where = f"after {kept}" if finished else "before the first experiment; nothing was written"
        return f"{word}: {where}; re-run to resume"
    return f"{word}: {current}; nothing was written{' for it (' + kept + ')' if kept else ''}" \
           "; re-run to resume"


def claims_report(table: Any, selected: list[str], profile: str | None = None) -> str:
    """The claims rows of the experiments run now, one line on how many others there are (the
    whole table is in claims.md) and, given the ``profile``, the papers' 36 claims in
    categories on this run's verdicts (:func:`pipecomm.lab.paper_claims.run_summary`: C2.9 and
    the other method claims are not the papers', and a threshold that is pipecomm's model is
    named)."""
    from pipecomm.lab import claims as claims_mod
    from pipecomm.lab import paper_claims

    mine = table[table.experiment.isin(selected)]
    text = claims_mod.to_text(mine) if len(mine) else "(these experiments have no claims)\n"
    others = table[~table.experiment.isin(selected)]
    if len(others):
        word = rehearsal.NOT_DECIDED if (others.verdict == rehearsal.NOT_DECIDED).any() \
            else claims_mod.NOT_RUN  # a rehearsal's table has no NOT RUN
        not_run = int((others.verdict == word).sum())
        text += (f"{len(others)} claims of other experiments are not shown ({not_run} of them "
                 f"{word})\n")
    if profile is not None and not rehearsal.is_rehearsal(profile):  # a rehearsal decides nothing
        text += "\n" + paper_claims.run_summary(table, profile) + "\n"
    return text


def where_result(out: Path) -> str:
    """Where a finished result's figure and data are, relative to the repository.

    Example::

        where_result(RESULTS / "cpu/E4")   # 'figure results/cpu/E4/figure.png, data results/...'
    """
    parts = [f"figure {profiles.shown_path(out / 'figure.png')}"] if (out / "figure.png").exists() else []
    return ", ".join([*parts, f"data {profiles.shown_path(out / 'data.csv')}"])


def run(profile: str, selected: list[profiles.Experiment], overrides: dict[str, dict[str, Any]],
        force: bool = False, timeout_factor: float = 3.0, runs: int = 1,
        report_after: bool = False) -> int:
    """Run ``selected`` (reusing current results) ``runs`` times, independently (run k in
    :func:`run_dir`), print where each result is and the claims of the experiments run (and,
    with ``report_after``, write the report, :func:`write_report`); returns the exit status (1: an experiment failed, 2: the results directory is in use or
    cannot be written, 130: Ctrl-C, 143: SIGTERM).

    Holds ``results/<profile>/.lock`` throughout (:func:`pipecomm.lab.guard.locked`) and first
    removes what killed runs left there; a result that is not current says why in one line
    before it runs again."""
    base = profiles.RESULTS / profile
    try:
        guard.check_writable(base)
        with guard.locked(base):
            guard.remove_debris(base)
            guard.remove_dead_kernel_dirs()
            if rehearsal.is_rehearsal(profile):  # its data stand-ins and their record
                rehearsal.prepare(base)
            status = _run_locked(profile, selected, overrides, force, timeout_factor, runs)
    except (guard.Busy, OSError) as exc:
        print(f"{Path(sys.argv[0]).name or 'pipecomm'}: {exc}", file=sys.stderr)
        return 2
    if report_after and status in (0, 1):
        try:
            print(f"report: {profiles.shown_path(write_report(profile))}")
        except (profiles.UsageError, OSError) as exc:
            print(f"report not written: {exc}", file=sys.stderr)
    return status


def _run_locked(profile: str, selected: list[profiles.Experiment], overrides: dict[str, dict[str, Any]],
                force: bool, timeout_factor: float, runs: int) -> int:
    from tqdm.std import tqdm

    failures, dirs, finished = [], {}, []
    states: list[dict[str, str]] = [{} for _ in range(runs)]  # how each result stands, per run
    current: str | None = None
    guard_ = _Interrupt()
    bar = None
    try:
        with guard_.installed():
            execute.ensure_kernel()
            total = sum(e.budget_s for e in selected) * runs
            times = f" x {runs} independent runs" if runs > 1 else ""
            if rehearsal.is_rehearsal(profile):
                print(rehearsal.BANNER, flush=True)
                for line in rehearsal.findings(profiles.load_profile(profile, profiles.discover())):
                    print(f"found: {line}", flush=True)
            print(f"profile {profile}: {len(selected)} experiment(s){times}, budget "
                  f"{total / 60:.1f} min", flush=True)
            for k in range(1, runs + 1):
                base = run_dir(profile, k)
                label = f"run {k}/{runs} " if runs > 1 else ""
                bar = tqdm(selected, desc=f"{label}experiments", unit="exp", file=sys.stdout,
                           disable=not execute.is_terminal())
                for exp in bar:
                    if guard_.interrupted:  # Ctrl-C as a notebook finished: it was kept
                        raise KeyboardInterrupt
                    current = f"{label}{exp.id}"
                    bar.set_postfix_str(exp.id)
                    own = overrides.get(exp.id, {})
                    params = profiles.run_params(exp, own)
                    out = base / profiles.override_dirname(exp.id, own)
                    if k == 1:
                        dirs[exp.id] = out
                    calibration = reuse.calibration_of(base)
                    if calibration is not None:
                        os.environ["PIPECOMM_CALIBRATION"] = str(calibration)
                    state = reuse.result_state(exp, profile, out, params)
                    if not force and state == "current":
                        states[k - 1][exp.id] = "current"
                        tqdm.write(f"{label}{exp.id}: current, reused: {where_result(out)}")
                        continue
                    if state.startswith("stale"):
                        tqdm.write(f"{label}{exp.id}: {state}; running it again")
                    try:
                        wall = execute.run_experiment(exp, profile, params, out, timeout_factor)
                    except Exception as exc:
                        if guard_.interrupted:
                            raise KeyboardInterrupt from None
                        failures.append(f"{label}{exp.id}")
                        states[k - 1][exp.id] = "old result: its re-run failed"
                        tqdm.write(f"{label}{exp.id}: FAILED: "
                                   f"{failure_message(exp, exc, own, profile)}")
                        continue
                    states[k - 1][exp.id] = "current"
                    finished.append(f"{label}{exp.id}")
                    current = None
                    tqdm.write(f"{label}{exp.id}: done in {wall:.1f} s{budget_note(exp, wall)}: "
                               f"{where_result(out)}")
                if guard_.interrupted:
                    raise KeyboardInterrupt
                bar.close()
            current = "the claims table"  # written atomically: the old one or the new one
            table = claims_table(profile, write=True, runs=runs, states=states)
    except KeyboardInterrupt:
        with _quiet():
            execute.stop_kernels()
            if bar is not None:
                bar.close()
        term = guard_.signum == signal.SIGTERM
        print(f"\n{interrupted_line(current, finished, 'terminated' if term else 'interrupted')}",
              flush=True)
        return 128 + (guard_.signum or signal.SIGINT)
    base = profiles.RESULTS / profile
    extra = {k: v for k, v in dirs.items() if v.name != k}
    if extra:  # the runs with overrides are judged on their own directories, and say so
        import pandas as pd

        own = override_claims(profile, [e for e in selected if e.id in extra], overrides,
                              extra, states[0])
        table = pd.concat([table[~table.experiment.isin(list(extra))], *own.values()])
        table = table.fillna("")
        shown = ", ".join(profiles.shown_path(p) for p in own)
        print(f"\nclaims of {', '.join(extra)} on the run(s) with -p overrides (with their "
              f"statements, predictions and references: {shown}):")
    print()
    print(claims_report(table, list(dirs), profile), end="")
    over = f", {runs} independent runs" if runs > 1 else ""
    print(f"(all claims of profile {profile}, default parameters{over}: "
          f"{profiles.shown_path(base / 'claims.md')})")
    if rehearsal.is_rehearsal(profile):
        print(f"{rehearsal.BANNER}; what it replaced: {profiles.shown_path(base / 'claims.md')} and "
              f"each experiment's env.json (rehearsal)")
    if failures:
        print(f"experiments that failed: {', '.join(failures)} (their claims above are "
              "decided on the old result, where there is one: see the result column)",
              file=sys.stderr)
        return 1
    return 0


def budget_note(exp: profiles.Experiment, wall: float) -> str:
    """A calm note when a run took longer than its budget, with the host's load.

    Example::

        budget_note(exp, 40.0)   # ' (over its 35 s budget; load average 1.9 per core)'
    """
    if wall <= exp.budget_s:
        return ""
    load = ""
    with contextlib.suppress(OSError, AttributeError):
        load = f"; load average {os.getloadavg()[0] / (os.cpu_count() or 1):.1f} per core"
    return f" (over its {exp.budget_s:.0f} s budget{load})"


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())

