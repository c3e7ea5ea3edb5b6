"""One check: checkpoint -> HF fp32 reference -> candidate -> block rows, e2e, gates -> CheckResult."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import tempfile
import platform
import time
import traceback
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from models import FAMILY_NAMES, UNSUPPORTED, code_digest, family_for_model_type, get_family, text_config
from models.args import ModelArgs
from models.quantized import dequantized_checkpoint, quantization_of
from models.checkpoint import CheckpointError, cache_root, cached_identity, checkpoint_identity, config_checkpoint, meta_weights, \
    published_config, read_config, tiny_checkpoint
from models.trained import PROFILES
from oracle import expected
from oracle import goldens as golden_files
from oracle import insitu
from oracle import thresholds
from oracle.backend import CheckSpec, InputError, ModelSource, memory_refusal, resolve, validate_options
from oracle.distribution import distribution_metrics, judge_distribution
from oracle.metrics import OutputError, as_array, as_f64, router_metrics, tensor_metrics, top2_margin, weight_diffs
from oracle.noise import noise_for, rounding, score_error
from oracle.reference import capture, load_hf_model, reference_mode
from oracle.sampling import sampling_gates
from oracle.result import E2E, BlockRow, CheckResult, GateRow, worst_row

PACKAGES = ("torch", "transformers", "safetensors", "numpy", "executorch", "iree-base-compiler",
            "iree-base-runtime", "iree-turbine", "mlx", "mlx-lm", "moe-oracle")


def provenance(spec: CheckSpec, backend=None) -> dict:
    """Versions, host, seed, thresholds. torch's intra-op thread count only where the candidate
    runs torch (a backend without `runs_torch = False`: a warm check of one that runs no torch
    never imports it)."""
    from oracle.artifacts import versions

    host = {"name": platform.node(), "machine": platform.machine(), "system": platform.system(),
            "cpus": os.cpu_count()}
    if getattr(backend, "runs_torch", True):
        import torch

        host["torch_threads"] = torch.get_num_threads()
    return {
        "versions": {p: v for p, v in versions(*PACKAGES).items() if v is not None},
        "python": platform.python_version(),
        "host": host,
        "seed": spec.seed,
        "thresholds_sha256": hashlib.sha256(thresholds.DEFAULT_PATH.read_bytes()).hexdigest(),
    }


def validate(spec: CheckSpec, command: str = "check"):
    """Everything about the spec that can be refused before any work; returns the backend.
    spec.options are converted to the types the backend's option schema declares."""
    if spec.family not in FAMILY_NAMES:
        if spec.family in UNSUPPORTED:
            raise InputError(f"family {spec.family!r} is not supported yet: missing {UNSUPPORTED[spec.family]}")
        raise InputError(f"unknown family {spec.family!r}; known: {', '.join(FAMILY_NAMES)}")
    if spec.layers is not None and not spec.config:
        raise InputError("--layers applies to --config (a seeded checkpoint of a published config)")
    if spec.weights not in PROFILES:
        raise InputError(f"unknown weight profile {spec.weights!r}; known: {', '.join(PROFILES)}")
    if spec.weights != "normal" and spec.model_dir:
        raise InputError(f"--weights {spec.weights} makes the tiny or --config checkpoint's weights; "
                         "--model-dir is a checkpoint with its own")
    for name in ("prompt_len", "decode_tokens"):
        if getattr(spec, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(spec, name)}")
    if spec.precision not in thresholds.precisions():
        raise InputError(f"unknown precision {spec.precision!r}; known: {', '.join(thresholds.precisions())}")
    backend = resolve(spec.backend)
    supported = getattr(backend, "precisions", None)
    if supported is not None and spec.precision not in supported:
        raise InputError(f"backend {spec.backend} does not support precision {spec.precision} "
                         f"(supports {', '.join(supported)})")
    if spec.quant_reference not in QUANT_REFERENCES:
        raise InputError(f"--quant-reference {spec.quant_reference}: allowed values are {', '.join(QUANT_REFERENCES)}")
    if spec.quant_reference != "dequantized" and not thresholds.quantized(spec.precision):
        raise InputError(f"--quant-reference applies to the quantized precisions, not {spec.precision}")
    if shipped_dir(spec) is not None:
        if spec.candidate_dir is not None and not getattr(backend, "loads_directory", False):
            raise InputError(f"backend {spec.backend} cannot load a prebuilt directory (--candidate-dir): "
                             "it builds its candidate from the checkpoint")
        if spec.precision not in ("fp32", "bf16"):
            raise InputError(f"--precision {spec.precision}: a shipped quantized directory's quantization is its "
                             "own (read from its config.json); --precision is then the activation dtype, fp32 or bf16")
    if spec.reference is not None:
        saved_reference(spec)
    if spec.artifact is not None:
        suffix = getattr(backend, "artifact_suffix", None)
        if suffix is None:
            raise InputError(f"backend {spec.backend} runs no prebuilt program (--pte / --vmfb)")
        if not spec.artifact.endswith(suffix):
            raise InputError(f"backend {spec.backend} runs a {suffix} program (--{suffix[1:]}), not {spec.artifact}")
        if not Path(spec.artifact).is_file():
            raise InputError(f"--{suffix[1:]} {spec.artifact}: no such file")
    spec.options.update(validate_options(backend, spec.options, command))
    check_options = getattr(backend, "check_options", None)
    problem = check_options(spec) if check_options else None
    if problem:
        raise InputError(f"backend {spec.backend}: {problem}")
    return backend


def require_family(family, config: dict, where: str) -> None:
    mt = config["model_type"]
    if mt not in family.model_types:
        other = family_for_model_type(mt)
        hint = f" (that is family {other!r})" if other else (
            f" (not supported yet: missing {UNSUPPORTED[mt]})" if mt in UNSUPPORTED else "")
        raise InputError(f"{where} has model_type {mt!r}, not a {family.name} checkpoint{hint}")


def family_of(model_dir: str | None, config: str | None, layers: int | None = None) -> str:
    """The family a checkpoint directory's (or a published) config.json names by its model_type:
    what --family defaults to with --model-dir or --config."""
    if model_dir is None and config is None:
        raise InputError("--family is required with the tiny checkpoint (or give --model-dir / --config)")
    try:
        cfg = read_config(Path(model_dir)) if model_dir else published_config(config, layers)
    except CheckpointError as e:
        raise InputError(str(e)) from None
    mt = cfg.get("model_type")
    name = family_for_model_type(mt) or family_for_model_type(text_config(cfg).get("model_type"))
    if name is None:
        hint = f": not supported yet, missing {UNSUPPORTED[mt]}" if mt in UNSUPPORTED else ""
        raise InputError(f"{model_dir or config}: no family reads model_type {mt!r}{hint} "
                         f"(families: {', '.join(FAMILY_NAMES)})")
    return name


def model_source(spec: CheckSpec, progress=None) -> ModelSource:
    """The checkpoint of the spec (--model-dir, --config, or the tiny one), validated from its
    headers; its identity computed (or read from the identity cache)."""
    family = get_family(spec.family)
    try:
        if spec.model_dir:
            model_dir = Path(spec.model_dir)
        elif spec.config:
            cfg = published_config(spec.config, spec.layers)
            require_family(family, cfg, f"--config {spec.config}")
            try:  # consistent before a checkpoint is written from it
                family.args(cfg)
            except CheckpointError as e:
                raise CheckpointError(f"--config {spec.config}: {e}") from None
            model_dir = config_checkpoint(family, spec.config, spec.layers, spec.seed, progress=progress,
                                          weights=spec.weights)
        else:
            model_dir = tiny_checkpoint(family, spec.seed, spec.weights)
        return source_of(family, model_dir, spec)
    except CheckpointError as e:
        raise InputError(str(e)) from None


def check_length(config: dict, max_len: int, what: str) -> None:
    """InputError when a sequence of max_len tokens (`what`) does not fit the model's positions."""
    limit = text_config(config).get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < max_len:  # (other values: its rule says)
        raise InputError(f"{what} exceeds max_position_embeddings {limit}")


def source_of(family, model_dir: Path, spec: CheckSpec) -> ModelSource:
    config = read_config(model_dir)
    require_family(family, config, f"{model_dir}/config.json")
    max_len = spec.prompt_len + spec.decode_tokens
    check_length(config, max_len, f"prompt-len + decode-tokens = {max_len}")
    # a checkpoint this code validated before, unchanged since (same identity): from the cache
    known = validated_args(family, cached_identity(model_dir), max_len)
    if known is not None:
        return ModelSource(family, model_dir, config, known[0], known[1])
    # every tensor checked (names, shapes, dtypes, shards) from the headers alone, then the
    # identity: one streamed pass (cached by path, size and mtime) that refuses NaN/Inf weights
    args = family.validate(config, meta_weights(model_dir), max_seq_len=max_len, where=str(model_dir / "config.json"))
    sha = checkpoint_identity(model_dir)
    save_validated_args(family, sha, args)
    return ModelSource(family, model_dir, config, args, sha)


def _validated_parts(family, sha: str, max_len: int) -> dict:
    from oracle.artifacts import versions

    return {"family": family.name, "sha": sha, "max_len": max_len, "code": code_digest(), **versions("transformers")}


def validated_args(family, sha: str | None, max_len: int):
    """(ModelArgs, sha) of a checkpoint this code already validated (its identity unchanged:
    same files, sizes, mtimes), from the cache: no transformers config class, no model skeleton.
    None when not cached."""
    from oracle.artifacts import json_get

    if sha is None:
        return None
    d = json_get("validated", _validated_parts(family, sha, max_len))
    if d is None:
        return None
    try:
        return ModelArgs.from_dict(d), sha
    except (TypeError, KeyError):  # not this code's ModelArgs
        return None


def save_validated_args(family, sha: str, args) -> None:
    from oracle.artifacts import json_put

    json_put("validated", _validated_parts(family, sha, args.max_seq_len), asdict(args))


def shipped_dir(spec: CheckSpec) -> str | None:
    """The shipped (mlx-lm format) directory the check is about: --candidate-dir, or a --model-dir
    whose config.json has a quantization entry (then there is no original to compare with)."""
    if spec.candidate_dir is not None:
        return spec.candidate_dir
    if spec.model_dir is None:
        return None
    try:
        return spec.model_dir if quantization_of(read_config(Path(spec.model_dir))) is not None else None
    except CheckpointError:
        return None  # model_source() says what is wrong with it


@dataclass
class Sources:
    """The checkpoints one check reads. Plain: `src` alone. A shipped directory: `src` is HF's
    checkpoint of its weights (dequantized to fp32), `original` the HF checkpoint it was made
    from (None when only the shipped directory was given)."""

    src: ModelSource
    shipped: str | None = None
    original: ModelSource | None = None
    quantization: dict | None = None  # the shipped directory's quantization (models.quantized.summary)
    built: bool = False  # the shipped directory is the one the backend wrote for --precision q8/q4


QUANT_REFERENCES = ("dequantized", "original")


def builds_quantized(spec: CheckSpec, backend) -> bool:
    """Whether a quantized precision is checked on the directory the backend writes (the
    implementation/quantization split of a shipped directory): q8/q4 on a backend that exports
    and loads directories, no directory or program given, --quant-reference dequantized."""
    return (spec.quant_reference == "dequantized" and thresholds.quantized(spec.precision)
            and spec.candidate_dir is None and spec.artifact is None and shipped_dir(spec) is None
            and getattr(backend, "loads_directory", False) and hasattr(backend, "export"))


def quantizing_options(backend, options: dict) -> dict:
    """The options that shape the quantized weights (the schema's `quantizes`), spent on the
    directory the backend writes."""
    schema = {o.name: o for o in getattr(backend, "option_schema", ())}
    return {k: v for k, v in options.items() if k in schema and schema[k].quantizes}


def quantized_directory(backend, src: ModelSource, spec: CheckSpec, progress) -> str:
    """The directory the backend's `export` writes for spec's q8/q4 and quantizing options,
    cached by content (checkpoint, precision, options, the backend's code, tool versions)."""
    import inspect

    from oracle.artifacts import cached_artifact, sha256_file, versions

    opts = quantizing_options(backend, spec.options)
    code = sha256_file(Path(inspect.getsourcefile(type(backend))))
    parts = {"checkpoint": src.checkpoint_sha256, "precision": spec.precision, "options": opts, "code": code,
             **versions(*PACKAGES)}
    progress(f"writing the {spec.precision} directory ({spec.backend} export)")
    art = cached_artifact("quantized", parts, "config.json",
                          lambda path: backend.export(src, replace(spec, options=opts), path.parent),
                          name=f"{spec.family}.{spec.precision}")
    return str(Path(art.path).parent)


def sources(spec: CheckSpec, progress=None, backend=None) -> Sources:
    shipped, original = shipped_dir(spec), None
    built = backend is not None and builds_quantized(spec, backend)
    if built:
        original = model_source(spec, progress)
        shipped = quantized_directory(backend, original, spec, progress or (lambda msg: None))
    if shipped is None:
        return Sources(model_source(spec, progress))
    family = get_family(spec.family)
    if not built:
        original = None if shipped == spec.model_dir else model_source(spec, progress)
    try:
        own = read_config(Path(shipped))
        require_family(family, own, f"{shipped}/config.json")
        quantization_of(own)
        if original is not None:
            differs = first_difference(original.args, family.args(own, original.args.max_seq_len))
            if differs:
                raise InputError(f"--candidate-dir {shipped} is not the architecture of {original.model_dir}: "
                                 f"config {differs}")
        deq, summary = dequantized_checkpoint(family, Path(shipped), original.config if original else None,
                                              progress=progress, original=original.model_dir if original else None)
        try:
            src = source_of(family, deq, spec)
        except CheckpointError as e:
            raise InputError(f"--candidate-dir {shipped}: its weights do not fit "
                             f"{'the original' if original else 'its config'}: {e}") from None
    except CheckpointError as e:
        raise InputError(f"{shipped}: {e}") from None
    return Sources(src, shipped, original, summary, built)


def first_difference(a, b) -> str | None:
    """The first ModelArgs field (bar the sequence length) where two checkpoints differ, as text."""
    for f in fields(a):
        if f.name != "max_seq_len" and getattr(a, f.name) != getattr(b, f.name):
            return f"{f.name}: {getattr(a, f.name)!r} (original) vs {getattr(b, f.name)!r} (candidate)"
    return None


def prompt_tokens(spec: CheckSpec, vocab: int) -> list[int]:
    """prompt_len token ids drawn by torch from `seed` (cached: a warm check imports no torch)."""
    from oracle.artifacts import cached_json, versions

    def draw():
        import torch

        gen = torch.Generator().manual_seed(spec.seed)
        return torch.randint(0, vocab, (spec.prompt_len,), generator=gen).tolist()

    return cached_json("prompts", {"seed": spec.seed, "vocab": vocab, "n": spec.prompt_len, **versions("torch")}, draw)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def tokenized_prompts(spec: CheckSpec, srcs, vocab: int) -> list[list[int]]:
    """--prompt / --prompts: each text tokenized by the checkpoint's own tokenizer
    (transformers' AutoTokenizer from the directory's files, never downloaded; special tokens as
    the tokenizer adds them). Exit 2 when the checkpoint carries no tokenizer."""
    dirs = [Path(d) for d in (spec.model_dir, srcs.shipped) if d]
    where = next((d for d in dirs if any((d / f).is_file() for f in TOKENIZER_FILES)), None)
    if where is None:
        named = spec.model_dir or spec.config or "the tiny checkpoint"
        raise InputError(f"--prompt/--prompts need the checkpoint's tokenizer, and {named} has none "
                         f"({' / '.join(TOKENIZER_FILES)})")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(where), local_files_only=True)
    except Exception as e:
        raise InputError(f"{where}: its tokenizer does not load ({type(e).__name__}: {e})") from None
    out = []
    for i, text in enumerate(spec.prompts):
        ids = list(tok(text)["input_ids"])
        if not ids:
            raise InputError(f"prompt {i + 1} tokenizes to nothing")
        if max(ids) >= vocab:
            raise InputError(f"prompt {i + 1}: token id {max(ids)} is outside the model's vocabulary ({vocab})")
        out.append(ids)
    return out


def prompt_set(ref0, e2e0, rows0, spec, src, cand, prompts: list[list[int]], progress) -> dict:
    """Every prompt's e2e against its own reference (at a reduced precision, judged against HF's
    own error on that prompt), and the distribution metrics over all of
    them (llama.cpp's --kl-divergence figures): KL percentiles, same top-1, and the perplexity
    of each prompt's own next tokens under the candidate and the reference (prefill rows)."""
    lim = thresholds.at_width(thresholds.limits(spec.precision, "e2e", spec.family, spec.backend),
                              reduction_length(src.args))
    per, ref_all, cand_all, nll = [], [], [], {"reference": [], "candidate": []}
    for i, tokens in enumerate(prompts):
        progress("prompts", i, len(prompts))
        if i == 0:
            ref, e2e, rows = ref0, e2e0, rows0
        else:
            ref, rows = reference_of(spec, src, tokens), []
            try:  # reduced precisions: each prompt's steps judged against HF's own error on that prompt
                noise = noise_for(ref, src, spec, tokens)
            except Exception:  # not measurable: the fixed table, as for the first prompt (run_check)
                noise = None
            e2e = run_e2e(ref, cand, spec, reduction_length(src.args), rows, noise)[0]
        per.append({"prompt_tokens": len(tokens), "status": e2e.status, "token_exact": e2e.token_exact,
                    "max_abs": max((s["max_abs"] for s in e2e.steps if s.get("max_abs") is not None), default=None)})
        if any("vs_noise" in s for s in e2e.steps):  # judged against HF's own error on this prompt
            per[-1]["max_vs_noise"] = max(s["vs_noise"] for s in e2e.steps if "vs_noise" in s)
        for k, r, c in rows:
            ref_all.append(r)
            cand_all.append(c)
            if k == 0 and c.shape[0] == len(tokens) and len(tokens) > 1:  # every prompt row: its next tokens
                nll["reference"].append((r[:-1], tokens[1:]))
                nll["candidate"].append((c[:-1], tokens[1:]))
    out = {"count": len(prompts), "per_prompt": per}
    if ref_all:
        d = distribution_metrics(np.concatenate(ref_all), np.concatenate(cand_all), lim.get("tie_margin", 0.0))
        if "kl_mean" in lim:
            d["status"], d["ratio"] = judge_distribution(d, lim)
        out["distribution"] = d
    if nll["reference"]:
        from oracle.distribution import perplexity

        ppl = {}
        for who, parts in nll.items():
            ppl[who], n = perplexity(np.concatenate([p for p, _ in parts]), np.concatenate([t for _, t in parts]))
        out["perplexity"] = {**ppl, "ratio": ppl["candidate"] / ppl["reference"], "positions": n}
    failed = any(p["status"] in ("fail", "error") for p in per) or (out.get("distribution") or {}).get("status") == "fail"
    out["status"] = "fail" if failed else "pass"
    return out


@functools.lru_cache(maxsize=4)
def reference_for(family_name: str, model_dir: str, sha: str, prompt: tuple, n: int):
    """The HF reference for this checkpoint and prompt: in memory, else from the disk cache
    (keyed by the checkpoint's sha256, prompt, steps, and the code and versions that capture
    it), else captured and saved."""
    from oracle import reference
    from oracle.artifacts import key_of, versions

    code = hashlib.sha256(Path(reference.__file__).read_bytes()).hexdigest()
    key = key_of({"family": family_name, "sha": sha, "prompt": list(prompt), "n": n, "code": code,
                  **versions("torch", "transformers", "safetensors")})
    path = cache_root() / "references" / key
    ref = reference.load(path)
    if ref is None:
        family = get_family(family_name)
        if reference_mode(Path(model_dir)) == "streamed":
            (cache_root() / "offload").mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_root() / "offload") as offload:
                ref = capture(load_hf_model(family, Path(model_dir), offload_dir=Path(offload)), family,
                              list(prompt), n)
        else:
            ref = capture(load_hf_model(family, Path(model_dir)), family, list(prompt), n)
        bad = reference.first_nonfinite(ref)
        if bad:
            raise InputError(f"the HF fp32 reference itself produces NaN/Inf, first at {bad}: the checkpoint "
                             f"{model_dir} (weights or config) is bad; no backend can be judged against it")
        reference.save(ref, path)
    return ref


def dtype_name(x) -> str | None:
    """The dtype a candidate returned: torch and numpy arrays; None when unknown."""
    dt = getattr(x, "dtype", None)
    return None if dt is None else str(dt).rsplit(".", 1)[-1]  # torch.float32, mlx.core.float32, float32


def expected_dtype(spec) -> str | None:
    try:
        return thresholds.limits(spec.precision, "output", spec.family, spec.backend).get("dtype")
    except KeyError:
        return None


def _shape(a) -> str:
    return "[" + ", ".join(map(str, a.shape)) + "]"


def _rows(a: np.ndarray, width: int) -> np.ndarray:
    """[..., width] -> [N, width] (a candidate may drop or keep the batch dimension)."""
    return a.reshape(-1, width) if a.ndim and a.shape[-1] == width else a.reshape(1, -1)


def candidate_arrays(kind: str, outs, ref_outs) -> list:
    """A candidate's outputs for one block as host arrays, one per call, each the
    reference's shape up to leading 1s: router (weights [T, k] float64, indices [T, k] int64),
    others [T, H] float64. OutputError says what is wrong (count, None, a tuple where an
    array is expected, a shape) and for which call."""
    if not isinstance(outs, (list, tuple)):
        raise OutputError(f"run_block returned a {type(outs).__name__}, expected a list with one output per call")
    if len(outs) != len(ref_outs):
        raise OutputError(f"{len(outs)} output(s) for {len(ref_outs)} call(s)")
    arrays = []
    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        try:
            if kind == "router":
                if not isinstance(o, (tuple, list)) or len(o) != 2:
                    what = "None" if o is None else f"a {type(o).__name__}" + (
                        f" of {len(o)}" if isinstance(o, (tuple, list)) else "")
                    raise OutputError(f"{what} where (weights [T, k], indices [T, k]) is expected")
                rw, ri = r
                want = (int(ri.size // ri.shape[-1]), int(ri.shape[-1]))
                w, idx = as_array(o[0]), as_array(o[1], np.int64)
                for name, a in (("weights", w), ("indices", idx)):
                    a2 = _rows(a, want[1]) if a.ndim else a.reshape(1, 1)
                    if a2.shape != want:
                        got = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
                        raise OutputError(f"{name} shape {_shape(got)} vs reference [{want[0]}, {want[1]}]")
                arrays.append((w.reshape(want), idx.reshape(want)))
            else:
                want = (int(r.size // r.shape[-1]), int(r.shape[-1]))
                a = as_array(o)
                if a.size != want[0] * want[1] or (a.ndim and a.shape[-1] != want[1]):
                    got = a.reshape(-1, a.shape[-1]) if a.ndim else a
                    raise OutputError(f"shape {_shape(got)} vs reference [{want[0]}, {want[1]}]")
                arrays.append(a.reshape(want))
        except OutputError as e:
            raise OutputError(f"call {i}: {e}") from None
    return arrays


def invalid_row(key, mode, lim, detail, reason: str, status: str = "fail") -> BlockRow:
    """A row the candidate's output could not be compared for (fail) or whose block raised (error)."""
    field = "exception" if status == "error" else "invalid_output"
    return BlockRow(key[0], key[1], status, mode, {field: reason, "nonfinite": 0}, lim, float("inf"), detail)


def reduction_length(args) -> int:
    """The longest dot product of the model's blocks (what fp32 summation error grows with)."""
    return max(args.hidden_size, args.moe_intermediate_size, args.shared_expert_intermediate_size,
               args.intermediate_size, args.q_lora_rank, args.kv_lora_rank)


def router_gaps(ref, layer: int, n: int | None = None, dtype=np.float32, weights: bool = True) -> np.ndarray:
    """The reference's k-th minus (k+1)-th selection score per token of `layer`'s router calls
    (the first n: the sequence's calls come first, then the expert probes); for a group-limited
    router the smaller of that and the margin of its group choice; with `weights`, also of the
    decisions that set its weights (sparsemixer's masks: the block rows judge the weights; e2e
    does not excuse a step for them, oracle/check.py excuse_routing_ties)."""
    p = -np.sort(-np.concatenate(ref.router_probs[layer])[:n].astype(dtype), axis=-1)  # descending
    k = ref.outputs[layer, "router"][0][1].shape[-1]
    with np.errstate(invalid="ignore"):  # -inf (a group left out) below the k-th: an infinite gap
        gap = p[:, k - 1] - p[:, k] if p.shape[-1] > k else np.full(p.shape[0], np.inf)
    if layer in ref.group_gaps:
        gap = np.minimum(gap, np.concatenate(ref.group_gaps[layer])[:n])
    if weights and layer in ref.weight_gaps:
        gap = np.minimum(gap, np.concatenate(ref.weight_gaps[layer])[:n])
    return gap


def tie_gaps(ref, layer: int, spec, noise=None, n: int | None = None, in_model: bool = False):
    """The near-tie gap per token of `layer`'s first n router calls (an array) or for all (a
    number): with the precision's measured error (oracle/noise.py), `tie_factor` times its error on
    that token's selection scores (the logit gap against the logit error): on the reference's
    router inputs (a block row), or inside HF's whole run at this precision (`in_model`: e2e, whose
    router inputs carry the upstream layers' error); else the router table's fixed tie gap,
    scaled to the number of experts."""
    router_lim = thresholds.limits(spec.precision, "router", spec.family, spec.backend)
    scores = None if noise is None else (noise.e2e_scores if in_model else noise.scores).get(layer)
    if scores is not None and "tie_factor" in router_lim:
        return router_lim["tie_factor"] * score_error(ref.router_probs[layer], scores, n)
    return thresholds.tie_gap(router_lim, ref.router_probs[layer][0].shape[-1])


def router_near_ties(ref, layer: int, spec, n: int | None = None, noise=None, in_model: bool = False) -> np.ndarray:
    """Per token of `layer`'s first n router calls: is the reference's routing a near tie at this
    precision (its gap below tie_gaps)?"""
    return ~(router_gaps(ref, layer, n, weights=not in_model) >= tie_gaps(ref, layer, spec, noise, n, in_model))


def compare_block(ref, key, outs, spec, layer_types, routes: dict | None = None, reduction: int = 0,
                  noise=None, upstream: list | None = None) -> BlockRow:
    """One block row. `routes` (layer -> per token: did the candidate's router row route it as the
    reference did (oracle.check: the same experts, near-tie weights within the limit), filled in by
    the router row) decides which tokens the moe and layer rows compare: not a
    token the candidate's router row routed elsewhere (that row judges routing); a moe row then
    compares every token routed as the reference did, near ties included. `noise` (oracle/noise.py,
    reduced precisions): the row is judged against HF's own error at this precision. `upstream`
    (oracle/insitu.py, an in-situ row at a precision with an in_situ rule): HF fp32's outputs on the
    candidate's own upstream, what a correct block makes of the error the row's input carries."""
    layer, kind = key
    lim = thresholds.at_width(thresholds.limits(spec.precision, kind, spec.family, spec.backend), reduction)
    detail = layer_types[layer] if kind == "attention" else ""
    try:
        arrays = candidate_arrays(kind, outs, ref.outputs[key])
    except OutputError as e:
        return invalid_row(key, "isolated", lim, detail, str(e))
    if kind == "router":
        ref_w = np.concatenate([w.reshape(-1, w.shape[-1]) for w, _ in ref.outputs[key]])
        ref_i = np.concatenate([i.reshape(-1, i.shape[-1]) for _, i in ref.outputs[key]])
        cand_w = np.concatenate([w for w, _ in arrays])
        cand_i = np.concatenate([i for _, i in arrays])
        gaps, tie = router_gaps(ref, layer, dtype=np.float64), tie_gaps(ref, layer, spec, noise)
        m = router_metrics(ref_w, ref_i, cand_w, cand_i, gaps, tie)
        h = noise.outputs.get(key) if noise is not None and "noise_factor" in lim else None
        if h is not None and "shape_mismatch" not in m:  # the weights: against HF's own weight error
            nm = router_metrics(ref_w, ref_i, np.concatenate([w.reshape(-1, w.shape[-1]) for w, _ in h]),
                                np.concatenate([i.reshape(-1, i.shape[-1]) for _, i in h]), gaps, tie)
            # storing the weights at this precision, at least half a unit in the last place of the
            # largest (a weight of exactly 1, as sparsemixer's, still allows its neighbours' rounding)
            stored = max(float(np.abs(rounding(ref_w, spec.precision) - ref_w).max()),
                         float(np.abs(ref_w).max()) * 2.0 ** -9) if ref_w.size else 0.0
            lim = {**lim, "weight_atol": lim["noise_factor"] * nm["weight_max_abs"] + lim["noise_floor"] * stored}
            m["noise_weight_max_abs"], m["noise_topk_agreement"] = nm["weight_max_abs"], nm["topk_agreement"]
        rule = thresholds.in_situ(spec.precision) if upstream is not None else None
        if rule and "shape_mismatch" not in m:  # in-situ: + factor x the weight error its own upstream carries
            uw = np.concatenate([w.reshape(-1, w.shape[-1]) for w, _ in upstream]).astype(np.float64)
            ui = np.concatenate([i.reshape(-1, i.shape[-1]) for _, i in upstream])
            um = router_metrics(ref_w, ref_i, uw, ui, gaps, tie)
            m["upstream_weight_max_abs"] = um["weight_max_abs"]
            lim = {**lim, "upstream_factor": rule["upstream_factor"], "table_weight_atol": lim["weight_atol"],
                   "weight_atol": lim["weight_atol"] + rule["upstream_factor"] * um["weight_max_abs"]}
        if np.ndim(tie):
            m["tie_tokens"] = int((gaps < tie).sum())
        status, ratio = thresholds.judge_router(m, lim)
        if routes is not None and "shape_mismatch" not in m:
            # routed as the reference did: the same experts and, at a near tie of a decision that
            # sets the weights (sparsemixer's mask), weights within the limit
            dw = weight_diffs(ref_w, ref_i, cand_w, cand_i)
            routes[layer] = (dw < np.inf) & ~((gaps < tie) & (dw > lim["weight_atol"]))
    else:
        r = np.concatenate([o.reshape(-1, o.shape[-1]) for o in ref.outputs[key]]).astype(np.float64)
        c = np.concatenate(arrays)
        keep = None
        if kind in ("moe", "layer") and layer in ref.router_probs and r.shape[0] == c.shape[0]:
            # tokens whose reference routing is a near tie at this precision: a flipped
            # expert there is the precision's doing, reported as a count, not compared
            # (router calls = the sequence's calls, then the expert probes: moe has both, layer none)
            keep = ~router_near_ties(ref, layer, spec, r.shape[0], noise)
            rerouted = np.zeros_like(keep)
            if routes is not None and len(routes.get(layer, ())) >= len(keep):
                # the candidate's router row (the reference's router inputs): a token it routed
                # to other experts is the router row's to judge (its agreement limit: 1.0 at
                # fp32/bf16, 0.75 for a 4-bit router), not compared here; a moe row (the same
                # inputs) compares every token routed as the reference did, near ties included
                same = routes[layer][: len(keep)]
                rerouted = ~same
                keep = same if kind == "moe" else keep & same
            if not keep.any():  # nothing left to compare: not a pass
                return BlockRow(layer, kind, "n/a", "isolated", {"tie_tokens_excluded": int(keep.size), "nonfinite": 0},
                                lim, 0.0, f"every token is a router near tie at {spec.precision} or routed elsewhere "
                                          "by the candidate's router: nothing compared")
            r, c = r[keep], c[keep]
        lim = thresholds.at_scale(lim, math.sqrt(float(np.mean(r * r))))
        m = tensor_metrics(r, c, lim["atol"], lim["rtol"])
        want, got = expected_dtype(spec), dtype_name(outs[0]) if outs else None
        if want and got and got != want:  # e.g. an unconditional cast that changes the output dtype
            m["dtype_mismatch"] = f"{got} (expected {want})"
        h = noise.outputs.get(key) if noise is not None and "noise_factor" in lim else None
        if h is not None:  # HF at this precision, the same inputs and the same tokens kept
            h = np.concatenate([o.reshape(-1, o.shape[-1]) for o in h]).astype(np.float64)
            h = h[keep] if keep is not None and h.shape[0] == keep.shape[0] else h
            lim = noise_row_limits(lim, r, h, spec.precision, m)
        rule = thresholds.in_situ(spec.precision) if upstream is not None else None
        if rule and "shape_mismatch" not in m and "dtype_mismatch" not in m:
            u = np.concatenate([o.reshape(-1, o.shape[-1]) for o in upstream]).astype(np.float64)
            u = u[keep] if keep is not None and u.shape[0] == keep.shape[0] else u
            lim = upstream_metrics(lim, rule, r, c, u, m)
        if keep is not None:
            m["tie_tokens_excluded"] = int((~keep & ~rerouted).sum())  # near ties, not compared
            if rerouted.any():  # routed elsewhere by the candidate's router row, which judges that
                m["rerouted_tokens_excluded"] = int(rerouted.sum())
            if m.get("first_divergence"):  # back to the token index of the whole sequence
                fd = m["first_divergence"]
                fd["index"][0] = int(np.flatnonzero(keep)[fd["index"][0]])
            if keep.size and (~keep).sum() * 4 > keep.size:  # said in the status line: a verdict on few tokens
                m["excluded_over_quarter"] = f"{int((~keep).sum())} of {keep.size} tokens not compared"
        judge = (thresholds.judge_upstream if "upstream_allclose_ratio" in m
                 else thresholds.judge_noise if "noise_max_abs" in m else thresholds.judge_tensor)
        status, ratio = judge(m, lim)
    return BlockRow(layer, kind, status, "isolated", m, lim, ratio, detail)


def upstream_metrics(lim: dict, rule: dict, r: np.ndarray, c: np.ndarray, u: np.ndarray, m: dict) -> dict:
    """The limits of an in-situ row whose reference is `r` and candidate `c`, from `u`, HF fp32 on
    the candidate's own upstream (oracle/insitu.py): element by element |c - r| <= atol + rtol |r| +
    upstream_factor |u - r| (an element's propagated error follows what was summed into it
    upstream, not its own magnitude), rel_l2 <= the table's + upstream_factor x u's. Records u's
    error (`upstream_max_abs`, `upstream_rel_l2`), the candidate's max_abs as a multiple of it
    (`vs_upstream`), the elementwise ratio and the first element beyond it in `m`."""
    if u.shape != r.shape:
        return lim
    um = tensor_metrics(r, u, lim["atol"], lim["rtol"])
    m["upstream_max_abs"], m["upstream_rel_l2"] = um["max_abs"], um["rel_l2"]
    if um["max_abs"] > 0:  # nothing upstream (the first layer): the table alone, no ratio
        m["vs_upstream"] = m["max_abs"] / um["max_abs"]
    lim = thresholds.upstream_limits(lim, rule, um)
    prop = np.nan_to_num(np.abs(u - r), nan=0.0, posinf=0.0)  # a non-finite upstream allows nothing more
    d = np.abs(c - r)
    tol = lim["atol"] + lim["rtol"] * np.abs(r) + lim["upstream_factor"] * prop
    excess = np.where(np.isfinite(d), d / tol, np.inf)
    m["upstream_allclose_ratio"] = float(excess.max()) if excess.size else 0.0
    bad = np.flatnonzero(~(excess <= 1.0))
    m["first_divergence"] = None
    if bad.size:
        i = int(bad[0])
        m["first_divergence"] = {"index": [int(v) for v in np.unravel_index(i, r.shape)], "reference": float(r.flat[i]),
                                 "candidate": float(c.flat[i]) if np.isfinite(c.flat[i]) else str(c.flat[i])}
    return lim


def noise_row_limits(lim: dict, r: np.ndarray, h: np.ndarray, precision: str, m: dict) -> dict:
    """The limits of a row (or an e2e step) whose reference is `r`, from HF's own output `h` at
    this precision on the same inputs; records HF's error and the candidate's ratio to it in `m`."""
    if h.shape != r.shape:
        return lim
    nm = tensor_metrics(r, h, lim["atol"], lim["rtol"])
    stored = tensor_metrics(r, rounding(r, precision), lim["atol"], lim["rtol"])
    m["noise_max_abs"], m["noise_rel_l2"] = nm["max_abs"], nm["rel_l2"]
    if "max_abs" in m:  # the candidate's error as a multiple of the precision's own
        m["vs_noise"] = m["max_abs"] / nm["max_abs"] if nm["max_abs"] > 0 else (0.0 if m["max_abs"] == 0 else math.inf)
    return thresholds.noise_limits(lim, nm, stored)


def _step_logits(raw, k: int, ref_rows: int, vocab: int) -> np.ndarray:
    """A candidate's logits for e2e step k as [rows, V]: prefill [T or 1, V], decode [V]."""
    out = as_array(raw)
    if out.ndim == 0 or out.shape[-1] != vocab:
        raise OutputError(f"logits shape {_shape(out)}: the last dimension must be the vocabulary ({vocab})")
    out = out.reshape(-1, vocab)
    allowed = (ref_rows, 1) if k == 0 else (1,)
    if out.shape[0] not in allowed:
        what = f"{ref_rows} (every prompt token) or 1 (the last)" if k == 0 else "1"
        raise OutputError(f"logits shape {_shape(out)}: {out.shape[0]} row(s), expected {what}")
    return out


def routing_tie_positions(ref, spec, noise=None) -> list[int]:
    """Positions of the reference's sequence where some layer's router is a near tie at this
    precision (k-th vs (k+1)-th selection score closer than tie_gaps)."""
    n = len(ref.tokens) - 1  # the sequence's calls: the prompt, then each fed-back token
    tie = np.zeros(n, dtype=bool)
    for layer in ref.router_probs:
        near = router_near_ties(ref, layer, spec, n, noise, in_model=True)
        tie[: near.shape[0]] |= near
    return [int(i) for i in np.flatnonzero(tie)]


def run_e2e(ref, cand, spec, reduction: int = 0, collect: list | None = None, noise=None) -> E2E:
    """The candidate's prefill and decode steps, fed the reference's tokens. `collect` (a list)
    receives (step, reference rows, candidate rows) for each step the candidate answered.
    `noise` (oracle/noise.py, reduced precisions): each step is judged against HF's own logits
    error at this precision on that step, and a token flip is a tie within that error."""
    lim = thresholds.at_width(thresholds.limits(spec.precision, "e2e", spec.family, spec.backend), reduction)
    P = ref.prompt_len
    noisy = noise is not None and "noise_factor" in lim and len(noise.logits) == len(ref.logits)
    # A step that attends to a position whose expert choice is a near tie (in any layer) may
    # see that token routed to other experts by the candidate's own rounding: its logits and
    # token are then judged `routing-tie` (reported, as token ties are), never for NaN/Inf.
    # Measured noise (reduced precisions): only a step judged at such a position (a flipped
    # choice shows at its own position), see excuse_routing_ties
    routing_ties = routing_tie_positions(ref, spec, noise)
    first_routing_tie = routing_ties[0] if routing_ties and not noisy else None
    step_noise, noise_median = last_row_noise(ref, noise) if noisy else (None, None)
    steps, cand_tokens, ties, first, dtypes, error = [], [], [], None, set(), None
    ref_rows, cand_rows = [], []  # every position's logits, for the distribution metrics
    for k in range(len(ref.logits)):
        r_all = ref.logits[k]
        vocab = r_all.shape[-1]
        try:
            if k == 0:
                raw = cand.prefill(ref.tokens[:P])
            else:
                raw = cand.decode(ref.tokens[P + k - 1], P + k - 1)
        except Exception as e:  # the candidate raised: the state is unknown, later steps are not run
            error = f"step {k} ({'prefill' if k == 0 else 'decode'}): {type(e).__name__}: {e}"
            break
        ref_tok, margin = int(r_all[-1].argmax()), top2_margin(r_all[-1])
        try:
            out = _step_logits(raw, k, r_all.shape[0], vocab)
        except OutputError as e:
            cand_tokens.append(-1)
            steps.append({"step": k, "max_abs": None, "rel_l2": None, "nonfinite": 0, "ratio": float("inf"),
                          "logits_status": "fail", "invalid_output": str(e), "reference_margin": margin,
                          "reference_token": ref_tok, "candidate_token": -1, "token": "mismatch",
                          "first_divergence": None})
            if first is None:
                first = {"step": k, "position": P + k - 1 if k else P - 1, "reference_token": ref_tok,
                         "candidate_token": -1, "reference_margin": margin, "tie": False}
            continue
        r = r_all[-out.shape[0]:]
        dtypes.add(dtype_name(raw))
        ref_rows.append(as_f64(r).reshape(-1, vocab))
        cand_rows.append(out)
        if collect is not None:
            collect.append((k, ref_rows[-1], out))
        m = tensor_metrics(r, out, lim["atol"], lim["rtol"])
        tie_margin = lim["tie_margin"]
        if noisy:
            h = noise.logits[k].reshape(-1, vocab)[-out.shape[0]:].astype(np.float64)
            step_lim = noise_row_limits(lim, as_f64(r).reshape(h.shape), h, spec.precision, m)
            status, ratio = thresholds.judge_noise(m, noise_step_floor(step_lim, noise_median))
            tie_margin = lim["tie_factor"] * step_noise[k]["max_abs"]
        else:
            status, ratio = thresholds.judge_tensor(m, lim)
        position = P + k - 1 if k else P - 1
        routed_tie = first_routing_tie is not None and first_routing_tie <= position and not m["nonfinite"]
        if status == "fail" and routed_tie and "shape_mismatch" not in m:
            status = "routing-tie"
        cand_tok = int(np.nanargmax(out[-1])) if np.isfinite(out[-1]).any() else -1
        cand_tokens.append(cand_tok)
        token_status = "match"
        if cand_tok != ref_tok:
            token_status = "tie" if margin < tie_margin else "routing-tie" if routed_tie else "mismatch"
            if token_status == "tie":
                ties.append(k)
            if first is None:
                first = {"step": k, "position": position, "reference_token": ref_tok,
                         "candidate_token": cand_tok, "reference_margin": margin, "tie": token_status == "tie",
                         "routing_tie": token_status == "routing-tie"}
        steps.append({"step": k, "max_abs": m.get("max_abs"), "rel_l2": m.get("rel_l2"),
                      "nonfinite": m["nonfinite"], "ratio": ratio, "logits_status": status,
                      "reference_margin": margin, "reference_token": ref_tok,
                      "candidate_token": cand_tok, "token": token_status,
                      "first_divergence": m.get("first_divergence"),
                      **({k2: m[k2] for k2 in ("noise_max_abs", "vs_noise") if k2 in m})})
    if noisy:
        excuse_routing_ties(steps, routing_ties, P, first)
    complete = error is None and len(steps) == len(ref.logits)
    exact = complete and all(s["token"] == "match" for s in steps)
    ok = complete and all(s["logits_status"] in ("pass", "routing-tie") and s["token"] != "mismatch" for s in steps)
    distribution = None
    if "kl_mean" in lim and cand_rows:  # quantized precisions: judged by the logits' distribution, tokens reported
        distribution = distribution_metrics(np.concatenate(ref_rows), np.concatenate(cand_rows),
                                            lim.get("tie_margin", 0.0))
        distribution["status"], distribution["ratio"] = judge_distribution(distribution, lim)
        ok = distribution["status"] == "pass" and complete and not any("invalid_output" in s for s in steps)
    status = "error" if error else "pass" if ok else "fail"
    e2e = E2E(status, ref.tokens[:P], ref.tokens[P:], cand_tokens, exact, steps, lim,
              first, ties, distribution, error=error, routing_ties=routing_ties)
    want, got = expected_dtype(spec), sorted(d for d in dtypes if d)
    gate = None
    if want and got:
        gate = GateRow("logits_dtype", "pass" if got == [want] else "fail", ", ".join(got), want,
                       "the logits keep the model's declared dtype (no unconditional cast)")
    return e2e, gate


def last_row_noise(ref, noise) -> tuple[list[dict], dict]:
    """HF's error at this precision on each e2e step's last row (the row that decides the token:
    its max_abs sets the step's tie margin), and the median over the steps (one step's error is
    one sample, and a step where HF happened to round well would otherwise hold another correct
    implementation to a tighter limit than the rest)."""
    errs = [tensor_metrics(r.reshape(-1, r.shape[-1])[-1:], h.reshape(-1, h.shape[-1])[-1:], 1.0, 0.0)
            for r, h in zip(ref.logits, noise.logits)]
    return errs, {"max_abs": float(np.median([e["max_abs"] for e in errs])),
                  "rel_l2": float(np.median([e["rel_l2"] for e in errs]))}


def noise_step_floor(lim: dict, median: dict) -> dict:
    """An e2e step's noise limits, at least noise_factor x HF's median step error."""
    f = lim["noise_factor"]
    return {**lim, "max_abs": max(lim["max_abs"], f * median["max_abs"]),
            "rel_l2": max(lim["rel_l2"], f * median["rel_l2"])}


def excuse_routing_ties(steps: list[dict], tie_positions: list[int], P: int, first: dict | None) -> None:
    """Measured noise: a failing step is `routing-tie` (reported, not failed) only when the
    position it is judged at is itself a near tie inside HF's own run at this precision (the
    prefill: any prompt position), never for NaN/Inf or an unreadable output. A flipped expert
    choice shows at its own position; no step is excused for an earlier one, so a decode-path
    defect fails at every decode step whose own routing is not a near tie. (What a flip at an
    earlier position does to later steps through attention would need the reference with that
    choice flipped: not measured, so not excused; nor is a weight decided by a near tie, such as
    sparsemixer's masks, which the block rows judge.)"""
    ties = set(tie_positions)
    for s in steps:
        if s["logits_status"] != "fail" and s["token"] != "mismatch":
            continue
        if s["nonfinite"] or "invalid_output" in s:
            continue
        held = range(P) if s["step"] == 0 else [P + s["step"] - 1]
        if not ties.intersection(held):
            continue
        if s["logits_status"] == "fail":
            s["logits_status"] = "routing-tie"
        if s["token"] == "mismatch":
            s["token"] = "routing-tie"
            if first is not None and first["step"] == s["step"]:
                first["routing_tie"] = True


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


def saved_reference(spec: CheckSpec) -> dict:
    """provenance.json of --reference DIR, checked against the spec (family, lengths, seed)."""
    from oracle.reference import read_portable

    try:
        meta = read_portable(Path(spec.reference))
    except ValueError as e:
        raise InputError(str(e)) from None
    for name in ("family", "prompt_len", "decode_tokens", "seed"):
        if meta.get(name) != getattr(spec, name):
            raise InputError(f"--reference {spec.reference} was captured with {name.replace('_', '-')} "
                             f"{meta.get(name)!r}, this check has {getattr(spec, name)!r}")
    return meta


def reference_of(spec: CheckSpec, src: ModelSource, prompt: list[int]):
    """The HF reference for this checkpoint: --reference DIR when it was captured from this
    checkpoint (same sha256), else captured here (or from the cache)."""
    if spec.reference is not None and saved_reference(spec)["checkpoint_sha256"] == src.checkpoint_sha256:
        from oracle.reference import load_portable

        try:
            ref = load_portable(Path(spec.reference))
        except ValueError as e:
            raise InputError(str(e)) from None
        if ref.tokens[: ref.prompt_len] != list(prompt):
            raise InputError(f"--reference {spec.reference}: its prompt tokens are not this check's")
        return ref
    try:
        return reference_for(spec.family, str(src.model_dir), src.checkpoint_sha256, tuple(prompt),
                             spec.decode_tokens)
    except CheckpointError as e:
        raise InputError(f"the HF reference cannot load {src.model_dir}: {e}") from None


def save_reference(spec: CheckSpec, out: str, progress=None) -> list[Path]:
    """`oracle reference save`: capture (or take from the cache) the reference of the spec's
    checkpoint and write it as a portable directory."""
    from oracle.reference import save_portable

    progress = progress or (lambda *a: None)
    src = model_source(spec, lambda msg: progress(f"checkpoint: {msg}"))
    prompt = prompt_tokens(spec, src.args.vocab_size)
    progress("reference")
    ref = reference_of(replace(spec, reference=None), src, prompt)
    return save_portable(ref, Path(out), {
        "family": spec.family, "checkpoint_sha256": src.checkpoint_sha256, "checkpoint": str(src.model_dir),
        "config": src.config, "prompt_len": spec.prompt_len, "decode_tokens": spec.decode_tokens,
        "seed": spec.seed, "prompt": prompt, "tokens": ref.tokens,
        "versions": provenance(spec)["versions"], "python": platform.python_version(),
        "host": platform.node()})


def block_rows(ref, cand, spec: CheckSpec, args, progress, noise=None,
               src: ModelSource | None = None) -> list[BlockRow]:
    """Every block row of the candidate against the reference. A block that raises is that
    row's error; RuntimeError when every block raised. With `src` (the checkpoint), in-situ rows at
    a precision with an in_situ rule are judged against HF fp32 run on the candidate's own upstream
    (oracle/insitu.py)."""
    keys = ref.block_keys()
    routes = {}  # layer -> the candidate's routing, from its router row (for the moe row)
    modes = getattr(cand, "block_modes", {})
    rows, errors, outputs = {}, [], {}
    mode_of = {key: modes.get(key[1], getattr(cand, "block_mode", "isolated")) for key in keys}
    for n, key in enumerate(keys):
        progress("blocks", n, len(keys))
        mode = mode_of[key]
        try:
            outs = cand.run_block(key[0], key[1], ref.inputs[key])
        except Exception as e:  # this block crashed: its row is an error, the others are still measured
            lim = thresholds.limits(spec.precision, key[1], spec.family, spec.backend)
            detail = args.layer_types[key[0]] if key[1] == "attention" else ""
            reason = f"{type(e).__name__}: {e}"
            errors.append(f"{key[0]} {key[1]}: {reason}")
            rows[key] = invalid_row(key, mode, lim, detail, reason, "error")
            continue
        if outs is None:
            rows[key] = BlockRow(key[0], key[1], "n/a", mode, {}, {}, 0.0, "not isolated by backend")
            continue
        outputs[key] = outs
    in_situ = {k: o for k, o in outputs.items() if insitu.is_in_situ(mode_of[k])}
    if in_situ and src is not None and thresholds.in_situ(spec.precision):
        progress("blocks: HF fp32 on the candidate's own upstream (in-situ rows)")
    upstream, why = in_situ_upstream(ref, spec, src, in_situ)
    for key, outs in outputs.items():
        row = compare_block(ref, key, outs, spec, args.layer_types, routes, reduction_length(args), noise,
                            upstream.get(key))
        if why and insitu.is_in_situ(mode_of[key]):
            row.metrics["upstream"] = why
        row.mode = mode_of[key]
        rows[key] = row
    if errors and len(errors) == len(keys):
        raise RuntimeError(f"every block raised; the first: {errors[0]}")
    return [rows[key] for key in keys]


def in_situ_upstream(ref, spec: CheckSpec, src: ModelSource | None, outputs: dict) -> tuple[dict, str | None]:
    """(key -> HF fp32's outputs on the candidate's own upstream, or {}; why it was not measured,
    or None) for the candidate's in-situ rows, at a precision with an in_situ rule."""
    if not outputs or src is None or thresholds.in_situ(spec.precision) is None:
        return {}, None
    try:
        arrays = {}
        for key, outs in outputs.items():
            if key[1] != "router":
                try:
                    arrays[key] = candidate_arrays(key[1], outs, ref.outputs[key])
                except OutputError:
                    continue  # that row fails on its own; the layers after it are fed HF's stream
        return insitu.propagated(ref, src, spec, list(outputs), arrays), None
    except Exception as e:  # judged by the isolated table, and the row says why
        return {}, f"not measured ({type(e).__name__}: {e}): the isolated table judges"


def limits_precision(quantization: dict) -> str:
    """The quantized precision whose limits judge the quantization error: q4 where any module
    has 4 bits or fewer, else q8."""
    return "q4" if min(quantization.get("bits") or [8]) <= 4 else "q8"


def quantization_rows(spec: CheckSpec, srcs: Sources, prompt: list[int], progress) -> dict:
    """The quantization error: HF on the original weights (the reference) against HF on the
    shipped weights dequantized (the candidate, transformers itself), block by block and end to
    end. Judged end to end, by the logits' distribution at the quantized precision's limits (KL,
    delta-p, same top-1: what quantization is judged by); the block rows are the scheme's own loss
    per block, each measured against the precision's fixed table and reported (`over_table`), not
    judged: with outlier features a correct group quantization exceeds a table fitted on
    normal-law weights (docs/noise.md). Of a directory the backend built for --precision q8/q4
    (`srcs.built`) nothing is judged: its loss is the chosen bits and group size on these weights,
    not the backend's doing (status `reported`)."""
    precision = limits_precision(srcs.quantization or {})
    qspec = replace(spec, precision=precision, candidate_dir=None)
    ref = reference_of(spec, srcs.original, prompt)
    out = {"precision": precision, "reference": "HF transformers fp32, original weights",
           "candidate": "HF transformers fp32, the shipped weights dequantized"}
    try:
        hf = resolve("hf").load(srcs.src, replace(qspec, precision="fp32"))
        rows = block_rows(ref, hf, qspec, srcs.original.args, lambda *a: progress("quantization", *a[1:]))
        e2e, _ = run_e2e(ref, hf, qspec, reduction_length(srcs.original.args))
    except Exception as e:
        return {**out, "status": "error", "error": f"{type(e).__name__}: {e}"}
    w = worst_row(rows)
    status = "reported" if srcs.built else "fail" if e2e.status in ("fail", "error") else "pass"
    return {**out, "status": status, "blocks": [asdict(r) for r in rows],
            "e2e": asdict(e2e), "over_table": asdict(w) if w else None}


def artifact_matches(spec: CheckSpec, src: ModelSource) -> None:
    """A program brought with --pte / --vmfb and the manifest.json `oracle export` wrote beside
    it: built from this checkpoint, for this check's sequence length (its state buffers and
    static shapes are sized by it). Without a manifest nothing can be said before it runs."""
    path = Path(spec.artifact).with_name("manifest.json")
    try:
        man = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    flag = f"--{Path(spec.artifact).suffix[1:]} {spec.artifact}"
    if not isinstance(man, dict):
        raise InputError(f"{flag}: {path} is not an export manifest (not a JSON object)")
    fam = man.get("family")
    if fam and fam != spec.family:
        raise InputError(f"{flag} was exported for family {fam!r} ({path}), not {spec.family!r}: "
                         "a program of another model")
    sha = man.get("checkpoint_sha256")
    if sha and sha != src.checkpoint_sha256:
        raise InputError(f"{flag} was exported from checkpoint sha256 {str(sha)[:16]}... ({path}), "
                         f"not this check's ({src.checkpoint_sha256[:16]}...)")
    opts = man.get("options") if isinstance(man.get("options"), dict) else {}
    inner = opts.get("options") if isinstance(opts.get("options"), dict) else {}
    lengths = [opts.get("prompt_len", 0), opts.get("decode_tokens", 0)]
    built = inner.get("max_seq_len") or (sum(lengths) if all(isinstance(n, int) for n in lengths) else 0)
    want = spec.prompt_len + spec.decode_tokens
    if not isinstance(built, int):
        raise InputError(f"{flag}: {path} has max_seq_len {built!r:.40}, not a number of tokens")
    if built and built != want:
        raise InputError(f"{flag} was exported for a sequence of {built} tokens ({path}); this check needs "
                         f"{want} (--prompt-len {spec.prompt_len} + --decode-tokens {spec.decode_tokens}): check with "
                         f"lengths that add up to {built}, or export with --max-seq-len {want}")


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
    if backend is None:
        backend = validate(spec)
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

    if srcs.built:  # the candidate loads the directory at fp32 activations, judged at the fp32 limits
        spec = replace(spec, candidate_dir=srcs.shipped, precision="fp32",
                       options={k: v for k, v in spec.options.items() if k not in quantizing_options(backend, spec.options)})
    elif srcs.shipped is not None and getattr(backend, "loads_directory", False):
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
        check_given = getattr(backend, "check_given", None)  # the program itself (exporters/given.py)
        if check_given is not None:
            check_given(src, spec)
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
            opts = quantizing_options(backend, asked.options)
            result.quantization["built"] = (f"--precision {asked.precision}: the directory `{spec.backend}` exports "
                                            f"({', '.join(f'{k}={v}' for k, v in opts.items()) or 'default options'}), "
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
        cand = backend.load(src, spec)
        timings["load_s"] = time.perf_counter() - t
        info = dict(getattr(cand, "info", {}) or {})
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
        result.e2e, dtype_gate = run_e2e(ref, cand, spec, reduction_length(src.args), rows, noise)
        if dtype_gate:
            result.gates.append(dtype_gate)
        timings["e2e_s"] = time.perf_counter() - t
        if prompts:
            stage = "prompts"
            t = time.perf_counter()
            result.prompts = prompt_set(ref, result.e2e, rows, spec, src, cand, prompts, progress)
            timings["prompts_s"] = time.perf_counter() - t
        stage = "gates"
        gates = getattr(cand, "gates", None)
        if gates is not None:
            result.gates += _contained(result, "backend_gates", lambda: list(gates())) or []
        sampling = spec.options.get("sampling")
        if sampling is not None:
            stage = "sampling"
            progress("sampling")
            t = time.perf_counter()
            result.gates += _contained(result, "sampling", lambda: sampling_gates(
                ref, cand, float(sampling["temperature"]), float(sampling["top_p"]), spec.seed,
                thresholds.limits(spec.precision, "e2e")["tie_margin"])) or []
            timings["sampling_s"] = time.perf_counter() - t
        structures = getattr(cand, "structures", None)
        if structures is not None:
            result.structures = dict(_contained(result, "structures", structures) or {})
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


def reference_margins(ref) -> dict:
    """How far the reference is from ties: token top-2 logit margins, router k-th vs (k+1)-th gap."""
    P = ref.prompt_len
    margins = [top2_margin(lg[-1]) for lg in ref.logits]
    gaps = [float(router_gaps(ref, layer).min()) for layer in ref.router_probs]
    return {"min_token_margin": min(margins), "token_margins": margins,
            "min_router_gap": min(gaps) if gaps else None, "prompt_len": P,
            "expert_coverage": {str(k): v for k, v in ref.coverage.items()}}


__all__ = ["run_check", "CheckSpec", "InputError", "GateRow"]
