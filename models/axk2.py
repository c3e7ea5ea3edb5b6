"""A.X-K2 (axk2, SK Telecom): DeepSeek-V3.2's layer stack with DeepSeek sparse attention (models/layers/dsa.py: the
lightning indexer, half-split rotation, reading the normalised q latent) and three changes:
- the query and an output gate come out of one fused projection of the q latent (models/layers/mla_gated.py:
  q_gate_proj reads cat(q_a_layernorm(q_a_proj(x)), q_a_proj(x)); per head, the query then the gate; the heads'
  context times sigmoid(gate) element-wise before o_proj; no q_b_proj);
- a low-rank gated RMSNorm (models/layers/gated_norm.py: y = RMSNorm(x), y * sigmoid(fc2(silu(fc1(y))))) as every
  layer's input norm and as the sparse layers' post-attention norm (the dense layers' is a plain RMSNorm);
- DeepSeek-V3's router (sigmoid + correction bias, renormalised, routed_scaling_factor) whose group limit, where
  n_group is set (the larger releases; A.X-K2-Light routes over every expert), scores the left-out groups 0 for the
  choice, not -inf (RouterArgs.group_mask_zero).
Dense layers: those mlp_layer_types names "dense".

The tiny config: index_topk 4 below the default prompt's 8 tokens (the sparsity bites from the fifth query on),
16 index heads of 128 (DeepSeek-V3.2's tiny: a key's score rarely relu'd to 0 by every head), 4 expert groups of
which 2 are kept."""

from dataclasses import replace

from models.args import ModelArgs
from models.deepseek_v32 import DSA_RULES, dsa_args
from models.deepseek_v32 import sanitize as sanitize_v32
from models.family import Family
from models.glm4_moe_lite import mlp_types
from models.mapping import require
from models.mlx_lm import rope_parameters

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    mlp_layer_types=["dense", "sparse", "sparse"],
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    max_position_embeddings=256, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    index_topk=4, index_head_dim=128, index_n_heads=16, gated_norm_rank=16,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(rope_parameters(c).get("partial_rotary_factor", 1.0) == 1.0,
            "axk2: partial_rotary_factor (the latent attention rotates all qk_rope_head_dim dims)")
    require(c.gated_norm_rank > 0, f"axk2: gated_norm_rank {c.gated_norm_rank} (the norms' gate has that rank)")
    a = dsa_args(c, "axk2")
    return replace(a, mlp_types=mlp_types(c), attention=replace(a.attention, output_gate=True),
                   norm=replace(a.norm, gate_rank=c.gated_norm_rank), router=replace(a.router, group_mask_zero=True))


# the release's names (transformers' conversion mapping renames them on load): the gated norms' gate W_down / W_up
# (HF's mlp.fc1 / mlp.fc2), the fused q/gate projection q_b_proj (HF's q_gate_proj)
RELEASE_NAMES = {"W_down": "mlp.fc1", "W_up": "mlp.fc2"}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    out = {}
    for k, t in sanitize_v32(weights, args).items():
        k = ".".join(RELEASE_NAMES.get(part, part) for part in k.split("."))
        out[k.replace("self_attn.q_b_proj.", "self_attn.q_gate_proj.")] = t
    return out


FAMILY = Family(
    name="axk2", model_types=("axk2",), hf_module="axk2", hf_class_name="AXK2ForCausalLM", hf_config_name="AXK2Config",
    tiny_config=TINY, to_args=to_args, sanitize=sanitize, experts="n_routed_experts",
    rules=(*DSA_RULES, ("positive", "gated_norm_rank")),
)
