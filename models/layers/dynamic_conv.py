"""Inkling2's dynamic short convolution (HF's Inkling2DynamicShortConvolution, the FULL layers' k and v): a causal
convolution of `kernel` taps whose weights are, per token and per kv head, a static per-channel tap weight
(`static_weight` [kernel, C], tap 0 the current token) plus a tap weight projected from the token's own input
(`weight_proj`: input -> heads * kernel, shared by the head's channels); in fp32, plus the input (a residual), the
sum divided by sqrt(2 * kernel + 1). Its last kernel - 1 inputs are carried in a buffer into the next call."""

from __future__ import annotations

import math

import torch
from torch import nn

from models.layers.state import reset_at_start


class DynamicConv(nn.Module):
    def __init__(self, dim: int, input_size: int, heads: int, kernel: int):
        super().__init__()
        self.K, self.heads = kernel, heads
        self.static_weight = nn.Parameter(torch.zeros(kernel, dim))
        self.weight_proj = nn.Linear(input_size, heads * kernel, bias=False)
        self.register_buffer("conv_state", torch.zeros(1, kernel - 1, dim))  # the last inputs, fp32, oldest first
        self.carry = True  # read at every call: a seeded fault starts every call from zeros

    def forward(self, x, dynamic_input, pos):  # x [B, T, C], dynamic_input [B, T, D], pos [T] -> [B, T, C]
        reset_at_start(pos, self.conv_state)
        B, T, C = x.shape
        w = self.weight_proj(dynamic_input).float().view(B, T, self.heads, 1, self.K)
        w = self.static_weight.float().T.view(self.heads, -1, self.K) + w  # [B, T, heads, C / heads, K]
        xf = x.float()
        state = self.conv_state if self.carry else torch.zeros_like(self.conv_state)
        context = torch.cat([state.expand(B, -1, -1), xf], dim=1)  # [B, K-1+T, C]
        self.conv_state.copy_(context[:1, -(self.K - 1):])
        # windows[..., lag]: the input `lag` tokens back
        windows = torch.stack([context[:, self.K - 1 - lag: self.K - 1 - lag + T] for lag in range(self.K)], dim=-1)
        y = (windows.view(B, T, self.heads, -1, self.K) * w).sum(-1).reshape(B, T, C)
        return ((y + xf) / math.sqrt(2 * self.K + 1)).to(x.dtype)
