"""Rotary position embeddings: rotate-half on the first rotary dims (partial rotary, interleaved
pairs), with the frequencies of YaRN, Llama 3's scaling and LongRoPE."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.args import Llama3Scaling, RopeArgs, YaRN


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` dims of each head (r.partial_rotary_factor of
    them, or `partial`). r.interleave: the rotary pairs are (x0, x1), (x2, x3) ... (DeepSeek): the
    head is de-interleaved first (even dims, then odd), which rotates the same pairs; q.k is
    unchanged by that order. r.kind: the frequencies of YaRN (and its cos/sin attention factor),
    of Llama 3's scaling, or LongRoPE's (and its cos/sin scale); "proportional" (Gemma 4): rotate-half over the
    whole head with only the first partial_rotary_factor of its frequencies nonzero. r.fp32: cos/sin kept in fp32 and
    the rotation computed in fp32, cast back to x's dtype once; else cos/sin cast to x's dtype and
    the rotation in it."""

    def __init__(self, head_dim: int, r: RopeArgs, partial: float | None = None):
        super().__init__()
        self.rotary_dim = int(head_dim * (r.partial_rotary_factor if partial is None else partial))
        self.interleave, self.fp32, self.theta = r.interleave, r.fp32, r.theta
        inv = 1.0 / (r.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        if r.kind == "proportional":  # Gemma 4: the whole head, its first slots at theta^(-2i/head_dim), the rest 0
            angles, self.rotary_dim = int(r.partial_rotary_factor * head_dim // 2), head_dim
            inv = torch.cat((1.0 / (r.theta ** (torch.arange(0, 2 * angles, 2, dtype=torch.float) / head_dim)),
                             torch.zeros(head_dim // 2 - angles)))
        self.factor, self.longrope = 1.0, None
        if r.kind == "yarn":
            inv, self.factor = yarn_frequencies(inv, self.rotary_dim, r.theta, r.scaling)
        elif r.kind == "llama3":
            inv = llama3_frequencies(inv, r.scaling)
        elif r.kind == "longrope":
            inv = 1.0 / (torch.tensor(r.scaling.short_factor, dtype=torch.float32)
                         * r.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
            self.longrope = r.scaling
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, pos):  # x [B, nh, T, hd], pos [T]
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [T, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        up = self.fp32 and x.dtype != torch.float32  # (static when traced: an fp32 program is unchanged)
        dtype = torch.float32 if up else x.dtype  # of cos/sin and of the rotation
        if self.longrope is not None:  # the call's length decides the scale (HF: max(position) + 1)
            lr = self.longrope
            mscale = lr.short_mscale if lr.short_mscale == lr.long_mscale else torch.where(
                pos.max() + 1 > lr.original_max_position_embeddings, lr.long_mscale, lr.short_mscale)
            cos, sin = (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)
        elif self.factor != 1.0:  # YaRN's attention factor
            cos, sin = (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)
        else:
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleave:
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        if up:
            rot = rot.float()
        rot = rot * cos + rotate_half(rot) * sin
        return torch.cat((rot.to(x.dtype) if up else rot, rest), dim=-1)

    def hf_layout(self, y):
        """A rotated head in HF's layout: interleaved pairs put back in place (q.k is the same either way)."""
        if not self.interleave:
            return y
        rot, rest = y[..., : self.rotary_dim], y[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        return torch.cat((torch.stack((rot[..., :half], rot[..., half:]), dim=-1).flatten(-2), rest), dim=-1)


def llama3_frequencies(inv, s: Llama3Scaling):
    """Llama 3's rope scaling (HF _compute_llama3_parameters): long wavelengths divided by
    `factor`, short ones kept, a smooth blend between."""
    factor, low_freq_factor, high_freq_factor = s.factor, s.low_freq_factor, s.high_freq_factor
    original_max = s.original_max_position_embeddings
    low_wavelen, high_wavelen = original_max / low_freq_factor, original_max / high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(inv, dim: int, theta: float, y: YaRN):
    """YaRN (arXiv 2309.00071): high-frequency dims keep their frequency (extrapolate), low ones
    are divided by `factor` (interpolate), a linear ramp between the two correction dims; and the
    factor cos/sin are multiplied by. Returns (inv_freq [dim/2], factor)."""
    factor, original_max, beta_fast, beta_slow = y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow
    mscale, mscale_all_dim, truncate, attention_factor = y.mscale, y.mscale_all_dim, y.truncate, y.attention_factor

    def correction_dim(rotations):
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate
    if attention_factor is not None:
        attention = attention_factor
    elif mscale and mscale_all_dim:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    return inv, float(attention)
