"""FlexOlmo (flex_olmo): OLMoE's MoE (softmax top-k routing, optionally renormalised; no shared expert)
under OLMo 2's layer: post-norms only, each block's output normed before its residual add and no norm
before a block (NormArgs.placement "post": post_attention_layernorm, post_feedforward_layernorm), a flat
q/k RMSNorm over each whole projection, OLMo 2's RMSNorm ((w * x).to(dtype)), default RoPE."""

from models.args import AttentionArgs, ModelArgs, NormArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"flex_olmo: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    return hf_args(
        c, "flex_olmo", head_dim=c.hidden_size // c.num_attention_heads,
        norm=NormArgs(gain_fp32=True, placement="post"),
        attention=AttentionArgs(qk_norm="flat", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.intermediate_size,
        router=RouterArgs(norm_topk_prob=c.norm_topk_prob),
    )


FAMILY = Family(
    name="flex_olmo", model_types=("flex_olmo",), hf_module="flex_olmo", hf_class_name="FlexOlmoForCausalLM",
    hf_config_name="FlexOlmoConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize_hf,
    rules=(("positive", "intermediate_size"),),
)
