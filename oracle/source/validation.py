"""Everything about a check's spec that can be refused before any work (exit 2): the family, the
backend and its options, the precision, lengths, the inputs given (a program, a saved reference, a
shipped directory), and a given program's manifest against this check."""

from __future__ import annotations

import json
from pathlib import Path

from models import FAMILY_NAMES, UNSUPPORTED, family_for_model_type
from models.family import text_config
from models.checkpoint import CheckpointError, read_config
from oracle.source.published import published_config
from oracle.source.trained import PROFILES
from oracle.verdict import thresholds
from oracle.backend import CheckSpec, InputError, ModelSource, resolve, validate_options
from oracle.reference.cached import saved_reference
from oracle.source.sources import QUANT_REFERENCES, shipped_dir


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
    if backend.precisions is not None and spec.precision not in backend.precisions:
        raise InputError(f"backend {spec.backend} does not support precision {spec.precision} "
                         f"(supports {', '.join(backend.precisions)})")
    if spec.quant_reference not in QUANT_REFERENCES:
        raise InputError(f"--quant-reference {spec.quant_reference}: allowed values are {', '.join(QUANT_REFERENCES)}")
    if spec.quant_reference != "dequantized" and not thresholds.quantized(spec.precision):
        raise InputError(f"--quant-reference applies to the quantized precisions, not {spec.precision}")
    if shipped_dir(spec) is not None:
        if spec.candidate_dir is not None and not backend.loads_directory:
            raise InputError(f"backend {spec.backend} cannot load a prebuilt directory (--candidate-dir): "
                             "it builds its candidate from the checkpoint")
        if spec.precision not in ("fp32", "bf16"):
            raise InputError(f"--precision {spec.precision}: a shipped quantized directory's quantization is its "
                             "own (read from its config.json); --precision is then the activation dtype, fp32 or bf16")
    if spec.reference is not None:
        saved_reference(spec)
    if spec.artifact is not None:
        suffix = backend.artifact_suffix
        if suffix is None:
            raise InputError(f"backend {spec.backend} runs no prebuilt program (--pte / --vmfb / --gguf)")
        if not spec.artifact.endswith(suffix):
            raise InputError(f"backend {spec.backend} runs a {suffix} program (--{suffix[1:]}), not {spec.artifact}")
        if not Path(spec.artifact).is_file():
            raise InputError(f"--{suffix[1:]} {spec.artifact}: no such file")
    spec.options.update(validate_options(backend, spec.options, command))
    problem = backend.check_options(spec)
    if problem:
        raise InputError(f"backend {spec.backend}: {problem}")
    return backend


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


def artifact_matches(spec: CheckSpec, src: ModelSource, sized: bool = True) -> None:
    """A program brought with --pte / --vmfb / --gguf and the manifest.json `oracle export` wrote beside
    it: built from this checkpoint, for this check's sequence length (its state buffers and
    static shapes are sized by it; `sized` False: a file whose runtime sizes its own state, a GGUF).
    Without a manifest nothing can be said before it runs."""
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
    if not sized:
        return
    if not isinstance(built, int):
        raise InputError(f"{flag}: {path} has max_seq_len {built!r:.40}, not a number of tokens")
    if built and built != want:
        raise InputError(f"{flag} was exported for a sequence of {built} tokens ({path}); this check needs "
                         f"{want} (--prompt-len {spec.prompt_len} + --decode-tokens {spec.decode_tokens}): check with "
                         f"lengths that add up to {built}, or export with --max-seq-len {want}")
