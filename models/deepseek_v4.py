"""DeepSeek-V4 (Flash, Pro): shared-KV multi-query attention (one key head of head_dim 512, read as the values too)
over a sliding window plus compressed KV (models/layers/compressed_attention.py, compressed_kv.py): CSA layers an
overlapping compressor every m positions and a lightning indexer keeping index_topk entries per query, HCA layers a
heavy compressor every m' positions, all entries visible; sliding-only layers the window alone. A learned sink logit
per head; the grouped output projection (o_groups blocks to o_lora_rank, then o_b_proj); RoPE on the trailing
qk_rope_head_dim dims (interleaved pairs), the main rope (rope_theta) on sliding-only layers, the compress rope
(compress_rope_theta, YaRN with attention factor 1) on the others. The MoE: sqrt(softplus) scores, the correction
bias for the choice, always renormalised, routed_scaling_factor; hash_moe layers choose their experts by a frozen
token-id table (tid2eid: models/layers/hash_router.py); the experts' and the shared expert's SwiGLU clamped
(swiglu_limit: silu of the gate clamped above, the up clamped both ways). The residual as hc_mult streams mixed by
manifold-constrained hyper-connections (models/layers/hyper.py).

The tiny config makes each mechanism bite on the default prompt (8 tokens) and its decode steps: a window of 4, HCA
every 4 positions (layer 0, hash-routed), a sliding-only layer, CSA every 2 positions with index_topk 2 (of 4 entries
after the prompt: layer 2), hc_mult 2, swiglu_limit 1 (the clamp reached at weights of std 0.1)."""

from __future__ import annotations

import re

from models.args import (FULL, SLIDING, AttentionArgs, CompressedArgs, ExpertArgs, HyperArgs, ModelArgs, NormArgs,
                         RopeArgs, RouterArgs, YaRN)
from models.family import Family
from models.mapping import points_without, drop_layers_from, hf_args, require, sanitize_hf, strip_prefix
from models.mlx_lm import MlxLm

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

TINY = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.25, q_lora_rank=24, o_groups=2, o_lora_rank=16,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus", swiglu_limit=1.0, max_position_embeddings=256,
    # HCA first (with the hash routing), CSA last: the seeded faults of each reach a layer by position (first, last)
    layer_types=[HCA, SWA, CSA], mlp_layer_types=["hash_moe", "moe", "moe"],
    compress_rates={CSA: 2, HCA: 4}, sliding_window=4, index_topk=2, index_head_dim=16,
    # 16 index heads: an entry's score is rarely relu'd to an exact 0 by every head (with 4, seed 0's layer 2 scored two
    # entries 0 at position 7, a tie for the second pick that iree-compile's topk broke the other way); fp32 gaps
    # between the 2nd and 3rd entry at least 3.2e-3 over 16 positions, seeds 0-2
    index_n_heads=16,
    rope_theta=10000.0, compress_rope_theta=160000.0,
    # YaRN on the compressed layers' rope, as the release has it (factor 16 over 65536 positions), scaled down
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    hc_mult=2, hc_sinkhorn_iters=20,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def rope_args(p: dict, partial: float, **how) -> RopeArgs:
    """One of V4's two ropes (rope_parameters["main"] / ["compress"])."""
    kind = p.get("rope_type", "default")
    require(kind in ("default", "yarn"), f"deepseek_v4: rope_type {kind!r} (default and yarn only)")
    scaling = None
    if kind == "yarn":
        af = p.get("attention_factor")
        scaling = YaRN(float(p["factor"]), int(p["original_max_position_embeddings"]),
                       beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                       truncate=bool(p.get("truncate", True)), attention_factor=None if af is None else float(af))
    return RopeArgs.scaled(float(p["rope_theta"]), scaling, partial_rotary_factor=partial, **how)


def to_args(c) -> ModelArgs:
    require(c.num_key_value_heads == 1, f"deepseek_v4: num_key_value_heads {c.num_key_value_heads} (shared-KV MQA)")
    require(c.n_shared_experts == 1, f"deepseek_v4: n_shared_experts {c.n_shared_experts} (HF's shared MLP is one "
                                     "moe_intermediate_size wide)")
    require(c.hidden_act == "silu", f"deepseek_v4: hidden_act {c.hidden_act!r}")
    require(c.scoring_func == "sqrtsoftplus", f"deepseek_v4: scoring_func {c.scoring_func!r} (sqrtsoftplus only)")
    require(not c.attention_bias and not c.mlp_bias, "deepseek_v4: attention_bias / mlp_bias")
    n = c.num_hidden_layers
    rates = [0 if t == SWA else int(c.compress_rates[t]) for t in c.layer_types]
    compressed = CompressedArgs(
        q_lora_rank=c.q_lora_rank, o_groups=c.o_groups, o_lora_rank=c.o_lora_rank, qk_rope_head_dim=c.qk_rope_head_dim,
        ratios=tuple(rates), indexed=tuple(t == CSA for t in c.layer_types), index_topk=c.index_topk,
        index_n_heads=c.index_n_heads, index_head_dim=c.index_head_dim)
    rp, prf = c.rope_parameters, c.partial_rotary_factor
    # the compressed layers' rope is the model's; the sliding-only layers' its `sliding` (main: rope_theta)
    rope = rope_args(rp["compress"], prf, sliding=rope_args(rp["main"], prf))
    return hf_args(
        c, "deepseek_v4", rope=rope, layer_types=tuple(SLIDING if t == SWA else FULL for t in c.layer_types),
        attention=AttentionArgs("compressed", compressed=compressed, sliding_window=c.sliding_window, sinks=True),
        num_experts=c.n_routed_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size, shared_expert_gated=False,
        mlp_activation="cswiglu", experts=ExpertArgs("cswiglu", swiglu_limit=float(c.swiglu_limit)),
        # HF's routers always renormalise (norm_topk_prob unread), 1e-20 beside the sum
        router=RouterArgs(scoring="sqrtsoftplus", correction_bias=True, norm_topk_prob=True, norm_eps=1e-20,
                          routed_scaling_factor=float(c.routed_scaling_factor),
                          fp32_params=("e_score_correction_bias",),
                          hash_layers=tuple(t == "hash_moe" for t in c.mlp_layer_types[:n])),
        norm=NormArgs(gain_fp32=True),  # HF's DeepseekV4RMSNorm: fp32 gains (kept fp32), (w * x).to(dtype)
        hyper=HyperArgs(streams=c.hc_mult, form="mhc", sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                        norm_eps=c.rms_norm_eps),
    )


# the release's names (transformers 5.23's save_pretrained writes them too) -> HF's in-memory names, the production
# model's: HF's conversion mapping for deepseek_v4, in its order (one pass of each over every name)
RENAMES = tuple((re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."), (r"\.q_norm\.", ".q_a_norm."),
    (r"\.gate\.bias", ".gate.e_score_correction_bias"), (r"\.w1\.", ".gate_proj."), (r"\.w2\.", ".down_proj."),
    (r"\.w3\.", ".up_proj."),
))


def hf_name(name: str) -> str:
    for pattern, to in RENAMES:
        name = pattern.sub(to, name)
    return name


def sanitize(weights: dict, args: ModelArgs) -> dict:
    weights = {hf_name(k): t for k, t in strip_prefix(weights).items() if not k.startswith("mtp.")}
    # the hash layers' token -> experts table, int64 in the checkpoint: a floating parameter in the production model
    weights = {k: t.float() if k.endswith(".gate.tid2eid") else t for k, t in weights.items()}
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


# mlx-lm 0.32.2 has no DeepSeek-V4: its deepseek_v41 (model_type deepseek_v41_text, DeepSeek-V4.1) routes every layer by
# its scores (no hash-routed layers: HF's mlp_layer_types "hash_moe", tid2eid) and fake-quantises the attention's KV to
# FP8 and the indexer's queries and keys to FP4 (_fake_quant_fp8 / _fake_quant_fp4), which HF's DeepSeek-V4 does not
MLX = MlxLm(module="deepseek_v41", config={}, require=(
    (lambda c: False, "DeepSeek-V4's architecture, which mlx-lm 0.32.2 has no model of: its deepseek_v41 "
                      "(DeepSeek-V4.1) has no hash-routed layers (tid2eid) and fake-quantises the KV to FP8 and the "
                      "indexer to FP4, which HF's DeepSeek-V4 does not"),
))


def point_view(points, args: ModelArgs, layer=None):
    """HF's points less those laid out otherwise: its rope taps (HF rotates the whole head, the production model its
    trailing qk_rope_head_dim dims alone) and the CSA indexer's scores over the entries made (the production's over
    its cache's length)."""
    return points_without(points, lambda n: n in ("q_rope", "k_rope") or n.endswith("indexer.scorer"))


FAMILY = Family(
    name="deepseek_v4", model_types=("deepseek_v4",), hf_module="deepseek_v4", hf_class_name="DeepseekV4ForCausalLM",
    hf_config_name="DeepseekV4Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    hf_point_view=point_view,
    experts="n_routed_experts", tiny_ids={"tid2eid": "n_routed_experts"},  # (the hash table drawn)
)
