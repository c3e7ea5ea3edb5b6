"""Reports as the same numbers: a CheckResult's JSON without what depends on the run or the
machine rather than on the check (timings, cache state, host, checkpoint directory, Python),
for comparing reports across code changes (tests/baselines/: the five original families'
reports, saved before the family abstraction; `python -m oracle.baseline` compares them all)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BASELINES = Path(__file__).resolve().parents[1] / "tests" / "baselines"
# thresholds_sha256 hashes the whole thresholds file, which changes when another family's
# overrides are added; the limits each row was judged by are in the rows and are compared
RUN_STATE = ("timings", "cache")
MACHINE = ("host", "python", "thresholds_sha256")


def normalized(doc: dict) -> dict:
    doc = {k: v for k, v in doc.items() if k not in RUN_STATE}
    prov = {k: v for k, v in doc.get("provenance", {}).items() if k not in MACHINE}
    if isinstance(prov.get("checkpoint"), dict):
        prov["checkpoint"] = {k: v for k, v in prov["checkpoint"].items() if k != "dir"}
    # a compiled program (IREE's .vmfb) carries the source locations (file:line) of the production
    # model's code, so any edit of models/layers.py changes its bytes: the artifacts' names are
    # compared, what they compute is in every row
    for path in (("artifacts",), ("backend", "artifacts")):
        node = prov
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(path[-1]), list):
            node[path[-1]] = [{k: v for k, v in a.items() if k != "sha256"} if isinstance(a, dict) else a
                              for a in node[path[-1]]]
    return {**doc, "provenance": prov}


def dumps(doc: dict) -> str:
    return json.dumps(normalized(doc), indent=1, sort_keys=True) + "\n"


def baseline_name(family: str, backend: str, precision: str) -> str:
    return f"{family}__{backend}__{precision}.json"


def main(argv=None) -> int:
    """Run every saved baseline's check and report which differ (exit 1 if any)."""
    from oracle.check import CheckSpec, run_check

    names = sorted(BASELINES.glob("*.json"))
    bad = 0
    for path in names:
        family, backend, precision = path.stem.split("__")
        got = dumps(run_check(CheckSpec(family=family, backend=backend, precision=precision)).to_dict())
        same = got == path.read_text()
        bad += not same
        print(f"{'same' if same else 'DIFFERS'}  {path.stem}", flush=True)
    print(f"{len(names) - bad} of {len(names)} reports unchanged")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
