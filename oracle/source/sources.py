"""Where a check's inputs come from: the checkpoint (--model-dir, a published --config, or the
tiny one; validated once and its ModelArgs cached by identity), a shipped directory or the one a
backend writes for q8/q4 (dequantized into an HF checkpoint), and the prompt tokens (seeded ids or
real text through the checkpoint's own tokenizer)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass, replace
from pathlib import Path

from models import UNSUPPORTED, code_digest, family_for_model_type, get_family
from models.family import text_config
from models.args import ModelArgs
from oracle.source.quantized import dequantized_checkpoint, quantization_of
from models.checkpoint import CheckpointError, meta_weights, read_config
from oracle.source.identity import cached_identity, checkpoint_identity
from oracle.source.seeded import config_checkpoint, tiny_checkpoint
from oracle.source.published import published_config
from oracle.verdict import thresholds
from oracle.reports.provenance import PACKAGES
from oracle.backend import CheckSpec, InputError, ModelSource, implementation




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
    from oracle.cache.artifacts import versions

    return {"family": family.name, "sha": sha, "max_len": max_len, "code": code_digest(), **versions("transformers")}


def validated_args(family, sha: str | None, max_len: int):
    """(ModelArgs, sha) of a checkpoint this code already validated (its identity unchanged:
    same files, sizes, mtimes), from the cache: no transformers config class, no model skeleton.
    None when not cached."""
    from oracle.cache.artifacts import json_get

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
    from oracle.cache.artifacts import json_put

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
    quantization: dict | None = None  # the shipped directory's quantization (oracle.source.quantized.summary)
    built: bool = False  # the shipped directory is the one the backend wrote for --precision q8/q4


QUANT_REFERENCES = ("dequantized", "original")


def builds_quantized(spec: CheckSpec, backend) -> bool:
    """Whether a quantized precision is checked on the directory the backend writes (the
    implementation/quantization split of a shipped directory): q8/q4 on a backend that exports
    and loads directories, no directory or program given, --quant-reference dequantized."""
    return (spec.quant_reference == "dequantized" and thresholds.quantized(spec.precision)
            and spec.candidate_dir is None and spec.artifact is None and shipped_dir(spec) is None
            and backend.loads_directory and backend.export is not None)


def quantizing_options(backend, options: dict) -> dict:
    """The options that shape the quantized weights (the schema's `quantizes`), spent on the
    directory the backend writes."""
    schema = {o.name: o for o in backend.option_schema}
    return {k: v for k, v in options.items() if k in schema and schema[k].quantizes}


def quantized_directory(backend, src: ModelSource, spec: CheckSpec, progress) -> str:
    """The directory the backend's `export` writes for spec's q8/q4 and quantizing options,
    cached by content (checkpoint, precision, options, the backend's code, tool versions)."""
    import inspect

    from oracle.cache.artifacts import cached_artifact, sha256_file, versions

    opts = quantizing_options(backend, spec.options)
    code = sha256_file(Path(inspect.getsourcefile(implementation(backend))))
    parts = {"checkpoint": src.checkpoint_sha256, "precision": spec.precision, "options": opts, "code": code,
             **versions(*PACKAGES)}
    progress(f"writing the {spec.precision} directory ({spec.backend} export)")
    art = cached_artifact("quantized", parts, "config.json",
                          lambda path: backend.export(src, replace(spec, options=opts), path.parent),
                          name=f"{spec.family}.{spec.precision}")
    return str(Path(art.path).parent)


def sources(spec: CheckSpec, progress=None, backend=None) -> Sources:
    if spec.artifact is not None and backend is not None and backend.artifact_weights is not None:
        return artifact_sources(spec, backend, progress)
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


def artifact_sources(spec: CheckSpec, backend, progress) -> Sources:
    """A given artifact with weights of its own (a GGUF): HF's checkpoint of those weights (the
    backend's `artifact_weights`: dequantized, checked against the original's architecture) is the
    implementation's reference; the original checkpoint the quantization's."""
    original = model_source(spec, progress)
    try:
        deq, summary = backend.artifact_weights(original, Path(spec.artifact), progress or (lambda msg: None))
        src = source_of(original.family, deq, spec)
    except CheckpointError as e:
        raise InputError(f"{spec.artifact}: its weights do not fit the original: {e}") from None
    return Sources(src, spec.artifact, original, summary)


def first_difference(a, b, group: str = "") -> str | None:
    """The first ModelArgs field (bar the sequence length; within a group, the group's field:
    "router.n_group") where two checkpoints differ, as text."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name == "max_seq_len" or x == y:
            continue
        if is_dataclass(x) and type(x) is type(y):
            return first_difference(x, y, f"{group}{f.name}.")
        return f"{group}{f.name}: {x!r} (original) vs {y!r} (candidate)"
    return None


def require_family(family, config: dict, where: str) -> None:
    mt = config["model_type"]
    if mt not in family.model_types:
        other = family_for_model_type(mt)
        hint = f" (that is family {other!r})" if other else (
            f" (not supported yet: missing {UNSUPPORTED[mt]})" if mt in UNSUPPORTED else "")
        raise InputError(f"{where} has model_type {mt!r}, not a {family.name} checkpoint{hint}")


def check_length(config: dict, max_len: int, what: str) -> None:
    """InputError when a sequence of max_len tokens (`what`) does not fit the model's positions."""
    limit = text_config(config).get("max_position_embeddings")
    if isinstance(limit, int) and not isinstance(limit, bool) and 0 < limit < max_len:  # (other values: its rule says)
        raise InputError(f"{what} exceeds max_position_embeddings {limit}")


def prompt_tokens(spec: CheckSpec, vocab: int) -> list[int]:
    """prompt_len token ids drawn by torch from `seed` (cached: a warm check imports no torch)."""
    from oracle.cache.artifacts import cached_json, versions

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
