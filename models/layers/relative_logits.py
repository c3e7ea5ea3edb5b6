"""Inkling's attention (HF's InklingAttention): no rotary position at all; instead a relative position bias
conditioned on the hidden states (InklingRelativeLogits). Each query's relative states r = r_proj(x) [nh, d_rel] mix a
trained bank of bias-vs-distance profiles `proj` [d_rel, extent] into one bias per head and backward distance; the
bias of key s for query t is that row at distance t - s, zero outside 0 <= t - s < extent (the SLIDING layers'
extent is their window). k and v pass a residual short convolution each (models/layers/residual_conv.py) before
the per-head RMSNorms of q and k; the softmax scale is 1 / head_dim (q and k are normed); the FULL layers may scale
the queries and the bias by 1 + alpha * log(max((pos + 1) / floor, 1)) (fp32). A layer's own heads and head width
(ModelArgs.layer_heads / layer_kv_heads / layer_head_dim: Inkling's swa_* on its SLIDING layers)."""

from __future__ import annotations

import torch
from torch import nn

from models.args import SLIDING, ModelArgs, heads
from models.layers.norms import rms_norm
from models.layers.residual_conv import ResidualConv


class RelativeLogits(nn.Module):
    def __init__(self, d_rel: int, extent: int):
        super().__init__()
        self.extent = extent
        self.proj = nn.Parameter(torch.zeros(d_rel, extent))
        # read at every call: seeded faults read each distance's neighbour, or leave the bias past the extent
        self.shift, self.bounded = 0, True  # (models/faults/inkling.py)

    def forward(self, r, q_pos, k_pos):  # r [B, T, nh, d_rel], q_pos [T], k_pos [S] -> bias [B, nh, T, S]
        rel = (r @ self.proj).transpose(1, 2)  # [B, nh, T, extent]
        distance = q_pos[:, None] - k_pos[None, :]  # [T, S]
        index = (distance + self.shift).clamp(0, self.extent - 1).expand(*rel.shape[:2], -1, -1)
        bias = self.pick(rel, index)
        outside = (distance < 0) | (distance >= self.extent) if self.bounded else distance < 0
        return bias.masked_fill(outside, 0.0)

    def pick(self, rel, index):  # rel [B, nh, T, extent] at index [B, nh, T, S] along the last dim (an exporter's
        return rel.gather(-1, index)  # own op form overrides it: the MLX delegate takes no gather)


class RelativeAttention(nn.Module):
    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        ink = a.inkling
        (self.nh, self.kvh), self.hd = heads(a, layer), a.layer_head_dim[layer] if a.layer_head_dim else a.head_dim
        sliding = a.layer_types[layer] == SLIDING
        self.window = a.attention.sliding_window if sliding else None
        H, kv = a.hidden_size, self.kvh * self.hd
        self.q_proj = nn.Linear(H, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(H, kv, bias=False)
        self.v_proj = nn.Linear(H, kv, bias=False)
        self.r_proj = nn.Linear(H, self.nh * ink.d_rel, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, H, bias=False)
        self.k_sconv = ResidualConv(kv, ink.conv_kernel)
        self.v_sconv = ResidualConv(kv, ink.conv_kernel)
        self.q_norm = rms_norm(a, self.hd)
        self.k_norm = rms_norm(a, self.hd)
        self.rel_logits_proj = RelativeLogits(ink.d_rel, self.window if sliding else ink.rel_extent)
        self.scale = 1.0 / self.hd  # q and k RMS-normed per head: 1/d, not 1/sqrt(d)
        self.log_floor, self.log_alpha = (0, 0.0) if sliding else (ink.log_floor, ink.log_alpha)
        S = a.max_seq_len
        self.register_buffer("k_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        B, T, _ = x.shape
        q = self.q_proj(x)
        k = self.k_sconv(self.k_proj(x), pos)
        v = self.v_sconv(self.v_proj(x), pos)
        r = self.r_proj(x).view(B, T, self.nh, -1)
        q = self.q_norm(q.view(B, T, self.nh, self.hd)).transpose(1, 2)
        k = self.k_norm(k.view(B, T, self.kvh, self.hd)).transpose(1, 2)
        kc, vc = self.update_cache(k, v.view(B, T, self.kvh, self.hd).transpose(1, 2), pos)
        bias = self.rel_logits_proj(r, pos, self.cache_pos)  # [B, nh, T, S]
        if self.log_floor:  # (HF: in fp32)
            tau = 1.0 + self.log_alpha * torch.log(((pos + 1).float() / self.log_floor).clamp(min=1.0))
            tau = tau.view(1, 1, -1, 1)
            q, bias = (q.float() * tau).to(q.dtype), (bias.float() * tau).to(bias.dtype)
        rep = self.nh // self.kvh
        kc, vc = kc.repeat_interleave(rep, dim=1), vc.repeat_interleave(rep, dim=1)
        scores = (q @ kc.transpose(2, 3)) * self.scale + bias
        scores = scores.masked_fill(~self.mask(pos), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((probs @ vc).transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def update_cache(self, k, v, pos):  # k, v [B, kvh, T, hd] -> the caches [B, kvh, S, hd]
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        return self.k_cache, self.v_cache

    def mask(self, pos):  # [T, S]: causal, within the window on SLIDING layers
        visible = self.cache_pos[None, :] <= pos[:, None]
        if self.window is not None:
            visible = torch.where(pos[:, None] - self.cache_pos[None, :] < self.window, visible, False)
        return visible
