"""Per-family check times (docs/benchmarks.md "Per-family check times"; not a test).

    python benchmarks/family_checks.py [--families a,b] [--backends eager,hf,mlx] [--write-docs]

Runs `oracle check --family F --backend B` (fp32, the tiny seeded checkpoint) for each family and backend,
each in a fresh process on an empty cache of its family (the first backend of a family builds the
checkpoint and the HF reference; the others reuse them, as a user's second check does), and records the
wall seconds and the verdict (pass, xfail, a refusal). Default: every family, the seven Linux backends.
Prints a markdown table; --write-docs puts it between the family-times markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BACKENDS = ("eager", "hf", "mlx", "llamacpp", "iree-llvm-cpu", "executorch", "executorch-mlx")
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- family-times:begin (benchmarks/family_checks.py --write-docs) -->", "<!-- family-times:end -->"


def check(family: str, backend: str, cache: Path, out: Path) -> tuple[float, str]:
    env = {**os.environ, "MOE_ORACLE_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "oracle.cli", "check", "--family", family, "--backend", backend,
                        "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
    secs = time.perf_counter() - t
    if out.exists():
        status = json.loads(out.read_text()).get("status", "?")
    else:  # a refusal (exit 2) or an unavailable backend: its one line
        status = f"exit {r.returncode}: " + (r.stderr.strip().splitlines() or ["?"])[-1][:80]
    return secs, status


def cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None) -> int:
    from models import FAMILY_NAMES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(FAMILY_NAMES))
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--write-docs", action="store_true")
    a = ap.parse_args(argv)
    families, backends = a.families.split(","), a.backends.split(",")
    unknown = [f for f in families if f not in FAMILY_NAMES]
    if unknown:
        raise SystemExit(f"unknown family: {', '.join(unknown)} (see `oracle families`)")
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for family in families:
            cells = []
            for backend in backends:
                secs, status = check(family, backend, Path(d) / family, Path(d) / f"{family}-{backend}.json")
                cells.append(f"{secs:.0f} s {status}")
                print(f"{family} {backend}: {secs:.1f} s {status}", file=sys.stderr, flush=True)
            rows.append(f"| {family} | " + " | ".join(cells) + " |")
    table = "\n".join([
        f"Measured {datetime.date.today()} on {cpu()}, {os.cpu_count()} cores, Python {platform.python_version()}: "
        "`oracle check --family F --backend B` fp32 tiny, wall seconds of a fresh process, the family's cache "
        "empty before its first backend (that one builds the checkpoint and the HF reference).", "",
        "| family | " + " | ".join(backends) + " |", "|---" * (len(backends) + 1) + "|", *rows])
    print(table)
    if a.write_docs:
        text = DOC.read_text()
        block = f"{BEGIN}\n{table}\n{END}"
        if BEGIN in text:
            text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
        else:
            text += f"\n## Per-family check times\n\n{block}\n"
        DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
