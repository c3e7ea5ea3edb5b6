"""Warm workers for `oracle matrix`: a fork server that imported the oracle, torch and the
matrix's backends once forks a fresh child per check, so no check pays interpreter start-up
and imports. Each child runs one check exactly as `python -m oracle.cli check ...` would (in
its own session, output to files) and exits with its exit code; see oracle/matrix.py.

This module is the fork server's preload (`set_forkserver_preload(["oracle.worker"])`): on
import there, with $MOE_ORACLE_WARM_BACKENDS set (only in the fork server's environment),
it does the imports. Anywhere else importing it imports nothing heavy."""

from __future__ import annotations

import io
import os
import sys

WARM_ENV = "MOE_ORACLE_WARM_BACKENDS"  # comma-separated backend names; set for the fork server's start only


def warm_up(backends: list[str]) -> None:
    """What `oracle check` imports, in its order (oracle.quiet first: transformers reads its
    verbosity at import), before any torch op runs or any thread a fork would lose starts.
    Best effort: a backend that fails to import is the check's error, reported there. Output
    (import chatter) is discarded."""
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    try:
        from oracle.quiet import quiet

        quiet()
        import importlib

        # the CLI (run by each child as a program: run_check) and what its check command imports
        for module in ("oracle.cli", "oracle.check", "oracle.reports.markdown", "oracle.reports.result"):
            importlib.import_module(module)
        from oracle.backend import resolve

        for name in backends:
            try:
                resolve(name)
            except BaseException:  # noqa: BLE001 (a plugin may even sys.exit on import)
                pass
    except BaseException:  # noqa: BLE001 (never take the fork server down: its children import what they need)
        pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _unbuffered(name: str, fd: int) -> None:
    """sys.stdout / sys.stderr as PYTHONUNBUFFERED=1 makes them (the cold subprocess runs
    with it): every write reaches the file at once, so a crash loses nothing."""
    old = getattr(sys, name)
    try:
        old.flush()
    except (OSError, ValueError):
        pass
    new = io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), encoding=getattr(old, "encoding", None) or "utf-8",
                           errors=getattr(old, "errors", None) or "strict", write_through=True)
    setattr(sys, name, new)
    setattr(sys, f"__{name}__", new)


def run_check(argv: list[str], env: dict, out_path: str, err_path: str) -> None:
    """In a child forked from the fork server: `oracle check` with `argv`, then exit with its
    exit code. Its own session first, so a timeout's kill of the process group takes the
    compilers it starts too; fd 1 and 2 go to files (a compiler's output included) that the
    matrix reads for the error row."""
    os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    _unbuffered("stdout", 1)
    _unbuffered("stderr", 2)
    os.environ.clear()  # this check's environment, not the one the fork server started with
    os.environ.update(env)
    import runpy

    sys.argv = ["oracle.cli", *argv]
    interrupted = False
    try:  # `python -m oracle.cli check ...`, as the cold path runs it (its imports are preloaded)
        runpy.run_module("oracle.cli", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:  # as the interpreter exits on it
        code = e.code
    except BaseException as e:  # noqa: BLE001 (as the interpreter: traceback on stderr, exit 1)
        sys.excepthook(*sys.exc_info())
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    _exit(code, interrupted)


def _exit(code: int, interrupted: bool = False) -> None:
    """Exit as the interpreter does (wait for threads, atexit handlers, flush), with `code`;
    `interrupted` (an uncaught KeyboardInterrupt): killed by SIGINT, as the interpreter is."""
    import atexit
    import signal
    import threading

    try:
        threading._shutdown()  # noqa: SLF001 (what interpreter shutdown does first)
    except BaseException:  # noqa: BLE001
        pass
    try:
        atexit._run_exitfuncs()  # noqa: SLF001 (multiprocessing children skip them otherwise)
    except BaseException:  # noqa: BLE001
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code & 0xFF)


if os.environ.get(WARM_ENV) is not None:  # imported as the fork server's preload
    warm_up([b for b in os.environ.pop(WARM_ENV).split(",") if b])
