"""Flint (flint): Qwen3-MoE's attention with a per-head q/k RMSNorm and a learned sink logit per head
(gpt-oss's), rope on the sliding-window layers only (the full-attention layers have no positional
encoding: NoPE); gpt-oss's RMSNorm ((w * x).to(dtype)) everywhere; experts chosen on the sigmoid of fp32
router logits (no correction bias), the chosen scores renormalised (fp32) as weights; an always-on,
ungated shared expert (`mlp.shared_expert`, shared_expert_intermediate_size wide); the mlp_only_layers
(and the layers off decoder_sparse_step) dense, intermediate_size wide."""

from models.args import DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
    # every layer kind: a dense NoPE full layer, a sparse rope sliding layer, a sparse NoPE full layer
    layer_types=[FULL, SLIDING, FULL], mlp_only_layers=[0], sliding_window=4,  # the prompts are longer
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def sparse(c, i: int) -> bool:
    return i not in c.mlp_only_layers and c.num_experts > 0 and (i + 1) % c.decoder_sparse_step == 0


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"flint: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.hidden_act == "silu", f"flint: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    n = c.num_hidden_layers
    return hf_args(
        c, "flint", layer_types=tuple(c.layer_types),
        # only the sliding-window layers rotate
        rope=RopeArgs(rope_theta(c), per_layer=tuple(int(t == SLIDING) for t in c.layer_types)),
        norm=NormArgs(gain_fp32=True),  # FlintRMSNorm is GptOssRMSNorm
        attention=AttentionArgs(qk_norm="head", sinks=True, sliding_window=c.sliding_window,
                                qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        mlp_types=tuple(SPARSE if sparse(c, i) else DENSE for i in range(n)), intermediate_size=c.intermediate_size,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, shared_expert_gated=False,
        # HF: fp32 logits (the weight kept in fp32), sigmoid, top-k, renormalised, the fp32 weights into the sum
        router=RouterArgs(scoring="sigmoid", norm_topk_prob=c.norm_topk_prob, fp32=True, fp32_params=("weight",),
                          weights_in_model_dtype=False),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's sink logits (self_attn.softmax_offset, what save_pretrained writes; HF's in-memory
    name is sinks) and its ungated shared expert (mlp.shared_expert: the production model's always-on one)."""
    return sanitize_hf({k.replace(".self_attn.softmax_offset", ".self_attn.sinks")
                        .replace(".mlp.shared_expert.", ".mlp.shared_experts."): t for k, t in weights.items()}, args)


FAMILY = Family(
    name="flint", model_types=("flint",), hf_module="flint", hf_class_name="FlintForCausalLM",
    hf_config_name="FlintConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    rules=(("positive", "intermediate_size", "moe_intermediate_size", "decoder_sparse_step", "sliding_window"),
           ("layer_index", "mlp_only_layers")),
)
