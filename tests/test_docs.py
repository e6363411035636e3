"""The design in docs/ stays true of the code, and the code cites only files in the repository.

* every ``pipecomm.x.y`` name that docs/equations.md (and the other docs/ pages) name in backticks
  imports or resolves as an attribute;
* every claim id named in docs/experiments.md exists in artifact/claims.yaml;
* every docs/ page the index links to exists, and every relative link between pages resolves;
* no file under src/ (nor tools/, benchmarks/, examples/, notebooks/) mentions a design or notes
  file outside the repository (``DESIGN.md``, ``PAPERS.md``, a "notes file", ``notes/``,
  ``../shared`` or ``/work/`` paths), and every ``docs/<page>.md`` such a file cites exists.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
SRC = ROOT / "src"

_NAME = re.compile(r"`(pipecomm(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
# the project's design contract and paper notes live outside the repository under these names;
# docs/papers.md (lower case, inside docs/) is the repository's own page
_FORBIDDEN = re.compile(
    r"(?<![\w/])(?:DESIGN|PAPERS)\.md|(?i:notes file|\bnotes/|\.\./shared|/work/|/shared/)"
)


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of ``dotted``, then walk the attributes.

    Example::

        resolve("pipecomm.pipesgd.PipeSGD.step")   # the function object
    """
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError names the missing piece
        return obj
    raise ModuleNotFoundError(dotted)


def doc_names(page: Path) -> list[str]:
    """The backticked ``pipecomm....`` names of one docs page, in order of appearance."""
    return list(dict.fromkeys(_NAME.findall(page.read_text(encoding="utf-8"))))


def test_equations_index_names_functions():
    names = doc_names(DOCS / "equations.md")
    assert len(names) > 50, "docs/equations.md lost its index"
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not missing, "docs/equations.md names what does not exist:\n" + "\n".join(missing)


@pytest.mark.parametrize(
    "page", sorted(p.name for p in DOCS.glob("*.md") if p.name != "equations.md")
)
def test_other_pages_name_existing_code(page):
    missing = []
    for name in doc_names(DOCS / page):
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not missing, f"docs/{page} names what does not exist:\n" + "\n".join(missing)


def test_resolve_reports_what_is_missing():
    assert resolve("pipecomm.lab.networks.cost.allreduce_time") is importlib.import_module(
        "pipecomm.lab.networks.cost"
    ).allreduce_time
    with pytest.raises(AttributeError):
        resolve("pipecomm.lab.networks.cost.no_such_function")
    with pytest.raises(ModuleNotFoundError):
        resolve("nosuchpackage.x")


def test_experiments_page_names_existing_claims():
    entries = yaml.safe_load((ROOT / "artifact" / "claims.yaml").read_text(encoding="utf-8"))
    ids = {str(e["id"]) for e in entries}
    named = set(re.findall(r"\bC\d+\.\d+\b", (DOCS / "experiments.md").read_text("utf-8")))
    assert named, "docs/experiments.md names no claim"
    assert not named - ids, f"docs/experiments.md names unknown claims {sorted(named - ids)}"


def test_experiments_page_has_no_thresholds():
    # thresholds live only in artifact/claims.yaml: no "within 25%", "at least 1.4x", "<= 1.05"
    text = (DOCS / "experiments.md").read_text(encoding="utf-8")
    text = text.replace("95%", "")  # the confidence level of every interval, not a threshold
    hits = re.findall(r"\d+(?:\.\d+)?\s*%|\d+\.\d+\s*x\b|[<>]=\s*\d", text)
    assert not hits, f"docs/experiments.md states thresholds {hits}; cite artifact/claims.yaml"


def test_links_between_pages_resolve():
    broken = []
    for page in DOCS.glob("*.md"):
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.name} -> {target}")
    assert not broken, f"broken links in docs/: {broken}"
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not list {page.name}"


def _code_files() -> list[Path]:
    """src/ (the library), plus the scripts and notebooks a reader runs."""
    files = sorted(SRC.rglob("*.py"))
    for folder in ("tools", "benchmarks", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return files + sorted((ROOT / "notebooks").glob("*.ipynb"))


def test_source_cites_only_files_in_the_repository():
    offenders, dangling = [], []
    for path in _code_files():
        text = path.read_text(encoding="utf-8")
        for lineno, line in enumerate(text.splitlines(), 1):
            if _FORBIDDEN.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()}")
            for cited in re.findall(r"docs/[A-Za-z0-9_]+\.md", line):
                if not (ROOT / cited).exists():
                    dangling.append(f"{path.relative_to(ROOT)}:{lineno}: {cited}")
    assert not offenders, "code cites files outside the repository:\n" + "\n".join(offenders)
    assert not dangling, "code cites docs pages that do not exist:\n" + "\n".join(dangling)


@pytest.mark.parametrize(
    ("line", "flagged"),
    [
        ("the rule of DESIGN.md", True),
        ("(PAPERS.md)", True),
        ("schedules of /work/notes/algorithms.md", True),
        ("``notes/algorithms.md``", True),
        ("a notes file", True),
        ("../shared/DESIGN.md", True),
        ("docs/papers.md and docs/update_rules.md", False),
        ("the network/ports of a rank", False),
    ],
)
def test_forbidden_pattern(line, flagged):
    assert bool(_FORBIDDEN.search(line)) is flagged


def _refusal(op: str, dtype) -> type[Exception]:
    """The exception pipecomm's process group raises for ``op`` on a ``dtype`` tensor."""
    import torch

    from pipecomm.backend import PipecommProcessGroup

    class _Stub:  # _prepare reads only the options, and only after its checks
        options = None

    try:
        PipecommProcessGroup._prepare(_Stub(), "allreduce", [torch.ones(2, dtype=dtype)], op)
    except (TypeError, ValueError) as exc:
        return type(exc)
    raise AssertionError(f"{op} of {dtype} was not refused")


def test_readme_names_the_errors_the_backend_raises():
    import torch

    text = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    avg_int, max_complex = _refusal("avg", torch.int64), _refusal("max", torch.complex64)
    assert (avg_int, max_complex) == (TypeError, ValueError)
    assert f"AVG of integers is a {avg_int.__name__}" in text
    assert re.search(r"MAX or MIN of complex numbers[^.]*are a " + max_complex.__name__, text)


def test_readme_jupyter_command_runs_as_root():
    """README's one JupyterLab command starts as root too: jupyter refuses root unless
    ServerApp.allow_root (an option only root's start consults)."""
    import shlex

    from jupyter_server.serverapp import ServerApp
    from jupyterlab.labapp import LabApp

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Interactive use", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert len(commands) == 1, "Interactive use gives one command"
    argv = shlex.split(commands[0])
    assert argv[:2] == [".venv/bin/jupyter", "lab"]
    app = LabApp()
    app.parse_command_line(argv[2:])
    assert app.extra_args == [] and app.config.ServerApp.root_dir == "."
    assert ServerApp(config=app.config).allow_root is True


def test_readme_is_a_short_users_guide():
    """The library's guide first, the lab's in docs/lab.md: README at most 300 lines."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail to docs/"
    assert lines.index("## The library") < lines.index("## The lab: reproducing the papers")


def test_readers_pages_name_no_internal_issue_numbers():
    """A reader cannot open the project's issue tracker: ARTIFACT.md, README.md, docs/ and the
    claims' texts they are generated from say what changed, not which issue asked for it."""
    pages = [ROOT / "README.md", ROOT / "artifact" / "ARTIFACT.md", *sorted(
        (ROOT / "docs").glob("*.md")), ROOT / "artifact" / "claims.yaml",
        ROOT / "artifact" / "claims-ledger.yaml", ROOT / "artifact" / "paper-claims.yaml",
        *sorted((ROOT / "artifact" / "profiles").glob("*.yaml"))]
    found = [f"{p.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
             for p in pages for text in [p.read_text(encoding="utf-8")]
             for m in re.finditer(r"\bissues?\s+#?\d+", text)]  # wrapped across lines too
    assert not found, "\n".join(found)
