"""GLM-4.5 / GLM-4.6 (glm4_moe): GQA with q/k/v biases (no o bias), optional per-head q/k
RMSNorm, partial rotary (half the head), the first `first_k_dense_replace` layers dense, then
experts chosen as DeepSeek-V3 does (sigmoid + correction bias, group-limited) plus always-on
shared experts."""

from models.args import AttentionArgs, ModelArgs, RopeArgs
from models.family import Family
from models.mapping import (deepseek_router, drop_layers_from, first_k_dense, hf_args, require, rope_theta, sanitize_hf,
                            sigmoid_routing)
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, NOAUX, UNTIED, MlxLm, const, head_dim, rope_parameters
from models.rules import FIRST_K_DENSE, GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    first_k_dense_replace=1, use_qk_norm=True, attention_bias=True, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def partial_rotary(c) -> float:
    return float(rope_parameters(c).get("partial_rotary_factor", 1.0))


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"glm4_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    return hf_args(c, "glm4_moe", attention=AttentionArgs(qk_norm="head" if c.use_qk_norm else "none",
                                                          qkv_bias=c.attention_bias, o_bias=False),
                   rope=RopeArgs(rope_theta(c), partial_rotary_factor=partial_rotary(c)), **first_k_dense(c),
                   router=deepseek_router(c, **sigmoid_routing(c)))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


MLX = MlxLm(
    module="glm4_moe",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", max_position_embeddings="max_position_embeddings",
        moe_intermediate_size="moe_intermediate_size", norm_topk_prob="norm_topk_prob",
        num_attention_heads="num_attention_heads", n_group="n_group", head_dim=head_dim, topk_group="topk_group",
        n_shared_experts="n_shared_experts", n_routed_experts="n_routed_experts",
        routed_scaling_factor="routed_scaling_factor", num_experts_per_tok="num_experts_per_tok",
        first_k_dense_replace="first_k_dense_replace", num_hidden_layers="num_hidden_layers",
        num_key_value_heads="num_key_value_heads", rms_norm_eps="rms_norm_eps", rope_theta=rope_theta,
        rope_scaling=const(None), use_qk_norm="use_qk_norm", tie_word_embeddings="tie_word_embeddings",
        attention_bias="attention_bias", partial_rotary_factor=partial_rotary,  # HF keeps it in rope_parameters
        scoring_func=const("sigmoid"), topk_method=const("noaux_tc"),
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE + NOAUX + UNTIED,
)

FAMILY = Family(
    name="glm4_moe", model_types=("glm4_moe",), hf_module="glm4_moe", hf_class_name="Glm4MoeForCausalLM",
    hf_config_name="Glm4MoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    experts="n_routed_experts", rules=(*GROUPED, *FIRST_K_DENSE),
)
