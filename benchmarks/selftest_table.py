"""The self-test figures of docs/benchmarks.md from `oracle selftest --json` reports (not a test).

    python benchmarks/selftest_table.py REPORT.json [REPORT.json ...] [--rerun REPORT.json ...]

The compiled backends' self-tests run one family a process (one program lowered per fault: an
hour or more a family on 2 cores), e.g.

    oracle selftest --backend executorch --family qwen3_moe --seeds 0,1,2 --json et-qwen3_moe.json

Prints one markdown row per (backend, family) of the reports, in the catalogue's family order,
then one total row per backend: faults detected / required, localised, false alarms / clean runs,
crashed, not injected, not applicable, the drill's share (--drill), and the seconds the checks took
(the sum of the report's rows: the run's wall time without start-up).

--rerun: the reports after it hold faults run again alone (`--fault NAME`) after their form
changed; each of their fault rows replaces the same (backend, family, fault) row of the reports
before it, or its not-applicable entry (a fault that had no form on the backend then), and the
family is marked (its rerun faults named under the table).
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
    """family -> counts of one report (a report may hold several families): the self-test's own summary
    (oracle.selftest.result.SelftestResult.summary) of that family's rows, with the seconds its checks took."""
    from oracle.selftest.result import AlarmRow, FaultRow, SelftestResult

    out = {}
    for fam in doc["families"]:
        of = lambda rows: [x for x in rows if x["family"] == fam]  # noqa: E731
        res = SelftestResult(doc["backend"], [fam], doc["seeds"], faults=[FaultRow(**r) for r in of(doc["faults"])],
                             false_alarms=[AlarmRow(**a) for a in of(doc["false_alarms"])],
                             not_applicable=of(doc["not_applicable"]), refused=of(doc["refused"]))
        s = res.summary()
        out[fam] = {k: s.get(k, 0) for k in ("faults", "detected", "localized", "false_alarms", "clean_runs",
                                              "crashed", "not_injected", "drilled", "point_localized")}
        out[fam]["not_applicable"] = len(res.not_applicable)
        out[fam]["seconds"] = sum(r.seconds for r in res.faults) + sum(a.seconds for a in res.false_alarms)
        out[fam]["refused"] = res.refused[0]["why"] if res.refused else None
        out[fam]["cut"] = doc.get("complete") is False  # a report of a run cut short: the rows it finished
    return out


def line(backend: str, family: str, c: dict) -> str:
    if c["refused"] and not c["clean_runs"]:
        return f"| {backend} | {family} | refused: {c['refused'][:120]} | | | | | | | |"
    drill = f"{c['point_localized']}/{c['drilled']}" if c["drilled"] else "-"
    family += (" (cut short)" if c.get("cut") else "") + (" (r)" if c.get("rerun") else "")
    return (f"| {backend} | {family} | {c['detected']}/{c['faults']} | {c['localized']}/{c['faults']} | "
            f"{c['false_alarms']}/{c['clean_runs']} | {c['crashed']} | {c['not_injected']} | {c['not_applicable']} | "
            f"{drill} | {_minutes(c['seconds'])} |")


def merge_reruns(docs: list[dict], reruns: list[dict]) -> dict:
    """Replace the rows of `docs` that `reruns` ran again; (backend, family) -> the faults rerun."""
    rerun = {(d["backend"], r["family"], r["fault"]): r for d in reruns for r in d["faults"]}
    marked: dict = {}
    for d in docs:
        for i, r in enumerate(d["faults"]):
            key = (d["backend"], r["family"], r["fault"])
            if key in rerun:
                d["faults"][i] = rerun.pop(key)
                marked.setdefault(key[:2], []).append(r["fault"])
        for r in list(d.get("not_applicable", [])):  # a fault that had no form on the backend then
            key = (d["backend"], r["family"], r.get("fault"))
            if key in rerun:
                d["not_applicable"].remove(r)
                d["faults"].append(rerun.pop(key))
                marked.setdefault(key[:2], []).append(r["fault"])
    if rerun:
        sys.exit(f"--rerun: no row to replace for {sorted(rerun)}")
    return marked


def main(paths: list[str]) -> str:
    from models import FAMILY_NAMES

    i = paths.index("--rerun") if "--rerun" in paths else len(paths)
    docs = [json.loads(Path(p).read_text()) for p in paths[:i]]
    marked = merge_reruns(docs, [json.loads(Path(p).read_text()) for p in paths[i + 1:]])
    per: dict[str, dict] = {}
    for doc in docs:
        per.setdefault(doc["backend"], {}).update(rows_of(doc))
    for (backend, fam), names in marked.items():
        per[backend][fam]["rerun"] = names
    out = [HEADER]
    for backend, fams in per.items():
        order = sorted(fams, key=lambda f: FAMILY_NAMES.index(f) if f in FAMILY_NAMES else len(FAMILY_NAMES))
        for fam in order:
            out.append(line(backend, fam, fams[fam]))
        if len(fams) > 1:
            total = {k: sum(c[k] for c in fams.values()) for k in fams[order[0]] if k not in ("refused", "cut", "rerun")}
            total["refused"] = None
            out.append(line(f"**{backend}**", f"**{len(fams)} families**", total))
    if marked:
        out.append("")
        grouped: dict = {}  # one line per backend and set of faults, naming its families
        for (b, f), names in marked.items():
            grouped.setdefault((b, tuple(names)), []).append(f)
        whose = lambda names: "its fault's" if len(names) == 1 else "their faults'"  # noqa: E731
        out += [f"- (r) {b} {', '.join(fams)}: {', '.join(names)} run again alone after {whose(names)} form changed"
                for (b, names), fams in grouped.items()]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    print(main(sys.argv[1:]))
