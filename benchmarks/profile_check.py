"""Where the seconds of a warm `oracle check` go, per backend (not a test).

    python benchmarks/profile_check.py [--family olmoe] [--backends eager,mlx,...] [--repeat 5]

Each backend's check runs once to fill the caches, then `--repeat` times as a fresh process
that does what `oracle check` does (parse, quiet, import, validate, run_check, write the JSON
and markdown) and reports the time of each stage; the wall time is measured from outside.

Stages: start (interpreter start-up and exit: the wall time minus everything the process
measured), imports (oracle.check and the backend module), checkpoint (identity and config,
from the caches), reference (the cached reference read), load (the cached artifact loaded),
blocks, e2e, other (gates, goldens, provenance), report (JSON + markdown written). Medians
over the repeats, with the wall's min and max.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("MOE_ORACLE_CACHE", str(ROOT / ".cache" / "moe-oracle"))

BACKENDS = ("eager", "hf", "mlx", "iree-llvm-cpu", "executorch", "executorch-mlx")
STAGES = ("start", "imports", "checkpoint", "reference", "load", "blocks", "e2e", "other", "report")


def child(family: str, backend: str, out: str) -> None:
    """One warm check in this process, timed by stage; prints the stages as JSON."""
    t0 = time.perf_counter()
    from oracle import cli

    a = cli.parser().parse_args(["check", "--family", family, "--backend", backend])
    from oracle.quiet import quiet

    quiet()
    from oracle.backend import CheckSpec
    from oracle.check import run_check
    from oracle.source.validation import validate
    from oracle.reports.markdown import markdown
    from oracle.reports.result import dumps, write_atomic

    spec = CheckSpec(family=a.family, backend=a.backend, precision=a.precision, prompt_len=a.prompt_len,
                     decode_tokens=a.decode_tokens, seed=a.seed)
    backend_ = validate(spec)
    t1 = time.perf_counter()
    result = run_check(spec, backend_)
    t2 = time.perf_counter()
    write_atomic(Path(out) / "check.json", dumps(result))
    write_atomic(Path(out) / "check.md", markdown(result.to_dict()))
    t3 = time.perf_counter()
    tm = result.timings
    stages = {"imports": t1 - t0, "checkpoint": tm.get("checkpoint_s", 0.0), "reference": tm.get("reference_s", 0.0),
              "load": tm.get("load_s", 0.0), "blocks": tm.get("blocks_s", 0.0), "e2e": tm.get("e2e_s", 0.0),
              "report": t3 - t2}
    stages["other"] = (t2 - t1) - sum(stages[k] for k in ("checkpoint", "reference", "load", "blocks", "e2e"))
    print(json.dumps({"status": result.status, "in_process": t3 - t0, "stages": stages}))


def timed_child(family: str, backend: str) -> dict:
    """One warm check as a fresh process: its stages and its wall time seen from outside."""
    with tempfile.TemporaryDirectory() as out:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, __file__, "--child", backend, "--family", family, "--out", out],
                           capture_output=True, text=True)
        wall = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"{backend}: the profiled check failed:\n{r.stderr[-2000:]}")
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    doc["wall"] = wall
    doc["stages"]["start"] = wall - doc["in_process"]
    return doc


def warm_up(family: str, backend: str) -> None:
    """The check once, so that every cache it reads is filled."""
    subprocess.run([sys.executable, "-m", "oracle.cli", "check", "--family", family, "--backend", backend],
                   cwd=ROOT, capture_output=True, text=True)


def profile(family: str, backend: str, repeat: int) -> dict:
    warm_up(family, backend)
    runs = [timed_child(family, backend) for _ in range(repeat)]
    walls = [r["wall"] for r in runs]
    return {"backend": backend, "status": runs[-1]["status"], "wall": walls,
            "stages": {s: statistics.median(r["stages"][s] for r in runs) for s in STAGES}}


def table(rows: list[dict]) -> str:
    head = "| backend | status | wall median (min-max) s | " + " | ".join(STAGES) + " |"
    lines = [head, "|" + "---|" * (3 + len(STAGES))]
    for r in rows:
        w = r["wall"]
        lines.append(f"| {r['backend']} | {r['status']} | {statistics.median(w):.2f} ({min(w):.2f}-{max(w):.2f}) | "
                     + " | ".join(f"{r['stages'][s]:.2f}" for s in STAGES) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="olmoe")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.family, a.child, a.out)
        return 0
    from oracle.backend import resolve

    rows = []
    for b in a.backends.split(","):
        ok, why = resolve(b).availability()
        if not ok:
            print(f"{b}: skipped ({why})", file=sys.stderr)
            continue
        print(f"{b} ...", file=sys.stderr, flush=True)
        rows.append(profile(a.family, b, a.repeat))
    print(f"warm `oracle check --family {a.family}`, {a.repeat} runs each, {platform.machine()} "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}; stage medians in seconds\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
