"""Every speed figure of docs/benchmarks.md in one run (not a test).

    python benchmarks/speed.py [--repeat 5] [--make-test] [--write-docs]

Measures, each as min / median / max over --repeat runs:
- `oracle --help` and `python -c "import oracle.check"` (fresh processes);
- a warm `oracle check --family olmoe` per Linux backend (everything cached; the stages of
  benchmarks/profile_check.py);
- `oracle matrix` over the five families x the six Linux backends (fp32), warm, with -j 1 and
  with the default -j (the number of cores), and their ratio;
- with --make-test: `make test` in a fresh clone of this checkout (cold caches: what CI sees),
  once (it takes minutes).
Prints a markdown section; --write-docs puts it between the speed markers of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("MOE_ORACLE_CACHE", str(ROOT / ".cache" / "moe-oracle"))

from profile_check import BACKENDS, STAGES, profile  # noqa: E402

FAMILIES = "qwen3_5_moe,qwen3_moe,olmoe,qwen2_moe,mixtral"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- speed:begin (benchmarks/speed.py --write-docs) -->", "<!-- speed:end -->"
# the targets (issue 17), seconds
TARGETS = {"help": 0.3, "check:eager": 2.5, "check:executorch": 2.5, "check:hf": 2.5, "check:executorch-mlx": 2.5,
           "check:mlx": 1.5, "check:iree-llvm-cpu": 1.5, "matrix_warm": 60, "make_test": 12 * 60}


def wall(cmd: list[str], cwd=ROOT, check: bool = True) -> float:
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    secs = time.perf_counter() - t
    if check and r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return secs


def spread(xs: list[float]) -> str:
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}"


def verdict(key: str, value: float) -> str:
    target = TARGETS.get(key)
    if target is None:
        return ""
    return f"≤ {target:g}: {'met' if value <= target else 'NOT met'}"


def matrix(jobs: int, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    return wall([sys.executable, "-m", "oracle.cli", "matrix", "--families", FAMILIES,
                 "--backends", ",".join(BACKENDS), "--precisions", "fp32", "--report-dir", str(out),
                 "-j", str(jobs)], check=False)  # a failing check is the matrix's business, not the timing's


def make_test() -> float:
    with tempfile.TemporaryDirectory() as d:
        subprocess.run(["git", "clone", "-q", str(ROOT), d], check=True)
        env = {k: v for k, v in os.environ.items() if k != "MOE_ORACLE_CACHE"}  # the clone's own, empty cache
        t = time.perf_counter()
        r = subprocess.run(["make", "test"], cwd=d, env=env, capture_output=True, text=True)
        secs = time.perf_counter() - t
        if r.returncode != 0:
            raise SystemExit(f"make test failed in the fresh clone:\n{r.stdout[-3000:]}")
    return secs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--make-test", action="store_true", help="also time `make test` in a fresh clone (minutes)")
    p.add_argument("--write-docs", action="store_true", help=f"write the section into {DOC.relative_to(ROOT)}")
    a = p.parse_args()
    from oracle.backend import resolve

    oracle = [sys.executable, "-m", "oracle.cli"]
    lines = [f"### Speed ({platform.machine()}, {os.cpu_count()} cores, "
             f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, "
             f"Python {platform.python_version()}, {time.strftime('%Y-%m-%d')}; `python benchmarks/speed.py`)", "",
             f"min / median / max over {a.repeat} runs, seconds.", "",
             "| what | min / median / max | target |", "|---|---|---|"]
    print("oracle --help ...", file=sys.stderr, flush=True)
    h = [wall([*oracle, "--help"]) for _ in range(a.repeat)]
    lines.append(f"| `oracle --help` | {spread(h)} | {verdict('help', statistics.median(h))} |")
    imp = [wall([sys.executable, "-c", "import oracle.check"]) for _ in range(a.repeat)]
    lines.append(f"| `python -c 'import oracle.check'` | {spread(imp)} | |")
    rows = []
    for b in BACKENDS:
        ok, why = resolve(b).availability()
        if not ok:
            lines.append(f"| warm `oracle check --family olmoe --backend {b}` | skipped: {why} | |")
            continue
        print(f"warm check {b} ...", file=sys.stderr, flush=True)
        r = profile("olmoe", b, a.repeat)
        rows.append(r)
        lines.append(f"| warm `oracle check --family olmoe --backend {b}` ({r['status']}) | {spread(r['wall'])} | "
                     f"{verdict('check:' + b, statistics.median(r['wall']))} |")
    with tempfile.TemporaryDirectory() as d:
        print("matrix (warming up) ...", file=sys.stderr, flush=True)
        first = matrix(os.cpu_count() or 1, Path(d) / "m")
        print("matrix -j 1 / -j N ...", file=sys.stderr, flush=True)
        serial = [matrix(1, Path(d) / "m") for _ in range(max(1, a.repeat // 2))]
        par = [matrix(os.cpu_count() or 1, Path(d) / "m") for _ in range(max(1, a.repeat // 2))]
    lines.append(f"| warm `oracle matrix` (5 families x {len(BACKENDS)} backends, fp32), -j 1 | {spread(serial)} | |")
    lines.append(f"| warm `oracle matrix`, -j {os.cpu_count()} (default) | {spread(par)} | "
                 f"{verdict('matrix_warm', statistics.median(par))} |")
    lines.append(f"| parallel / serial (warm matrix) | {statistics.median(par) / statistics.median(serial):.2f} | |")
    lines.append(f"| first matrix run of this benchmark (as warm as the cache was) | {first:.1f} | |")
    if a.make_test:
        print("make test in a fresh clone ...", file=sys.stderr, flush=True)
        mt = make_test()
        lines.append(f"| `make test`, fresh clone (cold caches, venv set-up included), s | {mt:.0f} "
                     f"({mt / 60:.1f} min) | {verdict('make_test', mt)} |")
    lines += ["", "Where a warm check's time goes (medians, `python benchmarks/profile_check.py`):", "",
              "| backend | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)]
    for r in rows:
        lines.append(f"| {r['backend']} | " + " | ".join(f"{r['stages'][s]:.2f}" for s in STAGES) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.write_docs:
        doc = DOC.read_text()
        if BEGIN not in doc or END not in doc:
            raise SystemExit(f"{DOC.relative_to(ROOT)} has no speed markers ({BEGIN} ... {END})")
        head, rest = doc.split(BEGIN, 1)
        DOC.write_text(head + BEGIN + "\n" + text + END + rest.split(END, 1)[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
