"""Cold and warm `oracle check --backend executorch` per family (a measurement, not a test).

    .venv/bin/python benchmarks/executorch_bench.py [--family F]... [--option KEY=VALUE]... [--json out.json]

Each family is checked twice with the CLI, as a user runs it, in one fresh cache directory:
cold (the .pte is exported and lowered) then warm (the .pte comes from the cache). Prints a
markdown table: exit code, status, the worst block's ratio to its limit, e2e token
exactness and logits max_abs, wall seconds, the check's own load (export + lowering) seconds,
whether the artifact was cached, and the load average (other work on the machine makes
these figures noisy: say so with them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "qwen3_5_moe")


def check(family: str, options: list[str], cache: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "oracle.cli", "check", "--family", family, "--backend", "executorch",
           "--json", str(out)] + [a for o in options for a in ("--option", o)]
    env = {**os.environ, "MOE_ORACLE_CACHE": cache, "PYTHONPATH": str(ROOT)}
    load = os.getloadavg()[0]
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    doc = json.loads(out.read_text()) if out.exists() else {}
    ratios = [b["ratio"] for b in doc.get("blocks", []) if isinstance(b.get("ratio"), (int, float))]
    steps = (doc.get("e2e") or {}).get("steps", [])
    return {"rc": p.returncode, "status": doc.get("status"), "wall_s": round(wall, 1),
            "worst_block_ratio": round(max(ratios), 3) if ratios else None,
            "e2e_max_abs": max((s["max_abs"] for s in steps if s.get("max_abs") is not None), default=None),
            "load_s": round(doc.get("timings", {}).get("load_s", float("nan")), 1),
            "cached": doc.get("cache", {}).get("all_cached"), "loadavg": round(load, 2),
            "e2e_exact": (doc.get("e2e") or {}).get("token_exact")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", action="append", help="default: all five")
    ap.add_argument("--option", action="append", default=[], help="backend option KEY=VALUE (repeatable)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--cache", help="the cache directory (default: a fresh temporary one, so the first run is cold)")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="et-bench-") as tmp:
        cache = a.cache or tmp
        for family in a.family or FAMILIES:
            for run in ("cold", "warm"):
                r = check(family, a.option, cache, Path(tmp) / f"{family}-{run}.json")
                rows.append({"family": family, "run": run, **r})
                print(json.dumps(rows[-1]), file=sys.stderr)
    print(f"host {platform.node()}: {os.cpu_count()} cpus, options {a.option or 'default'}\n")
    print("| family | run | exit | status | worst block ratio | e2e exact | e2e logits max_abs | wall s "
          "| load (export+lower) s | cached | load avg |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['family']} | {r['run']} | {r['rc']} | {r['status']} | {r['worst_block_ratio']} | {r['e2e_exact']} "
              f"| {r['e2e_max_abs']} | {r['wall_s']} | {r['load_s']} | {r['cached']} | {r['loadavg']} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
