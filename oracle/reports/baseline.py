"""Reports as the same numbers: a CheckResult's JSON compared with a saved one by the rule of
oracle.verdict.portable (host facts, run state and file locations left out; measured errors within a
tenth of their limit), for comparing reports across code changes and machines (tests/baselines/:
the five original families' reports, saved before the family abstraction; `python -m
oracle.reports.baseline` compares them all)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oracle.verdict.portable import comparable, differences

BASELINES = Path(__file__).resolve().parents[2] / "tests" / "baselines"


def dumps(doc: dict) -> str:
    """A report as it is saved in tests/baselines/."""
    return json.dumps(comparable(doc), indent=1, sort_keys=True) + "\n"


def baseline_name(family: str, backend: str, precision: str) -> str:
    return f"{family}__{backend}__{precision}.json"


def compare(path: Path, doc: dict) -> list[str]:
    """Differences of a fresh report from the saved baseline at `path` (empty: unchanged)."""
    return differences(json.loads(path.read_text()), doc)


def main(argv=None) -> int:
    """Run every saved baseline's check (or those named: family__backend__precision) and report which
    differ, every difference listed (exit 1 if any). --update: write the fresh reports as the baselines,
    after their differences were read and each explained by a deliberate change (say which in the
    commit); a report whose check did not pass is never written."""
    import argparse

    from oracle.backend import CheckSpec
    from oracle.check import run_check
    from oracle.reports.result import Status

    ap = argparse.ArgumentParser(prog="python -m oracle.reports.baseline")
    ap.add_argument("names", nargs="*", help="family__backend__precision (default: every baseline)")
    ap.add_argument("--update", action="store_true", help="write the fresh reports over the baselines")
    a = ap.parse_args(argv)
    names = [BASELINES / f"{n}.json" for n in a.names] or sorted(BASELINES.glob("*.json"))
    bad = 0
    for path in names:
        family, backend, precision = path.stem.split("__")
        doc = run_check(CheckSpec(family=family, backend=backend, precision=precision)).to_dict()
        diffs = compare(path, doc) if path.is_file() else ["no baseline"]
        bad += bool(diffs)
        print(f"{'same' if not diffs else 'DIFFERS'}  {path.stem}" + "".join(f"\n    {d}" for d in diffs),
              flush=True)
        if a.update and diffs:
            if doc["status"] not in (Status.PASS, Status.XFAIL):
                print(f"    not written: the check is {doc['status']}")
                continue
            path.write_text(dumps(doc))
            print(f"    written {path}")
    print(f"{len(names) - bad} of {len(names)} reports unchanged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
