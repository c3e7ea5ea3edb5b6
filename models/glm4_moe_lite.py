"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's multi-head latent attention (a q_lora_rank bottleneck,
rotary pairs interleaved by default, optional YaRN) on GLM-4.5's MoE: the layers `mlp_layer_types` names
"dense" have one plain MLP (the release: the first), the others experts chosen as DeepSeek-V3 does (sigmoid
plus a correction bias, group-limited), renormalised, times routed_scaling_factor, plus always-on shared
experts. A config delta on what exists: its dense layers are a per-layer list, not first_k_dense_replace;
HF maps head_dim to qk_rope_head_dim (the rope's width)."""

from models.args import DENSE, SPARSE, ModelArgs
from models.deepseek_v3 import from_mlx
from models.family import Family
from models.mapping import (deepseek_router, drop_layers_from, hf_args, mla, require, rope_of, rope_theta_any,
                            sanitize_hf, sigmoid_routing)
from models.mlx_lm import COMMON_REQUIRE, MLA_NAMES, NOAUX, UNTIED, YARN_REQUIRE, MlxLm, const, rope_parameters, yarn_scaling
from models.rules import GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
    mlp_layer_types=["dense", "sparse", "sparse"],  # the release's pattern: the first layer dense
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
    rope_interleave=True, max_position_embeddings=256, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def mlp_types(c) -> tuple[str, ...]:
    """ModelArgs.mlp_types of a config that lists each layer's MLP ("dense" / "sparse": mlp_layer_types)."""
    types = tuple(c.mlp_layer_types)
    require(len(types) == c.num_hidden_layers,
            f"mlp_layer_types has {len(types)} entries, num_hidden_layers is {c.num_hidden_layers}")
    require(set(types) <= {DENSE, SPARSE}, f"mlp_layer_types {sorted(set(types) - {DENSE, SPARSE})} (only dense, sparse)")
    return types


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"glm4_moe_lite: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(rope_parameters(c).get("partial_rotary_factor", 1.0) == 1.0,
            "glm4_moe_lite: partial_rotary_factor (the latent attention rotates all qk_rope_head_dim dims)")
    return hf_args(c, "glm4_moe_lite", rope=rope_of(c, interleave=bool(c.rope_interleave)), attention=mla(c),
                   mlp_types=mlp_types(c), intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                   shared_expert_gated=False, router=deepseek_router(c, **sigmoid_routing(c)))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


def first_dense(c) -> int:
    """mlx-lm's first_k_dense_replace: the dense layers of mlp_layer_types, which must all come first."""
    return sum(t == DENSE for t in c.mlp_layer_types)


MLX = MlxLm(
    module="glm4_moe_lite",
    config=dict(
        **MLA_NAMES,
        topk_method=const("noaux_tc"), scoring_func=const("sigmoid"),  # what HF hard-codes
        norm_topk_prob="norm_topk_prob", moe_layer_freq=const(1), first_k_dense_replace=first_dense,
        rope_theta=rope_theta_any, rope_scaling=yarn_scaling, attention_dropout=const(0.0),
        partial_rotary_factor=const(1.0), tie_word_embeddings="tie_word_embeddings",
        num_nextn_predict_layers=const(0), quantization=const(None),
    ),
    require=COMMON_REQUIRE + YARN_REQUIRE + NOAUX + UNTIED + (
        (lambda c: c.rope_interleave, "rope_interleave=False (mlx-lm rotates interleaved pairs)"),
        (lambda c: tuple(c.mlp_layer_types) == (DENSE,) * first_dense(c) + (SPARSE,) * (c.num_hidden_layers - first_dense(c)),
         "dense layers after a sparse one in mlp_layer_types (mlx-lm reads first_k_dense_replace)"),
    ),
    array_mask=True,
)

FAMILY = Family(
    name="glm4_moe_lite", model_types=("glm4_moe_lite",), hf_module="glm4_moe_lite",
    hf_class_name="Glm4MoeLiteForCausalLM", hf_config_name="Glm4MoeLiteConfig", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, from_mlx=from_mlx, mlx=MLX, experts="n_routed_experts",
    rules=(*GROUPED, ("positive", "moe_intermediate_size", "intermediate_size"), ("per_layer", "mlp_layer_types"),
           ("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")),
)
