"""K-EXAONE (exaone_moe): sliding-window layers with rope (the last sliding_window positions) and full-attention
layers without it (NoPE, where a sliding window is set; rope on every layer where it is not), a per-head q/k
RMSNorm before the rotation, dense layers by mlp_layer_types (the first `first_k_dense_replace` by default),
then experts chosen as DeepSeek-V3 does (sigmoid + correction bias in fp32, group-limited), renormalised,
times routed_scaling_factor, plus always-on shared experts. The release keeps the correction bias beside
the router (mlp.e_score_correction_bias); HF reads it into the router (mlp.gate)."""

from models.args import DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, RopeArgs
from models.checkpoint import unstack_experts
from models.family import Family
from models.mapping import deepseek_router, hf_args, require, rope_theta, sanitize_hf, sigmoid_routing
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, MlxLm, const, head_dim

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    num_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, n_group=1, topk_group=1,
    first_k_dense_replace=1,  # layer 0 dense, 1-3 MoE
    # the release's pattern (three sliding-window layers, then a full one), the window shorter than the prompts
    sliding_window=4, sliding_window_pattern=4,
    layer_types=[SLIDING, SLIDING, SLIDING, FULL], max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    # the release's own fields (HF keeps them as they are; llama.cpp's converter takes the gating function from
    # scoring_func, and its loader refuses a GGUF without it)
    scoring_func="sigmoid", topk_method="noaux_tc",
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"exaone_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(set(c.layer_types) <= {FULL, SLIDING}, f"exaone_moe: unknown layer_types {sorted(set(c.layer_types))}")
    require(set(c.mlp_layer_types) <= {SPARSE, DENSE}, f"exaone_moe: mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    # HF's ExaoneMoeAttention: rope where there is no sliding window at all, else on the sliding layers only
    rotates = tuple(int(c.sliding_window is None or t == SLIDING) for t in c.layer_types)
    return hf_args(
        c, "exaone_moe", layer_types=tuple(c.layer_types),
        rope=RopeArgs(rope_theta(c), per_layer=() if all(rotates) else rotates),
        attention=AttentionArgs(qk_norm="head", sliding_window=c.sliding_window),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size, num_experts=c.num_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.num_shared_experts or 0), shared_expert_gated=False,
        router=deepseek_router(c, **sigmoid_routing(c)),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # the release's mlp.e_score_correction_bias (HF: WeightRenaming into mlp.gate); no multi-token-prediction layers
    w = {k.replace(".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"): t for k, t in weights.items()
         if not k.startswith("mtp.")}
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names back to the release's (the inverse of its sanitize): the correction bias under mlp., the
    stacked experts per expert."""
    return unstack_experts({k.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"): t
                            for k, t in weights.items()})


MLX = MlxLm(
    module="exaone_moe",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", moe_intermediate_size="moe_intermediate_size",
        num_hidden_layers="num_hidden_layers", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", head_dim=head_dim, num_experts="num_experts",
        num_experts_per_tok="num_experts_per_tok", num_shared_experts="num_shared_experts",
        rms_norm_eps="rms_norm_eps", max_position_embeddings="max_position_embeddings",
        sliding_window="sliding_window", layer_types=lambda c: list(c.layer_types),
        is_moe_layer=lambda c: [t == SPARSE for t in c.mlp_layer_types], n_group="n_group", topk_group="topk_group",
        routed_scaling_factor="routed_scaling_factor", norm_topk_prob="norm_topk_prob",
        scoring_func=const("sigmoid"), topk_method=const("noaux_tc"),  # what HF hard-codes
        rope_theta=rope_theta, rope_scaling=const(None),
        rope_parameters=lambda c: {"rope_type": "default", "rope_theta": rope_theta(c)},
        tie_word_embeddings="tie_word_embeddings",
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE + (
        (lambda c: not (c.norm_topk_prob and c.num_experts_per_tok == 1),
         "norm_topk_prob with num_experts_per_tok=1 (mlx-lm skips renormalisation at top_k 1)"),
        (lambda c: c.num_experts_per_tok <= c.topk_group * (c.num_experts // c.n_group),
         "num_experts_per_tok > the experts of the kept groups (mlx-lm masks groups with 0, HF with -inf)"),
        (lambda c: c.sliding_window is None or SLIDING in c.layer_types,
         "a sliding_window without sliding layers (HF rotates no layer, mlx-lm every one)"),
        (lambda c: c.sliding_window is not None or SLIDING not in c.layer_types,
         "sliding layers without a sliding_window"),
    ),
)

FAMILY = Family(
    name="exaone_moe", model_types=("exaone_moe",), hf_module="exaone_moe", hf_class_name="ExaoneMoeForCausalLM",
    hf_config_name="ExaoneMoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX, from_mlx=from_mlx,
    rules=(("positive", "n_group", "topk_group", "moe_intermediate_size", "intermediate_size", "sliding_window"),
           ("at_most", "topk_group", "n_group"), ("divides", "n_group", "num_experts")),
)
