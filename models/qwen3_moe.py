"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing with renormalisation, no shared expert."""

from models.args import AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const, head_dim

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(not c.mlp_only_layers and c.decoder_sparse_step == 1,
            "qwen3_moe: dense MLP layers (mlp_only_layers / decoder_sparse_step > 1) are not supported yet")
    require(not c.use_sliding_window, "qwen3_moe: use_sliding_window is not supported yet")
    return hf_args(
        c, "qwen3_moe", attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=c.norm_topk_prob),
    )


MLX = MlxLm(
    module="qwen3_moe",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", head_dim=head_dim, rms_norm_eps="rms_norm_eps",
        vocab_size="vocab_size", max_position_embeddings="max_position_embeddings",
        num_experts="num_experts",  # HF saves num_local_experts; its config class maps the name
        num_experts_per_tok="num_experts_per_tok", norm_topk_prob="norm_topk_prob",
        decoder_sparse_step="decoder_sparse_step", mlp_only_layers="mlp_only_layers",
        moe_intermediate_size="moe_intermediate_size", tie_word_embeddings="tie_word_embeddings",
        rope_theta=rope_theta, rope_scaling=const(None),
    ),
    require=COMMON_REQUIRE + (
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's qwen3_moe has no attention biases)"),
        (lambda c: not c.use_sliding_window, "use_sliding_window (mlx-lm's qwen3_moe has none)"),
    ),
)

FAMILY = Family(
    name="qwen3_moe", model_types=("qwen3_moe",), hf_module="qwen3_moe", hf_class_name="Qwen3MoeForCausalLM",
    hf_config_name="Qwen3MoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf, mlx=MLX,
    rules=(("positive", "moe_intermediate_size", "decoder_sparse_step"), ("layer_index", "mlp_only_layers")),
)
