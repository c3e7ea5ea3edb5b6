"""Qwen3.5-MoE (text): hybrid Gated DeltaNet + gated full attention (partial rotary,
per-head q/k norm), (1 + w) RMSNorm, softmax top-k routing with renormalisation and a
sigmoid-gated shared expert."""

from models import Family, ModelArgs, hf_args, require, sanitize_hf
from models.layers import FULL, LINEAR
from models.quantized import unstack_experts

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=[LINEAR, LINEAR, LINEAR, FULL], max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    rp = c.rope_parameters or {}
    partial = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    require(set(c.layer_types) <= {FULL, LINEAR}, f"qwen3_5_moe: unknown layer_types {sorted(set(c.layer_types))}")
    return hf_args(
        c, "qwen3_5_moe", partial_rotary_factor=partial, norm_offset=True, qk_norm="head",
        attn_output_gate=True, qkv_bias=c.attention_bias, o_bias=c.attention_bias,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=True,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, layer_types=tuple(c.layer_types),
        linear_num_key_heads=c.linear_num_key_heads, linear_num_value_heads=c.linear_num_value_heads,
        linear_key_head_dim=c.linear_key_head_dim, linear_value_head_dim=c.linear_value_head_dim,
        linear_conv_kernel_dim=c.linear_conv_kernel_dim,
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # text-only checkpoints use model.*, the multimodal release model.language_model.*
    w = {k.replace("model.language_model.", "model.", 1): t for k, t in weights.items()
         if not k.startswith(("mtp.", "model.visual."))}
    return sanitize_hf(w, args)


# the (1 + w) RMSNorms, whose weights mlx-lm's sanitize() stores as 1 + w (not linear_attn.norm)
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names (language_model.model.*, switch_mlp experts, norms stored as 1 + w,
    conv1d as [C, K, 1]) -> HF's: model.* for a text-only config, model.language_model.* for
    the multimodal release's composite one; per-expert tensors."""
    base = "model.language_model." if isinstance(config.get("text_config"), dict) else "model."
    out = {}
    for k, v in unstack_experts(weights).items():
        if k.startswith(("vision_tower.", "model.visual.")):  # a multimodal directory's vision weights
            continue
        if k.startswith("language_model.model."):
            k = base + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        if k.endswith(OFFSET_NORMS) and v.ndim == 1:
            v = v - 1.0
        if k.endswith("conv1d.weight") and v.ndim == 3 and v.shape[-1] == 1:
            v = v.moveaxis(2, 1)
        out[k] = v
    return out


FAMILY = Family(
    # the text-only config, or the multimodal release's composite one (its text_config is read)
    name="qwen3_5_moe", model_types=("qwen3_5_moe_text", "qwen3_5_moe"), hf_module="qwen3_5_moe",
    hf_class_name="Qwen3_5MoeForCausalLM", hf_config_name="Qwen3_5MoeTextConfig",
    tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx,
)
