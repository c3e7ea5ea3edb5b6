"""`oracle matrix`: every family x backend x precision, each check in its own process
(a crash or a hang is that check's `error` row, not the end of the run), up to `jobs` at
once, each forked from a warm fork server (oracle/worker.py); split into deterministic
shards for parallel CI jobs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from oracle.reports import summary as S
from oracle.reports.result import Status, write_atomic

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
    if be.precisions is not None and c.precision not in be.precisions:
        return f"backend {c.backend} does not support precision {c.precision}"
    return None


def check_argv(c: Combo, json_path: Path, seed: int, extra: list[str]) -> list[str]:
    """`oracle check` arguments of one combo (after `python -m oracle.cli`)."""
    return ["check", "--family", c.family, "--backend", c.backend, "--precision", c.precision, "--seed", str(seed),
            "--json", str(json_path), *extra]


def outcome_row(c: Combo, json_path: Path, returncode: int, stderr: str) -> dict:
    """The row of a check that ran: its JSON's, else an error (the exit code and the last
    line on stderr; exit 2, refused as bad input such as an unsupported option: skipped)."""
    if json_path.is_file():
        return S.row_of(json.loads(json_path.read_text()), f"checks/{json_path.name}")
    tail = (stderr.strip().splitlines() or [f"exit {returncode}"])[-1]
    status = Status.SKIPPED if returncode == 2 else Status.ERROR
    return S.synthetic_row(c.family, c.backend, c.precision, status, f"exit {returncode}: {tail}")


def run_one(c: Combo, out_dir: Path, timeout: float, seed: int, extra: list[str]) -> tuple[dict, float]:
    """One check in a fresh interpreter (`python -m oracle.cli check`, its own session): its
    row and seconds. A crash or a hang past `timeout` is its error row."""
    return run_checks([c], out_dir, timeout, seed, extra, jobs=1, warm=False)[0]


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


def kill_session(pid: int) -> None:
    """SIGKILL a forked check's session (oracle.worker.run_check makes it one first): the group, and the
    child itself were it killed before its setsid. The caller reaps it."""
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def default_jobs() -> int:
    return os.cpu_count() or 1


def warm_supported() -> bool:
    """The warm fork server runs on Linux. Elsewhere (macOS: forking a process that loaded
    Apple's frameworks, as torch and mlx do on import, is unsafe) each check is a fresh
    interpreter."""
    import multiprocessing

    return sys.platform.startswith("linux") and "forkserver" in multiprocessing.get_all_start_methods()


class _Cold:
    """A check in a fresh interpreter, its own session (process group)."""

    def __init__(self, argv: list[str], out: Path, err: Path, env: dict):
        with open(out, "wb") as o, open(err, "wb") as e:
            self.proc = subprocess.Popen([sys.executable, "-m", "oracle.cli", *argv], stdout=o, stderr=e,
                                         start_new_session=True, env=env)

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        kill_group(self.proc)

    def close(self) -> None:
        pass


class _Warm:
    """A check in a child forked from the warm fork server; the child makes itself a session
    (process group) leader first (oracle.worker.run_check)."""

    def __init__(self, ctx, argv: list[str], out: Path, err: Path, env: dict):
        from oracle import worker

        self.proc = ctx.Process(target=worker.run_check, args=(argv, env, str(out), str(err)), name="oracle-check")
        self.proc.start()

    def poll(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        kill_session(self.proc.pid)
        self.proc.join()  # the fork server reaps it and hands back its exit status

    def close(self) -> None:
        self.proc.close()


def start_fork_server(backends: list[str], env: dict):
    """The forkserver context, its server started now, in `env`, with oracle.worker preloaded
    and warmed up for `backends` (imports only: no torch op runs, no thread starts there
    before a fork)."""
    import multiprocessing
    from multiprocessing import forkserver

    from oracle import worker

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["oracle.worker"])
    # the server is spawned with os.environ; WARM_ENV is read by its import of oracle.worker
    server_env = {**env, worker.WARM_ENV: ",".join(backends)}
    before = {k: os.environ.get(k) for k in server_env}
    os.environ.update(server_env)
    try:
        forkserver.ensure_running()
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return ctx


def stop_fork_server() -> None:
    """Kill the fork server (after its children: no check is left running) and reap it."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGKILL)  # not waiting for it to notice: a stray descendant may hold its pipe
    except ProcessLookupError:
        pass
    stop = getattr(server, "_stop", None)
    if stop is not None:
        stop()


def _terminate_raises():
    """While checks run, SIGTERM (a cancelled CI job) raises SystemExit(143), as Ctrl-C raises
    KeyboardInterrupt: the running checks are killed before the matrix exits. The previous
    handler, to restore; None where it was not the default (or not in the main thread)."""
    import threading

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, terminated)


@dataclass
class _Running:
    combo: Combo
    json_path: Path
    err: Path
    handle: _Cold | _Warm
    started: float


def run_checks(cs: list[Combo], out_dir: Path, timeout: float, seed: int, extra: list[str], jobs: int = 1,
               progress=None, warm: bool | None = None) -> list[tuple[dict, float]]:
    """Every combo's (row, seconds), in the order of `cs`, each check in its own process, at
    most `jobs` at once (jobs=1: one after the other, in order). warm (default: where
    supported): each check forked from a fork server that did the imports once; else a fresh
    interpreter each. A crash or a hang past `timeout` costs only that check's row; on an
    exception (Ctrl-C) every running check is killed with its process group.

    A family's first check runs before the others of that family start: it fills the caches
    they share (the seeded checkpoint, the HF reference), which are not then built, or written,
    by several checks at once."""
    jobs = max(1, jobs)
    warm = warm_supported() if warm is None else warm
    results: list[tuple[dict, float] | None] = [None] * len(cs)
    pending = []
    for i, c in enumerate(cs):
        reason = _precision_skip(c)
        if reason:
            results[i] = S.synthetic_row(c.family, c.backend, c.precision, Status.SKIPPED, reason), 0.0
        else:
            pending.append(i)
    if not pending:
        return results
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if jobs > 1 and len(pending) > 1:
        # checks share the cores: OpenMP's idle threads sleep rather than spin, which otherwise
        # takes the cores from the other checks (-j 2 on 2 cores: 38 s -> 21 s). It must be set
        # before torch loads OpenMP; the thread counts, and so the numbers, stay as they are.
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    running: dict[int, _Running] = {}
    settled: set[str] = set()  # families with a finished check
    tmp = Path(tempfile.mkdtemp(prefix="oracle-matrix-"))
    ctx = None

    def report():
        if progress:
            done = sum(r is not None for r in results)
            names = ", ".join(r.combo.id for r in running.values())
            progress(f"{done}/{len(cs)} done, running {names}" if names else f"{done}/{len(cs)} done")

    def start(i: int) -> None:
        nonlocal ctx, warm
        c = cs[i]
        json_path = out_dir / "checks" / f"{S.file_id(c.id)}.json"
        json_path.unlink(missing_ok=True)
        argv = check_argv(c, json_path, seed, extra)
        out, err = tmp / f"{i}.out", tmp / f"{i}.err"
        t = time.perf_counter()
        handle = None
        if warm:
            try:
                if ctx is None:
                    ctx = start_fork_server(sorted({cs[j].backend for j in [i, *pending]}), env)
                handle = _Warm(ctx, argv, out, err, env)
            except Exception:  # noqa: BLE001 (no fork server here: a fresh interpreter per check)
                warm = False
        if handle is None:
            handle = _Cold(argv, out, err, env)
        running[i] = _Running(c, json_path, err, handle, t)

    def finish(i: int, row: dict) -> None:
        r = running.pop(i)
        r.handle.close()
        results[i] = row, time.perf_counter() - r.started
        settled.add(r.combo.family)

    on_term = _terminate_raises()
    try:
        report()
        while pending or running:
            busy = {r.combo.family for r in running.values()} - settled
            for i in list(pending):
                if len(running) >= jobs:
                    break
                if cs[i].family in busy:  # waits for the first check of its family
                    continue
                pending.remove(i)
                start(i)
                if cs[i].family not in settled:
                    busy.add(cs[i].family)
                report()
            time.sleep(0.05)
            now = time.perf_counter()
            for i, r in sorted(running.items()):
                code = r.handle.poll()
                if code is not None:
                    stderr = r.err.read_text(errors="replace") if r.err.is_file() else ""
                    finish(i, outcome_row(r.combo, r.json_path, code, stderr))
                elif now - r.started > timeout:
                    r.handle.kill()
                    finish(i, S.synthetic_row(r.combo.family, r.combo.backend, r.combo.precision, Status.ERROR,
                                              f"timed out after {timeout:g} s"))
                else:
                    continue
                report()
    except BaseException:  # interrupted: leave no check running behind
        for r in running.values():
            r.handle.kill()
        raise
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
        if ctx is not None:
            stop_fork_server()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def write_outputs(report_dir: Path, summary: dict) -> None:
    from oracle.reports.html import render_html

    write_atomic(report_dir / "summary.json", json.dumps(summary, indent=1, sort_keys=True) + "\n")
    write_atomic(report_dir / "summary.md", S.markdown(summary))
    write_atomic(report_dir / "junit.xml", S.junit(summary))
    write_atomic(report_dir / "report.html", render_html(summary, report_dir))


def run_matrix(cs: list[Combo], report_dir: Path, timeout: float = 1800, seed: int = 0,
               extra: list[str] | None = None, progress=None, require: bool = False, jobs: int | None = None,
               warm: bool | None = None) -> dict:
    """jobs: checks at once (default: the number of CPUs); the reports are the same for any."""
    report_dir.mkdir(parents=True, exist_ok=True)
    (report_dir / "checks").mkdir(exist_ok=True)
    done = run_checks(cs, report_dir, timeout, seed, extra or [], jobs or default_jobs(), progress, warm)
    rows = [row for row, _ in done]
    timings = {c.id: round(secs, 1) for c, (_, secs) in zip(cs, done)}
    summary = S.summarize(rows, timings, require)
    write_outputs(report_dir, summary)
    return summary


def merge_dirs(dirs: list[Path], out: Path) -> dict:
    """Join shard report dirs into `out`: check JSONs copied, summary rebuilt. Every shard is read
    and merged before anything is written (a bad one: ValueError, `out` untouched)."""
    summaries = []
    for d in dirs:
        if not (d / "summary.json").is_file():
            raise ValueError(f"{d}: not a matrix report directory (no summary.json in it)")
        summaries.append(S.load(d / "summary.json"))
    try:
        merged = S.merge(summaries)
    except (KeyError, TypeError, AttributeError) as e:  # the schema tag, but rows malformed
        raise ValueError(f"malformed summary rows in {', '.join(map(str, dirs))} ({type(e).__name__}: {e})") from None
    (out / "checks").mkdir(parents=True, exist_ok=True)
    for d in dirs:
        for f in sorted((d / "checks").glob("*.json")) if (d / "checks").is_dir() else []:
            if d.resolve() != out.resolve():
                write_atomic(out / "checks" / f.name, f.read_text())
    write_outputs(out, merged)
    return merged
