"""Laguna (Poolside): GQA with per-head q/k RMSNorm before the rotation, a softplus gate on the attention
output from its own projection of the layer's input (g_proj: one value per head, or per channel with gating
"per-element"; AttentionArgs.gate_act / gate_width), a q head count per layer (num_attention_heads_per_layer:
ModelArgs.layer_heads; the kv heads are the same in every layer), sliding-window layers (layer_types) and a
rope per layer type (rope_parameters keyed by layer type, each its own theta, rotary fraction and scaling:
RopeArgs.sliding); experts chosen on sigmoid scores of the tanh-softcapped fp32 logits plus a correction
bias (RouterArgs.logit_softcap), the chosen scores renormalised, the routed sum times
moe_routed_scaling_factor, plus an always-on shared expert; dense layers by mlp_layer_types (the release's
first). The release keeps the correction bias under `mlp.experts.` and names the shared expert
`mlp.shared_expert`."""

from models.args import DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, RouterArgs
from models.family import Family
from models.checkpoint import unstack_experts
from models.mapping import hf_args, require, rope_per_type, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    # a layer with its own q heads (8 over the 2 kv heads where the others have 4)
    num_attention_heads_per_layer=[4, 4, 8], num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
    # every kind: a dense full layer, then sparse sliding and full ones; the window shorter than the prompts
    layer_types=[FULL, SLIDING, FULL], mlp_layer_types=[DENSE, SPARSE, SPARSE], sliding_window=4,
    # the release's two ropes (HF's defaults): the full layers' theta 5e5 on half of each head, the sliding
    # layers' 1e4 on all of it
    rope_parameters={FULL: {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0}},
    gating=True, moe_routed_scaling_factor=2.0,
    # a cap the tiny logits (std ~0.8) reach, so that the softcap changes the choice and the weights
    moe_router_logit_softcapping=1.5,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def gate_width(c) -> str:
    require(c.gating in (True, False, "per-head", "per-element"), f"laguna: gating {c.gating!r} is not one of "
            "True, False, 'per-head', 'per-element'")
    return "head" if c.gating is True or c.gating == "per-head" else "element"


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"laguna: unknown layer_types {sorted(set(c.layer_types))}")
    require(set(c.mlp_layer_types) <= {DENSE, SPARSE}, f"laguna: unknown mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    heads = tuple(c.num_attention_heads_per_layer)
    require(all(isinstance(h, int) and h > 0 and h % c.num_key_value_heads == 0 for h in heads),
            f"num_attention_heads_per_layer {list(heads)}: each must be a positive multiple of num_key_value_heads "
            f"({c.num_key_value_heads})")
    return hf_args(
        c, "laguna", rope=rope_per_type(c), layer_types=tuple(c.layer_types),
        layer_heads=heads if any(h != c.num_attention_heads for h in heads) else (),
        attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                                sliding_window=c.sliding_window, gate_act="softplus" if c.gating else "none",
                                gate_width=gate_width(c) if c.gating else "head"),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size, num_experts=c.num_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, shared_expert_gated=False,
        router=RouterArgs(scoring="sigmoid", correction_bias=True, norm_topk_prob=True,
                          routed_scaling_factor=float(c.moe_routed_scaling_factor),
                          logit_softcap=float(c.moe_router_logit_softcapping or 0.0), weights_in_model_dtype=True),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # the release's mlp.experts.e_score_correction_bias and mlp.shared_expert (HF's conversion mapping)
    w = {k.replace(".mlp.experts.e_score_correction_bias", ".mlp.gate.e_score_correction_bias")
          .replace(".mlp.shared_expert.", ".mlp.shared_experts."): t for k, t in weights.items()}
    return sanitize_hf(w, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names back to the release's (the inverse of its sanitize): the router's gate.proj as the bare
    mlp.gate, the correction bias under mlp.experts, the stacked experts per expert."""
    w = {k.replace(".mlp.gate.proj.", ".mlp.gate.")
          .replace(".mlp.gate.e_score_correction_bias", ".mlp.experts.e_score_correction_bias"): t
         for k, t in weights.items()}
    return unstack_experts(w)


def router_output(out, args):
    """HF's LagunaTopKRouter returns (capped logits, renormalised weights, indices); its MoE block scales the
    routed sum by moe_routed_scaling_factor, the production router scales the weights (the same products)."""
    logits, weights, idx = out
    return logits, weights * args.router.routed_scaling_factor, idx


def router_input(out, weights, idx, args):
    """router_output's inverse: HF's triple with the given top-k, its weights unscaled."""
    return out[0], (weights / args.router.routed_scaling_factor).to(out[1].dtype), idx


def _ropes(c) -> list:
    rp = c.rope_parameters or {}
    return [rp.get(t) or {} for t in set(c.layer_types)]


MLX = MlxLm(
    module="laguna",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        intermediate_size="intermediate_size", num_hidden_layers="num_hidden_layers",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads", head_dim="head_dim",
        max_position_embeddings="max_position_embeddings", rms_norm_eps="rms_norm_eps",
        attention_bias="attention_bias", qkv_bias="attention_bias",  # HF's attention_bias is on q/k/v and o
        gating=lambda c: bool(c.gating), tie_word_embeddings="tie_word_embeddings", sliding_window="sliding_window",
        partial_rotary_factor=const(None),  # each type's own (rope_parameters), HF's default 1.0 where none
        rope_parameters=lambda c: {t: dict(p) for t, p in (c.rope_parameters or {}).items() if isinstance(p, dict)},
        layer_types=lambda c: list(c.layer_types),
        num_attention_heads_per_layer=lambda c: list(c.num_attention_heads_per_layer),
        mlp_layer_types=lambda c: list(c.mlp_layer_types), num_experts="num_experts",
        num_experts_per_tok="num_experts_per_tok", moe_intermediate_size="moe_intermediate_size",
        shared_expert_intermediate_size="shared_expert_intermediate_size",
        moe_routed_scaling_factor="moe_routed_scaling_factor",
        moe_router_logit_softcapping="moe_router_logit_softcapping", moe_router_score_func=const("sigmoid"),
    ),
    require=COMMON_REQUIRE + (
        (lambda c: c.gating in (True, False, "per-head"), "per-element gating (mlx-lm's laguna gates per head)"),
        (lambda c: FULL in c.layer_types, "no full_attention layer (mlx-lm's laguna builds its mask from the first)"),
        (lambda c: all(p.get("rope_type", "default") == "default" for p in _ropes(c)),
         "rope scaling (mlx-lm's laguna is checked here with default RoPE only)"),
    ),
)

def point_view(points, args: ModelArgs, layer=None):
    """The drill's points of HF's MoE block in the production layout: HF's experts module sums the experts by the
    unscaled weights and the block scales the sum after it; the production experts sum by the scaled weights, so
    HF's `experts` point times moe_routed_scaling_factor is the production one (router_output's scaling, here)."""
    import copy

    out = copy.copy(points)  # (a Points keeps its registered paths and taps)
    f = args.router.routed_scaling_factor
    for n in [n for n in points if n == "experts" or n.endswith(".experts")]:
        out[n] = [a * f for a in points[n]]
    return out


FAMILY = Family(
    name="laguna", model_types=("laguna",), hf_module="laguna", hf_class_name="LagunaForCausalLM",
    hf_config_name="LagunaConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX, from_mlx=from_mlx,
    router_output=router_output, router_input=router_input, hf_point_view=point_view,
    tiny_std={"self_attn.g_proj.weight": 0.3},  # gates that differ from softplus(0) = 0.69 by token
    rules=(("positive", "moe_intermediate_size", "intermediate_size", "shared_expert_intermediate_size",
            "sliding_window"), ("per_layer", "mlp_layer_types", "num_attention_heads_per_layer")),
)
