"""Mistral Small 4 (mistral4): DeepSeek-V3's multi-head latent attention (a q_lora_rank bottleneck, rotary pairs
interleaved, YaRN with its mscale in the softmax scale) with one addition, a query scale that grows with the
position (rope_parameters' llama_4_scaling_beta, as Llama 4 and Ministral 3 have it): every query, after its
rotation, times 1 + beta * log(1 + floor(pos / original_max_position_embeddings)) (AttentionArgs.q_position_beta).
Its MoE is DeepSeek-V3's without the correction bias: softmax scores (in the model's dtype), the topk_group
best of n_group groups by the sum of their best two, the top-k weights renormalised (HF adds 1e-20 to the sum:
no fp32 difference at any weight the softmax gives) and times routed_scaling_factor, plus always-on shared
experts; the first first_k_dense_replace layers dense.

The tiny config's original_max_position_embeddings is 4 so that the scale changes within a check's prompt
(positions 0-3 at 1, 4-7 at 1 + beta log 2, ...): the same field sets YaRN's original context, as in HF."""

from models.args import ModelArgs, RouterArgs
from models.deepseek_v3 import from_mlx as deepseek_v3_from_mlx
from models.family import Family
from models.mapping import drop_layers_from, first_k_dense, hf_args, mla, require, rope_of, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MLA_NAMES, NOAUX, UNTIED, MlxLm, const, rope_parameters
from models.rules import FIRST_K_DENSE, GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True, first_k_dense_replace=1,
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    rope_interleave=True, max_position_embeddings=256, rms_norm_eps=1e-6,
    # the release's YaRN (factor 128 over 8192) and llama-4 scaling (beta 0.1), scaled: the scale's period is
    # YaRN's original context, 4 positions here, so a check's prompt crosses it
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 4,
                     "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 8 / 24},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def query_scale(c) -> dict:
    """AttentionArgs' q_position_beta and q_position_period from rope_parameters (HF's get_llama_4_attn_scale reads
    llama_4_scaling_beta and original_max_position_embeddings; without a beta: no scale)."""
    rp = c.rope_parameters or {}
    beta = rp.get("llama_4_scaling_beta")
    if not beta:
        return {}
    require(bool(rp.get("original_max_position_embeddings")),
            "mistral4: llama_4_scaling_beta without original_max_position_embeddings (the scale's period)")
    return dict(q_position_beta=float(beta), q_position_period=float(rp["original_max_position_embeddings"]))


def to_args(c) -> ModelArgs:
    from dataclasses import replace

    require(c.hidden_act == "silu", f"mistral4: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    rp = c.rope_parameters or {}
    rotary = c.qk_rope_head_dim / (c.qk_nope_head_dim + c.qk_rope_head_dim)
    require(abs(float(rp.get("partial_rotary_factor", rotary)) - rotary) < 1e-6,
            f"mistral4: partial_rotary_factor {rp.get('partial_rotary_factor')} (the latent attention rotates the "
            f"qk_rope_head_dim of each head: {rotary:.4f})")
    return hf_args(c, "mistral4", rope=rope_of(c, interleave=bool(c.rope_interleave)),
                   attention=replace(mla(c), **query_scale(c)), **first_k_dense(c),
                   router=RouterArgs(scoring="softmax", n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                                     group_score="top2", norm_topk_prob=bool(c.norm_topk_prob),
                                     routed_scaling_factor=float(c.routed_scaling_factor), weights_in_model_dtype=True))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names -> HF's as transformers holds and writes Mistral 4 (deepseek_v3.from_mlx: kv_b_proj back from
    the absorbed halves), the experts fused as the release keeps them: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    import torch

    stacked = {k: v for k, v in weights.items() if ".mlp.switch_mlp." in k}  # [E, out, in], as mlx-lm keeps them
    out = deepseek_v3_from_mlx({k: v for k, v in weights.items() if k not in stacked}, config)
    for k, v in stacked.items():
        if k.endswith(".mlp.switch_mlp.gate_proj.weight"):
            p = k[: -len("switch_mlp.gate_proj.weight")]
            out[p + "experts.gate_up_proj"] = torch.cat([v, stacked[p + "switch_mlp.up_proj.weight"]], dim=1)
            out[p + "experts.down_proj"] = stacked[p + "switch_mlp.down_proj.weight"]
    return out


def mlx_attn_scale(model, x, cache):
    """What mlx-lm's Mistral4Model passes every layer beside x and the mask: the query scale of x's positions."""
    from mlx_lm.models.ministral3 import _get_llama_4_attn_scale

    rp = model.args.rope_parameters
    return (_get_llama_4_attn_scale(x.shape[1], cache.offset if cache is not None else 0, rp["llama_4_scaling_beta"],
                                    rp["original_max_position_embeddings"]).astype(x.dtype),)


MLX = MlxLm(
    module="mistral4",
    config=dict(
        **MLA_NAMES,
        norm_topk_prob="norm_topk_prob",
        first_k_dense_replace="first_k_dense_replace", tie_word_embeddings="tie_word_embeddings",
        rope_interleave="rope_interleave", rope_parameters=lambda c: dict(rope_parameters(c)),
        # (what its __post_init__ derives them as: the q/k head width, and rope_parameters)
        head_dim=lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim,
        qk_head_dim=lambda c: c.qk_nope_head_dim + c.qk_rope_head_dim, rope_scaling=lambda c: dict(rope_parameters(c)),
        rope_theta=lambda c: float(rope_parameters(c).get("rope_theta", 10000.0)),
    ),
    require=COMMON_REQUIRE + NOAUX + UNTIED + (
        (lambda c: rope_parameters(c).get("rope_type", "default") == "yarn",
         "rope_type other than yarn (mlx-lm's mistral4 reads its scale's period from the yarn parameters)"),
        (lambda c: rope_parameters(c).get("truncate", True), "yarn truncate=False (mlx-lm always truncates)"),
        (lambda c: bool(rope_parameters(c).get("llama_4_scaling_beta")),
         "no llama_4_scaling_beta (mlx-lm's mistral4 reads it)"),
    ),
    experts="fused", block_args=mlx_attn_scale,
)

FAMILY = Family(
    name="mistral4", model_types=("mistral4",), hf_module="mistral4", hf_class_name="Mistral4ForCausalLM",
    hf_config_name="Mistral4Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx, mlx=MLX,
    experts="n_routed_experts",
    rules=(*GROUPED, *FIRST_K_DENSE,
           ("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")),
)
