"""Cold and warm `oracle check --backend iree-llvm-cpu` times per family (not a test).

Cold: a fresh, empty MOE_ORACLE_CACHE (tiny checkpoint written, every program exported and
compiled); warm: the same check again on that cache (nothing compiled). Each run is a
separate `oracle check` process, timed from outside, so the figures are what a user waits;
load_s is the cold run's export + compile (backend.load).
Timings on a shared machine are noisy: the load average is printed with every row.

    .venv/bin/python benchmarks/iree_bench.py [--families olmoe mixtral] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen3_5_moe", "qwen3_moe", "olmoe", "qwen2_moe", "mixtral")


def run_check(family: str, cache: Path, report: Path) -> tuple[float, dict]:
    env = {**os.environ, "MOE_ORACLE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "oracle.cli", "check", "--family", family, "--backend", "iree-llvm-cpu",
                        "--json", str(report)], cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        sys.exit(f"{family}: oracle check exited {p.returncode}\n{p.stdout}\n{p.stderr[-3000:]}")
    return wall, json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--keep", help="use (and keep) this cache dir instead of a temporary one; must be empty")
    a = ap.parse_args()
    print(f"host: {os.cpu_count()} cpus, python {sys.version.split()[0]}")
    print(f"{'family':12s} {'cold_s':>7s} {'warm_s':>7s} {'warm/cold':>9s} {'load_s':>7s} {'cached':>6s}  load avg")
    with tempfile.TemporaryDirectory() as tmp:
        for family in a.families:
            cache = Path(a.keep) / family if a.keep else Path(tmp) / family
            cache.mkdir(parents=True, exist_ok=True)
            if any(cache.iterdir()):
                sys.exit(f"{cache} is not empty: a cold run needs an empty cache")
            load_before = os.getloadavg()[0]
            cold, cold_doc = run_check(family, cache, Path(tmp) / f"{family}-cold.json")
            warm, warm_doc = run_check(family, cache, Path(tmp) / f"{family}-warm.json")
            print(f"{family:12s} {cold:7.1f} {warm:7.1f} {warm / cold:9.2f} {cold_doc['timings']['load_s']:7.1f} "
                  f"{str(warm_doc['cache']['all_cached']):>6s}  {load_before:.1f} -> {os.getloadavg()[0]:.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
