"""Port bugs of a decoder layer and of the model around the layers: norms (eps, the (1 + w) offset,
LayerNorm), residuals and Granite's multipliers, the final norm, the head's scaling and dtype."""

from __future__ import annotations

import torch.nn.functional as F

from models.faults.fault import patch


def logits_to_float(model, a):
    head = model.lm_head
    fwd = type(head).forward
    patch(head, "forward", lambda x: fwd(head, x).float())


# ------------------------------------------------------------------ layer / model
def input_norm_eps(layer, a):  # (a layer with an MLP alone, Nemotron-H's: its one norm)
    (layer.input_layernorm if hasattr(layer, "input_layernorm") else layer.post_attention_layernorm).eps = \
        a.rms_norm_eps * 1e3


def norm_offset_missing(layer, a):
    layer.post_attention_layernorm.offset = False


def residual_missing(layer, a):
    if hasattr(layer, "attn_hyper_connection"):  # Qwen4-Exp's gated residual: the attention's streams not added back
        hc = layer.attn_hyper_connection
        patch(hc, "forward", lambda streams: (lambda m, s, w: (m, s * 0, w))(*type(hc).forward(hc, streams)))
        return
    if getattr(layer, "hyper", False):  # hyper-connections (models/layers/hyper.py): the attention's streams not added back
        hc = layer.attn_hc
        patch(hc, "mix", lambda post, comb, out, streams: type(hc).mix(hc, post, comb, out, streams * 0))
        return
    if hasattr(layer, "post_attention_residual_scale"):  # ZAYA's scaled residual add: the stream's term dropped
        rs = layer.post_attention_residual_scale
        patch(rs, "forward", lambda h, residual: (h + rs.hidden_states_bias) * rs.hidden_states_scale)
        return
    if not (layer.has_mixer and layer.has_mlp):  # one block (Nemotron-H): its output without the stream
        patch(layer, "forward", lambda x, pos: layer.attn(layer.input_layernorm(x), pos) if layer.has_mixer
              else layer.ffn(layer.post_attention_layernorm(x)))
        return
    if getattr(layer, "parallel", False):  # a parallel block (Cohere): attention + MLP without the stream
        patch(layer, "forward", lambda x, pos: (lambda h: layer.attn(h, pos) + layer.ffn(h))(layer.input_layernorm(x)))
        return
    if layer.placement != "pre":  # post / sandwich norms (models.args.NormArgs.placement)
        patch(layer, "forward", lambda x, pos: (lambda h: h + layer.mlp_branch(h))(layer.attention_branch(x, pos)))
        return
    patch(layer, "forward", lambda x, pos: (lambda h: h + layer.mlp(layer.post_attention_layernorm(h)))(
        layer.attn(layer.input_layernorm(x), pos)))


def post_norm_misplaced(layer, a):
    """The attention's post-norm in the wrong place: "post" (no pre-norms) ported as pre-norm, the norm on
    the block's input instead of its output; "sandwich": the post-norm applied after the residual add,
    to the sum, instead of to the attention's output."""
    post = layer.post_attention_layernorm
    if layer.placement == "post":
        patch(layer, "forward", lambda x, pos: (lambda h: h + layer.mlp_branch(h))(x + layer.attn(post(x), pos)))
    else:
        patch(layer, "forward", lambda x, pos: (lambda h: h + layer.mlp_branch(h))(
            post(x + layer.attn(layer.input_layernorm(x), pos))))


def post_norm_missing(layer, a):
    """The attention's post-norm left out (the attention's output added to the stream as it is)."""
    def forward(x, pos):
        h = x + layer.attn(x if layer.placement == "post" else layer.input_layernorm(x), pos)
        return h + layer.mlp_branch(h)

    patch(layer, "forward", forward)


def final_norm_eps(model, a):
    model.norm.eps = a.rms_norm_eps * 1e3


def layernorm_as_rmsnorm(layer, a):
    norm = layer.input_layernorm
    patch(norm, "forward", lambda x: F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps))


def residual_multiplier_missing(layer, a):
    layer.residual_multiplier = 1.0


def logits_scaling_missing(model, a):
    model.lm_head.logits_scaling = 1.0
