"""Kimi delta attention (KDA, Kimi-Linear's linear attention): the gated delta rule of the Gated DeltaNet with its
decay per channel (per key dimension) instead of per head.

q, k, v: their projections through one causal depthwise conv (silu) over q | k | v, its state in conv_state; q and k
l2-normed (HF's l2norm, eps 1e-6 under the root), q scaled by dk^-1/2. The decay's log per channel
g = -e^A_log (per head) * softplus(f + dt_bias (per channel)) (the forget gate; Kimi-Linear's f = f_b_proj(f_a_proj(x)),
low-rank through head_dim), or bounded, g = lower_bound * sigmoid(e^A_log * (f + dt_bias)) (Bailing-hybrid's safe gate,
f = f_proj(x) full-rank: KDAArgs); beta = sigmoid(b_proj(x)) per head. Per token: S <- diag(e^g) S;
u = beta (v - S^T k); S <- S + k u^T; o = S^T q, the state S [h, dk, dv] in recurrent_state (fp32 at every precision,
as HF keeps it). The output RMSNorm per head, gated by sigmoid(g_b_proj(g_a_proj(x))) (Bailing-hybrid's: g_proj(x)),
then o_proj.

The prefill in parallel form over the whole prompt (HF's torch fallback computes the same within chunks of 64, the
chunks one after another): the decay between every two tokens per channel, e^(G_t - G_s) [T, T, dk] (exp of a sum of
log decays, never of a growing exponent), the pseudo-values solved by doubling (a fixed number of matmuls, no loop over
tokens, any length: an exported prefill's T may be dynamic); the decode the one-step recurrence. Its memory is
T^2 dk per head (the release's 32 heads of 128 at T 1024: 16 GiB in fp32): the oracle's prompts are short; a long
prefill would go in chunks, as HF's.

Shapes: B batch, T tokens, h heads, d = dk = dv head dim."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import taps
from models.layers.state import reset_at_start
from models.layers.taps import tap


def l2norm(x, eps: float = 1e-6):  # HF's (FLA's): x / sqrt(sum(x^2) + eps), the root and the division as HF's
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def kda_prefill(q, k, v, g, beta, state, max_len: int):
    """The gated delta rule with a per-channel decay over T tokens at once, fp32.

    q, k [B, h, T, dk] (l2-normed, q scaled), v [B, h, T, dv], g [B, h, T, dk] (log decays), beta [B, h, T],
    state [B, h, dk, dv]. With G = cumsum(g) per channel, the pseudo-values U solve (I + A) U = R where
    A[t, s] = beta_t sum_c k_t[c] e^(G_t[c] - G_s[c]) k_s[c] (s < t) and R = beta (V - (K e^G) S0); A is strictly
    lower triangular, so (I + A)^-1 = prod_j (I + (-A)^(2^j)) exactly once 2^j reaches T.
    Returns o [B, h, T, dv] and the new state."""
    T = q.shape[2]
    G = g.cumsum(2)  # [B, h, T, dk]
    idx = torch.arange(T, device=q.device)
    strict = (idx[None, :] < idx[:, None])[..., None]  # [t, s, 1]: s < t
    incl = (idx[None, :] <= idx[:, None])[..., None]
    dG = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, h, t, s, dk]: G_t - G_s
    A = beta[..., None] * (k[:, :, :, None, :] * k[:, :, None, :, :]
                           * torch.where(strict, dG, float("-inf")).exp()).sum(-1)  # [B, h, T, T]
    eG = G.exp()
    U = beta[..., None] * (v - (k * eG) @ state)  # [B, h, T, dv]
    M = -A
    for _ in range(max(1, math.ceil(math.log2(max(max_len, 2))))):
        U = U + M @ U
        M = M @ M
    qk = (q[:, :, :, None, :] * k[:, :, None, :, :] * torch.where(incl, dG, float("-inf")).exp()).sum(-1)
    o = (q * eG) @ state + qk @ U
    G_last = G[:, :, -1:, :]  # [B, h, 1, dk]
    new_state = G_last.transpose(-1, -2).exp() * state + (k * (G_last - G).exp()).transpose(-1, -2) @ U
    return o, new_state


def kda_step(q, k, v, g, beta, state):
    """One token: q, k, g [B, h, 1, dk], v [B, h, 1, dv], beta [B, h, 1], state [B, h, dk, dv] -> o [B, h, 1, dv],
    the new state."""
    state = g.transpose(-1, -2).exp() * state  # each key channel's row decays by its own e^g
    u = beta[..., None] * (v - k @ state)
    state = state + k.transpose(-1, -2) @ u
    return q @ state, state


class ForgetGate(nn.Module):
    """The per-channel log decay [B, T, h, d], fp32: -e^A_log * softplus(f + dt_bias), or
    lower_bound * sigmoid(e^A_log * (f + dt_bias)) where the gate is bounded (KDAArgs.lower_bound); f the low-rank
    f_b_proj(f_a_proj(x)) or the full-rank f_proj(x) (KDAArgs.low_rank_gates); A_log per head (HF's Kimi-Linear
    layout [1, 1, h, 1]), dt_bias per channel [h d]. Rounded to x's dtype where HF's is (KDAArgs.decay_in_model_dtype;
    the recurrence takes it in fp32)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        k = a.kda
        self.h, self.d = k.num_heads, k.head_dim
        if k.low_rank_gates:
            self.f_a_proj = nn.Linear(a.hidden_size, self.d, bias=False)
            self.f_b_proj = nn.Linear(self.d, self.h * self.d, bias=False)
        else:
            self.f_proj = nn.Linear(a.hidden_size, self.h * self.d, bias=False)
        self.dt_bias = nn.Parameter(torch.zeros(self.h * self.d))
        self.A_log = nn.Parameter(torch.zeros(1, 1, self.h, 1))
        self.lower_bound, self.in_model_dtype = k.lower_bound, k.decay_in_model_dtype

    def forward(self, x):  # x [B, T, H]
        B, T, _ = x.shape
        f = self.f_b_proj(self.f_a_proj(x)) if hasattr(self, "f_b_proj") else self.f_proj(x)
        u = (f.float() + self.dt_bias.float()).view(B, T, self.h, self.d)
        if self.lower_bound:  # HF's: lower_bound * sigmoid(e^A_log * u), in (lower_bound, 0)
            g = self.lower_bound * torch.sigmoid(-self.decay_rate() * u)
        else:  # (HF Kimi-Linear's softplus; Bailing's unbounded gate takes F.softplus: within an ulp of it)
            g = self.decay_rate() * torch.where(u > 20.0, u, torch.log(1.0 + torch.exp(u)))
        return g.to(x.dtype) if self.in_model_dtype else g

    def decay_rate(self):  # -e^A_log [1, 1, h, 1]: the log decay per unit of time step, negative
        return -self.A_log.float().exp()


class OutputNorm(nn.Module):
    """RMSNorm per head in fp32 (the gain in fp32), times the activation of the output gate, in the input's dtype
    (HF's KimiLinearRMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, gate):
        xf = x.float()
        xf = self.weight.float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return (xf * self.activation(gate.float())).to(x.dtype)

    def activation(self, gate):
        return torch.sigmoid(gate)


class KimiDeltaAttention(nn.Module):
    """Kimi delta attention with its conv and recurrent state in buffers (module names HF's)."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        self.h, self.d, self.K = a.kda.num_heads, a.kda.head_dim, a.kda.conv_kernel
        inner = self.h * self.d
        self.conv_dim, self.max_len = 3 * inner, a.max_seq_len
        self.q_proj = nn.Linear(a.hidden_size, inner, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, inner, bias=False)
        self.v_proj = nn.Linear(a.hidden_size, inner, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.K, groups=self.conv_dim, bias=False)
        self.forget_gate = ForgetGate(a)
        self.b_proj = nn.Linear(a.hidden_size, self.h, bias=False)
        if a.kda.low_rank_gates:
            self.g_a_proj = nn.Linear(a.hidden_size, self.d, bias=False)
            self.g_b_proj = nn.Linear(self.d, inner, bias=False)
        else:
            self.g_proj = nn.Linear(a.hidden_size, inner, bias=False)
        self.o_norm = OutputNorm(self.d, a.rms_norm_eps)
        self.o_proj = nn.Linear(inner, a.hidden_size, bias=False)
        self.register_buffer("conv_state", torch.zeros(1, self.conv_dim, self.K - 1, dtype=dtype))
        self.register_buffer("recurrent_state", torch.zeros(1, self.h, self.d, self.d))  # fp32 at every precision

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        B, T, _ = x.shape
        reset_at_start(pos, self.conv_state, self.recurrent_state)
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        conv = self.conv(qkv.transpose(1, 2)).transpose(1, 2)  # [B, T, 3 h d]
        if taps.TAPS is not None:  # the conv's output as the recurrence takes it (oracle/drill/points.py)
            tap("conv", conv)
        q, k, v = (t.reshape(B, T, self.h, self.d).float() for t in conv.split(self.h * self.d, dim=-1))
        q = tap("q_l2norm", l2norm(q)).transpose(1, 2) * self.d**-0.5  # [B, h, T, d]
        k = tap("k_l2norm", l2norm(k)).transpose(1, 2)
        g = tap("g", self.forget_gate(x)).transpose(1, 2)  # [B, h, T, d]
        if g.dtype != torch.float32:  # (a decay in the model's dtype: the recurrence in fp32)
            g = g.float()
        # [B, h, T] (HF: the sigmoid at the model dtype, then fp32)
        beta = tap("beta", torch.sigmoid(self.b_proj(x)).float()).transpose(1, 2)
        o = tap("recurrence", self.delta_rule(q, k, v.transpose(1, 2), g, beta).transpose(1, 2)).to(x.dtype)
        gate = (self.g_b_proj(self.g_a_proj(x)) if hasattr(self, "g_b_proj") else self.g_proj(x)).view(B, T, self.h,
                                                                                                       self.d)
        return self.o_proj(self.o_norm(o, gate).reshape(B, T, -1))

    def conv(self, qkv):  # [B, C, T] -> silu(causal depthwise conv) [B, C, T], carrying conv_state
        conv_in = torch.cat([self.conv_state, qkv], dim=-1)  # [B, C, K-1+T]
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1):])
        return F.silu(F.conv1d(conv_in, self.conv1d.weight, groups=self.conv_dim))

    def delta_rule(self, q, k, v, g, beta):  # carrying recurrent_state; the decode (one token) as the recurrence
        if q.shape[2] == 1:
            o, state = kda_step(q, k, v, g, beta, self.recurrent_state)
        else:
            o, state = kda_prefill(q, k, v, g, beta, self.recurrent_state, self.max_len)
        self.recurrent_state.copy_(state)
        return o
