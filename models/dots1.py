"""dots.llm1 (dots1): GQA with per-head q/k RMSNorm, the first `first_k_dense_replace` layers
dense, then experts chosen as DeepSeek-V3 does (sigmoid + correction bias, group-limited) plus
always-on shared experts. Sliding-window layers (layer_types) are refused: the released
configs have none."""

from models.args import FULL, AttentionArgs, ModelArgs
from models.family import Family
from models.mapping import deepseek_router, first_k_dense, hf_args, require, rope_theta, sanitize_hf, sigmoid_routing
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, NOAUX, MlxLm, const, head_dim
from models.rules import FIRST_K_DENSE, GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, first_k_dense_replace=1,
    sliding_window=None, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"dots1: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(all(t == FULL for t in c.layer_types), "dots1: sliding_attention layers are not supported yet")
    return hf_args(c, "dots1", attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
                   **first_k_dense(c), router=deepseek_router(c, **sigmoid_routing(c)))


MLX = MlxLm(
    module="dots1",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        rms_norm_eps="rms_norm_eps", vocab_size="vocab_size", max_position_embeddings="max_position_embeddings",
        num_key_value_heads="num_key_value_heads", first_k_dense_replace="first_k_dense_replace",
        moe_intermediate_size="moe_intermediate_size", n_routed_experts="n_routed_experts",
        n_shared_experts="n_shared_experts", norm_topk_prob="norm_topk_prob",
        num_experts_per_tok="num_experts_per_tok", rope_theta=rope_theta,
        routed_scaling_factor="routed_scaling_factor", head_dim=head_dim,
        scoring_func=const("noaux_tc"),  # not read by mlx-lm (sigmoid hard-coded)
        n_group="n_group", topk_group="topk_group", attention_bias="attention_bias",  # not read: required False
        mlp_bias=const(False), rope_scaling=const(None), tie_word_embeddings="tie_word_embeddings",
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE + NOAUX + (
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's dots1 projections have no bias)"),
        (lambda c: all(t == FULL for t in c.layer_types), "sliding_attention layers (mlx-lm's dots1 has none)"),
    ),
)

FAMILY = Family(
    name="dots1", model_types=("dots1",), hf_module="dots1", hf_class_name="Dots1ForCausalLM",
    hf_config_name="Dots1Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf, mlx=MLX,
    experts="n_routed_experts", rules=(*GROUPED, *FIRST_K_DENSE),
)
