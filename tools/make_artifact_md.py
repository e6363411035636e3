"""Fill the generated sections of artifact/ARTIFACT.md from artifact/claims.yaml and the profiles.

    .venv/bin/python tools/make_artifact_md.py          # rewrite in place
    .venv/bin/python tools/make_artifact_md.py --check  # exit 1 if ARTIFACT.md is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "artifact" / "ARTIFACT.md"


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def _args(args: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in args.items())


def claims_section() -> str:
    claims = yaml.safe_load((ROOT / "artifact" / "claims.yaml").read_text())
    lines = ["| claim | paper | experiment | statement (checked) | the paper's own claim / number "
             "| model prediction | threshold (check arguments) | why this threshold |",
             "|---|---|---|---|---|---|---|---|"]
    for c in claims:
        if c.get("kind") == "illustration":
            pred, thr, why = "(model illustration)", "no verdict", ""
        else:
            pred, thr, why = c["prediction"], f"`{c['check']}`: {_args(c['args'])}", \
                c["threshold_reason"]
        lines.append(f"| {c['id']} | {_cell(c['paper'])} | {c['experiment']} | "
                     f"{_cell(c['statement'])} | {_cell(c.get('paper_value', ''))} | "
                     f"{_cell(pred)} | {_cell(thr)} | {_cell(why)} |")
    return "\n".join(lines)


def reference_section(profile: str) -> str:
    import pandas as pd

    path = ROOT / "artifact" / "reference" / profile / "claims.csv"
    if not path.exists():
        return f"(no reference run of the {profile} profile yet)"
    table = pd.read_csv(path).fillna("")
    lines = [f"Reference run of the `{profile}` profile (`artifact/reference/{profile}/`):", "",
             "| claim | measured (95% interval) | threshold | verdict |", "|---|---|---|---|"]
    ran = {d.name for d in path.parent.iterdir() if d.is_dir()}
    table = table[table["experiment"].isin(ran)]  # cpu-full keeps only its own experiments
    for _, r in table.iterrows():
        lines.append(f"| {r['claim']} | {_cell(r['measured'])} | {_cell(r['threshold'])} | "
                     f"{r['verdict']} |")
    counts = table["verdict"].value_counts()
    lines += ["", ", ".join(f"{n} {v}" for v, n in counts.items())]
    return "\n".join(lines)


def experiments_section() -> str:
    sys.path.insert(0, str(ROOT / "src"))
    from pipecomm.lab import artifact

    found = artifact.discover()
    names = artifact.PROFILE_NAMES
    budgets = {}
    for name in names:  # resolved as the orchestrator resolves them (cpu-full extends cpu)
        exps = artifact.load_profile(name, artifact.discover())
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


def render(text: str) -> str:
    sections = (("claims", claims_section()), ("experiments", experiments_section()),
                ("reference-cpu", reference_section("cpu")),
                ("reference-cpu-full", reference_section("cpu-full")))
    for key, body in sections:
        pattern = re.compile(rf"(<!-- {key}:begin[^>]*-->\n).*?(<!-- {key}:end -->)", re.S)
        text = pattern.sub(lambda m, b=body: m.group(1) + b + "\n" + m.group(2), text)
    return text


def main() -> int:
    old = DOC.read_text()
    new = render(old)
    if "--check" in sys.argv:
        if new != old:
            print("artifact/ARTIFACT.md is out of date: run tools/make_artifact_md.py")
            return 1
        return 0
    DOC.write_text(new)
    print("wrote", DOC.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
