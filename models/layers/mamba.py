"""Mamba (Jamba's `mamba`): in_proj to x and the gate z; a causal depthwise conv (silu) carrying conv_state; x_proj
to the time step's low-rank input, B and C, each RMS-normed (Jamba's dt / b / c layernorms); dt = softplus(dt_proj);
the selective scan per channel, the decay e^(dt A) with A [inner, state] per channel and state, its state
[inner, state] in recurrent_state (fp32); the D skip; y * silu(z); out_proj. The prefill is the scan by doubling (a
fixed number of steps for any length; HF's torch path loops over the tokens); the decode (T == 1) the one-step
recurrence HF's torch path computes.

Shapes: b batch, T tokens, d inner channels, n state size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import taps
from models.layers.norms import RMSNorm
from models.layers.state import reset_at_start
from models.layers.taps import tap

def selective_scan(x, dt, A, B, C, state, max_len: int):
    """x, dt [b, T, d] (dt discretised), A [d, n] (negative), B, C [b, T, n], state [b, d, n], all fp32.
    Per token: S <- e^(dt A) S + dt x B; y = S C. As a scan by doubling (Hillis-Steele): after step j every token
    holds the recurrence over its last 2^j tokens, so ceil(log2(max_len)) steps cover any prompt, a fixed number of
    steps whatever T (no loop over tokens: a program whose prefill takes any length holds it). Returns y [b, T, d]
    (without the D skip) and the new state."""
    T = x.shape[1]
    decay = (dt[..., None] * A).exp()  # [b, T, d, n]
    u = (dt * x)[..., None] * B[:, :, None, :]  # [b, T, d, n]: each token's input
    first = (torch.arange(T, device=x.device) == 0).to(u.dtype)[None, :, None, None]
    u = u + first * decay * state[:, None]  # the carried state enters at the first token
    k = 1
    while k < max(max_len, 2):
        earlier_decay = F.pad(decay, (0, 0, 0, 0, k, 0), value=1.0)[:, :T]  # token t - k's (1 before the start)
        earlier_u = F.pad(u, (0, 0, 0, 0, k, 0))[:, :T]
        u, decay = u + decay * earlier_u, decay * earlier_decay
        k *= 2
    y = (u @ C[..., None]).squeeze(-1)  # [b, T, d]
    return y, u[:, -1]


def scan_step(x, dt, A, B, C, state):
    """One token: x, dt [b, d], A [d, n], B, C [b, n], state [b, d, n] (fp32)."""
    state = (dt[..., None] * A).exp() * state + (dt * x)[..., None] * B[:, None, :]
    return (state @ C[..., None])[..., 0], state


class Mamba(nn.Module):
    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        m = a.mamba
        self.d, self.n, self.r, self.K = m.inner, m.state_size, m.dt_rank, m.conv_kernel
        self.max_len = a.max_seq_len
        self.in_proj = nn.Linear(a.hidden_size, 2 * self.d, bias=m.proj_bias)
        self.conv1d = nn.Conv1d(self.d, self.d, self.K, groups=self.d, bias=m.conv_bias)  # HF's [d, 1, K]
        self.x_proj = nn.Linear(self.d, self.r + 2 * self.n, bias=False)
        self.dt_proj = nn.Linear(self.r, self.d, bias=True)
        self.A_log = nn.Parameter(torch.zeros(self.d, self.n))
        self.D = nn.Parameter(torch.ones(self.d))
        self.out_proj = nn.Linear(self.d, a.hidden_size, bias=m.proj_bias)
        if m.inner_norms:  # Jamba's RMSNorms of the time step's input, B and C
            self.dt_layernorm = RMSNorm(self.r, a.rms_norm_eps)
            self.b_layernorm = RMSNorm(self.n, a.rms_norm_eps)
            self.c_layernorm = RMSNorm(self.n, a.rms_norm_eps)
        self.register_buffer("conv_state", torch.zeros(1, self.d, self.K - 1, dtype=dtype))
        self.register_buffer("recurrent_state", torch.zeros(1, self.d, self.n))  # fp32 at every precision

    def forward(self, x, pos):  # x [b, T, H], pos [T]
        reset_at_start(pos, self.conv_state, self.recurrent_state)
        xs, z = self.in_proj(x).chunk(2, dim=-1)  # [b, T, d] each
        xs = tap("conv", self.conv(xs.transpose(1, 2)).transpose(1, 2))
        dt, B, C = torch.split(self.x_proj(xs), [self.r, self.n, self.n], dim=-1)
        if hasattr(self, "dt_layernorm"):
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        dt = tap("dt", self.discretized(dt))  # [b, T, d] fp32
        A = self.decay_rate()  # [d, n]
        if taps.TAPS is not None:
            tap("decay", (dt[..., None] * A).exp().flatten(2))
        y = self.scan(xs.float(), dt, A, B.float(), C.float()) + xs.float() * self.D.float()
        y = tap("recurrence", y * F.silu(z.float()))  # [b, T, d], gated (as HF's selective scan returns it)
        return self.out_proj(y.to(x.dtype))

    def decay_rate(self):  # A = -e^A_log [d, n] (fp32)
        return -self.A_log.float().exp()

    def discretized(self, dt):  # softplus(dt_proj(dt)), the bias added in fp32 as HF does
        w = self.dt_proj.weight
        return F.softplus((dt @ w.t()).float() + self.dt_proj.bias.float())

    def conv(self, xs):  # [b, d, T] -> silu(causal depthwise conv) [b, d, T], carrying conv_state
        conv_in = torch.cat([self.conv_state, xs], dim=-1)
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1):])
        return F.silu(F.conv1d(conv_in, self.conv1d.weight, self.conv1d.bias, groups=self.d))

    def scan(self, xs, dt, A, B, C):  # carrying recurrent_state
        if xs.shape[1] == 1:  # decode: the recurrence
            y, state = scan_step(xs[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], self.recurrent_state)
            y = y[:, None]
        else:
            y, state = selective_scan(xs, dt, A, B, C, self.recurrent_state, self.max_len)
        self.recurrent_state.copy_(state)
        return y
