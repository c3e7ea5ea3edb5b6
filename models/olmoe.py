"""OLMoE: flat q/k RMSNorm over the whole projection, softmax top-k routing, no shared expert."""

from models.args import AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const, head_dim, rope

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=False, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.clip_qkv is None, "olmoe: clip_qkv is not supported yet (q/k/v clamping)")
    return hf_args(
        c, "olmoe", head_dim=c.hidden_size // c.num_attention_heads,
        attention=AttentionArgs(qk_norm="flat", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.intermediate_size,
        router=RouterArgs(norm_topk_prob=c.norm_topk_prob),
    )


MLX = MlxLm(
    module="olmoe",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", head_dim=head_dim, rms_norm_eps="rms_norm_eps",
        vocab_size="vocab_size", max_position_embeddings="max_position_embeddings",
        num_experts="num_experts", num_experts_per_tok="num_experts_per_tok", norm_topk_prob="norm_topk_prob",
        attention_bias="attention_bias", mlp_bias=const(False),  # HF's OLMoE experts have no bias
        tie_word_embeddings="tie_word_embeddings", **rope(rope_theta),
    ),
    require=COMMON_REQUIRE + ((lambda c: c.clip_qkv is None, "clip_qkv (mlx-lm's olmoe does not clamp q/k/v)"),),
)

FAMILY = Family(
    name="olmoe", model_types=("olmoe",), hf_module="olmoe", hf_class_name="OlmoeForCausalLM",
    hf_config_name="OlmoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf, mlx=MLX,
    rules=(("positive", "intermediate_size"),),
)
