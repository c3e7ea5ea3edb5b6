"""Hyper-connections (ModelArgs.hyper, models/hyper_args.py): the residual stream is N streams [B, T, N, H]
between the decoder layers. Around each block (the attention, the MLP) a HyperConnection computes from the
streams a collapse ("pre": the block's input, one stream [B, T, H]) and an expansion ("post": how the block's
output goes back onto each stream); DeepSeek-V4's manifold-constrained form (mHC, GLM-5.3's too) also mixes the
streams with a doubly-stochastic matrix ("comb", Sinkhorn-Knopp), HY-V4's independent form (iHC) adds them back
unmixed, in fp32. The embedding is copied onto the N streams; a HyperHead collapses them before the final norm.

Parameter names are HF's: layers.{i}.attn_hc.{fn,base,scale}, layers.{i}.ffn_hc.*, hc_head.{hc_fn,hc_base,hc_scale}.
A block's own input and output are HF's (the normed collapse; the block's output before the expansion): the
block rows of the oracle see what HF's hooks see. The decoder layer's input and output are the streams; fed
[B, T*N, H] (the oracle's rows), the layer reads them as [B, T, N, H]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.hyper_args import HyperArgs


def _inv_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """One block's hyper-connection: forward(streams [B, T, N, H]) -> (post [B, T, N], comb [B, T, N, N] or None,
    the block's input [B, T, H]); mix(post, comb, block output [B, T, H], streams) -> the new streams."""

    def __init__(self, h: HyperArgs, hidden: int):
        super().__init__()
        self.h, n = h, h.streams
        width = (2 + n) * n if h.form == "mhc" else 2 * n
        self.fn = nn.Parameter(torch.zeros(width, n * hidden))
        self.base = nn.Parameter(torch.zeros(width))
        self.scale = nn.Parameter(torch.ones(3 if h.form == "mhc" else 2))
        self.iters, self.magnitude = h.sinkhorn_iters, h.magnitude

    def forward(self, streams: torch.Tensor):
        pre, post, comb = self.weights(streams)
        return post, comb, self.collapse(pre, streams)

    def mixes(self, flat: torch.Tensor) -> torch.Tensor:
        """The projection of the RMS-normed flattened streams (fp32) [B, T, width]: mHC norms the input, iHC scales
        the projection (HF's order of operations in each)."""
        if self.h.form == "ihc":
            return F.linear(flat, self.fn.float()) * _inv_rms(flat, self.h.norm_eps)
        return F.linear(flat * _inv_rms(flat, self.h.norm_eps), self.fn.float())

    def weights(self, streams: torch.Tensor):
        """(pre [B, T, N], post [B, T, N], comb [B, T, N, N] or None), fp32."""
        h, n = self.h, self.h.streams
        mixes = self.mixes(streams.flatten(2).float())
        if h.form == "ihc":  # HY-V4: no comb
            pre_w, post_w = mixes.split(n, dim=-1)
            pre_b, post_b = self.base.float().split(n)
            pre_s, post_s = self.scale.float().unbind(0)
            pre = torch.sigmoid(pre_w * pre_s + pre_b) + h.eps
            return pre, self.magnitude * torch.sigmoid(post_w * post_s + post_b) + h.eps, None
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + h.eps
        post = self.magnitude * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + h.eps
        return pre, post, sinkhorn(comb, self.iters, h.eps)

    def collapse(self, pre, streams):  # [B, T, H]: the streams weighted by pre, summed in fp32
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=2).to(streams.dtype)

    def mix(self, post, comb, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The streams after the block: post * out on each stream, plus the streams (mHC: mixed, comb^T @ streams,
        in the model's dtype; iHC: unmixed, in fp32)."""
        dtype = streams.dtype
        if comb is None:
            return (post.float().unsqueeze(-1) * out.float().unsqueeze(-2) + streams.float()).to(dtype)
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """HF's Sinkhorn-Knopp projection: the columns normalised, then (iters - 1) times the rows and the columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperHead(nn.Module):
    """The streams [B, T, N, H] collapsed to [B, T, H] before the final norm: sigmoid-weighted ("weighted":
    hc_fn [N, N*H], hc_base [N], hc_scale [1]) or their mean ("mean", GLM-5.3: no parameters)."""

    def __init__(self, h: HyperArgs, hidden: int):
        super().__init__()
        self.h = h
        if h.head == "weighted":
            self.hc_fn = nn.Parameter(torch.zeros(h.streams, h.streams * hidden))
            self.hc_base = nn.Parameter(torch.zeros(h.streams))
            self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.h
        if h.head == "mean":
            return x.mean(dim=2)
        flat = x.flatten(2).float()
        if h.form == "ihc":  # HY-V4's order: the norm applied to the projection, the sum in fp32
            mixes = F.linear(flat, self.hc_fn.float()) * _inv_rms(flat, h.norm_eps)
            pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + h.eps
            return (pre.unsqueeze(-1) * x.float()).sum(dim=2).to(x.dtype)
        mixes = F.linear(flat * _inv_rms(flat, h.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + h.eps
        return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


def expand(h: HyperArgs, x: torch.Tensor) -> torch.Tensor:
    """The embedding [B, T, H] copied onto the streams [B, T, N, H]."""
    return x.unsqueeze(2).expand(-1, -1, h.streams, -1).contiguous()


def add_hyper(layer: nn.Module, h: HyperArgs, hidden: int) -> None:
    """A decoder layer's two hyper-connections (HF's attn_hc and ffn_hc)."""
    layer.attn_hc = HyperConnection(h, hidden)
    layer.ffn_hc = HyperConnection(h, hidden)


def hyper_stream(layer: nn.Module, x: torch.Tensor, pos) -> torch.Tensor:
    """A pre-norm decoder layer on the streams: x [B, T, N, H], or [B, T*N, H] (a layer row's input), -> [B, T, N, H].
    Each block fed its norm of the collapse, its output expanded back onto the streams."""
    n = layer.attn_hc.h.streams
    s = x.reshape(x.shape[0], -1, n, x.shape[-1])
    post, comb, h = layer.attn_hc(s)
    s = layer.attn_hc.mix(post, comb, layer.attn(layer.input_layernorm(h), pos), s)
    post, comb, h = layer.ffn_hc(s)
    return layer.ffn_hc.mix(post, comb, layer.ffn(layer.post_attention_layernorm(h)), s)
