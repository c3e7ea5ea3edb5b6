"""A.X-K1 (axk1, SK Telecom): DeepSeek-V3 (multi-head latent attention, always through a q_lora_rank
bottleneck, rotary pairs interleaved; experts chosen on sigmoid scores + a correction bias among the
topk_group best groups, renormalised, times routed_scaling_factor, plus always-on shared experts) with one
change: an RMSNorm on the MoE block's output (routed + shared), before the residual add
(ModelArgs.moe_output_norm; HF's mlp.post_mlp_layernorm). Its dense layers are the ones `mlp_layer_types`
names "dense" (HF derives the list from the legacy first_k_dense_replace / moe_layer_freq).

The release stores the norm at the decoder layer (`model.layers.{i}.post_mlp_layernorm.weight`, as
transformers' conversion mapping saves it), for the dense layers too, which never use it: sanitize() moves
the sparse layers' into their MoE block and drops the dense layers'."""

import re

from models.args import DENSE, ModelArgs
from models.family import Family
from models.glm4_moe_lite import mlp_types
from models.mapping import (deepseek_router, drop_layers_from, hf_args, mla, require, rope_of, sanitize_hf,
                            sigmoid_routing)
from models.mlx_lm import rope_parameters
from models.rules import GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    mlp_layer_types=["dense", "sparse", "sparse"],  # the release's first_k_dense_replace 1
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
    rope_interleave=True, max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

NORM = re.compile(r"^layers\.(\d+)\.(?:mlp\.)?post_mlp_layernorm\.")


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"axk1: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(bool(c.q_lora_rank), "axk1: q_lora_rank (A.X-K1's attention always projects q through it)")
    require(rope_parameters(c).get("partial_rotary_factor", 1.0) == 1.0,
            "axk1: partial_rotary_factor (the latent attention rotates all qk_rope_head_dim dims)")
    return hf_args(c, "axk1", rope=rope_of(c, interleave=bool(c.rope_interleave)), attention=mla(c),
                   mlp_types=mlp_types(c), intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                   shared_expert_gated=False, moe_output_norm=True, router=deepseek_router(c, **sigmoid_routing(c)))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    out = {}
    for k, t in sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args).items():
        m = NORM.match(k)
        if m is None:
            out[k] = t
        elif args.mlp_types[int(m.group(1))] != DENSE:  # (a dense layer's is never used)
            out[f"layers.{m.group(1)}.mlp.post_mlp_layernorm.{k[m.end():]}"] = t
    return out


FAMILY = Family(
    name="axk1", model_types=("axk1",), hf_module="axk1", hf_class_name="AXK1ForCausalLM",
    hf_config_name="AXK1Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize, experts="n_routed_experts",
    rules=(*GROUPED, ("positive", "moe_intermediate_size", "intermediate_size"), ("per_layer", "mlp_layer_types"),
           ("positive", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank")),
)
