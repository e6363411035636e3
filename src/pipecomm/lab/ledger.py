"""The pre-registration ledger: every version of every claim, when it was stated, what it decides.

A claim's protocol, regime, threshold and gates are fixed before the run that decides it. Its
definition is the hash of the fields of its ``artifact/claims.yaml`` entry that say what the
verdict decides (:func:`pipecomm.lab.claims.definition`); its *regime* in a profile is the hash
of the parameters its experiment runs with there (the notebook's defaults updated by
``artifact/profiles/<profile>.yaml``, :func:`regimes`). ``artifact/claims-ledger.yaml`` records,
for every version of every claim (``C9.2`` is version a, ``C9.2b`` version b):

* ``stated`` and ``commit``: the first commit whose claims.yaml holds this definition (and kept
  it since), and that commit's date -- found in git, never typed in (:func:`update`);
* ``definition``, ``kind`` and ``regime`` (per profile) as they were stated;
* ``verdicts``, for a version a newer one replaced: its reference verdicts, frozen when it was
  replaced, so that they are shown (ARTIFACT.md's history table) after the references move on;
* ``amendments``: a reclassification (``kind``) or a parameter change that leaves the regime as
  it was, each with its date and reason, shown in the history table too.

Every claims table records each verdict's definition (the ``definition`` column of claims.csv),
so a reference verdict names what it decided. :func:`problems` lists, one line per claim, every
way the three disagree: a definition changed after a run (a new version is due: ``C5.4b``,
``supersedes: C5.4``), a regime or kind changed without an amendment, a version without a
ledger record, a reference that decided a version before its commit. tests/test_claims_ledger.py
fails on any of them; ``tools/claims_ledger.py`` updates the ledger and records amendments.

Example::

    from pipecomm.lab import ledger
    print("\\n".join(ledger.problems()) or "ledger in order")
"""

from __future__ import annotations

import copy
import datetime
import functools
import hashlib
import json
import subprocess
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from pipecomm.lab import claims
from pipecomm.lab.results import REPO_ROOT

_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where there is one: 30 files
LEDGER_FILE = REPO_ROOT / "artifact" / "claims-ledger.yaml"
REFERENCE = REPO_ROOT / "artifact" / "reference"
#: The profiles whose reference claims tables the ledger reads (those that exist).
REFERENCE_PROFILES = ("cpu", "cpu-full", "shaped", "gpu")
#: Verdicts that decided nothing: a version with none of the others has never run.
NOT_DECIDED = (claims.NOT_RUN, claims.MODEL, "")
HEADER = """\
# The pre-registration ledger of artifact/claims.yaml (docs/experiments.md, "Versions").
# Written by tools/claims_ledger.py (update; amend ID --reason TEXT); checked by
# tests/test_claims_ledger.py. One record per version of a claim (C9.2 is version a, C9.2b b):
#   stated, commit  the first commit whose claims.yaml holds this definition (found in git);
#                   empty until the version is committed -- it must be, before its first run
#   definition      pipecomm.lab.claims.definition of the entry: what its verdict decides
#   kind            paper, method or illustration, as stated (a change is an amendment)
#   regime          per profile, the hash of its experiment's parameters there (notebook
#                   defaults and artifact/profiles/<profile>.yaml); for the versions stated
#                   before this ledger began (2026-12-02) recorded on that day
#   verdicts        a superseded version's reference verdicts, frozen when it was superseded
#   amendments      a reclassification or a regime-neutral parameter change, with its reason
"""


# --------------------------------------------------------------------------- hashes


def regime_hash(params: dict[str, Any]) -> str:
    """16 hex digits of SHA-256 over an experiment's parameters as canonical JSON.

    Example::

        >>> regime_hash({"world_size": 8, "nbytes": 1 << 20}) == regime_hash({"nbytes": 1048576,
        ...                                                                 "world_size": 8})
        True
    """
    text = json.dumps(params, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def regimes(entries: list[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Claim id -> {profile: regime hash} for every profile that lists the claim (it runs the
    claim's experiment and the claim's ``profiles`` admit it): the hash of the parameters the
    experiment runs with there (:func:`pipecomm.lab.profiles.run_params`).

    Example::

        regimes(claims.load_claims())["C5.4"]   # {'cpu': '...', 'cpu-full': '...', ...}
    """
    from pipecomm.lab import profiles, results

    found = profiles.discover()
    per_profile: dict[str, dict[str, str]] = {}
    for name in profiles.PROFILE_NAMES:
        if not (profiles.PROFILES / f"{name}.yaml").exists():
            continue
        exps = profiles.load_profile(name, copy.deepcopy(found))
        per_profile[name] = {eid: regime_hash(results.json_roundtrip(profiles.run_params(e)))
                             for eid, e in exps.items() if eid in found}
    out = {}
    for e in entries:
        out[e["id"]] = {name: exps[e["experiment"]] for name, exps in per_profile.items()
                        if e["experiment"] in exps
                        and (e.get("profiles") is None or name in e["profiles"])}
    return out


# --------------------------------------------------------------------------- references


def reference_tables(root: Path = REFERENCE) -> dict[str, pd.DataFrame]:
    """Every reference claims table: ``"cpu"`` (the profile's table over its runs) and
    ``"cpu/run-2"`` (an independent run's own), read as text.

    Example::

        sorted(reference_tables())   # ['cpu', 'cpu-full', 'cpu/run-2', 'cpu/run-3', 'shaped', ...]
    """
    out = {}
    for name in REFERENCE_PROFILES:
        for path in sorted((root / name).glob("**/claims.csv")) if (root / name).is_dir() else []:
            label = str(path.parent.relative_to(root))
            if label.count("/") > 1 or "report" in label:
                continue
            out[label] = pd.read_csv(path, dtype=str, keep_default_na=False)
    return out


def decided(tables: dict[str, pd.DataFrame], claim_id: str) -> dict[str, dict[str, str]]:
    """The verdicts the references' profile tables give ``claim_id`` where they decided
    something (not NOT RUN, not an illustration): ``{profile: {"verdict", "runs",
    "measured"}}``.

    Example::

        decided(reference_tables(), "C5.4")["cpu"]["verdict"]   # 'FAIL'
    """
    out = {}
    for label, table in tables.items():
        if "/" in label:
            continue
        rows = table[table["claim"] == claim_id]
        if rows.empty or rows["verdict"].iloc[0] in NOT_DECIDED:
            continue
        row = rows.iloc[0]
        out[label] = {"verdict": row["verdict"], "runs": row.get("runs", ""),
                      "measured": row.get("measured", "")}
    return out


# --------------------------------------------------------------------------- git


def _git(*args: str, root: Path = REPO_ROOT) -> str | None:
    """``git args`` in the repository; None where there is no git or no repository."""
    try:
        proc = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def has_git(root: Path = REPO_ROOT) -> bool:
    """Whether ``root`` is a git checkout with its whole history (an archived snapshot or a
    shallow clone cannot show where a version was first stated: the checks that need git are
    left out there)."""
    if _git("rev-parse", "--verify", "HEAD", root=root) is None:
        return False
    return (_git("rev-parse", "--is-shallow-repository", root=root) or "").strip() != "true"


def claims_history(root: Path = REPO_ROOT) -> list[tuple[str, str, dict[str, str]]]:
    """The commits that changed artifact/claims.yaml, oldest first (first parents), each with
    its date and the definition of every claim its file states: ``(sha, date, {id: hash})``."""
    log = _git("log", "--first-parent", "--reverse", "--format=%H %cs", "--",
               "artifact/claims.yaml", root=root)
    out = []
    for line in (log or "").splitlines():
        sha, date = line.split()
        text = _git("show", f"{sha}:artifact/claims.yaml", root=root)
        try:
            doc = yaml.load(text or "", Loader=_LOADER) or []
        except yaml.YAMLError:
            continue
        defs = {e["id"]: claims.definition(e) for e in doc
                if isinstance(e, dict) and "id" in e}
        out.append((sha, date, defs))
    return out


def first_stated(claim_id: str, definition: str,
                 history: list[tuple[str, str, dict[str, str]]]) -> tuple[str, str] | None:
    """The commit (and its date) from which claims.yaml has stated ``claim_id`` with
    ``definition`` without a break up to the last commit of ``history``; None when the last
    commit does not state it so (not committed yet).

    Example::

        >>> h = [("a1", "2026-11-21", {"C1": "x"}), ("b2", "2026-11-25", {"C1": "y"}),
        ...      ("c3", "2026-11-28", {"C1": "y", "C2": "z"})]
        >>> first_stated("C1", "y", h), first_stated("C2", "z", h), first_stated("C1", "x", h)
        (('b2', '2026-11-25'), ('c3', '2026-11-28'), None)
    """
    found = None
    for sha, date, defs in reversed(history):
        if defs.get(claim_id) != definition:
            break
        found = (sha, date)
    return found


def states(commit: str, claim_id: str, definition: str, root: Path = REPO_ROOT) -> bool:
    """Whether claims.yaml at ``commit`` states ``claim_id`` with ``definition`` (a version
    stated on a branch: the first-parent history of main shows it first at the merge)."""
    text = _git("show", f"{commit}:artifact/claims.yaml", root=root)
    try:
        doc = yaml.load(text or "", Loader=_LOADER) or []
    except yaml.YAMLError:
        return False
    return any(isinstance(e, dict) and e.get("id") == claim_id
               and claims.definition(e) == definition for e in doc)


@functools.lru_cache(maxsize=64)
def decided_at(path: Path, root: Path = REPO_ROOT) -> str | None:
    """The commit that recorded the verdicts of a reference claims table: the newest commit
    that changed any claim's verdict, runs or measured value in it (a commit that only added a
    column, such as the definitions, decided nothing); None if git does not track it."""
    rel = str(path.relative_to(root))
    log = _git("log", "--first-parent", "--format=%H", "--", rel, root=root)
    shas = (log or "").split()

    def verdicts(sha: str) -> set[tuple[str, ...]]:
        import io

        text = _git("show", f"{sha}:{rel}", root=root)
        if not text:
            return set()
        t = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
        cols = [c for c in ("claim", "verdict", "runs", "measured") if c in t.columns]
        return set(t[cols].itertuples(index=False, name=None))

    for sha, older in zip(shas, [*shas[1:], None]):
        if older is None or verdicts(sha) != verdicts(older):
            return sha
    return None


@functools.lru_cache(maxsize=1024)
def is_ancestor(a: str, b: str, root: Path = REPO_ROOT) -> bool:
    """Whether commit ``a`` is ``b`` or one of its ancestors."""
    try:
        proc = subprocess.run(["git", "-C", str(root), "merge-base", "--is-ancestor", a, b],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0


# --------------------------------------------------------------------------- the ledger


def load_ledger(path: Path = LEDGER_FILE) -> dict[str, dict[str, Any]]:
    """artifact/claims-ledger.yaml: claim id -> its record ({} when there is none yet)."""
    if not Path(path).exists():
        return {}
    return yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}


def write_ledger(ledger: dict[str, dict[str, Any]], path: Path = LEDGER_FILE) -> None:
    """Write the ledger (its header, then one record per version in claims.yaml's order)."""
    from pipecomm.lab import results

    body = yaml.safe_dump(ledger, sort_keys=False, allow_unicode=True, width=100)
    results.write_text(path, HEADER + body)


def problems(entries: list[dict[str, Any]] | None = None,
             ledger: dict[str, dict[str, Any]] | None = None,
             tables: dict[str, pd.DataFrame] | None = None,
             current_regimes: dict[str, dict[str, str]] | None = None,
             git: bool | None = None, root: Path = REPO_ROOT) -> list[str]:
    """Every disagreement between claims.yaml, the ledger and the reference claims tables, one
    line each, naming the claim and what to do (empty when all is in order):

    * a version without a ledger record, or whose definition, kind or regime differs from its
      record (a definition changed after a run needs a new version; before its first run the
      record is restated by ``tools/claims_ledger.py update``; a kind or a regime-neutral
      parameter change is an amendment with its reason);
    * a reference verdict decided on a definition other than the entry's (its
      ``definition`` column);
    * a superseded version whose reference verdicts are not frozen in the ledger, or are not
      those the references give while they still hold it;
    * with git: a recorded commit that does not state the version, a reference decided before
      the version's commit, a decided version with no commit.

    Example::

        problems()   # [] when claims.yaml, the ledger and the references agree
    """
    entries = claims.load_claims(superseded=True) if entries is None else entries
    ledger = load_ledger() if ledger is None else ledger
    tables = reference_tables(root / "artifact" / "reference") if tables is None else tables
    current_regimes = regimes(entries) if current_regimes is None else current_regimes
    git = has_git(root) if git is None else git
    out: list[str] = []
    by_id = {e["id"]: e for e in entries}
    history = claims_history(root) if git else []
    for e in entries:
        cid, rec = e["id"], ledger.get(e["id"])
        d = claims.definition(e)
        ran = decided(tables, cid)
        if rec is None:
            out.append(f"{cid}: no record in artifact/claims-ledger.yaml: state it with "
                       f"tools/claims_ledger.py update and commit it before its first run")
            continue
        if rec.get("definition") != d:
            if ran:
                out.append(f"{cid}: its definition changed after a run ({', '.join(ran)}): "
                           f"restore it and state the change as a new version (a new entry "
                           f"with supersedes: {cid}, and superseded_by on this one)")
            else:
                out.append(f"{cid}: its definition changed since it was stated, before any "
                           f"run: record it again with tools/claims_ledger.py update")
        if rec.get("kind") != e["kind"]:
            out.append(f"{cid}: kind {e['kind']} in claims.yaml, {rec.get('kind')} in the "
                       f"ledger: record the reclassification and why with "
                       f"tools/claims_ledger.py amend {cid} --reason TEXT")
        if not e.get("superseded_by"):
            now = set(current_regimes.get(cid, {}))
            was = set(rec.get("regime") or {})
            if now != was:
                out.append(f"{cid}: evaluated in {', '.join(sorted(now)) or 'no profile'}, "
                           f"stated for {', '.join(sorted(was)) or 'no profile'}: record why "
                           f"with tools/claims_ledger.py amend {cid} --reason TEXT")
            for name, h in current_regimes.get(cid, {}).items():
                if rec.get("regime", {}).get(name) != h:
                    out.append(f"{cid}: {e['experiment']}'s parameters in profile {name} "
                               f"changed since it was stated: state a new version, or record "
                               f"why the regime is the same with tools/claims_ledger.py amend "
                               f"{cid} --reason TEXT")
        if e.get("superseded_by"):
            frozen = rec.get("verdicts") or {}
            for name, v in ran.items():
                if name not in frozen:
                    out.append(f"{cid}: superseded by {e['superseded_by']}, but its {name} "
                               f"verdict is not frozen in the ledger: run "
                               f"tools/claims_ledger.py update")
                elif frozen[name].get("verdict") != v["verdict"]:
                    out.append(f"{cid}: the ledger's frozen {name} verdict "
                               f"{frozen[name].get('verdict')} is not the reference's "
                               f"{v['verdict']}")
        if git:
            commit = rec.get("commit")
            if commit and rec.get("definition") == d:
                stated = first_stated(cid, d, history)
                if stated is None or not (stated[0] == commit or states(commit, cid, d, root)
                                          and is_ancestor(commit, stated[0], root)):
                    where = "no commit states it yet" if stated is None else \
                        f"the first commit that states it is {stated[0][:10]}"
                    out.append(f"{cid}: the ledger's commit {commit[:10]} is not where this "
                               f"definition was stated ({where}): run "
                               f"tools/claims_ledger.py update")
            elif ran:
                out.append(f"{cid}: decided by a reference ({', '.join(ran)}) but no commit "
                           f"states it: a version is committed before its first run")
    for label, table in tables.items():
        if "definition" not in table.columns:
            out.append(f"artifact/reference/{label}/claims.csv has no definition column: "
                       f"tools/claims_ledger.py backfill")
            continue
        for row in table.itertuples():
            e = by_id.get(row.claim)
            if e is None or not row.definition or row.verdict in NOT_DECIDED:
                continue
            if row.definition != claims.definition(e):
                out.append(f"{row.claim}: the {label} reference decided definition "
                           f"{row.definition}, claims.yaml now states "
                           f"{claims.definition(e)}: a definition changed after a run is a new "
                           f"version (a new entry with supersedes: {row.claim})")
            elif git:
                commit = (ledger.get(row.claim) or {}).get("commit")
                path = root / "artifact" / "reference" / label / "claims.csv"
                wrote = decided_at(path, root)
                if commit and wrote and not is_ancestor(commit, wrote, root):
                    out.append(f"{row.claim}: the {label} reference was decided at "
                               f"{wrote[:10]}, before the commit {commit[:10]} that states "
                               f"it: a version is committed before its first run")
    for cid, rec in ledger.items():
        if cid not in by_id and not rec.get("withdrawn"):
            out.append(f"{cid}: in the ledger but not in claims.yaml: a version is superseded "
                       f"(superseded_by), never deleted")
    return out


def update(today: str | None = None, root: Path = REPO_ROOT,
           path: Path = LEDGER_FILE) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Bring the ledger up to date with claims.yaml and git, where that rewrites no history:
    a record for each new version (its regime and kind as they are now), the commit and date
    that state each version once it is committed, a version's definition again where no
    reference has decided it yet, and the frozen reference verdicts of each superseded
    version. Returns the ledger and what it refused (a definition changed after a run, a
    regime or kind change: :func:`problems` names them; see :func:`amend`).

    Example::

        ledger, refused = update()   # tools/claims_ledger.py update
    """
    today = today or datetime.date.today().isoformat()
    entries = claims.load_claims(superseded=True)
    old = load_ledger(path)
    tables = reference_tables(root / "artifact" / "reference")
    now = regimes(entries)
    history = claims_history(root) if has_git(root) else []
    new: dict[str, dict[str, Any]] = {}
    for e in entries:
        cid, d = e["id"], claims.definition(e)
        rec = dict(old.get(cid) or {})
        ran = decided(tables, cid)
        if not rec:
            rec = {"kind": e["kind"], "stated": today, "commit": None, "definition": d,
                   "regime": now.get(cid, {})}
        elif rec.get("definition") != d and not ran:  # restated before its first run
            rec.update(stated=today, commit=None, definition=d)
        if rec.get("definition") == d:
            stated = first_stated(cid, d, history)
            if stated is not None:
                rec["commit"], rec["stated"] = stated
        if e.get("superseded_by"):
            frozen = dict(rec.get("verdicts") or {})
            for name, v in ran.items():
                wrote = decided_at(root / "artifact" / "reference" / name / "claims.csv", root)
                frozen.setdefault(name, {**v, "reference": wrote or ""})
            if frozen:
                rec["verdicts"] = frozen
        new[cid] = _ordered(rec)
    for cid, rec in old.items():  # a withdrawn record stays
        new.setdefault(cid, rec)
    refused = problems(entries, new, tables, now, git=bool(history), root=root)
    return new, refused


def amend(claim_id: str, reason: str, today: str | None = None,
          path: Path = LEDGER_FILE) -> dict[str, dict[str, Any]]:
    """Record that ``claim_id``'s kind or its experiment's parameters changed without changing
    what its verdict decides, and why: the record takes the current kind and regime, and its
    ``amendments`` list says what changed, when and why (the history table shows it). A
    definition is never amended: a changed definition is a new version.

    Example::

        amend("C2.9", "the port model is context, not the LP paper: a method claim")
    """
    if not reason.strip():
        raise ValueError("an amendment needs its reason")
    today = today or datetime.date.today().isoformat()
    entries = {e["id"]: e for e in claims.load_claims(superseded=True)}
    if claim_id not in entries:
        raise ValueError(f"{claim_id} is not in artifact/claims.yaml")
    ledger = load_ledger(path)
    rec = ledger.get(claim_id)
    if rec is None:
        raise ValueError(f"{claim_id} has no ledger record: tools/claims_ledger.py update first")
    e = entries[claim_id]
    now = regimes([e])[claim_id]
    changed = []
    if rec.get("kind") != e["kind"]:
        changed.append(f"kind {rec.get('kind')} -> {e['kind']}")
        rec["kind"] = e["kind"]
    was = rec.get("regime") or {}
    moved = sorted(name for name in now if name in was and was[name] != now[name])
    if moved:
        changed.append("regime in " + ", ".join(moved))
    added, dropped = sorted(set(now) - set(was)), sorted(set(was) - set(now))
    if added:
        changed.append("evaluated in " + ", ".join(added))
    if dropped:
        changed.append("no longer evaluated in " + ", ".join(dropped))
    if moved or added or dropped:
        rec["regime"] = now
    if not changed:
        raise ValueError(f"{claim_id}: its kind and regime are as recorded: nothing to amend")
    rec.setdefault("amendments", []).append({"date": today, "changed": "; ".join(changed),
                                             "reason": " ".join(reason.split())})
    ledger[claim_id] = _ordered(rec)
    return ledger


_ORDER = ("kind", "stated", "commit", "definition", "regime", "verdicts", "amendments",
          "withdrawn")


def _ordered(rec: dict[str, Any]) -> dict[str, Any]:
    return {k: rec[k] for k in (*_ORDER, *sorted(set(rec) - set(_ORDER))) if k in rec}


def backfill_definitions(root: Path = REPO_ROOT) -> list[Path]:
    """Give each reference claims table written before tables recorded definitions its
    ``definition`` column: each claim's definition in the claims.yaml of the commit that
    recorded its verdicts (:func:`decided_at`, from git), blank for a claim that file did not
    state. Returns the tables written.

    Example::

        backfill_definitions()   # tools/claims_ledger.py backfill
    """
    written = []
    for label in reference_tables(root / "artifact" / "reference"):
        path = root / "artifact" / "reference" / label / "claims.csv"
        table = pd.read_csv(path, dtype=str, keep_default_na=False)
        if "definition" in table.columns:
            continue
        commit = decided_at(path, root)
        text = _git("show", f"{commit}:artifact/claims.yaml", root=root) if commit else None
        if text is None:
            raise RuntimeError(f"{path}: no commit recorded it: its definitions cannot be known")
        defs = {e["id"]: claims.definition(e) for e in yaml.safe_load(text)}
        table["definition"] = [defs.get(c, "") for c in table["claim"]]
        table.to_csv(path, index=False)
        written.append(path)
    return written
