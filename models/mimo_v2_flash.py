"""MiMo-V2-Flash (Xiaomi): GQA without q/k norm where the sliding-window layers (layer_types; the release's
pattern: the first layer and every sixth full, the rest sliding) have twice the full layers' kv heads
(ModelArgs.layer_kv_heads) and a learned sink per head (AttentionArgs.sinks_on "sliding"); value heads
narrower than the q/k heads (v_head_dim, AttentionArgs.v_head_dim), the values times attention_value_scale
before the attention; a rope per layer type (rope_parameters keyed by layer type: RopeArgs.sliding), each
rotating a fraction of the head (partial_rotary_factor, 0.334 where a type states none); DeepSeek-V3's router
(sigmoid scores + correction bias for the choice, groups, renormalised, routed_scaling_factor) without a
shared expert; dense layers by mlp_layer_types (the release's first). The release's multi-token-prediction
layers (model.mtp.*) are not part of the model HF runs: left out."""

from models.args import DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs
from models.family import Family
from models.mapping import deepseek_router, hf_args, require, rope_per_type, sanitize_hf, sigmoid_routing
from models.mlx_lm import COMMON_REQUIRE, NOAUX, UNTIED, MlxLm, const
from models.rules import GROUPED

PARTIAL = 0.334  # HF's MiMoV2FlashRotaryEmbedding default where a type's rope_parameters state none

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=2, head_dim=24, v_head_dim=16, attention_value_scale=0.707,
    n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
    routed_scaling_factor=1.0, max_position_embeddings=256,
    # every kind: a dense full layer, then sparse sliding ones (with sinks and twice the kv heads); the window
    # shorter than the prompts
    layer_types=[FULL, SLIDING, SLIDING], mlp_layer_types=[DENSE, SPARSE, SPARSE], sliding_window=4,
    # the release's two ropes (HF's defaults): theta 5e6 on the full layers, 1e4 on the sliding ones, a third
    # of each head rotated (int(24 * 0.334) = 8 dims)
    rope_parameters={FULL: {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": PARTIAL},
                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": PARTIAL}},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

# the release's own config.json fields beside HF's (HF 5.23 derives its layer_types, rope_parameters and window from
# its defaults and sliding_window_size: sliding_window = sliding_window_size + 1, 4 here), as the release writes them
# (its sliding_window equals sliding_window_size, 128; no rope_parameters: HF's defaults, TINY's, are the release's
# thetas and fraction): what llama.cpp's converter reads
RELEASE = dict(
    hybrid_layer_pattern=[int(t == SLIDING) for t in TINY["layer_types"]],
    moe_layer_freq=[int(t == SPARSE) for t in TINY["mlp_layer_types"]],
    sliding_window=TINY["sliding_window"] - 1, sliding_window_size=TINY["sliding_window"] - 1,
    swa_num_attention_heads=TINY["num_attention_heads"], swa_num_key_value_heads=2 * TINY["num_key_value_heads"],
    swa_head_dim=TINY["head_dim"], swa_v_head_dim=TINY["v_head_dim"],
    rope_theta=TINY["rope_parameters"][FULL]["rope_theta"], swa_rope_theta=TINY["rope_parameters"][SLIDING]["rope_theta"],
    partial_rotary_factor=PARTIAL, add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
    scoring_func="sigmoid", topk_method="noaux_tc", layernorm_epsilon=1e-5,  # (HF's rms_norm_eps default)
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"mimo_v2_flash: unknown layer_types {sorted(set(c.layer_types))}")
    require(set(c.mlp_layer_types) <= {DENSE, SPARSE},
            f"mimo_v2_flash: unknown mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    kvh = c.num_key_value_heads
    return hf_args(
        c, "mimo_v2_flash", rope=rope_per_type(c, partial=PARTIAL), layer_types=tuple(c.layer_types),
        layer_kv_heads=tuple(2 * kvh if t == SLIDING else kvh for t in c.layer_types),
        attention=AttentionArgs(qkv_bias=c.attention_bias, sliding_window=c.sliding_window, sinks=True,
                                sinks_on="sliding", v_head_dim=c.v_head_dim,
                                value_scale=1.0 if c.attention_value_scale is None else float(c.attention_value_scale)),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
        moe_intermediate_size=c.moe_intermediate_size, router=deepseek_router(c, **sigmoid_routing(c)),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # the release's self_attn.attention_sink_bias is HF's sinks; its model.mtp.* layers HF does not load
    w = {k.replace(".self_attn.attention_sink_bias", ".self_attn.sinks"): t for k, t in weights.items()
         if not k.startswith("model.mtp.")}
    return sanitize_hf(w, args)


def _rope(c, kind: str) -> dict:
    rp = c.rope_parameters or {}
    return rp.get(kind) or rp


def _partials(c) -> set:
    return {float(_rope(c, t).get("partial_rotary_factor", PARTIAL)) for t in set(c.layer_types)}


MLX = MlxLm(
    module="mimo_v2_flash",
    config=dict(
        model_type="model_type", num_experts_per_tok="num_experts_per_tok",
        # the release's own fields, which HF's config derives its own from
        hybrid_layer_pattern=lambda c: [int(t == SLIDING) for t in c.layer_types],
        moe_layer_freq=lambda c: [int(t == SPARSE) for t in c.mlp_layer_types],
        add_swa_attention_sink_bias=const(True), add_full_attention_sink_bias=const(False),
        # HF: sliding_window = the release's sliding_window_size + 1 (SGLang attends that many previous tokens
        # plus the query); mlx-lm reads sliding_window_size as its window, the query included
        sliding_window_size=lambda c: c.sliding_window - 1,
        vocab_size="vocab_size", hidden_size="hidden_size", intermediate_size="intermediate_size",
        moe_intermediate_size="moe_intermediate_size", num_hidden_layers="num_hidden_layers",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        n_shared_experts=const(None), n_routed_experts="n_routed_experts",
        routed_scaling_factor="routed_scaling_factor", topk_method=const("noaux_tc"), scoring_func=const("sigmoid"),
        norm_topk_prob="norm_topk_prob", n_group="n_group", topk_group="topk_group",
        max_position_embeddings="max_position_embeddings", layernorm_epsilon="rms_norm_eps",
        rope_theta=lambda c: float(_rope(c, FULL)["rope_theta"]),
        swa_rope_theta=lambda c: float(_rope(c, SLIDING)["rope_theta"]),
        swa_num_attention_heads="num_attention_heads",
        swa_num_key_value_heads=lambda c: 2 * c.num_key_value_heads, head_dim="head_dim", v_head_dim="v_head_dim",
        swa_head_dim="head_dim", swa_v_head_dim="v_head_dim",
        partial_rotary_factor=lambda c: next(iter(_partials(c))), attention_value_scale="attention_value_scale",
    ),
    require=COMMON_REQUIRE + NOAUX + UNTIED + (
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's mimo_v2_flash has no attention biases)"),
        (lambda c: FULL in c.layer_types and SLIDING in c.layer_types,
         "layer_types without both kinds (mlx-lm's mimo_v2_flash looks up one layer of each)"),
        (lambda c: all(_rope(c, t).get("rope_type", "default") == "default" for t in set(c.layer_types)),
         "rope scaling (mlx-lm's mimo_v2_flash reads no rope scaling)"),
        (lambda c: len(_partials(c)) == 1, "a partial_rotary_factor per layer type (mlx-lm's mimo_v2_flash has one)"),
    ),
)

FAMILY = Family(
    name="mimo_v2_flash", model_types=("mimo_v2_flash",), hf_module="mimo_v2_flash",
    hf_class_name="MiMoV2FlashForCausalLM", hf_config_name="MiMoV2FlashConfig", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, mlx=MLX, experts="n_routed_experts", release_config=RELEASE,
    release_drops=("rope_parameters",),
    rules=(*GROUPED, ("positive", "moe_intermediate_size", "intermediate_size", "v_head_dim", "sliding_window"),
           ("per_layer", "mlp_layer_types")),
)
