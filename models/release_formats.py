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

A release's index (`released_index`) is checked from the headers alone, before any work: every packed tensor
with its scales, of the shapes the format defines (one scale a block), no scale without its weight, no
quant_method or fmt this file does not know. What it gives is the checkpoint the file defines: the
dequantized tensors under HF's names, with their shapes and dtypes, and where each one's parts are.

`pack` writes a tensor in a release's format (the seeded `--config` checkpoints of gpt-oss and DeepSeek-V3 are
written so, as released): FP8 by transformers' own quantizer (Fp8Quantize), MXFP4 by the OCP MX rule (no
library packs it on a CPU: transformers' needs triton kernels).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.errors import CheckpointError

MXFP4, FP8 = "mxfp4", "fp8"
METHODS = (MXFP4, FP8)
MX_BLOCK = 32  # values per e8m0 scale (MXFP4)
FP8_SCALE = ".weight_scale_inv"
FP8_DTYPES = {"e4m3": "F8_E4M3"}  # `fmt` -> the weights' safetensors dtype
FP8_FMT_ALIASES = {"float8_e4m3fn": "e4m3"}  # MiniMax-M2's config spells it as torch's dtype
SCALE_DTYPES = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class ReleaseFormat:
    """A checkpoint's quantized release format, from its config.json (`quantization_config`)."""

    method: str  # MXFP4 or FP8
    block: tuple[int, int] | None = None  # FP8: weight_block_size (rows, columns)
    fmt: str | None = None  # FP8: the float8 format (e4m3)
    skip: tuple[str, ...] = ()  # modules_to_not_convert: names left unquantized (informational)

    def describe(self) -> str:
        if self.method == MXFP4:
            return "MXFP4 (e2m1 values, an e8m0 scale per 32)"
        return f"FP8 {self.fmt} block-scaled ({self.block[0]}x{self.block[1]} blocks, weight_scale_inv)"


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
    fmt = q.get("fmt", "e4m3")
    fmt = FP8_FMT_ALIASES.get(fmt, fmt) if isinstance(fmt, str) else fmt
    if fmt not in FP8_DTYPES:
        raise CheckpointError(f"config.json quantization_config.fmt {fmt!r} is not an FP8 format read here "
                              f"(known: {', '.join(FP8_DTYPES)})")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"config.json quantization_config.weight_block_size {block!r} is not two positive "
                              "integers (rows, columns)")
    return ReleaseFormat(FP8, block=(block[0], block[1]), fmt=fmt, skip=skip)


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
    entries, parts = {}, {}
    want = FP8_DTYPES[fmt.fmt]
    bm, bn = fmt.block
    for name, (shard, dtype, shape) in raw.items():
        if name.endswith(FP8_SCALE):
            weight = name[: -len(FP8_SCALE)] + ".weight"
            if weight not in raw:
                raise CheckpointError(f"tensor {name}: an FP8 scale without {weight}")
            continue
        scale = name[: -len(".weight")] + FP8_SCALE if name.endswith(".weight") else None
        if dtype != want:
            if dtype.startswith("F8_"):
                raise CheckpointError(f"tensor {name} is {dtype}: config.json declares FP8 {fmt.fmt} ({want})")
            if scale in raw:
                raise CheckpointError(f"tensor {name} is {dtype}, not {want}, but has {scale}")
            entries[name] = (shard, dtype, shape)
            continue
        if scale not in raw:
            raise CheckpointError(f"tensor {name}: {want} without its {FP8_SCALE.lstrip('.')} (the release's "
                                  "per-block scales)")
        if len(shape) < 2:
            raise CheckpointError(f"tensor {name}: {want} {list(shape)} is not a matrix")
        rows, cols = shape[-2:]
        s_shard, s_dtype, s_shape = raw[scale]
        # one scale a block, the last row and column of blocks partial where the block does not divide the weight
        # (DeepSeek-V3's kv_a_proj_with_mqa [576, 7168] has scales [5, 56]: its reference dequantizer's ceil grid)
        grid = (*shape[:-2], -(-rows // bm), -(-cols // bn))
        if s_dtype not in SCALE_DTYPES or tuple(s_shape) != grid:
            raise CheckpointError(f"tensor {scale}: {s_dtype} {list(s_shape)} does not fit {name} {list(shape)} "
                                  f"in weight_block_size [{bm}, {bn}] blocks (want a float {list(grid)}: one scale "
                                  "a block, config.json quantization_config)")
        entries[name] = (shard, "F32", tuple(shape))
        parts[name] = {"weight": name, "scale_inv": scale}
    return ReleasedIndex(fmt, entries, parts)


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

    q, scale = tensors["weight"], tensors["scale_inv"]
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

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # the magnitudes of the 3 low bits; bit 3 is the sign
MX_SKIP = ("self_attn", "router", "embed_tokens", "lm_head")  # gpt-oss's modules_to_not_convert
FP8_SKIP = ("gate", "router")  # the routers (a module of that name: DeepSeek's mlp.gate, MiniMax's block_sparse_moe.gate)


def packs(fmt: ReleaseFormat, name: str, shape) -> bool:
    """Whether the release holds the checkpoint tensor `name` packed: MXFP4 the experts' stacked weights
    (`...experts.gate_up_proj` / `down_proj`, [E, in, out]), FP8 every 2-d weight of a decoder layer but the
    router's (and whatever modules_to_not_convert names)."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    module = name.rsplit(".", 1)[0]  # P.weight's module P; a fused experts tensor's: the experts module
    if fmt.skip and not should_convert_module(module, list(fmt.skip)):  # transformers' matching of the patterns
        return False
    if fmt.method == MXFP4:
        return (name.endswith(("experts.gate_up_proj", "experts.down_proj")) and len(shape) == 3
                and shape[-2] % MX_BLOCK == 0 and not any(k in name for k in MX_SKIP))
    return (name.endswith(".weight") and len(shape) == 2 and ".layers." in name
            and module.rsplit(".", 1)[-1] not in FP8_SKIP and "norm" not in module)  # (and the norms stay bf16)


def pack(fmt: ReleaseFormat, name: str, w) -> dict:
    """The release's tensors of checkpoint tensor `name` (`packs` true): MXFP4 {name_blocks, name_scales}, FP8
    {name, name_scale_inv}. What they define is `dequantize` of them."""
    import torch

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
    return {name: q.contiguous(), name[: -len(".weight")] + FP8_SCALE: out[name[: -len(".weight")] + FP8_SCALE]}


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
    mids = torch.tensor([(a + b) / 2 for a, b in zip(E2M1, E2M1[1:])])
    code = torch.bucketize(x.abs(), mids).to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)
    return (code[..., 0::2] | (code[..., 1::2] << 4)), (exp + 127).to(torch.uint8)
