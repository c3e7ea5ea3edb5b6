"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing with renormalisation, no shared expert."""

from models import Family, ModelArgs, hf_args, require, sanitize_hf

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
        c, "qwen3_moe", qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size, norm_topk_prob=c.norm_topk_prob,
    )


FAMILY = Family(
    name="qwen3_moe", model_types=("qwen3_moe",), hf_module="qwen3_moe", hf_class_name="Qwen3MoeForCausalLM",
    hf_config_name="Qwen3MoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf,
)
