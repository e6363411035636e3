"""Result reuse: when a finished result of an experiment may stand in for running it again.

A result ``results/<profile>/<E>/`` is *current* while everything it was made from is unchanged:
its parameters (``params.json``), the code it ran (:func:`code_hash`: its notebook and the
pipecomm modules its experiment imports), the files it read from other results or from the data
directory (:func:`inputs`: E0's ``calibration.json``, a data set's files), and its own files as
they were written. :func:`write_manifest` records the last at write time (each file's size and
sha256, data.csv's row count, the inputs' sha256) in ``manifest.json``; :func:`stale_reason`
checks all of it and says in one line what differs. Nothing that fails a check is reused.

Example::

    from pipecomm.lab import reuse
    reuse.stale_reason(out, params, reuse.code_hash(exp), reuse.inputs(exp, params, cal))
    # None (current), or e.g. 'data.csv has 212 bytes, 18,344 when it was written'
"""

from __future__ import annotations

import ast
import csv
import hashlib
import re
from pathlib import Path
from typing import Any

from pipecomm.lab import profiles, results

ROOT = results.REPO_ROOT
SRC = ROOT / "src"
MANIFEST = "manifest.json"
#: The files every finished result holds (its notebook writes the first, the orchestrator the rest).
REQUIRED = ("data.csv", "notebook.ipynb", "params.json", "env.json")
#: Packages whose modules count whole when one of them is imported (they load their submodules
#: lazily, by name); pipecomm itself and pipecomm.lab.experiments count module by module.
_WHOLE_PACKAGES = ("pipecomm.collectives", "pipecomm.decentralized", "pipecomm.pipesgd")


# --------------------------------------------------------------------------- the code it ran


def _module_file(name: str) -> Path | None:
    base = SRC.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def code_files(notebook: Path) -> list[Path]:
    """The files a result of the experiment of ``notebook`` depends on: the notebook and every
    pipecomm module its experiment module imports, directly or through other pipecomm modules
    (imports anywhere in a module, read from the source; a package of :data:`_WHOLE_PACKAGES`
    counts whole).

    Example::

        [p.name for p in code_files(Path("notebooks/01_lp_cost_model.ipynb"))][:1]
        # ['01_lp_cost_model.ipynb']
    """
    files = {notebook}
    todo = [f"pipecomm.lab.experiments.e{notebook.stem}"]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # parent packages run too
        whole = next((w for w in _WHOLE_PACKAGES if name == w or name.startswith(w + ".")), None)
        if whole is not None and whole not in seen:
            todo += [f"{whole}.{p.stem}" for p in _module_file(whole).parent.glob("*.py")
                     if p.stem != "__init__"]
        path = _module_file(name)
        if path is None:
            continue
        files.add(path)
        package = name if path.name == "__init__.py" else ".".join(parts[:-1])
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "pipecomm"]
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    mod = ".".join([*up, mod] if mod else up)
                if mod.split(".")[0] == "pipecomm":
                    todo += [mod, *(f"{mod}.{a.name}" for a in node.names)]
    return sorted(files)


def code_hash(notebook: Path) -> str:
    """A hash of the contents of :func:`code_files` (paths relative to the repository): a result
    is current while it matches; a commit that touches only docs or other experiments keeps it.

    Example::

        code_hash(Path("notebooks/01_lp_cost_model.ipynb"))   # '3f2a...' (16 hex digits)
    """
    digest = hashlib.sha256()
    for path in code_files(notebook):
        digest.update(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path).encode())
        digest.update(b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------- what it read


def sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            digest.update(piece)
    return digest.hexdigest()


def _shown(path: Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def inputs(eid: str, params: dict[str, Any], calibration: Path | None) -> dict[str, str]:
    """The files a run of experiment ``eid`` reads that other runs write, each with its sha256:
    E0's ``calibration.json`` (the orchestrator hands it to every later experiment, whose cost
    models and LP block size read it), and the files of the data directory ``data_root`` for
    experiments that take one. A result made from other inputs is stale.

    Example::

        inputs("E4", {}, Path("results/cpu/E0/calibration.json"))   # {'calibration': '9c1e...'}
    """
    found: dict[str, str] = {}
    if calibration is not None and eid != "E0" and calibration.is_file():
        found["calibration"] = sha256(calibration)
    root = params.get("data_root")
    if isinstance(root, str) and root:
        base = Path(root) if Path(root).is_absolute() else ROOT / root
        if base.is_dir():
            for path in sorted(p for p in base.rglob("*") if p.is_file()):
                if path.name != "README.md" and not path.name.startswith("."):
                    found[_shown(path)] = sha256(path)
    return found


# --------------------------------------------------------------------------- its own files


def csv_rows(path: Path) -> int:
    """Data rows of a CSV file (quoted newlines kept inside their row), header excluded."""
    with open(path, newline="") as f:
        return max(0, sum(1 for _ in csv.reader(f)) - 1)


def write_manifest(out: Path, inputs_used: dict[str, str]) -> None:
    """Record what the finished result in ``out`` consists of: every file's size and sha256,
    data.csv's row count and the inputs it read (:func:`inputs`), in ``out/manifest.json``
    (written last, atomically).

    Example::

        write_manifest(tmp, inputs("E4", params, calibration))   # before the rename into place
    """
    files = {rel: {"bytes": (out / rel).stat().st_size, "sha256": sha256(out / rel)}
             for rel in _own_files(out)}
    manifest = {"files": files, "rows": {"data.csv": csv_rows(out / "data.csv")},
                "inputs": inputs_used}
    results.write_json(out / MANIFEST, manifest)


def _own_files(out: Path) -> list[str]:
    """The files of a result, relative to it: all but the manifest and hidden ones (a reader's
    ``.ipynb_checkpoints/``)."""
    return sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()
                  and p.name != MANIFEST
                  and not any(part.startswith(".") for part in p.relative_to(out).parts))


def _read(path: Path) -> Any:
    try:
        return results.read_json(path)
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _file_reason(out: Path, rel: str, want: Any) -> str | None:
    path = out / rel
    if not isinstance(want, dict):
        return f"{MANIFEST} is damaged (entry of {rel})"
    if not path.is_file():
        return f"{rel} is missing"
    size, was = path.stat().st_size, want.get("bytes")
    if size != was:
        was = f"{was:,}" if isinstance(was, int) else repr(was)
        return f"{rel} has {size:,} bytes, {was} when it was written"
    if sha256(path) != want.get("sha256"):
        return f"{rel} changed since it was written (sha256 differs)"
    return None


def _differing(old: Any, new: Any) -> str:
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    names = sorted(k for k in set(old) | set(new) if old.get(k, ...) != new.get(k, ...))
    return f" ({', '.join(names[:4])}{', ...' if len(names) > 4 else ''})" if names else ""


def stale_reason(out: Path, params: dict[str, Any], code: str,
                 inputs_now: dict[str, str]) -> str | None:
    """Why the result in ``out`` cannot be reused for a run with ``params``, the code of hash
    ``code`` and the inputs ``inputs_now`` -- one line naming what differs -- or None when it
    can (current). Never raises on damaged files: a file of any shape is a reason.

    Example::

        stale_reason(RESULTS / "cpu/E4", params, code_hash(nb), inputs("E4", params, cal))
        # 'figure.png is missing'
    """
    if not out.is_dir():
        return "no result"
    manifest = _read(out / MANIFEST)
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return f"no valid {MANIFEST} (written before manifests existed, or damaged)"
    files = manifest["files"]
    missing = [name for name in REQUIRED if name not in files]
    if missing:
        return f"{MANIFEST} lists no {', '.join(missing)}"
    for rel, want in files.items():
        reason = _file_reason(out, str(rel), want)
        if reason:
            return reason
    extra = [rel for rel in _own_files(out) if rel not in files]
    if extra:
        return f"{extra[0]} is not part of the result as it was written"
    rows = (manifest.get("rows") or {}).get("data.csv") if isinstance(manifest.get("rows"),
                                                                      dict) else None
    try:
        got = csv_rows(out / "data.csv")
    except (OSError, UnicodeDecodeError, csv.Error):
        got = None
    if got is None or got != rows:
        return f"data.csv has {got} rows, {rows} when it was written"
    old = _read(out / "params.json")
    new = results.json_roundtrip(params)
    if old != new:
        return f"made with other parameters{_differing(old, new)}"
    env = _read(out / "env.json")
    old_code = env.get("code_hash") if isinstance(env, dict) else None
    if old_code != code:
        return f"made by other code (code hash {old_code} now {code})"
    used = manifest.get("inputs")
    if used != inputs_now:
        used = used if isinstance(used, dict) else {}
        changed = sorted(k for k in set(used) | set(inputs_now) if used.get(k) != inputs_now.get(k))
        names = ["E0's calibration.json" if k == "calibration" else k for k in changed]
        return f"its input {', '.join(names[:3])} changed since it ran"
    return None


# --------------------------------------------------------------------------- a result's state


def calibration_of(base: Path) -> Path | None:
    """E0's calibration in the run directory ``base``, which every later experiment reads."""
    path = base / "E0" / "calibration.json"
    return path if path.is_file() else None


def why_stale(exp: profiles.Experiment, out: Path, params: dict[str, Any]) -> str | None:
    """Why ``out`` cannot stand in for a run of ``exp`` with ``params`` (one line), or None when
    it is current: :func:`stale_reason` with today's code and inputs (E0's
    calibration beside ``out``)."""
    used = inputs(exp.id, params, calibration_of(out.parent))
    return stale_reason(out, params, code_hash(exp.notebook), used)


def result_state(exp: profiles.Experiment, profile: str, out: Path | None = None,
                 params: dict[str, Any] | None = None) -> str:
    """``current`` (reusable with the profile's parameters, today's code and inputs, its files as
    written), ``stale: <why>`` (there, but not reusable) or ``none`` -- of ``out`` (default
    ``results/<profile>/<E>/``).

    Example::

        result_state(discover()["E1"], "cpu")   # 'stale: figure.png is missing'
    """
    out = profiles.RESULTS / profile / exp.id if out is None else out
    if not out.is_dir() or not any(out.iterdir()):
        return "none"
    reason = why_stale(exp, out, profiles.run_params(exp) if params is None else params)
    return "current" if reason is None else f"stale: {reason}"


def override_state(exp: profiles.Experiment, profile: str, out: Path) -> tuple[str, dict[str, Any] | None]:
    """How the override result ``out`` (``results/<profile>/<E>__.../``) stands, and the
    overrides it was run with: the parameters of its params.json that its name names (a run
    with ``-p`` of those writes there). Then :func:`result_state` against ``run_params(exp,
    overrides)`` -- ``current`` when that ``-p`` run would reuse it, ``stale: <why>`` when the
    profile, the code or a file changed since --; ``stale`` too when its params.json is
    unreadable, names a parameter the experiment no longer has or does not give its name
    (the overrides are then those that differ from the profile's, :func:`override_of`).

    Example::

        override_state(exp_e4, "cpu", RESULTS / "cpu/E4__world_size=4")
        # ('current', {'world_size': 4})
    """
    try:
        params = results.read_json(out / "params.json")
    except (OSError, ValueError, UnicodeDecodeError):
        params = None
    if not isinstance(params, dict):
        return "stale: params.json is missing or not a JSON object", None
    named = {k: v for k, v in params.items()
             if re.search(rf"(?:__|,){re.escape(str(k))}=", out.name)}
    if named and profiles.override_dirname(exp.id, named) == out.name:
        gone = sorted(set(named) - set(profiles.run_params(exp)))
        if gone:
            return f"stale: made with parameters {exp.id} no longer has ({', '.join(gone)})", named
        return result_state(exp, profile, out, profiles.run_params(exp, named)), named
    own = profiles.override_of(exp, params) or {}
    shown = profiles.override_text(own) or "the profile's own parameters"
    return (f"stale: its params.json holds {shown}, a run of which goes to "
            f"{profiles.override_dirname(exp.id, own)}"), own


def override_dirs(exp: profiles.Experiment, profile: str) -> list[Path]:
    """Every override result of ``exp`` in ``results/<profile>/``: its ``<E>__*/`` folders.

    Example::

        override_dirs(exp_e4, "cpu")   # [PosixPath('results/cpu/E4__world_size=4')]
    """
    base = profiles.RESULTS / profile
    return sorted(p for p in base.glob(f"{exp.id}__*") if p.is_dir()) if base.is_dir() else []

