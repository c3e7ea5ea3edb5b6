"""dots3 (dots3_note, rednote hi lab; the text model of the dots3-note VLM: HF's Dots3NoteForCausalLM over
Dots3NoteTextConfig): DeepSeek-V3.2's layer stack with latent attention of two kinds by layer (models/layers/
mla_scaled.py): "indexed_attention" layers with DeepSeek sparse attention (the lightning indexer of GLM-5, interleaved
rotation, its weights_proj in the model's dtype: HF keeps no module in fp32) and "sliding_attention" layers with a
window, no indexer and dimensions of their own (heads, q/kv lora ranks, head widths: HF's per_layer_config) and a
rope base of their own; on both, the normalised q and kv latents scaled by (hidden_size / rank)^1/2, the shared
rotary key RMS-normed before its rotation, and a sigmoid gate per head. Dense layers where mlp_layer_types says
"dense"; the others DeepSeek-V3's routing (sigmoid + correction bias, renormalised, routed_scaling_factor) plus
always-on shared experts of shared_experts_intermediate_size each. The vision and audio towers are not checked.

The tiny config: an indexed, a sliding, then an indexed layer (the DSA faults go to the last layer); index_topk 4 and
sliding_window 4, both below the default prompt's 8 tokens; the sliding layer with 2 heads (4 elsewhere), a kv rank
of 32 (16), no-rope and value widths of 24 (16)."""

from dataclasses import replace

from models.args import DSA, FULL, MLA, AttentionArgs, SLIDING, ModelArgs, RopeArgs
from models.family import Family
from models.glm4_moe_lite import mlp_types
from models.mapping import deepseek_router, drop_layers_from, hf_args, require, sanitize_hf, sigmoid_routing
from models.rules import GROUPED

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_experts_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
    mlp_layer_types=["dense", "sparse", "sparse"],
    layer_types=["indexed_attention", "sliding_attention", "indexed_attention"], sliding_window=4,
    q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, head_dim=24,
    swa_num_attention_heads=2, swa_num_key_value_heads=2, swa_q_lora_rank=24, swa_kv_lora_rank=32, swa_head_dim=32,
    swa_qk_nope_head_dim=24, swa_v_head_dim=24, swa_qk_rope_head_dim=8, rope_theta=1000000.0, swa_rope_theta=50000.0,
    max_position_embeddings=256, rms_norm_eps=1e-5, index_topk=4, index_head_dim=128, index_n_heads=16,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

KINDS = {"indexed_attention": FULL, "sliding_attention": SLIDING}


def _rope(c, kind: str, **how) -> RopeArgs:
    p = c.rope_parameters[kind]
    require(p.get("rope_type", "default") == "default", f"dots3_note: {kind} rope_type {p.get('rope_type')!r} "
            "(only default RoPE)")
    return RopeArgs(float(p["rope_theta"]), interleave=True, **how)


def _mla(c) -> MLA:
    return MLA(kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim,
               v_head_dim=c.v_head_dim, q_lora_rank=c.q_lora_rank or 0)


class _Global:
    """HF's config, its per-layer fields (which it refuses to read globally) read from its first indexed layer's."""

    def __init__(self, c):
        types = list(c.layer_types)
        self._c = c
        self._first = c.per_layer_config[types.index("indexed_attention") if "indexed_attention" in types else 0]

    def __getattr__(self, name):
        try:
            return getattr(self._c, name)
        except RuntimeError:  # (transformers' AmbiguousGlobalPerLayerAttributeError)
            return getattr(self._first, name)


def to_args(c) -> ModelArgs:
    return _to_args(_Global(c))


def _to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"dots3_note: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(set(c.layer_types) <= set(KINDS), f"dots3_note: layer_types {sorted(set(c.layer_types) - set(KINDS))} "
            "(only indexed_attention, sliding_attention)")
    types = tuple(KINDS[t] for t in c.layer_types)
    per = [c.per_layer_config[i] for i in range(c.num_hidden_layers)]
    for p in per:
        require(bool(p.q_lora_rank), "dots3_note: q_lora_rank (HF's attention always projects q through it)")
        require(p.num_key_value_heads == p.num_attention_heads, "dots3_note: num_key_value_heads != num_attention_heads")
    sliding = next((p for p, t in zip(per, types) if t == SLIDING), None)
    # the DSA layers' cos/sin are computed in fp32 (HF's rotary embedding of inputs_embeds.float()), the sliding ones'
    # in the model's dtype
    rope = _rope(c, "indexed_attention", fp32=True) if FULL in types else _rope(c, "sliding_attention")
    if sliding is not None and FULL in types:
        rope = replace(rope, sliding=_rope(c, "sliding_attention"))
    attention = AttentionArgs(
        "mla", _mla(c),
        mla_sliding=None if sliding is None else _mla(sliding), mla_scaled=True, gate_act="sigmoid", gate_width="head",
        sliding_window=c.sliding_window if sliding is not None else None, qkv_bias=c.attention_bias,
        o_bias=c.attention_bias,
        dsa=DSA(index_topk=c.index_topk, index_head_dim=c.index_head_dim, index_n_heads=c.index_n_heads,
                rope_interleave=True, weights_fp32=False) if FULL in types else None)
    return hf_args(c, "dots3_note", rope=rope, attention=attention, layer_types=types,
                   layer_heads=tuple(p.num_attention_heads for p in per),
                   layer_kv_heads=tuple(p.num_key_value_heads for p in per),
                   mlp_types=mlp_types(c), intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                   moe_intermediate_size=c.moe_intermediate_size,
                   shared_expert_intermediate_size=c.shared_experts_intermediate_size * c.n_shared_experts,
                   shared_expert_gated=False, router=deepseek_router(c, **sigmoid_routing(c)))


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return sanitize_hf(drop_layers_from(weights, args.num_hidden_layers), args)


# the release's own config.json fields, which transformers 5.23's save_pretrained folds into per_layer_config and a
# rope_parameters keyed by layer type (HF reads them back to the same model): llama.cpp's converter reads these (its
# gating check, the sliding layers' MLA geometry, its rope bases from rope_theta / swa_rope_theta where rope_parameters
# has no full_attention entry, and the latents' rescale, which HF always applies and the converter folds into the norms
# only when told)
RELEASE = dict(
    scoring_func="sigmoid", topk_method="noaux_tc", apply_mla_qkv_lora_rescale=True,
    sliding_window_size=TINY["sliding_window"], rope_theta=TINY["rope_theta"], swa_rope_theta=TINY["swa_rope_theta"],
    **{k: v for k, v in TINY.items() if k.startswith("swa_") and k != "swa_rope_theta"},
)

FAMILY = Family(
    name="dots3_note", model_types=("dots3_note_text",), hf_module="dots3_note", hf_class_name="Dots3NoteForCausalLM",
    hf_config_name="Dots3NoteTextConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    experts="n_routed_experts", release_config=RELEASE, release_drops=("rope_parameters",),
    rules=(*GROUPED, ("positive", "moe_intermediate_size", "intermediate_size", "shared_experts_intermediate_size"),
           ("per_layer", "mlp_layer_types"), ("positive", "sliding_window", "index_topk", "index_head_dim",
                                               "index_n_heads")),
)
