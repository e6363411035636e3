"""The lab's configuration files, checked against JSON schemas before any work starts.

``artifact/claims.yaml`` (:data:`CLAIMS`) and ``artifact/profiles/*.yaml`` (:data:`PROFILE`) are
read with :func:`load`: a YAML syntax error, an unknown key (``thresholdd:``, ``parms:``), a value
of the wrong type or out of range becomes one :class:`ConfigError` line naming the file, the place
(``claim C4.1``, ``experiments.E4``), the key and what is allowed -- never a traceback at the end
of a run that may have taken hours.

Example::

    >>> from pipecomm.lab import schema
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "cpu.yaml"
    >>> _ = path.write_text("profile: cpu\\nexperiments: {E4: {budget_s: -1}}\\n")
    >>> try:
    ...     schema.load(path, schema.PROFILE)
    ... except schema.ConfigError as exc:
    ...     print(str(exc).split(": ", 1)[1])
    experiments.E4.budget_s: -1 is not allowed (a number > 0)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import jsonschema

PROFILE_NAMES = ["cpu", "cpu-full", "gpu", "shaped"]
KINDS = ["paper", "method", "illustration"]
#: Whose number a paper claim's threshold is: the paper's, pipecomm's model's, the artifact's margin.
BARS = ["paper", "model", "margin"]
_TEXT = {"type": "string", "minLength": 1}

#: One entry of artifact/claims.yaml: what each kind must state (docs/experiments.md, "Claims").
CLAIM: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "kind", "paper", "experiment", "statement"],
    "properties": {
        "id": _TEXT,
        "kind": {"enum": KINDS},
        "paper": _TEXT,
        "experiment": {"type": "string", "pattern": "^E[0-9]+$"},
        "statement": _TEXT,
        "source": _TEXT,
        "paper_value": {"type": ["string", "number"]},
        "prediction": {"type": "string"},
        "threshold_reason": _TEXT,
        "check": _TEXT,
        "args": {"type": ["object", "null"]},
        "profiles": {"type": "array", "minItems": 1, "items": {"enum": PROFILE_NAMES}},
        "bar": {"enum": BARS},
        "supersedes": _TEXT,
        "superseded_by": _TEXT,
        "change": _TEXT,
    },
    "allOf": [
        {"if": {"properties": {"kind": {"enum": ["paper", "method"]}}},
         "then": {"required": ["check", "prediction", "threshold_reason"]}},
        {"if": {"properties": {"kind": {"const": "paper"}}},
         "then": {"required": ["source", "bar"]}},
        {"if": {"required": ["supersedes"]}, "then": {"required": ["change"]}},
    ],
}
CLAIMS: dict[str, Any] = {"type": "array", "items": CLAIM}

#: One claim of the papers in artifact/paper-claims.yaml (pipecomm.lab.paper_claims).
PAPER_CLAIM: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "paper", "claim", "source", "meaning", "claims", "related"],
    "properties": {
        "id": {"type": "string", "pattern": "^(LP|PS|DG|DA)-[0-9]+$"},
        "paper": {"enum": ["LP", "Pipe-SGD", "LW/DGD", "DAdam"]},
        "claim": _TEXT,
        "source": _TEXT,
        "meaning": _TEXT,
        "claims": {"type": "array", "items": _TEXT},
        "related": {"type": "array", "items": _TEXT},
        "decided_in": {"type": "array", "minItems": 1, "items": {"enum": PROFILE_NAMES}},
        "timed": {"type": "boolean"},
        "comparison": _TEXT,
        "regime": _TEXT,
        "why": _TEXT,
        "primary": {"type": "boolean"},
    },
    "allOf": [
        {"if": {"properties": {"claims": {"minItems": 1}}},
         "then": {"required": ["decided_in", "timed", "comparison", "regime"]},
         "else": {"required": ["why"]}},
    ],
}
PAPER_CLAIMS: dict[str, Any] = {"type": "array", "items": PAPER_CLAIM}

#: artifact/profiles/<name>.yaml: which experiments a profile runs, their budgets and parameters.
PROFILE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["profile", "experiments"],
    "properties": {
        "profile": {"enum": PROFILE_NAMES},
        "extends": {"enum": PROFILE_NAMES},
        "backend": {"enum": ["gloo", "nccl"]},
        "experiments": {
            "type": "object",
            "propertyNames": {"pattern": "^E[0-9]+$"},
            "additionalProperties": {
                "type": ["object", "null"],
                "additionalProperties": False,
                "properties": {
                    "budget_s": {"type": "number", "exclusiveMinimum": 0},
                    "params": {"type": ["object", "null"]},
                },
            },
        },
    },
}

_ALLOWED = {  # what a failed keyword allows, in words
    "exclusiveMinimum": lambda s: f"a number > {s['exclusiveMinimum']}",
    "minimum": lambda s: f"a number >= {s['minimum']}",
    "enum": lambda s: "one of " + ", ".join(map(str, s["enum"])),
    "const": lambda s: repr(s["const"]),
    "type": lambda s: "a value of type " + (" or ".join(s["type"]) if isinstance(s["type"], list)
                                            else s["type"]),
    "pattern": lambda s: f"a name matching {s['pattern']}",
    "minLength": lambda s: "a non-empty text",
    "minItems": lambda s: "a non-empty list",
}


class ConfigError(ValueError):
    """A configuration file that cannot be used: one line naming the file, the key, what is
    allowed."""


def _where(error: jsonschema.ValidationError, doc: Any) -> str:
    """``claim C4.1`` or ``experiments.E4.params``: where in the document the error lies."""
    path = list(error.absolute_path)
    if isinstance(doc, list) and path and isinstance(path[0], int):
        entry = doc[path[0]]
        head = f"claim {entry.get('id', '#' + str(path[0] + 1))}" if isinstance(entry, dict) \
            else f"entry {path[0] + 1}"
        return ".".join([head, *map(str, path[1:])])
    return ".".join(map(str, path)) or "the file"


def _message(error: jsonschema.ValidationError, doc: Any) -> str:
    where = _where(error, doc)
    keyword, sub = error.validator, error.schema
    if keyword == "additionalProperties":
        allowed = ", ".join(sorted(sub.get("properties", {})))
        unknown = sorted(set(error.instance) - set(sub.get("properties", {})))
        return f"{where}: unknown key {', '.join(map(repr, unknown))} (allowed: {allowed})"
    if keyword == "required":
        return f"{where}: {error.message.replace(' is a required property', '')} is required"
    if keyword == "propertyNames":
        return f"{where}: key {error.instance!r} is not allowed (a name matching E<number>)"
    allowed = _ALLOWED.get(keyword)
    if allowed is not None:
        return f"{where}: {error.instance!r} is not allowed ({allowed(sub)})"
    return f"{where}: {error.message}"


def _first(errors: list[jsonschema.ValidationError]) -> jsonschema.ValidationError:
    """The error a reader fixes first: the earliest place in the file, the deepest cause."""
    def place(error: jsonschema.ValidationError) -> tuple[list[str], int]:
        path = [f"{p:09d}" if isinstance(p, int) else str(p) for p in error.absolute_path]
        return path, -len(path)

    return min(errors, key=place)


def _jsonschema() -> Any:
    """jsonschema, imported when a file is first checked (a rank process never checks one) and
    without the optional ``rfc3987_syntax`` it would load for the "iri" formats: that import
    builds a grammar and costs about 2 s of CPU per process, and these schemas use no format."""
    if "jsonschema" not in sys.modules and "rfc3987_syntax" not in sys.modules:
        sys.modules["rfc3987_syntax"] = None  # type: ignore[assignment]  # import -> ImportError
        try:
            import jsonschema
        finally:
            del sys.modules["rfc3987_syntax"]
    import jsonschema

    return jsonschema


def load(path: str | Path, schema: dict[str, Any]) -> Any:
    """Read the YAML file ``path`` and check it against ``schema``; returns its contents.

    Raises:
        ConfigError: one line ``<file>: <where>: <what is wrong> (<what is allowed>)``, for a
            missing file, a YAML syntax error (with its line and column) or the first place
            that breaks the schema.
    """
    path = Path(path)
    shown = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"{shown}: cannot be read ({exc.strerror})") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{shown}: YAML syntax error at {at}{problem}") from None
    if doc is None and schema.get("type") == "array":
        doc = []
    errors = list(_jsonschema().Draft202012Validator(schema).iter_errors(doc))
    if errors:
        raise ConfigError(f"{shown}: {_message(_first(errors), doc)}")
    return doc
