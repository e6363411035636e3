"""Keep artifact/claims-ledger.yaml, the pre-registration ledger of artifact/claims.yaml.

    .venv/bin/python tools/claims_ledger.py check      # exit 1 and one line per problem
    .venv/bin/python tools/claims_ledger.py update     # new versions, commits, frozen verdicts
    .venv/bin/python tools/claims_ledger.py amend C2.9 --reason "why the change decides the same"
    .venv/bin/python tools/claims_ledger.py backfill   # definition column of old reference tables

A new version of a claim is a new entry of claims.yaml (``C9.2b`` with ``supersedes: C9.2``,
``change:`` saying what changed, its prediction and threshold reason) and ``superseded_by:
C9.2b`` on the old one, whose definition stays as it was. ``update`` records it; after the
commit that states it, ``update`` again records that commit (the version must be committed
before its first run). docs/experiments.md, "Versions", has the rules.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pipecomm.lab import ledger  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="list every problem; exit 1 if there is one")
    sub.add_parser("update", help="record new versions, their commits and frozen verdicts")
    amend = sub.add_parser("amend", help="record a reclassification or a regime-neutral change")
    amend.add_argument("claim")
    amend.add_argument("--reason", required=True)
    sub.add_parser("backfill", help="the definition column of reference tables that lack it")
    args = parser.parse_args(argv)
    if args.command == "check":
        found = ledger.problems()
        print("\n".join(found) or "claims.yaml, the ledger and the references agree")
        return 1 if found else 0
    if args.command == "backfill":
        for path in ledger.backfill_definitions():
            print("wrote", path.relative_to(ROOT))
        return 0
    if args.command == "amend":
        try:
            book = ledger.amend(args.claim, args.reason)
        except ValueError as exc:
            print(f"claims_ledger.py: {exc}", file=sys.stderr)
            return 2
        ledger.write_ledger(book)
        print(f"amended {args.claim}")
        return 0
    book, refused = ledger.update()
    ledger.write_ledger(book)
    print(f"wrote {ledger.LEDGER_FILE.relative_to(ROOT)}")
    if refused:
        print("\n".join(refused), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
