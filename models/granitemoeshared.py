"""GraniteMoeShared (IBM Granite 3.x MoE with a shared expert): GraniteMoE's layer (models/granitemoe.py:
the four multipliers, top-k logits then softmax over those k) plus an always-on, ungated shared MLP
beside the MoE block (ModelArgs.shared_expert_beside): HF's decoder layer adds shared_mlp(x) to
block_sparse_moe(x), both on the post-attention norm's output, before the residual multiplier. The
release fuses the shared MLP's gate and up as `shared_mlp.input_linear` [2I, H] (gate rows, then up)."""

import re

from models.args import ModelArgs
from models.family import Family
from models.granitemoe import sanitize as granitemoe_sanitize
from models.granitemoe import to_args as granitemoe_args

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=32, shared_intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # granitemoe's tiny multipliers (the release's, the attention one scaled to head_dim 16)
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.2, logits_scaling=6.0,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    a = granitemoe_args(c)
    return ModelArgs(**{**a.__dict__, "family": "granitemoeshared", "shared_expert_beside": True,
                        "shared_expert_intermediate_size": c.shared_intermediate_size, "shared_expert_gated": False})


SHARED = re.compile(r"(.*\.shared_mlp)\.input_linear\.weight$")


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """GraniteMoE's mapping, and the shared MLP's fused input_linear split into gate_proj / up_proj
    (output_linear -> down_proj)."""
    out = {}
    for k, t in weights.items():
        if m := SHARED.match(k):
            gate, up = t.chunk(2, dim=0)
            out[f"{m.group(1)}.gate_proj.weight"], out[f"{m.group(1)}.up_proj.weight"] = gate, up
        else:
            out[k.replace(".shared_mlp.output_linear.", ".shared_mlp.down_proj.")] = t
    return granitemoe_sanitize(out, args)


FAMILY = Family(
    name="granitemoeshared", model_types=("granitemoeshared",), hf_module="granitemoeshared",
    hf_class_name="GraniteMoeSharedForCausalLM", hf_config_name="GraniteMoeSharedConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, hf_moe="block_sparse_moe", hf_router="block_sparse_moe.router",
    # mlx-lm 0.32.2 has no granitemoeshared model (its granitemoe has no shared MLP)
    experts="num_local_experts", rules=(("positive", "intermediate_size", "logits_scaling"),),
)
