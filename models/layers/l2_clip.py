"""Inkling2's L2 clips (HF's Inkling2L2Clip, Inkling2ScaledL2Clip): each head vector scaled down to `threshold` where
its L2 norm is larger (shorter ones unchanged), in fp32, rounded once to the input's dtype; the scaled clip first
multiplies by a learned scale per head and channel [heads, dim]. Inkling2's queries pass the scaled clip, its keys the
plain one, its relative states a scaled clip of their own threshold (rel_l2_clip_threshold)."""

from __future__ import annotations

import torch
from torch import nn


class L2Clip(nn.Module):
    def __init__(self, threshold: float, heads: int = 0, dim: int = 0):
        super().__init__()
        self.threshold = threshold  # read at every call (a seeded fault clips elsewhere)
        if heads:  # the scaled clip
            self.scale = nn.Parameter(torch.ones(heads, dim))
        self.scaled = bool(heads)  # read at every call: a seeded fault drops the scale (models/faults/)

    def forward(self, x):  # [..., heads, dim]
        xf = x.float() * self.scale.float() if self.scaled and hasattr(self, "scale") else x.float()
        norm = torch.linalg.vector_norm(xf, dim=-1, keepdim=True)
        return (xf * (self.threshold / (norm + 1e-6)).clamp(max=1.0)).to(x.dtype)
