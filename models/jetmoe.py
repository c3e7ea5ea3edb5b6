"""JetMoE: a mixture of attention heads (AttentionArgs kind "moa", models/layers/moa.py: each token's k
attention experts of E, each a routed query and output projection over shared kv heads, the outputs
weighted by a softmax over the top-k router logits, plus a bias) and a mixture of SwiGLU experts routed
the same way (top-k logits, softmax over the k: softmax, top-k, renormalised), with a bias on the MoE
block's output (ModelArgs.moe_bias). Llama's pre-norm layer; the heads are kv_channels wide, k x
num_key_value_heads query heads; the decoder layers' RMSNorms have HF's default eps 1e-6 (only the final
norm reads rms_norm_eps). HF keeps both mixtures' experts fused ([E, out, in]) under `input_linear` /
`output_linear` and each router's linear layer at `router.layer`."""

import re

from models.args import AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, sanitize_hf

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_key_value_heads=2, kv_channels=16,
    intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rms_norm_eps=1e-6,
    tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

LAYER_NORM_EPS = 1e-6  # HF's JetMoeRMSNorm(hidden_size): the decoder layers' norms read no config field


def to_args(c) -> ModelArgs:
    require(c.activation_function == "silu", f"jetmoe: activation_function {c.activation_function!r} (silu only)")
    require(c.rms_norm_eps == LAYER_NORM_EPS, f"jetmoe: rms_norm_eps {c.rms_norm_eps} (HF's decoder layers' norms "
                                              "use 1e-6 whatever it says; only the final norm reads it)")
    heads = c.num_key_value_heads * c.num_experts_per_tok
    # HF's rotary embedding is hidden_size / num_attention_heads wide, its heads kv_channels
    require(c.hidden_size // heads == c.kv_channels,
            f"jetmoe: hidden_size / (num_key_value_heads x num_experts_per_tok) = {c.hidden_size // heads} != "
            f"kv_channels {c.kv_channels} (HF rotates a head of the first width)")
    return hf_args(
        c, "jetmoe", num_attention_heads=heads, head_dim=c.kv_channels, attention=AttentionArgs("moa"),
        num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size,
        router=RouterArgs(norm_topk_prob=True), moe_bias=True,
    )


RENAMES = ((r"\.self_attention\.experts\.input_linear\.weight$", ".self_attn.q_experts"),
           (r"\.self_attention\.experts\.output_linear\.weight$", ".self_attn.o_experts"),
           (r"\.self_attention\.experts\.bias$", ".self_attn.o_bias"),
           (r"\.self_attention\.experts\.router\.layer\.", ".self_attn.router."),
           (r"\.self_attention\.kv_proj\.", ".self_attn.kv_proj."),
           (r"\.mlp\.input_linear\.weight$", ".mlp.experts.gate_up_proj"),  # [E, 2I, H] gate rows, then up
           (r"\.mlp\.output_linear\.weight$", ".mlp.experts.down_proj"),  # [E, H, I]
           (r"\.mlp\.router\.layer\.", ".mlp.gate."))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    out = {}
    for k, t in weights.items():
        for pattern, new in RENAMES:
            k = re.sub(pattern, new, k)
        out[k] = t
    return sanitize_hf(out, args)


def router_output(logits, args: ModelArgs):
    """HF's MoE router's linear layer's logits [N, E] -> (logits, weights, indices) as JetMoeTopKGating
    computes them: top-k of the fp32 logits, softmax over the k, in the model's dtype."""
    import torch

    top, idx = logits.float().topk(args.num_experts_per_tok, dim=1)
    return logits, torch.softmax(top, dim=1).type_as(logits), idx


def router_input(logits, weights, idx, args: ModelArgs):
    """router_output's inverse: logits whose routing gives `weights` (renormalised) at `idx`: log(weights)
    there, -inf elsewhere."""
    import torch

    w = weights.to(logits.dtype).reshape(-1, idx.shape[-1])
    return torch.full_like(logits, float("-inf")).scatter(1, idx.reshape(-1, idx.shape[-1]), torch.log(w))


# the trained profile's names for HF's JetMoE attention (Family.hf_profile_view): the attention experts' query and
# output projections and the output bias stand for q_proj, o_proj (its [E, H, hidden] with H first) and o_proj's
# bias; k is the first half of kv_proj's rows
PROFILE_NAMES = {"self_attention.experts.input_linear.weight": "self_attn.q_proj.weight",
                 "self_attention.experts.output_linear.weight": "self_attn.o_proj.weight",
                 "self_attention.experts.bias": "self_attn.o_proj.bias"}


def profile_view(sd: dict, cfg: dict) -> dict:
    out = {}
    for k, t in sd.items():
        rel = next((r for r in PROFILE_NAMES if k.endswith("." + r)), None)
        if rel is not None:
            out[k[: -len(rel)] + PROFILE_NAMES[rel]] = t.transpose(0, 1) if rel.endswith("output_linear.weight") else t
        elif k.endswith(".self_attention.kv_proj.weight"):
            base = k[: -len("self_attention.kv_proj.weight")]
            out[base + "self_attn.k_proj.weight"], out[base + "self_attn.v_proj.weight"] = t.chunk(2, dim=0)
        else:
            out[k] = t
    return out


FAMILY = Family(
    name="jetmoe", model_types=("jetmoe",), hf_module="jetmoe", hf_class_name="JetMoeForCausalLM",
    hf_config_name="JetMoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_attention=("self_attention",), hf_router="mlp.router.layer", router_output=router_output,
    router_input=router_input, hf_profile_view=profile_view,
    # (neither mlx-lm 0.32.2 nor llama.cpp's converter has JetMoE)
    experts="num_local_experts",
    rules=(("positive", "kv_channels", "intermediate_size"),),
)
