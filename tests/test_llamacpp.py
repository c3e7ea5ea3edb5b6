"""The llamacpp backend (exporters/llamacpp/): GGUFs written by llama.cpp's own converter and run
by llama.cpp, checked block by block (in-situ, read by its eval callback) and end to end against HF
fp32; its known divergences proven by their causes; a GGUF as shipped (--gguf, Q8_0 and Q4_K_M made
by llama.cpp's own quantizer) with both row sets; bad GGUFs refused by name; GGUF-level seeded
faults detected and localised; and the a8 arithmetic (oracle/verdict/arithmetic.py) it is judged by."""

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from oracle.source.seeded import tiny_checkpoint
from models import get_family
from oracle.verdict.arithmetic import RoundedActivations, round_blocks
from oracle.backend import CheckSpec
from oracle.check import run_check


@pytest.fixture(scope="module")
def llamacpp():
    pytest.importorskip("llama_cpp")
    from exporters.llamacpp import backend as llamacpp

    ok, why = llamacpp.BACKEND.availability()
    if not ok:
        pytest.skip(why)
    return llamacpp


def check(family, **kw):
    return run_check(CheckSpec(family=family, backend="llamacpp", **kw))


def rows(r):
    return {(b.layer, b.kind): b for b in r.blocks}


# families whose converted GGUF llama.cpp runs as HF does (the others: known divergences below, or
# the converter's refusal); `oracle check --backend llamacpp` over all fifteen is docs/llamacpp.md's table
# (the other passing families, qwen3_moe, qwen2_moe, mixtral, glm4_moe, granitemoe: their goldens in the nightly
# matrix and `oracle goldens check`; here the simplest and the one with sinks, biases and a clamped SwiGLU; and
# AFMoE, whose sandwich norms put a post-norm on every block's output: each row (its expert probes too, and the last
# layer's through its output-row selection) read before it)
@pytest.mark.parametrize("family", ["olmoe", "gpt_oss", "afmoe"])
def test_converted_gguf_passes_at_fp32(llamacpp, family):
    r = check(family)
    assert r.status == "pass", (r.error, r.worst)
    assert r.blocks and all(b.mode == "in-situ" or b.kind in ("router", "moe") for b in r.blocks)
    kinds = {b.kind for b in r.blocks}
    assert {"attention", "layer", "router", "moe", "logits"} <= kinds, kinds
    assert r.e2e.candidate_tokens == r.e2e.reference_tokens
    # an f32 GGUF, an f32 KV cache, no flash attention: the fp32 settings, within fp32 limits
    assert r.provenance["backend"]["gguf"]["outtype"] == "f32" and r.provenance["backend"]["gguf"]["kv"] == "f32"
    assert max(s["max_abs"] for s in r.e2e.steps) < 1e-4
    assert "graph_tensors" in r.structures and "ffn_moe_topk" in r.structures["graph_tensors"]
    # the invariance rows (oracle/verdict/invariance.py): llama.cpp chunks (llama_decode at the positions after a
    # first) and batches (a second context, one sequence id per prompt), each within the e2e limit of its own path
    rows = {row["name"]: row for row in r.invariance}
    assert list(rows) == ["repeat", "chunked", "batched"] and all(row["status"] == "pass" for row in rows.values())
    assert [run["run"] for run in rows["chunked"]["runs"]] == ["3+5", "1 x 8"]
    assert rows["batched"]["ratio"] < 1 and rows["batched"]["routing"].get("divergences", 0) == 0


def test_converter_refusal_names_the_converters_reason(llamacpp, cli):
    r = cli("check", "--family", "phimoe", "--backend", "llamacpp")
    assert r.returncode == 2
    assert "PhimoeForCausalLM is not supported by convert_hf_to_gguf.py" in r.stderr


def test_a_converter_that_cannot_read_transformers_config_is_its_expected_failure(llamacpp):
    """Bailing-hybrid, written as released (architectures BailingMoeV3ForCausalLM, no_kda_lora, head-wise gates,
    norm_topk_prob): llama.cpp's converter reads config.json through transformers 5.23's AutoConfig, whose to_dict()
    names norm_topk_prob moe_renormalize (BailingHybridConfig.attribute_map), and its bailingmoe3.py requires
    norm_topk_prob. The converter's exception on an architecture it registers is a defect of the candidate, not a
    refusal: the check's error at load (the converter's own reason), xfail by its known divergence (fails = load);
    an architecture it does not register stays a refusal (test_converter_refusal_names_the_converters_reason)."""
    r = check("bailing_hybrid")
    assert r.status == "xfail", (r.status, r.error)
    assert r.error.startswith("load: LoadError") and "KeyError: 'norm_topk_prob'" in r.error and "bailingmoe3.py" in r.error
    assert r.expected["failed"] == ["load"]


def test_one_converter_process_converts_one_checkpoint_after_another(llamacpp, tmp_path):
    """exporters.llamacpp.converter.Converter: a second conversion is the same child's (the converter's imports paid
    once), its GGUF byte for byte the one a fresh process writes (`python -m exporters.llamacpp convert`);
    the converter's error is that conversion's, the child goes on; a child that dies mid-conversion is that
    conversion's error (its exit status) and the next conversion gets a new child."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    from exporters.llamacpp.converter import Converter
    from exporters.llamacpp.setup import converter_dir

    conv = Converter()
    # the child is judged by what it holds (about 0.35 GiB after a tiny conversion), not by Linux's ru_maxrss,
    # which counts the parent's resident memory at the fork: a test worker of several GiB had every child ended
    conv.RECYCLE_BYTES = 640 << 20
    parent = np.ones(100_000_000)  # 0.8 GB resident here when the child is started
    src = tiny_checkpoint(get_family("olmoe"), 0)
    try:
        first = conv.run(src, tmp_path / "a.gguf", "f32")
        del parent
        pid = conv.proc.pid
        rc, result, text = conv.run(src, tmp_path / "missing" / "d.gguf", "f32")  # a directory that is not there
        assert first[0] == 0 and rc == 1 and result is None and "FileNotFoundError" in text and conv.proc.pid == pid
        second = conv.run(src, tmp_path / "b.gguf", "f32")
        assert second[0] == 0 and first[1] == second[1] and conv.proc.pid == pid
        fresh = subprocess.run([sys.executable, "-m", "exporters.llamacpp", "convert", str(src), str(tmp_path / "c.gguf"),
                                "f32"], cwd=ROOT, capture_output=True, text=True)
        assert fresh.returncode == 0 and json.loads(fresh.stdout.strip().splitlines()[-1]) == first[1]
        assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes() == (tmp_path / "c.gguf").read_bytes()

        conv.close()  # a child that dies on the conversion it is given
        conv.proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(7)"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        conv.where = str(converter_dir())
        assert conv.run(src, tmp_path / "f.gguf", "f32")[:2] == (7, None) and conv.proc is None
        assert conv.run(src, tmp_path / "g.gguf", "f32")[0] == 0
        assert (tmp_path / "g.gguf").read_bytes() == (tmp_path / "a.gguf").read_bytes()
    finally:
        conv.close()


def test_a_gguf_llama_cpp_cannot_load_is_its_expected_failure(llamacpp):
    """dots1's loader sizes K/V for n_head heads: the tiny GQA checkpoint is refused at load, the
    check is an error there, and the known divergence (fails = ["load"]) makes it xfail."""
    r = check("dots1")
    assert r.status == "xfail", (r.status, r.error)
    assert r.error.startswith("load: LoadError") and "blk.0.attn_k.weight" in r.error and "wrong shape" in r.error
    assert r.expected["failed"] == ["load"]


def _edited(family, tmp_path, **config):
    """The family's tiny checkpoint with config.json keys set (weights shared)."""
    src = tiny_checkpoint(get_family(family), 0)
    out = tmp_path / family
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(_merged(cfg, config)))
    return str(out)


def _merged(cfg: dict, config: dict) -> dict:
    """cfg with config's keys set, a dict merged key by key (a composite release's nested text config)."""
    return {**cfg, **{k: _merged(cfg[k], v) if isinstance(v, dict) and isinstance(cfg.get(k), dict) and k != "rope_parameters"
                      else v for k, v in config.items()}}


@pytest.mark.parametrize("family,config,cause", [
    # the converter reads the gating function from scoring_func, which transformers does not keep
    ("deepseek_v3", {"scoring_func": "sigmoid"}, "scoring_func"),
    # ... and (converted as DeepSeek-V2) the dense layers from first_k_dense_replace, which it does not keep either
    ("glm4_moe_lite", {"first_k_dense_replace": 1, "scoring_func": "sigmoid"}, "first_k_dense_replace"),
    # llama.cpp hard-codes Llama 4's chunk size and floor scale to the published 8192
    ("llama4", {"attention_chunk_size": 8192, "floor_scale": 8192}, "attention_chunk_size"),
    # the converter rotates GLM-4.5's default half of each head where the config names no partial_rotary_factor
    ("solar_open", {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 1.0}},
     "partial_rotary_factor"),
    # llama.cpp's interleaved M-RoPE leaves a frequency outside its sections at the 4th position, 0 for text
    ("qwen3_omni_moe", {"thinker_config": {"text_config": {"rope_parameters": {
        "rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [3, 3, 2], "interleaved": True,
        "mrope_interleaved": True}}}}, "4th dim is all 0"),
    # llama.cpp's mellum graph rotates the sliding layers with the full layers' rope base
    ("mellum", {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0}}},
     "rope_freq_base_swa"),
    # llama.cpp's laguna has no router softcap and assumes the release's full-every-4th layer pattern
    ("laguna", {"moe_router_logit_softcapping": 0.0,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]}, "softcap"),
    # llama.cpp's granite_swa reads no layer_rope_theta: one rope base for every layer
    ("granitemoe_swa", {"layer_rope_theta": [10000.0, 10000.0, 10000.0]}, "layer_rope_theta"),
    # llama.cpp's lfm2moe never scales the experts' weights by routed_scaling_factor (its short-conv layers pass)
    ("lfm2_moe", {"routed_scaling_factor": 1.0}, "expert_weights_scale"),
    # llama.cpp's Kimi delta attention l2-normalises q and k with rms_norm_eps under the root (HF's: a fixed 1e-6)
    ("kimi_linear", {"rms_norm_eps": 1e-6}, "sqrt(sum(x^2) + rms_norm_eps)"),
])
def test_known_divergences_are_their_causes(llamacpp, tmp_path, family, config, cause):
    """The tiny checkpoint fails where its entry says (xfail); with the cause removed from config.json
    every row passes: the entry names the real cause, not a tolerance."""
    r = check(family)
    assert r.status == "xfail", (r.status, r.error, r.worst)
    assert cause in r.expected["cause"]
    if family == "deepseek_v3":  # the drill names where: the scores (llama.cpp's softmax), the logits agree
        drill = r.drill["blocks"][0]
        assert drill["kind"] == "router" and drill["first_divergence"] == "scores", drill["verdict"]
    fixed = check(family, model_dir=_edited(family, tmp_path, **config))
    assert fixed.status == "pass", (fixed.error, fixed.worst)


def _gelu_fp16_table(x):
    """ggml-cpu's GELU (GGML_GELU_FP16, ggml-cpu/vec.h ggml_vec_geglu_f32): 0 at or below -10, x at or above 10, else
    its table: the tanh GELU of x rounded to fp16, the result rounded to fp16."""
    t = torch.nn.functional.gelu(x.half().float(), approximate="tanh").half().float()
    return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, t))


def test_gemma4_gelu_is_ggml_fp16_table(llamacpp):
    """gemma4's known divergence on llamacpp: read off llama.cpp's graph (tiny checkpoint, seed 0), both GeGLUs (the
    dense MLP's ffn_geglu-0, the experts' ffn_moe_geglu-0) are the fp16 table's GELU of llama.cpp's own gate times
    its up, bit for bit, and rel 3e-4 from torch's tanh GELU; HF's Gemma 4 with that GELU put in gives llama.cpp's
    layer 0 output to rel 3e-7 (without it 2e-4: the layer row's 69x its limit)."""
    from oracle.source.sources import model_source

    spec = CheckSpec(family="gemma4", backend="llamacpp")
    src = model_source(spec)
    toks = [5, 17, 200, 3, 99, 42, 7, 128, 61, 250]
    cand = llamacpp.BACKEND.load(src, spec)
    try:
        t = {k: torch.tensor(v) for k, v in cand._call("tensors", toks, list(range(len(toks))), [
            "ffn_gate-0", "ffn_up-0", "ffn_geglu-0", "ffn_moe_gate_up-0", "ffn_moe_geglu-0", "l_out-0", "attn_out-0",
            "ffn_norm_1-0", "ffn_moe-0"]).items()}
        rows = cand._call("blocks", toks, list(range(len(toks))), None, True)
    finally:
        cand.close()
    # the rows' reading of a MoE block fed the stream beside a dense MLP (Runner.stream_fed): the router's and the
    # block's input is the stream (the experts' pre-norm output gave top-k agreement 0.667), the block's output the
    # experts' sum post-normed, the dense MLP's input its own norm's output
    for key, name in (((0, "input:ffn"), "attn_out-0"), ((0, "moe_normed"), "ffn_moe-0"),
                      ((0, "input:mlp"), "ffn_norm_1-0")):
        assert torch.equal(torch.tensor(rows[key]).reshape(t[name].shape), t[name]), key
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    gate_up = t["ffn_moe_gate_up-0"]
    n = gate_up.shape[-1] // 2
    for geglu, gate, up in ((t["ffn_geglu-0"], t["ffn_gate-0"], t["ffn_up-0"]),
                            (t["ffn_moe_geglu-0"], gate_up[..., :n], gate_up[..., n:])):
        assert torch.equal(geglu, _gelu_fp16_table(gate) * up)
        assert rel(geglu, torch.nn.functional.gelu(gate, approximate="tanh") * up) > 1e-4
    import transformers

    class TableGelu(torch.nn.Module):
        def forward(self, x):
            return _gelu_fp16_table(x)

    hf = transformers.AutoModelForCausalLM.from_pretrained(src.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        exact = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states[1][0]
        for layer in hf.model.layers:
            layer.mlp.act_fn, layer.experts.act_fn = TableGelu(), TableGelu()
        table = hf(torch.tensor([toks]), output_hidden_states=True).hidden_states[1][0]
    assert rel(t["l_out-0"], table) < 2e-6 and rel(t["l_out-0"], exact) > 5e-5


def test_hy_v4_rotates_consecutive_pairs(llamacpp):
    """hy_v4's known divergence on llamacpp: read off llama.cpp's graph (tiny checkpoint, seed 0), layer 0's attention
    input is HF's and its output is not (rel 0.22); HF's HY-V4 with its rotations (the latent attention's and the
    indexer's) on consecutive pairs instead of rotate_half gives llama.cpp's output at every position."""
    import transformers
    from transformers.models.hy_v4 import modeling_hy_v4

    from oracle.source.sources import model_source

    spec = CheckSpec(family="hy_v4", backend="llamacpp")
    src = model_source(spec)
    toks = [172, 47, 117, 192, 67, 251, 195, 3]
    cand = llamacpp.BACKEND.load(src, spec)
    try:
        t = {k: torch.tensor(v) for k, v in cand._call("tensors", toks, list(range(len(toks))),
                                                       ["attn_norm-0", "attn_out-0"]).items()}
    finally:
        cand.close()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src.model_dir, dtype=torch.float32).eval()
    rec = {}
    hf.model.layers[0].self_attn.register_forward_hook(
        lambda m, a, kw, o: rec.update(x=kw["hidden_states"][0], out=o[0][0]), with_kwargs=True)

    def pairs(x, cos, sin):  # consecutive pairs (x0, x1), (x2, x3), ... rotated by HF's frequencies
        c, s = (v[..., : x.shape[-1] // 2].repeat_interleave(2, -1) for v in (cos, sin))
        return x * c + torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2) * s

    def rotate_pairs(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return pairs(q, cos, sin), pairs(k, cos, sin)

    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    with torch.no_grad():
        hf(torch.tensor([toks]))
        half = rec["out"].clone()
        assert rel(t["attn_norm-0"].reshape(rec["x"].shape), rec["x"]) < 1e-6  # the same input
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(modeling_hy_v4, "apply_rotary_pos_emb", rotate_pairs)
            hf(torch.tensor([toks]))
    out = t["attn_out-0"].reshape(half.shape)
    assert rel(out, half) > 0.1
    assert max(rel(out[p], rec["out"][p]) for p in range(len(toks))) < 3e-5


def _converted_hparams(llamacpp, family):
    """(the tiny checkpoint's source, the hyper-parameters llama.cpp's converter wrote into its f32 GGUF)."""
    from exporters.llamacpp.gguf import _hparams, arch_of, reader
    from oracle.source.sources import model_source

    spec = CheckSpec(family=family, backend="llamacpp")
    src = model_source(spec)
    r = reader(Path(llamacpp.BACKEND.gguf(src, spec).path))
    return src, _hparams(r, arch_of(r))


def test_minimax_m3_vl_is_converted_from_the_release_layout(llamacpp):
    """minimax_m3_vl's tiny checkpoint is written as released (MiniMaxM3SparseForCausalLM, per-expert w1/w3/w2 under
    block_sparse_moe, sparse_attention_config, moe_layer_freq: Family.release_config and the release's conversion
    registered for HF's class), which llama.cpp's converter takes: its indexer is the tiny config's (blocks of 2, 2 kept,
    one local, 2 heads), the first layer dense."""
    src, hp = _converted_hparams(llamacpp, "minimax_m3_vl")
    c = src.config
    assert (hp["minimax-m3.attention.indexer.block_size"], hp["minimax-m3.attention.indexer.top_k"],
            hp["minimax-m3.attention.indexer.local_blocks"], hp["minimax-m3.attention.indexer.head_count"]) == (
        c["index_block_size"], c["index_topk_blocks"], c["index_local_blocks"], c["index_n_heads"]) == (2, 2, 1, 2)
    assert hp["minimax-m3.leading_dense_block_count"] == 1 and hp["minimax-m3.expert_shared_count"] == 1


def test_qwen4_exp_qsa_layers_are_converted_dense(llamacpp):
    """qwen4_exp's known divergence, its first cause read off the GGUF: llama.cpp's converter writes a QSA layer's
    compress ratio only where layer_types says full_attention, but it reads config.json through transformers 5.23's
    AutoConfig, which names that layer indexed_attention: every ratio 0, and llama.cpp's graph attends to every key
    there (its second cause, the Gated DeltaNet's sigmoid output gate, is in llama.cpp's graph: src/models/qwen4exp.cpp)."""
    from transformers import AutoConfig

    src, hp = _converted_hparams(llamacpp, "qwen4_exp")
    assert AutoConfig.from_pretrained(src.model_dir).layer_types[-1] == "indexed_attention"
    assert hp["qwen4exp.attention.indexer.top_k"] == src.config["indexer_budget"] == 4
    assert list(hp["qwen4exp.attention.compress_ratios"]) == [0, 0, 0, 0]  # the full layer's would be 2


def test_gemma4_check_is_its_known_divergence(llamacpp):
    """The check: an xfail whose routers pass, read on the stream they are fed, its dense MLPs and MoE blocks each
    a row, failing by the GELU alone (test_gemma4_gelu_is_ggml_fp16_table)."""
    r = check("gemma4")
    assert r.status == "xfail" and "GGML_GELU_FP16" in r.expected["cause"], (r.status, r.worst)
    by_kind = {k: [b for b in r.blocks if b.kind == k] for k in ("attention", "router", "mlp", "moe")}
    assert all(b.status == "pass" for k in ("attention", "router") for b in by_kind[k])
    assert all(b.status == "fail" for k in ("mlp", "moe") for b in by_kind[k]) and by_kind["mlp"] and by_kind["moe"]


@pytest.fixture(scope="module")
def shipped(llamacpp, tmp_path_factory):
    """olmoe's GGUFs made by llama.cpp's own tools: the converter at f32, then llama_model_quantize."""
    from oracle.cli import main

    out = {}
    for t in ("Q8_0", "Q4_K_M", "bf16"):
        d = tmp_path_factory.mktemp(t)
        assert main(["export", "--family", "olmoe", "--backend", "llamacpp", "--option", f"outtype={t}",
                     "--output-dir", str(d)]) == 0
        out[t] = d / "model.gguf"
    return out


@pytest.mark.parametrize("qtype,arithmetic,bits", [("Q8_0", "a8", 8), ("Q4_K_M", "a8", 5), ("bf16", "abf16", 16)])
def test_shipped_gguf_has_both_row_sets_and_the_implementation_passes(shipped, qtype, arithmetic, bits):
    r = check("olmoe", artifact=str(shipped[qtype]))
    assert r.status == "pass", (r.error, r.worst)
    q = r.quantization
    # (Q4_K_M at hidden 64: llama-quantize falls back from the k-quants, whose blocks are 256 wide, to Q5_0/Q5_1/Q8_0)
    assert q["format"] == "GGUF" and q["kind"] == qtype.upper() and min(q["bits"]) == bits
    # the implementation: llama.cpp against HF on the GGUF's own weights, at llama.cpp's arithmetic
    assert r.spec["precision"] == arithmetic
    for b in r.blocks:
        assert b.status == "pass", (b.layer, b.kind, b.metrics)
        if b.kind in ("attention", "moe") and b.metrics.get("noise_max_abs"):
            # emulated a8 rounding is llama.cpp's own: its error is about HF a8's on the same block
            assert 0.3 < b.metrics["max_abs"] / b.metrics["noise_max_abs"] < 3, (b.layer, b.kind, b.metrics)
    # the quantization: HF on the GGUF's weights against HF on the original, judged by the distribution
    assert q["rows"]["status"] == "pass" and q["rows"]["blocks"]
    worst = max(x["metrics"]["rel_l2"] for x in q["rows"]["blocks"] if x["kind"] == "moe")
    assert 1e-4 < worst < 0.1  # the weights really are quantized, and not garbage


def test_shipped_gguf_weights_are_the_ggufs_own(shipped, llamacpp):
    """The dequantized checkpoint holds the GGUF's values, pulled back through the converter's map:
    an expert weight differs from the original by Q8_0's rounding and no more."""
    from models.checkpoint import read_tensors, tensor_index
    from oracle.source.sources import model_source

    spec = CheckSpec(family="olmoe", backend="llamacpp")
    orig = model_source(spec)
    ref = llamacpp.BACKEND.gguf(orig, spec)
    from exporters.llamacpp.gguf import dequantized_gguf, reader, values


    d, summary = dequantized_gguf(orig.family, orig, shipped["Q8_0"], Path(ref.path), "test")
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    a = read_tensors(tensor_index(orig.model_dir), [name])[name].float().numpy()
    b = read_tensors(tensor_index(d), [name])[name].float().numpy()
    gguf = values({t.name: t for t in reader(shipped["Q8_0"]).tensors}["blk.0.ffn_down_exps.weight"])
    assert np.array_equal(b, gguf[3])  # [E, H, I] in the GGUF: expert 3's values, moved back exactly
    # and those are the original rounded to 8 bits per 32 values: half a step, the step's fp16 scale aside
    step = np.abs(a).reshape(a.shape[0], -1, 32).max(-1, keepdims=True) / 127
    err = np.abs(a - b).reshape(step.shape[0], -1, 32)
    assert 0 < err.max() and (err <= step * 0.6).all()
    assert summary["tensors_changed"] > 0 and summary["activations"] == "a8"


def test_bad_ggufs_are_refused_by_name(shipped, llamacpp, tmp_path, cli):
    from exporters.llamacpp.faults import rewrite

    key = tmp_path / "key.gguf"
    shutil.copy(shipped["Q8_0"], key)
    rewrite(key, {"{arch}.expert_used_count": 3})
    shape = tmp_path / "shape.gguf"
    shutil.copy(shipped["Q8_0"], shape)
    rewrite(shape, tensors=lambda t, r: {"blk.1.attn_norm.weight": np.ones(32, np.float32)})
    text = tmp_path / "text.gguf"
    text.write_text("not a gguf\n")
    for path, message in ((key, "hyper-parameter olmoe.expert_used_count = 3, but the original checkpoint's config gives 2"),
                          (shape, "tensor blk.1.attn_norm.weight has shape [32]; the original's is [64]"),
                          (text, "not a readable GGUF file"), (tmp_path / "none.gguf", "no such file")):
        r = cli("check", "--family", "olmoe", "--backend", "llamacpp", "--gguf", str(path))
        assert r.returncode == 2 and message in r.stderr, (path.name, r.stderr[-500:])
    r = cli("check", "--family", "qwen3_moe", "--backend", "llamacpp", "--gguf", str(shipped["Q8_0"]))
    assert r.returncode == 2 and "architecture 'olmoe'" in r.stderr and "converts to 'qwen3moe'" in r.stderr


# a metadata fault (first layer), a tensor fault (its layer) and a shape finding; the whole catalogue is
# `oracle selftest --backend llamacpp` (nightly; docs/llamacpp.md)
@pytest.mark.parametrize("fault,where,point", [
    ("gguf_rope_freq_base_wrong", (0, "attention"), None),  # attention's points are not mapped: n/a
    ("gguf_expert_gate_up_swapped", (1, "moe"), "experts"),
    ("gguf_expert_used_count_wrong", (0, "router"), "topk"),
])
def test_gguf_faults_are_detected_and_localised(llamacpp, fault, where, point):
    from exporters.llamacpp import faults as llamacpp_faults

    f = next(x for x in llamacpp_faults.CATALOGUE if x.name == fault)
    r = run_check(CheckSpec(family="olmoe", backend="llamacpp"), llamacpp.BACKEND.with_fault(f))
    assert r.status == "fail"
    assert (r.worst["layer"], r.worst["kind"]) == where, r.worst
    drill = (r.drill.get("blocks") or [{}])[0]
    assert drill.get("first_divergence") == point, r.drill


def test_round_blocks_is_8_bit_per_block_of_32():
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    y = round_blocks(x, 8, 32)
    d = (x.reshape(3, 2, 32).abs().amax(-1, keepdim=True) / 127).half().float()  # Q8_0 keeps its scale in fp16
    err = (y - x).reshape(3, 2, 32).abs()
    assert (err <= d * 0.5 * 1.001 + 1e-7).all() and err.max() > 0
    assert (y.reshape(3, 2, 32) / d).sub((y.reshape(3, 2, 32) / d).round()).abs().max() < 1e-3  # on the grid
    assert torch.equal(round_blocks(x[:, :48], 8, 32), x[:, :48])  # not whole blocks: left alone


def test_rounded_activations_touch_weight_products_only():
    lin = torch.nn.Linear(64, 8, bias=False)
    x = torch.randn(2, 64)
    with RoundedActivations((8, 32)):
        a = lin(x)
        b = x @ x.T  # two activations: not rounded
    assert torch.allclose(a, lin(round_blocks(x, 8, 32)), atol=0) and not torch.equal(a, lin(x))
    assert torch.equal(b, x @ x.T)


def test_qwen2moe_shared_gate_of_zero_is_nan_in_llama_cpp(llamacpp):
    """An upstream defect the GGUF self-test found: llama.cpp's qwen2moe computes the shared expert's
    sigmoid gate as silu(x) / x (src/models/qwen2moe.cpp), 0 / 0 where the gate's logit is exactly 0:
    a zeroed gate tensor (HF: sigmoid(0) = 0.5) makes every later row NaN. A NaN never passes: the
    layer's moe row fails with its count. When llama.cpp computes a real sigmoid this test fails:
    then the gate is 0.5 and the row fails by its numbers instead (update the docs)."""
    from exporters.llamacpp.faults import rewrite

    def zero_gate(path, args):
        rewrite(path, tensors=lambda t, r: {"blk.1.ffn_gate_inp_shexp.weight": np.zeros_like(t["blk.1.ffn_gate_inp_shexp.weight"])})

    r = run_check(CheckSpec(family="qwen2_moe", backend="llamacpp", drill="off"),
                  llamacpp.LlamaCppBackend("llamacpp+zero_gate", zero_gate, "zero_gate"))
    assert r.status == "fail"
    moe = rows(r)[(1, "moe")]
    assert moe.status == "fail" and moe.metrics["nonfinite"] > 0
    assert rows(r)[(0, "moe")].status == "pass"  # the layer before is untouched
