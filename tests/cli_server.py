"""`oracle ...` for the tests without paying the interpreter's imports each time.

About 120 of the suite's calls run the CLI in a subprocess (exit codes and output as a user sees
them); each imported torch and transformers again: 2-4 s of CPU a call on 2 cores, a third of a
warm `make test`. This is the matrix's warm path (oracle/worker.py) for the tests: one server per
pytest process imports what `oracle check` on eager and hf imports, then forks a fresh child per
call, which runs `python -m oracle.cli ARGS` exactly as oracle.worker.run_check does for a matrix
check (its own session, the call's environment, fd 1 and 2 to files) in the call's directory, and
exits with its exit code. Each call is still its own process: a crash, os._exit or a hang costs that
call alone, and no state passes from one call to the next (the server runs no check itself).

Used where the call runs from the checkout's root (sys.path[0] of `python -m` is the current
directory: a call from elsewhere, e.g. a plugin in the current directory, runs cold, as before), on
Linux only; ORACLE_TEST_COLD_CLI=1 runs every call cold."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve() -> None:
    """The server: requests on stdin (a JSON line each), the child's pid then its exit code on stdout."""
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(2, 1)  # nothing the imports print reaches the protocol
    from oracle import worker

    worker.warm_up(["eager", "hf"])
    for line in requests:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                requests.close()
                replies.close()
                os.chdir(req["cwd"])
                worker.run_check(req["argv"], req["env"], req["out"], req["err"])  # exits
            finally:
                os._exit(70)
        replies.write(f"{pid}\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(f"{os.waitstatus_to_exitcode(status)}\n")
        replies.flush()


class Server:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli_server"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _line(self, timeout: float | None) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise EOFError("the warm CLI server exited")
        return line.strip()

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory(prefix="oracle-cli-") as d:
            out, err = Path(d) / "out", Path(d) / "err"
            self.proc.stdin.write(json.dumps({"argv": list(args), "env": env, "cwd": str(cwd),
                                              "out": str(out), "err": str(err)}) + "\n")
            self.proc.stdin.flush()
            # the fork's pid (the first call waits for the server's imports: within the call's timeout too)
            pid = self._line(timeout)
            if pid is None:  # the server never forked: stopped (the next call starts another)
                self.close()
                raise subprocess.TimeoutExpired(["oracle", *args], timeout)
            pid = int(pid)
            code = self._line(timeout)
            if code is None:  # as subprocess.run's timeout: the call killed (with what it started)
                from oracle.matrix import kill_session

                kill_session(pid)
                self._line(None)
                raise subprocess.TimeoutExpired(["oracle", *args], timeout)
            return subprocess.CompletedProcess(["oracle", *args], int(code), out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


_server: Server | None = None


def run(args, cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess | None:
    """The call through this process's server (started on first use), or None where it runs cold."""
    global _server
    if (os.environ.get("ORACLE_TEST_COLD_CLI") == "1" or not sys.platform.startswith("linux")
            or Path(cwd).resolve() != ROOT):
        return None
    for _ in range(2):  # a server that died (killed from outside) is started again once
        if _server is None:
            import atexit

            _server = Server({**env, "PYTHONUNBUFFERED": "1"})
            atexit.register(_server.close)
        try:
            return _server.run([str(a) for a in args], Path(cwd), env, timeout)
        except (EOFError, BrokenPipeError, ValueError):
            _server.close()
            _server = None
    return None


if __name__ == "__main__":
    serve()
