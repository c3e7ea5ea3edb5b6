"""Quantized checkpoints as shipped: mlx-lm's affine format, read and dequantized by the format's
own definition (independently of any runtime), and written back as an HF checkpoint.

mlx-lm's format (`mlx_lm.convert -q`, `mlx_lm.utils.save_model`): config.json carries
`quantization: {group_size, bits, mode, "<module path>": {group_size, bits} | false, ...}`; a
quantized module `P` has `P.weight` (uint32 words, `32 / bits` values each, packed from the
lowest bit up, a row's values as one little-endian bit stream), `P.scales` and `P.biases`
(one per group of `group_size` values along the input dimension). The weight is

    w[..., g * group_size + j] = scales[..., g] * q[..., g * group_size + j] + biases[..., g]

Names are mlx-lm's (after its `sanitize()`: experts stacked as `switch_mlp.*`); the family's
`from_mlx` maps them back to an HF checkpoint's names and layouts.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from models.checkpoint import LAYER, CheckpointError, layer_groups, read_config, read_tensors, tensor_index
from oracle.cache.files import cached_dir
from oracle.source.identity import checkpoint_identity

if TYPE_CHECKING:
    import torch

FORMAT = 1  # bump when the dequantized checkpoint's recipe changes (invalidates the cache)
QUANT_KEYS = ("quantization", "quantization_config")
MODES = ("affine",)  # mlx's other modes (mxfp4, nvfp4, mxfp8) have no scale-and-bias definition
BITS = (2, 3, 4, 5, 6, 8)


def quantization_of(config: dict) -> dict | None:
    """The `quantization` entry of a config.json (mlx-lm writes it twice, under both keys), or
    None for an unquantized checkpoint. A torchao/GPTQ-style `quantization_config` (a
    `quant_method`) is not this format: refused with its name."""
    q = config.get("quantization", config.get("quantization_config"))
    if q is None:
        return None
    if not isinstance(q, dict) or "quant_method" in q:
        method = q.get("quant_method") if isinstance(q, dict) else q
        raise CheckpointError(f"quantization {method!r} is not mlx-lm's affine format (the one format read "
                              "so far: config.json quantization: {group_size, bits, mode})")
    for key in ("group_size", "bits"):
        if not isinstance(q.get(key), int):
            raise CheckpointError(f"config.json quantization has no integer {key!r}: {q}")
    if q.get("mode", "affine") not in MODES:
        raise CheckpointError(f"quantization mode {q['mode']!r} is not supported yet (only affine: "
                              "w = scale * q + bias per group)")
    return q


def module_quantization(q: dict, path: str) -> dict | None:
    """{bits, group_size} of the module at `path` (its per-module override, else the defaults),
    or None where the recipe leaves it unquantized (an override of false)."""
    own = q.get(path)
    if own is False:
        return None
    own = own if isinstance(own, dict) else {}
    out = {"bits": own.get("bits", q["bits"]), "group_size": own.get("group_size", q["group_size"])}
    if out["bits"] not in BITS:
        raise CheckpointError(f"{path}: {out['bits']}-bit quantization is not in mlx's affine format ({BITS})")
    return out


def summary(q: dict, modules: dict) -> dict:
    """What the check reports and judges by: the widest and narrowest bits used, and per
    (bits, group_size) how many modules. `modules`: path -> {bits, group_size}."""
    counts: dict = {}
    for m in modules.values():
        key = f"{m['bits']}-bit g{m['group_size']}" + (f" {m['mode']}" if m.get("mode", "affine") != "affine" else "")
        counts[key] = counts.get(key, 0) + 1
    bits = sorted({m["bits"] for m in modules.values()})
    kind = "none" if not bits else f"q{bits[0]}" if len(bits) == 1 else "mixed"
    modes = sorted({m.get("mode", "affine") for m in modules.values()}) or ["affine"]
    return {"format": f"mlx {' + '.join(modes)}" if q else "mlx (unquantized)", "kind": kind, "bits": bits,
            "group_size": q["group_size"] if q else None,
            "modules": dict(sorted(counts.items()))}


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32 words [..., W] -> integer values [..., W * 32 / bits] (int32), lowest bits first."""
    import torch

    w = words.view(torch.int32)
    if 32 % bits == 0:  # whole values per word: shift and mask (an arithmetic shift keeps the low bits)
        shifts = torch.arange(0, 32, bits, dtype=torch.int32)
        return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    if sys.byteorder != "little":
        raise CheckpointError("unpacking 3/5/6-bit values assumes a little-endian host")
    # values cross word boundaries: the row is one little-endian bit stream
    stream = ((w.view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).flatten(-2)
    stream = stream.reshape(*stream.shape[:-1], -1, bits).to(torch.int32)
    return (stream << torch.arange(bits, dtype=torch.int32)).sum(-1, dtype=torch.int32)


def dequantize(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int,
               name: str = "") -> torch.Tensor:
    """fp32 weights [..., in] of one quantized tensor, by the format's definition."""
    import torch

    n_in = words.shape[-1] * 32 // bits
    if words.dtype != torch.uint32 or words.shape[-1] * 32 % bits:
        raise CheckpointError(f"{name}.weight: {words.dtype} {list(words.shape)} is not packed {bits}-bit uint32")
    if scales.shape != biases.shape or scales.shape[:-1] != words.shape[:-1] or scales.shape[-1] * group_size != n_in:
        raise CheckpointError(
            f"{name}: scales {list(scales.shape)} / biases {list(biases.shape)} do not fit weight "
            f"{list(words.shape)} at {bits} bits, group size {group_size} ({n_in} inputs)")
    q = unpack(words, bits).float().reshape(*words.shape[:-1], -1, group_size)
    w = q * scales.float().unsqueeze(-1) + biases.float().unsqueeze(-1)
    return w.reshape(*words.shape[:-1], n_in)


MX_GROUP = 32  # mlx's mxfp4: 32 e2m1 values a uint8 e8m0 scale


def dequantize_mxfp4(words: torch.Tensor, scales: torch.Tensor, name: str = "") -> torch.Tensor:
    """fp32 weights [..., in] of one tensor in mlx's mxfp4 mode: 4-bit e2m1 codes packed as `unpack` reads them
    (eight a uint32 word, lowest bits first), times 2^(scale - 127) per group of 32."""
    import torch

    if words.dtype != torch.uint32 or scales.shape[:-1] != words.shape[:-1] or scales.shape[-1] * MX_GROUP != words.shape[-1] * 8:
        raise CheckpointError(f"{name}: weight {words.dtype} {list(words.shape)} / scales {list(scales.shape)} are not "
                              f"mxfp4 (uint32 words of eight e2m1 values, a uint8 scale per {MX_GROUP})")
    from models.release_formats import E2M1

    codes = unpack(words, 4).reshape(*words.shape[:-1], -1, MX_GROUP)
    w = torch.tensor(E2M1)[codes] * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return w.reshape(*words.shape[:-1], -1)


def read_dequantized(index: dict, q: dict | None, names: list[str]) -> tuple[dict, dict]:
    """(mlx name -> fp32 tensor, path -> {bits, group_size} of each quantized module) for the
    tensors `names` of a directory (`index`: its tensor_index; a module's scales and biases are
    among `names`, as layer_groups keeps them): quantized modules dequantized, the rest upcast."""
    import torch

    raw = read_tensors(index, names)
    out, modules = {}, {}
    for n, t in sorted(raw.items()):
        if n.endswith((".scales", ".biases")):
            continue
        path = n.rsplit(".", 1)[0]
        if n.endswith(".weight") and f"{path}.scales" in raw:
            if q is None:
                raise CheckpointError(f"{path} has scales, but config.json has no quantization entry")
            spec = module_quantization(q, path)
            if spec is None:
                raise CheckpointError(f"{path}: config.json says unquantized, but it has scales")
            scales = raw[f"{path}.scales"]
            if f"{path}.biases" not in raw and scales.dtype == torch.uint8:
                # mlx's mxfp4 mode, as mlx_lm.utils.infer_quant_config reads it (uint8 scales, no biases): a
                # release's MXFP4 experts kept packed by mlx-lm (its own conversion of gpt-oss leaves them so)
                out[n] = dequantize_mxfp4(t, scales, path)
                modules[path] = {"bits": 4, "group_size": MX_GROUP, "mode": "mxfp4"}
                continue
            if f"{path}.biases" not in raw:
                raise CheckpointError(f"{path}: quantized weight without biases (affine needs both)")
            out[n] = dequantize(t, scales, raw[f"{path}.biases"], spec["bits"], spec["group_size"], path)
            modules[path] = spec
        elif t.dtype == torch.uint32:
            raise CheckpointError(f"{n}: packed uint32 weights without {path}.scales")
        else:
            out[n] = t.float() if t.is_floating_point() else t
    return out, modules


def dropped_by_mlx_lm(family) -> tuple[str, ...]:
    """The checkpoint tensors (name endings) the family's mlx-lm model has no parameter for: its
    sanitize() drops them, so a shipped directory cannot carry them (models.mlx_lm.MlxLm.dropped)."""
    return tuple(getattr(family.mlx, "dropped", ()) or ())


def from_original(family, original: Path | None, layers: set | None = None) -> dict:
    """The tensors mlx-lm's format drops (dropped_by_mlx_lm), read from the original checkpoint
    (of the decoder `layers` given, when given): HF's reference on a shipped directory is the
    original's architecture, and these are part of it (ERNIE 4.5's e_score_correction_bias chooses
    the experts). Without the original there is no reference to build: a CheckpointError saying why."""
    dropped = dropped_by_mlx_lm(family)
    if not dropped:
        return {}
    if original is None:
        raise CheckpointError(
            f"{family.name}: mlx-lm's format drops {', '.join(dropped)} (mlx-lm's {family.mlx.module} has no such "
            "parameter), so a shipped directory alone does not say HF's model: give the original checkpoint "
            "too (--candidate-dir with --model-dir, or the tiny checkpoint)")
    index = tensor_index(Path(original))
    names = sorted(n for n in index if n.endswith(dropped)
                   and (layers is None or (m := LAYER.search(n)) is None or int(m.group(1)) in layers))
    if not names:
        raise CheckpointError(f"{family.name}: the original checkpoint {original} has no {', '.join(dropped)}")
    return {n: t.float() for n, t in read_tensors(index, names).items()}


def write_dequantized(family, qdir: Path, config: dict, out: Path, progress=None, original: Path | None = None) -> dict:
    """The HF checkpoint of `qdir`'s weights dequantized to fp32 (one shard per decoder layer,
    one for the rest: a layer at a time in memory), with `config` as its config.json, plus the
    tensors mlx-lm's format drops taken from the `original` checkpoint (from_original). Returns
    the quantization summary."""
    from safetensors.torch import save_file

    q = quantization_of(read_config(qdir))
    index = tensor_index(qdir)  # the headers, read once
    groups = layer_groups(index)
    weight_map, modules = {}, {}
    for i, names in enumerate(groups):
        if progress:
            m = re.search(r"\.layers\.(\d+)\.", names[0])
            progress(f"dequantizing {'layer ' + m[1] if m else 'embeddings and head'} ({i + 1}/{len(groups)})")
        tensors, mods = read_dequantized(index, q, names)
        modules.update(mods)
        hf = family.from_mlx(tensors, config)
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in hf.items()}, str(out / shard), metadata={"format": "pt"})
        weight_map.update({k: shard for k in hf})
    restored = from_original(family, original, {int(m.group(1)) for n in index if (m := LAYER.search(n))})
    if restored:
        clash = sorted(set(restored) & set(weight_map))
        if clash:
            raise CheckpointError(f"{qdir} carries {clash[0]}, which mlx-lm's {family.mlx.module} drops")
        save_file({k: v.contiguous() for k, v in restored.items()}, str(out / "model-from-original.safetensors"),
                  metadata={"format": "pt"})
        weight_map.update({k: "model-from-original.safetensors" for k in restored})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1, sort_keys=True))
    info = summary(q, modules)
    if restored:
        dropped = ", ".join(dropped_by_mlx_lm(family))
        info["from_original"] = (f"{len(restored)} tensor(s) mlx-lm's format drops ({dropped}) taken from the "
                                 "original checkpoint for HF's reference")
    return info


def dequantized_checkpoint(family, qdir: Path, config: dict | None = None, progress=None,
                           original: Path | None = None) -> tuple[Path, dict]:
    """(the cached HF checkpoint of `qdir` dequantized to fp32, its quantization summary).
    `config`: the config.json to give it (the original's, when there is one: same architecture);
    by default the quantized directory's own without its quantization entries. `original`: the
    checkpoint it was made from, where the tensors mlx-lm's format drops come from (from_original)."""
    from importlib.metadata import version

    qdir = Path(qdir)
    own = read_config(qdir)
    if config is None:
        config = {k: v for k, v in own.items() if k not in QUANT_KEYS}
    # keyed by this file's code and the family's own (its from_mlx maps the names back)
    from models import family_source

    code = hashlib.sha256(Path(__file__).read_bytes() + family_source(family.name)).hexdigest()
    recipe = {"candidate_sha256": checkpoint_identity(qdir), "config": config, "format": FORMAT, "code": code,
              "family": family.name, "torch": version("torch")}
    if dropped_by_mlx_lm(family):
        if original is None:
            from_original(family, None)  # refused (the reason) before any work
        recipe["original_sha256"] = checkpoint_identity(Path(original))

    def build(out):
        info = write_dequantized(family, qdir, config, out, progress, original)
        (out / "oracle_quantization.json").write_text(json.dumps(info, indent=1, sort_keys=True))

    path = cached_dir(recipe, f"dequantized-{family.name}", "oracle_dequantized.json", build)
    return path, json.loads((path / "oracle_quantization.json").read_text())
