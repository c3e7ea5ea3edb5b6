"""Reports as the same numbers: a CheckResult's JSON compared with a saved one by the rule of
oracle.portable (host facts, run state and file locations left out; measured errors within a
tenth of their limit), for comparing reports across code changes and machines (tests/baselines/:
the five original families' reports, saved before the family abstraction; `python -m
oracle.baseline` compares them all)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from oracle.portable import comparable, differences

BASELINES = Path(__file__).resolve().parents[1] / "tests" / "baselines"


def dumps(doc: dict) -> str:
    """A report as it is saved in tests/baselines/."""
    return json.dumps(comparable(doc), indent=1, sort_keys=True) + "\n"


def baseline_name(family: str, backend: str, precision: str) -> str:
    return f"{family}__{backend}__{precision}.json"


def compare(path: Path, doc: dict) -> list[str]:
    """Differences of a fresh report from the saved baseline at `path` (empty: unchanged)."""
    return differences(json.loads(path.read_text()), doc)


def main(argv=None) -> int:
    """Run every saved baseline's check and report which differ (exit 1 if any)."""
    from oracle.backend import CheckSpec
    from oracle.check import run_check

    names = sorted(BASELINES.glob("*.json"))
    bad = 0
    for path in names:
        family, backend, precision = path.stem.split("__")
        diffs = compare(path, run_check(CheckSpec(family=family, backend=backend, precision=precision)).to_dict())
        bad += bool(diffs)
        print(f"{'same' if not diffs else 'DIFFERS'}  {path.stem}" + "".join(f"\n    {d}" for d in diffs[:10]),
              flush=True)
    print(f"{len(names) - bad} of {len(names)} reports unchanged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
