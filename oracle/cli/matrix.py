"""`oracle matrix`: every family x backend x precision, each check isolated."""

from __future__ import annotations

from oracle.cli.common import (EXIT, cache_limit_option, check_outputs, fail_input, known_family, positive_int,
                                progress_reporter, weights_option)
from oracle.reports.result import Status


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
    m = sub.add_parser("matrix", help="run every family x backend x precision, each check isolated")
    m.add_argument("--families", help="comma-separated (default: every supported family; with --model-dir / --config, the family its config names)")
    m.add_argument("--backends", default="eager", help="comma-separated (default: eager)")
    m.add_argument("--precisions", default="fp32", help="comma-separated (default: fp32)")
    m.add_argument("--shard", help="I/N: run shard I of N (deterministic split)")
    m.add_argument("--report-dir", required=True)
    m.add_argument("--timeout", type=positive_int, default=1800, help="per-check timeout in seconds")
    m.add_argument("-j", "--jobs", type=positive_int, metavar="N",
                   help="run up to N checks at once, each in its own process (on Linux forked from a server "
                        "that did the imports once) (default: the number of CPUs; 1: one after the other, in "
                        "order); the reports are the same for any N, only the timings differ. Every check holds "
                        "its own model: lower N for large checkpoints")
    m.add_argument("--seed", type=int, default=0)
    weights_option(m)
    m.add_argument("--require", action="store_true", help="an unavailable backend fails the matrix")
    msrc = m.add_mutually_exclusive_group()
    msrc.add_argument("--model-dir", help="check this HF checkpoint directory (one family: --families F)")
    msrc.add_argument("--config", help="a seeded checkpoint of a published config (see `oracle check --config`)")
    m.add_argument("--layers", type=positive_int, help="with --config: cut the depth to N layers")
    m.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="passed to every check")
    cache_limit_option(m)


def cmd_matrix(a) -> int:
    from oracle.matrix import combos, parse_shard, run_matrix, shard

    if a.families is None and (a.model_dir or a.config):  # the one family that checkpoint's config names
        from oracle.backend import InputError
        from oracle.source.validation import family_of

        try:
            a.families = family_of(a.model_dir, a.config, a.layers)
        except InputError as e:
            fail_input(str(e))
    from models import FAMILY_NAMES

    fams = [x for x in (a.families or ",".join(FAMILY_NAMES)).split(",") if x]
    backends = [x for x in a.backends.split(",") if x]
    precisions = [x for x in a.precisions.split(",") if x]
    matrix_names_known(fams, backends, precisions)  # a typo in a nightly workflow is no green run of skips
    if a.weights != "normal" and a.model_dir:
        fail_input(f"--weights {a.weights} makes the tiny or --config checkpoint's weights; --model-dir is a "
                   "checkpoint with its own")
    cs = combos(fams, backends, precisions)
    if a.shard:
        try:
            cs = shard(cs, *parse_shard(a.shard))
        except ValueError as e:
            fail_input(str(e))
    check_outputs(dirs=[("--report-dir", a.report_dir)])
    prog, update = progress_reporter()
    from pathlib import Path

    extra = [x for kv in a.option for x in ("--option", kv)] + (["--require"] if a.require else [])
    if (a.model_dir or a.config) and len(fams) != 1:
        fail_input("--model-dir / --config name one checkpoint: give its family alone with --families")
    if a.layers and not a.config:
        fail_input("--layers applies to --config")
    for flag, value in (("--model-dir", a.model_dir), ("--config", a.config), ("--layers", a.layers)):
        if value is not None:
            extra += [flag, str(value)]
    if a.weights != "normal":  # (normal: the command lines every check ran with before the profiles)
        extra += ["--weights", a.weights]
    if prog:
        with prog:
            summary = run_matrix(cs, Path(a.report_dir), a.timeout, a.seed, extra, progress=update,
                                 require=a.require, jobs=a.jobs)
    else:
        summary = run_matrix(cs, Path(a.report_dir), a.timeout, a.seed, extra, require=a.require, jobs=a.jobs)
    from oracle.reports.summary import markdown

    print(markdown(summary), end="")
    return 0 if summary["status"] == Status.PASS else EXIT["fail"]


def matrix_names_known(families, backends, precisions) -> None:
    """Refuse (exit 2, before any check runs) a family, backend or precision the oracle does not
    know. A known backend that is unavailable here, or that lacks one of the precisions, is a
    skipped row with its reason, as for `check`; a plugin (package.module:attr) must import."""
    from oracle.backend import BackendError, builtin_names, resolve
    from oracle.verdict import thresholds

    for flag, given in (("--families", families), ("--backends", backends), ("--precisions", precisions)):
        if not given:
            fail_input(f"{flag}: empty list")
    for f in families:
        known_family("--families", f)
    for b in backends:
        if b not in builtin_names():
            if ":" not in b:
                fail_input(f"--backends: unknown backend {b!r}; built-in: {', '.join(builtin_names())}; "
                           "or give a plugin as package.module:attr")
            try:
                resolve(b)
            except BackendError as e:
                fail_input(f"--backends: {e}")
    for p in precisions:
        if p not in thresholds.precisions():
            fail_input(f"--precisions: unknown precision {p!r}; known: {', '.join(thresholds.precisions())}")
