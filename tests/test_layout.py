"""The house's layout: the library (``pipecomm.*``) never imports the lab (``pipecomm.lab``), the
import graph has no circle (so no floor imports one above it), and no private name (``_x``) of a
pipecomm module is used outside its package, in the sources, benchmarks, tools and examples."""

from __future__ import annotations

import ast
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


MODULES = _modules()


def _resolve(name: str) -> str:
    while name and name not in MODULES:
        name = name.rsplit(".", 1)[0] if "." in name else ""
    return name


def _package(module: str, path: Path) -> str:
    """The package whose private names ``module`` may use: its own package, or for a module at
    the top (``pipecomm.lab.networks.netem``) the module itself."""
    if path.name == "__init__.py":
        return module
    parent = module.rsplit(".", 1)[0]
    return module if parent == "pipecomm" else parent


def _imports(path: Path) -> list[tuple[str, str]]:
    """(imported module, the name bound or used) of every pipecomm import in ``path``, at any
    depth (imports inside functions count)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipecomm"):
            out += [(node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, "") for a in node.names if a.name.startswith("pipecomm")]
    return out


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for m, path in MODULES.items():
        for mod, name in _imports(path):
            target = _resolve(f"{mod}.{name}" if name else mod)
            if target and target != m:
                edges[m].add(target)
    return edges


def test_the_library_never_imports_the_lab():
    bad = [(m, t) for m, ts in _edges().items() if not m.startswith("pipecomm.lab")
           for t in ts if t.startswith("pipecomm.lab")]
    assert not bad, bad


def test_no_import_circle():
    edges = _edges()

    def related(a: str, b: str) -> bool:  # a package and its own submodules
        return a.startswith(b + ".") or b.startswith(a + ".")

    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> list[str] | None:
        state[m] = 1
        for t in sorted(edges[m]):
            if related(m, t):
                continue
            if state.get(t) == 1:
                return [*path, m, t]
            if t not in state and (cycle := visit(t, [*path, m])):
                return cycle
        state[m] = 2
        return None

    for m in sorted(MODULES):
        if m not in state:
            assert (cycle := visit(m, [])) is None, " -> ".join(cycle)


def test_no_private_name_outside_its_package():
    files = [*SRC.rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
             *(ROOT / "tools").glob("*.py"), *(ROOT / "examples").glob("*.py")]
    bad = []
    for path in files:
        here = next((m for m, p in MODULES.items() if p == path), None)
        pkg = _package(here, path) if here else None
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}  # a name bound to a pipecomm module -> that module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pipecomm"):
                for a in node.names:
                    target = _resolve(f"{node.module}.{a.name}")
                    if target == f"{node.module}.{a.name}":
                        aliases[a.asname or a.name] = target
                    owner = _package(target, MODULES[target]) if target else node.module
                    dotted = f"{node.module}.{a.name}".split(".")
                    if any(part.startswith("_") for part in dotted) and not _inside(pkg, owner):
                        bad.append(f"{path.relative_to(ROOT)}: from {node.module} import {a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.startswith("pipecomm") and a.asname:
                        aliases[a.asname] = _resolve(a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in aliases and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                target = aliases[node.value.id]
                if not _inside(pkg, _package(target, MODULES[target])):
                    bad.append(f"{path.relative_to(ROOT)}: {node.value.id}.{node.attr}")
    assert not bad, bad


def _inside(pkg: str | None, owner: str) -> bool:
    """Whether code of package ``pkg`` may use ``owner``'s private names (its own, or a parent's
    package's)."""
    return pkg is not None and (pkg == owner or pkg.startswith(owner + "."))


# --------------------------------------------------------------------------- the library's size

LIBRARY = [p for p in (SRC / "pipecomm").rglob("*.py") if "lab" not in p.relative_to(SRC).parts]
#: The library's bounds (src/pipecomm minus src/pipecomm/lab): modules and lines, counted as
#: ``find src/pipecomm -name '*.py' -not -path '*/lab/*' | xargs wc -l``.
MAX_MODULES, MAX_LINES = 37, 9000
#: Function-local imports the library keeps, each breaking a genuine cost (the comment at the
#: import says which): (module, imported module).
LOCAL_IMPORTS = {("pipecomm.run", "pipecomm"),  # --help without torch's import
                 ("pipecomm.observe", "pandas")}  # `import pipecomm` loads no pandas


def test_the_entry_points_load_no_lab_module():
    import subprocess
    import sys

    code = ("import sys; import pipecomm.collectives, pipecomm.backend, pipecomm.hooks, "
            "pipecomm.pipesgd, pipecomm.decentralized; "
            "print(sorted(m for m in sys.modules if m.startswith('pipecomm.lab')))")
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=300).stdout
    assert out.strip() == "[]", out


def test_the_library_has_few_modules():
    assert len(LIBRARY) <= MAX_MODULES, f"{len(LIBRARY)} library modules, at most {MAX_MODULES}"


def test_the_library_has_few_lines():
    lines = sum(len(p.read_text().splitlines()) for p in LIBRARY)
    assert lines <= MAX_LINES, f"{lines} library lines, at most {MAX_LINES}"


def test_no_function_local_import_in_the_library():
    bad = []
    for path in LIBRARY:
        module = next(m for m, p in MODULES.items() if p == path)
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Import | ast.ImportFrom):
                    names = [node.module] if isinstance(node, ast.ImportFrom) else \
                        [a.name for a in node.names]
                    bad += [(module, n) for n in names if (module, n) not in LOCAL_IMPORTS]
    assert not bad, bad


# --------------------------------------------------------------------------- the lab's layout

#: The lab's four wings (docs/README.md, "Layout"), and what sits on top of them: the
#: experiments, what their notebooks call, the claims and their ledger, and the orchestrator
#: behind run_all.sh (profiles, executing notebooks, result reuse, the command line and report).
WINGS = {"measure", "networks", "workloads", "training"}
ON_TOP = {"experiments", "experiment", "checks", "notebook", "cli", "meanings", "results",
          "claims", "ledger", "paper_claims", "profiles", "rehearsal", "standin", "execute",
          "reuse", "guard", "schema", "artifact", "report"}


def test_the_lab_is_four_wings_and_what_sits_on_top():
    lab = SRC / "pipecomm" / "lab"
    here = {p.stem for p in lab.glob("*.py") if p.stem != "__init__"} | \
        {p.name for p in lab.iterdir() if (p / "__init__.py").is_file()}
    assert here == WINGS | ON_TOP, (f"not placed: {sorted(here - WINGS - ON_TOP)}; "
                                    f"gone: {sorted(WINGS | ON_TOP - here)}")
