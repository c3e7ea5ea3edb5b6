"""`oracle check`: one family on one backend against HF transformers fp32."""

from __future__ import annotations

import os
import sys

from oracle.cli.common import (EXIT, backend_options, cache_limit_option, check_outputs, default_family, fail_input,
                                options_of, positive_int, progress_reporter, weights_option)
from oracle.reports.result import Status


def add(sub) -> None:
    """The command's options, on the `oracle` parser's subcommands."""
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
    c.add_argument("--invariance", choices=["on", "off"], default="on",
                   help="the invariance rows after e2e (default on): the run repeated, the prompt prefilled in chunks "
                   "and token by token, and batched with another prompt, each against the same backend's e2e path")
    c.add_argument("--require-deterministic", action="store_true",
                   help="the repeat row fails on any difference between two runs (default: beyond the precision's limit)")
    c.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8; >= 0)")
    c.add_argument("--top-p", type=float, default=0.9, help="sampling top-p (default 0.9; in (0, 1])")
    backend_options(c)
    cache_limit_option(c)


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
        from oracle.source.given import check_in_child  # a child process: its crash is exit 2, not this process's end

        return check_in_child(argv, "--pte" if a.pte else "--vmfb", given)
    from oracle.backend import CheckSpec, InputError
    from oracle.check import run_check
    from oracle.reports.markdown import markdown
    from oracle.reports.result import dumps, write_atomic
    from oracle.source.validation import validate

    if a.json == "-" and a.markdown == "-":
        fail_input("--json - and --markdown - cannot both be standard output")
    check_outputs(files=[("--json", a.json), ("--markdown", a.markdown)])
    options = options_of(a)
    if a.sampling:
        from models.layers.sampling import check_args

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
                     prompts=read_prompts(a), artifact=a.pte or a.vmfb or a.gguf, options=options, drill=a.drill,
                     invariance=a.invariance, require_deterministic=a.require_deterministic)
    if a.require_deterministic and a.invariance == "off":
        print("oracle: error: --require-deterministic needs the invariance rows (--invariance on)", file=sys.stderr)
        return EXIT["bad_input"]
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
        from oracle.backend import available_memory
        from oracle.cache.store import human

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
