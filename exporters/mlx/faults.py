"""Seeded faults on mlx-lm's model, keyed by the names in models/faults/.

Each transform changes one block of a loaded mlx-lm model in place, the way the bug would
look in an MLX port: a module attribute (rope, scale, eps, norm), weights, or one module
instance's `__call__`. `inject(fault, model, args)` applies it at the layer models/faults/
expects the oracle to localise it (`fault.layer(args)`, `fault.kind`), reading the checkpoint's
ModelArgs for what mlx-lm's modules do not all carry (top-k, renormalisation, head_dim, rope theta).
mlx-lm's families name their parts differently (exporters/mlx/model.py: `switch_mlp` or `experts`,
a router that routes by itself or a linear gate whose logits the block routes inline, Granite's
`router.layer`, GPT-OSS's `sm_scale`, Llama 4's `use_qk_norm`, ropes with explicit frequencies):
every transform goes through those accessors, so each fault has its own form on every family.
Faults with no form on mlx-lm's model (the bf16 dtype faults; ERNIE's correction-bias faults, whose
bias mlx-lm drops) are refused: `MLXBackend.with_fault` returns None for them and `not_applicable`
says why.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exporters.mlx.fault_attention import (gdn_chunked_prefill, gdn_forget, gqa_repeat_wrong, kv_off_by_one,
                                            mla_cache_not_carried, mla_rope_nope_swapped, not_causal,
                                            output_gate_no_sigmoid, qk_norm_before_rope, qk_norm_flat_for_per_head,
                                            qk_norm_missing, qk_norm_per_head_for_flat, rope_interleaved,
                                            rope_of_the_model, rope_on_nope_layer, rope_theta_wrong,
                                            rotary_fraction_wrong, scale_wrong, sinks_dropped, window_off_by_one,
                                            q_position_scale_missing, yarn_mscale_missing)
from exporters.mlx.fault_dsa import FAULTS as DSA_FAULTS
from exporters.mlx.fault_block_sparse import FAULTS as BLOCK_SPARSE_FAULTS
from exporters.mlx.fault_gemma4 import FAULTS as GEMMA4_FAULTS
from exporters.mlx.fault_gemma4 import ON_GEMMA4
from exporters.mlx.fault_kda import FAULTS as KDA_FAULTS
from exporters.mlx.fault_mamba import FAULTS as MAMBA_FAULTS
from exporters.mlx.fault_moe import (bias_ignored, bias_in_weights, clamp_missing, dense_layer_routed,
                                     expert_index_off_by_one, gate_up_swapped, group_limit_ignored, moe_layer_as_dense,
                                     no_renorm, one_expert_fewer, one_expert_off, patched_combine, reroute,
                                     router_logit_bias_ignored, set_gate, sigmoid, softmax_after_topk,
                                     softmax_for_sigmoid, sparsemixer_first_unmasked, stray_bf16)
from exporters.mlx.model import attention_block, call_mixer, final_norm, get_part, moe_block, part, patch_call, text_model


# ------------------------------------------------------------------ layer / model
def _input_norm_eps(layer, a):
    get_part(layer, "input_layernorm").eps *= 1e3


def _norm_offset_missing(layer, a):  # sanitize()'s +1 on (1 + w) weights lost (conv1d-shape trap)
    norm = get_part(layer, "post_attention_layernorm")
    norm.weight = norm.weight - 1.0


def _residual_missing(layer, a):
    if "mixer" in layer and "norm" in layer:  # Nemotron-H's block: its one mixer's output without the stream
        def block(self, x, mask=None, cache=None):
            h = self.norm(x)
            return self.mixer(h, mask=mask, cache=cache) if self.block_type in ("M", "*") else self.mixer(h)

        patch_call(layer, block)
        return
    pre, post = get_part(layer, "input_layernorm"), get_part(layer, "post_attention_layernorm")

    def call(self, x, *args, **kw):  # (mask, cache), or what the model passes beside them (Mistral 4's attn_scale)
        h = call_mixer(attention_block(self), pre(x), *args, **kw)
        return h + moe_block(self)(post(h))

    patch_call(layer, call)


def _final_norm_eps(model, a):
    final_norm(text_model(model)).eps *= 1e3


def _layernorm_as_rmsnorm(layer, a):
    owner, name = part(layer, "input_layernorm")
    ln = getattr(owner, name)
    rms = nn.RMSNorm(ln.weight.shape[0], eps=ln.eps)
    rms.weight = ln.weight
    setattr(owner, name, rms)


def _logits_scaling_missing(model, a):
    text_model(model).logits_scaling = 1.0  # mlx-lm's Granite divides by it (so does the logits block)


def _short_conv_gate_missing(sc, a):  # the short conv's in_proj with its C third (the gate) all ones
    call = type(sc.in_proj).__call__

    def fn(self, x):
        b, _, v = mx.split(call(self, x), 3, axis=-1)
        return mx.concatenate([b, mx.ones_like(b), v], axis=-1)

    patch_call(sc.in_proj, fn)


def _set(name, value):
    def apply(obj, a):
        setattr(obj, name, value(a) if callable(value) else value)

    return apply


# name -> transform(target, args): target the layer, its attention block (fault.kind attention),
# or the model (fault.target model; MODEL_LEVEL: the model and the layer index)
FAULTS = {
    "router_softmax_after_topk": lambda layer, a: reroute(layer, a, softmax_after_topk),
    "router_no_renorm": no_renorm,
    "router_wrong_num_experts": one_expert_fewer,
    "router_sigmoid": sigmoid,
    "expert_gate_up_swapped": gate_up_swapped,
    "expert_weights_off_1e-3": one_expert_off,
    "expert_index_off_by_one": expert_index_off_by_one,
    "expert_weights_not_applied": lambda layer, a: patched_combine(layer, a, weighted=False),
    "shared_expert_gate_no_sigmoid": lambda layer, a: patched_combine(layer, a, shared_sigmoid=False),
    "shared_expert_missing": lambda layer, a: patched_combine(layer, a, shared=False),
    "stray_bf16_downcast": stray_bf16,
    "rope_theta_wrong": rope_theta_wrong,
    "rope_interleaved": rope_interleaved,
    "rotary_fraction_wrong": rotary_fraction_wrong,
    "qk_norm_missing": qk_norm_missing,
    "qk_norm_before_rope": qk_norm_before_rope,
    "qk_norm_per_head_for_flat": qk_norm_per_head_for_flat,
    "qk_norm_flat_for_per_head": qk_norm_flat_for_per_head,
    "kv_cache_write_off_by_one": kv_off_by_one,
    "attention_not_causal": not_causal,
    "attention_scale_wrong": scale_wrong,
    "gqa_kv_heads_tiled": gqa_repeat_wrong,
    "clip_qkv_missing": _set("clip_qkv", float("inf")),  # DBRX's attention clamps to ±clip_qkv (mx.clip)
    "attention_gate_no_sigmoid": output_gate_no_sigmoid,
    "gdn_state_not_carried": lambda gdn, a: gdn_forget(gdn, 1),
    "gdn_conv_state_not_carried": lambda gdn, a: gdn_forget(gdn, 0),
    "gdn_chunked_prefill_differs": gdn_chunked_prefill,
    "rmsnorm_eps_wrong": _input_norm_eps,
    "norm_offset_missing": _norm_offset_missing,
    "residual_missing": _residual_missing,
    "final_norm_eps_wrong": _final_norm_eps,
    "router_bias_in_weights": bias_in_weights,
    "router_bias_ignored": bias_ignored,
    "router_group_limit_ignored": group_limit_ignored,
    "routed_scaling_missing": set_gate(routed_scaling_factor=1.0),
    "routed_scaling_twice": set_gate(routed_scaling_factor=lambda a: a.router.routed_scaling_factor ** 2),
    "router_softmax_for_sigmoid": softmax_for_sigmoid,
    "dense_layer_routed": dense_layer_routed,
    "mla_rope_nope_swapped": mla_rope_nope_swapped,
    "mla_cache_not_carried": mla_cache_not_carried,
    "yarn_mscale_missing": yarn_mscale_missing, "q_position_scale_missing": q_position_scale_missing,
    "attention_sinks_dropped": sinks_dropped,
    "sliding_window_off_by_one": window_off_by_one,
    "swiglu_clamp_missing": clamp_missing,
    "router_logit_bias_ignored": router_logit_bias_ignored,
    "sparsemixer_first_unmasked": sparsemixer_first_unmasked,
    "layernorm_as_rmsnorm": _layernorm_as_rmsnorm,
    "moe_interleave_wrong": moe_layer_as_dense,
    "residual_multiplier_missing": _set("residual_multiplier", 1.0),
    "attention_multiplier_missing": _set("scale", lambda a: a.head_dim ** -0.5),
    "logits_scaling_missing": _logits_scaling_missing,
    "rope_on_nope_layer": rope_on_nope_layer,
    "rope_of_the_model_on_own_layer": rope_of_the_model,
    "router_softcap_missing": lambda layer, a: setattr(moe_block(layer).gate, "softcap", 0.0),  # laguna's MoEGate
    # mlx-lm's lfm2_moe ShortConv: its state is the cache's slot 0 (as Gated DeltaNet's conv state); mlx's Conv1d
    # weight is [H, K, 1]; the C gate is in_proj's middle third
    "short_conv_state_not_carried": lambda sc, a: gdn_forget(sc, 0),
    "short_conv_taps_reversed": lambda sc, a: setattr(sc.conv, "weight", sc.conv.weight[:, ::-1, :]),
    "short_conv_gate_missing": _short_conv_gate_missing,
    **MAMBA_FAULTS,
    **KDA_FAULTS,  # kimi_linear's KimiDeltaAttention, bailing_moe_v3's BailingKDA
    **DSA_FAULTS,  # deepseek_v32's (and glm_moe_dsa's) Indexer
    **BLOCK_SPARSE_FAULTS,  # minimax_m3_vl's Attention (its indexer inline)
    **GEMMA4_FAULTS,  # gemma4_text's (its MoE block regrouped: models.gemma4.mlx_regroup)
}
# ... and a common fault's own form on one family's mlx-lm model, where the common form reads a block that model does
# not have: (fault, mlx-lm module) -> transform
FORMS_ON = {**{(name, "gemma4_text"): form for name, form in ON_GEMMA4.items()}}


# transforms taking (model, layer index): what they change is also outside the layer (its cache, a donor rope)
MODEL_LEVEL = {"kv_cache_write_off_by_one", "sliding_window_off_by_one", "rope_on_nope_layer"}


# faults of the catalogue with no form on mlx-lm's model, and why (None from MLXBackend.with_fault)
NOT_APPLICABLE = {
    "moe_output_upcast": "a bf16 dtype fault: mlx's CPU gather_mm (the experts) is float32-only, so mlx runs bf16 "
                         "on Apple GPUs only, where no form of it is written yet",
    "logits_cast_to_float": "a bf16 dtype fault: mlx's CPU gather_mm (the experts) is float32-only, so mlx runs "
                            "bf16 on Apple GPUs only, where no form of it is written yet",
    "mamba2_chunk_boundary_off_by_one": "mlx-lm's Mamba2 prefill scans in steps of 256 tokens whatever the config's "
                                        "chunk size (mlx_lm.models.ssm.ssm_attn): the config's chunk boundaries have "
                                        "no place in it",
}


# ... and on one family's mlx-lm model only: (fault, mlx-lm module) -> why
NOT_APPLICABLE_ON = {
    ("router_bias_in_weights", "ernie4_5_moe"): "mlx-lm's ernie4_5_moe has no correction bias (its sanitize() drops "
                                                "it: the known divergence), so there is no bias to misuse",
    ("router_bias_ignored", "ernie4_5_moe"): "mlx-lm's ernie4_5_moe already ignores the correction bias (the known "
                                             "divergence): the fault is the candidate as it is",
    ("router_softmax_after_topk", "jamba"): "mlx-lm's jamba already takes the softmax over the top-k logits (the known "
                                            "divergence): the fault is the candidate as it is",
    ("rope_on_nope_layer", "jamba"): "mlx-lm's jamba attention has no rotary embedding at all (no rope to misapply)",
    ("rope_on_nope_layer", "nemotron_h"): "mlx-lm's nemotron_h attention has no rotary embedding at all (no rope to "
                                          "misapply)",
    ("rope_on_nope_layer", "kimi_linear"): "mlx-lm's kimi_linear latent attention has no rotary embedding at all (no "
                                           "rope to misapply)",
}


def not_applicable(fault, module: str) -> str | None:
    """Why `fault` has no form on the mlx-lm model `module` (None: it has one)."""
    return NOT_APPLICABLE_ON.get((fault.name, module)) or NOT_APPLICABLE.get(fault.name) or (
        None if fault.name in FAULTS else "no form on mlx-lm's model in exporters/mlx/faults.py")


def inject(fault, model, args) -> None:
    """Apply `fault` to the loaded mlx-lm model where models/faults/ expects it (fault.layer(args))."""
    module = type(model).__module__.rsplit(".", 1)[-1]
    why = NOT_APPLICABLE_ON.get((fault.name, module))
    if why:  # refused for this family's mlx-lm model (the selftest lists it as not applicable)
        from oracle.backend import InputError

        raise InputError(f"{fault.name}: {why}")
    i, form = fault.layer(args), FORMS_ON.get((fault.name, module), FAULTS[fault.name])
    if fault.name in MODEL_LEVEL:
        form(model, i)
    elif i is None:
        form(model, args)
    elif fault.kind == "attention":
        form(attention_block(model.layers[i]), args)
    else:
        form(model.layers[i], args)


# ------------------------------------------------------------------ a quantized runtime's faults
# Seeded into the candidate loaded from a shipped directory (--candidate-dir), in one decoder
# layer's experts: the weights in the file are right, the runtime dequantizes them wrongly. The
# implementation rows must fail at that layer's moe; the quantization rows (HF original vs HF on
# the file's weights) cannot see a runtime fault and must not change.
def _experts_quantized(layer) -> list:
    sw = moe_block(layer).switch_mlp
    mods = [getattr(sw, name) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all("scales" in m for m in mods):
        raise ValueError("the layer's experts are not quantized: a quantized runtime fault needs a quantized candidate")
    return mods


def _scale_bias_swap(layer):  # each group's scale read as its bias and its bias as its scale
    for m in _experts_quantized(layer):
        m.scales, m.biases = m.biases, m.scales


def _group_size_doubled(layer):  # each scale and bias applied to two groups: group size read as 2x the file's
    for m in _experts_quantized(layer):
        idx = mx.array([(g // 2) * 2 for g in range(m.scales.shape[-1])])
        m.scales, m.biases = m.scales[..., idx], m.biases[..., idx]


QUANTIZED_FAULTS = {"dequant_scale_bias_swap": _scale_bias_swap, "dequant_group_size_doubled": _group_size_doubled}


# the point inside its block each fault's form here breaks, where it is not the catalogue's
# (models.faults.catalogue.POINTS): these forms edit a projection's weights, so that projection diverges first
POINTS = {
    "gqa_kv_heads_tiled": ("k_proj", "v_proj"),  # k/v projections widened to one head per query head
    "mla_rope_nope_swapped": ("q_proj", "q_b_proj"),  # the q projection's rows rolled by the rope width
    "router_wrong_num_experts": "logits",  # the gate's rows sliced: the logits have fewer experts
}
