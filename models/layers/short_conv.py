"""LFM2's gated short convolution (the mixer of its "conv" layers): in_proj to three streams B, C, x;
B * x through a causal depthwise conv of `kernel` taps (no activation), gated by C; the output projection. The last
kernel - 1 inputs of the conv are its state, carried in a buffer for the next call (decode)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.state import reset_at_start
from models.layers.taps import tap


class ShortConv(nn.Module):
    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        H, self.K = a.hidden_size, a.short_conv.kernel
        bias = a.short_conv.bias
        self.in_proj = nn.Linear(H, 3 * H, bias=bias)
        # HF's module name and weight layout [H, 1, K] (its padding is replaced by the carried state)
        self.conv = nn.Conv1d(H, H, self.K, groups=H, bias=bias)
        self.o_proj = nn.Linear(H, H, bias=bias)  # HF's out_proj (the attention's o_proj's name: one rename)
        self.register_buffer("conv_state", torch.zeros(1, H, self.K - 1, dtype=dtype))

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        reset_at_start(pos, self.conv_state)
        b, c, v = self.in_proj(x).transpose(1, 2).chunk(3, dim=1)  # each [B, H, T]
        bx = b * v
        tap("bx", bx, lambda t: t.transpose(1, 2))  # [B, T, H]: rows by token, as every other point
        y = tap("conv", self.causal_conv(bx), lambda t: t.transpose(1, 2))
        return self.o_proj(self.gated(c, y).transpose(1, 2))

    def causal_conv(self, bx):  # [B, H, T] -> [B, H, T], carrying conv_state
        conv_in = torch.cat([self.conv_state, bx], dim=-1)  # [B, H, K-1+T]
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1):])
        return F.conv1d(conv_in, self.conv.weight, self.conv.bias, groups=self.conv.groups)

    def gated(self, c, y):
        return c * y
