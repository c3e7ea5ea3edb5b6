"""Mellum (JetBrains Mellum2): Qwen3-MoE's layer (per-head q/k RMSNorm, softmax top-k routing renormalised,
no shared expert) with sliding-window layers (layer_types) and a rope per layer type (rope_parameters keyed by
"full_attention" / "sliding_attention", each its own theta and rotary fraction: RopeArgs.sliding), and
optional dense layers (mlp_layer_types, intermediate_size). The release's multi-token-prediction layer (mtp.*)
is not part of the model HF runs: left out."""

from models.args import DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_per_type, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, head_dim

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    layer_types=[SLIDING, FULL], sliding_window=4,  # the prompts are longer than the window
    # the release's two ropes (HF's defaults): the full layers' theta 5e5, the sliding layers' 1e4
    rope_parameters={FULL: {"rope_type": "default", "rope_theta": 500000.0},
                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"mellum: unknown layer_types {sorted(set(c.layer_types))}")
    require(set(c.mlp_layer_types) <= {DENSE, SPARSE}, f"mellum: unknown mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    return hf_args(
        c, "mellum", rope=rope_per_type(c), layer_types=tuple(c.layer_types),
        attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                                sliding_window=c.sliding_window),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=c.norm_topk_prob),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # HF ignores the release's multi-token-prediction layer (_keys_to_ignore_on_load_unexpected: ^mtp\.)
    return sanitize_hf({k: t for k, t in weights.items() if not k.startswith("mtp.")}, args)


def _rope_types(c) -> list:
    rp = c.rope_parameters or {}
    return [rp.get(t) or {} for t in set(c.layer_types)]


MLX = MlxLm(
    module="mellum",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_experts="num_experts", num_experts_per_tok="num_experts_per_tok",
        moe_intermediate_size="moe_intermediate_size", rms_norm_eps="rms_norm_eps", vocab_size="vocab_size",
        num_key_value_heads="num_key_value_heads", head_dim=head_dim, tie_word_embeddings="tie_word_embeddings",
        max_position_embeddings="max_position_embeddings", norm_topk_prob="norm_topk_prob",
        sliding_window="sliding_window", layer_types=lambda c: list(c.layer_types),
        rope_parameters=lambda c: {t: dict(p) for t, p in (c.rope_parameters or {}).items() if isinstance(p, dict)},
    ),
    require=COMMON_REQUIRE + (
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's mellum has no attention biases)"),
        (lambda c: all(t == SPARSE for t in c.mlp_layer_types), "dense layers (mlx-lm's mellum has an MoE in every layer)"),
        (lambda c: FULL in c.layer_types, "no full_attention layer (mlx-lm's mellum builds its mask from the first)"),
        (lambda c: SLIDING not in c.layer_types or c.sliding_window is not None,
         "sliding layers without a sliding_window (mlx-lm's mellum gives them a rotating cache of that size)"),
        (lambda c: all(p.get("rope_type", "default") == "default" for p in _rope_types(c)),
         "rope scaling (mlx-lm's mellum is checked here with default RoPE only)"),
        (lambda c: all(p.get("partial_rotary_factor", 1.0) == 1.0 for p in _rope_types(c)),
         "partial_rotary_factor (mlx-lm's mellum rotates every dim of the head)"),
    ),
)

FAMILY = Family(
    name="mellum", model_types=("mellum",), hf_module="mellum", hf_class_name="MellumForCausalLM",
    hf_config_name="MellumConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    rules=(("positive", "moe_intermediate_size", "intermediate_size", "sliding_window"),
           ("per_layer", "mlp_layer_types")),
)
