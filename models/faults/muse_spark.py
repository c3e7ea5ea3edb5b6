"""Port bugs of what Muse Spark brought (models/layers/muse.py): the residual gates (left out, or without their
temperature), the centered norms taken as plain w-gain norms, the input-scaled norm normalising first, the experts'
post-norm applied to their weighted sum instead of to each expert, the attention's output norm left out, q without
its qk_scale_factor, the router's logits without output_multiplier."""

from __future__ import annotations

from models.faults.fault import Fault, patch


def _muse(a) -> bool:
    return a.muse is not None


# ------------------------------------------------------------------ the layer (the last)
def residual_gate_missing(layer, a):
    """The attention's residual add ungated (x + branch, HF: alpha * x + beta * branch)."""
    layer.post_attention_residual_gate.on = False


def residual_gate_temperature_missing(layer, a):
    """The residual gates' sigmoid of the raw gate (HF divides it by residual_gate_temperature)."""
    layer.post_attention_residual_gate.temperature = 1.0
    layer.post_feedforward_residual_gate.temperature = 1.0


def centered_norm_not_centered(layer, a):
    """The input norm's gain taken as w (HF's centered norm: 1 + w)."""
    layer.input_layernorm.centered = False


def post_feedforward_norm_normalised_first(layer, a):
    """The input-scaled post-feedforward norm computed as a plain (1 + w) norm: normalised, then scaled."""
    layer.post_feedforward_layernorm.scale_first = False


# ------------------------------------------------------------------ the MoE block, its router (the last layer's)
def expert_norm_after_sum(layer, a):
    """The experts' post-norm applied once to their weighted sum (HF: to each expert's output, before its weight)."""
    ex = layer.mlp.experts

    def forward(x, idx, w):
        y = ex.expert_mlp(x, idx)
        return ex.post_expert_norm((y * w[..., None]).sum(dim=1).to(x.dtype))

    patch(ex, "forward", forward)


def pre_expert_norm_not_centered(layer, a):
    """The norm in the experts' projected space with gain w (HF's: 1 + w)."""
    layer.mlp.pre_expert_norm.centered = False


def router_multiplier_missing(layer, a):
    """The router's logits without output_multiplier."""
    layer.mlp.gate.multiplier = 1.0


# ------------------------------------------------------------------ the attention (the last full one: NoPE)
def attention_output_norm_missing(attn, a):
    attn.o_normed = False


def qk_scale_missing(attn, a):
    """q not multiplied by qk_scale_factor after its norm."""
    attn.q_scale = 1.0


MUSE_SPARK: tuple[Fault, ...] = (
    Fault("residual_gate_missing", "layer", "last", "the attention's residual add ungated (x + branch, HF's "
          "MuseSparkResidualGate: alpha x + beta branch)", residual_gate_missing, _muse),
    Fault("residual_gate_temperature_missing", "layer", "last", "the residual gates' sigmoid without the gate's "
          "temperature (residual_gate_temperature)", residual_gate_temperature_missing, _muse),
    Fault("centered_norm_not_centered", "layer", "last", "the centered input norm's gain w instead of 1 + w",
          centered_norm_not_centered, _muse),
    Fault("input_scaled_norm_normalised_first", "layer", "last", "the input-scaled post-feedforward norm normalising "
          "before its (1 + w) scale (HF: scale, round, then normalise)", post_feedforward_norm_normalised_first, _muse),
    Fault("expert_norm_after_sum", "moe", "last", "the experts' post-norm applied to their weighted sum, not to each "
          "expert's output before its weight", expert_norm_after_sum, _muse),
    Fault("pre_expert_norm_not_centered", "moe", "last", "the norm of the experts' projected input with gain w "
          "instead of 1 + w", pre_expert_norm_not_centered, _muse),
    Fault("router_multiplier_missing", "router", "last", "the router's logits without output_multiplier",
          router_multiplier_missing, lambda a: _muse(a) and a.muse.output_multiplier != 1.0),
    Fault("attention_output_norm_missing", "attention", "full", "the attention's per-head output norm (o_norm) left "
          "out", attention_output_norm_missing, _muse),
    Fault("qk_scale_missing", "attention", "full", "q not multiplied by qk_scale_factor after its weightless norm",
          qk_scale_missing, lambda a: _muse(a) and a.muse.qk_scale != 1.0),
)

# the point inside its block each breaks (models.faults.catalogue.POINTS)
POINTS = {
    "residual_gate_missing": "post_attention_residual_gate",
    "residual_gate_temperature_missing": "post_attention_residual_gate",
    "centered_norm_not_centered": "input_layernorm",
    "input_scaled_norm_normalised_first": "post_feedforward_layernorm",
    "expert_norm_after_sum": "experts", "pre_expert_norm_not_centered": "pre_expert_norm",
    "router_multiplier_missing": "logits", "attention_output_norm_missing": "o_norm", "qk_scale_missing": "context",
}
