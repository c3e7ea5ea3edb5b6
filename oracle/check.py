"""One check as a pipeline of stages: validate -> sources (checkpoint, shipped directory, prompts)
-> reference (HF fp32) -> the precision's own error (HF at it) -> candidate -> block rows -> e2e
-> quantization rows -> gates -> CheckResult. Each stage lives in its own module; this one runs
them in order, times them and contains a stage that crashes."""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, replace

from oracle import expected
from oracle import goldens as golden_files
from oracle import thresholds
from oracle.backend import CheckSpec, InputError, as_backend, as_candidate, memory_refusal
from oracle.noise import exact_for, noise_for
from oracle.provenance import provenance
from oracle.sampling import sampling_gates
from oracle.result import CheckResult, GateRow, worst_row
from oracle.compare import block_rows, reduction_length
from oracle.e2e import prompt_set, run_e2e
from oracle.quantization import quantization_rows
from oracle.references import reference_margins, reference_of, saved_reference
from oracle.sources import check_length, prompt_tokens, quantizing_options, sources, tokenized_prompts
from oracle.validation import artifact_matches, validate


def _contained(result, name: str, fn):
    """Run an optional stage of the candidate (its gates, structures, sampler): an exception
    there is that stage's `error` gate row, not the end of the check."""
    try:
        return fn()
    except Exception as e:
        result.gates.append(GateRow(name, "error", None, None, f"{type(e).__name__}: {e}"))
        return None


def peak_rss_gib() -> float | None:
    """This process's peak resident memory so far (Linux VmHWM: anonymous and mapped file
    pages), in GiB; None where /proc is not there. Recorded with the timings: after the
    reference (its side of the check) and at the end (the whole check)."""
    try:
        with open("/proc/self/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None
    return round(kb / 2**20, 3)


def spec_record(spec: CheckSpec) -> dict:
    """The spec as the report records it: a saved reference's path is run state (in `cache`),
    so a check against a moved reference reports the same bytes as one captured in-process; the
    weight profile and the quantization reference only where they are not the default (a report of
    the defaults stays as before they existed)."""
    defaults = {"weights": "normal", "quant_reference": "dequantized"}
    return {k: v for k, v in asdict(spec).items() if k != "reference" and not (k in defaults and v == defaults[k])}


def run_check(spec: CheckSpec, backend=None, progress=None, goldens: bool = True,
              validate_only: bool = False) -> CheckResult:
    """Run one check. Raises InputError for bad input. A crash in the backend's load() (or in
    every block) is status 'error'; a crash or malformed output in one block, one e2e step or
    one optional stage is that row's error/fail and the check goes on.
    goldens=False leaves out the golden gates (how `oracle goldens freeze` checks).
    validate_only: every input read and checked (checkpoint, config, given program, saved
    reference, prompts), then the result as it stands: no reference is captured, nothing is run."""
    progress = progress or (lambda stage, done=0, total=0: None)
    t0 = time.perf_counter()
    timings = {}
    backend = validate(spec) if backend is None else as_backend(backend)  # (a duck-typed object wrapped)
    if goldens and not golden_files.root().is_dir():  # a broken install would silently drop every golden gate
        raise InputError(f"the goldens directory {golden_files.root()} is missing (a broken install?): "
                         "reinstall moe-oracle, or set MOE_ORACLE_GOLDENS")
    result = CheckResult(spec=spec_record(spec), status="pass", provenance=provenance(spec, backend))
    ok, reason = backend.availability()
    if not ok:
        result.status, result.skipped_reason = "skipped", reason
        return result
    progress("checkpoint")
    srcs = sources(spec, lambda msg: progress(f"checkpoint: {msg}"), backend)
    src = srcs.src
    asked = spec

    def record(s: CheckSpec) -> dict:  # q8/q4 as asked, not the fp32 check of the directory built for it
        return spec_record(replace(s, precision=asked.precision, candidate_dir=None, options=asked.options)
                           if srcs.built else s)

    spent = quantizing_options(backend, spec.options) if srcs.built else {}  # the directory's, spent on it
    if srcs.built:  # the candidate loads the directory at fp32 activations, judged at the fp32 limits
        spec = replace(spec, candidate_dir=srcs.shipped, precision="fp32",
                       options={k: v for k, v in spec.options.items() if k not in spent})
    elif srcs.shipped is not None and backend.loads_directory:
        spec = replace(spec, candidate_dir=srcs.shipped)  # the backend loads the shipped directory
        result.spec = spec_record(spec)
    result.provenance["checkpoint"] = {"dir": str(src.model_dir), "sha256": src.checkpoint_sha256,
                                       "tiny": spec.model_dir is None and spec.config is None}
    timings["checkpoint_s"] = time.perf_counter() - t0
    refusal = memory_refusal(backend, src, spec)
    if refusal:
        raise InputError(refusal)
    if spec.artifact is not None:
        artifact_matches(spec, src)
        backend.check_given(src, spec)  # the program itself (exporters/given.py)
    if spec.reference is not None:
        saved = saved_reference(spec)["checkpoint_sha256"]
        here = [s.checkpoint_sha256 for s in (src, srcs.original) if s is not None]
        if saved not in here:
            raise InputError(f"--reference {spec.reference} was captured from checkpoint sha256 {saved[:16]}..., "
                             f"not this check's ({', '.join(h[:16] + '...' for h in here)})")

    prompts = None
    if spec.prompts:
        prompts = tokenized_prompts(spec, srcs, src.args.vocab_size)
        longest = max(map(len, prompts))
        check_length(src.config, longest + spec.decode_tokens,
                     f"the longest prompt ({longest} tokens) + decode-tokens {spec.decode_tokens}")
        spec = replace(spec, prompt_len=longest)  # what static-length artifacts are sized for
        src = replace(src, args=replace(src.args, max_seq_len=longest + spec.decode_tokens))
        result.spec = record(spec)

    if validate_only:
        if spec.reference is not None and saved_reference(spec)["checkpoint_sha256"] == src.checkpoint_sha256:
            reference_of(spec, src, prompts[0] if prompts else prompt_tokens(spec, src.args.vocab_size))  # read
        return result
    progress("reference")
    t = time.perf_counter()
    prompt = prompts[0] if prompts else prompt_tokens(spec, src.args.vocab_size)
    ref = reference_of(spec, src, prompt)
    timings["reference_s"] = time.perf_counter() - t
    timings["reference_peak_rss_gib"] = peak_rss_gib()
    result.reference = reference_margins(ref)
    noise = None
    if thresholds.noise_relative(spec.precision):  # the precision's own error: HF at it, same inputs
        progress(f"HF at {spec.precision} (the precision's own error)")
        t = time.perf_counter()
        try:
            noise = noise_for(ref, src, spec, prompt)
            result.reference["noise"] = f"HF transformers at {spec.precision} on the same inputs (oracle/noise.py)"
        except Exception as e:  # the limits fall back to the fixed tables, and the report says so
            result.reference["noise"] = f"not measured ({type(e).__name__}: {e}): fixed {spec.precision} tables"
        timings["noise_s"] = time.perf_counter() - t
    if srcs.shipped is not None:
        result.quantization = {
            "shipped_dir": srcs.shipped, **(srcs.quantization or {}),
            "dequantized_checkpoint": {"dir": str(src.model_dir), "sha256": src.checkpoint_sha256},
            "original": str(srcs.original.model_dir) if srcs.original else None,
            "implementation": f"the candidate vs HF on the shipped weights (dequantized to fp32), at {spec.precision} "
                              "limits: does the runtime compute the model it was given?",
            "limits": spec.precision,
        }
        if srcs.built:
            result.quantization["built"] = (f"--precision {asked.precision}: the directory `{spec.backend}` exports "
                                            f"({', '.join(f'{k}={v}' for k, v in spent.items()) or 'default options'}), "
                                            "loaded as the candidate")
        if srcs.original is None:
            result.quantization["note"] = ("no original checkpoint given: only the implementation rows exist "
                                           "(the quantization error needs the weights it was made from)")
        else:
            progress("quantization")
            t = time.perf_counter()
            result.quantization["rows"] = quantization_rows(spec, srcs, prompt, progress)
            timings["quantization_s"] = time.perf_counter() - t

    stage = "load"
    try:
        progress("load")
        t = time.perf_counter()
        cand = as_candidate(backend.load(src, spec))
        timings["load_s"] = time.perf_counter() - t
        info = dict(cand.info or {})
        artifacts = info.pop("artifacts", [])
        result.provenance["host"].update(info.pop("host", {}))  # e.g. IREE's target CPU: host facts in one place
        result.provenance["backend"] = info
        result.provenance["artifacts"] = [{"name": a["name"], "sha256": a["sha256"]} for a in artifacts]
        result.cache = {"artifacts": [{k: a[k] for k in ("name", "cached", "build_s", "path")} for a in artifacts],
                        "all_cached": bool(artifacts) and all(a["cached"] for a in artifacts)}
        if spec.reference is not None:  # where the reference came from is run state: the numbers are the same
            result.cache["reference"] = spec.reference

        stage = "blocks"
        t = time.perf_counter()
        result.blocks = block_rows(ref, cand, spec, src.args, progress, noise, src)
        timings["blocks_s"] = time.perf_counter() - t

        stage = "e2e"
        progress("e2e")
        t = time.perf_counter()
        rows = []
        result.e2e, dtype_gate = run_e2e(ref, cand, spec, reduction_length(src.args), rows, noise,
                                         exact=lambda: exact_for(ref, src, spec, prompt))
        if dtype_gate:
            result.gates.append(dtype_gate)
        timings["e2e_s"] = time.perf_counter() - t
        if prompts:
            stage = "prompts"
            t = time.perf_counter()
            result.prompts = prompt_set(ref, result.e2e, rows, spec, src, cand, prompts, progress)
            timings["prompts_s"] = time.perf_counter() - t
        stage = "gates"
        result.gates += _contained(result, "backend_gates", lambda: list(cand.gates())) or []
        sampling = spec.options.get("sampling")
        if sampling is not None:
            stage = "sampling"
            progress("sampling")
            t = time.perf_counter()
            result.gates += _contained(result, "sampling", lambda: sampling_gates(
                ref, cand, float(sampling["temperature"]), float(sampling["top_p"]), spec.seed,
                thresholds.limits(spec.precision, "e2e")["tie_margin"])) or []
            timings["sampling_s"] = time.perf_counter() - t
        result.structures = dict(_contained(result, "structures", cand.structures) or {})
        if goldens:
            stage = "goldens"
            tok = golden_files.token_gate(spec, result.e2e.candidate_tokens)
            result.gates += ([tok] if tok else []) + golden_files.structure_gates(spec, result.structures)
    except InputError:  # the backend refused what it was given (e.g. a program without the exporter's methods)
        raise
    except Exception as e:  # load() crashed (or every block did): this check is an error, not the run
        result.error = f"{stage}: {type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-8))

    w = worst_row(result.blocks)  # rows measured before a crash still localise
    result.worst = asdict(w) if w else None
    failed = (w is not None or (result.e2e and result.e2e.status in ("fail", "error"))
              or any(g.status in ("fail", "error") for g in result.gates)
              or (result.quantization or {}).get("rows", {}).get("status") in ("fail", "error")
              or (result.prompts or {}).get("status") == "fail")
    result.status = "error" if result.error else "fail" if failed else "pass"
    expected.judge(result)  # a known candidate defect: fails as its entry says -> xfail; passes -> stale
    timings["total_s"] = time.perf_counter() - t0
    timings["peak_rss_gib"] = peak_rss_gib()
    result.timings = timings
    return result


__all__ = ["run_check", "CheckSpec", "InputError", "GateRow"]
