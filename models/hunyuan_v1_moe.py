"""Hunyuan-A13B (hunyuan_v1_moe): Llama's GQA with a per-head q/k RMSNorm applied to the rotated q and k
(after RoPE: AttentionArgs.qk_norm_after_rope; HF's query_layernorm / key_layernorm), rope theta stretched
by a fixed NTK alpha (rope_type "dynamic" with `alpha`: theta * alpha ** (d / (d - 2)), HF's ntk_alpha, no
length dependence); softmax routing over fp32 logits, the top-k always renormalised, plus one always-on
ungated shared MLP (`mlp.shared_mlp`); experts and shared MLP both intermediate_size wide, every layer
MoE. moe_topk may be a per-layer list (the release's form, llama.cpp's converter reads it so): one value."""

from models.args import AttentionArgs, ModelArgs, RopeArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, sanitize_hf
from models.mlx_lm import COMMON_REQUIRE, MlxLm, const, head_dim, rope_parameters

L = 2
TINY = dict(
    # llama.cpp's converter asserts the release's rope (alpha 1000, theta 1e4, head dim 128 as hidden / heads,
    # 32k positions): a tiny of two 128-wide heads
    vocab_size=256, hidden_size=256, intermediate_size=32, num_hidden_layers=L, num_attention_heads=2,
    num_key_value_heads=1, head_dim=128, num_experts=8, moe_topk=[2] * L, max_position_embeddings=32768,
    rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0},
    # the release's own fields (HF reads none of them; llama.cpp's converter and mlx-lm do)
    moe_intermediate_size=[32] * L, num_shared_expert=[1] * L, use_mixed_mlp_moe=True, use_qk_norm=True,
    use_cla=False, cla_share_factor=1,
    tie_word_embeddings=True,  # the release ties them (mlx-lm's hunyuan always does)
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def one(c, name: str):
    """A field that may be one value or a per-layer list (HF reads moe_topk[layer]): its one value."""
    v = getattr(c, name, None)
    if isinstance(v, (list, tuple)):
        require(len(set(v)) == 1, f"hunyuan_v1_moe: {name} differs between layers ({v}): not supported")
        return v[0]
    return v


def theta(c) -> float:
    """HF's rope theta: rope_type "dynamic" with an alpha is a fixed NTK stretch of the base (computed in
    Python floats, as HF's compute_ntk_alpha_rope_parameters does); "default" the base itself."""
    rp = rope_parameters(c)
    kind, base = rp.get("rope_type", "default"), float(rp["rope_theta"])
    if kind == "dynamic" and rp.get("alpha"):
        d = c.head_dim
        return base * rp["alpha"] ** (d / (d - 2))
    require(kind == "default", f"hunyuan_v1_moe: rope_type {kind!r} is not supported (only 'default' and "
                               "'dynamic' with alpha)")
    return base


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"hunyuan_v1_moe: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(isinstance(c.num_experts, int) and c.num_experts > 1, "hunyuan_v1_moe: num_experts must be one "
            f"number above 1 (got {c.num_experts!r})")
    for name, want in (("moe_intermediate_size", c.intermediate_size), ("num_shared_expert", 1)):
        v = one(c, name)
        require(v in (None, want), f"hunyuan_v1_moe: {name} {v} (HF's experts and shared MLP are intermediate_size "
                                   f"wide, one shared MLP: {name} must be {want})")
    require(getattr(c, "use_mixed_mlp_moe", True) and not getattr(c, "use_cla", False),
            "hunyuan_v1_moe: use_mixed_mlp_moe False or use_cla (HF always adds the shared MLP and has no "
            "cross-layer attention)")
    return hf_args(
        c, "hunyuan_v1_moe", num_experts_per_tok=one(c, "moe_topk"), rope=RopeArgs(theta(c)),
        attention=AttentionArgs(qk_norm="head", qk_norm_after_rope=True, qkv_bias=c.attention_bias,
                                o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.intermediate_size,
        shared_expert_intermediate_size=c.intermediate_size, shared_expert_gated=False,
        # HF: logits over the fp32 gate weight (wg, built in fp32), softmax, top-k, renormalised, cast to the
        # logits' dtype
        router=RouterArgs(norm_topk_prob=True, fp32=True, fp32_params=("weight",)),
    )


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """query_layernorm / key_layernorm -> q_norm / k_norm; the gate's wg -> mlp.gate; the shared MLP
    (mlp.shared_mlp) -> the always-on shared expert."""
    out = {}
    for k, t in weights.items():
        k = k.replace(".self_attn.query_layernorm.", ".self_attn.q_norm.")
        k = k.replace(".self_attn.key_layernorm.", ".self_attn.k_norm.")
        k = k.replace(".mlp.gate.wg.", ".mlp.gate.").replace(".mlp.shared_mlp.", ".mlp.shared_experts.")
        out[k] = t
    return sanitize_hf(out, args)


def alpha(c) -> float:
    return float(rope_parameters(c).get("alpha") or 1.0)


MLX = MlxLm(
    module="hunyuan",
    config=dict(
        model_type="model_type", vocab_size="vocab_size", hidden_size="hidden_size",
        num_hidden_layers="num_hidden_layers", intermediate_size="intermediate_size",
        num_attention_heads="num_attention_heads", num_key_value_heads="num_key_value_heads",
        attention_bias="attention_bias", moe_topk=lambda c: one(c, "moe_topk"), num_experts="num_experts",
        num_shared_expert=const(1), use_mixed_mlp_moe=const(True), use_qk_norm=const(True),
        rms_norm_eps="rms_norm_eps", rope_theta=lambda c: float(rope_parameters(c)["rope_theta"]),
        use_cla=const(False), cla_share_factor=const(1), moe_intermediate_size="intermediate_size",
        # mlx-lm reads only the alpha (its DynamicNTKAlphaRoPE stretches the base the same way)
        rope_scaling=lambda c: {"type": "dynamic", "factor": 1.0, "alpha": alpha(c)},
        tie_word_embeddings="tie_word_embeddings",
    ),
    require=COMMON_REQUIRE + (
        (lambda c: c.tie_word_embeddings, "tie_word_embeddings False (mlx-lm's hunyuan always reads the logits "
                                          "off the embedding)"),
        (lambda c: head_dim(c) * c.num_attention_heads == c.hidden_size,
         "head_dim other than hidden_size / num_attention_heads (mlx-lm's hunyuan derives it)"),
        (lambda c: rope_parameters(c).get("rope_type", "default") in ("default", "dynamic"),
         "rope_type other than default / dynamic with alpha"),
    ),
)

FAMILY = Family(
    name="hunyuan_v1_moe", model_types=("hunyuan_v1_moe",), hf_module="hunyuan_v1_moe",
    hf_class_name="HunYuanMoEV1ForCausalLM", hf_config_name="HunYuanMoEV1Config", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, mlx=MLX, hf_router="mlp.gate", top_k="moe_topk",
    rules=(("positive", "intermediate_size"),),
)
