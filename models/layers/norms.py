"""Norms of the production model: HF's RMSNorm (w * x, (1 + w) * x, the gain in fp32), LayerNorm
with bias, the Gated DeltaNet's gated output norm, and the weightless l2 norms."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs


class RMSNorm(nn.Module):
    """HF RMSNorm: normalise in fp32. offset=False: w * x.to(dtype) (gain_fp32: (w * x).to(dtype),
    one rounding); offset=True: (x * (1 + w)).to(dtype)."""

    def __init__(self, dim: int, eps: float, offset: bool = False, gain_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset, self.gain_fp32 = eps, offset, gain_fp32

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        if self.gain_fp32 and x.dtype != torch.float32:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with bias (PhiMoE) or without (DBRX), computed in the input's dtype as HF's nn.LayerNorm is."""


def norm(a: ModelArgs, dim: int) -> nn.Module:
    """The family's norm of a hidden state (ModelArgs.norm)."""
    if a.norm.kind == "layer":
        return LayerNorm(dim, eps=a.rms_norm_eps, bias=a.norm.bias)
    return rms_norm(a, dim)


def rms_norm(a: ModelArgs, dim: int) -> RMSNorm:
    return RMSNorm(dim, a.rms_norm_eps, a.norm.offset, a.norm.gain_fp32)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * silu(z), the Gated DeltaNet output norm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2_rms(x, eps):  # Llama 4's weightless q/k norm: x / rms(x), in fp32
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)
