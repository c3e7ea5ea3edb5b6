"""Lightning attention (MiniMax-Text-01's linear attention): q, k, v = silu(qkv_proj(x)) per head; a linear attention
whose state decays by e^-s a token, s the head's slope (s = 2^(-8/h)^(head+1) x (1 - layer / (layers - 1)), as HF's
get_slope_rate); its state [heads, head_dim, head_dim] in recurrent_state (fp32); an RMSNorm (eps 1e-6, HF's
default) over all heads; gated by sigmoid(output_gate(x)); out_proj. The prefill in closed form over the whole prompt
(HF's torch path computes it in blocks of block_size), the decode the one-step recurrence S <- e^-s S + k^T v, o = q S.

Shapes: b batch, T tokens, h heads, d head dim."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.norms import RMSNorm
from models.layers.state import reset_at_start
from models.layers.taps import tap


def slope_rate(heads: int, layer: int, layers: int) -> torch.Tensor:  # [h]: HF's MiniMaxLightningAttention's
    base = 1 / (2 ** (8 / heads))
    return base ** (torch.arange(heads) + 1) * (1 - layer / (layers - 1 + 1e-5) + 1e-5)


def lightning_prefill(q, k, v, s, state):
    """q, k, v [b, h, T, d], s [h] (the slopes), state [b, h, d, d], fp32. Per token: S <- e^-s S + k^T v; o = q S.
    Returns o [b, h, T, d] and the new state."""
    T = q.shape[2]
    idx = torch.arange(T, device=q.device, dtype=q.dtype)
    gap = idx[:, None] - idx[None, :]  # [l, t]: l - t
    decay = torch.where(gap >= 0, (-s[:, None, None] * gap).exp(), 0.0)  # [h, l, t]
    o = ((q @ k.transpose(-1, -2)) * decay) @ v + (q * (-s[:, None, None] * (idx[:, None] + 1)).exp()) @ state
    to_end = (-s[:, None, None] * (T - 1 - idx[:, None])).exp()  # [h, T, 1]
    new = state * (-s * T).exp()[:, None, None] + (k * to_end).transpose(-1, -2) @ v
    return o, new


class Lightning(nn.Module):
    def __init__(self, a: ModelArgs, layer: int, dtype=torch.float32):
        super().__init__()
        self.h, self.d = a.num_attention_heads, a.head_dim
        inner = self.h * self.d
        self.qkv_proj = nn.Linear(a.hidden_size, 3 * inner, bias=False)
        self.norm = RMSNorm(inner, 1e-6)
        self.output_gate = nn.Linear(a.hidden_size, inner, bias=False)
        self.out_proj = nn.Linear(inner, a.hidden_size, bias=False)
        self.register_buffer("slope", slope_rate(self.h, layer, a.num_hidden_layers), persistent=False)
        self.register_buffer("recurrent_state", torch.zeros(1, self.h, self.d, self.d))  # fp32 at every precision

    def forward(self, x, pos):  # x [b, T, H], pos [T]
        b, T, _ = x.shape
        reset_at_start(pos, self.recurrent_state)
        qkv = F.silu(self.qkv_proj(x)).view(b, T, self.h, 3 * self.d).transpose(1, 2)  # [b, h, T, 3d]
        q, k, v = (t.float() for t in qkv.split(self.d, dim=-1))
        o = tap("recurrence", self.scan(q, k, v, self.slopes()).transpose(1, 2).reshape(b, T, -1))  # [b, T, h d]
        o = self.norm(o.to(x.dtype))
        return self.out_proj(self.gated(o, x))

    def slopes(self):  # [h]
        return self.slope.float()

    def gated(self, o, x):
        return torch.sigmoid(self.output_gate(x)) * o

    def scan(self, q, k, v, s):  # carrying recurrent_state
        if q.shape[2] == 1:  # decode: the recurrence
            state = (-s).exp()[:, None, None] * self.recurrent_state + k.transpose(-1, -2) @ v
            o = q @ state
        else:
            o, state = lightning_prefill(q, k, v, s, self.recurrent_state)
        self.recurrent_state.copy_(state)
        return o
