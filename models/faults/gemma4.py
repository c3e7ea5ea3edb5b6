"""Port bugs of what Gemma 4 brought (models/gemma4.py): the values as the keys' projection and their gainless norm,
the full layers' proportional RoPE, the router's normed and scaled input, the per-expert scale, the GeGLU's tanh
gelu, the MoE block beside the dense MLP on the stream, the layer scalar and the logits' soft cap."""

from __future__ import annotations

import torch.nn.functional as F

from models.args import FULL, ModelArgs, RopeArgs
from models.faults.fault import Fault, patch
from models.layers.norms import l2_rms


# ------------------------------------------------------------------ attention (the full layers: target "full")
def values_of_the_rotated_keys(attn, a):
    """k = v read as "the values are the keys": v taken from k after its norm and rotation (HF takes the projection)."""
    project = attn.project

    def wrong(x, pos):
        q, k, v, gate = project(x, pos)
        return q, k, (l2_rms(k, attn.eps) if attn.v_norm else k), gate

    patch(attn, "project", wrong)


def v_norm_missing(attn, a):
    attn.v_norm = False


def proportional_rope_as_partial(attn, a):
    """The full layers' proportional RoPE ported as the usual partial rotary: rotate-half within the first quarter of
    the head, its frequencies over that quarter (HF's: over the whole head, the rest of its slots at frequency 0)."""
    from models.layers.rope import Rope

    r = attn.rope
    attn.rope = Rope(attn.hd, RopeArgs(r.theta, partial_rotary_factor=a.rope.partial_rotary_factor))


# ------------------------------------------------------------------ router, MoE block (the last layer's)
def router_input_norm_missing(layer, a):
    """The router on the stream times its scales, without the RMS norm (the norm taken for the experts' own)."""
    gate = layer.mlp.gate
    patch(gate, "normed", lambda x: x * gate.scale * gate.root)


def router_root_size_missing(layer, a):
    """The router's input without its hidden^-0.5 factor (scalar_root_size)."""
    layer.mlp.gate.root = 1.0


def per_expert_scale_missing(layer, a):
    layer.mlp.scaled = False


def experts_exact_gelu(layer, a):
    """The experts' GeGLU with the exact gelu (gelu_pytorch_tanh read as gelu)."""
    patch(layer.mlp.experts, "activation", lambda gate, up: F.gelu(gate) * up)


# ------------------------------------------------------------------ the layer, the head
def moe_fed_the_normed_stream(layer, a):
    """The router and the experts fed pre_feedforward_layernorm's output, the dense MLP's input (HF's: the stream)."""
    def branch(h):
        x = layer.pre_feedforward_layernorm(h)
        return layer.post_feedforward_layernorm(layer.post_feedforward_layernorm_1(layer.dense_mlp(x)) + layer.mlp(x))

    patch(layer, "mlp_branch", branch)


def dense_mlp_dropped(layer, a):
    """The dense MLP beside the MoE block left out (the MoE block alone, as in other MoE layers)."""
    patch(layer, "mlp_branch", lambda h: layer.post_feedforward_layernorm(layer.mlp(h)))


def layer_scalar_missing(layer, a):
    patch(layer, "forward", layer.stream)


def logit_softcap_missing(model, a):
    model.lm_head.softcap = 0.0


def _k_eq_v(a: ModelArgs) -> bool:  # the last attention layer (HF's: always full) has its values from k
    return a.attention.k_eq_v and a.layer_types[-1] == FULL


GEMMA4: tuple[Fault, ...] = (
    Fault("values_of_the_rotated_keys", "attention", "full", "k = v layers: the values taken from the keys after their "
          "norm and rotation (HF: the keys' projection)", values_of_the_rotated_keys, _k_eq_v),
    Fault("v_norm_missing", "attention", "full", "the values' RMS norm (v_norm) left out", v_norm_missing,
          lambda a: a.attention.v_norm),
    Fault("proportional_rope_as_partial", "attention", "full", "proportional RoPE ported as partial rotary (a "
          "quarter of the head rotated with its own frequencies)", proportional_rope_as_partial,
          lambda a: a.rope.kind == "proportional" and a.layer_types[-1] == FULL),
    Fault("router_input_norm_missing", "router", "last", "the router's input not RMS-normed", router_input_norm_missing,
          lambda a: a.router.input_norm),
    Fault("router_root_size_missing", "router", "last", "the router's input without its hidden^-0.5 factor",
          router_root_size_missing, lambda a: a.router.input_norm),
    Fault("per_expert_scale_missing", "moe", "last", "the per-expert scale of the routing weights left out",
          per_expert_scale_missing, lambda a: a.router.per_expert_scale),
    Fault("experts_exact_gelu", "moe", "last", "the experts' GeGLU with the exact gelu (not the tanh approximation)",
          experts_exact_gelu, lambda a: a.experts.activation == "geglu"),
    Fault("moe_fed_the_normed_stream", "layer", "last", "the MoE block beside the dense MLP fed the MLP's normed input "
          "(HF's router and experts read the stream)", moe_fed_the_normed_stream, lambda a: a.moe_beside_mlp),
    Fault("dense_mlp_dropped", "layer", "last", "the dense MLP beside the MoE block left out", dense_mlp_dropped,
          lambda a: a.moe_beside_mlp),
    Fault("layer_scalar_missing", "layer", "last", "the layer's output not multiplied by its layer_scalar",
          layer_scalar_missing, lambda a: a.layer_scalar),
    Fault("logit_softcap_missing", "logits", "model", "the final logits' soft cap (final_logit_softcapping) left out",
          logit_softcap_missing, lambda a: bool(a.multipliers.logit_softcap)),
)

# the point inside its block each breaks (models.faults.catalogue.POINTS)
POINTS = {
    "values_of_the_rotated_keys": "context", "v_norm_missing": "context", "proportional_rope_as_partial": "q_rope",
    # (HF's router returns no logits: its scores come first, models.gemma4.point_view)
    "router_input_norm_missing": "scores", "router_root_size_missing": "scores", "per_expert_scale_missing": "experts",
    "experts_exact_gelu": "experts", "moe_fed_the_normed_stream": ("scores", "mlp.gate", "experts", "mlp"),
    # (the dense MLP's pre-norm, which HF runs, never runs)
    "dense_mlp_dropped": ("pre_feedforward_layernorm", "dense_mlp"), "layer_scalar_missing": "output",
    "logit_softcap_missing": "output",
}
