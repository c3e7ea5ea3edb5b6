"""Cohere2-MoE (Cohere Command A MoE, North): a parallel block (one input norm, the attention and the
MLP both on its output, both added to the residual: ModelArgs.parallel_block), bias-free LayerNorms
(an RMSNorm where the config sets rms_norm_eps); sliding-window layers with interleaved-pair RoPE
(rotated in fp32) and NoPE full-attention layers, a leading dense layer rotating too where
prefix_dense_sliding_window_pattern is 1 (HF's force_rope); routing: the top-k of the logits, softmax
over those k (= softmax, top-k, renormalised; or sigmoids, renormalised by norm_topk_prob); the shared
experts' output AVERAGED with the routed experts' ((routed + shared) / 2: ModelArgs.shared_expert_average,
shared_expert_combination_strategy "average"; "sum" adds them); the logits times logit_scale (a
divisor 1 / logit_scale here, exact for the powers of two Cohere ships). Embeddings tied."""

from models.args import (DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, Multipliers, NormArgs, RopeArgs,
                         RouterArgs)
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, prefix_dense_intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    num_shared_experts=1, shared_expert_combination_strategy="average", expert_selection_fn="softmax",
    # every layer kind: a leading dense full-attention layer (rotating: prefix_dense_sliding_window_pattern 1),
    # sparse sliding-window layers, a sparse NoPE full-attention layer; the window shorter than the prompts
    layer_types=[FULL, SLIDING, SLIDING, FULL], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    sliding_window=4, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    rope_theta=50000.0,  # (HF's config keeps its own rope_theta field beside rope_parameters: the same value)
    logit_scale=0.25, layer_norm_eps=1e-5, tie_word_embeddings=True,
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def rotates(c, i: int) -> bool:
    """HF's Cohere2MoeAttention: a sliding-window layer rotates, and a dense layer where
    prefix_dense_sliding_window_pattern is 1 (force_rope); a full-attention sparse layer is NoPE."""
    dense = c.mlp_layer_types[i] == "dense"
    return c.layer_types[i] == SLIDING or (dense and c.prefix_dense_sliding_window_pattern == 1)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"cohere2_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU: silu only)")
    require(set(c.layer_types) <= {FULL, SLIDING}, f"cohere2_moe: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.expert_selection_fn in ("softmax", "sigmoid"),
            f"cohere2_moe: expert_selection_fn {c.expert_selection_fn!r}")
    require(c.shared_expert_combination_strategy in ("average", "sum"),
            f"cohere2_moe: shared_expert_combination_strategy {c.shared_expert_combination_strategy!r}")
    n = c.num_hidden_layers
    mlp = tuple(DENSE if c.mlp_layer_types[i] == "dense" else SPARSE for i in range(n))
    rms = c.rms_norm_eps is not None
    sigmoid = c.expert_selection_fn == "sigmoid"
    return hf_args(
        c, "cohere2_moe", head_dim=c.head_dim, layer_types=tuple(c.layer_types), mlp_types=mlp,
        intermediate_size=(c.prefix_dense_intermediate_size or 0) if DENSE in mlp else 0,
        rms_norm_eps=c.rms_norm_eps if rms else c.layer_norm_eps,
        norm=NormArgs() if rms else NormArgs("layer", bias=False),
        rope=RopeArgs(rope_theta(c), interleave=True, fp32=True, per_layer=tuple(int(rotates(c, i)) for i in range(n))),
        attention=AttentionArgs(qkv_bias=c.attention_bias, o_bias=c.attention_bias, sliding_window=c.sliding_window),
        num_experts=c.num_experts, moe_intermediate_size=c.intermediate_size,
        # top-k of the logits then softmax over the k: softmax, top-k, renormalised (sigmoid: renormalised if asked)
        router=RouterArgs(scoring="sigmoid", norm_topk_prob=c.norm_topk_prob) if sigmoid
        else RouterArgs(norm_topk_prob=True),
        shared_expert_intermediate_size=c.intermediate_size * (c.num_shared_experts or 0), shared_expert_gated=False,
        shared_expert_average=c.shared_expert_combination_strategy == "average", parallel_block=True,
        multipliers=Multipliers(logits_scaling=1.0 / float(c.logit_scale)),
    )


FAMILY = Family(
    name="cohere2_moe", model_types=("cohere2_moe",), hf_module="cohere2_moe", hf_class_name="Cohere2MoeForCausalLM",
    hf_config_name="Cohere2MoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf,
    # (mlx-lm 0.32.2 has no cohere2_moe model)
    rules=(("positive", "intermediate_size", "sliding_window", "logit_scale", "layer_norm_eps"),
           ("per_layer", "mlp_layer_types")),
)
