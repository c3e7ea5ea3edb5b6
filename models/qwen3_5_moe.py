"""Qwen3.5-MoE (text): hybrid Gated DeltaNet + gated full attention (partial rotary,
per-head q/k norm), (1 + w) RMSNorm, softmax top-k routing with renormalisation and a
sigmoid-gated shared expert."""

from models.args import FULL, LINEAR, AttentionArgs, LinearAttentionArgs, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.checkpoint import conv1d_from_mlx, unstack_experts
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, ConfigError, MlxLm, const
from models.rules import GATED_DELTANET

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
        c, "qwen3_5_moe", rope=RopeArgs(rope_theta(c), partial_rotary_factor=partial), norm=NormArgs(offset=True),
        attention=AttentionArgs(qk_norm="head", output_gate=True, qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size, router=RouterArgs(norm_topk_prob=True),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, layer_types=tuple(c.layer_types),
        linear_attention=gated_deltanet(c),
    )


def gated_deltanet(c) -> LinearAttentionArgs:
    return LinearAttentionArgs(c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                               c.linear_value_head_dim, c.linear_conv_kernel_dim)


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
    return from_mlx_names(weights, "model.language_model." if isinstance(config.get("text_config"), dict) else "model.")


def from_mlx_names(weights: dict, base: str) -> dict:
    """(also Qwen3-Next's) mlx-lm's text names under `base`, per-expert tensors, norms as w, conv1d [C, 1, K]."""
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
        out[k] = v
    return conv1d_from_mlx(out)


def _rope_parameters(c):
    """mlx-lm reads rope_theta and partial_rotary_factor out of rope_parameters (with defaults
    1e5 and 0.25): pass all three keys, as HF resolves them."""
    rp = c.rope_parameters or {}
    partial = rp.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    return {"type": "default", "rope_theta": rope_theta(c), "partial_rotary_factor": partial}


def full_attention_interval_of(c):
    """mlx-lm's Qwen3.5 ignores layer_types: layer i is full attention iff (i + 1) % n == 0."""
    types = list(c.layer_types)
    n = types.index(FULL) + 1 if FULL in types else 0
    want = [FULL if n and (i + 1) % n == 0 else LINEAR for i in range(len(types))]
    if types != want:
        raise ConfigError(f"qwen3_5_moe: layer_types {types} is not periodic (linear_attention x (n-1), "
                          "full_attention): mlx-lm derives the layer kinds from full_attention_interval only")
    return n


def conv1d_shape(name: str, shape) -> str | None:
    """mlx-lm's sanitize adds 1 to the (1 + w) RMSNorm weights only while conv1d is still HF-shaped
    [C, 1, K]: anything else would silently drop the offset."""
    if name.endswith("conv1d.weight") and not (len(shape) == 3 and shape[1] == 1 and shape[2] > 1):
        return (f"{name} has shape {list(shape)}, expected HF's [C, 1, K>1]: mlx-lm's sanitize would then "
                "not add 1 to the (1 + w) RMSNorm weights")
    return None


MLX = MlxLm(
    module="qwen3_5_moe",
    args_class=("qwen3_5", "TextModelArgs"),  # the text_config of qwen3_5_moe's ModelArgs
    config=dict(
        model_type=const("qwen3_5_moe"),  # HF's text model_type is qwen3_5_moe_text
        hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        head_dim="head_dim", rms_norm_eps="rms_norm_eps", vocab_size="vocab_size",
        max_position_embeddings="max_position_embeddings", attention_bias="attention_bias",
        tie_word_embeddings="tie_word_embeddings",
        linear_num_value_heads="linear_num_value_heads", linear_num_key_heads="linear_num_key_heads",
        linear_key_head_dim="linear_key_head_dim", linear_value_head_dim="linear_value_head_dim",
        linear_conv_kernel_dim="linear_conv_kernel_dim",
        full_attention_interval=full_attention_interval_of,
        num_experts="num_experts", num_experts_per_tok="num_experts_per_tok",
        moe_intermediate_size="moe_intermediate_size",
        shared_expert_intermediate_size="shared_expert_intermediate_size",
        norm_topk_prob=const(True),  # HF's Qwen3.5-MoE router always renormalises
        intermediate_size=const(0),  # dense-MLP size, read only when num_experts == 0 (require)
        decoder_sparse_step=const(1),  # not read by mlx-lm's qwen3_5: every layer is MoE, as in HF
        rope_parameters=_rope_parameters, rope_scaling=_rope_parameters,  # mlx-lm: rope_scaling = rope_parameters
        rope_theta=rope_theta, partial_rotary_factor=lambda c: _rope_parameters(c)["partial_rotary_factor"],
    ),
    require=COMMON_REQUIRE + ((lambda c: c.num_experts > 0, "num_experts == 0 (a dense Qwen3.5, not this family)"),),
    experts="fused",  # its sanitize() accepts nothing else
    check_tensor=conv1d_shape,
)

FAMILY = Family(
    # the text-only config, or the multimodal release's composite one (its text_config is read)
    name="qwen3_5_moe", model_types=("qwen3_5_moe_text", "qwen3_5_moe"), hf_module="qwen3_5_moe",
    hf_class_name="Qwen3_5MoeForCausalLM", hf_config_name="Qwen3_5MoeTextConfig",
    tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx, mlx=MLX,
    rules=(("positive", "moe_intermediate_size"), *GATED_DELTANET),
)
