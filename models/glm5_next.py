"""GLM-5.3 (glm5_next, GLM-5-Next: multimodal only, its text model checked on text; models.text_tower): Kimi delta
attention on most layers beside NoPE latent attention with a k-pool DSA indexer, the residual as mHC
hyper-connections.

- KDA layers (layer_types "linear_attention"; models/layers/kda.py): Kimi-Linear's low-rank forget and output gates,
  the forget gate bounded (linear_lower_bound · sigmoid(e^A_log · (f + dt_bias)), Bailing-hybrid's safe gate), A_log
  one per head [h] (Kimi-Linear's [1, 1, h, 1]).
- The "indexed_attention" layers: DeepSeek's latent attention through q_lora_rank with no rotary dims at all
  (qk_rope_head_dim 0), its latent norms at rms_norm_eps (DeepSeek's: 1e-6: MLA.norm_eps); DeepSeek sparse attention
  whose indexer scores pools of index_kpool keys (models/layers/dsa_pool.py: each pool's key a learned softmax mix,
  index_topk / index_kpool pools kept plus the query's incomplete pool), unrotated, weights_proj not kept in fp32; a
  "shared" layer of indexer_types attends to the keys the layer just before it chose (HF passes the choice one layer
  on: that layer must be an indexed one).
- mHC (models/layers/hyper.py, DeepSeek-V4's form: Sinkhorn-projected comb, post 2 · sigmoid), only the bases and
  scales kept in fp32, and the streams' plain mean before the final norm (DeepSeek-V4's is weighted).
- Clamped SwiGLU on every MLP (experts, shared expert, dense layers: swiglu_limit); DeepSeek-V3 routing (sigmoid plus
  a correction bias, group-limited, renormalised, routed_scaling_factor); dense layers by mlp_layer_types.

The tiny config: KDA, indexed (full), indexed (shared), indexed (full: the DSA faults go to the last indexed layer's
own indexer), KDA last as the release's (its input norm's eps matters there: a NoPE latent attention through
q_lora_rank renormalises every projection of its input, so a wrong input-norm eps barely moves it); pools of 2,
index_topk 4 (2 pools) below the default prompt's 8 tokens (4 pools at its end); 4 streams with the mHC bases and
scales drawn wide (tiny_std); swiglu_limit 0.5, reached by weights of std 0.1. The config.json carries the release's
own fields beside HF's (llama.cpp's converter reads them): linear_attn_config, mla_use_nope, first_k_dense_replace,
scoring_func, topk_method."""

import re
from dataclasses import replace

from models.args import DSA, FULL, KDA, LINEAR, ExpertArgs, HyperArgs, KDAArgs, ModelArgs, RopeArgs
from models.checkpoint import stack_hf_experts
from models.family import Family
from models.kimi_linear import FORGET, joined_convs, mlp_types
from models.mapping import deepseek_router, hf_args, mla, require, sigmoid_routing, tie_embeddings
from models.text_tower import TextTower

INDEXED = "indexed_attention"  # HF's layer type of a latent-attention (DSA) layer

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2,
    n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    layer_types=[LINEAR, INDEXED, INDEXED, INDEXED, LINEAR], indexer_types=["full", "full", "shared", "full", "full"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"],
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=24,
    index_topk=4, index_kpool=2, index_head_dim=32, index_n_heads=16,
    linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
    hc_mult=4, hc_eps=1e-6, hc_sinkhorn_iters=20, swiglu_limit=0.5,
    max_position_embeddings=256, rms_norm_eps=1e-5,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

# the mHC bases and scales drawn around their own scale: with std 0.1 every stream would get nearly the same weight
TINY_STD = {"_hc.base": 1.0, "_hc.scale": (1.0, 0.5)}


def shared_indexers(c) -> tuple[bool, ...]:
    types, kinds = tuple(c.indexer_types), tuple(c.layer_types)
    require(len(types) == c.num_hidden_layers,
            f"indexer_types has {len(types)} entries, num_hidden_layers is {c.num_hidden_layers}")
    require(set(types) <= {"full", "shared"}, f"indexer_types {sorted(set(types) - {'full', 'shared'})}")
    shared = tuple(t == "shared" and k == INDEXED for t, k in zip(types, kinds))
    for i, s in enumerate(shared):  # (HF hands a choice to the next layer only)
        require(not s or (i > 0 and kinds[i - 1] == INDEXED),
                f"indexer_types[{i}] 'shared' after a {kinds[i - 1] if i else 'missing'} layer (HF: a shared layer "
                "reads the choice of the indexed layer just before it)")
    return shared


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"glm5_next: hidden_act {c.hidden_act!r} (the MLPs and the convs are silu)")
    require(set(c.layer_types) <= {LINEAR, INDEXED}, f"glm5_next: layer_types {sorted(set(c.layer_types))}")
    require(c.index_kpool >= 1 and c.index_topk % c.index_kpool == 0,
            f"index_topk {c.index_topk} not a multiple of index_kpool {c.index_kpool}")
    n = c.num_hidden_layers
    dsa = DSA(index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads,
              shared=shared_indexers(c), weights_fp32=False, kpool=c.index_kpool,
              kpool_tail=bool(c.index_kpool_always_select_tail))
    latent = mla(c)
    attention = replace(latent, dsa=dsa, mla=replace(latent.mla, norm_eps=c.rms_norm_eps))
    lower = c.linear_lower_bound
    return hf_args(
        c, "glm5_next", layer_types=tuple(KDA if t == LINEAR else FULL for t in c.layer_types),
        rope=RopeArgs(10000.0, per_layer=(0,) * n),  # NoPE: no layer rotates (the base is never read)
        attention=attention, mlp_types=mlp_types(c), intermediate_size=c.intermediate_size,
        num_experts=c.n_routed_experts, moe_intermediate_size=c.moe_intermediate_size,
        shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0), shared_expert_gated=False,
        mlp_activation="cswiglu", experts=ExpertArgs("cswiglu", swiglu_limit=float(c.swiglu_limit)),
        router=deepseek_router(c, **sigmoid_routing(c)),
        kda=KDAArgs(num_heads=c.linear_num_heads, head_dim=c.linear_head_dim, conv_kernel=c.linear_conv_kernel_dim,
                    lower_bound=float(lower) if lower is not None else 0.0),
        hyper=HyperArgs(streams=c.hc_mult, form="mhc", sinkhorn_iters=c.hc_sinkhorn_iters, eps=c.hc_eps,
                        norm_eps=c.rms_norm_eps, head="mean", fp32_params=("base", "scale")),
    )


# the release's names -> HF's (transformers 5.23's conversion mapping "glm5_next", whose reverse save_pretrained
# writes): the forget gate's tensors on the attention, the hyper-connections' hc_{attn,ffn}_{fn,base,scale}
HC = re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$")


def release_names(weights: dict) -> dict:
    """The release's model.language_model.* as model.*, without the vision tower."""
    return {k.replace("model.language_model.", "model.", 1): t for k, t in weights.items()
            if not k.startswith(("model.visual.", "visual."))}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    """The release's layout (save_pretrained's) or HF's own -> the production model's: per-expert gate/up/down
    stacked, q/k/v_conv1d joined, the forget gate's tensors under forget_gate (A_log [h] as [1, 1, h, 1]), the
    hyper-connections' names HF's."""
    out = {}
    for k, t in release_names(weights).items():
        if (m := FORGET.fullmatch(k)) is not None:
            k = f"{m[1]}.forget_gate.{m[2]}"
        k = HC.sub(lambda m: f".{m[1]}_hc.{m[2]}", k)
        if k.endswith(".forget_gate.A_log"):
            t = t.reshape(1, 1, -1, 1)
        out[k[len("model."):] if k.startswith("model.") else k] = t
    return tie_embeddings(stack_hf_experts(joined_convs(out)), args)


def release_fields(c) -> dict:
    """The release's config.json fields beside HF's (what llama.cpp's converter reads; HF derives its own)."""
    kinds = c["layer_types"]
    return dict(linear_attn_config=dict(num_heads=c["linear_num_heads"], head_dim=c["linear_head_dim"],
                                        short_conv_kernel_size=c["linear_conv_kernel_dim"],
                                        gate_lower_bound=c["linear_lower_bound"],
                                        kda_layers=[i for i, t in enumerate(kinds) if t == LINEAR],
                                        full_attn_layers=[i for i, t in enumerate(kinds) if t != LINEAR]),
                mla_use_nope=True, first_k_dense_replace=c["mlp_layer_types"].count("dense"), scoring_func="sigmoid",
                topk_method="noaux_tc")


TOWER = TextTower(model="Glm5NextTextModel", composite="glm5_next",
                  architecture="Glm5NextForConditionalGeneration", composite_config="Glm5NextConfig")

FAMILY = Family(
    name="glm5_next", model_types=("glm5_next", "glm5_next_text"), hf_module="glm5_next",
    hf_class_name="Glm5NextTextModel", hf_config_name="Glm5NextTextConfig", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, text_tower=TOWER, experts="n_routed_experts", tiny_std=TINY_STD, not_positive=("head_dim",),
    release_config=release_fields(TINY),
    rules=(("positive", "linear_num_heads", "linear_head_dim", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim",
            "q_lora_rank", "index_kpool", "index_topk", "moe_intermediate_size", "intermediate_size"),
           ("at_least", "linear_conv_kernel_dim", 2), ("per_layer", "mlp_layer_types", "layer_types", "indexer_types")),
)
