"""One check as a pipeline of stages: validate -> sources (checkpoint, shipped directory, prompts)
-> reference (HF fp32) -> quantization rows -> candidate load -> the precision's own error (HF at it,
with a streamed candidate's layer-by-layer pass) -> block rows -> e2e -> drill (inside the worst failing block) -> gates -> CheckResult. Each stage lives in its own module; this one runs
them in order, times them and contains a stage that crashes."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import asdict, dataclass, field, replace

from oracle.verdict import expected, goldens as golden_files
from oracle.drill import points
from oracle.verdict import thresholds
from oracle.cache.store import CacheFull
from models.checkpoint import CheckpointError
from oracle.backend import (CheckSpec, InputError, as_backend, as_candidate, hf_spec, memory_plan, memory_refusal,
                            MemoryRefusal, resolve)
from oracle.verdict.noise import aligner, block_aligner, exact_for, forget_models, noise_for, shared_models_memory
from oracle.reports.provenance import provenance
from oracle.verdict.sampling import sampling_gates
from oracle.reports.result import CheckResult, GateRow, Status, worst_row
from oracle.schedule import lockstep
from oracle.verdict.compare import aligning, block_rows, reduction_length, reference_margins
from oracle.verdict.conversion import check_tensors
from oracle.verdict.e2e import ReplayAhead, prompt_set, run_e2e
from oracle.verdict.invariance import ROWS as INVARIANCE_ROWS, InvarianceRow, invariance_rows, ordinary
from oracle.verdict.quantization import quantization_rows
from oracle.reference.streaming import READ, forget_reads, release_held
from oracle.reference.cached import reference_of, saved_reference
from oracle.source.sources import (builds_quantized, check_length, model_source, prompt_tokens, quantizing_options,
                                   sources, tokenized_prompts)
from oracle.source.validation import artifact_matches, validate


def _contained(result, name: str, fn):
    """Run an optional stage of the candidate (its gates, structures, sampler): an exception
    there is that stage's `error` gate row, not the end of the check."""
    try:
        return fn()
    except Exception as e:
        result.gates.append(GateRow(name, Status.ERROR, None, None, f"{type(e).__name__}: {e}"))
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


def resident_bytes() -> int | None:
    """This process's resident memory now (Linux /proc/self/statm), or None where it cannot be read: what a
    long-lived worker keeps between checks (peak_rss_gib is the peak, which hides memory freed since)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def disk_read_bytes() -> int | None:
    """Bytes this process has read from storage so far (Linux /proc/self/io read_bytes: what the page cache
    did not already hold), or None where it cannot be read."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))
    except (OSError, StopIteration, ValueError):
        return None


def spec_record(spec: CheckSpec) -> dict:
    """The spec as the report records it: a saved reference's path is run state (in `cache`),
    so a check against a moved reference reports the same bytes as one captured in-process; the
    weight profile and the quantization reference only where they are not the default (a report of
    the defaults stays as before they existed)."""
    defaults = {"weights": "normal", "quant_reference": "dequantized", "drill": "auto", "invariance": "on",
                "require_deterministic": False}
    return {k: v for k, v in asdict(spec).items() if k != "reference" and not (k in defaults and v == defaults[k])}


@dataclass
class Run:
    """What one check has so far, handed from stage to stage."""

    spec: CheckSpec  # as the stages see it (a built q8/q4 directory: its fp32 check)
    asked: CheckSpec  # as the user asked
    backend: object
    result: CheckResult
    progress: object
    t0: float
    timings: dict = field(default_factory=dict)
    srcs: object = None  # oracle.source.sources.Sources
    src: object = None  # the checkpoint the reference runs (a shipped directory's: dequantized)
    prompts: list | None = None  # --prompts, tokenized
    prompt: list | None = None  # the first prompt: the reference's, the blocks' and e2e's
    ref: object = None
    noise: object = None
    cand: object = None
    block_align: object = None  # oracle.verdict.noise.block_aligner of the check
    spent: dict = field(default_factory=dict)  # options spent on writing a q8/q4 directory
    weights: dict | None = None  # a shipped file's weight check (oracle/verdict/conversion.py)
    stage: str = ""  # the candidate's stage running (a crash's error names it)
    read_before: int = field(default_factory=lambda: READ["bytes"])  # streamed checkpoint bytes read before it
    disk_before: int | None = field(default_factory=disk_read_bytes)  # this process's storage reads before it

    def record(self, s: CheckSpec) -> dict:  # q8/q4 as asked, not the fp32 check of the directory built for it
        return spec_record(replace(s, precision=self.asked.precision, candidate_dir=None, options=self.asked.options)
                           if self.srcs.built else s)

    def timed(self, name: str, fn):
        t = time.perf_counter()
        out = fn()
        self.timings[f"{name}_s"] = time.perf_counter() - t
        return out


def release_record(config: dict) -> dict:
    """What the report says of a checkpoint released in a quantized format (models/release_formats.py)."""
    from models.release_formats import release_format

    fmt = release_format(config)
    return {} if fmt is None else {"release_format": fmt.describe(), "release_method": fmt.method, "release_read": (
        "dequantized by the format's definition as the reference reads it (transformers' dequantizers, a tensor at "
        "a time); each candidate is given the release as its runtime reads it (the compiled backends the "
        "dequantized tensors, mlx-lm and llama.cpp their own loaders and converter)")}


def run_check(spec: CheckSpec, backend=None, progress=None, goldens: bool = True,
              validate_only: bool = False) -> CheckResult:
    """_run_check; an artifact the cache cannot hold is bad input (refused with the sizes, exit 2)."""
    try:
        return _run_check(spec, backend, progress, goldens, validate_only)
    except CacheFull as e:
        raise InputError(str(e)) from None
    finally:
        release_held()  # a streamed model's layer kept loaded between its block rows
        forget_reads()  # and the checkpoint tensors of the layer read last
        forget_models()  # and the streamed HF models the noise and the routing replays shared


def _run_check(spec: CheckSpec, backend=None, progress=None, goldens: bool = True,
               validate_only: bool = False) -> CheckResult:
    """Run one check. Raises InputError for bad input. A crash in the backend's load() (or in
    every block) is status 'error'; a crash or malformed output in one block, one e2e step or
    one optional stage is that row's error/fail and the check goes on.
    goldens=False leaves out the golden gates (how `oracle goldens freeze` checks).
    validate_only: every input read and checked (checkpoint, config, given program, saved
    reference, prompts), then the result as it stands: no reference is captured, nothing is run."""
    run = start(spec, backend, progress, goldens)
    if run.result.status == Status.SKIPPED:  # the backend is not available here
        return run.result
    if validate_only and planned_checkpoint(run):  # a --config checkpoint not built: its plan, nothing written
        return run.result
    if validate_only and planned_directory(run):  # the q8/q4 directory a check writes: its plan, nothing written
        return run.result
    read_sources(run)  # checkpoint, the directory a q8/q4 check builds, memory, given program, saved reference
    read_prompts(run)
    if validate_only:
        read_saved_reference(run)
        return run.result
    weight_check(run)  # a shipped file's weights, tensor by tensor, within its format's rounding of the original
    try:
        capture_reference(run)  # HF fp32 on the prompt: every block's inputs and outputs, the e2e logits
    except InputError as e:  # e.g. non-finite: where the weight check already named a defect, that is the verdict
        if (run.weights or {}).get("status") != Status.FAIL:
            raise
        run.result.quantization = {"shipped_dir": run.srcs.shipped, **(run.srcs.quantization or {}), "weights": run.weights}
        run.result.reference = {"not_run": f"HF on the shipped weights could not run: {e}"}
        return verdict(run)
    quantization(run)  # a shipped or built directory: what it is, and its quantization's own loss
    try:
        run_candidate(run, goldens)  # load, block rows, e2e, prompts, gates, sampling, structures, goldens
    except (InputError, CacheFull):  # the backend refused what it was given (e.g. a program without the
        raise  # exporter's methods), or the cache cannot hold its artifact
    except Exception as e:  # load() crashed (or every block did): this check is an error, not the run
        run.result.error = f"{run.stage}: {type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-8))
    return verdict(run)


def start(spec: CheckSpec, backend, progress, goldens: bool) -> Run:
    """The spec validated (or a given backend wrapped), the result begun; skipped where the
    backend cannot run on this host."""
    t0 = time.perf_counter()
    backend = validate(spec) if backend is None else as_backend(backend)  # (a duck-typed object wrapped)
    if goldens and not golden_files.root().is_dir():  # a broken install would silently drop every golden gate
        raise InputError(f"the goldens directory {golden_files.root()} is missing (a broken install?): "
                         "reinstall moe-oracle, or set MOE_ORACLE_GOLDENS")
    result = CheckResult(spec=spec_record(spec), status=Status.PASS, provenance=provenance(spec, backend))
    run = Run(spec, spec, backend, result, progress or (lambda stage, done=0, total=0: None), t0)
    ok, reason = backend.availability_for(spec)
    if not ok:
        result.status, result.skipped_reason = Status.SKIPPED, reason
    return run


def read_sources(run: Run) -> None:
    """The checkpoints (a q8/q4 check of a backend that writes directories: the directory it
    exports, checked at fp32 against HF on its weights dequantized), then every refusal that
    needs them: memory, a given program that is not this model's, a saved reference of another
    checkpoint."""
    spec, backend, result = run.spec, run.backend, run.result
    run.progress("checkpoint")
    planned_directory(run)
    run.srcs = srcs = sources(spec, lambda msg: run.progress(f"checkpoint: {msg}"), backend)
    run.src = src = srcs.src
    run.spent = quantizing_options(backend, spec.options) if srcs.built else {}  # the directory's, spent on it
    if srcs.built:  # the candidate loads the directory at fp32 activations, judged at the fp32 limits
        spec = replace(spec, candidate_dir=srcs.shipped, precision="fp32",
                       options={k: v for k, v in spec.options.items() if k not in run.spent})
    elif srcs.shipped is not None and backend.loads_directory:
        spec = replace(spec, candidate_dir=srcs.shipped)  # the backend loads the shipped directory
        result.spec = spec_record(spec)
    act = (srcs.quantization or {}).get("activations")
    own = None if act or backend.arithmetic is None else backend.arithmetic(src, spec)  # the candidate's own
    act = act or own
    if act and spec.precision == "fp32":  # a runtime that rounds activations for these weights (a8: llama.cpp's
        spec = replace(spec, precision=act)  # quantized GGUFs): judged against HF with that arithmetic
        result.spec = spec_record(spec)
    run.spec = spec
    result.provenance["checkpoint"] = {"dir": str(src.model_dir), "sha256": src.checkpoint_sha256,
                                       "tiny": spec.model_dir is None and spec.config is None,
                                       **release_record(src.config)}
    if own and spec.precision == own:
        result.provenance["checkpoint"]["arithmetic"] = (
            f"{own}: the candidate computes its products with the release's packed weights so (its runtime's own "
            "arithmetic for them); judged against HF computing the same way (oracle/verdict/arithmetic.py)")
    run.timings["checkpoint_s"] = time.perf_counter() - run.t0
    plan_resources(run, src, spec)
    if spec.artifact is not None:
        artifact_matches(spec, srcs.original or src, sized=backend.artifact_weights is None)  # a GGUF: from the original
        backend.check_given(src, spec)  # the program itself (exporters/shared/given.py; a no-op by default)
    if spec.reference is not None:
        saved = saved_reference(spec)["checkpoint_sha256"]
        here = [s.checkpoint_sha256 for s in (src, srcs.original) if s is not None]
        if saved not in here:
            raise InputError(f"--reference {spec.reference} was captured from checkpoint sha256 {saved[:16]}..., "
                             f"not this check's ({', '.join(h[:16] + '...' for h in here)})")


def planned_checkpoint(run: Run) -> bool:
    """--validate-only of a --config check whose seeded checkpoint is not built yet: the config checked,
    and what the check will need, without writing it (a 30B checkpoint is 57 GiB): its disk in the
    cache and the backend's memory, each refused here as the check would refuse it. The plan goes into
    the result's provenance ("checkpoint": "not_built", bytes, parameters, memory). False where there is
    no such plan to make (another source, or the checkpoint already built: validated as usual)."""
    from oracle.cache import store as cache
    from models import get_family
    from oracle.source.seeded import config_checkpoint, config_parameters
    from oracle.source.published import published_config
    from oracle.backend import ModelSource
    from oracle.source.sources import require_family

    spec = run.spec
    if not spec.config or spec.model_dir or spec.candidate_dir or spec.artifact:
        return False
    family = get_family(spec.family)
    try:
        cfg = published_config(spec.config, spec.layers)
        require_family(family, cfg, f"--config {spec.config}")
        args = family.args(cfg, spec.prompt_len + spec.decode_tokens)
        if config_checkpoint(family, spec.config, spec.layers, spec.seed, weights=spec.weights, build=False):
            return False
        params = config_parameters(family, cfg)
    except CheckpointError as e:
        raise InputError(f"--config {spec.config}: {e}") from None
    nbytes = params * 2  # written in bf16
    why = cache.refusal(nbytes, f"the seeded checkpoint of --config {spec.config}")
    if why:
        raise InputError(why)
    src = ModelSource(family, None, cfg, args, "", parameters=params)
    plan_resources(run, src, spec)  # (the memory and cache: provenance["plan"])
    run.result.provenance["checkpoint"] = {"not_built": True, "config": spec.config, "parameters": params,
                                           "bytes": nbytes}
    return True


def planned_directory(run: Run) -> bool:
    """A q8/q4 check on the directory its backend writes: the check's memory and cache planned on the original
    before the directory is written (plan_resources; refused there with the sizes: mlx-lm's writer holds the
    model in memory, and a 30B model's would be killed by the kernel mid-write). True where there is such a
    directory to write (the plan in the result's provenance), False otherwise."""
    if not builds_quantized(run.spec, run.backend):
        return False
    plan_resources(run, model_source(run.spec, lambda msg: run.progress(f"checkpoint: {msg}")), run.spec)
    run.result.provenance["checkpoint"] = {"quantized_directory": "planned"}
    return True


def cache_estimate(src, spec: CheckSpec) -> int:
    """Bytes a check writes into the cache beside the checkpoint, from the shapes: the reference (each
    decoder layer's block inputs and outputs, fp32, over the prompt and decode positions, and its expert
    probes: up to 4 rows per expert; the logits), and as much again for each of up to 6 measurements of HF's
    own error (the noise and the routing replays; they keep outputs, not probes). Measured on Qwen3-30B-A3B
    (48 layers, 8 + 8 positions): reference 0.21 GiB (docs/benchmarks.md)."""
    a = src.args
    positions = spec.prompt_len + spec.decode_tokens
    row = 4 * a.hidden_size
    reference = a.num_hidden_layers * (8 * positions + 4 * a.num_experts) * row + 4 * positions * a.vocab_size
    noise = a.num_hidden_layers * 8 * positions * row + 4 * positions * a.vocab_size
    return reference + 6 * noise


def plan_resources(run: Run, src, spec: CheckSpec) -> dict:
    """The memory the check will need (the backend's estimate, the harness's models beside it: memory_plan) and
    the cache it will write beside the checkpoint (cache_estimate), refused here where either cannot fit
    (bad input, with the sizes), else recorded in the result's provenance ("plan"): what --validate-only says."""
    from oracle.cache import store as cache

    beside = shared_models_memory(src, spec)
    refusal = memory_refusal(run.backend, src, spec, beside)
    if refusal:
        raise MemoryRefusal(refusal)
    need, how = memory_plan(run.backend, src, spec, beside)
    writes = cache_estimate(src, spec)
    refusal = cache.refusal(writes, "this check's reference and noise measurements")
    if refusal:
        raise InputError(refusal)
    plan = {"memory_bytes": need, "memory": how, "cache_bytes": writes}  # (the memory available: the host's, not here)
    run.result.provenance["plan"] = plan
    return plan


def read_prompts(run: Run) -> None:
    """--prompts tokenized; static-length artifacts are then sized for the longest."""
    spec, src = run.spec, run.src
    if spec.prompts:
        run.prompts = tokenized_prompts(spec, run.srcs, src.args.vocab_size)
        longest = max(map(len, run.prompts))
        check_length(src.config, longest + spec.decode_tokens,
                     f"the longest prompt ({longest} tokens) + decode-tokens {spec.decode_tokens}")
        run.spec = replace(spec, prompt_len=longest)  # what static-length artifacts are sized for
        run.src = replace(src, args=replace(src.args, max_seq_len=longest + spec.decode_tokens))
        run.result.spec = run.record(run.spec)
    run.prompt = run.prompts[0] if run.prompts else prompt_tokens(run.spec, run.src.args.vocab_size)


def read_saved_reference(run: Run) -> None:
    """validate_only: a saved reference of this checkpoint is read (and so checked) too."""
    if run.spec.reference is not None and saved_reference(run.spec)["checkpoint_sha256"] == run.src.checkpoint_sha256:
        reference_of(run.spec, run.src, run.prompt)


def capture_reference(run: Run) -> None:
    run.progress("reference")
    run.ref = run.timed("reference", lambda: reference_of(run.spec, run.src, run.prompt))
    run.timings["reference_peak_rss_gib"] = peak_rss_gib()
    run.result.reference = reference_margins(run.ref)


def measure_noise(run: Run, cand) -> None:
    """The precision's own error (HF at it, same inputs: oracle/verdict/noise.py); where it cannot be
    measured the fixed tables judge, and the report says so. A candidate that computes its block rows
    and e2e steps ahead, one layer at a time (Candidate.ahead: a streamed checkpoint), runs in turn with
    the measurement, so that each layer is read once for all (oracle/schedule.py); its time is then in
    noise_s (ahead_s where there is no noise to measure)."""
    spec = run.spec
    replay = ReplayAhead(run.ref, run.src, spec, run.prompt)  # the e2e routing replay, in the same pass
    ahead = cand.ahead(run.ref, aligning(run.ref, spec, run.block_align), replay.on_layer)
    alongside = () if ahead is None else (ahead, *replay.passes())
    if not thresholds.noise_relative(spec.precision):
        if ahead is not None:
            run.progress("the candidate layer by layer")
            run.timed("ahead", lambda: lockstep(list(alongside)))
            replay.finish()
        return
    run.progress(f"HF at {spec.precision} (the precision's own error)"
                 + (", with the candidate, layer by layer" if ahead is not None else ""))
    t = time.perf_counter()
    try:
        run.noise = noise_for(run.ref, run.src, spec, run.prompt, alongside)
        # the report names the module by its path before the reorganisation of 2026-12 (oracle/verdict/noise.py
        # now): reports stay comparable with the saved ones (tests/baselines), the path changes with the schema
        run.result.reference["noise"] = f"HF transformers at {spec.precision} on the same inputs (oracle/noise.py)"
    except Exception as e:
        run.result.reference["noise"] = f"not measured ({type(e).__name__}: {e}): fixed {spec.precision} tables"
        lockstep(list(alongside))  # the candidate's pass to its end (what it kept is asked for next)
    if ahead is not None:
        replay.finish()
    run.timings["noise_s"] = time.perf_counter() - t


def quantization(run: Run) -> None:
    """A shipped (or built) directory: what it holds and what is judged, and its quantization's
    own loss (HF on the original weights vs HF on the dequantized ones) where the original is known. A
    given program with its weights beside it (.ptd, .irpa): their weight check alone."""
    spec, srcs = run.spec, run.srcs
    if srcs.shipped is None:
        if run.weights is not None and run.weights.get("tensors"):
            run.result.quantization = {"shipped_dir": spec.artifact, "format": "the program's own weights file",
                                       "weights": run.weights}
        return
    q = run.result.quantization = {
        "shipped_dir": srcs.shipped, **(srcs.quantization or {}),
        "dequantized_checkpoint": {"dir": str(run.src.model_dir), "sha256": run.src.checkpoint_sha256},
        "original": str(srcs.original.model_dir) if srcs.original else None,
        "implementation": f"the candidate vs HF on the shipped weights (dequantized to fp32), at {spec.precision} "
                          "limits: does the runtime compute the model it was given?",
        "limits": spec.precision,
    }
    if srcs.built:
        q["built"] = (f"--precision {run.asked.precision}: the directory `{spec.backend}` exports "
                      f"({', '.join(f'{k}={v}' for k, v in run.spent.items()) or 'default options'}), "
                      "loaded as the candidate")
    if run.weights is not None:
        q["weights"] = run.weights
    if srcs.original is None:
        q["note"] = ("no original checkpoint given: only the implementation rows exist "
                     "(the quantization error needs the weights it was made from)")
    else:
        run.progress("quantization")
        q["rows"] = run.timed("quantization", lambda: quantization_rows(spec, srcs, run.prompt, run.progress))
        if isinstance(q["rows"], dict) and (run.weights or {}).get("status") == Status.PASS:
            q["rows"]["explained"] = ("the weight check found every tensor a correct quantization of the original: "
                                      "these block losses are the format's own rounding, not a defect")


def weight_check(run: Run) -> None:
    """A shipped file (a directory, a GGUF): is it a correct conversion of the original? Each tensor,
    brought back by the format's layout rules (the backend's `shipped_tensors`), within the format's own
    rounding (oracle/verdict/conversion.py). A tensor beyond it is a conversion defect: the check fails, naming it.
    Run before the reference: a defect can make HF on the shipped weights fail to run (a zeroed router
    row's expert probe is 0/0), and the defect is then the verdict. The quantization rows then say whether
    their loss is explained by that rounding."""
    srcs, backend = run.srcs, run.backend
    # a shipped directory or GGUF; or a given program's own weights file (.ptd, .irpa): the checkpoint is its original
    shipped = srcs.shipped or (run.spec.artifact if backend.artifact_weights is None else None)
    original = srcs.original or (srcs.src if srcs.shipped is None else None)
    if shipped is None:
        return
    if original is None:
        run.weights = {"status": Status.NA, "note": "no original checkpoint given: the weights cannot be checked"}
        return
    if backend.shipped_tensors is None:
        run.weights = {"status": Status.NA, "note": f"backend {run.spec.backend} has no weight check for its files"}
        return
    run.progress("weights")
    progress = lambda msg: run.progress(msg)  # noqa: E731
    try:
        run.weights = run.timed("weights", lambda: check_tensors(
            backend.shipped_tensors(original, shipped, progress), progress))
    except CheckpointError as e:  # the file does not hold the original's tensors: a conversion defect named
        run.weights = {"status": Status.FAIL, "tensors": None, "failed": None, "error": str(e)}
    except Exception as e:  # the check of the weights crashed: not a pass
        run.weights = {"status": Status.ERROR, "error": f"{type(e).__name__}: {e}"}


def run_candidate(run: Run, goldens: bool) -> None:
    """The candidate's stages in order; `run.stage` names the one running (a crash's error says
    where). The optional ones (gates, sampling, structures) are contained: a crash there is that
    gate's error row."""
    spec, src, ref, result = run.spec, run.src, run.ref, run.result
    run.stage = "load"
    run.progress("load")
    run.cand = cand = run.timed("load", lambda: as_candidate(run.backend.load(src, spec)))
    info = dict(cand.info or {})
    artifacts = info.pop("artifacts", [])
    result.provenance["host"].update(info.pop("host", {}))  # e.g. IREE's target CPU: host facts in one place
    result.provenance["backend"] = info
    result.provenance["artifacts"] = [{"name": a["name"], "sha256": a["sha256"]} for a in artifacts]
    result.cache = {"artifacts": [{k: a[k] for k in ("name", "cached", "build_s", "path")} for a in artifacts],
                    "all_cached": bool(artifacts) and all(a["cached"] for a in artifacts)}
    if spec.reference is not None:  # where the reference came from is run state: the numbers are the same
        result.cache["reference"] = spec.reference

    run.stage = "noise"  # the precision's own error, with the candidate's layer-by-layer pass where it has one
    run.block_align = block_aligner(ref, src, spec)  # the block rows' routing replay (run ahead with that pass)
    measure_noise(run, cand)

    run.stage = "blocks"
    result.blocks = run.timed("blocks", lambda: block_rows(ref, cand, spec, src.args, run.progress, run.noise, src,
                                                          align=run.block_align))

    run.stage = "e2e"
    run.progress("e2e")
    rows = []  # every e2e step's (step, reference rows, candidate rows), for the prompt set's distribution
    kept = {}  # the e2e path's raw answers, for the invariance rows
    result.e2e, dtype_gate = run.timed("e2e", lambda: run_e2e(ref, cand, spec, reduction_length(src.args), rows,
                                                              run.noise, exact=lambda: exact_for(ref, src, spec, run.prompt),
                                                              align=aligner(ref, src, spec, run.prompt), keep=kept))
    if dtype_gate:
        result.gates.append(dtype_gate)
    if spec.invariance == "on":
        run.stage = "invariance"
        run.progress("invariance")
        result.invariance = run.timed("invariance", lambda: invariance_section(run, cand, kept))
    drill_down(run)
    if run.prompts:
        run.stage = "prompts"
        result.prompts = run.timed("prompts", lambda: prompt_set(ref, result.e2e, rows, spec, src, cand, run.prompts,
                                                                 run.progress))
    run.stage = "gates"
    result.gates += _contained(result, "backend_gates", lambda: list(cand.gates())) or []
    sampling = spec.options.get("sampling")
    if sampling is not None:
        run.stage = "sampling"
        run.progress("sampling")
        result.gates += run.timed("sampling", lambda: _contained(result, "sampling", lambda: sampling_gates(
            ref, cand, float(sampling["temperature"]), float(sampling["top_p"]), spec.seed,
            thresholds.limits(spec.precision, "e2e")["tie_margin"]))) or []
    result.structures = dict(_contained(result, "structures", cand.structures) or {})
    if goldens:
        run.stage = "goldens"
        tok = golden_files.token_gate(spec, result.e2e.candidate_tokens)
        result.gates += ([tok] if tok else []) + golden_files.structure_gates(spec, result.structures)


def invariance_section(run: Run, cand, kept: dict) -> list[dict]:
    """The repeat, chunked and batched rows (oracle/verdict/invariance.py), against the e2e path's answers;
    n/a, each with the reason, where that path did not answer every step."""
    ref, spec = run.ref, run.spec
    answers = kept.get("answers") or []
    if kept.get("error") or len(answers) < len(ref.logits):
        why = f"the e2e path did not answer every step ({kept.get('error') or 'no answers'})"
        return [InvarianceRow(name, Status.NA, why).as_dict() for name in INVARIANCE_ROWS]
    # every routing difference the e2e row judged, with the experts chosen there: a path that chose the same is
    # held to that row's verdict (after routing replay, against the measured noise), not judged again
    judged = {(d["call"], d["layer"], d["position"]): sorted(d["candidate"])
              for d in (run.result.e2e.routing or {}).get("differences", []) if d.get("what", "experts") == "experts"}
    lim = thresholds.at_width(thresholds.limits(spec.precision, "e2e", spec.family, spec.backend),
                              reduction_length(run.src.args))
    try:
        base = ordinary(ref, answers, kept.get("routes") or [])
    except ValueError as e:  # answers the e2e row judged malformed (another width than the vocabulary's): no path
        why = f"the e2e path's answers are not logits rows of the vocabulary ({e})"
        return [InvarianceRow(name, Status.NA, why).as_dict() for name in INVARIANCE_ROWS]
    rows = invariance_rows(ref, cand, spec, base, judged,
                           run.noise if thresholds.noise_relative(spec.precision) else None, lim,
                           spec.require_deterministic)
    return [r.as_dict() for r in rows]


def drill_down(run: Run) -> None:
    """Inside the blocks (oracle/drill/points.py): the worst failing block of a failing check ("auto"),
    or every block ("all"), run again on both sides with its points recorded. A drill that cannot
    run says why in its section; it never changes the check's status."""
    spec, result = run.spec, run.result
    # the worst failing block, of a kind the candidate's known divergence (goldens/known_divergences.toml)
    # does not fail where there is one: that is where a new defect shows
    known = expected.known_fails(result)
    failing = worst_row([r for r in result.blocks if r.kind not in known]) or worst_row(result.blocks)
    if spec.drill == "off" or (spec.drill == "auto" and (failing is None or failing.kind not in points.DRILLED)):
        return
    keys = ([(r.layer, r.kind) for r in result.blocks if r.kind in points.DRILLED and r.status != Status.NA]
            if spec.drill == "all" else [(failing.layer, failing.kind)])
    run.stage = "drill"
    run.progress("drill")
    t = time.perf_counter()
    try:
        hf = resolve("hf").load(run.src, hf_spec(spec, "fp32"))
        # at a precision judged against its own error (bf16), HF at that precision sets each point's limit
        noise = resolve("hf").load(run.src, hf_spec(spec, spec.precision)) \
            if thresholds.noise_relative(spec.precision) else None
        drills = []
        for key in keys:
            lim = points.point_limits(spec.precision, key[1], spec.family, spec.backend, reduction_length(run.src.args))
            drills.append(points.drill(run.ref, key, run.cand, hf, lim, noise, spec.precision).as_dict())
        result.drill = {"blocks": drills}
    except Exception as e:  # the drill is a diagnosis: its crash is reported, the verdict stands
        result.drill = {"blocks": [], "error": f"{type(e).__name__}: {e}"}
    run.timings["drill_s"] = time.perf_counter() - t


def verdict(run: Run) -> CheckResult:
    """The worst block row, the status (error, fail or pass), a known defect's expected failure."""
    result = run.result
    w = worst_row(result.blocks)  # rows measured before a crash still localise
    result.worst = asdict(w) if w else None
    failed = (w is not None or (result.e2e and result.e2e.status in (Status.FAIL, Status.ERROR))
              or any(g.status in (Status.FAIL, Status.ERROR) for g in result.gates)
              or (result.quantization or {}).get("rows", {}).get("status") in (Status.FAIL, Status.ERROR)
              or ((result.quantization or {}).get("weights") or {}).get("status") in (Status.FAIL, Status.ERROR)
              or (result.prompts or {}).get("status") == Status.FAIL
              or any(r["status"] in (Status.FAIL, Status.ERROR) for r in result.invariance or []))
    result.status = Status.ERROR if result.error else Status.FAIL if failed else Status.PASS
    expected.judge(result)  # a known candidate defect: fails as its entry says -> xfail; passes -> stale
    run.timings["total_s"] = time.perf_counter() - run.t0
    run.timings["peak_rss_gib"] = peak_rss_gib()
    if READ["bytes"] > run.read_before:  # streamed HF models (reference, noise, hf): what their layers read
        run.timings["streamed_gib_read"] = (READ["bytes"] - run.read_before) / 2**30
        disk = disk_read_bytes()  # and what the process read from storage (the checkpoint, less what was cached)
        if disk is not None and run.disk_before is not None:
            run.timings["disk_gib_read"] = (disk - run.disk_before) / 2**30
    result.timings = run.timings
    return result


__all__ = ["run_check", "CheckSpec", "InputError", "GateRow"]
