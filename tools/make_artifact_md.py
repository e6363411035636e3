"""Fill the generated sections of artifact/ARTIFACT.md and docs/papers.md from
artifact/claims.yaml, artifact/paper-claims.yaml, artifact/claims-ledger.yaml, the reference
claims tables and the profiles.

    .venv/bin/python tools/make_artifact_md.py          # rewrite in place
    .venv/bin/python tools/make_artifact_md.py --check  # exit 1 if either file is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "artifact" / "ARTIFACT.md"
PAPERS_DOC = ROOT / "docs" / "papers.md"
sys.path.insert(0, str(ROOT / "src"))


def _claims(superseded: bool = False) -> list[dict]:
    """claims.yaml's entries, checked (the current versions, or every version)."""
    from pipecomm.lab import claims

    return claims.load_claims(superseded=superseded)


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _args(args: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items())


REFERENCE_PROFILES = ("cpu", "shaped", "cpu-full")  # the profiles with a reference run here


def _reference(profile: str):
    """The reference run's claims table of ``profile``: the rows of its own experiments and of
    the claims claims.yaml still states (a claim removed from claims.yaml is no claim of the
    artifact any more, whatever an older reference run decided about it)."""
    import pandas as pd

    path = ROOT / "artifact" / "reference" / profile / "claims.csv"
    if not path.exists():
        return None
    table = pd.read_csv(path, dtype=str).fillna("")
    ran = {d.name for d in path.parent.iterdir() if d.is_dir()}
    stated = {c["id"] for c in yaml.safe_load((ROOT / "artifact" / "claims.yaml").read_text())}
    # cpu-full keeps only its own experiments
    return table[table["experiment"].isin(ran) & table["claim"].isin(stated)]


def _meaning(profile: str, row) -> str:
    """One sentence per profile: reproduced, contradicted (with the numbers), or not decidable
    here (and why) -- from the reference run's verdict and what it measured."""
    verdict, measured = row["verdict"], _cell(row["measured"])
    runs = f" ({row['runs']})" if row.get("runs", "") else ""
    if verdict == "PASS":
        return f"{profile}: reproduced{runs}"
    if verdict == "FAIL":
        return f"{profile}: contradicted in the regime tested{runs}: {measured}"
    if verdict == "UNSTABLE":
        return f"{profile}: not decidable here, the independent runs disagree ({row['runs']}): " \
               f"{measured}"
    if verdict == "INCONCLUSIVE":
        why = measured.split("cannot decide:", 1)
        reason = why[1].strip() if len(why) == 2 else f"the interval straddles the threshold: " \
                                                         f"{measured}"
        return f"{profile}: not decidable here{runs}: {reason}"
    return f"{profile}: {verdict}: {measured}"


def paper_verdicts_section() -> str:
    """The papers' claims first: one row per paper claim, its verdict per profile, what it
    means."""
    claims = [c for c in _claims() if c.get("kind") == "paper"]
    refs = {name: _reference(name) for name in REFERENCE_PROFILES}
    refs = {k: v.set_index("claim") for k, v in refs.items() if v is not None}
    lines = ["| claim | the paper says (source) | checked here | "
             + " | ".join(refs) + " | what it means |",
             "|---|---|---|" + "---|" * len(refs) + "---|"]
    for c in claims:
        cells, meaning = [], []
        for name, table in refs.items():
            if c["id"] not in table.index:
                cells.append("-")
                continue
            row = table.loc[c["id"]]
            runs = f" ({row['runs']})" if row.get("runs", "") else ""
            cells.append(f"{row['verdict']}{runs}")
            if row["verdict"] not in ("NOT RUN",):
                meaning.append(_meaning(name, row))
        said = f"{_cell(c.get('paper_value', ''))} ({_cell(c['source'])})"
        bar = " (threshold from pipecomm's model)" if c.get("bar") == "model" else ""
        never = (f"a new version of {c['supersedes']} (history table), not run yet"
                 if c.get("supersedes") else "not run in any reference")
        lines.append(f"| {c['id']} | {said} | {_cell(c['statement'])}{bar} | " + " | ".join(cells)
                     + f" | {_cell('; '.join(meaning)) or never} |")
    return "\n".join(lines)


def claims_section() -> str:
    claims = _claims()
    titles = {"paper": "The papers' claims", "method": "Method claims (pipecomm's own models, "
              "emulator and targets)", "illustration": "Model illustrations (no verdict)"}
    parts = []
    for kind, title in titles.items():
        head = "| claim | experiment | statement (checked) | "
        head += "source | the paper's number | " if kind == "paper" else ""
        head += "model prediction | threshold (check arguments) | why this threshold |"
        lines = [f"**{title}**", "", head, "|" + "---|" * (head.count("|") - 1)]
        for c in (c for c in claims if c.get("kind") == kind):
            if kind == "illustration":
                pred, thr, why = _cell(c.get("prediction", "")) or "(model illustration)", \
                    "no verdict", ""
            else:
                pred, thr, why = c["prediction"], f"`{c['check']}`: {_args(c['args'])}", \
                    c["threshold_reason"]
            paper = f"{_cell(c['source'])} | {_cell(c.get('paper_value', ''))} | " \
                if kind == "paper" else ""
            lines.append(f"| {c['id']} | {c['experiment']} | {_cell(c['statement'])} | {paper}"
                         f"{_cell(pred)} | {_cell(thr)} | {_cell(why)} |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def reference_section(profile: str) -> str:
    path = ROOT / "artifact" / "reference" / profile / "claims.csv"
    table = _reference(profile)
    if table is None:
        return f"(no reference run of the {profile} profile yet)"
    runs = "runs" in table.columns
    n = len(list(path.parent.glob("run-*"))) + 1
    what = f"{n} independent runs" if runs else "reference run"
    kinds = {c["id"]: c for c in _claims(superseded=True)}
    lines = [f"The `{profile}` profile's {what} (`artifact/reference/{profile}/`; kind as "
             f"claims.yaml states it now, a superseded version marked):", "",
             "| claim | kind | measured (95% interval) | threshold | " + ("runs | " if runs else "")
             + "verdict |", "|---|---|---|---|" + ("---|" if runs else "") + "---|"]
    for _, r in table.iterrows():
        entry = kinds.get(r["claim"], {})
        kind = entry.get("kind", r.get("kind", ""))
        if entry.get("superseded_by"):
            kind += f" (superseded by {entry['superseded_by']})"
        extra = f"{_cell(r['runs'])} | " if runs else ""
        lines.append(f"| {r['claim']} | {kind} | {_cell(r['measured'])} | "
                     f"{_cell(r['threshold'])} | {extra}{r['verdict']} |")
    counts = table["verdict"].value_counts()
    lines += ["", ", ".join(f"{k} {v}" for v, k in counts.items())]
    return "\n".join(lines)


def experiments_section() -> str:
    from pipecomm.lab import profiles

    found = profiles.discover()
    names = profiles.PROFILE_NAMES
    budgets = {}
    for name in names:  # resolved as the orchestrator resolves them (cpu-full extends cpu)
        exps = profiles.load_profile(name, profiles.discover())
        spec = yaml.safe_load((ROOT / "artifact" / "profiles" / f"{name}.yaml").read_text())
        own = set(spec.get("experiments") or {})
        if spec.get("extends"):
            parent = yaml.safe_load(
                (ROOT / "artifact" / "profiles" / f"{spec['extends']}.yaml").read_text())
            own |= set(parent.get("experiments") or {})
        budgets[name] = {eid: e.budget_s for eid, e in exps.items() if eid in own}
    lines = ["| id | notebook | command | " + " | ".join(f"{n} budget" for n in names)
             + " | outputs |", "|---|---|---|" + "---|" * len(names) + "---|"]
    for eid, exp in found.items():
        cells = " | ".join(f"{budgets[n][eid]:.0f} s" if eid in budgets[n] else "-"
                           for n in names)
        lines.append(f"| {eid} | `{exp.notebook.name}` | `./run_all.sh --only {eid}` | {cells} | "
                     f"`results/<profile>/{eid}/` |")
    lines.append("")
    totals = ", ".join(f"{n} {sum(budgets[n].values()) / 60:.1f} min" for n in names)
    lines.append(f"Budgets add up to: {totals} (cpu-full: every experiment; its own protocols, "
                 "E7, E9 and E13, take the rest of the time). Each notebook's first "
                 "markdown cell says what its figure shows and which claims it tests; its last "
                 "cell shows their verdicts.")
    return "\n".join(lines)


def paper_claims_section(brief: bool = False) -> str:
    """The papers' 36 claims in categories, computed from the reference verdicts
    (pipecomm.lab.paper_claims)."""
    from pipecomm.lab import paper_claims

    return paper_claims.to_markdown(paper_claims.table(), brief=brief)


def _verdict_cell(v: dict | None) -> str:
    if not v:
        return "-"
    runs = f" ({v['runs']})" if v.get("runs") and v["runs"] != v["verdict"] else ""
    return f"{v['verdict']}{runs}"


def _runs_experiment(table, experiment: str) -> bool:
    """Whether a reference claims table decided anything of ``experiment``."""
    rows = table[table["experiment"] == experiment]
    return bool((~rows["verdict"].isin(["NOT RUN", "MODEL (no verdict)", ""])).any())


def history_section() -> str:
    """Every claim with more than one version or an amendment: each version, when and at which
    commit it was stated, its status and its verdicts (a superseded version's frozen in the
    ledger, never re-evaluated; a current one's from the references)."""
    from pipecomm.lab import claims, ledger

    entries = _claims(superseded=True)
    book = ledger.load_ledger()
    tables = ledger.reference_tables()
    families: dict[str, list[dict]] = {}
    for e in entries:
        families.setdefault(claims.split_id(e["id"])[0], []).append(e)
    profiles = [p for p in REFERENCE_PROFILES if p in tables]
    lines = ["| claim | version | stated (commit) | status | " + " | ".join(profiles)
             + " | what changed |", "|---|---|---|---|" + "---|" * len(profiles) + "---|"]
    for family, versions in families.items():
        amended = any(book.get(e["id"], {}).get("amendments") for e in versions)
        if len(versions) < 2 and not amended:
            continue
        for e in versions:
            rec = book.get(e["id"], {})
            commit = (rec.get("commit") or "")[:7] or "not committed"
            frozen = rec.get("verdicts") or {}
            live = ledger.decided(tables, e["id"])
            if e.get("superseded_by"):
                status = (f"superseded by {e['superseded_by']}: its verdicts frozen, never "
                          f"re-evaluated")
                cells = [_verdict_cell(frozen.get(p)) for p in profiles]
            else:
                status = f"current ({e['kind']})"
                cells = [_verdict_cell(live.get(p)) if live.get(p) else
                         "not run yet" if _runs_experiment(tables[p], e["experiment"]) else "-"
                         for p in profiles]
            changed = [e.get("change", "")] if e.get("change") else []
            changed += [f"{a['date']}: {a['changed']} -- {a['reason']}"
                        for a in rec.get("amendments", [])]
            lines.append(f"| {family} | {claims.split_id(e['id'])[1]} ({e['id']}) | "
                         f"{rec.get('stated', '')} ({commit}) | {status} | " + " | ".join(cells)
                         + f" | {_cell(' '.join(changed)) or '-'} |")
    return "\n".join(lines)


def render(text: str) -> str:
    sections = (("paper-claims", paper_claims_section()), ("claim-history", history_section()),
                ("paper-verdicts", paper_verdicts_section()), ("claims", claims_section()),
                ("experiments", experiments_section()),
                ("reference-cpu", reference_section("cpu")),
                ("reference-cpu-full", reference_section("cpu-full")),
                ("reference-shaped", reference_section("shaped")))
    for key, body in sections:
        pattern = re.compile(rf"(<!-- {key}:begin[^>]*-->\n).*?(<!-- {key}:end -->)", re.S)
        text = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), text)
    return text


def render_papers(text: str) -> str:
    """docs/papers.md's generated list of the papers' claims in categories."""
    body = paper_claims_section(brief=True)
    pattern = re.compile(r"(<!-- paper-claims:begin[^>]*-->\n).*?(<!-- paper-claims:end -->)", re.S)
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main() -> int:
    stale = []
    for doc, fill in ((DOC, render), (PAPERS_DOC, render_papers)):
        old = doc.read_text()
        new = fill(old)
        if "--check" in sys.argv:
            if new != old:
                stale.append(str(doc.relative_to(ROOT)))
            continue
        doc.write_text(new)
        print("wrote", doc.relative_to(ROOT))
    if stale:
        print(f"{', '.join(stale)} out of date: run tools/make_artifact_md.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
