"""HY-V4 (hy_v4, Tencent Hy4): GLM-5's layer stack with four changes.

- Independent hyper-connections (iHC, models/layers/hyper.py, HyperArgs form "ihc"): the residual is hc_mult
  streams; around each block a collapse (sigmoid weights + hc_eps) and an expansion (hc_magnitude * sigmoid + hc_eps)
  computed from the streams in fp32, the streams added back unmixed (no comb, no Sinkhorn); the embedding copied onto
  the streams, a weighted collapse (hc_head) before the final norm.
- The latent attention (q_lora_rank bottleneck, half-split rotation: HF's "non-interleave") with a learned sink
  logit per head (gpt-oss's, AttentionArgs.sinks) and a sigmoid gate per value channel from its own projection
  (HF's gate_proj, here g_proj: gate_act "sigmoid", gate_width "element").
- DeepSeek sparse attention (models/layers/dsa.py) whose indexer rotates the *last* qk_rope_head_dim dims of its
  q and k (DSA.rope_last), LayerNorms its keys in fp32 with rms_norm_eps (k_norm_eps, k_norm_fp32), and shares its
  choice with the "shared" layers of indexer_types (GLM-5's).
- Clamped SwiGLU experts (ExpertArgs "cswiglu": silu(min(gate, limit)) * clamp(up, +-limit)); DeepSeek-V3 routing
  (sigmoid + correction bias, renormalised, routed_scaling_factor) with always-on shared experts; dense layers by
  mlp_layer_types.

The tiny config: index_topk 4 below the default prompt's 8 tokens; indexer_types full, shared, full (the last layer
has its own indexer: the DSA faults go to the last layer's); 4 streams with the iHC bases and scales drawn wide
(tiny_std) so each stream's weights differ; hc_magnitude 1.5 (not DeepSeek-V4's constant 2); swiglu_limit 0.5,
reached by weights of std 0.1."""

import re
from dataclasses import replace

from models.args import DSA, ExpertArgs, HyperArgs, ModelArgs
from models.deepseek_v32 import DSA_RULES
from models.family import Family
from models.glm4_moe_lite import mlp_types
from models.glm_moe_dsa import shared_layers
from models.mapping import points_without, deepseek_router, hf_args, mla, require, rope_of, sanitize_hf, sigmoid_routing

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    mlp_layer_types=["dense", "sparse", "sparse"],
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24,
    max_position_embeddings=256, rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    index_topk=4, index_head_dim=128, index_n_heads=16, indexer_types=["full", "shared", "full"],
    hc_mult=4, hc_magnitude=1.5, hc_eps=1e-6, swiglu_limit=0.5,  # (hc_magnitude: not DeepSeek-V4's 2)
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

# the hyper-connections' bases and scales drawn around their own scale: with std 0.1 every stream would get nearly
# the same weight (sigmoid(0) = 0.5), and a port that mixed the streams in the wrong order could pass
TINY_STD = {"_hc.base": 1.0, "_hc.scale": (1.0, 0.5), "hc_head.hc_base": 1.0, "hc_head.hc_scale": (1.0, 0.5)}


def hyper(c) -> HyperArgs:
    return HyperArgs(streams=c.hc_mult, form="ihc", sinkhorn_iters=0, eps=c.hc_eps, norm_eps=c.rms_norm_eps,
                     magnitude=float(c.hc_magnitude))


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"hy_v4: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(c.swiglu_limit > 0, f"hy_v4: swiglu_limit {c.swiglu_limit} (no clamp: not ported)")
    require(c.index_head_dim >= c.qk_rope_head_dim,
            f"index_head_dim {c.index_head_dim} < qk_rope_head_dim {c.qk_rope_head_dim} (the indexer rotates that many)")
    require(set(c.layer_types) == {"indexed_attention"}, f"hy_v4: layer_types {sorted(set(c.layer_types))}")
    dsa = DSA(index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads,
              rope_interleave=False, shared=shared_layers(c), rope_last=True, k_norm_eps=c.rms_norm_eps,
              k_norm_fp32=True)
    attention = replace(mla(c), dsa=dsa, sinks=True, gate_act="sigmoid", gate_width="element")
    return hf_args(c, "hy_v4", rope=rope_of(c, interleave=False), attention=attention, mlp_types=mlp_types(c),
                   intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                   shared_expert_gated=False, router=deepseek_router(c, **sigmoid_routing(c)),
                   experts=ExpertArgs("cswiglu", swiglu_limit=float(c.swiglu_limit)), hyper=hyper(c))


# the release's names -> HF's (transformers 5.23 conversion_mapping "hy_v4", in its order); save_pretrained writes the
# release's, so the tiny checkpoints hold them too
RELEASE_NAMES = (
    (r"\.hc_pre\.hc_", ".hc_"), (r"\.learnable_sink_param", ".sinks"), (r"\.linear_gate", ".gate_proj"),
    (r"\.hc_attn_layer\.hc_fn", ".attn_hc.fn"), (r"\.hc_attn_layer\.hc_base", ".attn_hc.base"),
    (r"\.hc_attn_layer\.hc_scale", ".attn_hc.scale"), (r"\.hc_mlp_layer\.hc_fn", ".ffn_hc.fn"),
    (r"\.hc_mlp_layer\.hc_base", ".ffn_hc.base"), (r"\.hc_mlp_layer\.hc_scale", ".ffn_hc.scale"),
    (r"\.hc_head_fn", ".hc_fn"), (r"\.hc_head_base", ".hc_base"), (r"\.hc_head_scale", ".hc_scale"),
)


def hf_name(name: str) -> str:
    for pattern, to in RELEASE_NAMES:
        name = re.sub(pattern, to, name)
    return name


def release_names(weights: dict) -> dict:
    """The release's layout (what llama.cpp's converter reads: model.layers.N.hc_attn_layer.hc_pre.hc_fn,
    model.hc_head.hc_head_fn, the MLPs' gate_proj): transformers 5.23's save_pretrained reverses its renames onto the
    first match and writes hc_pre.hc_attn_layer.hc_fn, model.hc_pre.hc_head.hc_head_fn and every gate_proj as
    linear_gate. The seeded checkpoints are written so (Family.release_names); HF reads both back the same."""
    def name(k):
        k = re.sub(r"\.hc_pre\.hc_(attn|mlp)_layer\.hc_", r".hc_\1_layer.hc_pre.hc_", k)
        k = k.replace(".hc_pre.hc_head.", ".hc_head.")
        return k if ".self_attn." in k else k.replace(".linear_gate.", ".gate_proj.")
    return {name(k): v for k, v in weights.items()}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's names (or HF's) -> HF's, then the production model's: the attention's gate projection is its
    g_proj; the MTP layers (model.mtp_layers.*, which HF does not load) left out."""
    weights = {hf_name(k).replace(".self_attn.gate_proj.", ".self_attn.g_proj."): t for k, t in weights.items()
               if ".mtp_layers." not in k}
    return sanitize_hf(weights, args)



def point_view(points, args: ModelArgs, layer=None):
    """HF's points less its rope taps: HF's latent attention and its indexer both rotate through the tapped function,
    the production attention through its own (the indexer's alone are tapped: 9 against HF's 18, none on a shared
    layer)."""
    return points_without(points, lambda n: n in ("q_rope", "k_rope"))


FAMILY = Family(
    name="hy_v4", model_types=("hy_v4",), hf_module="hy_v4", hf_class_name="HYV4ForCausalLM",
    hf_config_name="HYV4Config", tiny_config=TINY, to_args=to_args, sanitize=sanitize, experts="n_routed_experts",
    hf_point_view=point_view,
    tiny_std=TINY_STD, release_names=release_names, rules=(*DSA_RULES, ("per_layer", "indexer_types")),
)
