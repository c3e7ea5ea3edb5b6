"""`oracle`: the command line, one module per command (its options and what it runs) over a small
shared parser (oracle/cli/common.py).

Exit codes: 0 pass (or skipped without --require), 1 fail, 2 bad input,
3 skipped with --require, 4 backend error."""

from __future__ import annotations

import argparse
import sys

from models import moved
from oracle.cli import cache, check, export, goldens, info, matrix, reference, report, selftest
from oracle.cli.common import (EXIT, Parser, apply_cache_limit, terminate_cleanly, version)  # noqa: F401 (oracle.cli.EXIT)
from oracle.quiet import quiet

__getattr__ = moved.forward("oracle.cli")  # the names of the module this package was before 2026-12, for one release


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="oracle", description="Numerical-validation oracle for MoE LLM backends.")
    p.add_argument("--version", action="version", version=f"moe-oracle {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in (check, export, selftest, matrix, report, goldens, reference, info, cache):
        command.add(sub)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)  # before any heavy import: --help and usage errors need none
    with terminate_cleanly():
        return run_command(a, argv)


def run_command(a, argv) -> int:
    quiet()
    apply_cache_limit(a)
    commands = {"cache": cache.cmd_cache, "families": info.cmd_families, "backends": info.cmd_backends,
                "export": export.cmd_export, "selftest": selftest.cmd_selftest, "matrix": matrix.cmd_matrix,
                "goldens": goldens.cmd_goldens, "report": report.cmd_report, "reference": reference.cmd_reference}
    if a.cmd == "families" or a.cmd == "backends":
        return commands[a.cmd]()
    if a.cmd in commands:
        return commands[a.cmd](a)
    return check.cmd_check(a, sys.argv[1:] if argv is None else list(argv))

