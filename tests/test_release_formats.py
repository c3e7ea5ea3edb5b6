"""The released quantized formats (models/release_formats.py): MXFP4 and FP8 block-scaled tensors packed here by
the test's own packers (the formats' definitions, written from the spec, not from the code under test) and read
back by transformers' dequantizers; a malformed release is refused from its headers, naming the tensor or field."""

import json
from pathlib import Path

import pytest
import torch

from models.checkpoint import CheckpointError
from models.release_formats import FP8, MXFP4, ReleaseFormat, dequantize, release_format, released_index

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF's expert tensor w [E, in, out] -> (blocks uint8 [E, out, in/32, 16], scales uint8 [E, out, in/32],
    the values they define [E, in, out]): per 32 inputs a power-of-two scale (e8m0, bias 127) that puts the
    largest |value| at or under 6, each value the nearest e2m1 (ties to the lower code), two a byte, low first."""
    t = w.transpose(-1, -2)  # [E, out, in]
    g = t.reshape(*t.shape[:-1], -1, 32)
    amax = g.abs().amax(-1).clamp_min(2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0))
    x = g / torch.exp2(exp)[..., None]
    codes = (x[..., None] - E2M1).abs().argmin(-1)  # [..., 32]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    values = (E2M1[codes] * torch.exp2(exp)[..., None]).reshape(t.shape).transpose(-1, -2)
    return blocks, (exp + 127).to(torch.uint8), values


def pack_fp8(w: torch.Tensor, bm: int, bn: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [out, in] -> (float8_e4m3fn weight, float32 weight_scale_inv [ceil(out/bm), ceil(in/bn)], the values they
    define: each block's fp8 values times its scale, in fp32): the block's largest |value| mapped to 448; where the
    block does not divide the weight, the last row / column of blocks is the part that is there (DeepSeek's grid)."""
    rows, cols = w.shape
    pr, pc = -rows % bm, -cols % bn
    blocks = torch.nn.functional.pad(w, (0, pc, 0, pr)).reshape((rows + pr) // bm, bm, (cols + pc) // bn, bn)
    scale = blocks.abs().amax((1, 3)).clamp_min(2.0 ** -100) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    values = (q.float() * scale[:, None, :, None]).reshape(rows + pr, cols + pc)[:rows, :cols]
    return q.reshape(rows + pr, cols + pc)[:rows, :cols].contiguous(), scale, values


def test_mxfp4_reads_as_its_definition():
    w = torch.randn(3, 64, 5, generator=torch.Generator().manual_seed(0))  # [E, in, out]
    blocks, scales, values = pack_mxfp4(w)
    got = dequantize(ReleaseFormat(MXFP4), {"blocks": blocks, "scales": scales})
    assert got.dtype == torch.bfloat16 and got.shape == w.shape
    assert torch.equal(got.float(), values)  # every e2m1 value times a power of two is exact in bf16
    assert (got.float() - w).abs().max() < 0.5 * w.abs().max()  # and it is the weight, 4-bit coarse
    one = dequantize(ReleaseFormat(MXFP4), {"blocks": blocks[1], "scales": scales[1]})  # one expert's
    assert torch.equal(one.float(), values[1])


def test_fp8_reads_as_its_definition():
    w = torch.randn(32, 48, generator=torch.Generator().manual_seed(1))
    q, scale, values = pack_fp8(w, 16, 16)
    got = dequantize(ReleaseFormat(FP8, block=(16, 16), fmt="e4m3"), {"weight": q, "scale": scale})
    assert got.dtype == torch.float32 and torch.equal(got, values)
    assert (got - w).abs().max() < 0.07 * w.abs().max()  # e4m3: 3 mantissa bits


def test_fp8_reads_partial_blocks_as_the_release_defines_them():
    """A block size that does not divide the weight (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows in 128-row blocks):
    one scale a block of the ceil grid, the last blocks partial. transformers' dequantizer wants whole blocks."""
    w = torch.randn(40, 20, generator=torch.Generator().manual_seed(2))
    q, scale, values = pack_fp8(w, 16, 16)
    assert scale.shape == (3, 2)
    got = dequantize(ReleaseFormat(FP8, block=(16, 16), fmt="e4m3"), {"weight": q, "scale": scale})
    assert got.shape == (40, 20) and torch.equal(got, values)
    assert (got - w).abs().max() < 0.07 * w.abs().max()


def test_the_published_releases_declare_their_formats():
    gpt = json.loads((CONFIGS / "gpt-oss-20b.json").read_text())
    ds = json.loads((CONFIGS / "deepseek-v3.json").read_text())
    assert release_format(gpt).method == MXFP4
    f = release_format(ds)
    assert (f.method, f.fmt, f.block) == (FP8, "e4m3", (128, 128))
    assert release_format({"model_type": "olmoe"}) is None
    assert release_format({"quantization_config": {"group_size": 64, "bits": 4}}) is None  # mlx-lm's own


@pytest.mark.parametrize("q,needle", [
    ({"quant_method": "gptq"}, "quant_method 'gptq' is not a format read here"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size [128] is not two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size [0, 128]"),
    ("fp8", "quantization_config is str"),
])
def test_an_unknown_or_malformed_quantization_config_names_the_field(q, needle):
    with pytest.raises(CheckpointError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        release_format({"quantization_config": q})


MX = ReleaseFormat(MXFP4)
F8 = ReleaseFormat(FP8, block=(16, 16), fmt="e4m3")
S = Path("model.safetensors")


def test_a_release_index_is_the_checkpoint_it_defines():
    raw = {"m.layers.0.mlp.experts.down_proj_blocks": (S, "U8", (4, 64, 2, 16)),
           "m.layers.0.mlp.experts.down_proj_scales": (S, "U8", (4, 64, 2)),
           "m.layers.0.mlp.router.weight": (S, "BF16", (4, 64))}
    idx = released_index(raw, MX)
    assert idx.entries == {"m.layers.0.mlp.experts.down_proj": (S, "BF16", (4, 64, 64)),
                           "m.layers.0.mlp.router.weight": (S, "BF16", (4, 64))}
    assert idx.parts == {"m.layers.0.mlp.experts.down_proj": {"blocks": "m.layers.0.mlp.experts.down_proj_blocks",
                                                              "scales": "m.layers.0.mlp.experts.down_proj_scales"}}
    raw = {"m.layers.0.self_attn.q_proj.weight": (S, "F8_E4M3", (32, 48)),
           "m.layers.0.self_attn.q_proj.weight_scale_inv": (S, "F32", (2, 3)),
           "m.layers.0.input_layernorm.weight": (S, "BF16", (48,))}
    idx = released_index(raw, F8)
    assert idx.entries["m.layers.0.self_attn.q_proj.weight"] == (S, "F32", (32, 48))
    assert idx.entries["m.layers.0.input_layernorm.weight"] == (S, "BF16", (48,))
    assert set(idx.parts) == {"m.layers.0.self_attn.q_proj.weight"}


@pytest.mark.parametrize("fmt,raw,needle", [
    (MX, {"e.gate_up_proj_blocks": (S, "U8", (4, 64, 2, 16)), "e.gate_up_proj_scales": (S, "U8", (4, 64, 3))},
     r"tensor e.gate_up_proj_scales: U8 \[4, 64, 3\] does not fit e.gate_up_proj_blocks"),
    (MX, {"e.gate_up_proj_blocks": (S, "U8", (4, 64, 2, 16))}, "tensor e.gate_up_proj_blocks: MXFP4 blocks without"),
    (MX, {"e.gate_up_proj_scales": (S, "U8", (4, 64, 2))}, "tensor e.gate_up_proj_scales: MXFP4 scales without"),
    (MX, {"e.gate_up_proj_blocks": (S, "BF16", (4, 64, 2, 16)), "e.gate_up_proj_scales": (S, "U8", (4, 64, 2))},
     "tensor e.gate_up_proj_blocks: BF16 .* is not MXFP4 blocks"),
    (F8, {"p.weight": (S, "F8_E4M3", (40, 48)), "p.weight_scale_inv": (S, "F32", (2, 3))},  # the floor grid
     r"tensor p.weight_scale_inv: F32 \[2, 3\] does not fit p.weight \[40, 48\] \(one scale a \[16, 16\] block: "
     r"want a float \[3, 3\]"),
    (F8, {"p.weight": (S, "F8_E4M3", (32, 48)), "p.weight_scale_inv": (S, "F32", (2, 2))},
     r"tensor p.weight_scale_inv: F32 \[2, 2\] does not fit p.weight \[32, 48\]"),
    (F8, {"p.weight": (S, "F8_E4M3", (32, 48))}, "tensor p.weight: F8_E4M3 without its weight_scale_inv"),
    (F8, {"p.weight_scale_inv": (S, "F32", (2, 3))}, "tensor p.weight_scale_inv: an FP8 scale without p.weight"),
    (F8, {"p.weight": (S, "F8_E5M2", (32, 48)), "p.weight_scale_inv": (S, "F32", (2, 3))},
     "tensor p.weight is F8_E5M2: config.json declares FP8 e4m3"),
])
def test_a_malformed_release_names_the_tensor(fmt, raw, needle):
    with pytest.raises(CheckpointError, match=needle):
        released_index(raw, fmt)


def test_the_production_packers_write_what_the_format_defines():
    """models/release_formats.pack (what the seeded --config checkpoints are written with) against the formats'
    definitions computed here: MXFP4 by the OCP MX rule (shared exponent floor(log2 amax) - 2, nearest e2m1,
    saturated at 6), FP8 per block of the ceil grid (partial blocks included), each read back by `dequantize`."""
    from models.release_formats import pack

    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 64, 6, generator=g) * torch.logspace(-3, 1, 6)  # [E, in, out], a scale per output
    w[0, :32, 0] = 0.0  # an all-zero block
    name = "model.layers.0.mlp.experts.gate_up_proj"
    parts = pack(MX, name, w)
    assert set(parts) == {name + "_blocks", name + "_scales"}
    got = dequantize(MX, {"blocks": parts[name + "_blocks"], "scales": parts[name + "_scales"]}).float()
    t = w.transpose(-1, -2).reshape(2, 6, 2, 32)
    amax = t.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax.clamp_min(1e-30))) - 2)
    x = (t / scale).clamp(-6, 6)
    mags = E2M1[:8]
    want = mags[(x.abs()[..., None] - mags).abs().argmin(-1)] * x.sign() * scale
    want = torch.where(amax > 0, want, torch.zeros_like(want)).reshape(2, 6, 64).transpose(-1, -2)
    assert torch.equal(got, want)
    f8 = ReleaseFormat(FP8, block=(16, 16), fmt="e4m3")
    w = torch.randn(40, 20, generator=g)
    parts = pack(f8, "p.weight", w)
    q, s = parts["p.weight"], parts["p.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and q.shape == (40, 20) and s.shape == (3, 2)
    got = dequantize(f8, {"weight": q, "scale": s})
    blocks = torch.nn.functional.pad(w, (0, 12, 0, 8)).reshape(3, 16, 2, 16)
    assert torch.allclose(s, blocks.abs().amax((1, 3)) / 448.0, rtol=1e-6)  # the block's largest |value| at 448
    assert torch.equal(got, (q.float() * s.repeat_interleave(16, 0)[:40].repeat_interleave(16, 1)[:, :20]))
    assert (got - w).abs().max() < 0.07 * w.abs().max()


def test_a_release_packs_what_its_release_packs():
    from models.release_formats import packs

    ds = release_format(json.loads((CONFIGS / "deepseek-v3.json").read_text()))
    gpt = release_format(json.loads((CONFIGS / "gpt-oss-20b.json").read_text()))
    assert packs(ds, "model.layers.5.self_attn.kv_a_proj_with_mqa.weight", (576, 7168))
    assert packs(ds, "model.layers.5.mlp.experts.17.down_proj.weight", (7168, 2048))
    assert not packs(ds, "model.layers.5.mlp.gate.weight", (256, 7168))  # the router stays bf16
    assert not packs(ds, "model.embed_tokens.weight", (129280, 7168)) and not packs(ds, "lm_head.weight", (1, 2))
    assert packs(gpt, "model.layers.0.mlp.experts.gate_up_proj", (32, 2880, 5760))
    assert not packs(gpt, "model.layers.0.self_attn.q_proj.weight", (4096, 2880))  # modules_to_not_convert
    assert not packs(gpt, "model.layers.0.mlp.experts.gate_up_proj_bias", (32, 5760))
    # MiniMax-M2's spelling of the format and its modules_to_not_convert (transformers' own pattern matching)
    mm = release_format({"quantization_config": {"quant_method": "fp8", "fmt": "float8_e4m3fn",
                                                 "weight_block_size": [128, 128],
                                                 "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}})
    assert mm.fmt == "e4m3"
    assert not packs(mm, "model.layers.0.block_sparse_moe.gate.weight", (256, 3072))
    assert packs(mm, "model.layers.0.block_sparse_moe.experts.3.w1.weight", (1536, 3072))
    assert packs(mm, "model.layers.0.self_attn.q_proj.weight", (6144, 3072))
    from models.release_formats import CT

    ct = ReleaseFormat(CT, fmt="e4m3", strategy="channel", skip=("re:.*self_attn.q_proj$",))  # a regex of `ignore`
    assert not packs(ct, "model.layers.3.self_attn.q_proj.weight", (64, 64))
    assert packs(ct, "model.layers.3.self_attn.k_proj.weight", (32, 64))


def ct_config(strategy="channel", **weights):
    """compressed-tensors' float-quantized quantization_config, as llm-compressor writes it."""
    w = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False, **weights}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w,
                                          "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}},
            "ignore": ["lm_head", "re:.*mlp.gate$"]}


def test_compressed_tensors_float_quantized_reads_as_its_definition():
    """weight = its e4m3 values times weight_scale: one for the tensor, one per output row, or one per block."""
    from models.release_formats import CT

    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 20, generator=g)
    for strategy, extra in (("tensor", {}), ("channel", {}), ("block", {"block_structure": [16, 16]})):
        fmt = release_format({"quantization_config": ct_config(strategy, **extra)})
        assert (fmt.method, fmt.strategy, fmt.fmt) == (CT, strategy, "e4m3") and "compressed-tensors" in fmt.describe()
        if strategy == "block":
            q, s, values = pack_fp8(w, 16, 16)
        else:
            s = (w.abs().amax() if strategy == "tensor" else w.abs().amax(1, keepdim=True)) / 448.0
            q = (w / s).to(torch.float8_e4m3fn)
            values = q.float() * s
            s = s.reshape(1) if strategy == "tensor" else s
        got = dequantize(fmt, {"weight": q, "scale": s})
        assert got.dtype == torch.float32 and torch.equal(got, values), strategy
        assert (got - w).abs().max() < 0.07 * w.abs().max()
        from models.release_formats import pack  # the production packer writes what reads back so

        parts = pack(fmt, "p.weight", w)
        assert set(parts) == {"p.weight", "p.weight_scale"} and parts["p.weight_scale"].dim() == s.dim()
        back = dequantize(fmt, {"weight": parts["p.weight"], "scale": parts["p.weight_scale"]})
        assert (back - w).abs().max() < 0.07 * w.abs().max()


@pytest.mark.parametrize("change,needle", [
    ({"format": "pack-quantized"}, "quantization_config.format 'pack-quantized' (compressed-tensors) is not a format"),
    ({"config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}}},
     "is not 8-bit float weights"),
    ({"config_groups": {"a": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"}},
                        "b": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}}},
     "groups with different weights schemes are not read (a, b)"),
    ({"config_groups": {"g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}},
     "weights.block_structure None is not two positive integers"),
])
def test_a_compressed_tensors_config_not_read_here_names_the_field(change, needle):
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        release_format({"quantization_config": {**ct_config(), **change}})


def test_a_compressed_tensors_index_drops_the_activation_scales_and_checks_the_weights():
    fmt = release_format({"quantization_config": ct_config()})
    raw = {"m.layers.0.self_attn.q_proj.weight": (S, "F8_E4M3", (32, 48)),
           "m.layers.0.self_attn.q_proj.weight_scale": (S, "BF16", (32, 1)),
           "m.layers.0.self_attn.q_proj.input_scale": (S, "F32", (1,)),
           "m.layers.0.mlp.gate.weight": (S, "BF16", (8, 48))}
    idx = released_index(raw, fmt)
    assert set(idx.entries) == {"m.layers.0.self_attn.q_proj.weight", "m.layers.0.mlp.gate.weight"}
    assert idx.parts["m.layers.0.self_attn.q_proj.weight"] == {
        "weight": "m.layers.0.self_attn.q_proj.weight", "scale": "m.layers.0.self_attn.q_proj.weight_scale"}
    raw["m.layers.0.self_attn.q_proj.weight_scale"] = (S, "BF16", (32, 48))
    with pytest.raises(CheckpointError, match=r"weight_scale: BF16 \[32, 48\] does not fit .*one scale per output row"):
        released_index(raw, fmt)
