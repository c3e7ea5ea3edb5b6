"""GraniteMoE-SWA (IBM Granite "swash"): GraniteMoE's layer (models/granitemoe.py: the four multipliers, top-k
logits then softmax over those k) with sliding-window layers (layer_types), a learned sink per head in every
layer's softmax (HF computes it as sigmoid(logsumexp - sink) times the output: the same as one more softmax
logit), and a rope base per layer (layer_rope_theta, 0: no rope on that layer; RopeArgs.layer_theta).
HF's shared MLP beside the MoE block (shared_intermediate_size > 0, default 0) is granitemoeshared's mechanism
(ModelArgs.shared_expert_beside, its fused input_linear split by that family's sanitize): the tiny config has none
(granitemoeshared's tiny checks it); tests/test_checkpoint.py checks a config with one."""

from models.args import FULL, SLIDING, AttentionArgs, ModelArgs, RopeArgs
from models.family import Family
from models.granitemoe import to_args as granitemoe_args
from models.granitemoeshared import sanitize as shared_sanitize
from models.mapping import require, rope_of

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # every kind: a full layer without rope, sliding layers at the global base and at their own
    layer_types=[FULL, SLIDING, SLIDING], sliding_window=4, layer_rope_theta=[0, 10000.0, 1000000.0],
    # granitemoe's tiny multipliers (the release's, the attention one scaled to head_dim 16)
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=6.0,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def layer_theta(c) -> tuple[float, ...]:
    """layer_rope_theta where a layer's base is not the global one (HF fills it with the global base)."""
    thetas = tuple(float(t) for t in (c.layer_rope_theta or ()))
    global_theta = float(c.rope_parameters["rope_theta"])
    return thetas if any(t != global_theta for t in thetas) else ()


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"granitemoe_swa: unknown layer_types {sorted(set(c.layer_types))}")
    a = granitemoe_args(c)
    attention = AttentionArgs(qkv_bias=c.attention_bias, o_bias=c.attention_bias, sliding_window=c.sliding_window,
                              sinks=True)
    rope: RopeArgs = rope_of(c, layer_theta=layer_theta(c))
    shared = int(c.shared_intermediate_size or 0)
    return ModelArgs(**{**a.__dict__, "family": "granitemoe_swa", "layer_types": tuple(c.layer_types),
                        "attention": attention, "rope": rope, "shared_expert_beside": shared > 0,
                        "shared_expert_intermediate_size": shared, "shared_expert_gated": False})


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return shared_sanitize(weights, args)  # (granitemoe's, the shared MLP's input_linear split where there is one)


FAMILY = Family(
    name="granitemoe_swa", model_types=("granitemoe_swa",), hf_module="granitemoe_swa",
    hf_class_name="GraniteMoeSWAForCausalLM", hf_config_name="GraniteMoeSWAConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, hf_moe="block_sparse_moe", hf_router="block_sparse_moe.router",
    # mlx-lm 0.32.2 has no granitemoe_swa model
    experts="num_local_experts",
    rules=(("positive", "intermediate_size", "logits_scaling", "sliding_window"), ("per_layer", "layer_rope_theta")),
)
