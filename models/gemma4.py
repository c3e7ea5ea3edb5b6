"""Gemma 4's MoE configuration (gemma-4-26B-A4B: `enable_moe_block`), its text model: sliding-window layers (head_dim,
default RoPE at theta 1e4) between full layers of their own head width (`global_head_dim`, HF's per_layer_config) and
kv heads (`num_global_key_value_heads`), whose values are the keys' projection (`attention_k_eq_v`: no v_proj), rotated
by "proportional" RoPE (rotate-half over the whole head, its first quarter of frequencies nonzero); per-head q/k RMSNorms
and a gainless v RMSNorm, softmax scale 1; sandwich norms (Gemma's RMSNorm: w * x, the gain in fp32); in every layer a
GeGLU MLP beside an MoE block with its own pre/post norms (models/layers/moe_beside.py), the router reading the stream
RMS-normed times a learned scale and hidden^-0.5, softmax top-k renormalised times a learned per-expert scale; each
layer's output times a learned scalar; embeddings times sqrt(hidden); the logits soft-capped (tanh(x / c) * c);
tied head.

HF's decoder layer calls its router, experts and their norms inline: no one module is the MoE block. The reference is
HF's Gemma4ForCausalLM with those four modules regrouped under one more per layer (`moe`), called where HF's forward
calls them, in the same order, and the router's last step (its weights times per_expert_scale) moved into that block,
the same product (the router's weights are then the routing's: models/layers/moe_beside.py); tests/test_gemma4.py: its
logits equal HF's own class's, bit for bit.

What the MoE release does not use is refused, each named: per-layer embeddings (`hidden_size_per_layer_input`, the
small dense Gemma 4s'), KV sharing across layers (`num_kv_shared_layers`) and its double-wide MLPs, bidirectional
attention (`use_bidirectional_attention` "all"), and Gemma 4 without its MoE block (a dense model)."""

from __future__ import annotations

import functools

from models.args import FULL, SLIDING, SPARSE, AttentionArgs, ExpertArgs, ModelArgs, Multipliers, NormArgs, RopeArgs, \
    RouterArgs
from models.family import Family
from models.mapping import require, strip_prefix, tie_embeddings
from models.mlx_lm import MlxLm, const

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
    num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
    # the release's full layers: twice as wide, fewer kv heads (2 of 16 there), the values the keys' projection
    global_head_dim=32, num_global_key_value_heads=2, attention_k_eq_v=True,
    enable_moe_block=True, num_experts=8, top_k_experts=2,
    hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,  # as the MoE release
    layer_types=[SLIDING, SLIDING, FULL], sliding_window=4,  # the prompts are longer than the window
    rope_parameters={FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
                     SLIDING: {"rope_type": "default", "rope_theta": 10000.0}},
    # the release's cap is 30; the tiny model's logits reach ~3, where a cap of 2 bends them (tanh(1.5) = 0.91)
    final_logit_softcapping=2.0, max_position_embeddings=256, tie_word_embeddings=True,
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def _rope(p: dict, kind: str) -> RopeArgs:
    require(isinstance(p, dict), f"gemma4: rope_parameters has no {kind!r} entry")
    rope_type = p.get("rope_type", "default")
    require(rope_type in ("default", "proportional"), f"gemma4: rope_type {rope_type!r} ({kind}) is not supported "
                                                      "(default and proportional only)")
    require(float(p.get("factor", 1.0)) == 1.0, f"gemma4: rope_parameters.{kind}.factor (proportional RoPE scaled)")
    # (HF's default RoPE ignores a partial_rotary_factor: every dim rotates)
    partial = float(p.get("partial_rotary_factor", 1.0)) if rope_type == "proportional" else 1.0
    return RopeArgs(float(p["rope_theta"]), rope_type, partial_rotary_factor=partial)


def to_args(c) -> ModelArgs:
    require(c.enable_moe_block, "gemma4: enable_moe_block false (a dense Gemma 4: no MoE block to check)")
    require(not c.hidden_size_per_layer_input, "gemma4: per-layer embeddings (hidden_size_per_layer_input "
            f"{c.hidden_size_per_layer_input}) are not implemented (the MoE release has none)")
    require(not c.num_kv_shared_layers, f"gemma4: KV sharing across layers (num_kv_shared_layers "
            f"{c.num_kv_shared_layers}) is not implemented (the MoE release has none)")
    require(c.use_bidirectional_attention != "all", "gemma4: use_bidirectional_attention 'all' (non-causal text)")
    require(c.hidden_activation == "gelu_pytorch_tanh", f"gemma4: hidden_activation {c.hidden_activation!r} "
            "(GeGLU with gelu's tanh approximation only)")
    require(set(c.layer_types) <= {FULL, SLIDING}, f"gemma4: unknown layer_types {sorted(set(c.layer_types))}")
    rp = c.rope_parameters or {}
    kinds = set(c.layer_types)
    full = _rope(rp.get(FULL), FULL) if FULL in kinds else None
    sliding = _rope(rp.get(SLIDING), SLIDING) if SLIDING in kinds else None
    rope = sliding if full is None else full if sliding is None else RopeArgs(
        full.theta, full.kind, partial_rotary_factor=full.partial_rotary_factor, sliding=sliding)
    layers = [c.per_layer_config[i] for i in range(c.num_hidden_layers)]  # (HF: the full layers' head_dim, kv heads)
    L = c.num_hidden_layers
    # the model's own head width and kv heads: the sliding layers' (HF's config refuses a global read of either)
    model = layers[c.layer_types.index(SLIDING)] if SLIDING in kinds else layers[0]
    return ModelArgs(
        family="gemma4", vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=L,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        rms_norm_eps=c.rms_norm_eps, num_experts=c.num_experts, num_experts_per_tok=c.top_k_experts,
        moe_intermediate_size=c.moe_intermediate_size, layer_types=tuple(c.layer_types), rope=rope,
        tie_word_embeddings=c.tie_word_embeddings, mlp_types=(SPARSE,) * L, intermediate_size=c.intermediate_size,
        mlp_activation="geglu", moe_beside_mlp=True, layer_scalar=True,
        layer_head_dim=tuple(p.head_dim for p in layers), layer_kv_heads=tuple(p.num_key_value_heads for p in layers),
        attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                                sliding_window=c.sliding_window, k_eq_v=bool(c.attention_k_eq_v), v_norm=True),
        router=RouterArgs(norm_topk_prob=True, input_norm=True, per_expert_scale=True, weights_in_model_dtype=False),
        experts=ExpertArgs("geglu"), norm=NormArgs(gain_fp32=True, placement="sandwich"),
        multipliers=Multipliers(embedding=c.hidden_size**0.5, attention=1.0,
                                logit_softcap=float(c.final_logit_softcapping or 0.0)),
    )


# HF's names inside a decoder layer -> the production model's: the MoE block's modules under `mlp` (the production
# sparse block, models/layers/moe_beside.py), the dense MLP beside it as `dense_mlp`
_NAMES = {"router.proj.weight": "mlp.gate.weight", "router.scale": "mlp.gate.scale",
          "router.per_expert_scale": "mlp.gate.per_expert_scale", "experts.": "mlp.experts.",
          "pre_feedforward_layernorm_2.": "mlp.pre_feedforward_layernorm_2.",
          "post_feedforward_layernorm_2.": "mlp.post_feedforward_layernorm_2.", "mlp.": "dense_mlp."}


def _renamed(name: str) -> str:
    if not name.startswith("layers."):
        return name
    _, layer, inner = name.split(".", 2)
    old = next((o for o in _NAMES if inner.startswith(o)), None)
    return name if old is None else f"layers.{layer}.{_NAMES[old]}{inner[len(old):]}"


def sanitize(weights: dict, args: ModelArgs) -> dict:
    return tie_embeddings({_renamed(k): t for k, t in strip_prefix(weights).items()}, args)


@functools.cache
def reference():
    """HF's Gemma4ForCausalLM whose sparse layers hold their MoE block as one module (`moe`: the router on the stream,
    the experts on it normed by pre_feedforward_layernorm_2, their output normed by post_feedforward_layernorm_2),
    called where HF's layer forward calls those modules. `moe` is not registered in the layer (the state dict, and the
    checkpoint HF writes, are HF's); the modules it holds are the layer's own."""
    import torch
    from torch import nn
    from transformers.models.gemma4 import modeling_gemma4 as g

    class MoEBlock(nn.Module):
        def __init__(self, layer):
            super().__init__()
            # the layer's own modules, under names of their own for the drill (hf_point_names: the production block's)
            self.block_router, self.block_experts = layer.router, layer.experts
            self.block_pre_norm, self.block_post_norm = layer.pre_feedforward_layernorm_2, layer.post_feedforward_layernorm_2

        def forward(self, hidden_states):
            flat = hidden_states.reshape(-1, hidden_states.shape[-1])
            _, top_k_weights, top_k_index = self.block_router(flat)
            top_k_weights = top_k_weights * self.block_router.per_expert_scale[top_k_index]  # (HF: the router's)
            h = self.block_pre_norm(flat)
            h = self.block_experts(h, top_k_index, top_k_weights)
            return self.block_post_norm(h.reshape(hidden_states.shape))

    def layer_forward(self, hidden_states, per_layer_input=None, shared_kv_states=None, position_embeddings=None,
                      attention_mask=None, position_ids=None, past_key_values=None, **kwargs):
        # HF 5.23's Gemma4TextDecoderLayer.forward (per-layer inputs refused: models.gemma4.to_args), the MoE block's
        # four calls as one
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, shared_kv_states=shared_kv_states,
                                          position_ids=position_ids, past_key_values=past_key_values, **kwargs)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm_1(hidden_states) + self.moe(residual)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        hidden_states *= self.layer_scalar
        return hidden_states

    def router_forward(self, hidden_states):
        # HF 5.23's Gemma4TextRouter.forward without its last step, the weights times per_expert_scale (MoEBlock's)
        hidden_states = self.norm(hidden_states)
        hidden_states = hidden_states * self.scale * self.scalar_root_size
        expert_scores = self.proj(hidden_states)
        router_probabilities = nn.functional.softmax(expert_scores, dim=-1, dtype=torch.float32)
        top_k_weights, top_k_index = torch.topk(router_probabilities, k=self.config.top_k_experts, dim=-1)
        top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
        return router_probabilities, top_k_weights, top_k_index

    class Gemma4ForCausalLM(g.Gemma4ForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                if layer.enable_moe_block and not layer.hidden_size_per_layer_input:
                    layer.__dict__["moe"] = MoEBlock(layer)
                    layer.forward = layer_forward.__get__(layer)
                    layer.router.forward = router_forward.__get__(layer.router)

    Gemma4ForCausalLM.__module__ = g.__name__  # (its architectures entry and class are HF's)
    Gemma4ForCausalLM.__qualname__ = "Gemma4ForCausalLM"
    return Gemma4ForCausalLM


def mlx_regroup(model) -> None:
    """mlx-lm's gemma4_text model with each MoE layer's router, experts and their norms regrouped as one module (the
    block the harness checks, as reference() regroups HF's): held outside mlx's module tree (`oracle_moe`: the model's
    parameters are mlx-lm's) and called where mlx-lm's layer calls those modules, in the same order."""
    import mlx.nn as nn

    class Gemma4MoEBlock(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.router, self.experts = layer.router, layer.experts
            self.pre_feedforward_layernorm_2 = layer.pre_feedforward_layernorm_2
            self.post_feedforward_layernorm_2 = layer.post_feedforward_layernorm_2

        def __call__(self, x):
            top_k_indices, top_k_weights = self.router(x)
            h = self.experts(self.pre_feedforward_layernorm_2(x), top_k_indices, top_k_weights)
            return self.post_feedforward_layernorm_2(h)

    def call(self, x, mask=None, cache=None, per_layer_input=None, shared_kv=None, offset=None):
        # mlx-lm 0.32.2's gemma4_text DecoderLayer.__call__ (per-layer inputs refused: to_args), the MoE block's four
        # calls as one
        residual = x
        h, shared_kv, offset = self.self_attn(self.input_layernorm(x), mask, cache, shared_kv=shared_kv, offset=offset)
        h = residual + self.post_attention_layernorm(h)
        residual = h
        h1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
        h = residual + self.post_feedforward_layernorm(h1 + self.oracle_moe(h))
        return h * self.layer_scalar, shared_kv, offset

    for layer in model.layers:
        if layer.enable_moe and "oracle_moe" not in layer.__dict__:
            object.__setattr__(layer, "oracle_moe", Gemma4MoEBlock(layer))
            cls = type(layer)  # this instance's __call__ overridden, its class's name and module kept (as
            # exporters.mlx.model.patch_call does: the harness finds mlx-lm's classes by them)
            layer.__class__ = type(cls.__name__, (cls,), {"__call__": call, "__module__": cls.__module__})


def from_mlx(weights: dict, config: dict) -> dict:
    """mlx-lm's names -> HF's: its experts' SwitchGLU (`experts.switch_glu.{gate,up,down}_proj.weight`, [E, out, in])
    back to HF's fused experts.gate_up_proj [E, 2I, H] (gate rows, then up: mlx-lm's sanitize splits them so) and
    experts.down_proj [E, H, I]."""
    import torch

    out = {}
    for k, v in weights.items():
        if k.endswith(".experts.switch_glu.gate_proj.weight"):
            p = k[: -len("switch_glu.gate_proj.weight")]
            out[p + "gate_up_proj"] = torch.cat([v, weights[p + "switch_glu.up_proj.weight"]], dim=1)
        elif k.endswith(".experts.switch_glu.down_proj.weight"):
            out[k[: -len("switch_glu.down_proj.weight")] + "down_proj"] = v
        elif not k.endswith(".experts.switch_glu.up_proj.weight"):
            out[k] = v
    return out


def _mlx_rope_parameters(c) -> dict:
    return {t: dict(p) for t, p in (c.rope_parameters or {}).items() if isinstance(p, dict)}


MLX = MlxLm(
    module="gemma4_text",
    config=dict(
        model_type=const("gemma4_text"), hidden_size="hidden_size", num_hidden_layers="num_hidden_layers",
        intermediate_size="intermediate_size", num_attention_heads="num_attention_heads",
        head_dim=lambda c: c.per_layer_config[c.layer_types.index(SLIDING)].head_dim if SLIDING in c.layer_types
        else c.per_layer_config[0].head_dim,
        global_head_dim=lambda c: c.per_layer_config[c.layer_types.index(FULL)].head_dim if FULL in c.layer_types
        else None,
        global_partial_rotary_factor=lambda c: float((c.rope_parameters or {}).get(FULL, {}).get("partial_rotary_factor",
                                                                                                1.0)),
        rms_norm_eps="rms_norm_eps", vocab_size="vocab_size", vocab_size_per_layer_input="vocab_size_per_layer_input",
        num_key_value_heads=lambda c: c.per_layer_config[c.layer_types.index(SLIDING)].num_key_value_heads
        if SLIDING in c.layer_types else c.per_layer_config[0].num_key_value_heads,
        num_global_key_value_heads=lambda c: c.per_layer_config[c.layer_types.index(FULL)].num_key_value_heads
        if FULL in c.layer_types and c.attention_k_eq_v else None,
        num_kv_shared_layers="num_kv_shared_layers", pad_token_id="pad_token_id",
        hidden_size_per_layer_input="hidden_size_per_layer_input", rope_traditional=const(False),
        partial_rotary_factor=const(1.0), rope_parameters=_mlx_rope_parameters, sliding_window="sliding_window",
        sliding_window_pattern=const(6),  # (unread: layer_types given)
        max_position_embeddings="max_position_embeddings", attention_k_eq_v="attention_k_eq_v",
        final_logit_softcapping="final_logit_softcapping", use_double_wide_mlp="use_double_wide_mlp",
        enable_moe_block="enable_moe_block", num_experts="num_experts", top_k_experts="top_k_experts",
        moe_intermediate_size="moe_intermediate_size", layer_types=lambda c: list(c.layer_types),
        tie_word_embeddings="tie_word_embeddings",
    ),
    require=(
        (lambda c: not c.attention_bias, "attention_bias (mlx-lm's gemma4_text has no attention biases)"),
        (lambda c: c.hidden_activation == "gelu_pytorch_tanh", "hidden_activation other than gelu_pytorch_tanh "
         "(mlx-lm's gemma4_text is GeGLU with gelu's tanh approximation)"),
    ),
    regroup=mlx_regroup,
)


def point_view(points, args: ModelArgs, layer=None):
    """The drill's points of HF's model without its router's `logits`: HF's router returns no logits, the
    log-probabilities that stand for them (router_output) differ from the production router's logits by a shift per
    token (its scores, choice and weights are compared)."""
    import copy

    out = copy.copy(points)  # (a Points keeps its registered paths and taps)
    out.pop("logits", None)
    return out


FAMILY = Family(
    name="gemma4", model_types=("gemma4_text", "gemma4"), hf_module="gemma4", hf_class_name="Gemma4ForCausalLM",
    hf_config_name="Gemma4TextConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize,
    hf_router="router", hf_moe="moe", hf_mlp="mlp", hf_reference=reference, hf_point_view=point_view, mlx=MLX,
    from_mlx=from_mlx,
    # the drill's names: HF's decoder layer's (its dense MLP, and the MoE block's modules, which the production layer
    # holds under `mlp`) and the regrouped MoE block's own (reference())
    hf_point_names={"mlp": "dense_mlp", "router": "mlp.gate", "experts": "mlp.experts",
                    "pre_feedforward_layernorm_2": "mlp.pre_feedforward_layernorm_2",
                    "post_feedforward_layernorm_2": "mlp.post_feedforward_layernorm_2",
                    "block_router": "gate", "block_experts": "experts", "block_pre_norm": "pre_feedforward_layernorm_2",
                    "block_post_norm": "post_feedforward_layernorm_2"},
    # HF's router returns the softmax probabilities where the harness reads logits: their log has the same softmax
    router_output=lambda out, a: (out[0].clamp_min(1e-38).log(), out[1], out[2]),
    experts="num_experts", top_k="top_k_experts",
    tiny_std={"layer_scalar": (1.0, 0.2), "router.scale": (1.0, 0.2), "per_expert_scale": (1.0, 0.2)},
    rules=(("positive", "intermediate_size", "moe_intermediate_size", "sliding_window", "global_head_dim"),),
)
