"""GraniteMoE (IBM Granite 3.0 MoE): Mixtral's layer with four multipliers: the embeddings times
embedding_multiplier, each block's output times residual_multiplier before its residual add,
attention_multiplier as the softmax scale, the logits divided by logits_scaling. Router: top-k of
the logits, softmax over those k (= softmax, top-k, renormalised)."""

import re

from models.args import AttentionArgs, ModelArgs, Multipliers, RouterArgs
from models.family import Family
from models.mapping import hf_args, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # the release's multipliers (granite-3.0-1b-a400m: 12, 0.22, 1/64, 6), the attention one
    # scaled to the tiny head_dim 16 (0.2 where 1/sqrt(16) = 0.25): each differs from 1 or the default
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=6.0,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    return hf_args(
        c, "granitemoe", head_dim=c.hidden_size // c.num_attention_heads, num_experts=c.num_local_experts,
        moe_intermediate_size=c.intermediate_size, router=RouterArgs(norm_topk_prob=True),
        attention=AttentionArgs(qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        multipliers=Multipliers(embedding=float(c.embedding_multiplier), residual=float(c.residual_multiplier),
                                attention=float(c.attention_multiplier), logits_scaling=float(c.logits_scaling)),
    )


# the published layout (what save_pretrained writes) and transformers' in-memory names
RENAMES = ((r"\.block_sparse_moe\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),  # [E, 2I, H] gate, up
           (r"\.block_sparse_moe\.output_linear\.weight$", ".mlp.experts.down_proj"),  # [E, H, I]
           (r"\.block_sparse_moe\.router\.layer\.weight$", ".mlp.gate.weight"),
           (r"\.block_sparse_moe\.router\.weight$", ".mlp.gate.weight"),
           (r"\.block_sparse_moe\.experts\.", ".mlp.experts."))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    out = {}
    for k, t in weights.items():
        for pattern, new in RENAMES:
            k = re.sub(pattern, new, k)
        out[k] = t
    return sanitize_hf(out, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's switch_mlp.{gate,up,down}_proj -> the published input_linear / output_linear."""
    import torch

    out = {}
    for k, v in weights.items():
        if ".switch_mlp.gate_proj.weight" in k:
            up = weights[k.replace("gate_proj", "up_proj")]
            out[k.replace("switch_mlp.gate_proj", "input_linear")] = torch.cat([v, up], dim=1)
        elif ".switch_mlp.down_proj.weight" in k:
            out[k.replace("switch_mlp.down_proj", "output_linear")] = v
        elif ".switch_mlp.up_proj." not in k:
            out[k] = v
    return out


MLX = MlxLm(
    module="granitemoe",
    config=dict(
        model_type="model_type", hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", rms_norm_eps="rms_norm_eps", vocab_size="vocab_size",
        logits_scaling="logits_scaling", attention_multiplier="attention_multiplier",
        embedding_multiplier="embedding_multiplier", residual_multiplier="residual_multiplier",
        max_position_embeddings="max_position_embeddings", attention_bias="attention_bias",
        num_local_experts="num_local_experts", num_experts_per_tok="num_experts_per_tok",
        tie_word_embeddings="tie_word_embeddings",  # mlx-lm's default is tied
        rope_theta=rope_theta, rope_scaling=const(None),
    ),
    require=COMMON_REQUIRE + (
        (lambda c: getattr(c, "head_dim", None) in (None, c.hidden_size // c.num_attention_heads),
         "head_dim != hidden_size / num_attention_heads (mlx-lm's granitemoe derives it)"),
    ),
    moe="block_sparse_moe", experts="fused", fused_names=("input_linear.weight", "output_linear.weight"),
)

FAMILY = Family(
    name="granitemoe", model_types=("granitemoe",), hf_module="granitemoe", hf_class_name="GraniteMoeForCausalLM",
    hf_config_name="GraniteMoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_moe="block_sparse_moe", hf_router="block_sparse_moe.router", from_mlx=from_mlx, mlx=MLX,
    # the logits are divided by logits_scaling
    experts="num_local_experts", rules=(("positive", "intermediate_size", "logits_scaling"),),
)
