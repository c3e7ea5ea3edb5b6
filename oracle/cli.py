"""`oracle`: the command line.

Exit codes: 0 pass (or skipped without --require), 1 fail, 2 bad input,
3 skipped with --require, 4 backend error.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from oracle.quiet import quiet
from oracle.result import Status

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


# models.trained.PROFILES (not imported here: --help and usage errors import nothing heavy)
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


def parser() -> argparse.ArgumentParser:
    p = Parser(prog="oracle", description="Numerical-validation oracle for MoE LLM backends.")
    p.add_argument("--version", action="version", version=f"moe-oracle {version()}")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="check one family on one backend against HF transformers fp32")
    c.add_argument("--family", help="default: the family the --model-dir / --config config.json names")
    c.add_argument("--backend", required=True, help="built-in name (see `oracle backends`) or package.module:attr")
    src = c.add_mutually_exclusive_group()
    src.add_argument("--model-dir", help="HF checkpoint directory (config.json + *.safetensors)")
    src.add_argument("--tiny", action="store_true", help="the family's tiny seeded checkpoint (default)")
    src.add_argument("--config", help="a seeded checkpoint of a published config: NAME in models/configs/ "
                     "(see `oracle families`) or a config.json path")
    c.add_argument("--layers", type=positive_int, help="with --config: cut the depth to N layers")
    c.add_argument("--candidate-dir", help="a shipped (e.g. mlx-lm quantized) directory for the backend to load as "
                   "the candidate; the reference is HF on its dequantized weights, and with the original "
                   "checkpoint (--model-dir / --config / tiny) the quantization error is reported apart")
    c.add_argument("--precision", default="fp32", help="fp32 (default), bf16, or q8/q4 where the backend quantizes "
                   "(with --candidate-dir: the activation dtype, fp32 or bf16)")
    c.add_argument("--quant-reference", choices=["dequantized", "original"], default="dequantized",
                   help="q8/q4 on a backend that writes its quantized directory (mlx): judge the candidate against HF "
                   "on those weights dequantized, at the fp32 limits, the quantization's own loss reported apart "
                   "(dequantized, default), or against HF on the original weights by the q8/q4 table (original)")
    prog = c.add_mutually_exclusive_group()
    prog.add_argument("--pte", help="an ExecuTorch program built elsewhere (e.g. by `oracle export`; its .ptd beside "
                      "it) for the executorch backends to run instead of building one")
    prog.add_argument("--vmfb", help="an IREE program built elsewhere (model.irpa beside it) for iree-llvm-cpu to run")
    prog.add_argument("--gguf", help="a GGUF file as shipped (any llama.cpp type: F32, BF16, Q8_0, Q4_K_M...) for "
                      "llamacpp to run, checked against the checkpoint it claims to be (--model-dir / --config / tiny): "
                      "llama.cpp against HF on the GGUF's own weights dequantized, and the quantization's loss apart")
    c.add_argument("--reference", help="a reference directory written by `oracle reference save` (used where its "
                   "checkpoint sha256 is this check's; no HF run)")
    ptext = c.add_mutually_exclusive_group()
    ptext.add_argument("--prompt", help="a text prompt, tokenized with the checkpoint's own tokenizer (default: "
                       "--prompt-len random token ids)")
    ptext.add_argument("--prompts", metavar="FILE", help="prompts, one per line or JSONL ({\"text\": ...}): each "
                       "checked end to end, the distribution metrics and perplexity aggregated over all")
    c.add_argument("--prompt-len", type=positive_int, default=8)
    c.add_argument("--decode-tokens", type=positive_int, default=8,
                   help="single-token decode steps after the prefill (default 8)")
    c.add_argument("--seed", type=int, default=0, help="tiny weights and prompt tokens (default 0)")
    weights_option(c)
    c.add_argument("--json", help="write the JSON report here ('-': standard output, instead of the summary)")
    c.add_argument("--markdown", help="write the markdown summary here ('-': standard output)")
    c.add_argument("--require", action="store_true", help="a skipped (unavailable) backend is a failure: exit 3")
    c.add_argument("--validate-only", action="store_true", help="read and check every input (options, checkpoint "
                   "and config, --pte/--vmfb/--gguf, --reference, --prompts) and stop: exit 0 when all are valid, 2 naming "
                   "the first that is not; no reference is captured, nothing is run or written")
    c.add_argument("--sampling", action="store_true", help="add the on-device sampler gate rows")
    c.add_argument("--drill", choices=["auto", "all", "off"], default="auto",
                   help="the points inside blocks, compared one by one (the first that diverges): auto (default) the "
                   "worst failing block of a failing check, all: every block, off: none; backends without points "
                   "say n/a")
    c.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8; >= 0)")
    c.add_argument("--top-p", type=float, default=0.9, help="sampling top-p (default 0.9; in (0, 1])")
    backend_options(c)
    cache_limit_option(c)
    e = sub.add_parser("export", help="write a backend's compiled artifacts and a manifest")
    e.add_argument("--family", help="default: the family the --model-dir / --config config.json names")
    e.add_argument("--backend", required=True)
    esrc = e.add_mutually_exclusive_group()
    esrc.add_argument("--model-dir")
    esrc.add_argument("--tiny-test", action="store_true", help="the family's tiny seeded checkpoint (default)")
    esrc.add_argument("--config", help="a seeded checkpoint of a published config (see `oracle check --config`)")
    e.add_argument("--layers", type=positive_int, help="with --config: cut the depth to N layers")
    e.add_argument("--output-dir", required=True)
    e.add_argument("--precision", default="fp32")
    e.add_argument("--seed", type=int, default=0)
    weights_option(e)
    e.add_argument("--max-seq-len", type=positive_int, default=128, help="static cache length (default 128)")
    e.add_argument("--prompt-len", type=positive_int, default=8, help="prefill length where it is static")
    e.add_argument("--qlinear", choices=["4w", "8w", "8da4w"], help="weight quantization (ExecuTorch exporters)")
    e.add_argument("--qlinear-group-size", type=positive_int, help="quantization group size")
    e.add_argument("--sample", action="store_true", help="fuse the on-device sampler (where supported)")
    backend_options(e)
    cache_limit_option(e)
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
    g = sub.add_parser("goldens", help="check or freeze golden tokens and structural goldens")
    gsub = g.add_subparsers(dest="goldens_cmd", required=True)
    for name, hlp in (("check", "run the checks that have goldens and compare"),
                      ("freeze", "write goldens for family/backend after its numeric check passes")):
        gp = gsub.add_parser(name, help=hlp)
        gp.add_argument("--family", action="append", help="limit to this family (repeatable)")
        gp.add_argument("--backend", action="append", help="limit to this backend (repeatable)")
        if name == "freeze":
            gp.add_argument("--precision", help="freeze at this precision (default: the goldens' own, fp32): "
                            "another precision writes only its structural goldens, <name>.<precision>.txt")
    rf = sub.add_parser("reference", help="save a captured HF reference as a portable directory")
    rfsub = rf.add_subparsers(dest="reference_cmd", required=True)
    rs = rfsub.add_parser("save", help="capture the HF fp32 reference of a checkpoint and write it to --out")
    rs.add_argument("--family", help="default: the family the --model-dir / --config config.json names")
    rsrc = rs.add_mutually_exclusive_group()
    rsrc.add_argument("--model-dir")
    rsrc.add_argument("--tiny", action="store_true", help="the family's tiny seeded checkpoint (default)")
    rsrc.add_argument("--config")
    rs.add_argument("--layers", type=positive_int)
    rs.add_argument("--prompt-len", type=positive_int, default=8)
    rs.add_argument("--decode-tokens", type=positive_int, default=8)
    rs.add_argument("--seed", type=int, default=0)
    weights_option(rs)
    rs.add_argument("--out", required=True, help="the directory to write (replaced if it is a saved reference)")
    sub.add_parser("families", help="list model families")
    sub.add_parser("backends", help="list backends and whether they are available here")
    ca = sub.add_parser("cache", help="list or prune the artifact cache ($MOE_ORACLE_CACHE, default "
                        "~/.cache/moe-oracle): programs, GGUFs, checkpoints, references, noise",
                        description="The artifact cache: entries built once and found again by content. It is kept "
                        "within a size limit (MOE_ORACLE_CACHE_LIMIT or --cache-limit on the commands that build; "
                        "default 32G): after each new entry the least recently used ones no running process holds "
                        "are removed, and an artifact that cannot fit is refused before it is built (exit 2). An "
                        "entry a running check holds is never removed.")
    csub = ca.add_subparsers(dest="cache_cmd", required=True)
    cl = csub.add_parser("list", help="every entry with its size, age (since last used) and whether a running "
                         "process holds it, least recently used first; the total against the limit")
    cl.add_argument("--json", action="store_true", help="the entries as JSON on standard output")
    cp = csub.add_parser("prune", help="remove entries (never one a running process holds). With no selector: "
                         "the least recently used until the cache is within its limit")
    cp.add_argument("--all", action="store_true", help="every entry")
    cp.add_argument("--backend", action="append", help="the artifacts this backend built (repeatable)")
    cp.add_argument("--older-than", type=float, metavar="DAYS", help="entries not used for more than DAYS days")
    cp.add_argument("--max-size", metavar="SIZE", help="the least recently used until the cache is at most SIZE "
                    "(e.g. 20G, 500M)")
    cp.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    cache_limit_option(ca)
    return p


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
    from oracle.result import output_problem

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


def cmd_families() -> int:
    from models import FAMILY_NAMES, UNSUPPORTED, get_family

    for name in FAMILY_NAMES:
        f = get_family(name)
        print(f"{name:14s} supported    HF {f.hf_class_name} (model_type {', '.join(f.model_types)})")
    for name, why in UNSUPPORTED.items():
        print(f"{name:14s} unsupported  missing: {why}")
    from models.checkpoint import known_configs

    print(f"published configs (--config NAME [--layers N]): {known_configs()}")
    return 0


def cmd_backends() -> int:
    from oracle.backend import BackendError, builtin_names, resolve

    for name in builtin_names():
        try:
            b = resolve(name)
            ok, reason = b.availability()
        except BackendError as e:
            b, ok, reason = None, False, str(e)
        print(f"{name:18s} {'available' if ok else 'unavailable'}{'' if ok else ': ' + reason}")
        if b is not None:
            if b.precisions:
                print(f"    precisions: {', '.join(b.precisions)}")
            schema = b.option_schema
            for o in schema:
                print(f"    {o.describe()}")
            if not schema:
                print("    options: none")
    return 0


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
    from oracle.validation import family_of

    try:
        a.family = family_of(a.model_dir, a.config, a.layers)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return False
    return True


def read_prompts(a) -> tuple[str, ...] | None:
    """--prompt TEXT, or --prompts FILE: one prompt per line (blank lines skipped), or JSONL
    objects with a "text" (or "prompt") string. Exit 2 for an unreadable or empty file."""
    import json

    if a.prompt is not None:
        if not a.prompt.strip():
            fail_input("--prompt is empty")
        return (a.prompt,)
    if a.prompts is None:
        return None
    try:
        lines = [ln for ln in open(a.prompts, encoding="utf-8").read().splitlines() if ln.strip()]
    except (OSError, UnicodeDecodeError) as e:
        fail_input(f"--prompts {a.prompts}: cannot read ({e})")
    texts = []
    for i, ln in enumerate(lines, 1):
        if ln.lstrip().startswith("{"):
            try:
                obj = json.loads(ln)
            except ValueError as e:
                fail_input(f"--prompts {a.prompts}:{i}: not valid JSON ({e})")
            text = obj.get("text", obj.get("prompt")) if isinstance(obj, dict) else None
            if not isinstance(text, str) or not text.strip():
                fail_input(f"--prompts {a.prompts}:{i}: a JSON line needs a non-empty \"text\" string")
            texts.append(text)
        else:
            texts.append(ln)
    if not texts:
        fail_input(f"--prompts {a.prompts}: no prompt in the file")
    return tuple(texts)


def cmd_check(a, argv: list[str]) -> int:
    given = a.pte or a.vmfb
    if given and not os.environ.get("MOE_ORACLE_GIVEN_PROGRAM_CHILD"):  # a program brought from elsewhere runs in
        from exporters.given import check_in_child  # a child process: its crash is exit 2, not this process's end

        return check_in_child(argv, "--pte" if a.pte else "--vmfb", given)
    from oracle.backend import CheckSpec, InputError
    from oracle.check import run_check
    from oracle.validation import validate
    from oracle.report import markdown
    from oracle.result import dumps, write_atomic

    if a.json == "-" and a.markdown == "-":
        fail_input("--json - and --markdown - cannot both be standard output")
    check_outputs(files=[("--json", a.json), ("--markdown", a.markdown)])
    options = options_of(a)
    if a.sampling:
        from models.sampling import check_args

        try:
            check_args(a.temperature, a.top_p)
        except ValueError as e:
            print(f"oracle: error: {e}", file=sys.stderr)
            return EXIT["bad_input"]
        options["sampling"] = {"temperature": a.temperature, "top_p": a.top_p}
    if a.family is None and not default_family(a):
        return EXIT["bad_input"]
    spec = CheckSpec(family=a.family, backend=a.backend, precision=a.precision, prompt_len=a.prompt_len,
                     decode_tokens=a.decode_tokens, seed=a.seed, model_dir=a.model_dir, config=a.config,
                     layers=a.layers, weights=a.weights, candidate_dir=a.candidate_dir,
                     quant_reference=a.quant_reference, reference=a.reference,
                     prompts=read_prompts(a), artifact=a.pte or a.vmfb or a.gguf, options=options, drill=a.drill)
    prog, update = progress_reporter()
    try:
        backend = validate(spec)
        if prog:
            with prog:
                result = run_check(spec, backend, update, validate_only=a.validate_only)
        else:
            result = run_check(spec, backend, validate_only=a.validate_only)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    if a.validate_only:  # nothing was run: no report
        if result.status == Status.SKIPPED:
            print(f"oracle: backend {spec.backend} is unavailable here ({result.skipped_reason}): inputs not checked",
                  file=sys.stderr)
            return EXIT["skipped_required"] if a.require else EXIT["pass"]
        from models.cache import human
        from oracle.backend import available_memory

        ckpt, plan = result.provenance.get("checkpoint") or {}, result.provenance.get("plan") or {}
        parts = []
        if plan.get("memory_bytes"):
            avail = available_memory()
            parts.append(f"the check's memory about {human(plan['memory_bytes'])} ({plan['memory']}; "
                         + (f"{human(avail)} available)" if avail else "it fits)"))
        if plan.get("cache_bytes"):
            parts.append(f"about {human(plan['cache_bytes'])} of cache beside the checkpoint (the reference and the "
                         "noise measurements; it fits)")
        needs = ", and ".join(parts)
        if ckpt.get("not_built"):
            print(f"oracle: inputs valid ({spec.family} on {spec.backend}): the config; its seeded checkpoint is not "
                  f"built yet: {ckpt['parameters'] / 1e9:.2f} B parameters, {human(ckpt['bytes'])} of disk in the cache "
                  f"(it fits){'; ' + needs if needs else ''}. Prompts and a saved reference are checked once it is built.")
            return EXIT["pass"]
        print(f"oracle: inputs valid ({spec.family} on {spec.backend}){': ' + needs if needs else ''}")
        return EXIT["pass"]
    doc_json = dumps(result)
    md = markdown(result.to_dict())
    if a.json:
        write_atomic(a.json, doc_json)
    if a.markdown:
        write_atomic(a.markdown, md)
    if "-" not in (a.json, a.markdown):  # standard output carries only what was asked for
        print(md, end="")
    if result.status == Status.ERROR:
        print(result.error, file=sys.stderr)
        return EXIT["error"]
    if result.status == Status.SKIPPED:
        return EXIT["skipped_required"] if a.require else EXIT["pass"]
    return EXIT[result.status]


def cmd_export(a) -> int:
    from oracle.backend import CheckSpec, InputError
    from oracle.export import run_export

    check_outputs(dirs=[("--output-dir", a.output_dir)])
    if a.family is None and not default_family(a):
        return EXIT["bad_input"]
    spec = CheckSpec(family=a.family, backend=a.backend, precision=a.precision, seed=a.seed,
                     prompt_len=a.prompt_len, decode_tokens=max(1, a.max_seq_len - a.prompt_len),
                     model_dir=a.model_dir, config=a.config, layers=a.layers, weights=a.weights,
                     options=options_of(a))
    try:
        manifest = run_export(spec, a.output_dir)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    except Exception as e:  # the exporter itself failed
        print(f"oracle: export failed: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT["error"]
    print(f"wrote {manifest}")
    return 0


def cmd_selftest(a) -> int:
    import json

    from oracle.backend import InputError
    from oracle.result import write_atomic
    from oracle.selftest import load_report, render, row_line, run_selftest

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
        from oracle.selftest import plan, plan_text

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


def cmd_conversion_selftest(a, families) -> int:
    import json

    from oracle.conversion_selftest import render, row_line, run_conversion_selftest
    from oracle.result import write_atomic

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


def cmd_matrix(a) -> int:
    from oracle.matrix import combos, parse_shard, run_matrix, shard

    if a.families is None and (a.model_dir or a.config):  # the one family that checkpoint's config names
        from oracle.backend import InputError
        from oracle.validation import family_of

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
    from oracle.summary import markdown

    print(markdown(summary), end="")
    return 0 if summary["status"] == Status.PASS else EXIT["fail"]


def matrix_names_known(families, backends, precisions) -> None:
    """Refuse (exit 2, before any check runs) a family, backend or precision the oracle does not
    know. A known backend that is unavailable here, or that lacks one of the precisions, is a
    skipped row with its reason, as for `check`; a plugin (package.module:attr) must import."""
    from oracle import thresholds
    from oracle.backend import BackendError, builtin_names, resolve

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


def cmd_report(a) -> int:
    import json
    from pathlib import Path

    from oracle import summary as S

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


def cmd_goldens(a) -> int:
    from dataclasses import replace

    from oracle import goldens
    from oracle.backend import BackendError, InputError, resolve
    from oracle.check import run_check

    if a.goldens_cmd == "freeze":
        backends = a.backend or ["eager"]
        from models import FAMILY_NAMES

        families = a.family or list(FAMILY_NAMES)
        rc = 0
        for b in backends:
            for f in families:
                try:
                    spec = goldens.default_spec(f, b)
                    if a.precision:
                        spec = replace(spec, precision=a.precision)
                except InputError as e:
                    print(f"oracle: error: {e}", file=sys.stderr)
                    return EXIT["bad_input"]
                try:
                    ok, msg, _ = goldens.freeze(spec, run_check(spec, goldens=False))
                except InputError as e:  # the backend refuses this family (e.g. mlx-lm's model computes another one)
                    ok, msg = False, f"{f}/{b}: refused, not freezing: {e}"
                print(msg)
                rc = rc or (0 if ok else EXIT["fail"])
        return rc
    for f in a.family or []:
        known_family("--family", f)
    pairs = [(f, b) for f, b in goldens.present()
             if (not a.family or f in a.family) and (not a.backend or b in a.backend)]
    if not pairs:
        have = sorted({b for f, b in goldens.present() if not a.family or f in a.family})
        print(f"oracle: no goldens for {', '.join(a.family or ['any family'])} on {', '.join(a.backend or ['any backend'])}"
              f" (backends with goldens for them: {', '.join(have) or 'none'}; `oracle goldens freeze` writes them)",
              file=sys.stderr)
        return EXIT["bad_input"]
    rc = 0
    for f, b in pairs:
        try:
            ok, reason = resolve(b).availability()
        except BackendError as e:
            ok, reason = False, str(e)
        if not ok:
            print(f"{f}/{b}: skipped ({reason})")
            continue
        try:
            r = run_check(goldens.default_spec(f, b))
        except InputError as e:
            print(f"oracle: error: {e}", file=sys.stderr)
            return EXIT["bad_input"]
        gates = [g for g in r.gates if g.name == "golden_tokens" or g.name.startswith("structure:")]
        bad = [g for g in gates if g.status != Status.PASS]
        print(f"{f}/{b}: {r.status}; goldens " + (", ".join(f"{g.name} {g.status}" for g in gates) or "none applied"))
        for g in bad:
            print(f"  {g.message}")
        if bad or r.status != Status.PASS:
            rc = EXIT["fail"]
    return rc


def cmd_reference(a) -> int:
    from oracle.backend import CheckSpec, InputError
    from oracle.references import save_reference
    from oracle.validation import family_of, validate

    from pathlib import Path

    out = Path(a.out)
    if out.exists() and not (out.is_dir() and ((out / "provenance.json").is_file() or not any(out.iterdir()))):
        fail_input(f"--out {out}: exists and is not a saved reference (not replaced)")
    check_outputs(dirs=[("--out", str(out.parent))])
    try:
        family = a.family or family_of(a.model_dir, a.config, a.layers)
        spec = CheckSpec(family=family, backend="hf", prompt_len=a.prompt_len, decode_tokens=a.decode_tokens,
                         seed=a.seed, model_dir=a.model_dir, config=a.config, layers=a.layers, weights=a.weights)
        validate(spec)
        prog, update = progress_reporter()
        if prog:
            with prog:
                files = save_reference(spec, a.out, update)
        else:
            files = save_reference(spec, a.out)
    except InputError as e:
        print(f"oracle: error: {e}", file=sys.stderr)
        return EXIT["bad_input"]
    print(f"wrote {out} ({', '.join(f.name for f in files)})")
    return 0


def cmd_cache(a) -> int:
    import json
    import time

    from models import cache
    from oracle.backend import BackendError, resolve
    from models.checkpoint import cache_root

    try:
        cap = cache.limit()
    except ValueError as e:
        fail_input(str(e))
    freed = cache.remove_stale_temps()  # left by a killed build: no entry owns them
    if freed:
        print(f"removed stale build directories (their writer is gone): {cache.human(freed)}", file=sys.stderr)
    es = cache.entries()
    if a.cache_cmd == "list":
        if a.json:
            print(json.dumps({"root": str(cache_root()), "limit": cap, "bytes": sum(e.bytes for e in es),
                              "entries": [e.as_dict() for e in es]}, indent=1))
            return 0
        for e in es:
            print(f"{cache.human(e.bytes):>10s}  {cache.age_text(e.last_used):>8s} ago  "
                  f"{'held ' if e.held else '     '} {e.name}")
        print(f"{len(es)} entries, {cache.human(sum(e.bytes for e in es))} of a {cache.human(cap)} limit "
              f"in {cache_root()}")
        return 0
    chosen = list(es)
    if a.backend:
        spaces = set()
        for name in a.backend:
            try:
                b = resolve(name)
            except BackendError as e:
                fail_input(f"--backend: {e}")
            spaces.update(f"artifacts/{ns}" for ns in (b.cache_namespaces or (b.name,)))
        chosen = [e for e in chosen if e.kind in spaces]
    if a.older_than is not None:
        if a.older_than < 0:
            fail_input(f"--older-than: must be at least 0 days, got {a.older_than}")
        chosen = [e for e in chosen if time.time() - e.last_used > a.older_than * 86400]
    if a.max_size is not None or not (a.all or a.backend or a.older_than is not None):
        try:
            target = cap if a.max_size is None else cache.parse_size(a.max_size)
        except ValueError as e:
            fail_input(f"--max-size: {e}")
        chosen = cache.least_recently_used(chosen, sum(e.bytes for e in es), target)
    held = [e for e in chosen if e.held]
    chosen = [e for e in chosen if not e.held]
    removed = chosen if a.dry_run else cache.prune(chosen)
    kept = held + [e for e in chosen if e not in removed]
    verb = "would remove" if a.dry_run else "removed"
    for e in removed:
        print(f"{verb} {e.name} ({cache.human(e.bytes)})")
    for e in kept:
        print(f"kept {e.name} ({cache.human(e.bytes)}): a running process holds it")
    print(f"{verb} {len(removed)} entries, {cache.human(sum(e.bytes for e in removed))}; the cache holds "
          f"{cache.human(cache.total_bytes())} of a {cache.human(cap)} limit")
    return 0


def apply_cache_limit(a) -> None:
    """--cache-limit SIZE: this process's and its children's limit (the environment variable they read)."""
    value = getattr(a, "cache_limit", None)
    if value is None:
        return
    from models.cache import ENV, parse_size

    try:
        parse_size(value)
    except ValueError as e:
        fail_input(f"--cache-limit: {e}")
    os.environ[ENV] = value


@contextlib.contextmanager
def terminate_cleanly():
    """SIGTERM (a CI timeout, `timeout`, a scheduler) exits through Python's own exit while a command
    runs, as Ctrl-C does, so a build in progress removes its partial directory
    (models.checkpoint.cached_dir, oracle/artifacts.py) instead of leaving it in the cache. Exit 143
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


def main(argv=None) -> int:
    a = parser().parse_args(argv)  # before any heavy import: --help and usage errors need none
    with terminate_cleanly():
        return run_command(a, argv)


def run_command(a, argv) -> int:
    quiet()
    apply_cache_limit(a)
    if a.cmd == "cache":
        return cmd_cache(a)
    if a.cmd == "families":
        return cmd_families()
    if a.cmd == "backends":
        return cmd_backends()
    if a.cmd == "export":
        return cmd_export(a)
    if a.cmd == "selftest":
        return cmd_selftest(a)
    if a.cmd == "matrix":
        return cmd_matrix(a)
    if a.cmd == "goldens":
        return cmd_goldens(a)
    if a.cmd == "report":
        return cmd_report(a)
    if a.cmd == "reference":
        return cmd_reference(a)
    return cmd_check(a, sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
