"""One command for a GPU session (docs/cuda.md): everything a lent GPU machine should run, in one go.

    python3 benchmarks/gpu_session.py [--wheels DIR] [--out DIR] [--budget SECONDS] [--dry-run]

For a machine like the lent H100 (16 cores, a preinstalled CUDA torch, transformers and friends, no
package registry): the pure-Python pins it lacks travel as wheels in `--wheels` (default `wheels/`
in the checkout: e.g. transformers 5.23.0); each is installed with `pip --no-index --no-deps
--target <out>/site` only where the installed version differs, and nothing else is installed. The
checkout then runs as `python3 -m oracle` with PYTHONPATH=<out>/site:<checkout>.

The steps (STEPS, below), each under its own time limit (a step cut at its limit leaves the reports
its finished checks wrote; the next step runs): `oracle backends`; the `cuda` matrix at fp32 and bf16;
the same at bf16 on the trained weight profile; the two GPU controls at bf16 (`eager` and `hf` with
`--option device=cuda`: the production model run eagerly on the GPU, and HF transformers itself on
it); the self-test on `cuda` for two families; `pytest -m gpu` on two families. The limits add up to
`BUDGET` (8 minutes of a 16-core H100 machine). Then <out>/table.md (the markdown table for
docs/cuda.md: one row per family, each step's status and worst ratio, the machine and the time each
step took) and <out>.tar.gz (every report, the logs, the table) are written.

--dry-run (a CPU test, tests/test_gpu_session.py): prints the commands, and checks each oracle
command against the CLI's own parser, every family, backend and `--option` against what exists,
and that `pytest -m gpu -k ...` selects tests; runs nothing, installs nothing, exit 1 on a problem.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = "12"  # of the H100 machine's 16 cores: the 2026-11-27 matrix ran at -j 12 (30 checks, 211 s)
FAMILIES = ("olmoe", "qwen3_5_moe")  # the self-test's and pytest's: a plain MoE, and the hybrid (attention, Gated DeltaNet)


@dataclass
class Step:
    name: str
    argv: list  # after `python3 -m`: an oracle command, or pytest
    limit_s: int  # cut there (SIGTERM, then SIGKILL 15 s later): its finished reports remain
    report: str | None = None  # the matrix report directory under --out (its checks/*.json feed the table)
    column: str = ""  # the table's column for a matrix step
    outputs: list = field(default_factory=list)  # files under --out it writes


def steps() -> list[Step]:
    """The session's steps (report paths relative to --out). Limits: the 2026-11-27 H100 run took 211 s
    for the 30-check cuda matrix (cold compiles, -j 12); the trained run compiles nothing new (Inductor's
    FX graph cache: same graphs, other weights); the controls compile nothing."""
    fam = [a for f in FAMILIES for a in ("--family", f)]
    return [
        Step("backends", ["oracle", "backends"], 15),
        Step("cuda", ["oracle", "matrix", "--backends", "cuda", "--precisions", "fp32,bf16", "-j", JOBS,
                      "--timeout", "190", "--require", "--report-dir", "{out}/cuda"], 195, "cuda", "cuda"),
        Step("cuda-trained", ["oracle", "matrix", "--backends", "cuda", "--precisions", "bf16", "--weights",
                              "trained", "-j", JOBS, "--timeout", "70", "--require", "--report-dir",
                              "{out}/cuda-trained"], 70, "cuda-trained", "cuda trained"),
        Step("controls", ["oracle", "matrix", "--backends", "eager,hf", "--precisions", "bf16", "--option",
                          "device=cuda", "-j", JOBS, "--timeout", "50", "--require", "--report-dir",
                          "{out}/controls"], 50, "controls", "control"),
        Step("selftest", ["oracle", "selftest", "--backend", "cuda", *fam, "--seeds", "0", "--json",
                          "{out}/selftest-cuda.json"], 50, outputs=["selftest-cuda.json"]),
        Step("pytest", ["pytest", "-q", "-m", "gpu", "-k", f"({' or '.join(FAMILIES)}) and not executorch",
                        "tests/test_cuda.py",
                        "--junitxml", "{out}/pytest-gpu.xml"], 40, outputs=["pytest-gpu.xml"]),
    ]


BUDGET = 7 * 60  # the steps' limits add up to at most this: 8 minutes of the GPU machine with a minute
# for its start, the wheels and the archive


# ---------------------------------------------------------------------------------------- wheels
def wheel_name_version(path: Path) -> tuple[str, str]:
    """('transformers', '5.23.0') from transformers-5.23.0-py3-none-any.whl (the wheel filename spec)."""
    name, ver = path.name.split("-")[:2]
    return name.replace("_", "-").lower(), ver


def wheels_to_install(wheels: Path) -> list[tuple[Path, str]]:
    """The carried wheels whose project is missing or at another version here: (wheel, why)."""
    out = []
    for whl in sorted(wheels.glob("*.whl")) if wheels.is_dir() else ():
        name, ver = wheel_name_version(whl)
        try:
            have = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            have = None
        if have != ver:
            out.append((whl, f"{name} {have or 'missing'} -> {ver}"))
    return out


# ---------------------------------------------------------------------------------------- dry run
def check_command(argv: list) -> list[str]:
    """What is wrong with one step's command (its options, families, backends), without running it."""
    sys.path.insert(0, str(ROOT))
    problems = []
    if argv[0] == "pytest":
        k = argv[argv.index("-k") + 1]
        got = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-m", "gpu",
                              "-k", k, *[a for a in argv if a.endswith(".py")]], cwd=ROOT, capture_output=True,
                             text=True, timeout=300)
        n = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", got.stdout)
        if not n or int(n.group(1)) == 0:
            problems.append(f"pytest -m gpu -k {k!r} selects no test ({got.stdout.strip().splitlines()[-1:]})")
        return problems
    from models import FAMILY_NAMES
    from oracle.backend import BackendError, resolve
    from oracle.cli import parser

    args = [a.replace("{out}", "/tmp/out") for a in argv[1:]]
    try:
        a = parser().parse_args(args)
    except SystemExit:
        return [f"oracle {' '.join(args)}: the CLI refuses it (see above)"]
    families = getattr(a, "family", None) or []
    for f in families if isinstance(families, list) else [families]:
        if f not in FAMILY_NAMES:
            problems.append(f"unknown family {f}")
    names = (a.backends.split(",") if getattr(a, "backends", None) else
             [a.backend] if getattr(a, "backend", None) else [])
    options = [o.split("=", 1) for o in getattr(a, "option", None) or []]
    for name in names:
        try:
            b = resolve(name)
        except BackendError as e:
            problems.append(str(e))
            continue
        schema = {o.name: o for o in b.option_schema}
        for key, value in options:
            if key not in schema:
                problems.append(f"{name} has no option {key}")
            elif schema[key].choices and value not in schema[key].choices:
                problems.append(f"{name}: {key}={value} is not one of {schema[key].choices}")
        for p in (getattr(a, "precisions", None) or "").split(",") if getattr(a, "precisions", None) else []:
            if b.precisions and p not in b.precisions:
                problems.append(f"{name} does not run {p}")
    return problems


# ---------------------------------------------------------------------------------------- the table
def check_rows(report_dir: Path) -> list[dict]:
    """One row per check JSON a matrix step wrote (all of them, or those finished before its limit)."""
    rows = []
    for f in sorted((report_dir / "checks").glob("*.json")) if report_dir.is_dir() else ():
        try:
            r = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        spec, e2e = r.get("spec", {}), r.get("e2e") or {}
        ratios = [b["ratio"] for b in r.get("blocks", []) if b.get("ratio") is not None]
        steps = [s.get("vs_noise") for s in e2e.get("steps", []) if s.get("vs_noise") is not None]
        routing = e2e.get("routing") or {}
        rows.append({"family": spec.get("family"), "backend": spec.get("backend"), "precision": spec.get("precision"),
                     "options": spec.get("options") or {}, "status": r.get("status"),
                     "worst_block": max(ratios, default=None), "e2e": e2e.get("status"),
                     "tokens_exact": e2e.get("token_exact"), "worst_step_x_hf": max(steps, default=None),
                     "route_differences": len(routing.get("differences", [])),
                     "divergences": routing.get("divergences"), "seconds": (r.get("timings") or {}).get("total_s")})
    return rows


def cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    text = row["status"]
    if row["worst_block"] is not None:
        text += f" {row['worst_block']:.2f}"
    if row["worst_step_x_hf"] is not None:
        text += f" / e2e {row['worst_step_x_hf']:.1f}x HF"
    if row["route_differences"]:
        text += f" / {row['route_differences']} route diff"
    if row["tokens_exact"] is False:
        text += " / tokens differ"
    return text


def table(out: Path, timings: dict, machine: dict) -> str:
    """The markdown for docs/cuda.md: a row per family, a column per matrix step (status, the worst block's
    ratio to its limit, the worst e2e step against HF bf16's own error, routing differences), then each
    step's wall time and exit."""
    cols = []
    for st in steps():
        if st.report:
            for r in check_rows(out / st.report):
                label = f"{st.column} {r['backend']} {r['precision']}" if st.column == "control" else \
                    f"{st.column} {r['precision']}"
                cols.append((label, r))
    labels = list(dict.fromkeys(label for label, _ in cols))
    by = {(label, r["family"]): r for label, r in cols}
    families = sorted({r["family"] for _, r in cols})
    lines = [f"GPU session {machine['date']}: {machine['gpu']}, {machine['cores']} cores, torch {machine['torch']}, "
             f"transformers {machine['transformers']}, Python {machine['python']}, commit {machine['commit']} "
             "(benchmarks/gpu_session.py).", "",
             "Each cell: status, worst block's ratio to its limit / worst e2e step in multiples of HF bf16's own "
             "error (bf16) / routing differences (oracle/verdict/replay.py).", "",
             "| family | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for f in families:
        lines.append(f"| {f} | " + " | ".join(cell(by.get((label, f))) for label in labels) + " |")
    lines += ["", "| step | wall s | limit s | exit |", "|---|---|---|---|"]
    for st in steps():
        t = timings.get(st.name)
        lines.append(f"| {st.name} | {t['wall_s'] if t else '-'} | {st.limit_s} | {t['exit'] if t else 'not run'} |")
    return "\n".join(lines) + "\n"


def machine_facts() -> dict:
    def version(p):
        try:
            return importlib.metadata.version(p)
        except importlib.metadata.PackageNotFoundError:
            return "missing"

    gpu = "no GPU"
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name()
    except ImportError:
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d"), "gpu": gpu, "cores": os.cpu_count(), "torch": version("torch"),
            "transformers": version("transformers"), "python": platform.python_version(), "commit": commit or "?"}


# ---------------------------------------------------------------------------------------- run
def run_step(st: Step, out: Path, env: dict) -> dict:
    argv = [sys.executable, "-m", *[a.replace("{out}", str(out)) for a in st.argv]]
    log = out / "logs" / f"{st.name}.log"
    t = time.perf_counter()
    with open(log, "w") as f:
        p = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = p.wait(timeout=st.limit_s)
        except subprocess.TimeoutExpired:
            p.terminate()  # the matrix kills its running checks on SIGTERM; finished reports stay
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            code = f"cut at {st.limit_s} s"
    return {"wall_s": round(time.perf_counter() - t, 1), "exit": code, "argv": argv[2:]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", default=str(ROOT / "wheels"), help="the carried wheels (default wheels/)")
    ap.add_argument("--out", default=str(ROOT / f"gpu-session-{time.strftime('%Y-%m-%d')}"))
    ap.add_argument("--dry-run", action="store_true", help="print and check the commands; run nothing")
    ap.add_argument("--facts", action="store_true", help=argparse.SUPPRESS)  # the machine's facts as JSON
    a = ap.parse_args(argv)
    if a.facts:
        print(json.dumps(machine_facts()))
        return 0
    out = Path(a.out).resolve()
    total = sum(st.limit_s for st in steps())
    print(f"# {len(steps())} steps, limits adding up to {total} s (budget {BUDGET} s)")
    problems = [] if total <= BUDGET else [f"the steps' limits add up to {total} s, over the {BUDGET} s budget"]
    for whl, why in wheels_to_install(Path(a.wheels)):
        print(f"pip install --no-index --no-deps --target {out / 'site'} {whl}   # {why}")
    for st in steps():
        print(f"timeout {st.limit_s} python3 -m {' '.join(x.replace('{out}', str(out)) for x in st.argv)}")
        if a.dry_run:
            problems += [f"{st.name}: {p}" for p in check_command(st.argv)]
    if a.dry_run:
        for p in problems:
            print(f"problem: {p}", file=sys.stderr)
        print("dry run: " + ("every command checked" if not problems else f"{len(problems)} problem(s)"))
        return 1 if problems else 0
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    (out / "logs").mkdir(parents=True, exist_ok=True)
    site = out / "site"
    for whl, why in wheels_to_install(Path(a.wheels)):
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(site),
                        str(whl)], check=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(site), str(ROOT), os.environ.get("PYTHONPATH"))
                                                       if p),
           "MOE_ORACLE_CACHE": os.environ.get("MOE_ORACLE_CACHE", str(out / "cache"))}
    facts = subprocess.run([sys.executable, "-m", "benchmarks.gpu_session", "--facts"], cwd=ROOT, env=env,
                           capture_output=True, text=True)  # with the carried wheels on the path
    machine = json.loads(facts.stdout) if facts.returncode == 0 else machine_facts()
    timings = {}
    for st in steps():
        timings[st.name] = run_step(st, out, env)
        print(f"{st.name}: {timings[st.name]['wall_s']} s, exit {timings[st.name]['exit']}", flush=True)
        (out / "timings.json").write_text(json.dumps({"machine": machine, "steps": timings}, indent=1))
        (out / "table.md").write_text(table(out, timings, machine))  # after every step: a cut session has one
    skip = (out / "site", out / "cache")  # the installed wheels and the artifact cache: not reports
    with tarfile.open(f"{out}.tar.gz", "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=lambda ti: None if any(
            ti.name == f"{out.name}/{p.name}" or ti.name.startswith(f"{out.name}/{p.name}/") for p in skip) else ti)
    print(f"wrote {out / 'table.md'} and {out}.tar.gz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
