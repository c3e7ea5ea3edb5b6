"""A check's reference: HF transformers fp32 captured once per checkpoint and prompt (cached in
process and on disk, keyed by the capture code), or a reference saved by `oracle reference save`
(portable, checked against the checkpoint it claims)."""

from __future__ import annotations

import functools
import hashlib
import platform
from dataclasses import replace
from pathlib import Path

from models import family_source, get_family
from models.checkpoint import CheckpointError
from oracle.backend import CheckSpec, InputError, ModelSource
from oracle.cache.store import cache_root
from oracle.reference.run import capture
from oracle.reference.streaming import load_hf_model, reference_mode
from oracle.reports.provenance import provenance
from oracle.source.sources import model_source, prompt_tokens


@functools.lru_cache(maxsize=4)
def reference_for(family_name: str, model_dir: str, sha: str, prompt: tuple, n: int):
    """The HF reference for this checkpoint and prompt: in memory, else from the disk cache
    (keyed by the checkpoint's sha256, prompt, steps, and the code and versions that capture
    it), else captured and saved."""
    from oracle.cache import store as cache
    from oracle.cache.artifacts import key_of, versions
    from oracle.reference.run import capture_code, first_nonfinite
    from oracle.reference.saved import load, save

    code = hashlib.sha256(capture_code()).hexdigest()
    # ... and the family's own code: the HF block map it reads the reference by (hf_attention, hf_router, a
    # router_output, a text tower) lives in its file: a changed family file is another reference
    family_code = hashlib.sha256(family_source(family_name)).hexdigest()
    key = key_of({"family": family_name, "sha": sha, "prompt": list(prompt), "n": n, "code": code,
                  "family_code": family_code, **versions("torch", "transformers", "safetensors")})
    path = cache_root() / "references" / key
    cache.hold(path)
    ref = load(path)
    if ref is None:
        family = get_family(family_name)
        streamed = reference_mode(Path(model_dir)) == "streamed"
        ref = capture(load_hf_model(family, Path(model_dir), streamed=streamed), family, list(prompt), n)
        bad = first_nonfinite(ref)
        if bad:
            raise InputError(f"the HF fp32 reference itself produces NaN/Inf, first at {bad}: the checkpoint "
                             f"{model_dir} (weights or config) is bad; no backend can be judged against it")
        save(ref, path)
        cache.enforce_quietly(path)
    cache.mark_used(path)
    return ref


def saved_reference(spec: CheckSpec) -> dict:
    """provenance.json of --reference DIR, checked against the spec (family, lengths, seed)."""
    from oracle.reference.saved import read_portable

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
        from oracle.reference.saved import load_portable

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
    from oracle.reference.saved import save_portable

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
