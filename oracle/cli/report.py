"""`oracle report merge | diff`: join sharded matrix runs, or diff two runs for a pull request."""

from __future__ import annotations

import sys

from oracle.cli.common import EXIT, check_outputs, fail_input
from oracle.reports.result import Status


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    rep = sub.add_parser("report", help="join sharded matrix runs, or diff two runs for a pull request")
    rsub = rep.add_subparsers(dest="report_cmd", required=True)
    mg = rsub.add_parser("merge", help="join shard report dirs into one")
    mg.add_argument("dirs", nargs="+")
    mg.add_argument("--report-dir", required=True)
    df = rsub.add_parser("diff", help="markdown comment: what changed against a baseline (exit 1 on regression)")
    df.add_argument("--baseline", required=True, help="baseline summary.json (or the matrix run's --report-dir)")
    df.add_argument("--current", required=True, help="current summary.json (or its --report-dir)")
    df.add_argument("--format", choices=["md", "json"], default="md")
    df.add_argument("--factor", type=float, default=4.0, help="a block regressed when its error grew more (4)")


def cmd_report(a) -> int:
    import json
    from pathlib import Path

    from oracle.reports import summary as S

    if a.report_cmd == "merge":
        check_outputs(dirs=[("--report-dir", a.report_dir)])
    try:
        if a.report_cmd == "merge":
            from oracle.matrix import merge_dirs

            merged = merge_dirs([Path(d) for d in a.dirs], Path(a.report_dir))
            print(S.markdown(merged), end="")
            return 0 if merged["status"] == Status.PASS else EXIT["fail"]
        docs = {}
        for flag, path in (("--baseline", a.baseline), ("--current", a.current)):
            if Path(path).is_dir():  # a matrix run's --report-dir: its summary
                if not (Path(path) / "summary.json").is_file():
                    fail_input(f"{flag} {path}: a directory without summary.json (not a matrix run's --report-dir)")
                path = str(Path(path) / "summary.json")
            if not Path(path).is_file():
                fail_input(f"{flag} {path}: no such file (a matrix run's summary.json or its --report-dir)")
            try:
                docs[flag] = S.load(path)
            except (OSError, ValueError, KeyError, TypeError) as e:
                fail_input(f"{flag} {path}: {e}")
        try:
            d = S.diff(docs["--baseline"], docs["--current"], a.factor)
        except (KeyError, TypeError, AttributeError) as e:  # valid JSON with the schema tag, rows malformed
            fail_input(f"--baseline {a.baseline} / --current {a.current}: malformed summary rows ({type(e).__name__}: {e})")
    except (OSError, ValueError) as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    print(json.dumps(d, indent=1) if a.format == "json" else S.diff_markdown(d), end="")
    return EXIT["fail"] if d["regressed"] else 0
