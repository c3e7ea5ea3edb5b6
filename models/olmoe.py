"""OLMoE: flat q/k RMSNorm over the whole projection, softmax top-k routing, no shared expert."""

from models import Family, ModelArgs, hf_args, require, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=False, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.clip_qkv is None, "olmoe: clip_qkv is not supported yet (q/k/v clamping)")
    return hf_args(
        c, "olmoe", head_dim=c.hidden_size // c.num_attention_heads, qk_norm="flat",
        qkv_bias=c.attention_bias, o_bias=c.attention_bias, num_experts=c.num_experts,
        moe_intermediate_size=c.intermediate_size, norm_topk_prob=c.norm_topk_prob,
    )


FAMILY = Family(
    name="olmoe", model_types=("olmoe",), hf_module="olmoe", hf_class_name="OlmoeForCausalLM",
    hf_config_name="OlmoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf,
)
