"""Qwen2-MoE: q/k/v bias, softmax top-k routing, sigmoid-gated shared expert. rope_theta 1e4 (HF default)."""

from models.args import AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, rope

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(not c.mlp_only_layers and c.decoder_sparse_step == 1,
            "qwen2_moe: dense MLP layers (mlp_only_layers / decoder_sparse_step > 1) are not supported yet")
    require(not c.use_sliding_window, "qwen2_moe: use_sliding_window is not supported yet")
    return hf_args(
        c, "qwen2_moe", head_dim=c.hidden_size // c.num_attention_heads, attention=AttentionArgs(qkv_bias=c.qkv_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=c.norm_topk_prob),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size,
    )


MLX = MlxLm(
    module="qwen2_moe",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size",  # dense-MLP size: mlx-lm's qwen2_moe has none (require)
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        rms_norm_eps="rms_norm_eps", vocab_size="vocab_size", num_experts="num_experts",
        num_experts_per_tok="num_experts_per_tok", moe_intermediate_size="moe_intermediate_size",
        shared_expert_intermediate_size="shared_expert_intermediate_size",
        tie_word_embeddings="tie_word_embeddings", **rope(rope_theta),
    ),
    require=COMMON_REQUIRE + (
        (lambda c: c.qkv_bias, "qkv_bias=False (mlx-lm's qwen2_moe always has q/k/v biases)"),
        (lambda c: not c.norm_topk_prob, "norm_topk_prob=True (mlx-lm's qwen2_moe never renormalises top-k)"),
        (lambda c: not c.use_sliding_window, "use_sliding_window (mlx-lm's qwen2_moe has none)"),
        (lambda c: not c.mlp_only_layers and c.decoder_sparse_step == 1,
         "dense MLP layers (mlx-lm's qwen2_moe puts an MoE in every layer)"),
    ),
)

FAMILY = Family(
    name="qwen2_moe", model_types=("qwen2_moe",), hf_module="qwen2_moe", hf_class_name="Qwen2MoeForCausalLM",
    hf_config_name="Qwen2MoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf, mlx=MLX,
    rules=(("positive", "moe_intermediate_size", "decoder_sparse_step"), ("layer_index", "mlp_only_layers")),
)
