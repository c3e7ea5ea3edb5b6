"""`oracle matrix`: every family x backend x precision, each check in its own process
(a crash or a hang is that check's `error` row, not the end of the run), split into
deterministic shards for parallel CI jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from oracle import summary as S
from oracle.result import write_atomic

OUTPUTS = ("summary.json", "summary.md", "junit.xml", "report.html")


@dataclass(frozen=True)
class Combo:
    family: str
    backend: str
    precision: str

    @property
    def id(self) -> str:
        return S.check_id(self.family, self.backend, self.precision)


def combos(families, backends, precisions) -> list[Combo]:
    return sorted((Combo(f, b, p) for f in families for b in backends for p in precisions), key=lambda c: c.id)


def parse_shard(text: str) -> tuple[int, int]:
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard expects I/N (e.g. 2/4), got {text!r}") from None
    if not 1 <= i <= n:
        raise ValueError(f"--shard {text}: need 1 <= I <= N")
    return i, n


def shard(cs: list[Combo], i: int, n: int) -> list[Combo]:
    """Shard I of N (1-based): every N-th check of the sorted list; the N shards cover it once."""
    return cs[i - 1 :: n]


def _precision_skip(c: Combo) -> str | None:
    from oracle.backend import BackendError, resolve

    try:
        be = resolve(c.backend)
    except BackendError as e:
        return str(e)
    supported = getattr(be, "precisions", None)
    if supported is not None and c.precision not in supported:
        return f"backend {c.backend} does not support precision {c.precision}"
    return None


def run_one(c: Combo, out_dir: Path, timeout: float, seed: int, extra: list[str]) -> tuple[dict, float]:
    t = time.perf_counter()
    reason = _precision_skip(c)
    if reason:
        return S.synthetic_row(c.family, c.backend, c.precision, "skipped", reason), 0.0
    json_path = out_dir / "checks" / f"{S.file_id(c.id)}.json"
    json_path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "oracle.cli", "check", "--family", c.family, "--backend", c.backend,
           "--precision", c.precision, "--seed", str(seed), "--json", str(json_path), *extra]
    # its own session (process group): on a timeout the whole group goes, compilers it started included
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return S.synthetic_row(c.family, c.backend, c.precision, "error",
                               f"timed out after {timeout:g} s"), time.perf_counter() - t
    except BaseException:  # interrupted: leave no check running behind
        kill_group(proc)
        raise
    if json_path.is_file():
        doc = json.loads(json_path.read_text())
        return S.row_of(doc, f"checks/{json_path.name}"), time.perf_counter() - t
    tail = (stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    status = "skipped" if proc.returncode == 2 else "error"  # 2: refused as bad input, e.g. unsupported
    return S.synthetic_row(c.family, c.backend, c.precision, status,
                           f"exit {proc.returncode}: {tail}"), time.perf_counter() - t


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (it and every process it started), then reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):  # not read: a process that left the group may still hold it
        if pipe:
            pipe.close()


def write_outputs(report_dir: Path, summary: dict) -> None:
    from oracle.html import render_html

    write_atomic(report_dir / "summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    write_atomic(report_dir / "summary.md", S.markdown(summary))
    write_atomic(report_dir / "junit.xml", S.junit(summary))
    write_atomic(report_dir / "report.html", render_html(summary, report_dir))


def run_matrix(cs: list[Combo], report_dir: Path, timeout: float = 1800, seed: int = 0,
               extra: list[str] | None = None, progress=None, require: bool = False) -> dict:
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "checks").mkdir(exist_ok=True)
    rows, timings = [], {}
    for n, c in enumerate(cs):
        if progress:
            progress(f"{c.id} ({n + 1}/{len(cs)})")
        row, secs = run_one(c, report_dir, timeout, seed, extra or [])
        rows.append(row)
        timings[c.id] = round(secs, 1)
    summary = S.summarize(rows, timings, require)
    write_outputs(report_dir, summary)
    return summary


def merge_dirs(dirs: list[Path], out: Path) -> dict:
    """Join shard report dirs into `out`: check JSONs copied, summary rebuilt."""
    summaries = []
    (out / "checks").mkdir(parents=True, exist_ok=True)
    for d in dirs:
        summaries.append(S.load(d / "summary.json"))
        for f in sorted((d / "checks").glob("*.json")) if (d / "checks").is_dir() else []:
            if d.resolve() != out.resolve():
                write_atomic(out / "checks" / f.name, f.read_text())
    merged = S.merge(summaries)
    write_outputs(out, merged)
    return merged
