"""Checkpoints in the formats their releases ship (issue 77): tiny gpt-oss with MXFP4 experts and tiny DeepSeek-V3
with FP8 block-scaled linears, packed here from HF-initialised weights by the packers of
tests/test_release_formats.py, each beside its dequantized twin (the same model with the packed values written
plainly, by the formats' definitions). `oracle check --model-dir` reads the release as released: the same
reference (tokens and logits, exactly) and the same verdict as the twin's; a malformed one is exit 2 naming the
tensor before any work."""

import json
import shutil
from pathlib import Path
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import get_family
from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.reference.cached import reference_of
from oracle.source.seeded import write_tiny_checkpoint
from oracle.source.sources import model_source, prompt_tokens
from tests.test_release_formats import pack_fp8, pack_mxfp4

# 16 x 16: q_a_proj / kv_a_proj_with_mqa [24, 64] and q_b_proj [96, 24] end in partial blocks (as the release's
# kv_a_proj_with_mqa [576, 7168] does in 128 x 128 ones), the others are whole blocks
FP8_BLOCK = (16, 16)
FP8_LINEAR = ("self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
              "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight", "gate_proj.weight", "up_proj.weight",
              "down_proj.weight")  # DeepSeek-V3's release: every attention and MLP linear (not the router, norms, head)


def _seeded(family: str, cfg: dict, out):
    """The family's tiny checkpoint of `cfg` (fp32, as the tiny ones are written), as HF saves it."""
    fam = get_family(family)
    out.mkdir(parents=True)
    write_tiny_checkpoint(fam.hf_config(cfg), fam.hf_class(), 0, out, fam.tiny_std)
    return load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())


def _write(out, tensors: dict, cfg: dict):
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=1, sort_keys=True))


@pytest.fixture(scope="module")
def gpt_oss_release(tmp_path_factory):
    """(release dir, twin dir): the experts as *_blocks / *_scales, quantization_config mxfp4."""
    tmp = tmp_path_factory.mktemp("gpt_oss")
    # MXFP4 packs 32 inputs a scale: the tiny config's intermediate size (48) is not a multiple of 32
    cfg = {**get_family("gpt_oss").tiny_config, "intermediate_size": 64}
    sd, cfg = _seeded("gpt_oss", cfg, tmp / "seeded")
    release, twin = {}, {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, values = pack_mxfp4(v)
            release[k + "_blocks"], release[k + "_scales"] = blocks, scales
            twin[k] = values
        else:
            release[k] = twin[k] = v
    _write(tmp / "release", release, {**cfg, "quantization_config": {"quant_method": "mxfp4"}})
    _write(tmp / "twin", twin, cfg)
    return tmp / "release", tmp / "twin"


def _fp8_release(tmp, block):
    """(release dir, twin dir): every attention and MLP linear float8_e4m3fn with weight_scale_inv per block."""
    sd, cfg = _seeded("deepseek_v3", get_family("deepseek_v3").tiny_config, tmp / "seeded")
    cfg["scoring_func"] = "sigmoid"  # the release's config.json has it (llama.cpp's converter reads it)
    release, twin = {}, {}
    for k, v in sd.items():
        if k.endswith(FP8_LINEAR) and ".layers." in k:
            q, scale, values = pack_fp8(v, *block)
            release[k], release[k + "_scale_inv"] = q, scale
            twin[k] = values
        else:
            release[k] = twin[k] = v
    q = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    _write(tmp / "release", release, {**cfg, "quantization_config": q})
    _write(tmp / "twin", twin, cfg)
    return tmp / "release", tmp / "twin"


@pytest.fixture(scope="module")
def deepseek_release(tmp_path_factory):
    return _fp8_release(tmp_path_factory.mktemp("deepseek_v3"), FP8_BLOCK)


@pytest.fixture(scope="module")
def deepseek_release_128(tmp_path_factory):
    """The release's own block size, 128 x 128 (every tiny linear one partial block): what mlx-lm reads."""
    return _fp8_release(tmp_path_factory.mktemp("deepseek_v3_128"), (128, 128))


def _same_as_twin(family, release, twin):
    specs = [CheckSpec(family=family, backend="eager", model_dir=str(d)) for d in (release, twin)]
    srcs = [model_source(s) for s in specs]
    assert srcs[0].args == srcs[1].args  # the release defines the twin's model
    refs = [reference_of(s, src, prompt_tokens(s, src.args.vocab_size)) for s, src in zip(specs, srcs)]
    assert refs[0].tokens == refs[1].tokens
    # the same weights, bit for bit (the prefill's logits are equal); a decode step's matrix-vector products
    # round by where the weights sit in memory (a mapped shard's or a dequantized tensor's alignment): 1e-6 here
    for a, b in zip(refs[0].logits, refs[1].logits):
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b), atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.as_tensor(refs[0].logits[0]), torch.as_tensor(refs[1].logits[0]))
    for backend in ("eager", "hf"):  # the production model from the dequantized tensors; HF's loader of the format
        rows = [run_check(replace(s, backend=backend)) for s in specs]
        assert rows[0].status == rows[1].status == "pass", (backend, rows[0].worst, rows[0].error)
        assert rows[0].e2e.token_exact and rows[1].e2e.token_exact
        fmt = rows[0].provenance["checkpoint"]["release_format"]
        assert fmt.startswith(("MXFP4", "FP8", "compressed-tensors")) and "release_format" not in rows[1].provenance["checkpoint"]
        from oracle.reports.markdown import markdown

        assert f"Release format: {fmt}, dequantized by the format's definition" in markdown(rows[0].to_dict())


def test_mxfp4_release_is_checked_as_released(gpt_oss_release):
    _same_as_twin("gpt_oss", *gpt_oss_release)


def test_fp8_release_is_checked_as_released(deepseek_release):
    _same_as_twin("deepseek_v3", *deepseek_release)


@pytest.fixture(scope="module")
def ct_release(tmp_path_factory):
    """(release dir, twin dir): tiny Qwen3-MoE as llm-compressor's FP8 (compressed-tensors float-quantized, a scale
    per output row: Qwen3 FP8-Dynamic releases) writes it: every decoder linear but the router float8_e4m3fn beside
    its weight_scale [out, 1]."""
    from tests.test_release_formats import ct_config

    tmp = tmp_path_factory.mktemp("qwen3_moe_ct")
    sd, cfg = _seeded("qwen3_moe", get_family("qwen3_moe").tiny_config, tmp / "seeded")
    release, twin = {}, {}
    for k, v in sd.items():
        if ".layers." in k and k.endswith("proj.weight") and v.dim() == 2:
            scale = v.abs().amax(1, keepdim=True).clamp_min(2.0 ** -100) / 448.0
            q = (v / scale).to(torch.float8_e4m3fn)
            release[k], release[k + "_scale"] = q, scale.bfloat16()
            twin[k] = q.float() * scale.bfloat16().float()
        else:
            release[k] = twin[k] = v
    _write(tmp / "release", release, {**cfg, "quantization_config": ct_config("channel")})
    _write(tmp / "twin", twin, cfg)
    return tmp / "release", tmp / "twin"


def test_compressed_tensors_fp8_release_is_checked_as_released(ct_release):
    """eager and hf as the twin; mlx-lm refuses compressed-tensors' float-quantized (its own loader's reason, the
    check's error); llama.cpp's converter dequantizes it (per-row scales) and passes at fp32."""
    _same_as_twin("qwen3_moe", *ct_release)
    pytest.importorskip("mlx_lm")
    row = run_check(CheckSpec(family="qwen3_moe", backend="mlx", model_dir=str(ct_release[0])))
    assert row.status == "error" and "unsupported compressed-tensors format 'float-quantized'" in row.error
    pytest.importorskip("llama_cpp")
    row = run_check(CheckSpec(family="qwen3_moe", backend="llamacpp", model_dir=str(ct_release[0])))
    assert row.status == "pass" and row.spec["precision"] == "fp32", (row.error, row.worst)


def test_a_malformed_release_is_refused_naming_the_tensor(deepseek_release, tmp_path):
    release, _ = deepseek_release
    bad = tmp_path / "bad"
    shutil.copytree(release, bad)
    sd = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    sd[name] = sd[name][:-1]  # a scale row short
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(InputError, match=rf"tensor {name}: F32 \[3, 4\] does not fit"):
        model_source(CheckSpec(family="deepseek_v3", backend="eager", model_dir=str(bad)))
    cfg = json.loads((release / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "bitsandbytes"
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InputError, match="quantization_config.quant_method 'bitsandbytes' is not a format read here"):
        model_source(CheckSpec(family="deepseek_v3", backend="eager", model_dir=str(bad)))
    from oracle.cli import main  # and `oracle check` says so: exit 2, before any work (no report written)

    out = tmp_path / "r.json"
    assert main(["check", "--family", "deepseek_v3", "--backend", "eager", "--model-dir", str(bad),
                 "--json", str(out)]) == 2
    assert not out.exists()


def transformers_loader(family, release):
    """transformers' own loader of the release, dequantizing (from_pretrained with Mxfp4Config /
    FineGrainedFP8Config(dequantize=True)): what the reference is checked against where it is right."""
    from transformers import FineGrainedFP8Config, Mxfp4Config

    from models.checkpoint import read_config
    from models.release_formats import MXFP4, release_format

    fmt = release_format(read_config(release))
    q = (Mxfp4Config(dequantize=True, modules_to_not_convert=list(fmt.skip) or None) if fmt.method == MXFP4
         else FineGrainedFP8Config(dequantize=True, weight_block_size=fmt.block))
    return family.hf_class().from_pretrained(release, quantization_config=q, dtype=torch.float32,
                                             attn_implementation="eager", experts_implementation="eager")


X = torch.arange(3, 11)[None]


@pytest.mark.parametrize("which", ["gpt_oss_release", "deepseek_release_128"])
def test_the_reference_reads_a_release_as_transformers_does(which, request):
    """The reference's reading of a release, streamed (each decoder layer read and dequantized for its forward) and
    whole (every layer read once and kept), computes what transformers' own loader of it does where its blocks
    are whole (there the scale grid says the block size)."""
    from oracle.reference.streaming import load_hf_model

    release, _ = request.getfixturevalue(which)
    family = get_family({"gpt_oss_release": "gpt_oss", "deepseek_release_128": "deepseek_v3"}[which])
    with torch.no_grad():
        theirs = transformers_loader(family, release)(X).logits
        whole = load_hf_model(family, release)(X).logits
        streamed = load_hf_model(family, release, streamed=True)(X).logits
    assert not hasattr(load_hf_model(family, release), "_oracle_streams")  # whole: nothing is dropped
    torch.testing.assert_close(whole, theirs, atol=1e-5, rtol=1e-5)  # (alignment, as above)
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=1e-5)


def test_a_decode_step_reads_only_the_chosen_experts_of_a_release(gpt_oss_release):
    """gpt-oss's MXFP4 experts are stored stacked: a streamed decode step (one token, 2 of 8 experts) reads and
    dequantizes only the chosen experts' rows of the packed tensors, and computes what the whole model does, bit
    for bit; a prefill (8 tokens: 16 choices) reads the layer whole."""
    from oracle.reference.streaming import load_hf_model, streamed_bytes

    family, release = get_family("gpt_oss"), gpt_oss_release[0]
    whole, streamed = load_hf_model(family, release), load_hf_model(family, release, streamed=True)
    assert all(len(s.fused) == 4 and s.count == 8 for s in streamed._oracle_streams)
    with torch.no_grad():
        before = streamed_bytes(streamed)
        step = streamed(torch.tensor([[5]])).logits
        one = streamed_bytes(streamed) - before
        prefill = streamed(X).logits
        full = streamed_bytes(streamed) - before - one
        assert torch.equal(step, whole(torch.tensor([[5]])).logits) and torch.equal(prefill, whole(X).logits)
    assert one < 0.7 * full  # the attention and router read whole either way; the experts a quarter


@pytest.mark.xfail(strict=True, reason="transformers 5.23 Fp8Dequantize._dequantize_one takes the block size from the "
                   "scale grid (rows // scale_rows): a weight whose last blocks are partial (24 rows in 16-row blocks: "
                   "2 scale rows) is read in blocks of 12, another model than the release's; the reference reads it by "
                   "weight_block_size (models/release_formats.py). XPASS: upstream fixed it, drop the xfail")
def test_transformers_loader_of_partial_fp8_blocks_is_the_release(deepseek_release):
    from oracle.reference.streaming import load_hf_model

    family = get_family("deepseek_v3")
    with torch.no_grad():
        theirs = transformers_loader(family, deepseek_release[0])(X).logits
        ours = load_hf_model(family, deepseek_release[0])(X).logits
    torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("which", ["gpt_oss_release", "deepseek_release"])
def test_the_production_weights_of_a_release_are_its_twins(which, request):
    """What the compiled backends build from (Family.production_tensors: IREE's parameter archive, the ExecuTorch
    and Inductor models' weights), a decoder layer at a time: the release's, dequantized as read, are the twin's bit
    for bit."""
    release, twin = request.getfixturevalue(which)
    family = get_family({"gpt_oss_release": "gpt_oss", "deepseek_release": "deepseek_v3"}[which])
    args = model_source(CheckSpec(family=family.name, backend="eager", model_dir=str(twin))).args
    groups = [list(family.production_tensors(d, args)) for d in (release, twin)]
    assert len(groups[0]) == len(groups[1]) == args.num_hidden_layers + 1
    for a, b in zip(*groups):
        assert sorted(a) == sorted(b)
        assert all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- the runtimes' own readings of a release

def test_mlx_keeps_an_mxfp4_release_packed_and_computes_its_model(gpt_oss_release):
    """mlx-lm reads the release as mlx_lm.utils.load_model does (the experts quantized mxfp4 before the weights
    load: their blocks and scales as released, run by mlx's MXFP4 kernels): the check passes, as the twin's."""
    pytest.importorskip("mlx_lm")
    rows = [run_check(CheckSpec(family="gpt_oss", backend="mlx", model_dir=str(d))) for d in gpt_oss_release]
    assert rows[0].status == rows[1].status == "pass", (rows[0].error, rows[0].worst)
    assert rows[0].e2e.reference_tokens == rows[1].e2e.reference_tokens
    kept = rows[0].provenance["backend"]["release_quantization"]
    assert kept["mode"] == "mxfp4" and sorted(kept["quantized"]) == sorted(
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj"))
    assert "release_quantization" not in rows[1].provenance["backend"]


def test_mlx_lm_reads_an_fp8_release_in_bfloat16(deepseek_release_128):
    """mlx-lm's deepseek_v3 sanitize dequantizes FP8 to bfloat16: its weights are the twin's rounded to bf16, bit
    for bit, so at fp32 it computes another model than the release's (the known divergence's cause, measured),
    and the check says so (xfail with that cause, not a pass and not a refusal)."""
    pytest.importorskip("mlx_lm")
    import mlx.core as mx
    import numpy as np

    from exporters.mlx.load import load_model

    release, twin = deepseek_release_128
    src = model_source(CheckSpec(family="deepseek_v3", backend="mlx", model_dir=str(release)))
    model, _ = load_model(src)
    w = model.model.layers[1].self_attn.o_proj.weight
    plain = load_file(str(twin / "model.safetensors"))["model.layers.1.self_attn.o_proj.weight"]
    assert w.dtype == mx.bfloat16
    assert np.array_equal(np.array(w.astype(mx.float32)), plain.bfloat16().float().numpy())
    assert not torch.equal(plain.bfloat16().float(), plain)  # (and that is a rounding)
    row = run_check(CheckSpec(family="deepseek_v3", backend="mlx", model_dir=str(release)))
    assert row.status == "xfail" and "dequantizes an FP8 release to bfloat16" in row.expected["cause"], row.expected


def _packed_fp8(family: str, tmp) -> tuple[dict, object]:
    """(the tiny checkpoint's tensors as an FP8 release in 128 x 128 blocks, by the production packer
    (models/release_formats.pack, as the seeded --config checkpoints are), written beside its plain one: tmp / plain
    and tmp / release)."""
    from models.release_formats import FP8, ReleaseFormat, pack, packs

    sd, cfg = _seeded(family, get_family(family).tiny_config, tmp / "plain")
    fmt = ReleaseFormat(FP8, block=(128, 128), fmt="e4m3")
    release = {}
    for k, v in sd.items():
        release.update(pack(fmt, k, v) if v.is_floating_point() and packs(fmt, k, v.shape) else {k: v})
    _write(tmp / "release", release, {**cfg, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
                                                                     "weight_block_size": [128, 128]}})
    return release, tmp / "release"


def test_mlx_lm_reads_minimax_fp8_in_bfloat16_too(tmp_path):
    """MiniMax-M2's FP8 release through mlx-lm (its minimax sanitize dequantizes to bf16 as deepseek_v3's does):
    the same known divergence, while the plain checkpoint passes."""
    pytest.importorskip("mlx_lm")
    tensors, release = _packed_fp8("minimax_m2", tmp_path)
    assert any(k.endswith("w1.weight_scale_inv") for k in tensors)
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"].dtype == torch.float32  # the router stays
    plain = run_check(CheckSpec(family="minimax_m2", backend="mlx", model_dir=str(tmp_path / "plain")))
    row = run_check(CheckSpec(family="minimax_m2", backend="mlx", model_dir=str(release)))
    assert plain.status == "pass", (plain.error, plain.worst)
    assert row.status == "xfail" and "minimax sanitize() dequantizes an FP8 release to bfloat16" in row.expected["cause"]


def test_an_fp8_release_mlx_lm_cannot_read_is_its_error_with_the_reason(tmp_path):
    """Qwen3-MoE's FP8 releases: mlx-lm 0.32.2's qwen3_moe sanitize() has no FP8 dequantization, so its model
    cannot load the release: the check's error says so (not mlx's "parameters not in model")."""
    pytest.importorskip("mlx_lm")
    _, release = _packed_fp8("qwen3_moe", tmp_path)
    row = run_check(CheckSpec(family="qwen3_moe", backend="mlx", model_dir=str(release)))
    assert row.status == "error" and "mlx-lm's qwen3_moe does not read an FP8 release" in row.error, row.error


def test_llamacpp_converts_a_release_as_its_converter_does(gpt_oss_release, deepseek_release):
    """llama.cpp's converter keeps MXFP4 experts as GGML MXFP4 (whose dot products take Q8_0 activations: the check
    is judged at a8, HF computing the same way) and dequantizes FP8 by weight_block_size, partial blocks too
    (an f32 GGUF: judged at fp32)."""
    pytest.importorskip("llama_cpp")
    from exporters.llamacpp.backend import BACKEND
    from exporters.llamacpp.gguf import reader

    ok, why = BACKEND.availability()
    if not ok:
        pytest.skip(why)
    mx = run_check(CheckSpec(family="gpt_oss", backend="llamacpp", model_dir=str(gpt_oss_release[0])))
    assert mx.status == "pass" and mx.spec["precision"] == "a8", (mx.error, mx.worst)
    assert mx.provenance["checkpoint"]["arithmetic"].startswith("a8:")
    spec = CheckSpec(family="gpt_oss", backend="llamacpp", model_dir=str(gpt_oss_release[0]))
    gguf = BACKEND.gguf(model_source(spec), spec).path  # the conversion the check ran (cached)
    types = {t.name: t.tensor_type.name for t in reader(gguf).tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "MXFP4" and types["blk.0.attn_q.weight"] == "F32"
    moe = [b for b in mx.blocks if b.kind == "moe"]
    # the a8 error is llama.cpp's own: about HF a8's on the same block (not a loosened limit: the blocks' own)
    assert all(0.3 < b.metrics["max_abs"] / b.metrics["noise_max_abs"] < 3 for b in moe), [b.metrics for b in moe]
    fp8 = run_check(CheckSpec(family="deepseek_v3", backend="llamacpp", model_dir=str(deepseek_release[0])))
    assert fp8.status == "pass" and fp8.spec["precision"] == "fp32", (fp8.error, fp8.worst)
    assert fp8.e2e.token_exact


def test_the_weight_check_finds_a_releases_mxfp4_experts_exactly(gpt_oss_release, tmp_path):
    """`oracle export` of the release, then `oracle check --gguf` with the release as the original: the MXFP4 experts
    are the release's values exactly; one block's e8m0 scale one step up (its 32 values doubled) fails naming the
    tensor."""
    pytest.importorskip("llama_cpp")
    from exporters.llamacpp.setup import gguf_module
    from oracle.cli import main  # in this process: the conversion and the reference cached across the three

    release = str(gpt_oss_release[0])
    assert main(["export", "--family", "gpt_oss", "--backend", "llamacpp", "--model-dir", release,
                 "--output-dir", str(tmp_path)]) == 0
    path, j = tmp_path / "model.gguf", tmp_path / "r.json"
    check = ["check", "--family", "gpt_oss", "--backend", "llamacpp", "--model-dir", release, "--gguf", str(path),
             "--json", str(j)]
    assert main(check) == 0
    weights = json.loads(j.read_text())["quantization"]["weights"]
    assert weights["status"] == "pass" and not weights["unbounded"]
    exps = [w for w in weights["rows"] if "_exps.weight" in w["name"]]
    assert len(exps) == 6 and all(w["format"].startswith("MXFP4 (kept from the release") for w in exps)
    reader = gguf_module().GGUFReader(str(path), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_up_exps.weight")
    blocks = t.data.reshape(-1, 17)  # GGML MXFP4: an e8m0 scale byte, then 16 bytes of 32 e2m1 values
    blocks[5, 0] += 1
    reader.data.flush()
    assert main(check) == 1
    weights = json.loads(j.read_text())["quantization"]["weights"]
    assert weights["failed"] == 1 and weights["worst"]["name"] == "blk.1.ffn_up_exps.weight"



def test_a_shipped_mlx_directory_of_a_release_keeps_its_mxfp4_experts(gpt_oss_release, tmp_path):
    """`oracle export --backend mlx --precision q8` of the release (mlx-lm keeps the MXFP4 experts packed and
    quantizes the rest affine 8-bit, as mlx_lm.convert does), then `oracle check --candidate-dir` with the release
    as the original: the experts are the release's values exactly, the rest within 8-bit affine rounding; one
    expert block's e8m0 scale one step up fails the weight check naming the tensor."""
    pytest.importorskip("mlx_lm")
    from safetensors.numpy import load_file as load_np, save_file as save_np

    from oracle.cli import main

    release, out, j = str(gpt_oss_release[0]), tmp_path / "q8", tmp_path / "r.json"
    assert main(["export", "--family", "gpt_oss", "--backend", "mlx", "--precision", "q8", "--model-dir", release,
                 "--output-dir", str(out)]) == 0
    check = ["check", "--family", "gpt_oss", "--backend", "mlx", "--model-dir", release, "--candidate-dir", str(out),
             "--json", str(j)]
    assert main(check) == 0
    doc = json.loads(j.read_text())
    q, weights = doc["quantization"], doc["quantization"]["weights"]
    assert q["format"] == "mlx affine + mxfp4" and q["modules"]["4-bit g32 mxfp4"] == 6, q
    kept = [w for w in weights["rows"] if w["format"].startswith("mlx mxfp4 (kept from the release")]
    assert weights["status"] == "pass" and len(kept) == 6
    shard = next(out.glob("model*.safetensors"))
    sd = load_np(str(shard))
    name = "model.layers.1.mlp.experts.up_proj.scales"
    if name not in sd:
        shard = next(p for p in out.glob("model*.safetensors") if name in load_np(str(p)))
        sd = load_np(str(shard))
    sd[name] = sd[name].copy()
    sd[name].reshape(-1)[3] += 1
    save_np(sd, str(shard), metadata={"format": "mlx"})
    assert main(check) == 1
    weights = json.loads(j.read_text())["quantization"]["weights"]
    assert weights["failed"] == 1 and weights["worst"]["name"] == "model.layers.1.mlp.experts.up_proj.weight"

# ---------------------------------------------------------------- seeded checkpoints of the published releases

CONFIGS = Path(__file__).resolve().parents[1] / "models" / "configs"
NARROW = {  # the published configs at tiny widths: their quantization_config (the release's format) kept
    "gpt-oss-20b": dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2, vocab_size=256,
                        layer_types=["sliding_attention", "full_attention"], sliding_window=8, pad_token_id=None,
                        eos_token_id=None, bos_token_id=None),
    "deepseek-v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, vocab_size=256),
}


@pytest.mark.parametrize("name,family,packed", [("gpt-oss-20b", "gpt_oss", "U8"), ("deepseek-v3", "deepseek_v3", "F8_E4M3")])
def test_a_seeded_release_config_is_written_as_released(name, family, packed, tmp_path):
    """--config of a published config that declares its release's format writes the checkpoint in it (the path
    --config gpt-oss-20b / deepseek-v3 take at full width), and the check reads it as released."""
    from safetensors import safe_open

    cfg = {**json.loads((CONFIGS / f"{name}.json").read_text()), **NARROW[name]}
    path = tmp_path / f"{name}-narrow.json"
    path.write_text(json.dumps(cfg))
    row = run_check(CheckSpec(family=family, backend="eager", config=str(path)))
    assert row.status == "pass" and row.e2e.token_exact, (row.error, row.worst)
    assert row.provenance["checkpoint"]["release_format"].startswith(("MXFP4", "FP8"))
    with safe_open(str(Path(row.provenance["checkpoint"]["dir"]) / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
    assert sum(d == packed for d in dtypes.values()) >= 4, dtypes
    router = "model.layers.1.mlp.router.weight" if family == "gpt_oss" else "model.layers.1.mlp.gate.weight"
    assert dtypes[router] == "BF16" and dtypes["model.embed_tokens.weight"] == "BF16"
