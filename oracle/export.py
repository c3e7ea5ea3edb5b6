"""`oracle export`: a backend's artifacts for one family, plus manifest.json."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from oracle.cache.store import CacheFull
from oracle.cache.artifacts import write_manifest
from oracle.backend import CheckSpec, InputError, MemoryRefusal, memory_refusal
from oracle.source.sources import model_source
from oracle.source.validation import validate


def run_export(spec: CheckSpec, output_dir: str) -> Path:
    try:
        return _run_export(spec, output_dir)
    except CacheFull as e:  # a checkpoint or artifact the cache cannot hold: refused with the sizes
        raise InputError(str(e)) from None


def _run_export(spec: CheckSpec, output_dir: str) -> Path:
    backend = validate(spec, "export")
    if backend.export is None:
        raise InputError(f"backend {spec.backend} has no exporter (nothing to write)")
    ok, reason = backend.availability()
    if not ok:
        raise InputError(f"backend {spec.backend} is unavailable here: {reason}")
    src = model_source(spec)
    refusal = memory_refusal(backend, src, spec)
    if refusal:
        raise MemoryRefusal(refusal)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = backend.export(src, spec, out)
    options = {k: v for k, v in asdict(spec).items()  # (the normal weight profile: as before the profiles)
               if k not in ("family", "model_dir") and not (k == "weights" and v == "normal")}
    return write_manifest(out, spec.family, src.config, options, files,
                          extra={"checkpoint_sha256": src.checkpoint_sha256, "backend": spec.backend})
