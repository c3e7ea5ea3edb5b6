"""The weight check of a shipped mlx-lm directory (oracle/verdict/conversion.py): each of its tensors against the
same tensor of the original converted by mlx-lm itself, unquantized (exporters/mlx/ `reference_directory`: mlx-lm's
`sanitize()` and writers, the weights at the original's own dtype: the original in the directory's own
names and layouts, experts stacked, norms stored as 1 + w where mlx-lm does), cached like any artifact.

A quantized module `P` (`P.weight` packed, `P.scales`, `P.biases`: oracle/source/quantized.py) is an affine grid
per group of `group_size` inputs: deq = scale * q + bias, q in [0, 2^bits - 1]. mlx's quantizer reads
the weights at the model's dtype and rounds the scale and bias to it after choosing the q (at bf16 a
value lands up to about 2 steps from its nearest grid point: the |q| ulps of the scale in the bound),
and makes 0 exact by moving the grid, which clips an extreme by up to one step. Measured on mlx 0.32.4
(docs/conversion.md). Every other tensor is a float format: half an ulp of its stored type."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from oracle.verdict.conversion import CHUNK_ELEMENTS, Chunk, Format, TensorSource

SAFETENSORS_FLOATS = {"F32": "F32", "BF16": "BF16", "F16": "F16"}
MLX_CLIP_STEPS = 1.0  # the zero-exact grid adjustment (measured: at most 1.0 step at fp32, 1.5 at bf16 with the
                      # scale's rounding, which the slack covers)


def label(name: str) -> str:
    """mlx-lm's name of a tensor, its stacked experts as the checkpoint's per-expert ones."""
    return re.sub(r"\.switch_mlp\.", ".experts.*.", name)


def directory_tensor_sources(shipped: Path, reference: Path, labels: dict | None = None):
    """A TensorSource per tensor of the shipped directory (a quantized module once, as its weight);
    `labels`: mlx name -> the checkpoint tensors it holds (hf_labels)."""
    from models.checkpoint import CheckpointError, read_config, tensor_index
    from oracle.source.quantized import module_quantization, quantization_of

    q = quantization_of(read_config(shipped))
    mine, ref = tensor_index(shipped), tensor_index(reference)
    quantized = {n[: -len(".scales")] for n in mine if n.endswith(".scales")}
    # packed in mlx-lm's conversion of the original too: a release's MXFP4 experts, which mlx-lm keeps so
    kept = {n[: -len(".scales")] for n in ref if n.endswith(".scales")}
    names = [n for n in mine if not n.endswith((".scales", ".biases"))]
    for n in sorted(set(ref) - set(names) - {f"{p}.{k}" for p in kept for k in ("scales", "biases")}):
        raise CheckpointError(f"{shipped}: {n} is missing (mlx-lm's conversion of the original has it)")
    for n in sorted(names):
        if n not in ref:
            raise CheckpointError(f"{shipped}: {n} is not a tensor of mlx-lm's conversion of the original")
        path = n.rsplit(".", 1)[0]
        shape = tuple(ref[n][2])
        units = shape[1] if len(shape) == 3 else 0  # stacked experts [E, out, in]
        if n.endswith(".weight") and path in quantized and path in kept and f"{path}.biases" not in mine:
            # mxfp4 as the original's conversion has it: the shipped values must be the release's, exactly
            fmt = Format("mlx mxfp4 (kept from the release: its values exactly)", dtype="F32")
            yield TensorSource(n, (labels or {}).get(n) or label(n), shape, fmt, _kept_chunks(mine, ref, n, path, shape), units)
        elif n.endswith(".weight") and path in quantized:
            spec = module_quantization(q, path) if q else None
            if spec is None:
                raise CheckpointError(f"{path} has scales, but config.json does not quantize it")
            dtype = SAFETENSORS_FLOATS.get(mine[f"{path}.scales"][1], "F32")
            bits, gs = spec["bits"], spec["group_size"]
            fmt = Format(f"mlx affine {bits}-bit g{gs} ({dtype} scales)", block=gs, qmin=0, qmax=2 ** bits - 1,
                         grid_dtype=dtype, input_dtype=dtype, clip_steps=MLX_CLIP_STEPS)
            yield TensorSource(n, (labels or {}).get(n) or label(n), shape, fmt,
                               _quantized_chunks(mine, ref, n, path, bits, gs, shape, path in kept), units)
        else:
            dtype = SAFETENSORS_FLOATS.get(mine[n][1])
            if dtype is None:
                raise CheckpointError(f"{shipped}: {n} is {mine[n][1]}, neither a float nor a quantized weight")
            yield TensorSource(n, (labels or {}).get(n) or label(n), shape, Format(dtype, dtype=dtype), _float_chunks(mine, ref, n, shape), units)


def _rows(t, shape):
    return t.reshape(int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1, -1)


def _float_chunks(mine, ref, n, shape):
    def chunks():
        from models.checkpoint import read_tensors

        x = _rows(read_tensors(ref, [n])[n], shape)
        d = _rows(read_tensors(mine, [n])[n], shape)
        step = max(1, CHUNK_ELEMENTS // x.shape[1])
        for a in range(0, len(x), step):
            yield Chunk(a, x[a:a + step].float().numpy(), d[a:a + step].float().numpy())
    return chunks


def _mxfp4_values(index, n, path, shape):
    """The fp32 values of an mlx mxfp4 tensor, as rows."""
    from models.checkpoint import read_tensors
    from oracle.source.quantized import dequantize_mxfp4

    t = read_tensors(index, [n, f"{path}.scales"])
    return _rows(dequantize_mxfp4(t[n], t[f"{path}.scales"], path), shape)


def _kept_chunks(mine, ref, n, path, shape):
    def chunks():
        x, d = _mxfp4_values(ref, n, path, shape), _mxfp4_values(mine, n, path, shape)
        step = max(1, CHUNK_ELEMENTS // x.shape[1])
        for a in range(0, len(x), step):
            yield Chunk(a, x[a:a + step].numpy(), d[a:a + step].numpy())
    return chunks


def _quantized_chunks(mine, ref, n, path, bits, gs, shape, ref_packed: bool = False):
    def chunks():
        from models.checkpoint import read_tensors
        from oracle.source.quantized import dequantize

        x = _mxfp4_values(ref, n, path, shape) if ref_packed else _rows(read_tensors(ref, [n])[n], shape)
        t = read_tensors(mine, [n, f"{path}.scales", f"{path}.biases"])
        words, scales, biases = (_rows(t[k], shape) for k in (n, f"{path}.scales", f"{path}.biases"))
        step = max(1, CHUNK_ELEMENTS // x.shape[1])
        for a in range(0, len(x), step):
            s, b = scales[a:a + step], biases[a:a + step]
            deq = dequantize(words[a:a + step], s, b, bits, gs, path)
            yield Chunk(a, x[a:a + step].float().numpy(), deq.numpy(), s.float().numpy(), b.float().numpy())
    return chunks


def hf_labels(family, config: dict, shapes: dict) -> dict:
    """mlx name -> the checkpoint tensors it holds (experts folded), learned from the family's own
    `from_mlx` (the inverse of mlx-lm's sanitize) run on shape-only tensors, a decoder layer at a time: the
    names that go when the tensor does."""
    import torch

    from models.checkpoint import layer_groups
    from oracle.selftest.conversion_faults import folded

    def outs(names):
        return set(family.from_mlx({n: torch.empty(shapes[n], device="meta") for n in names}, config))

    labels = {}
    for group in layer_groups(shapes):
        try:
            everything = outs(group)
        except Exception:  # noqa: BLE001 - a from_mlx that needs real values: the mlx names label themselves
            continue
        for n in group:
            parent = n.rsplit(".", 2)[0]
            for rest in ([n], [m for m in group if m.rsplit(".", 2)[0] == parent]):
                try:
                    gone = everything - outs([m for m in group if m not in rest])
                    break
                except Exception:  # noqa: BLE001 - a partner missing: try without the module's siblings too
                    gone = set()
            if gone:
                labels[n] = ", ".join(sorted({folded(g) for g in gone}))
    return labels


def scales_other_group(shipped: Path, reference: Path, layer: int) -> str | None:
    """A file defect: one quantized module of `layer` (its experts' up projection where there is one) with
    scales and biases computed for another group size (twice its own, or half where its inputs do not
    divide twice) and written in the shape its own group size needs, over the q its own quantization chose.
    Returns the module's weight name (what the weight check must name); None without a quantized module."""
    import mlx.core as mx

    from models.checkpoint import read_config, tensor_index
    from oracle.source.quantized import module_quantization, quantization_of

    q = quantization_of(read_config(shipped))
    index = tensor_index(shipped)
    modules = sorted(n[: -len(".scales")] for n in index if n.endswith(".scales") and f".layers.{layer}." in n)
    if not modules or q is None:
        return None
    path = next((m for m in modules if "up_proj" in m), modules[0])
    spec = module_quantization(q, path)
    gs, bits = spec["group_size"], spec["bits"]
    ref = mx.load(str(tensor_index(reference)[f"{path}.weight"][0]))[f"{path}.weight"]
    n_in = ref.shape[-1]
    other = 2 * gs if n_in % (2 * gs) == 0 else gs // 2
    if other < 32:  # mlx quantizes in groups of 32, 64 or 128
        return None
    _, s, b = mx.quantize(ref, group_size=other, bits=bits)
    s, b = ((mx.repeat(s, 2, axis=-1), mx.repeat(b, 2, axis=-1)) if other > gs else (s[..., ::2], b[..., ::2]))
    shard = str(index[f"{path}.scales"][0])
    weights = mx.load(shard)
    dtype = weights[f"{path}.scales"].dtype
    weights[f"{path}.scales"], weights[f"{path}.biases"] = s.astype(dtype), b.astype(dtype)
    mx.save_safetensors(shard, weights, metadata={"format": "mlx"})
    return f"{path}.weight"
