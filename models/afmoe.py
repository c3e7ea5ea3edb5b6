"""AFMoE (afmoe, Arcee's Trinity): sandwich norms (NormArgs.placement "sandwich": input_layernorm and
pre_mlp_layernorm before the blocks, post_attention_layernorm and post_mlp_layernorm on their outputs
before the residual adds), gpt-oss's RMSNorm ((w * x).to(dtype)); the embeddings times sqrt(hidden_size)
with mup_enabled; sliding-window layers with rope between full-attention layers without (NoPE), a
per-head q/k RMSNorm before the rotation, the output gated by sigmoid(gate_proj(x)) per element (the
production model's output gate: gate_proj's rows joined to q_proj's per head, Qwen3.5's layout); experts
chosen on sigmoid scores plus a correction bias (expert_bias, on the MoE block), the chosen scores
renormalised (fp32) times route_scale, plus always-on shared experts; the first num_dense_layers dense."""

from models.args import DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, Multipliers, NormArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, DEFAULT_ROPE, MlxLm, const, head_dim

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_dense_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
    num_experts_per_tok=2, num_shared_experts=1, route_scale=2.5, max_position_embeddings=256,
    # every layer kind: dense and sparse sliding (rope) layers, a sparse full (NoPE) layer; the window
    # shorter than the prompts
    global_attn_every_n_layers=4, sliding_window=4, mup_enabled=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # the release's own routing fields (HF always renormalises with the sigmoid; llama.cpp's converter
    # and mlx-lm read them)
    route_norm=True, score_func="sigmoid", n_group=1, topk_group=1,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"afmoe: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.hidden_act == "silu", f"afmoe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    n, dense = c.num_hidden_layers, c.num_dense_layers or 0
    return hf_args(
        c, "afmoe", layer_types=tuple(c.layer_types),
        rope=RopeArgs(rope_theta(c), per_layer=tuple(int(t == SLIDING) for t in c.layer_types)),  # NoPE full layers
        norm=NormArgs(gain_fp32=True, placement="sandwich"),  # AfmoeRMSNorm is GptOssRMSNorm
        multipliers=Multipliers(embedding=c.hidden_size**0.5 if c.mup_enabled else 1.0),
        attention=AttentionArgs(qk_norm="head", output_gate=True, sliding_window=c.sliding_window,
                                qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        mlp_types=tuple(DENSE if i < dense else SPARSE for i in range(n)), intermediate_size=c.intermediate_size,
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.num_shared_experts or 0),
        shared_expert_gated=False,
        # HF: logits in the model's dtype then fp32, sigmoid, the choice on scores + expert_bias, the chosen
        # scores / (sum + 1e-20) * route_scale, fp32 into the experts' sum
        router=RouterArgs(scoring="sigmoid", correction_bias=True, norm_topk_prob=True,
                          routed_scaling_factor=float(c.route_scale), weights_in_model_dtype=False),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The MoE block's router.gate and expert_bias -> mlp.gate's weight and correction bias; the sandwich
    norms pre_mlp / post_mlp -> pre_feedforward / post_feedforward; gate_proj [nh*hd, H] joined to q_proj
    head by head ([nh, 2 hd, H]: the head's q rows, then its gate rows)."""
    import torch

    out, gates = {}, {}
    for k, t in weights.items():
        k = k.replace(".mlp.router.gate.", ".mlp.gate.").replace(".mlp.expert_bias", ".mlp.gate.e_score_correction_bias")
        k = k.replace(".pre_mlp_layernorm.", ".pre_feedforward_layernorm.")
        k = k.replace(".post_mlp_layernorm.", ".post_feedforward_layernorm.")
        if k.endswith(".self_attn.gate_proj.weight"):
            gates[k[: -len("gate_proj.weight")]] = t
            continue
        out[k] = t
    nh, hd = args.num_attention_heads, args.head_dim
    for p, g in gates.items():
        q = out[p + "q_proj.weight"]
        out[p + "q_proj.weight"] = torch.cat([q.view(nh, hd, -1), g.view(nh, hd, -1)], dim=1).reshape(2 * nh * hd, -1)
    return sanitize_hf(out, args)


MLX = MlxLm(
    module="afmoe",
    config=dict(
        model_type="model_type", layer_types=lambda c: list(c.layer_types), vocab_size="vocab_size",
        hidden_size="hidden_size", intermediate_size="intermediate_size",
        moe_intermediate_size="moe_intermediate_size", num_hidden_layers="num_hidden_layers",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads", head_dim=head_dim,
        max_position_embeddings="max_position_embeddings", rms_norm_eps="rms_norm_eps", rope_theta=rope_theta,
        rope_scaling=const(None), tie_word_embeddings="tie_word_embeddings", num_experts="num_experts",
        num_experts_per_tok="num_experts_per_tok", num_shared_experts="num_shared_experts",
        num_dense_layers=lambda c: c.num_dense_layers or 0,
        route_norm=const(True),  # HF always renormalises (mlx-lm: only for top-k > 1, required below)
        route_scale="route_scale", score_func=const("sigmoid"), n_group=const(1), topk_group=const(1),
        sliding_window="sliding_window", mup_enabled=lambda c: bool(c.mup_enabled),
    ),
    require=COMMON_REQUIRE + DEFAULT_ROPE + (
        (lambda c: c.num_experts_per_tok > 1, "num_experts_per_tok 1 (mlx-lm's afmoe then skips the renormalisation "
                                              "HF always does)"),
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's afmoe has no attention biases)"),
        (lambda c: FULL in c.layer_types, "layer_types without a full_attention layer (mlx-lm's afmoe looks one up)"),
    ),
    moe="mlp",
)

def point_view(points, args: ModelArgs, layer=None):
    """The drill's points of HF's (and mlx-lm's) attention, whose q_proj and gate_proj are apart, in the production
    layout: gate_proj's output joined to q_proj's head by head ([.., nh, hd] each -> [.., nh * 2 hd], the production
    q_proj's rows: each head's q, then its gate)."""
    import copy

    import numpy as np

    out = copy.copy(points)  # (a Points keeps its registered paths and taps)
    nh, hd = args.num_attention_heads, args.head_dim
    for q in [n for n in points if n == "q_proj" or n.endswith(".q_proj")]:  # (the attention block's, a layer's)
        g = q[: -len("q_proj")] + "gate_proj"
        if g in points and len(points[g]) == len(points[q]):
            out[q] = [np.concatenate([a.reshape(*a.shape[:-1], nh, hd), b.reshape(*b.shape[:-1], nh, hd)], axis=-1)
                      .reshape(*a.shape[:-1], 2 * nh * hd) for a, b in zip(points[q], points[g])]
    return out


FAMILY = Family(
    name="afmoe", model_types=("afmoe",), hf_module="afmoe", hf_class_name="AfmoeForCausalLM",
    hf_config_name="AfmoeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, mlx=MLX,
    hf_router="mlp.router", hf_router_bias="mlp.expert_bias",
    hf_point_names={"pre_mlp_layernorm": "pre_feedforward_layernorm", "post_mlp_layernorm": "post_feedforward_layernorm"},
    hf_point_view=point_view,
    rules=(("positive", "intermediate_size", "moe_intermediate_size", "sliding_window", "global_attn_every_n_layers"),
           ("within_depth", "num_dense_layers")),
)
