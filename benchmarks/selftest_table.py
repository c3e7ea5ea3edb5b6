"""The self-test figures of docs/benchmarks.md from `oracle selftest --json` reports (not a test).

    python benchmarks/selftest_table.py REPORT.json [REPORT.json ...]

The compiled backends' self-tests run one family a process (one program lowered per fault: an
hour or more a family on 2 cores), e.g.

    oracle selftest --backend executorch --family qwen3_moe --seeds 0,1,2 --json et-qwen3_moe.json

Prints one markdown row per (backend, family) of the reports, in the catalogue's family order,
then one total row per backend: faults detected / required, localised, false alarms / clean runs,
crashed, not injected, not applicable, the drill's share (--drill), and the seconds the checks took
(the sum of the report's rows: the run's wall time without start-up).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HEADER = ("| backend | family | detected | localised | false alarms | crashed | not injected | "
          "not applicable | drill names the point | checks' time |\n|---|---|---|---|---|---|---|---|---|---|")


def _minutes(s: float) -> str:
    return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"


def rows_of(doc: dict) -> dict:
    """family -> counts of one report (a report may hold several families)."""
    from oracle.selftest import CLEAN

    out = {}
    for fam in doc["families"]:
        faults = [r for r in doc["faults"] if r["family"] == fam]
        req = [r for r in faults if r.get("injected", True) and not r.get("masked")
               and (r.get("noise_ratio") is None or r["noise_ratio"] > 1.0)]
        alarms = [a for a in doc["false_alarms"] if a["family"] == fam]
        drilled = [r for r in req if r.get("drilled") and r["localized"] and r.get("point") is not None
                   and r.get("point_exposed", True)]
        points = lambda r: r["point"] if isinstance(r["point"], list) else [r["point"]]  # noqa: E731
        out[fam] = {
            "faults": len(req), "detected": sum(r["detected"] for r in req),
            "localized": sum(r["localized"] for r in req),
            "false_alarms": sum(a["status"] not in CLEAN for a in alarms), "clean_runs": len(alarms),
            "crashed": sum(r["status"] == "error" or (r["status"] == "fail" and not r["detected"]) for r in req),
            "not_injected": sum(not r.get("injected", True) for r in faults),
            "not_applicable": sum(x["family"] == fam for x in doc["not_applicable"]),
            "drilled": len(drilled), "point": sum(r.get("drill_point") in points(r) for r in drilled),
            "seconds": sum(r["seconds"] for r in faults) + sum(a["seconds"] for a in alarms),
            "refused": next((x["why"] for x in doc["refused"] if x["family"] == fam), None),
        }
    return out


def line(backend: str, family: str, c: dict) -> str:
    if c["refused"] and not c["clean_runs"]:
        return f"| {backend} | {family} | refused: {c['refused'][:120]} | | | | | | | |"
    drill = f"{c['point']}/{c['drilled']}" if c["drilled"] else "-"
    return (f"| {backend} | {family} | {c['detected']}/{c['faults']} | {c['localized']}/{c['faults']} | "
            f"{c['false_alarms']}/{c['clean_runs']} | {c['crashed']} | {c['not_injected']} | {c['not_applicable']} | "
            f"{drill} | {_minutes(c['seconds'])} |")


def main(paths: list[str]) -> str:
    from models import FAMILY_NAMES

    per: dict[str, dict] = {}
    for p in paths:
        doc = json.loads(Path(p).read_text())
        per.setdefault(doc["backend"], {}).update(rows_of(doc))
    out = [HEADER]
    for backend, fams in per.items():
        order = sorted(fams, key=lambda f: FAMILY_NAMES.index(f) if f in FAMILY_NAMES else len(FAMILY_NAMES))
        for fam in order:
            out.append(line(backend, fam, fams[fam]))
        if len(fams) > 1:
            total = {k: sum(c[k] for c in fams.values()) for k in fams[order[0]] if k != "refused"}
            total["refused"] = None
            out.append(line(f"**{backend}**", f"**{len(fams)} families**", total))
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(main(sys.argv[1:]))
