"""Checkpoints as their releases ship them: the quantized formats most large MoE models are released in,
read by each format's own definition (transformers' dequantizers, which its loaders apply with
`dequantize=True`), a tensor at a time (issue 77).

- MXFP4 (gpt-oss; config.json `quantization_config: {"quant_method": "mxfp4"}`): an expert tensor that HF holds
  as W [E, in, out] (x @ W) ships as `W_blocks` uint8 [E, out, in / 32, 16] (two e2m1 values a byte, the low
  nibble first) and `W_scales` uint8 [E, out, in / 32] (e8m0: the 32 values of a block times 2^(s - 127)).
  transformers.integrations.mxfp4.convert_moe_packed_tensors dequantizes (and transposes) it; every value is
  exact in bf16 and fp32.
- FP8 block-scaled (DeepSeek-V3; `{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bm, bn]}`): a
  linear's `P.weight` [out, in] float8_e4m3fn beside `P.weight_scale_inv` [ceil(out / bm), ceil(in / bn)]
  (float32): each bm x bn block of the weight times its scale, in fp32 (transformers' Fp8Dequantize), the last
  row and column of blocks partial where the block does not divide the weight (DeepSeek-V3's
  kv_a_proj_with_mqa: 576 rows).
- compressed-tensors' float-quantized (llm-compressor's FP8; `{"quant_method": "compressed-tensors", "format":
  "float-quantized", "config_groups": {...: {"weights": {"num_bits": 8, "type": "float", "strategy": ...}}}}`):
  `P.weight` float8_e4m3fn times `P.weight_scale`, one for the tensor, one per output row, or one per block.

A release's index (`released_index`) is checked from the headers alone, before any work: every packed tensor
with its scales, of the shapes the format defines (one scale a block), no scale without its weight, no
quant_method or fmt this file does not know. What it gives is the checkpoint the file defines: the
dequantized tensors under HF's names, with their shapes and dtypes, and where each one's parts are.

`pack` writes a tensor in a release's format (the seeded `--config` checkpoints of gpt-oss and DeepSeek-V3 are
written so, as released): FP8 by transformers' own quantizer (Fp8Quantize), MXFP4 by the OCP MX rule (no
library packs it on a CPU: transformers' needs triton kernels).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from models.errors import CheckpointError

MXFP4, FP8, CT = "mxfp4", "fp8", "compressed-tensors"
METHODS = (MXFP4, FP8, CT)
MX_BLOCK = 32  # values per e8m0 scale (MXFP4)
FP8_SCALE = ".weight_scale_inv"
CT_SCALE = ".weight_scale"  # compressed-tensors' float-quantized: weight = its fp8 values times weight_scale
CT_FORMATS = ("float-quantized",)
CT_STRATEGIES = ("tensor", "channel", "block")  # one scale for the tensor, one per output row, one per block
CT_DROPPED = (".input_scale", ".weight_zero_point")  # static activation scales, symmetric zero points: not weights
FP8_DTYPES = {"e4m3": "F8_E4M3"}  # `fmt` -> the weights' safetensors dtype
FP8_FMT_ALIASES = {"float8_e4m3fn": "e4m3"}  # MiniMax-M2's config spells it as torch's dtype
SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class ReleaseFormat:
    """A checkpoint's quantized release format, from its config.json (`quantization_config`)."""

    method: str  # MXFP4, FP8 or CT
    block: tuple[int, int] | None = None  # FP8: weight_block_size (rows, columns); CT's block strategy: its blocks
    fmt: str | None = None  # FP8, CT: the float8 format (e4m3)
    skip: tuple[str, ...] = ()  # modules_to_not_convert (CT: ignore): names left unquantized
    strategy: str | None = None  # CT: the weights' scale strategy (CT_STRATEGIES)

    def describe(self) -> str:
        if self.method == MXFP4:
            return "MXFP4 (e2m1 values, an e8m0 scale per 32)"
        if self.method == CT:
            blocks = f", {self.block[0]}x{self.block[1]} blocks" if self.block else ""
            return f"compressed-tensors float-quantized FP8 {self.fmt} ({self.strategy} weight_scale{blocks})"
        return f"FP8 {self.fmt} block-scaled ({self.block[0]}x{self.block[1]} blocks, weight_scale_inv)"

    @property
    def scale(self) -> str:
        """FP8 / CT: the suffix of a weight's scale tensor."""
        return CT_SCALE if self.method == CT else FP8_SCALE


def release_format(config: dict) -> ReleaseFormat | None:
    """The release format config.json declares (None: not a quantized release, or mlx-lm's own format, whose
    quantization_config has no quant_method: oracle/source/quantized.py). An unknown quant_method, fmt or block
    size is a CheckpointError naming the field."""
    q = config.get("quantization_config")
    if q is None or (isinstance(q, dict) and "quant_method" not in q):
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json quantization_config is {type(q).__name__}, not an object")
    method = q.get("quant_method")
    if method not in METHODS:
        raise CheckpointError(f"config.json quantization_config.quant_method {method!r} is not a format read here "
                              f"(known: {', '.join(METHODS)})")
    skip = tuple(q.get("modules_to_not_convert") or ())
    if method == MXFP4:
        return ReleaseFormat(MXFP4, skip=skip)
    if method == CT:
        return _compressed_tensors(q)
    fmt = q.get("fmt", "e4m3")
    fmt = FP8_FMT_ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if fmt not in FP8_DTYPES:
        raise CheckpointError(f"config.json quantization_config.fmt {fmt!r} is not an FP8 format read here "
                              f"(known: {', '.join(FP8_DTYPES)})")
    block = _blocks(q.get("weight_block_size"), "quantization_config.weight_block_size")
    return ReleaseFormat(FP8, block=block, fmt=fmt, skip=skip)


def _blocks(block, where: str) -> tuple[int, int]:
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"config.json {where} {block!r} is not two positive integers (rows, columns)")
    return block[0], block[1]


def _compressed_tensors(q: dict) -> ReleaseFormat:
    """compressed-tensors' float-quantized format (FP8 weights, one weights scheme for every config group)."""
    form = q.get("format")
    if form not in CT_FORMATS:
        raise CheckpointError(f"config.json quantization_config.format {form!r} (compressed-tensors) is not a format "
                              f"read here (known: {', '.join(CT_FORMATS)}: FP8 weights with their weight_scale)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups or not all(isinstance(g, dict) for g in groups.values()):
        raise CheckpointError(f"config.json quantization_config.config_groups {groups!r} is not an object of "
                              "quantization groups")
    schemes = [g.get("weights") for g in groups.values()]
    if any(w != schemes[0] for w in schemes):
        raise CheckpointError("config.json quantization_config.config_groups: groups with different weights schemes "
                              f"are not read ({', '.join(groups)})")
    w = schemes[0]
    if not isinstance(w, dict) or w.get("type") != "float" or w.get("num_bits") != 8:
        raise CheckpointError(f"config.json quantization_config.config_groups.{next(iter(groups))}.weights {w!r} is "
                              "not 8-bit float weights (type float, num_bits 8)")
    strategy = w.get("strategy")
    if strategy not in CT_STRATEGIES:
        raise CheckpointError(f"config.json quantization_config.config_groups.{next(iter(groups))}.weights.strategy "
                              f"{strategy!r} is not read here (known: {', '.join(CT_STRATEGIES)})")
    block = _blocks(w.get("block_structure"), "quantization_config weights.block_structure") if strategy == "block" else None
    return ReleaseFormat(CT, block=block, fmt="e4m3", skip=tuple(q.get("ignore") or ()), strategy=strategy)


@dataclass
class ReleasedIndex:
    """What a release's tensors define: `entries` name -> (shard, safetensors dtype, shape) of the
    checkpoint as HF holds it (the dequantized tensors' dtype: BF16 for MXFP4, exact; F32 for FP8), and
    `parts` name -> {role: raw tensor name} for each tensor read from packed parts."""

    format: ReleaseFormat
    entries: dict
    parts: dict = field(default_factory=dict)


def released_index(raw: dict, fmt: ReleaseFormat) -> ReleasedIndex:
    """The index of the checkpoint a release defines, from its raw index (models.checkpoint.tensor_index:
    name -> (shard, dtype, shape)), validated: every malformed part is a CheckpointError naming the tensor."""
    return (_mxfp4_index if fmt.method == MXFP4 else _fp8_index)(raw, fmt)


def _mxfp4_index(raw: dict, fmt: ReleaseFormat) -> ReleasedIndex:
    entries, parts = {}, {}
    for name, (shard, dtype, shape) in raw.items():
        if name.endswith("_scales"):
            base = name[: -len("_scales")]
            if base + "_blocks" not in raw:
                raise CheckpointError(f"tensor {name}: MXFP4 scales without {base}_blocks")
            continue
        if not name.endswith("_blocks"):
            entries[name] = (shard, dtype, shape)
            continue
        base = name[: -len("_blocks")]
        scales = base + "_scales"
        if scales not in raw:
            raise CheckpointError(f"tensor {name}: MXFP4 blocks without {scales}")
        if dtype != "U8" or len(shape) < 3 or shape[-1] != MX_BLOCK // 2:
            raise CheckpointError(f"tensor {name}: {dtype} {list(shape)} is not MXFP4 blocks (uint8 [..., out, "
                                  f"in / {MX_BLOCK}, {MX_BLOCK // 2}]: two e2m1 values a byte)")
        s_shard, s_dtype, s_shape = raw[scales]
        if s_dtype != "U8" or tuple(s_shape) != tuple(shape[:-1]):
            raise CheckpointError(f"tensor {scales}: {s_dtype} {list(s_shape)} does not fit {name} {list(shape)} "
                                  f"(MXFP4 scales: uint8 e8m0 {list(shape[:-1])}, one per {MX_BLOCK} values)")
        *lead, out, groups, _ = shape
        # HF's layout after convert_moe_packed_tensors: [..., in, out] (the experts compute x @ W)
        entries[base] = (shard, "BF16", (*lead, groups * MX_BLOCK, out))
        parts[base] = {"blocks": name, "scales": scales}
    return ReleasedIndex(fmt, entries, parts)


def _fp8_index(raw: dict, fmt: ReleaseFormat) -> ReleasedIndex:
    """FP8 block-scaled and compressed-tensors' float-quantized: an fp8 `P.weight` and its scale tensor."""
    entries, parts = {}, {}
    want, suffix = FP8_DTYPES[fmt.fmt], fmt.scale
    for name, (shard, dtype, shape) in raw.items():
        if name.endswith(suffix):
            weight = name[: -len(suffix)] + ".weight"
            if weight not in raw:
                raise CheckpointError(f"tensor {name}: an FP8 scale without {weight}")
            continue
        if fmt.method == CT and name.endswith(CT_DROPPED):
            continue  # (the activations' static scales, the weights' zero points of a symmetric scheme)
        scale = name[: -len(".weight")] + suffix if name.endswith(".weight") else None
        if dtype != want:
            if dtype.startswith("F8_"):
                raise CheckpointError(f"tensor {name} is {dtype}: config.json declares FP8 {fmt.fmt} ({want})")
            if scale in raw:
                raise CheckpointError(f"tensor {name} is {dtype}, not {want}, but has {scale}")
            entries[name] = (shard, dtype, shape)
            continue
        if scale not in raw:
            raise CheckpointError(f"tensor {name}: {want} without its {suffix.lstrip('.')} (the release's scales)")
        if len(shape) < 2:
            raise CheckpointError(f"tensor {name}: {want} {list(shape)} is not a matrix")
        s_shard, s_dtype, s_shape = raw[scale]
        grid, how = _scale_grid(fmt, tuple(shape))
        row = fmt.method == CT and fmt.strategy == "channel"  # (a row scale may be written [rows] or [rows, 1])
        fits = math.prod(s_shape) == 1 if grid is None else tuple(s_shape) in ((grid, grid[:-1]) if row else (grid,))
        if s_dtype not in SCALE_DTYPES or not fits:
            raise CheckpointError(f"tensor {scale}: {s_dtype} {list(s_shape)} does not fit {name} {list(shape)} "
                                  f"({how}: want a float {'one-element tensor' if grid is None else list(grid)}, "
                                  "config.json quantization_config)")
        entries[name] = (shard, "F32", tuple(shape))
        parts[name] = {"weight": name, "scale": scale}
    return ReleasedIndex(fmt, entries, parts)


def _scale_grid(fmt: ReleaseFormat, shape: tuple) -> tuple[tuple | None, str]:
    """(the scale's shape for a weight of `shape`, None for a single scale; what it is)."""
    *lead, rows, cols = shape
    if fmt.method == CT and fmt.strategy == "tensor":
        return None, "one scale for the tensor"
    if fmt.method == CT and fmt.strategy == "channel":
        return (*lead, rows, 1), "one scale per output row"
    bm, bn = fmt.block
    # one scale a block, the last row and column of blocks partial where the block does not divide the weight
    # (DeepSeek-V3's kv_a_proj_with_mqa [576, 7168] has scales [5, 56]: its reference dequantizer's ceil grid)
    return (*lead, -(-rows // bm), -(-cols // bn)), f"one scale a [{bm}, {bn}] block"


def dequantize(fmt: ReleaseFormat, tensors: dict):
    """The tensor HF holds for one released one, from its parts (`tensors`: role -> tensor, as
    ReleasedIndex.parts names them), by transformers' own dequantizer."""
    import torch

    if fmt.method == MXFP4:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        blocks, scales = tensors["blocks"], tensors["scales"]
        # (the function works on [E, out, G, 16]: a 3-d tensor is one expert's)
        lead = blocks.dim() == 3
        out = convert_moe_packed_tensors(blocks[None] if lead else blocks, scales[None] if lead else scales,
                                         dtype=torch.bfloat16)
        return out[0] if lead else out
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    q, scale = tensors["weight"], tensors["scale"]
    if fmt.method == CT and fmt.strategy in ("tensor", "channel"):  # (no library here: compressed-tensors' own is
        # not installed) each value times its tensor's or its row's scale, in fp32
        s = scale.float().reshape(()) if fmt.strategy == "tensor" else scale.float().reshape(*q.shape[:-1], 1)
        return q.float() * s
    bm, bn = fmt.block
    rows, cols = q.shape[-2:]
    # transformers' dequantizer reads the block size off the scale grid, so it needs whole blocks: a partial last
    # row or column of blocks (the format's ceil grid) is padded with zeros for it and cut off after
    pad = (-rows % bm, -cols % bn)
    if any(pad):
        q = torch.nn.functional.pad(q.view(torch.uint8), (0, pad[1], 0, pad[0])).view(q.dtype)
    w = Fp8Dequantize(None)._dequantize_one(q, scale, torch.float32)
    return w[..., :rows, :cols].to(torch.float32)


# ---------------------------------------------------------------- writing a release

PACKING = 1  # bump when pack() writes other bytes (the seeded checkpoints' cache key: oracle/source/seeded.py)

# e2m1 (MXFP4's and mlx's mxfp4 values) by its 4-bit code: the magnitude in the 3 low bits, the sign in bit 3
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_SKIP = ("self_attn", "router", "embed_tokens", "lm_head")  # gpt-oss's modules_to_not_convert
FP8_SKIP = ("gate", "router")  # the routers (a module of that name: DeepSeek's mlp.gate, MiniMax's block_sparse_moe.gate)


def packs(fmt: ReleaseFormat, name: str, shape) -> bool:
    """Whether the release holds the checkpoint tensor `name` packed: MXFP4 the experts' stacked weights
    (`...experts.gate_up_proj` / `down_proj`, [E, in, out]), FP8 every 2-d weight of a decoder layer but the
    router's (and whatever modules_to_not_convert names)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    module = name.rsplit(".", 1)[0]  # P.weight's module P; a fused experts tensor's: the experts module
    # transformers' matching of the patterns (compressed-tensors' `ignore` marks a regular expression "re:")
    if fmt.skip and not should_convert_module(module, [k.removeprefix("re:") for k in fmt.skip]):
        return False
    if fmt.method == MXFP4:
        return (name.endswith(("experts.gate_up_proj", "experts.down_proj")) and len(shape) == 3
                and shape[-2] % MX_BLOCK == 0 and not any(k in name for k in MX_SKIP))
    return (name.endswith(".weight") and len(shape) == 2 and ".layers." in name
            and module.rsplit(".", 1)[-1] not in FP8_SKIP and "norm" not in module)  # (and the norms stay bf16)


def pack(fmt: ReleaseFormat, name: str, w) -> dict:
    """The release's tensors of checkpoint tensor `name` (`packs` true): MXFP4 {name_blocks, name_scales}, FP8
    {name, name_scale_inv}, CT {name, name_scale}. What they define is `dequantize` of them."""
    import torch

    scale_name = name[: -len(".weight")] + fmt.scale if fmt.method != MXFP4 else None
    if fmt.method == CT and fmt.strategy in ("tensor", "channel"):  # the largest |value| (of the tensor, the row) at 448
        amax = w.float().abs().amax() if fmt.strategy == "tensor" else w.float().abs().amax(-1, keepdim=True)
        scale = amax.clamp_min(2.0 ** -100) / 448.0
        return {name: (w.float() / scale).to(torch.float8_e4m3fn).contiguous(), scale_name: scale.reshape(
            (1,) if fmt.strategy == "tensor" else scale.shape).contiguous()}

    if fmt.method == MXFP4:
        parts = [_pack_mxfp4(e) for e in w.reshape(-1, *w.shape[-2:])]  # an expert at a time: bounded memory
        blocks = torch.stack([b for b, _ in parts]).reshape(*w.shape[:-2], *parts[0][0].shape)
        scales = torch.stack([s for _, s in parts]).reshape(*w.shape[:-2], *parts[0][1].shape)
        return {f"{name}_blocks": blocks.contiguous(), f"{name}_scales": scales.contiguous()}
    import types

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    bm, bn = fmt.block
    rows, cols = w.shape
    pad = (-rows % bm, -cols % bn)  # partial blocks: transformers' quantizer takes whole ones (zeros max nothing)
    padded = torch.nn.functional.pad(w.float(), (0, pad[1], 0, pad[0]))
    quantizer = Fp8Quantize(types.SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=fmt.block)))
    out = quantizer._quantize_one(name, padded)
    q = out[name][:rows, :cols]
    return {name: q.contiguous(), scale_name: out[name[: -len(".weight")] + FP8_SCALE]}


def _pack_mxfp4(w):
    """One expert's [in, out] -> (blocks uint8 [out, in / 32, 16], scales uint8 [out, in / 32]). OCP MX v1.0: the
    shared exponent floor(log2 amax) - 2 (e2m1's largest exponent), each value the nearest e2m1 (a tie to the
    smaller magnitude) saturated at 6; an all-zero block has the smallest scale."""
    import torch

    g = w.float().t().reshape(w.shape[1], -1, MX_BLOCK)  # [out, in / 32, 32]: the release's layout
    amax = g.abs().amax(-1)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2, torch.full_like(amax, -127))
    exp = exp.clamp(-127, 127)
    x = (g / torch.exp2(exp)[..., None]).clamp(-6.0, 6.0)
    mids = torch.tensor([(a + b) / 2 for a, b in zip(E2M1[:7], E2M1[1:8])])  # between the magnitudes
    code = torch.bucketize(x.abs(), mids).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)), (exp + 127).to(torch.uint8)
