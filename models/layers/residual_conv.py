"""Inkling's short convolution (HF's InklingShortConvolution): x + a causal depthwise conv of `kernel` taps over x, no
bias, computed in fp32 (its weight kept in fp32, as HF's _keep_in_fp32_modules_strict keeps it) and rounded once to
the input's dtype. Its last kernel - 1 inputs are its state, carried in a buffer into the next call (decode). Inkling
has four per layer: on k and on v before the attention (k_sconv, v_sconv), on the attention's output and on the
MLP's (attn_sconv, mlp_sconv)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.layers.state import reset_at_start


class ResidualConv(nn.Module):
    def __init__(self, dim: int, kernel: int):
        super().__init__()
        self.K = kernel
        self.conv1d = nn.Conv1d(dim, dim, kernel, groups=dim, bias=False)  # HF's name and layout [C, 1, K]
        self.register_buffer("conv_state", torch.zeros(1, dim, kernel - 1))  # fp32 whatever the model's dtype
        self.carry = True  # read at every call: a seeded fault starts every call from zeros (models/faults/inkling.py)

    def forward(self, x, pos):  # x [B, T, C], pos [T] -> [B, T, C]
        reset_at_start(pos, self.conv_state)
        xf = x.float()
        state = self.conv_state if self.carry else torch.zeros_like(self.conv_state)
        conv_in = torch.cat([state, xf.transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1):])
        y = F.conv1d(conv_in, self.conv1d.weight.float(), groups=self.conv1d.groups).transpose(1, 2)
        return (y + xf).to(x.dtype)
