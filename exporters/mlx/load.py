"""mlx-lm's model with the checkpoint's weights: the experts' layout read from the checkpoint
(per expert or fused), mlx-lm's own sanitize(), a cast, and mlx-lm's affine quantizer with the table of
what it quantized."""

from __future__ import annotations

import contextlib
import io
import re

from exporters.mlx.config import build_model, cached_mlx_config, mapping, mlx_config
from models.checkpoint import CheckpointError, shard_files
from models.mapping import drop_layers_from
from models.mlx_lm import ConfigError
from models.release_formats import CT, MXFP4, release_format

# ---------------------------------------------------------------- weights
EXPERT_KEY = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")


FUSED_KEY = re.compile(r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)")


ROLE = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def expert_layout(family: str, weights: dict) -> dict:
    """The checkpoint's expert tensors (per-expert as save_pretrained writes them, or fused
    experts.gate_up_proj [E, 2I, H] + down_proj [E, H, I]) in the layout the family's mlx-lm
    sanitize() stacks (its mapping's `experts`: fused, or per-expert under its `expert_names`,
    in its `moe` block: Mixtral's block_sparse_moe.experts.{e}.w1/w3/w2), every tensor passed
    through the mapping's `check_tensor`."""
    import mlx.core as mx

    m = mapping(family)
    out, experts = {}, {}
    for k, v in weights.items():
        if km := EXPERT_KEY.fullmatch(k):
            experts.setdefault(km[1], {}).setdefault(int(km[2]), {})[ROLE[km[3]]] = v
        elif km := FUSED_KEY.fullmatch(k):
            ex = experts.setdefault(km[1], {})
            half = v.shape[1] // 2
            for e in range(v.shape[0]):
                parts = {"gate": v[e, :half], "up": v[e, half:]} if km[2] == "gate_up_proj" else {"down": v[e]}
                ex.setdefault(e, {}).update(parts)
        else:
            out[k] = v
    for prefix, ex in experts.items():
        for e in range(len(ex)):
            if set(ex.get(e, {})) != {"gate", "up", "down"}:
                raise CheckpointError(f"{prefix}: expert {e} lacks gate/up/down tensors (experts 0..{len(ex) - 1})")
        if m.experts == "fused":
            gate_up, down = m.fused_names
            out[f"{prefix}.{m.moe}.{gate_up}"] = mx.stack(
                [mx.concatenate([ex[e]["gate"], ex[e]["up"]]) for e in range(len(ex))])
            out[f"{prefix}.{m.moe}.{down}"] = mx.stack([ex[e]["down"] for e in range(len(ex))])
            continue
        for e in range(len(ex)):
            for role, name in m.expert_names.items():
                out[f"{prefix}.{m.moe}.experts.{e}.{name}.weight"] = ex[e][role]
    if m.moe != "mlp":  # transformers' in-memory name for the MoE block is mlp
        out = {k.replace(".mlp.", f".{m.moe}."): v for k, v in out.items()}
    for k, v in out.items():
        problem = (m.check_tensor(k, v.shape) if m.check_tensor else None) or (
            m.check_value(k, v) if m.check_value else None)
        if problem:
            raise ConfigError(problem)
    return out


def load_model(src, config_fn=mlx_config):
    """(mlx-lm model with the checkpoint's weights through its sanitize(), converted fields)."""
    import mlx.core as mx

    family = src.family.name
    fields = cached_mlx_config(family, src.config) if config_fn is mlx_config else config_fn(family, src.config)
    model = build_model(family, fields)
    weights = {}
    for shard in shard_files(src.model_dir):
        weights.update(mx.load(str(shard)))
    weights = drop_layers_from(weights, src.args.num_hidden_layers)
    m = mapping(family)
    weights = model.sanitize(m.convert(weights) if m.convert else expert_layout(family, weights))
    release = release_format(src.config)
    if release is not None and release.method == CT:  # mlx_lm.utils' own refusal
        raise ValueError(f"mlx-lm reads compressed-tensors only in its packed formats (mlx_lm.utils."
                         f"_compressed_tensors_quantization: 'unsupported compressed-tensors format "
                         f"'float-quantized'; dequantize to bf16 before converting')")
    left = sorted(k for k in weights if k.endswith("_scale_inv"))
    if left:  # an FP8 release whose mlx-lm model does not dequantize it (its sanitize() leaves the scales)
        raise ValueError(f"mlx-lm's {m.module} does not read an FP8 release: its sanitize() keeps {len(left)} "
                         f"weight_scale_inv tensor(s) (e.g. {left[0]}) where mlx-lm's deepseek_v3 and minimax "
                         "dequantize them; mlx_lm.convert of this release fails the same way")
    release_quantize(model, weights, release)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if m.regroup is not None:  # (Gemma 4's MoE block as one module, for the harness's blocks and fault forms)
        m.regroup(model)
    return model, fields


# a release format -> the quantization mlx_lm.utils.load_model gives the modules whose packed tensors it has
# (mlx-lm 0.32.2): MXFP4 stays packed (its sanitize renames *_blocks / *_scales); FP8 is not here, the families'
# sanitize() dequantizes it (to bf16)
RELEASE_QUANTIZATION = {MXFP4: {"group_size": 32, "bits": 4, "mode": "mxfp4"}}


def release_quantization(release) -> dict | None:
    """The quantization mlx-lm keeps a release's packed modules at (RELEASE_QUANTIZATION), or None (`release`:
    the checkpoint's models.release_formats.ReleaseFormat, or None)."""
    return None if release is None else RELEASE_QUANTIZATION.get(release.method)


def release_quantize(model, weights: dict, release) -> None:
    """What mlx_lm.utils.load_model does to a checkpoint released in a quantized format before it loads the
    weights: the modules whose `.scales` the sanitized weights have made quantized, each with the bits, group
    size and mode mlx-lm infers from its tensors (mlx_lm.utils.infer_quant_config)."""
    quantization = release_quantization(release)
    if quantization is None:
        return
    import mlx.nn as nn
    from mlx_lm.utils import infer_quant_config

    def packed(path, module):
        return (hasattr(module, "to_quantized") and f"{path}.scales" in weights
                and infer_quant_config(path, module, weights))

    nn.quantize(model, **quantization, class_predicate=packed)


def cast(model, dtype) -> None:
    """Floating parameters to `dtype`, except what the model's cast_predicate keeps (as mlx_lm.convert)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    keep = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters()))


def quantize(model, bits: int, group_size: int) -> dict:
    """mlx-lm's quantizer as mlx_lm.convert runs it; returns what was and was not quantized."""
    from mlx_lm.utils import quantize_model

    with contextlib.redirect_stdout(io.StringIO()):  # it prints bits per weight
        quantize_model(model, {}, group_size, bits, mode="affine")
    return {"bits": bits, "group_size": group_size, "mode": "affine", **quantization_table(model, group_size)}


def quantization_table(model, group_size: int, left_out: str = "left out by the model's quant_predicate") -> dict:
    """Every weight-carrying module of an mlx model: quantized (bits, group size) or not (why; `left_out`: a
    module the quantizer could have taken)."""
    done, skipped = {}, {}
    for path, m in sorted(model.named_modules()):
        w = m.get("weight") if isinstance(m, dict) else None
        if w is None or w.ndim < 2 or m.children():
            continue
        if "scales" in m:
            done[path] = {"bits": m.bits, "group_size": m.group_size}
        elif not hasattr(m, "to_quantized"):
            skipped[path] = f"{type(m).__name__}: mlx has no quantized form"
        elif w.shape[-1] % group_size:
            skipped[path] = f"input dim {w.shape[-1]} not divisible by group size {group_size}"
        else:
            skipped[path] = left_out
    return {"quantized": done, "not_quantized": skipped}
