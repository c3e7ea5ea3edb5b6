"""Hy3 (hy_v3): GQA with a per-head q/k RMSNorm before the rotation (Apertus' attention, optional biases),
dense layers by mlp_layer_types (the first one by default), then experts chosen on sigmoid scores plus a
correction bias (fp32), their sigmoid scores renormalised (+1e-20) and times router_scaling_factor as weights
(kept in fp32), plus always-on shared experts; the shared and routed outputs summed in fp32 where
enable_moe_fp32_combine (one rounding of the sum either way: the same as the production model's sum in the
model's dtype). HF keeps the correction bias on the MoE block and passes it to its router
(Family.hf_router_bias); the release names it mlp.expert_bias, the router mlp.router.gate, the shared experts
mlp.shared_mlp, with per-expert experts.{e}.gate/up/down_proj."""

from models.args import DENSE, SPARSE, AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import drop_layers_from, hf_args, require, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    num_shared_experts=1, router_scaling_factor=2.826, mlp_layer_types=[DENSE, SPARSE, SPARSE],
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 11158840.0},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"hy_v3: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(set(c.mlp_layer_types) <= {SPARSE, DENSE}, f"hy_v3: mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    return hf_args(
        c, "hy_v3", attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        mlp_bias=c.mlp_bias, mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.num_shared_experts or 0), shared_expert_gated=False,
        router=RouterArgs(scoring="sigmoid", correction_bias=True, norm_topk_prob=True, fp32=True,
                          routed_scaling_factor=float(c.router_scaling_factor), weights_in_model_dtype=False,
                          fp32_params=("e_score_correction_bias",)),  # HF: _keep_in_fp32_modules_strict
    )


RELEASE = ((".mlp.router.gate.", ".mlp.gate."), (".mlp.expert_bias", ".mlp.gate.e_score_correction_bias"),
           (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
           (".mlp.shared_mlp.", ".mlp.shared_experts."))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's names (RELEASE; HF's in-memory mlp.e_score_correction_bias too), without the
    multi-token-prediction layer the release keeps at model.layers.{num_hidden_layers}."""
    w = {}
    for k, t in drop_layers_from(weights, args.num_hidden_layers).items():
        for old, new in RELEASE:
            k = k.replace(old, new)
        w[k] = t
    return sanitize_hf(w, args)


FAMILY = Family(
    name="hy_v3", model_types=("hy_v3",), hf_module="hy_v3", hf_class_name="HYV3ForCausalLM",
    hf_config_name="HYV3Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_router_bias="mlp.e_score_correction_bias",
    rules=(("positive", "moe_intermediate_size", "intermediate_size", "router_scaling_factor"),),
)
