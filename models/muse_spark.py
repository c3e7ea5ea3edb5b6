"""Muse Spark (muse_spark, Meta): the text tower of MuseSparkForConditionalGeneration on text input. Sliding-window
layers with RoPE and NoPE full layers (3:1, the last layer full: layer_rope_theta 0), weightless per-head q/k norms
(q times qk_scale_factor), the attention's output weightless-normed per head and gated per channel by
sigmoid(gate_proj(x)); sandwich norms (centered (1 + w) input and pre-feedforward norms, a weightless post-attention
norm, an input-scaled post-feedforward norm) and a learned gate on each residual add (MuseSparkResidualGate); a
sigmoid + correction-bias router on fp32 logits times output_multiplier, renormalised (eps 1e-15) and scaled; the
experts in a projected space (pre_expert_proj to moe_hidden_size, a centered norm, SwiGLU experts each input-scale
normed, post_expert_proj); weightless-normed embeddings; the logits times output_multiplier, then soft-capped.
The mechanisms: models/layers/muse.py (ModelArgs.muse).

The reference is HF's MuseSparkTextModel with the release's lm_head (models.text_tower) and the head's multiplier and
soft cap of MuseSparkForConditionalGeneration.forward (`reference`). The tiny checkpoint is written in the release's
layout: config.json the composite muse_spark one (text_config nested, the audio tower's out_hidden_size the text
hidden size as HF's config requires), the language model at model.language_model.*, no vision or audio tower."""

from __future__ import annotations

import functools

from models.args import (DENSE, FULL, SLIDING, SPARSE, AttentionArgs, ModelArgs, Multipliers, MuseArgs, NormArgs,
                         RopeArgs, RouterArgs)
from models.family import Family
from models.mapping import hf_args, require, rope_theta, sanitize_hf
from models.mlx_lm import MlxLm
from models.text_tower import TextTower, causal_lm

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
    # the experts' own width differs from the hidden size (a projection left out cannot go unnoticed)
    moe_hidden_size=48,
    # the release's pattern: three sliding-window layers (the window shorter than the prompts), then a NoPE full one
    sliding_window=4, layer_types=[SLIDING, SLIDING, SLIDING, FULL], layer_rope_theta=[10000.0, 10000.0, 10000.0, 0],
    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # scaled for the tiny weights: the cap (the release's 20 over logits of a wider model) bites the tiny logits, the
    # multiplier (the release's 1/sqrt(hidden / 256)) is not 1, the q scale keeps the attention from one-hot
    final_logit_softcapping=1.5, output_multiplier=2.0, qk_scale_factor=2.0, routed_scaling_factor=2.5,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


class MuseTower(TextTower):
    def composite_json(self, hf_module: str, text: dict) -> dict:
        """The release's composite config.json: HF's MuseSparkConfig requires the audio tower's output width to be the
        text hidden size (it is scattered onto the embeddings); the tiny one's is."""
        from transformers.models.muse_spark import MuseSparkConfig

        cfg = MuseSparkConfig(text_config=dict(text), audio_config={"out_hidden_size": text["hidden_size"]},
                              tie_word_embeddings=text.get("tie_word_embeddings", False)).to_dict()
        cfg["architectures"] = [self.architecture]
        return cfg


TOWER = MuseTower(model="MuseSparkTextModel", composite="muse_spark", architecture="MuseSparkForConditionalGeneration",
                  composite_config="MuseSparkConfig")


@functools.cache
def reference():
    """The text tower's CausalLM (models.text_tower) with MuseSparkForConditionalGeneration's head: the logits times
    output_multiplier, divided by the cap, tanh, times the cap (HF's order)."""
    import torch

    base = causal_lm("muse_spark", TOWER)

    class Capped(base):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            c = self.config
            logits = out.logits * c.output_multiplier
            logits = logits / c.final_logit_softcapping
            out.logits = torch.tanh(logits) * c.final_logit_softcapping
            return out

    Capped.__name__ = Capped.__qualname__ = base.__name__
    return Capped


def to_args(c) -> ModelArgs:
    require(c.hidden_act == "silu", f"muse_spark: hidden_act {c.hidden_act!r} (the experts are SwiGLU)")
    require(not c.attention_bias, "muse_spark: attention_bias (the release has none)")
    require(set(c.layer_types) <= {FULL, SLIDING}, f"muse_spark: unknown layer_types {sorted(set(c.layer_types))}")
    require(set(c.mlp_layer_types) <= {SPARSE, DENSE}, f"muse_spark: mlp_layer_types {sorted(set(c.mlp_layer_types))}")
    # HF's MuseSparkTextModel: a layer whose layer_rope_theta is 0 gets no rotation; the others the model's one rope
    # (its value of layer_rope_theta is not read)
    rotates = tuple(int(bool(t)) for t in c.layer_rope_theta)
    return hf_args(
        c, "muse_spark", layer_types=tuple(c.layer_types),
        rope=RopeArgs(rope_theta(c), per_layer=() if all(rotates) else rotates),
        attention=AttentionArgs(gate_act="sigmoid", gate_width="element", sliding_window=c.sliding_window),
        mlp_types=tuple(c.mlp_layer_types), intermediate_size=c.intermediate_size, num_experts=c.num_local_experts,
        moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(scoring="sigmoid", correction_bias=True, norm_topk_prob=True, norm_eps=1e-15,
                          routed_scaling_factor=c.routed_scaling_factor, fp32=True,
                          fp32_params=("weight", "e_score_correction_bias")),
        norm=NormArgs(gain_fp32=True, placement="sandwich"),
        multipliers=Multipliers(logits_scaling=1.0 / c.output_multiplier, logit_softcap=c.final_logit_softcapping),
        muse=MuseArgs(qk_scale=c.qk_scale_factor, post_norm_eps=c.post_norm_eps,
                      gate_temperature=c.residual_gate_temperature, moe_hidden_size=c.moe_hidden_size,
                      output_multiplier=c.output_multiplier),
    )


def release_names(weights: dict) -> dict:
    """The release's model.language_model.* as model.*, without the vision and audio towers."""
    return {k.replace("model.language_model.", "model.", 1): t for k, t in weights.items()
            if not k.startswith(("model.vision", "model.audio", "vision", "audio"))}


def sanitize(weights: dict, args: ModelArgs) -> dict:
    # the attention's output gate: HF's gate_proj is the production attention's g_proj (AttentionArgs.gate_act)
    w = {k.replace(".self_attn.gate_proj.", ".self_attn.g_proj."): t for k, t in release_names(weights).items()}
    return sanitize_hf(w, args)


# mlx-lm 0.32.2's muse_spark computes its norms, residual gates, routing and expert combine only through Metal kernels
# (mlx_lm.kernels: norm_add_norm, pre_norm, qk_norm_rope, rms_norm_sigmoid_gate, expert_routing,
# post_expert_norm_combine, each an mx.fast.metal_kernel with no other path): mlx's CPU backend refuses them
# ("[metal_kernel] No Metal back-end", measured on this host); it also refuses dense layers (mlp_layer_types)
MLX = MlxLm(module="muse_spark", config={}, require=(
    (lambda c: False, "Muse Spark's architecture, whose mlx-lm 0.32.2 model (muse_spark) runs its norms, gates and "
                      "routing as Metal kernels only (mx.fast.metal_kernel: '[metal_kernel] No Metal back-end' on "
                      "mlx's CPU backend)"),
))

FAMILY = Family(
    name="muse_spark", model_types=("muse_spark", "muse_spark_text"), hf_module="muse_spark",
    hf_class_name="MuseSparkTextModel", hf_config_name="MuseSparkTextConfig", tiny_config=TINY,
    to_args=to_args, sanitize=sanitize, text_tower=TOWER, hf_reference=reference, experts="num_local_experts",
    mlx=MLX,
)
