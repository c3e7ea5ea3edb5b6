"""Llama 4 (text): rope layers with chunked attention (within attention_chunk_size chunks) and a
weightless RMS q/k norm after the rotation, every no_rope_layers-0 layer without rope, with full
attention and q scaled by the position (attn_temperature_tuning); rotary pairs interleaved, Llama 3
rope scaling; MoE layers (moe_layers) route each token to its top expert by sigmoid(logit) which
scales the expert's *input*, plus an always-on shared expert; the other layers dense."""

import math

from models.args import CHUNKED, DENSE, FULL, SPARSE, AttentionArgs, Llama3Scaling, ModelArgs, RopeArgs, RouterArgs
from models.checkpoint import CheckpointError
from models.family import Family
from models.mapping import hf_args, require, sanitize_hf, strip_prefix
from models.mlx_lm import MlxLm, rope_parameters

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    num_local_experts=8, num_experts_per_tok=1, intermediate_size=24, intermediate_size_mlp=96,
    interleave_moe_layer_step=2,  # MoE on layers 1 and 3; layer 3 is the no-rope one (no_rope_layer_interval 4)
    attention_chunk_size=8,  # the prompts span two chunks
    use_qk_norm=True, attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,  # floor_scale 4: tuning is seen
    rms_norm_eps=1e-6,  # mlx-lm's q/k norm hard-codes 1e-6 (the release's 1e-5 is refused there)
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    max_position_embeddings=256, attention_bias=False,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def llama3_rope(c) -> Llama3Scaling | None:
    rp = rope_parameters(c)
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "llama3":
        raise CheckpointError(f"llama4: rope_type {kind!r} is not supported (only 'default' and 'llama3')")
    return Llama3Scaling(float(rp["factor"]), float(rp["low_freq_factor"]), float(rp["high_freq_factor"]),
                         int(rp["original_max_position_embeddings"]))


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, CHUNKED}, f"llama4: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.hidden_act == "silu", f"llama4: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    return hf_args(
        c, "llama4", rope=RopeArgs.scaled(
            float(rope_parameters(c)["rope_theta"]), llama3_rope(c),
            interleave=True, fp32=True,  # HF rotates in fp32 (complex products of x.float())
            per_layer=tuple(int(bool(r)) for r in c.no_rope_layers)),
        layer_types=tuple(c.layer_types),
        attention=AttentionArgs(chunk_size=c.attention_chunk_size or 0, qk_norm="l2" if c.use_qk_norm else "none",
                                temperature_tuning=bool(c.attn_temperature_tuning), floor_scale=float(c.floor_scale),
                                attn_scale=float(c.attn_scale), qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        mlp_types=tuple(SPARSE if i in c.moe_layers else DENSE for i in range(c.num_hidden_layers)),
        intermediate_size=c.intermediate_size_mlp, num_experts=c.num_local_experts,
        moe_intermediate_size=c.intermediate_size, shared_expert_intermediate_size=c.intermediate_size,
        shared_expert_gated=False, router=RouterArgs("sigmoid", norm_topk_prob=False, weights_on_input=True),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """feed_forward.{router, experts, shared_expert} -> mlp.{gate, experts, shared_experts}; the
    experts from x @ W ([E, H, 2I] gate columns then up; [E, I, H]) to the production layout; the
    multimodal release's language_model.* without its vision tower."""
    w = {}
    for k, t in weights.items():
        if k.startswith(("vision_model.", "multi_modal_projector.", "model.vision_model.",
                         "model.multi_modal_projector.")):
            continue
        k = k.replace("language_model.", "", 1) if k.startswith(("language_model.", "model.language_model.")) else k
        k = k.replace(".feed_forward.router.", ".mlp.gate.").replace(".feed_forward.shared_expert.",
                                                                      ".mlp.shared_experts.")
        k = k.replace(".feed_forward.", ".mlp.")
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t = t.transpose(1, 2).contiguous()
        w[k] = t
    return sanitize_hf(strip_prefix(w), args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's composite names (language_model.*) -> the text model's (model.*, lm_head), and its
    SwitchGLU experts [E, out, in] back to HF's x @ W layout: gate_up_proj [E, H, 2I] (gate columns,
    then up), down_proj [E, I, H]."""
    import torch

    out = {}
    for k, v in weights.items():
        k = k[len("language_model."):] if k.startswith("language_model.") else k
        if k.endswith("experts.gate_proj.weight"):
            p = k[: -len("gate_proj.weight")]
            up = weights["language_model." + p + "up_proj.weight"]
            out[p + "gate_up_proj"] = torch.cat([v, up], dim=1).transpose(1, 2)
        elif k.endswith("experts.down_proj.weight"):
            out[k[: -len(".weight")]] = v.transpose(1, 2)
        elif not k.endswith("experts.up_proj.weight"):
            out[k] = v
    return out


def router_output(out, args):
    """HF's Llama4Router returns (sigmoid scores [N, E], zero outside the top-k; logits [N, E])."""
    scores, logits = out
    idx = logits.topk(args.num_experts_per_tok, dim=-1).indices
    return logits, scores.gather(1, idx), idx


def router_input(out, weights, idx, args):
    """router_output's inverse: the scores [N, E] zero outside the given top-k, the weights there."""
    scores, logits = out
    return scores.new_zeros(scores.shape).scatter(1, idx, weights.to(scores.dtype)), logits


def _defaults(c) -> bool:
    """The layer pattern mlx-lm's llama4 hard-codes: rope + chunked unless (i + 1) % 4 == 0, MoE
    where i % step == step - 1."""
    n, step = c.num_hidden_layers, c.interleave_moe_layer_step
    return (list(c.no_rope_layers) == [int((i + 1) % 4 != 0) for i in range(n)]
            and list(c.layer_types) == [CHUNKED if (i + 1) % 4 != 0 else FULL for i in range(n)]
            and list(c.moe_layers) == [i for i in range(n) if i % step == step - 1])


MLX = MlxLm(
    module="llama4",
    args_class=("llama4", "TextArgs"),  # the text_config of llama4's ModelArgs; keys under language_model.
    config=dict(
        model_type="model_type", attention_bias="attention_bias", attention_chunk_size="attention_chunk_size",
        head_dim="head_dim", hidden_size="hidden_size", interleave_moe_layer_step="interleave_moe_layer_step",
        intermediate_size="intermediate_size", intermediate_size_mlp="intermediate_size_mlp",
        max_position_embeddings="max_position_embeddings", num_attention_heads="num_attention_heads",
        num_experts_per_tok="num_experts_per_tok", num_hidden_layers="num_hidden_layers",
        num_key_value_heads="num_key_value_heads", num_local_experts="num_local_experts", rms_norm_eps="rms_norm_eps",
        rope_theta=lambda c: float(rope_parameters(c)["rope_theta"]),
        rope_scaling=lambda c: None if not llama3_rope(c) else {**rope_parameters(c), "rope_type": "llama3"},
        use_qk_norm="use_qk_norm", vocab_size="vocab_size",
        attn_temperature_tuning=lambda c: bool(c.attn_temperature_tuning), floor_scale="floor_scale",
        attn_scale="attn_scale",
    ),
    require=(
        (lambda c: c.hidden_act == "silu", "hidden_act other than silu (mlx-lm's experts are SwiGLU)"),
        (lambda c: c.num_experts_per_tok == 1, "num_experts_per_tok != 1 (mlx-lm's llama4 asserts top-1)"),
        (_defaults, "no_rope_layers / layer_types / moe_layers other than the default pattern (mlx-lm's llama4 "
                    "derives them from the layer index)"),
        (lambda c: not c.use_qk_norm or math.isclose(c.rms_norm_eps, 1e-6),
         "use_qk_norm with rms_norm_eps != 1e-6 (mlx-lm's q/k norm hard-codes eps 1e-6)"),
        (lambda c: not c.tie_word_embeddings, "tie_word_embeddings (mlx-lm's llama4 has its own lm_head)"),
    ),
    convert=lambda weights: {"language_model." + k: v for k, v in weights.items()},
)

FAMILY = Family(
    name="llama4", model_types=("llama4_text", "llama4"), hf_module="llama4", hf_class_name="Llama4ForCausalLM",
    hf_config_name="Llama4TextConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_moe="feed_forward", hf_router="feed_forward.router", hf_mlp="feed_forward", router_output=router_output, router_input=router_input,
    from_mlx=from_mlx, mlx=MLX, experts="num_local_experts", hf_gate_up="columns",
    rules=(("positive", "intermediate_size", "intermediate_size_mlp", "interleave_moe_layer_step", "attention_chunk_size"),
           ("layer_index", "moe_layers"), ("per_layer", "no_rope_layers")),
)
