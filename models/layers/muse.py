"""Muse Spark's text model mechanisms (ModelArgs.muse, models/muse_args.py), as HF 5.23's MuseSparkText* compute them:

    layer:  h = gate_a(x, post_attention_layernorm(self_attn(input_layernorm(x))))
            y = gate_f(h, post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h))))
    gate(r, b) = alpha * r + beta * b,  beta = sigmoid(g / T), alpha = sqrt(max(sigmoid(-g / T) * (1 + beta), eps))

input_layernorm and pre_feedforward_layernorm are centered ((1 + w), RMSNorm(offset)), post_attention_layernorm is
weightless (post_norm_eps), post_feedforward_layernorm input-scaled (x * (1 + w) first, then normalised). The
attention: q and k weightless-normed per head (q then times qk_scale), rotated on the rope layers (the full layers NoPE),
the output weightless-normed per head, times sigmoid(gate_proj(x)) per channel, o_proj. The MoE: a sigmoid router on
fp32 logits times output_multiplier (+ correction bias for the choice, renormalised with eps 1e-15, scaled); the
experts run at moe_hidden_size: pre_expert_proj, a centered norm, SwiGLU experts each normed (input-scaled,
post_norm_eps) before its weight, post_expert_proj. The embeddings are weightless-normed (rms_norm_eps)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from models.args import SPARSE, ModelArgs, mlp_type
from models.layers.attention import Attention
from models.layers.experts import Experts
from models.layers.moe import SparseMoE
from models.layers.norms import RMSNorm
from models.layers.router import Router
from models.layers.taps import tap


def weightless(x, eps):
    """HF's MuseSparkRMSNorm without a scale: x * (mean(x^2) + eps)^-0.5 in fp32 (torch.pow, as HF)."""
    xf = x.float()
    return (xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)).type_as(x)


class WeightlessNorm(nn.Module):
    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return weightless(x, self.eps)


class CenteredNorm(RMSNorm):
    """MuseSparkTextCenteredRMSNorm: normalised in fp32, times (1 + w) computed in w's dtype (rounded there, as HF's)."""

    def __init__(self, dim: int, eps: float):
        super().__init__(dim, eps, offset=True)
        self.centered = True  # read at every call: a seeded fault takes the gain as w (models/faults/muse_spark.py)

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * ((1.0 + self.weight) if self.centered else self.weight).float()).type_as(x)


class InputScaledNorm(nn.Module):
    """MuseSparkTextInputScaledRMSNorm: x * (1 + w) (rounded to x's dtype), then normalised."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps
        self.scale_first = True  # read at every call: a seeded fault normalises first (models/faults/muse_spark.py)

    def forward(self, x):
        if not self.scale_first:
            xf = x.float()
            return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight).float()).type_as(x)
        y = (x.float() * (1.0 + self.weight).float()).type_as(x).float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


class ResidualGate(nn.Module):
    """MuseSparkResidualGate: alpha * residual + beta * branch (alpha, beta from the learned gate, fp32)."""

    def __init__(self, dim: int, temperature: float, eps: float):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(dim))
        self.temperature, self.eps = temperature, eps
        self.on = True  # read at every call: a seeded fault adds the branch ungated (models/faults/muse_spark.py)

    def forward(self, residual, h):
        if not self.on:
            return residual + h
        w = self.gate / self.temperature
        beta = torch.sigmoid(w)
        alpha = torch.sqrt(torch.clamp(torch.sigmoid(-w) * (1.0 + beta), min=self.eps))
        return (alpha * residual + beta * h).to(residual.dtype)


class MuseAttention(Attention):
    """GQA with weightless per-head q/k norms before the rotation (q times qk_scale), the output weightless-normed per
    head and gated per channel by sigmoid(g_proj(x)) (HF's gate_proj) before o_proj."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        self.q_scale = a.muse.qk_scale
        self.o_norm = WeightlessNorm(a.rms_norm_eps)  # (HF's module name: a point of the drill)
        self.o_normed = True  # read at every call: a seeded fault leaves the output norm out (models/faults/muse_spark.py)

    def forward(self, x, pos):
        q, k, v, _ = self.project(x, pos)
        kc, vc = self.update_cache(k, v, pos)
        y = self.attend(q, kc, vc, self.mask(pos))  # [B, T, nh * vd]
        if self.o_normed:
            B, T, _ = y.shape
            y = self.o_norm(y.view(B, T, self.nh, self.vd)).view(B, T, -1)
        return self.o_proj(self.projected_gate(x, y))

    def project(self, x, pos):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kvh, self.vd).transpose(1, 2)
        q, k = weightless(q, self.eps) * self.q_scale, weightless(k, self.eps)
        if self.use_rope:
            q = tap("q_rope", self.rope(q, pos), self.rope.hf_layout)
            k = tap("k_rope", self.rope(k, pos), self.rope.hf_layout)
        return q, k, v, None


class MuseRouter(Router):
    """The sigmoid router on fp32 logits times output_multiplier (HF's MuseSparkTopkRouter)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        self.multiplier = a.muse.output_multiplier

    def forward(self, x):  # x [N, H] -> weights [N, k], indices [N, k]
        logits = F.linear(x.float(), self.weight.float()) * self.multiplier
        return self.route(tap("logits", logits))


class MuseExperts(Experts):
    """SwiGLU experts at moe_hidden_size, each expert's output input-scaled-RMS-normed before its weight."""

    def __init__(self, a: ModelArgs):
        super().__init__(replace(a, hidden_size=a.muse.moe_hidden_size))
        self.post_expert_norm = InputScaledNorm(a.muse.moe_hidden_size, a.muse.post_norm_eps)

    def forward(self, x, idx, w):  # x [N, D], idx/w [N, k]
        y = self.post_expert_norm(self.expert_mlp(x, idx))  # [N, k, D]
        return (y * w[..., None]).sum(dim=1).to(x.dtype)


class MuseMoE(SparseMoE):
    """MuseSparkMoE: routed on the hidden state; the experts on pre_expert_norm(pre_expert_proj(x)), back through
    post_expert_proj. A SparseMoE (its router at `gate`, what the backends record a selection from) with modules of
    its own: no shared expert."""

    def __init__(self, a: ModelArgs):
        nn.Module.__init__(self)
        D = a.muse.moe_hidden_size
        self.gate = MuseRouter(a)
        self.pre_expert_proj = nn.Linear(a.hidden_size, D, bias=False)
        self.pre_expert_norm = CenteredNorm(D, a.rms_norm_eps)
        self.experts = MuseExperts(a)
        self.post_expert_proj = nn.Linear(D, a.hidden_size, bias=False)

    def forward(self, x):  # [B, T, H]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x)
        y = self.experts(self.pre_expert_norm(self.pre_expert_proj(x)), idx, w)
        return self.post_expert_proj(y).view(shape)


def muse_layer(layer: nn.Module, a: ModelArgs, i: int, dtype) -> None:
    """Make a sandwich-norm decoder layer (models.layers.transformer.DecoderLayer) Muse Spark's: its attention, MoE,
    norms and the two residual gates (DecoderLayer.stream reads them)."""
    m = a.muse
    layer.self_attn = MuseAttention(a, dtype, i)
    if mlp_type(a, i) == SPARSE:
        layer.mlp = MuseMoE(a)
    layer.input_layernorm = CenteredNorm(a.hidden_size, a.rms_norm_eps)
    layer.post_attention_layernorm = WeightlessNorm(m.post_norm_eps)
    layer.pre_feedforward_layernorm = CenteredNorm(a.hidden_size, a.rms_norm_eps)
    layer.post_feedforward_layernorm = InputScaledNorm(a.hidden_size, m.post_norm_eps)
    layer.post_attention_residual_gate = ResidualGate(a.hidden_size, m.gate_temperature, m.gate_eps)
    layer.post_feedforward_residual_gate = ResidualGate(a.hidden_size, m.gate_temperature, m.gate_eps)
