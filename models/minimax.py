"""MiniMax-Text-01 (minimax; not MiniMax-M2, models/minimax_m2.py): most layers' attention is lightning attention
(models/layers/lightning.py: a linear attention decaying by a per-head, per-layer slope, normed, sigmoid-gated; HF's
layer kind "linear_attention", its module self_attn), the rest GQA with RoPE; Mixtral's MoE (softmax, top-k,
renormalised); each residual taken from the *normed* input and both scaled (ModelArgs.residual_factors: HF's
full_attn / linear_attn / mlp alpha and beta factors). mlx-lm 0.32.2 has no model of it (its minimax.py is M2's)."""

from models.args import FULL, LIGHTNING, LINEAR, ModelArgs, ResidualFactors, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta
from models.mixtral import sanitize as mixtral_sanitize

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    # lightning, full, lightning, lightning (the release: 7 lightning to 1 full); blocks of 4 in HF's prefill, so a
    # prompt spans blocks
    layer_types=[LINEAR, FULL, LINEAR, LINEAR], block_size=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    # each factor other than 1 (the release: alpha (2 x layers)^0.25, beta 1)
    full_attn_alpha_factor=1.5, full_attn_beta_factor=0.8, linear_attn_alpha_factor=1.7, linear_attn_beta_factor=0.9,
    mlp_alpha_factor=1.6, mlp_beta_factor=1.1,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, LINEAR}, f"minimax: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.hidden_act == "silu", f"minimax: hidden_act {c.hidden_act!r} (silu is implemented)")
    partial = (c.rope_parameters or {}).get("partial_rotary_factor", 1.0)
    pair = lambda a, b: (float(getattr(c, a)), float(getattr(c, b)))  # noqa: E731
    return hf_args(
        c, "minimax", layer_types=tuple(LIGHTNING if t == LINEAR else FULL for t in c.layer_types),
        rope=RopeArgs(rope_theta(c), partial_rotary_factor=partial), num_experts=c.num_local_experts,
        moe_intermediate_size=c.intermediate_size, router=RouterArgs(norm_topk_prob=True, weights_in_model_dtype=False),
        residual_factors=ResidualFactors(full=pair("full_attn_alpha_factor", "full_attn_beta_factor"),
                                         linear=pair("linear_attn_alpha_factor", "linear_attn_beta_factor"),
                                         mlp=pair("mlp_alpha_factor", "mlp_beta_factor")),
    )


DECAYS = (".slope_rate", ".query_decay", ".key_decay", ".diagonal_decay")  # HF's lightning buffers, derived


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """Mixtral's layout (block_sparse_moe.experts.{e}.w1/w3/w2); HF's lightning decay buffers, which save_pretrained
    writes, left out: the production model derives them from the config (and a checkpoint's own are not read)."""
    return mixtral_sanitize({k: t for k, t in weights.items() if not k.endswith(DECAYS)}, args)


FAMILY = Family(
    name="minimax", model_types=("minimax",), hf_module="minimax", hf_class_name="MiniMaxForCausalLM",
    hf_config_name="MiniMaxConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    experts="num_local_experts", tiny_derived=DECAYS, hf_position_ids=True, rules=(("positive", "intermediate_size", "block_size"),),
)
