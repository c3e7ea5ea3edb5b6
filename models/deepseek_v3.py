"""DeepSeek-V3 (also R1 and Kimi-K2's architecture): multi-head latent attention with YaRN,
the first `first_k_dense_replace` layers dense, then 256 experts top-8 chosen on sigmoid scores
+ a correction bias among the 4 best of 8 groups, weights renormalised and scaled by
routed_scaling_factor, plus one always-on shared expert.

The worked example of a family made of blocks that exist (docs/architecture.md, "Where a new
family, backend, block kind or gate goes"): the config mapping, the checkpoint's names and the
mlx-lm mapping are all this file has."""

from models.args import ModelArgs
from models.checkpoint import unstack_experts
from models.family import Family
from models.mapping import (deepseek_router, drop_layers_from, first_k_dense, hf_args, mla, require, rope_of,
                            rope_theta_any, sanitize_hf, sigmoid_routing)
from models.mlx_lm import COMMON_REQUIRE, MLA_NAMES, NOAUX, UNTIED, YARN_REQUIRE, MlxLm, const, yarn_scaling
from models.rules import FIRST_K_DENSE, GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    rope_interleave=True, max_position_embeddings=256,
    # YaRN as the release has it (factor 40 over 4096 positions, mscale 1 / 1), scaled to the tiny
    # model so that the frequencies and the softmax scale both differ from plain RoPE
    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"deepseek_v3: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    return hf_args(c, "deepseek_v3", rope=rope_of(c, interleave=bool(c.rope_interleave)), attention=mla(c),
                   **first_k_dense(c), router=deepseek_router(c, **sigmoid_routing(c)))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names -> HF's: per-expert tensors, and kv_b_proj [H * (nope + v), kv_lora] back
    from the two halves mlx-lm's sanitize() splits it into (absorbed MLA): embed_q
    [H, kv_lora, nope] (the key half, transposed) and unembed_out [H, v, kv_lora]."""
    import torch

    out = {}
    for k, v in unstack_experts(weights).items():
        if k.endswith(".self_attn.embed_q.weight"):
            p = k[: -len("embed_q.weight")]
            wv = weights[p + "unembed_out.weight"]
            out[p + "kv_b_proj.weight"] = torch.cat([v.transpose(-1, -2), wv], dim=1).reshape(-1, v.shape[1])
        elif not k.endswith(".self_attn.unembed_out.weight"):
            out[k] = v
    return out


MLX = MlxLm(
    module="deepseek_v3",
    config=dict(
        **MLA_NAMES,
        topk_method=const("noaux_tc"), scoring_func=const("sigmoid"),  # what HF hard-codes
        norm_topk_prob="norm_topk_prob", moe_layer_freq=const(1),  # HF has no moe_layer_freq
        first_k_dense_replace="first_k_dense_replace", rope_theta=rope_theta_any, rope_scaling=yarn_scaling,
    ),
    require=COMMON_REQUIRE + YARN_REQUIRE + NOAUX + UNTIED + (
        (lambda c: c.rope_interleave, "rope_interleave=False (mlx-lm rotates interleaved pairs)"),
        (lambda c: c.num_hidden_layers <= 61, "num_hidden_layers > 61 (mlx-lm's sanitize drops model.layers.61*)"),
    ),
    array_mask=True,
)

FAMILY = Family(
    name="deepseek_v3", model_types=("deepseek_v3",), hf_module="deepseek_v3",
    hf_class_name="DeepseekV3ForCausalLM", hf_config_name="DeepseekV3Config", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, from_mlx=from_mlx, mlx=MLX, experts="n_routed_experts",
    rules=(*GROUPED, *FIRST_K_DENSE, ("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")),
)
