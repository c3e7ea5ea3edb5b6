"""Solar Open (solar_open): Llama's attention (q/k/v biases with `attention_bias`, never o's; no q/k norm;
full rotary) on GLM-4.5's MoE in every layer: experts chosen as DeepSeek-V3 does (sigmoid plus a correction
bias, group-limited), renormalised, times routed_scaling_factor, plus always-on shared experts. No dense
layers (its config has no first_k_dense_replace nor intermediate_size)."""

from models.args import SPARSE, AttentionArgs, ModelArgs
from models.family import Family
from models.mapping import deepseek_router, hf_args, require, rope_of, rope_theta, sanitize_hf, sigmoid_routing
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, NOAUX, UNTIED, MlxLm, const, head_dim, rope_parameters
from models.rules import GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(rope_parameters(c).get("partial_rotary_factor", 1.0) == 1.0,
            "solar_open: partial_rotary_factor (HF's SolarOpen attention rotates the whole head)")
    return hf_args(
        # the release scales its rope by YaRN (the tiny config keeps the default, so that mlx-lm's model runs it)
        c, "solar_open", attention=AttentionArgs(qkv_bias=c.attention_bias, o_bias=False), rope=rope_of(c),
        mlp_types=(SPARSE,) * c.num_hidden_layers, num_experts=c.n_routed_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0), shared_expert_gated=False,
        router=deepseek_router(c, **sigmoid_routing(c)),
    )


MLX = MlxLm(
    module="solar_open",  # its ModelArgs over mlx-lm's glm4_moe model
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="moe_intermediate_size",  # read for dense layers only: there are none
        moe_intermediate_size="moe_intermediate_size", num_hidden_layers="num_hidden_layers",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads", head_dim=head_dim,
        n_shared_experts="n_shared_experts", n_routed_experts="n_routed_experts",
        routed_scaling_factor="routed_scaling_factor", num_experts_per_tok="num_experts_per_tok",
        first_k_dense_replace=const(0), norm_topk_prob="norm_topk_prob",
        max_position_embeddings="max_position_embeddings", rms_norm_eps="rms_norm_eps", rope_theta=rope_theta,
        tie_word_embeddings="tie_word_embeddings", partial_rotary_factor=const(1.0), rope_scaling=const(None),
        attention_bias="attention_bias", use_qk_norm=const(False), n_group="n_group", topk_group="topk_group",
        scoring_func=const("sigmoid"), topk_method=const("noaux_tc"),
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE + NOAUX + UNTIED,
)

FAMILY = Family(
    name="solar_open", model_types=("solar_open",), hf_module="solar_open", hf_class_name="SolarOpenForCausalLM",
    hf_config_name="SolarOpenConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf, mlx=MLX,
    experts="n_routed_experts", rules=(*GROUPED, ("positive", "moe_intermediate_size")),
)
