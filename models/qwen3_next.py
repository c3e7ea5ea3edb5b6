"""Qwen3-Next: Qwen3.5-MoE's text model (Gated DeltaNet + gated full attention, (1 + w) RMSNorm,
softmax top-k routing, a sigmoid-gated shared expert) with its Gated DeltaNet input projections
fused per key head (in_proj_qkvz, in_proj_ba: re-laid out by sanitize() into Qwen3.5's), dense
MLP layers (mlp_only_layers, decoder_sparse_step) and norm_topk_prob from the config."""

from models.args import DENSE, FULL, LINEAR, SPARSE, AttentionArgs, ModelArgs, NormArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const
from models.qwen3_5_moe import (OFFSET_NORMS, conv1d_shape, from_mlx_names, full_attention_interval_of, gated_deltanet)  # noqa: F401
from models.rules import GATED_DELTANET

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True,
    mlp_only_layers=[1], decoder_sparse_step=1,  # layer 1 dense: every kind of layer appears
    layer_types=[LINEAR, LINEAR, LINEAR, FULL], max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def mlp_types(c) -> tuple:
    """HF's rule (Qwen3NextDecoderLayer): experts unless the layer is in mlp_only_layers, or
    (i + 1) is not a multiple of decoder_sparse_step, or there are no experts."""
    return tuple(SPARSE if (i not in (c.mlp_only_layers or []) and c.num_experts > 0
                            and (i + 1) % c.decoder_sparse_step == 0) else DENSE
                 for i in range(c.num_hidden_layers))


def to_args(c) -> ModelArgs:
    rp = c.rope_parameters or {}
    require(set(c.layer_types) <= {FULL, LINEAR}, f"qwen3_next: unknown layer_types {sorted(set(c.layer_types))}")
    require(c.hidden_act == "silu", f"qwen3_next: hidden_act {c.hidden_act!r} (the experts and the conv are silu)")
    return hf_args(
        c, "qwen3_next", rope=RopeArgs(rope_theta(c), partial_rotary_factor=rp.get("partial_rotary_factor", 1.0)),
        norm=NormArgs(offset=True),
        attention=AttentionArgs(qk_norm="head", output_gate=True, qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=bool(c.norm_topk_prob)),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, layer_types=tuple(c.layer_types),
        mlp_types=mlp_types(c), intermediate_size=c.intermediate_size, linear_attention=gated_deltanet(c),
    )


def split_qkvz_ba(qkvz, ba, a: ModelArgs):
    """The fused projections' rows, grouped per key head g (r = nv / nk value heads each):
    qkvz: q_g (dk) | k_g (dk) | v of g's r value heads (r dv) | z of them (r dv); ba: b (r) | a (r).
    -> Qwen3.5's in_proj_qkv (every q, then every k, then every v), in_proj_z, in_proj_b, in_proj_a."""
    import torch

    la = a.linear_attention
    nk, nv, dk, dv = la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim
    r, H = nv // nk, qkvz.shape[1:]
    q, k, v, z = torch.split(qkvz.reshape(nk, 2 * dk + 2 * r * dv, *H), [dk, dk, r * dv, r * dv], dim=1)
    b, a_ = torch.split(ba.reshape(nk, 2 * r, *H), [r, r], dim=1)
    qkv = torch.cat([q.reshape(nk * dk, *H), k.reshape(nk * dk, *H), v.reshape(nv * dv, *H)])
    return qkv, z.reshape(nv * dv, *H), b.reshape(nv, *H), a_.reshape(nv, *H)


def sanitize(weights: dict, args: ModelArgs) -> dict:
    out = {}
    for k, t in weights.items():
        if k.startswith("mtp."):  # the multi-token-prediction head: not the model checked
            continue
        if k.endswith("linear_attn.in_proj_qkvz.weight"):
            p = k[: -len("in_proj_qkvz.weight")]
            if p + "in_proj_ba.weight" not in weights:
                raise KeyError(f"{p}in_proj_ba.weight (beside {k})")
            parts = split_qkvz_ba(t, weights[p + "in_proj_ba.weight"], args)
            out.update(zip((p + n for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                                            "in_proj_a.weight")), parts))
        elif not k.endswith("linear_attn.in_proj_ba.weight"):
            out[k] = t
    return sanitize_hf(out, args)


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names (switch_mlp experts, norms stored as 1 + w, conv1d [C, K, 1]) -> HF's; the
    fused GDN projections are the same in both."""
    return from_mlx_names(weights, "model.")


MLX = MlxLm(
    module="qwen3_next",
    config=dict(
        model_type=const("qwen3_next"), hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        num_key_value_heads="num_key_value_heads", head_dim="head_dim", rms_norm_eps="rms_norm_eps",
        vocab_size="vocab_size", max_position_embeddings="max_position_embeddings",
        linear_num_value_heads="linear_num_value_heads", linear_num_key_heads="linear_num_key_heads",
        linear_key_head_dim="linear_key_head_dim", linear_value_head_dim="linear_value_head_dim",
        linear_conv_kernel_dim="linear_conv_kernel_dim", num_experts="num_experts",
        num_experts_per_tok="num_experts_per_tok", decoder_sparse_step="decoder_sparse_step",
        mlp_only_layers=lambda c: list(c.mlp_only_layers or []), moe_intermediate_size="moe_intermediate_size",
        shared_expert_intermediate_size="shared_expert_intermediate_size",
        norm_topk_prob="norm_topk_prob",  # mlx-lm's default is False, HF's True
        tie_word_embeddings="tie_word_embeddings", attention_bias="attention_bias",
        rope_theta=rope_theta, partial_rotary_factor=lambda c: (c.rope_parameters or {}).get("partial_rotary_factor", 1.0),
        rope_scaling=const(None), full_attention_interval=full_attention_interval_of,
    ),
    require=COMMON_REQUIRE + (
        # mlx-lm's sanitize finds the MoE layers by their experts and does nothing (no (1 + w) offset,
        # no conv1d transpose) when there are none
        (lambda c: SPARSE in mlp_types(c), "no MoE layer (mlx-lm's qwen3_next sanitize would skip the norm offset)"),
    ),
    check_tensor=conv1d_shape,
)

FAMILY = Family(
    name="qwen3_next", model_types=("qwen3_next",), hf_module="qwen3_next", hf_class_name="Qwen3NextForCausalLM",
    hf_config_name="Qwen3NextConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, from_mlx=from_mlx, mlx=MLX,
    rules=(("positive", "moe_intermediate_size", "intermediate_size", "decoder_sparse_step"),
           ("layer_index", "mlp_only_layers"), *GATED_DELTANET),
)
