"""What every command of the command line shares: exit codes, the argument parser and its shared
options, bad input as one line and exit 2, checks of output paths and families, a progress line,
the cache limit, a clean exit on SIGTERM."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

EXIT = {"pass": 0, "xfail": 0, "fail": 1, "bad_input": 2, "skipped_required": 3, "error": 4}


def positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error as one line (and the exit code 2 of every bad input)."""

    def error(self, message):
        self.exit(EXIT["bad_input"], f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# oracle.source.trained.PROFILES (not imported here: --help and usage errors import nothing heavy)
WEIGHT_PROFILES = ("normal", "trained")


def weights_option(p) -> None:
    p.add_argument("--weights", choices=WEIGHT_PROFILES, default="normal",
                   help="the tiny / --config checkpoint's weights: normal (one normal law; default) or trained "
                        "(outlier dims, massive activations, spread norm gains, sharp routers and attention, "
                        "drawn from --seed: docs/weights.md)")


def version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("moe-oracle")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def cache_limit_option(p) -> None:
    p.add_argument("--cache-limit", metavar="SIZE", help="the artifact cache's size limit (e.g. 20G, 500M; default "
                   "MOE_ORACLE_CACHE_LIMIT, else 32G): least recently used entries are removed past it, and an "
                   "artifact that cannot fit is refused before it is built")


def backend_options(p) -> None:
    p.add_argument("--device", choices=["cpu", "gpu"], help="where the backend runs (mlx: cpu or gpu)")
    p.add_argument("--group-size", type=positive_int, help="quantization group size (mlx q8/q4: 32 or 64)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   help="a backend-specific option (repeatable)")


def fail_input(message: str):
    """Bad input: one line on stderr, exit 2, nothing written."""
    print(f"oracle: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT["bad_input"])


def known_family(flag: str, family: str) -> None:
    """Bad input unless `family` is one of models.FAMILY_NAMES (a deferred one says what it lacks)."""
    from models import FAMILY_NAMES, UNSUPPORTED

    if family not in FAMILY_NAMES:
        why = f" (not supported yet: missing {UNSUPPORTED[family]})" if family in UNSUPPORTED else ""
        fail_input(f"{flag}: unknown family {family!r}{why}; known: {', '.join(FAMILY_NAMES)}")


def check_outputs(files=(), dirs=()) -> None:
    """Every output path writable (directories created) before any work."""
    from oracle.reports.result import output_problem

    for flag, path, directory in [(f, p, False) for f, p in files] + [(f, p, True) for f, p in dirs]:
        problem = path is not None and output_problem(path, directory)
        if problem:
            fail_input(f"{flag}: {problem}")


def options_of(a) -> dict:
    from oracle.backend import HARNESS_OPTIONS

    opts = {}
    for kv in a.option:
        k, sep, v = kv.partition("=")
        if not sep or not k:
            fail_input(f"--option expects KEY=VALUE, got {kv!r}")
        if k in HARNESS_OPTIONS:
            fail_input(f"--option {k}: set by the harness; use --{k.replace('_', '-')}")
        opts[k] = v
    for name in ("device", "group_size", "qlinear", "qlinear_group_size", "sample", "max_seq_len"):
        v = getattr(a, name, None)
        if v not in (None, False):
            opts[name] = v
    return opts


def progress_reporter():
    """A rich progress line on a terminal; nothing in CI logs."""
    if not sys.stderr.isatty():
        return None, None
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    prog = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                    console=Console(stderr=True), transient=True)
    task = prog.add_task("starting")

    def update(stage, done=0, total=0):
        prog.update(task, description=f"{stage} {done + 1}/{total}" if total else stage)

    return prog, update


def default_family(a) -> bool:
    """--family from the --model-dir / --config config.json's model_type; False (the reason on
    stderr) when there is none to read."""
    from oracle.backend import InputError
    from oracle.source.validation import family_of

    try:
        a.family = family_of(a.model_dir, a.config, a.layers)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return False
    return True


def run_and_report(run, prog, update, render, json_path, save) -> int:
    """A self-test's run (under the progress line where there is one), its table printed (on stderr when
    the report goes to standard output) and saved: exit 0 when every fault was caught and nothing else
    failed, 1 otherwise, 2 on bad input."""
    from oracle.backend import InputError

    try:
        if prog:
            with prog:
                res = run(lambda m: update(m))
        else:
            res = run()
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    print(render(res), end="", file=sys.stderr if json_path == "-" else sys.stdout)
    if json_path:
        save(res)
    return 0 if res.summary()["ok"] else EXIT["fail"]


def apply_cache_limit(a) -> None:
    """--cache-limit SIZE: this process's and its children's limit (the environment variable they read)."""
    value = getattr(a, "cache_limit", None)
    if value is None:
        return
    from oracle.cache.store import ENV, parse_size

    try:
        parse_size(value)
    except ValueError as e:
        fail_input(f"--cache-limit: {e}")
    os.environ[ENV] = value


@contextlib.contextmanager
def terminate_cleanly():
    """SIGTERM (a CI timeout, `timeout`, a scheduler) exits through Python's own exit while a command
    runs, as Ctrl-C does, so a build in progress removes its partial directory
    (oracle.cache.files.cached_dir, oracle/cache/artifacts.py) instead of leaving it in the cache. Exit 143
    (128 + SIGTERM), as the signal would. The previous handler is put back after."""
    import signal
    import threading

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
