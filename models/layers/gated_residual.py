"""Qwen4-Exp's gated residual (HF's Qwen4ExpTextGatedResidual): hyper-connections whose streams are kept flat,
[B, T, N * H] (N = GatedResidualArgs.streams; the embedding repeated N times), and the decoder layer built on them.

Before each block (the mixer, the MoE) its `*_hyper_connection` mixes the streams into the block's input: x_n =
RMSNorm of each stream (one (1 + w) gain over the N * H features, the norm per stream), w = sigmoid(up(silu(down(x_n) /
N))) [N * H], the input the mean over the streams of w * x_n; the block's output y [H] is added to stream s times
2 sigmoid(inject(x_n)_s / N). The model's last mix (no injection) gives the final hidden state: the production model's
`norm`. A layer with per-layer embeddings (models/layers/ple.py) adds them to the streams first, inside the layer as
HF's does, from the call's token ids the model (or a block's caller) wrote into their `call_tokens` (feed_tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.norms import RMSNorm


class GroupedRMSNorm(RMSNorm):
    """HF's Qwen4ExpTextRMSNorm with a group size: (1 + w) over dim features, each group of `group` normed alone."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__(dim, eps, offset=True)
        self.group = group

    def forward(self, x):
        xf = x.float().unflatten(-1, (-1, self.group))
        xf = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (xf * (1.0 + self.weight.float()) if self.offset else xf * self.weight.float()).type_as(x)


class GatedResidual(nn.Module):
    """streams [B, T, N * H] -> the block's input [B, T, H] (combine=False: the final mix), or with combine=True
    (block input, streams, injection weights [B, T, N])."""

    def __init__(self, a: ModelArgs, combine: bool = True):
        super().__init__()
        g = a.gated_residual
        self.n, self.h = g.streams, a.hidden_size
        self.hc_norm = GroupedRMSNorm(self.n * self.h, self.h, a.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(self.n * self.h, g.lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(g.lowrank, self.n * self.h, bias=False)
        if combine:
            self.block_inject_weight = nn.Linear(self.n * self.h, self.n, bias=False)

    @property
    def eps(self):  # (its norm's: what a final norm's eps is)
        return self.hc_norm.eps

    @eps.setter
    def eps(self, value):
        self.hc_norm.eps = value

    def forward(self, streams):
        normed = self.hc_norm(streams)
        w = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(normed) / self.n)))
        mixed = self.mix(w.unflatten(-1, (self.n, self.h)), normed.unflatten(-1, (self.n, self.h)))
        if not hasattr(self, "block_inject_weight"):
            return mixed
        return mixed, streams, self.inject(normed)

    def mix(self, w, normed):  # [B, T, N, H] each -> [B, T, H]
        return (w * normed).mean(dim=-2)

    def inject(self, normed):  # [B, T, N]
        return 2 * torch.sigmoid(self.block_inject_weight(normed) / self.n)


def injected(streams, y, weights):
    """streams + the block's output y [B, T, H] into each stream s times weights[..., s]."""
    return streams + (y.unsqueeze(-2) * weights.unsqueeze(-1)).flatten(-2)


def gated_layer(layer: nn.Module, a: ModelArgs) -> None:
    """A decoder layer on gated residuals: its two hyper-connections in place of its norms (their norms seen under the
    norms' names, not registered there: the state dict is HF's)."""
    for name in ("input_layernorm", "post_attention_layernorm"):
        if hasattr(layer, name):
            delattr(layer, name)
    layer.attn_hyper_connection = GatedResidual(a)
    layer.mlp_hyper_connection = GatedResidual(a)
    layer.__dict__["input_layernorm"] = layer.attn_hyper_connection.hc_norm
    layer.__dict__["post_attention_layernorm"] = layer.mlp_hyper_connection.hc_norm


def gated_stream(layer: nn.Module, streams, pos):
    """The layer's streams after its per-layer embeddings (models/layers/ple.py: the call's token ids from
    call_tokens), its mixer and its MoE block, each block between a mix and an injection."""
    if hasattr(layer, "ple"):
        streams = streams + layer.ple(streams, None, pos)
    x, streams, w = layer.attn_hyper_connection(streams)
    streams = injected(streams, layer.attn(x, pos), w)
    x, streams, w = layer.mlp_hyper_connection(streams)
    return injected(streams, layer.ffn(x), w)


def gated_forward(model: nn.Module, tokens, pos):
    """The production model's forward on gated residuals: the embedding repeated into N streams, the layers (a layer's
    per-layer embeddings read the token ids the model wrote: feed_tokens), the final mix (`norm`) and the head."""
    x = model.embed_tokens(tokens).repeat(1, 1, model.args.gated_residual.streams)
    for layer in model.layers:
        x = layer(x, pos)
    return model.lm_head(model.norm(x))
