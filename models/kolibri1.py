"""Kolibri-1 (Aleph Alpha, kolibri1): sandwich norms (NormArgs.placement "sandwich"; GLM-4's names: the input norm,
post_self_attn_layernorm on the attention's output, post_attention_layernorm before the MLP, post_mlp_layernorm on
its output; the release stores them as post_attn_norm and post_ffn_norm, the correction bias as moe.router.expert_bias), sliding-window layers with rope and full-attention layers without it (NoPE wherever a sliding window
is set, as EXAONE 4: the release's pattern four sliding, then one full), a per-head q/k RMSNorm before the rotation;
every layer sparse: its router ranks the fp32 logits plus a correction bias (RouterArgs.choice_on "logits", not the
scores as DeepSeek-V3), the weights the sigmoid of the chosen logits (renormalised with norm_topk_prob), plus an
always-on shared expert (shared_expert_intermediate_size). No mlx-lm model and no llama.cpp converter class."""

from models.args import FULL, SLIDING, AttentionArgs, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, renamed, require, rope_theta, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
    # both kinds, the window shorter than the prompts (the release: 4 sliding then 1 full, window 513)
    layer_types=[SLIDING, SLIDING, FULL], sliding_window=4,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"kolibri1: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(set(c.layer_types) <= {FULL, SLIDING}, f"kolibri1: unknown layer_types {sorted(set(c.layer_types))}")
    # HF's Kolibri1Attention (EXAONE 4's): rope where there is no sliding window at all, else on the sliding layers
    rotates = tuple(int(c.sliding_window is None or t == SLIDING) for t in c.layer_types)
    return hf_args(
        c, "kolibri1", layer_types=tuple(c.layer_types), norm=NormArgs(placement="sandwich"),
        rope=RopeArgs(rope_theta(c), per_layer=() if all(rotates) else rotates),
        attention=AttentionArgs(qk_norm="head", sliding_window=c.sliding_window),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size or 0, shared_expert_gated=False,
        router=RouterArgs(scoring="sigmoid", choice_on="logits", correction_bias=True,
                          norm_topk_prob=bool(c.norm_topk_prob), fp32=True, weights_in_model_dtype=False,
                          fp32_params=("e_score_correction_bias",)),  # HF: _keep_in_fp32_modules_strict
    )


# HF's in-memory norm names (GLM-4's sandwich) -> the production model's: post_attention_layernorm is GLM-4's pre-MLP
# norm. The one map the checkpoint (sanitize), the trained profile (profile_view) and the drill (hf_point_names) read
HF_NORMS = {"post_attention_layernorm": "pre_feedforward_layernorm",
            "post_self_attn_layernorm": "post_attention_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"}
# ... and the release's names (what transformers' kolibri1 conversion reads) -> HF's in-memory ones
RELEASE = {"post_attn_norm": "post_self_attn_layernorm", "post_ffn_norm": "post_mlp_layernorm"}
TO_PRODUCTION = {**HF_NORMS, **{r: HF_NORMS[h] for r, h in RELEASE.items()}}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf({renamed(k.replace(".moe.router.expert_bias", ".mlp.gate.e_score_correction_bias"),
                                TO_PRODUCTION): t for k, t in weights.items()}, args)


def profile_view(sd: dict, cfg: dict) -> dict:
    """HF's in-memory names (what the trained profile rewrites) -> the profile's: the residual-stream norms by role."""
    return {renamed(k, HF_NORMS): t for k, t in sd.items()}


FAMILY = Family(
    name="kolibri1", model_types=("kolibri1",), hf_module="kolibri1", hf_class_name="Kolibri1ForCausalLM",
    hf_config_name="Kolibri1Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    # the correction bias must move choices: beside fp32 logits of std ~0.8 the tiny draws' 0.1 never does
    tiny_std={"e_score_correction_bias": 1.0}, hf_profile_view=profile_view,
    hf_point_names=HF_NORMS,
    rules=(("positive", "moe_intermediate_size", "sliding_window"),),
)
