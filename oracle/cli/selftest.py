"""`oracle selftest`: the seeded-fault catalogue (or the conversion defects) through a backend."""

from __future__ import annotations

import os
import sys

from oracle.cli.common import (EXIT, cache_limit_option, check_outputs, fail_input, options_of, positive_int,
                                progress_reporter, run_and_report, weights_option)


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    s = sub.add_parser("selftest", help="run the seeded-fault catalogue: does the oracle catch and localise?")
    s.add_argument("--family", action="append", help="limit to this family (repeatable; default every supported family)")
    s.add_argument("--backend", default="eager")
    s.add_argument("--seeds", default="0,1,2", help="seeds of the clean (no-fault) runs (default 0,1,2)")
    s.add_argument("--precision", default="fp32", help="of the clean runs and every fault (default fp32); at bf16 "
                   "each fault also runs at fp32 to say whether it is above bf16's own error (only those are required)")
    weights_option(s)
    s.add_argument("--fault", action="append", help="limit to this fault (repeatable; default the catalogue)")
    s.add_argument("--shard", help="I/N: the families of shard I of N (every N-th family; the N shards cover them once)")
    s.add_argument("--json", help="write the selftest report here")
    s.add_argument("--resume", action="store_true", help="where the --json report exists (a run cut short): keep "
                   "its finished rows and run the rest (the same settings required)")
    s.add_argument("--drill", action="store_true", help="drill each detected fault's block (docs/drill.md) and report "
                   "the share whose first diverging point is the one the fault breaks")
    s.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="passed to every check")
    s.add_argument("-j", "--jobs", type=positive_int, default=1, metavar="N",
                   help="run up to N checks at once, each in a worker process (default 1): the same rows in the same "
                   "order; a compiled backend's self-test is mostly its lowerings, one core each (2 on a 2-core "
                   "machine halves it); each worker needs the memory of one check")
    s.add_argument("--list", action="store_true", help="run nothing: list each family's faults on the backend, "
                   "the block each must be found at, and those not run with why")
    s.add_argument("--conversion", action="store_true", help="the conversion defects instead (mlx, llamacpp): each "
                   "format the backend ships written by its exporter, unmodified (must pass) and with each defect "
                   "(experts exchanged, a projection transposed, ...: must fail the weight check naming its tensor)")
    s.add_argument("--format", action="append", help="with --conversion: limit to this shipped format (repeatable; "
                   "mlx: 'q8 g32', 'q8 g64', 'q4 g32', 'q4 g64'; llamacpp: F32, Q8_0, Q4_K_M)")
    cache_limit_option(s)


def cmd_selftest(a) -> int:
    import json

    from oracle.backend import InputError
    from oracle.reports.result import write_atomic
    from oracle.selftest.result import load_report, render, row_line
    from oracle.selftest.run import run_selftest

    check_outputs(files=[("--json", a.json)])
    if a.resume and (not a.json or a.json == "-"):
        fail_input("--resume needs --json PATH: the report it resumes and rewrites")
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
        if len(set(seeds)) < len(seeds):
            raise ValueError
    except ValueError:
        print(f"oracle: error: --seeds expects distinct comma-separated integers, got {a.seeds!r}", file=sys.stderr)
        return EXIT["bad_input"]
    families = a.family
    if a.shard:
        from models import FAMILY_NAMES
        from oracle.matrix import parse_shard

        try:
            i, n = parse_shard(a.shard)
        except ValueError as e:
            print(f"oracle: error: {e}", file=sys.stderr)
            return EXIT["bad_input"]
        families = list(families or FAMILY_NAMES)[i - 1 :: n]
        if not families:
            print(f"oracle: error: --shard {a.shard}: no family in this shard", file=sys.stderr)
            return EXIT["bad_input"]
    if a.conversion:
        return cmd_conversion_selftest(a, families)
    if a.format:
        fail_input("--format goes with --conversion")
    if a.list:
        from oracle.selftest.run import plan, plan_text

        try:
            print(plan_text(plan(a.backend, families, a.fault, options_of(a), a.weights, a.precision)), end="")
        except InputError as e:
            print(f"oracle: error: {e}", file=sys.stderr)
            return EXIT["bad_input"]
        return 0
    prog, update = progress_reporter()
    say = prog.console.print if prog else lambda line: print(line, file=sys.stderr, flush=True)
    save = lambda res, complete=True: write_atomic(  # noqa: E731
        a.json, json.dumps(res.to_dict(complete), indent=1, sort_keys=True, default=str) + "\n")

    def on_row(res, row):  # a line a finished row (long runs: an hour a family on a compiled backend), and
        say(f"selftest {a.backend}: {row_line(row)}")  # the report so far: a cut run keeps what finished
        if a.json and a.json != "-":
            save(res, complete=False)

    try:
        done = load_report(a.json) if a.resume and os.path.exists(a.json) else None
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    if done is not None:
        say(f"selftest {a.backend}: resuming {a.json}: {len(done.faults)} fault(s) and "
            f"{len(done.false_alarms)} clean run(s) finished")
    run = lambda progress=None: run_selftest(  # noqa: E731
        a.backend, families, seeds, a.fault, progress, options_of(a), a.weights, a.precision, a.drill, on_row,
        **({"resume": done, "resume_from": a.json} if done is not None else {}), jobs=a.jobs,
        notice=lambda line: say(f"selftest {a.backend}: {line}"))
    return run_and_report(run, prog, update, render, a.json, save)


def cmd_conversion_selftest(a, families) -> int:
    import json

    from oracle.reports.result import write_atomic
    from oracle.selftest.conversion import render, row_line, run_conversion_selftest

    for flag, given in (("--list", a.list), ("--resume", a.resume), ("--drill", a.drill), ("--option", a.option),
                        ("--precision", a.precision != "fp32"), ("--weights", a.weights != "normal")):
        if given:
            fail_input(f"{flag} does not go with --conversion (the formats are the backend's shipped_formats)")
    prog, update = progress_reporter()
    say = prog.console.print if prog else lambda line: print(line, file=sys.stderr, flush=True)
    on_row = lambda res, row: say(f"selftest --conversion {a.backend}: {row_line(row)}")  # noqa: E731
    run = lambda progress=None: run_conversion_selftest(a.backend, families, a.format, a.fault, progress, on_row)  # noqa: E731

    def save(res):
        write_atomic(a.json, json.dumps(res.to_dict(), indent=1, sort_keys=True, default=str) + "\n")
    return run_and_report(run, prog, update, render, a.json, save)
