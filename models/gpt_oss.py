"""gpt-oss: sliding-window layers (the last sliding_window positions) alternating with full ones,
a learned sink logit per head in every softmax, biased q/k/v/o, YaRN, a biased router whose top-k
logits are softmaxed, and experts with biases and the clamped SwiGLU
(gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)), gate/up interleaved."""

from models.args import FULL, SLIDING, AttentionArgs, ExpertArgs, ModelArgs, NormArgs, RouterArgs
from models.checkpoint import CheckpointError
from models.family import Family
from models.mapping import hf_args, require, rope_of, rope_theta_any, sanitize_hf
from models.mlx_lm import YARN_REQUIRE, MlxLm, yarn_scaling

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    layer_types=[SLIDING, FULL], sliding_window=4,  # the prompts are longer than the window
    attention_bias=True, swiglu_limit=7.0, max_position_embeddings=256,
    # the release's YaRN (factor 32 over 4096 positions, beta 32 / 1) but truncate True: mlx-lm always
    # truncates, the release's truncate False is refused there (the reference does both)
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c) -> ModelArgs:
    require(set(c.layer_types) <= {FULL, SLIDING}, f"gpt_oss: unknown layer_types {sorted(set(c.layer_types))}")
    return hf_args(
        c, "gpt_oss", rope=rope_of(c), layer_types=tuple(c.layer_types),
        norm=NormArgs(gain_fp32=True),  # GptOssRMSNorm: (w * x).to(dtype)
        attention=AttentionArgs(sliding_window=c.sliding_window, sinks=True, qkv_bias=c.attention_bias,
                                o_bias=c.attention_bias),
        num_experts=c.num_local_experts, moe_intermediate_size=c.intermediate_size,
        router=RouterArgs(norm_topk_prob=True, logit_bias=True),
        experts=ExpertArgs("clamped_swiglu", swiglu_limit=float(c.swiglu_limit),
                           swiglu_alpha=float(getattr(c, "swiglu_alpha", 1.702)), bias=True),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """HF's experts (x @ W: gate_up_proj [E, H, 2I] with gate in the even columns, up in the odd;
    down_proj [E, I, H]) -> the production layout ([E, 2I, H] gate rows then up rows; [E, H, I])."""
    import torch

    if any(k.endswith(("_blocks", "_scales")) for k in weights):
        raise CheckpointError("gpt_oss: MXFP4 experts (*_blocks / *_scales, the release's layout), but config.json "
                              "declares no quantization_config {\"quant_method\": \"mxfp4\"}: the release's config "
                              "says how its experts are packed")
    out = {}
    for k, t in weights.items():
        k = k.replace(".mlp.router.", ".mlp.gate.")
        if k.endswith("experts.gate_up_proj"):
            t = torch.cat([t[..., ::2], t[..., 1::2]], dim=-1).transpose(1, 2)
        elif k.endswith("experts.gate_up_proj_bias"):
            t = torch.cat([t[..., ::2], t[..., 1::2]], dim=-1)
        elif k.endswith("experts.down_proj"):
            t = t.transpose(1, 2)
        out[k] = t.contiguous()
    return sanitize_hf(out, args)


def to_mlx(weights: dict) -> dict:
    """HF's expert arrays -> mlx-lm's SwitchGLU names ([E, out, in], gate / up split), which its
    sanitize() passes through (it converts only the MXFP4 release)."""
    import mlx.core as mx

    out = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_up_proj"):
            p = k[: -len("gate_up_proj")]
            out[p + "gate_proj.weight"] = mx.contiguous(v[..., ::2].swapaxes(-1, -2))
            out[p + "up_proj.weight"] = mx.contiguous(v[..., 1::2].swapaxes(-1, -2))
        elif k.endswith("experts.gate_up_proj_bias"):
            p = k[: -len("gate_up_proj_bias")]
            out[p + "gate_proj.bias"], out[p + "up_proj.bias"] = v[..., ::2], v[..., 1::2]
        elif k.endswith("experts.down_proj"):
            out[k + ".weight"] = mx.contiguous(v.swapaxes(-1, -2))
        elif k.endswith("experts.down_proj_bias"):
            out[k[: -len("_bias")] + ".bias"] = v
        else:
            out[k] = v
    return out


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's SwitchGLU names -> HF's experts (to_mlx undone): gate_up_proj [E, H, 2I] with gate
    in the even columns and up in the odd, its bias [E, 2I] likewise; down_proj [E, I, H]."""
    import torch

    out = {}
    for k, v in weights.items():
        if k.endswith("experts.gate_proj.weight"):
            p = k[: -len("gate_proj.weight")]
            up = weights[p + "up_proj.weight"]
            out[p + "gate_up_proj"] = torch.stack([v, up], dim=-2).flatten(-3, -2).transpose(-1, -2)
        elif k.endswith("experts.gate_proj.bias"):
            p = k[: -len("gate_proj.bias")]
            out[p + "gate_up_proj_bias"] = torch.stack([v, weights[p + "up_proj.bias"]], dim=-1).flatten(-2)
        elif k.endswith("experts.down_proj.weight"):
            out[k[: -len(".weight")]] = v.transpose(-1, -2)
        elif k.endswith("experts.down_proj.bias"):
            out[k[: -len(".bias")] + "_bias"] = v
        elif not k.endswith(("experts.up_proj.weight", "experts.up_proj.bias")):
            out[k] = v
    return out


def _rope_scaling(c):
    s = yarn_scaling(c)
    return None if s is None else {**s, "rope_type": "yarn"}


MLX = MlxLm(
    module="gpt_oss",
    config=dict(
        model_type="model_type", num_hidden_layers="num_hidden_layers", num_local_experts="num_local_experts",
        num_experts_per_tok="num_experts_per_tok", vocab_size="vocab_size", rms_norm_eps="rms_norm_eps",
        hidden_size="hidden_size", intermediate_size="intermediate_size", head_dim="head_dim",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        sliding_window="sliding_window", layer_types=lambda c: list(c.layer_types), rope_theta=rope_theta_any,
        rope_scaling=_rope_scaling,
    ),
    require=YARN_REQUIRE + (
        (lambda c: c.swiglu_limit == 7.0 and getattr(c, "swiglu_alpha", 1.702) == 1.702,
         "swiglu_limit / swiglu_alpha other than 7 / 1.702 (mlx-lm's SwigluOAI hard-codes them)"),
        (lambda c: c.attention_bias, "attention_bias False (mlx-lm's gpt_oss always has the biases)"),
        (lambda c: not c.tie_word_embeddings, "tie_word_embeddings (mlx-lm's gpt_oss has its own lm_head)"),
        (lambda c: FULL in c.layer_types and SLIDING in c.layer_types,
         "layer_types without both kinds (mlx-lm's gpt_oss looks up one layer of each)"),
    ),
    convert=to_mlx,
)

FAMILY = Family(
    name="gpt_oss", model_types=("gpt_oss",), hf_module="gpt_oss", hf_class_name="GptOssForCausalLM",
    hf_config_name="GptOssConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, hf_router="mlp.router",
    from_mlx=from_mlx, mlx=MLX, tiny_std={"experts.gate_up_proj": 0.5},  # gate values beyond the clamp at 7 (std ~4)
    experts="num_local_experts", rules=(("positive", "intermediate_size", "sliding_window", "swiglu_limit"),),
    hf_gate_up="interleaved",
)
