"""Gated DeltaNet (Qwen3.5, Qwen3-Next): the causal conv and the gated delta rule, its recurrent
and conv state in buffers; the prefill in closed form (a fixed number of matmuls, no loop over
tokens), the decode as the one-step recurrence."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.norms import GatedRMSNorm, l2norm
from models.layers import taps
from models.layers.state import reset_at_start
from models.layers.taps import tap


def gated_delta_rule(q, k, v, g, beta, state, max_len: int):
    """Gated delta rule over T tokens in closed form (one chunk), fp32.

    q, k [B, h, T, dk] (l2-normalised, q scaled), v [B, h, T, dv], g, beta [B, h, T],
    state [B, h, dk, dv]. Per token: S <- e^g S; u = beta (v - S^T k); S <- S + k u^T;
    o = S^T q. With G = cumsum(g), the pseudo-values U solve (I + A) U = R where
    A[t, s] = beta_t e^(G_t - G_s) k_t.k_s (s < t), R = beta (V - e^G K S0); A is
    strictly lower triangular, so (I + A)^-1 = prod_j (I + (-A)^(2^j)) exactly once
    2^j reaches T: a fixed number of matmuls, no loop over tokens.
    Returns o [B, h, T, dv] and the new state.
    """
    T = q.shape[2]
    G = g.cumsum(-1)  # [B, h, T]
    idx = torch.arange(T, device=q.device)
    strict = idx[None, :] < idx[:, None]  # [t, s]: s < t
    incl = idx[None, :] <= idx[:, None]
    dG = G[..., :, None] - G[..., None, :]  # G_t - G_s
    decay_strict = torch.where(strict, dG, float("-inf")).exp()
    decay_incl = torch.where(incl, dG, float("-inf")).exp()
    eG = G.exp()[..., None]  # [B, h, T, 1]
    A = beta[..., :, None] * (k @ k.transpose(-1, -2)) * decay_strict  # [B, h, T, T]
    U = beta[..., None] * (v - eG * (k @ state))  # [B, h, T, dv]
    M = -A
    for _ in range(max(1, math.ceil(math.log2(max(max_len, 2))))):
        U = U + M @ U
        M = M @ M
    o = eG * (q @ state) + ((q @ k.transpose(-1, -2)) * decay_incl) @ U
    G_last = G[..., -1:]  # [B, h, 1]
    w = (G_last - G).exp()[..., None]  # e^(G_T - G_s)  [B, h, T, 1]
    new_state = G_last.exp()[..., None] * state + (k * w).transpose(-1, -2) @ U
    return o, new_state


class GatedDeltaNet(nn.Module):
    """Qwen3.5 linear attention: causal depthwise conv + gated delta rule, state in buffers."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        la = a.linear_attention
        self.nk, self.nv = la.num_key_heads, la.num_value_heads
        self.dk, self.dv = la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim = self.nk * self.dk, self.nv * self.dv
        self.K = la.conv_kernel_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.max_len = a.max_seq_len
        self.in_proj_qkv = nn.Linear(a.hidden_size, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(a.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(a.hidden_size, self.nv, bias=False)
        self.in_proj_a = nn.Linear(a.hidden_size, self.nv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.nv))
        self.A_log = nn.Parameter(torch.zeros(self.nv))
        self.norm = GatedRMSNorm(self.dv, a.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, a.hidden_size, bias=False)
        self.register_buffer("conv_state", torch.zeros(1, self.conv_dim, self.K - 1, dtype=dtype))
        # the recurrent state is kept in fp32 at every precision, as HF does
        self.register_buffer("recurrent_state", torch.zeros(1, self.nv, self.dk, self.dv))

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        B, T, _ = x.shape
        self.reset_at_start(pos)
        z = self.in_proj_z(x).view(B, T, self.nv, self.dv)
        b, a = self.in_proj_b(x), self.in_proj_a(x)  # [B, T, nv]
        conv = self.conv(self.in_proj_qkv(x).transpose(1, 2)).transpose(1, 2)  # [B, T, C]
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.nk, self.dk).float()
        k = k.reshape(B, T, self.nk, self.dk).float()
        v = v.reshape(B, T, self.nv, self.dv).float()
        if taps.TAPS is not None:  # the causal conv's output as the recurrence takes it (oracle/drill/points.py)
            tap("conv", torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], dim=-1))
        if self.nv != self.nk:
            q = q.repeat_interleave(self.nv // self.nk, dim=2)
            k = k.repeat_interleave(self.nv // self.nk, dim=2)
        q = tap("q_l2norm", l2norm(q)).transpose(1, 2) * self.dk**-0.5  # [B, nv, T, dk]
        k = tap("k_l2norm", l2norm(k)).transpose(1, 2)
        beta = tap("beta", torch.sigmoid(b).float()).transpose(1, 2)  # [B, nv, T] (HF: the sigmoid at the model dtype)
        g = tap("g", -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())).transpose(1, 2)
        o = tap("recurrence", self.delta_rule(q, k, v.transpose(1, 2), g, beta).transpose(1, 2)).to(x.dtype)
        o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(B, T, self.value_dim)
        return self.out_proj(o)

    def reset_at_start(self, pos):
        reset_at_start(pos, self.conv_state, self.recurrent_state)

    def conv(self, qkv):  # [B, C, T] -> silu(causal depthwise conv) [B, C, T], carrying conv_state
        conv_in = torch.cat([self.conv_state, qkv], dim=-1)  # [B, C, K-1+T]
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1) :])
        return F.silu(F.conv1d(conv_in, self.conv1d.weight, groups=self.conv_dim))

    def delta_rule(self, q, k, v, g, beta):  # carrying recurrent_state
        o, state = gated_delta_rule(q, k, v, g, beta, self.recurrent_state, self.max_len)
        self.recurrent_state.copy_(state)
        return o
