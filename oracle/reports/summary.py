"""Matrix summaries: one row per check, and their renderings (markdown, JUnit XML), the
merge of sharded runs and the diff of two runs for a pull request."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

from oracle.reports.result import Status, place

SCHEMA = "oracle-matrix/v1"
# xfail: a known candidate defect failing as its entry says (oracle/verdict/expected.py): does not gate
RANK = {Status.PASS: 0, Status.XFAIL: 1, Status.SKIPPED: 2, Status.FAIL: 3, Status.ERROR: 4}


def check_id(family: str, backend: str, precision: str) -> str:
    return f"{family}__{backend}__{precision}"


def _num(x) -> float:
    return x if isinstance(x, (int, float)) else math.inf


def row_of(doc: dict, json_name: str | None) -> dict:
    """The summary row of one check's JSON document."""
    spec = doc["spec"]
    w = doc.get("worst")
    e = doc.get("e2e")
    blocks = {f"{'model' if b['layer'] is None else b['layer']}.{b['kind']}": b["ratio"]
              for b in doc.get("blocks", []) if b["status"] != Status.NA}
    return {
        "id": check_id(spec["family"], spec["backend"], spec["precision"]),
        "family": spec["family"], "backend": spec["backend"], "precision": spec["precision"],
        "status": doc["status"],
        "reason": doc.get("skipped_reason") or ((doc.get("error") or "").splitlines() or [""])[0]
                  or (doc.get("expected") or {}).get("verdict") or None,
        "worst": None if not w else {"layer": w["layer"], "kind": w["kind"], "ratio": w["ratio"]},
        "blocks": blocks,
        "e2e": None if not e else {"status": e["status"], "token_exact": e["token_exact"],
                                   "max_abs": max((_num(s["max_abs"]) for s in e["steps"]), default=0.0)},
        "gates": [{"name": g["name"], "status": g["status"]} for g in doc.get("gates", [])],
        # the invariance rows (oracle/verdict/invariance.py): name -> status
        "invariance": {x["name"]: x["status"] for x in doc.get("invariance") or []},
        "json": json_name,
        # drilled blocks (oracle/drill/points.py): block -> the first point that diverges (None: every point agrees)
        **({"drill": {f"{'model' if d['layer'] is None else d['layer']}.{d['kind']}": d["first_divergence"]
                      for d in doc["drill"].get("blocks", [])}} if doc.get("drill") else {}),
    }


def synthetic_row(family, backend, precision, status, reason) -> dict:
    """A row for a check that produced no JSON (skipped up front, crashed, hung)."""
    return {"id": check_id(family, backend, precision), "family": family, "backend": backend,
            "precision": precision, "status": status, "reason": reason, "worst": None, "blocks": {},
            "e2e": None, "gates": [], "json": None}


def file_id(cid: str) -> str:
    """A check id usable as a file name (plugin backends are named package.module:attr)."""
    return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in cid)


def summarize(rows: list[dict], timings: dict | None = None, require: bool = False) -> dict:
    """require: a skipped check (unavailable backend) fails the matrix too."""
    rows = sorted(rows, key=lambda r: r["id"])
    counts = {s: sum(r["status"] == s for r in rows) for s in RANK}
    bad = counts[Status.FAIL] + counts[Status.ERROR] + (counts[Status.SKIPPED] if require else 0)
    return {"schema": SCHEMA, "status": Status.PASS if bad == 0 else Status.FAIL, "require": require, "counts": counts,
            "rows": rows, "timings": timings or {}}


def merge(summaries: list[dict]) -> dict:
    """Join sharded runs: rows by id (a check in two shards is an error in the sharding)."""
    rows, timings = {}, {}
    for s in summaries:
        for r in s["rows"]:
            if r["id"] in rows:
                raise ValueError(f"check {r['id']} appears in more than one shard")
            rows[r["id"]] = r
        timings.update(s.get("timings", {}))
    return summarize(list(rows.values()), timings, any(s.get("require") for s in summaries))


ICON = {Status.PASS: "✅", Status.FAIL: "❌", Status.ERROR: "💥", Status.SKIPPED: "⏭️", Status.XFAIL: "⚠️"}


def grid(summary: dict) -> list[dict]:
    """The matrix as a reviewer reads it: one grid per precision, families down and backends
    across (in the order they first appear), each cell the row of that check or None."""
    out = []
    for precision in dict.fromkeys(r["precision"] for r in summary["rows"]):
        rows = [r for r in summary["rows"] if r["precision"] == precision]
        families = list(dict.fromkeys(r["family"] for r in rows))
        backends = list(dict.fromkeys(r["backend"] for r in rows))
        cells = {(r["family"], r["backend"]): r for r in rows}
        out.append({"precision": precision, "families": families, "backends": backends,
                    "cells": [[cells.get((f, b)) for b in backends] for f in families]})
    return out


def cell_text(row: dict | None) -> str:
    """A check in a grid cell: its status, and its worst block's ratio to its limit where one failed."""
    if row is None:
        return ""
    w = row["worst"]
    return row["status"] + (f" {_g(w['ratio'])}x" if w and row["status"] != Status.PASS else "")


def grid_markdown(summary: dict) -> list[str]:
    lines = []
    for g in grid(summary):
        lines += [f"**{g['precision']}**", "", "| family | " + " | ".join(g["backends"]) + " |",
                  "|---" * (len(g["backends"]) + 1) + "|"]
        for f, cells in zip(g["families"], g["cells"]):
            lines.append(f"| {f} | " + " | ".join(f"{ICON.get(c['status'], '')} {cell_text(c)}".strip() if c else "·"
                                                  for c in cells) + " |")
        lines.append("")
    return lines


def markdown(summary: dict) -> str:
    c = summary["counts"]
    icon = "✅" if summary["status"] == Status.PASS else "❌"
    lines = [f"### {icon} oracle matrix: {c[Status.PASS]} pass, {c[Status.FAIL]} fail, {c[Status.ERROR]} error, "
             f"{c[Status.SKIPPED]} skipped" + (f", {c[Status.XFAIL]} expected failure(s)" if c.get(Status.XFAIL) else ""), ""]
    lines += grid_markdown(summary)
    lines += ["| check | status | worst block | e2e | repeat / chunked / batched |", "|---|---|---|---|---|"]
    for r in sorted(summary["rows"], key=lambda r: (-RANK[r["status"]], r["id"])):
        w = r["worst"]
        worst = "" if not w else f"{place(w['layer'])} {w['kind']} ({_g(w['ratio'])}x limit)"
        e = r["e2e"]
        e2e = "" if not e else f"{e['status']}{'' if e['token_exact'] else ', tokens differ'}"
        note = f" ({r['reason']})" if r["status"] in (Status.SKIPPED, Status.ERROR, Status.XFAIL) and r["reason"] else ""
        inv = r.get("invariance") or {}
        rows = " / ".join(inv.get(n, "-") for n in ("repeat", "chunked", "batched")) if inv else ""
        lines.append(f"| {r['family']} / {r['backend']} / {r['precision']} | {r['status']}{note} | {worst} | {e2e} | {rows} |")
    return "\n".join(lines) + "\n"


def junit(summary: dict) -> str:
    """One testcase per check; skipped checks are <skipped> with the reason."""
    c = summary["counts"]
    suite = ET.Element("testsuite", name="oracle", tests=str(len(summary["rows"])), failures=str(c[Status.FAIL]),
                       errors=str(c[Status.ERROR]), skipped=str(c[Status.SKIPPED] + c.get(Status.XFAIL, 0)))
    for r in summary["rows"]:
        tc = ET.SubElement(suite, "testcase", classname=f"oracle.{r['backend']}",
                           name=f"{r['family']}[{r['precision']}]",
                           time=f"{summary.get('timings', {}).get(r['id'], 0.0):.1f}")
        if r["status"] == Status.SKIPPED:
            ET.SubElement(tc, "skipped", message=r["reason"] or "skipped")
        elif r["status"] == Status.XFAIL:  # JUnit has no expected failure: a skip typed as pytest writes one
            ET.SubElement(tc, "skipped", type="xfail", message=r["reason"] or "expected failure")
        elif r["status"] == Status.ERROR:
            ET.SubElement(tc, "error", message=r["reason"] or "error")
        elif r["status"] == Status.FAIL:
            w = r["worst"]
            msg = "e2e failed" if not w else f"worst block: {place(w['layer'])} {w['kind']}, {_g(w['ratio'])}x limit"
            ET.SubElement(tc, "failure", message=msg)
    ET.indent(suite)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True) + "\n"


def diff(baseline: dict, current: dict, factor: float = 4.0, floor: float = 0.05) -> dict:
    """What changed between two matrix runs. A regression: a check whose status got worse,
    a check that is new and not passing, or a block whose ratio to its limit grew by more
    than `factor` (ignored while it stays under `floor` of its limit: noise far from the
    limit is not news)."""
    base = {r["id"]: r for r in baseline["rows"]}
    cur = {r["id"]: r for r in current["rows"]}
    status_changes, grown, new_skips, regressions, points, rows_changed = [], [], [], [], [], []
    for cid, r in cur.items():
        b = base.get(cid)
        if b is None:
            if r["status"] in (Status.FAIL, Status.ERROR):
                status_changes.append({"id": cid, "from": None, "to": r["status"], "reason": r["reason"]})
                regressions.append(cid)
            continue
        if r["status"] != b["status"]:
            status_changes.append({"id": cid, "from": b["status"], "to": r["status"], "reason": r["reason"]})
            if r["status"] == Status.SKIPPED:
                new_skips.append({"id": cid, "reason": r["reason"]})
            elif RANK[r["status"]] > RANK[b["status"]]:
                regressions.append(cid)
        for name, now in (r.get("invariance") or {}).items():  # an invariance row that changed its verdict
            was = (b.get("invariance") or {}).get(name)
            if was is not None and was != now:
                rows_changed.append({"id": cid, "row": name, "from": was, "to": now})
                if now in (Status.FAIL, Status.ERROR) and was not in (Status.FAIL, Status.ERROR):
                    regressions.append(cid)
        for blk, point in (r.get("drill") or {}).items():  # the drill names another point inside a block
            if blk in (b.get("drill") or {}) and b["drill"][blk] != point:
                points.append({"id": cid, "block": blk, "from": b["drill"][blk], "to": point})
        for blk, ratio in r["blocks"].items():
            old = b["blocks"].get(blk)
            if old is None:
                continue
            new, old = _num(ratio), _num(old)
            if new > floor and new > factor * max(old, 1e-12):
                grown.append({"id": cid, "block": blk, "from": old, "to": new, "growth": new / max(old, 1e-12)})
                regressions.append(cid)
    status_changes.sort(key=lambda c: (-RANK.get(c["to"], 0), c["id"]))
    grown.sort(key=lambda g: -g["to"])
    return {"status_changes": status_changes, "grown_blocks": grown, "new_skips": new_skips,
            "regressed": sorted(set(regressions)), "factor": factor, "drill_changes": points,
            "invariance_changes": rows_changed}


def diff_markdown(d: dict) -> str:
    if not (d["status_changes"] or d["grown_blocks"] or d["new_skips"] or d.get("drill_changes")
            or d.get("invariance_changes")):
        return "### ✅ oracle: no change against the baseline\n"
    head = "❌ oracle: regressions" if d["regressed"] else "ℹ️ oracle: changes (no regression)"
    lines = [f"### {head} against the baseline", ""]
    if d["regressed"]:
        lines.append("Regressed: " + ", ".join(f"`{c}`" for c in d["regressed"]))
        lines.append("")
    if d["status_changes"]:
        lines += ["| check | was | now | why |", "|---|---|---|---|"]
        for c in d["status_changes"]:
            lines.append(f"| {c['id']} | {c['from'] or 'new'} | {c['to']} | {c['reason'] or ''} |")
        lines.append("")
    if d["grown_blocks"]:
        lines += [f"Blocks whose error grew more than {d['factor']:g}x (ratio to limit):", "",
                  "| check | block | was | now |", "|---|---|---|---|"]
        for g in d["grown_blocks"][:20]:
            lines.append(f"| {g['id']} | {g['block']} | {_g(g['from'])} | {_g(g['to'])} |")
        lines.append("")
    if d.get("drill_changes"):
        lines += ["Drilled blocks whose first diverging point changed:", "", "| check | block | was | now |",
                  "|---|---|---|---|"]
        for p in d["drill_changes"]:
            lines.append(f"| {p['id']} | {p['block']} | {p['from'] or 'none'} | {p['to'] or 'none'} |")
        lines.append("")
    if d.get("invariance_changes"):
        lines += ["Invariance rows that changed (repeat, chunked, batched):", "", "| check | row | was | now |",
                  "|---|---|---|---|"]
        for c in d["invariance_changes"]:
            lines.append(f"| {c['id']} | {c['row']} | {c['from']} | {c['to']} |")
        lines.append("")
    if d["new_skips"]:
        lines.append("New skips: " + "; ".join(f"`{s['id']}` ({s['reason']})" for s in d["new_skips"]))
    return "\n".join(lines).rstrip() + "\n"


def load(path: str | Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    schema = doc.get("schema") if isinstance(doc, dict) else None
    if schema != SCHEMA:
        raise ValueError(f"{path}: not a matrix summary (schema {schema!r}, expected {SCHEMA!r})")
    return doc


def _g(x) -> str:
    return f"{x:.3g}" if isinstance(x, float) else str(x)
