"""DeepSeek-V2 / V2-Lite: multi-head latent attention (rotary pairs interleaved, optional YaRN),
the first `first_k_dense_replace` layers dense, then softmax routing: greedy top-k or, with
topk_method "group_limited_greedy", the top-k within the topk_group groups with the highest
expert probability; weights times routed_scaling_factor, never renormalised (HF 5.23 reads no
norm_topk_prob for V2); always-on shared experts."""

from models.args import ModelArgs
from models.family import Family
from models.mapping import (deepseek_router, drop_layers_from, first_k_dense, hf_args, mla, require, rope_of,
                            rope_theta_any, sanitize_hf)
from models.mlx_lm import COMMON_REQUIRE, MLA_NAMES, UNTIED, YARN_REQUIRE, MlxLm, const, yarn_scaling
from models.rules import FIRST_K_DENSE, GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=1, topk_method="group_limited_greedy", routed_scaling_factor=1.5,
    first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
    v_head_dim=16, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"deepseek_v2: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(not c.mlp_bias, "deepseek_v2: mlp_bias is not supported yet")
    require(c.topk_method in ("greedy", "group_limited_greedy"), f"deepseek_v2: topk_method {c.topk_method!r}")
    grouped = c.topk_method == "group_limited_greedy"
    # HF rotates q and k in fp32 (complex products of x.float()): rope_fp32
    return hf_args(c, "deepseek_v2", rope=rope_of(c, interleave=True, fp32=True), attention=mla(c), **first_k_dense(c),
                   router=deepseek_router(c, scoring="softmax", n_group=(c.n_group or 1) if grouped else 1,
                                          topk_group=(c.topk_group or 1) if grouped else 1, group_score="max",
                                          norm_topk_prob=False))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


MLX = MlxLm(
    module="deepseek_v2",
    config=dict(
        **MLA_NAMES,
        topk_method="topk_method", moe_layer_freq=const(1),
        first_k_dense_replace="first_k_dense_replace", rope_theta=rope_theta_any,
        # never None: mlx-lm's deepseek_v2 always builds its YaRN rope
        rope_scaling=lambda c: yarn_scaling(c) or {"rope_type": "default", "factor": 1.0},
    ),
    require=COMMON_REQUIRE + YARN_REQUIRE + UNTIED + (
        (lambda c: not c.mlp_bias, "mlp_bias (mlx-lm's deepseek_v2 MLPs have no bias)"),
    ),
)

FAMILY = Family(
    name="deepseek_v2", model_types=("deepseek_v2",), hf_module="deepseek_v2", hf_class_name="DeepseekV2ForCausalLM",
    hf_config_name="DeepseekV2Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    experts="n_routed_experts", rules=(*GROUPED, *FIRST_K_DENSE, ("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")),
)
