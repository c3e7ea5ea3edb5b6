"""Inkling2's block attention residual (HF's Inkling2BlockAttentionResidual): a layer's input is not the running
residual but an attention over the residual stream's history: the outputs of the completed blocks (each
n_layers_per_attn_res_block layers) and the current partial block, each RMS-normed without a gain (fp32), attended by
a learned query (one, or three: the FULL layers' q, k and v inputs) with scale hidden^-0.5; the values are the same
normed states. Returns one input per query."""

from __future__ import annotations

import torch
from torch import nn


class BlockAttentionResidual(nn.Module):
    def __init__(self, hidden: int, queries: int = 1, eps: float = 1e-6):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden) if queries == 1 else torch.zeros(queries, hidden))
        self.eps = eps

    def forward(self, blocks, partial):  # blocks [B, T, n, H], partial [B, T, H] -> queries x [B, T, H] (fp32)
        s = torch.cat([blocks, partial.unsqueeze(-2)], dim=-2).float()
        s = s * torch.rsqrt(s.square().mean(-1, keepdim=True) + self.eps)  # (HF's unweighted norm, in fp32)
        H = s.shape[-1]
        q = self.query.float().view(-1, H)  # [Q, H]
        probs = torch.softmax((q @ s.transpose(-1, -2)) * H**-0.5, dim=-1)  # [B, T, Q, n + 1]
        return (probs @ s).unbind(-2)
