"""A program brought from elsewhere (--pte / --vmfb): `oracle check` of it runs in a child process, so
that a runtime crashing on it is exit 2 naming the program, not the end of the run (the backends' own
checks of such a program, before a runtime of this process sees it: exporters/shared/given.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


CONTAINED = "MOE_ORACLE_GIVEN_PROGRAM_CHILD"  # set in the child that runs the check of a given program


def check_in_child(argv: list[str], flag: str, program: str) -> int:
    """`oracle check ARGV` of a given program, run in a child process: a program can pass every
    check below and still crash its runtime when it runs (a flipped byte in compiled code, an
    offset out of range: IREE segfaults), and that is exit 2 naming the program, not the end of
    the run. The child's output and exit status are passed on as they are."""
    env = {**os.environ, CONTAINED: "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-m", "oracle.cli", *argv], env=env, capture_output=True, text=True,
                       errors="replace")
    sys.stdout.write(r.stdout)
    if r.returncode >= 0:
        sys.stderr.write(r.stderr)
        return r.returncode
    how = signal.Signals(-r.returncode).name if -r.returncode in signal.valid_signals() else f"signal {-r.returncode}"
    log = runtime_log(r.stderr)
    runtime = {"--pte": "the ExecuTorch runtime", "--vmfb": "the IREE runtime"}.get(flag, "its runtime")
    print(f"oracle: error: {flag} {program}: {runtime} crashed running it ({how}{': ' + log if log else ''}); "
          "not a program it can run", file=sys.stderr)
    return 2


def runtime_log(stderr: str) -> str:
    """The runtime's last log line (ExecuTorch: `[program.cpp:114] File size is too small...`), or
    the last line of whatever it wrote, on one line and short."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    logged = [ln for ln in lines if re.match(r"\[\w+\.\w+:\d+\]", ln)]
    text = (logged or lines or [""])[-1]
    return text[:300]
