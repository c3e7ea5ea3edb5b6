"""Mamba2 (Granite 4.0-H's `mamba`, Nemotron-H's `mixer`): in_proj to the gate z, the conv stream x|B|C and dt; a
causal depthwise conv (silu) carrying conv_state; the selective scan per head, a scalar decay exp(dt * A) a token,
its state [heads, head_dim, state] in recurrent_state (fp32); the D skip; the gated group RMSNorm (y * silu(z),
normed per group); out_proj. The prefill is the SSD closed form HF's torch path computes chunk by chunk, here as one
chunk (a fixed number of matmuls, no loop over tokens, any length); the decode (T == 1) the one-step recurrence.

Shapes: b batch, T tokens, h heads, p head_dim, n state size, g groups, l = s positions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import taps
from models.layers.state import reset_at_start
from models.layers.taps import tap


def segment_sum(x):  # [..., l] -> [..., l, l]: out[i, j] = x[j+1] + ... + x[i] for j <= i, -inf above
    l = x.shape[-1]
    xe = x[..., None].expand(*x.shape, l)  # [..., i, j] = x[i]
    xe = xe.masked_fill(~torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device), -1), 0)
    out = xe.cumsum(dim=-2)  # (HF's stable form: a cumulative sum of the masked terms, not a difference of sums)
    return out.masked_fill(~torch.tril(torch.ones(l, l, dtype=torch.bool, device=x.device), 0), float("-inf"))


def ssd_prefill(xdt, a, B, C, state):
    """The Mamba2 scan over T tokens in closed form (one chunk: the decay between any two positions from a cumulative
    sum; no loop, no padding, so a program whose prefill takes any length holds it), fp32. xdt [b, T, h, p] (x times
    its time step), a [b, T, h] (dt A: each token's log-decay, negative), B, C [b, T, h, n] (groups repeated to the
    heads), state [b, h, p, n]. Per token: S <- e^a S + xdt B^T; y = S C. Returns y [b, T, h, p] (without the D skip)
    and the new state. Batched matmuls only (IREE 3.13 does not legalize the reductions a many-operand einsum lowers
    to). HF's chunks (chunk_size) change only the order of its sums."""
    xdt, B, C = xdt.transpose(1, 2), B.transpose(1, 2), C.transpose(1, 2)  # [b, h, T, .]
    a = a.transpose(1, 2)  # [b, h, T]
    a_cum = a.cumsum(-1)
    L = segment_sum(a).exp()  # [b, h, l, s]: the decay from s to l
    y = ((C @ B.transpose(-1, -2)) * L) @ xdt + (C @ state.transpose(-1, -2)) * a_cum.exp()[..., None]
    to_end = (a_cum[..., -1:] - a_cum).exp()  # [b, h, T]: from each token to the last
    new = state * a_cum[..., -1, None, None].exp() + ((B * to_end[..., None]).transpose(-1, -2) @ xdt).transpose(-1, -2)
    return y.transpose(1, 2), new


def ssd_step(x, dt, A, B, C, state):
    """One token of the recurrence: x [b, h, p], dt [b, h], A [h], B, C [b, h, n], state [b, h, p, n] (fp32)."""
    decay = (dt * A).exp()[..., None, None]  # [b, h, 1, 1]
    state = state * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    return state @ C[..., None], state  # y [b, h, p, 1]


class GatedGroupRMSNorm(nn.Module):
    """HF's MambaRMSNormGated (norm_before_gate=False): y * silu(z) in fp32, RMS-normed per group of
    `group` features, times the weight (at y's dtype)."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group, self.eps = group, eps

    def forward(self, y, z):  # [..., dim] each
        dtype = y.dtype
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (-1, self.group))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(dtype)


class Mamba2(nn.Module):
    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        m = a.mamba2
        self.h, self.p, self.n, self.g = m.num_heads, m.head_dim, m.state_size, m.n_groups
        self.inner = self.h * self.p
        self.K, self.chunk = m.conv_kernel, m.chunk_size  # (HF's chunk: where a chunked port's boundaries fall)
        self.dt_min, self.dt_max = m.time_step_limit
        self.conv_dim = self.inner + 2 * self.g * self.n
        self.in_proj = nn.Linear(a.hidden_size, self.inner + self.conv_dim + self.h, bias=m.proj_bias)
        # HF's layout [C, 1, K] (its padding replaced by the carried state); called as a function, as HF's is
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.h))
        self.A_log = nn.Parameter(torch.zeros(self.h))
        self.D = nn.Parameter(torch.ones(self.h))
        self.norm = GatedGroupRMSNorm(self.inner, self.inner // self.g, a.rms_norm_eps)
        self.out_proj = nn.Linear(self.inner, a.hidden_size, bias=m.proj_bias)
        self.register_buffer("conv_state", torch.zeros(1, self.conv_dim, self.K - 1, dtype=dtype))
        # the scan's state in fp32 at every precision (HF's torch path scans in fp32)
        self.register_buffer("recurrent_state", torch.zeros(1, self.h, self.p, self.n))

    def forward(self, x, pos):  # x [b, T, H], pos [T]
        b, T, _ = x.shape
        reset_at_start(pos, self.conv_state, self.recurrent_state)
        z, xBC, dt = torch.split(self.in_proj(x), [self.inner, self.conv_dim, self.h], dim=-1)
        xBC = tap("conv", self.conv(xBC.transpose(1, 2)).transpose(1, 2))  # [b, T, C]
        xs, B, C = torch.split(xBC, [self.inner, self.g * self.n, self.g * self.n], dim=-1)
        xs = xs.reshape(b, T, self.h, self.p).float()
        rep = self.h // self.g
        B = B.reshape(b, T, self.g, self.n).float().repeat_interleave(rep, dim=2)  # [b, T, h, n]
        C = C.reshape(b, T, self.g, self.n).float().repeat_interleave(rep, dim=2)
        dt = tap("dt", self.discretized(dt, T > 1))  # [b, T, h] fp32
        A = self.decay_rate()  # [h]
        if taps.TAPS is not None:
            tap("decay", (dt * A).exp())
        y = tap("recurrence", self.scan(xs, dt, A, B, C) + self.D.float()[:, None] * xs)  # [b, T, h, p]
        # HF: the prefill's scan output goes to the norm in fp32, the decode's at the model's dtype
        y = y.reshape(b, T, self.inner)
        y = self.norm(y if T > 1 else y.to(x.dtype), z)
        return self.out_proj(y.to(x.dtype))

    def decay_rate(self):  # A = -e^A_log (fp32): each head's state decays by e^(dt A) a token
        return -self.A_log.float().exp()

    def discretized(self, dt, prefill: bool = True):
        """softplus(dt + dt_bias), fp32, within the time-step limits in a prefill only: HF's torch path passes its
        dt_limit to the chunked scan, not to the one-step update (transformers 5.23 granitemoehybrid, nemotron_h)."""
        dt = F.softplus((dt + self.dt_bias.to(dt.dtype)).float())
        if prefill and (self.dt_min > 0.0 or self.dt_max != float("inf")):
            dt = dt.clamp(self.dt_min, self.dt_max)
        return dt

    def conv(self, xBC):  # [b, C, T] -> silu(causal depthwise conv) [b, C, T], carrying conv_state
        conv_in = torch.cat([self.conv_state, xBC], dim=-1)  # [b, C, K-1+T]
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1):])
        return F.silu(F.conv1d(conv_in, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim))

    def scan(self, xs, dt, A, B, C):  # carrying recurrent_state
        if xs.shape[1] == 1:  # decode: the recurrence
            y, state = ssd_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], self.recurrent_state)
            y = y.squeeze(-1)[:, None]
        else:
            y, state = self.prefill(xs * dt[..., None], dt * A, B, C, self.recurrent_state)
        self.recurrent_state.copy_(state)
        return y

    def prefill(self, xdt, a, B, C, state):  # the prefill's scan (xdt: x times dt; a: dt A)
        return ssd_prefill(xdt, a, B, C, state)
