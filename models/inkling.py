"""Inkling (thinkingmachines' Inkling, transformers 5.23 `inkling`: InklingForCausalLM on its text config,
model_type inkling_text; the multimodal release's vision and audio towers are not checked). No rotary position: the
attention's position signal is a relative bias conditioned on the hidden states (models/layers/relative_logits.py:
r_proj's relative states mix a trained bank of bias-vs-distance profiles, zero beyond rel_extent, the SLIDING layers'
extent their window), k and v each through a residual short convolution (x + causal depthwise conv(x), fp32, the
state carried into decode: models/layers/residual_conv.py), per-head q/k RMSNorms and a softmax scale of 1/head_dim,
the FULL layers' optional logarithmic scaling of the queries and the bias (log_scaling_n_floor); the sliding layers
("hybrid_sliding") have their own heads, kv heads and head width (swa_*). Each block's output passes a residual
short convolution of its own before its residual add (attn_sconv, mlp_sconv). The MoE (models/layers/sink_moe.py):
sigmoid + correction-bias choice on fp32 logits; the chosen experts' sigmoids normalised together with the shared
experts' (the router's last n_shared rows: the shared experts a sink inside the normalisation), times route_scale and a
learned global_scale; dense layers (mlp_layer_types) a SwiGLU times a learned global_scale. The embeddings RMS-normed
(embed_tokens.embed_norm), the final norm's output divided by logits_mup_width_multiplier before the untied head.
mlx-lm 0.32.2 and llama.cpp's converter have no Inkling."""

from models.args import FULL, SLIDING, AttentionArgs, InklingArgs, ModelArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import points_without, hf_args, require, sanitize_hf

HF_TYPES = {"hybrid": FULL, "hybrid_sliding": SLIDING}

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    # full layers 4 heads of 16 over 2 kv heads; sliding layers 6 heads of 8 over 3 kv heads (the swa_* differ)
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    swa_num_attention_heads=6, swa_num_key_value_heads=3, swa_head_dim=8,
    # window 4 and rel_extent 6 below the default prompt (8): both the window and the bias's reach bite; the
    # logarithmic scaling from position 3 (alpha 0.5: the queries of the last prompt tokens scaled by ~1.5)
    sliding_window_size=4, d_rel=4, rel_extent=6, log_scaling_n_floor=3, log_scaling_alpha=0.5, conv_kernel_size=3,
    layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse", "sparse"],
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, route_scale=2.5, logits_mup_width_multiplier=4.0,
    max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

# the learned scalars whose identity is 1 (mean 1, std 0.1: TINY_STD's N(0, 0.1) would all but switch the MLPs and the
# weights off); the distance profiles at std 0.5, a bias of the scores' own size (q.k / head_dim is within +-1)
TINY_STD = {"global_scale": (1.0, 0.1), "rel_logits_proj.proj": 0.5}


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= set(HF_TYPES), f"inkling: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.shared_expert_sink, "inkling: shared_expert_sink False (the shared experts outside the router's "
                                  "normalisation) is not supported yet")
    require(c.unpadded_vocab_size is None or c.unpadded_vocab_size >= c.vocab_size,
            "inkling: unpadded_vocab_size below vocab_size (the logits cut to the unpadded rows) is not supported yet")
    types = tuple(HF_TYPES[t] for t in c.layer_types)
    sliding = [t == SLIDING for t in types]
    n = c.num_hidden_layers
    return hf_args(
        c, "inkling", layer_types=types, tie_word_embeddings=False,  # (HF's model never ties its head)
        rope=RopeArgs(10000.0, per_layer=(0,) * n),  # no rotary position anywhere
        attention=AttentionArgs(kind="relative", qk_norm="head", sliding_window=c.sliding_window_size),
        layer_heads=tuple(c.swa_num_attention_heads if s else c.num_attention_heads for s in sliding),
        layer_kv_heads=tuple(c.swa_num_key_value_heads if s else c.num_key_value_heads for s in sliding),
        layer_head_dim=tuple(c.swa_head_dim if s else c.head_dim for s in sliding),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size,
        num_experts=c.n_routed_experts, moe_intermediate_size=c.moe_intermediate_size,
        # the choice: sigmoid of the fp32 logits + the correction bias (the weights: models/layers/sink_moe.py)
        router=RouterArgs(scoring="sigmoid", correction_bias=True, fp32=True, routed_scaling_factor=float(c.route_scale),
                          fp32_params=("e_score_correction_bias", "global_scale")),
        inkling=InklingArgs(d_rel=c.d_rel, rel_extent=c.rel_extent, conv_kernel=c.conv_kernel_size,
                            log_floor=c.log_scaling_n_floor or 0, log_alpha=float(c.log_scaling_alpha),
                            n_shared=c.n_shared_experts, route_scale=float(c.route_scale),
                            head_divisor=float(c.logits_mup_width_multiplier)),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """HF's names are the production model's (the MTP layers, model.mtp.*, dropped as HF drops them)."""
    return sanitize_hf({k: t for k, t in weights.items() if not k.startswith("model.mtp.")}, args)


def router_output(out, args: ModelArgs):
    """HF's InklingTopkRouter returns (routed logits, top-k weights, indices, the shared experts' weights)."""
    return out[0], out[1], out[2]


def router_input(out, weights, idx, args: ModelArgs):
    """router_output's inverse: the selection forced, the shared experts' weights HF computed kept (the shared
    logits are not in the router's output to renormalise them with: a forced selection is weighed by router_reweigh,
    this form only where the weights are given)."""
    return out[0], weights, idx, out[3]


def router_reweigh(router, x, idx, args: ModelArgs):
    """HF's InklingTopkRouter.forward with the experts `idx` [N, k] given: the chosen routed logits and the shared
    ones normalised together (logsigmoid, then a softmax over them), so the shared experts' weights follow the
    choice (router_input keeps HF's own: its output has no shared logits to renormalise with)."""
    import torch
    import torch.nn.functional as F

    E, k = router.num_experts, idx.shape[-1]
    logits = F.linear(x.reshape(-1, router.hidden_dim).float(), router.weight.float())
    chosen = torch.cat([logits[..., :E].gather(-1, idx.long()), logits[..., E:]], dim=-1)
    lp = F.logsigmoid(chosen)
    w = (torch.exp(lp - torch.logsumexp(lp, dim=-1, keepdim=True)) * router.route_scale
         * router.global_scale.float()).to(x.dtype)
    return logits[..., :E], w[..., :k].contiguous(), idx, w[..., k:].contiguous()


def point_view(points, args: ModelArgs, layer=None):
    """HF's points less those laid out otherwise: its short convolutions' `bx` / `conv` taps (the production residual
    conv computes them inline), the relative logits over the keys seen (the production's over the cache's length) and
    the router's logits over the routed experts (the production's with the shared experts' rows after them)."""
    return points_without(points, lambda n: n in ("bx", "conv", "logits") or n.endswith("rel_logits_proj"))


FAMILY = Family(
    name="inkling", model_types=("inkling_text",), hf_module="inkling", hf_class_name="InklingForCausalLM",
    hf_config_name="InklingTextConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, tiny_std=TINY_STD,
    hf_point_view=point_view,
    router_output=router_output, router_input=router_input, router_reweigh=router_reweigh, experts="n_routed_experts",
)
