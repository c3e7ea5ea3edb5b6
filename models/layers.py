"""Shared layers of the production MoE models.

Export-friendly: static-shape state buffers (KV cache, conv state, recurrent state),
no data-dependent Python control flow, positions passed explicitly. One forward
serves prefill (T tokens) and decode (T == 1); state is carried in registered
buffers and reset by a call at position 0.

Module names mirror the HF checkpoints (self_attn / linear_attn / mlp.gate /
mlp.experts / mlp.shared_expert ...) so that a family's `sanitize()` is mostly a
prefix strip plus the expert stacking.

Shapes: B batch (1), T tokens in this call, S max_seq_len, H hidden, E experts,
k experts per token, I expert intermediate, nh/kvh heads, hd head dim.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from models import routing
from models.args import (CHUNKED, FULL, LINEAR, SLIDING, SPARSE, STATE_BUFFERS, ModelArgs,  # noqa: F401
                         Llama3Scaling, RopeArgs, YaRN, block_path, mlp_type)

# a drill's recorder (oracle/points.py), called as TAPS(point, tensor) while one runs; None otherwise,
# so `tap` is a no-op and traced graphs (torch.export) do not change
TAPS = None


def tap(point: str, x, view=None):
    """A value with no module of its own, named for the drill (oracle.points.TAPS); `view` maps it to
    the layout HF computes it in (applied only while a drill records)."""
    if TAPS is not None:
        TAPS(point, x if view is None else view(x))
    return x


class RMSNorm(nn.Module):
    """HF RMSNorm: normalise in fp32. offset=False: w * x.to(dtype) (gain_fp32: (w * x).to(dtype),
    one rounding); offset=True: (x * (1 + w)).to(dtype)."""

    def __init__(self, dim: int, eps: float, offset: bool = False, gain_fp32: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset, self.gain_fp32 = eps, offset, gain_fp32

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:
            return (xf * (1.0 + self.weight.float())).type_as(x)
        if self.gain_fp32 and x.dtype != torch.float32:
            return (self.weight.float() * xf).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with bias (PhiMoE), computed in the input's dtype as HF's nn.LayerNorm is."""


def norm(a: ModelArgs, dim: int) -> nn.Module:
    """The family's norm of a hidden state (ModelArgs.norm)."""
    if a.norm.kind == "layer":
        return LayerNorm(dim, eps=a.rms_norm_eps)
    return rms_norm(a, dim)


def rms_norm(a: ModelArgs, dim: int) -> RMSNorm:
    return RMSNorm(dim, a.rms_norm_eps, a.norm.offset, a.norm.gain_fp32)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * silu(z), the Gated DeltaNet output norm."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x, z):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf.to(x.dtype) * F.silu(z.float())).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rope(nn.Module):
    """Rotate-half RoPE on the first `rotary_dim` dims of each head (r.partial_rotary_factor of
    them, or `partial`). r.interleave: the rotary pairs are (x0, x1), (x2, x3) ... (DeepSeek): the
    head is de-interleaved first (even dims, then odd), which rotates the same pairs; q.k is
    unchanged by that order. r.kind: the frequencies of YaRN (and its cos/sin attention factor),
    of Llama 3's scaling, or LongRoPE's (and its cos/sin scale). r.fp32: cos/sin kept in fp32 and
    the rotation computed in fp32, cast back to x's dtype once; else cos/sin cast to x's dtype and
    the rotation in it."""

    def __init__(self, head_dim: int, r: RopeArgs, partial: float | None = None):
        super().__init__()
        self.rotary_dim = int(head_dim * (r.partial_rotary_factor if partial is None else partial))
        self.interleave, self.fp32 = r.interleave, r.fp32
        inv = 1.0 / (r.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
        self.factor, self.longrope = 1.0, None
        if r.kind == "yarn":
            inv, self.factor = yarn_frequencies(inv, self.rotary_dim, r.theta, r.scaling)
        elif r.kind == "llama3":
            inv = llama3_frequencies(inv, r.scaling)
        elif r.kind == "longrope":
            inv = 1.0 / (torch.tensor(r.scaling.short_factor, dtype=torch.float32)
                         * r.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim))
            self.longrope = r.scaling
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x, pos):  # x [B, nh, T, hd], pos [T]
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [T, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        up = self.fp32 and x.dtype != torch.float32  # (static when traced: an fp32 program is unchanged)
        dtype = torch.float32 if up else x.dtype  # of cos/sin and of the rotation
        if self.longrope is not None:  # the call's length decides the scale (HF: max(position) + 1)
            lr = self.longrope
            mscale = lr.short_mscale if lr.short_mscale == lr.long_mscale else torch.where(
                pos.max() + 1 > lr.original_max_position_embeddings, lr.long_mscale, lr.short_mscale)
            cos, sin = (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)
        elif self.factor != 1.0:  # YaRN's attention factor
            cos, sin = (emb.cos() * self.factor).to(dtype), (emb.sin() * self.factor).to(dtype)
        else:
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        if self.interleave:
            rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
        if up:
            rot = rot.float()
        rot = rot * cos + rotate_half(rot) * sin
        return torch.cat((rot.to(x.dtype) if up else rot, rest), dim=-1)

    def hf_layout(self, y):
        """A rotated head in HF's layout: interleaved pairs put back in place (q.k is the same either way)."""
        if not self.interleave:
            return y
        rot, rest = y[..., : self.rotary_dim], y[..., self.rotary_dim :]
        half = self.rotary_dim // 2
        return torch.cat((torch.stack((rot[..., :half], rot[..., half:]), dim=-1).flatten(-2), rest), dim=-1)


def llama3_frequencies(inv, s: Llama3Scaling):
    """Llama 3's rope scaling (HF _compute_llama3_parameters): long wavelengths divided by
    `factor`, short ones kept, a smooth blend between."""
    factor, low_freq_factor, high_freq_factor = s.factor, s.low_freq_factor, s.high_freq_factor
    original_max = s.original_max_position_embeddings
    low_wavelen, high_wavelen = original_max / low_freq_factor, original_max / high_freq_factor
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_frequencies(inv, dim: int, theta: float, y: YaRN):
    """YaRN (arXiv 2309.00071): high-frequency dims keep their frequency (extrapolate), low ones
    are divided by `factor` (interpolate), a linear ramp between the two correction dims; and the
    factor cos/sin are multiplied by. Returns (inv_freq [dim/2], factor)."""
    factor, original_max, beta_fast, beta_slow = y.factor, y.original_max_position_embeddings, y.beta_fast, y.beta_slow
    mscale, mscale_all_dim, truncate, attention_factor = y.mscale, y.mscale_all_dim, y.truncate, y.attention_factor

    def correction_dim(rotations):
        return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv = (inv / factor) * (1 - extrapolate) + inv * extrapolate
    if attention_factor is not None:
        attention = attention_factor
    elif mscale and mscale_all_dim:
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    else:
        attention = yarn_mscale(factor)
    return inv, float(attention)


class Attention(nn.Module):
    """Causal attention over a static KV cache [B, kvh, S, hd]: over every earlier position (FULL),
    the last `sliding_window` (SLIDING) or those in the same `chunk_size` chunk (CHUNKED: AttentionArgs);
    with rope or not (RopeArgs.per_layer), and optionally a learned sink logit per head."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        self.nh, self.kvh, self.hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        at = a.attention
        self.gated = at.output_gate
        q_out = self.nh * self.hd * (2 if self.gated else 1)
        self.q_proj = nn.Linear(a.hidden_size, q_out, bias=at.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.kvh * self.hd, bias=at.qkv_bias)
        self.v_proj = nn.Linear(a.hidden_size, self.kvh * self.hd, bias=at.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, a.hidden_size, bias=at.o_bias)
        self.qk_norm = at.qk_norm
        if at.qk_norm == "head":
            self.q_norm = rms_norm(a, self.hd)
            self.k_norm = rms_norm(a, self.hd)
        elif at.qk_norm == "flat":
            self.q_norm = rms_norm(a, self.nh * self.hd)
            self.k_norm = rms_norm(a, self.kvh * self.hd)
        self.use_rope = a.rope.rotates(layer)
        self.rope = Rope(self.hd, a.rope)
        self.scale = a.multipliers.attention or self.hd**-0.5
        self.eps = a.rms_norm_eps
        kind = a.layer_types[layer]
        self.window = at.sliding_window if kind == SLIDING else None
        self.chunk = at.chunk_size if kind == CHUNKED else None
        if at.sinks:
            self.sinks = nn.Parameter(torch.zeros(self.nh))
        # Llama 4's no-rope layers scale q with the position
        self.temperature = (at.floor_scale, at.attn_scale) if at.temperature_tuning and not self.use_rope else None
        S = a.max_seq_len
        self.register_buffer("k_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q, k, v, gate = self.project(x, pos)
        kc, vc = self.update_cache(k, v, pos)
        y = self.attend(q, kc, vc, self.mask(pos))  # [B, T, nh * hd]
        if self.gated:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y)

    def project(self, x, pos):
        """q [B, nh, T, hd], k/v [B, kvh, T, hd] after q/k norm and RoPE; the output gate."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x), None
        if self.gated:
            q, gate = q.view(B, T, self.nh, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.nh * self.hd)
        k, v = self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "flat":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.nh, self.hd)
        k = k.view(B, T, self.kvh, self.hd)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.use_rope:
            q = tap("q_rope", self.rope(q, pos), self.rope.hf_layout)
            k = tap("k_rope", self.rope(k, pos), self.rope.hf_layout)
            if self.qk_norm == "l2":  # Llama 4: weightless, after the rotation, rope layers only
                q, k = l2_rms(q, self.eps), l2_rms(k, self.eps)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            t = torch.log(torch.floor((pos.float() + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0  # [T]
            q = (q * t[:, None]).to(q.dtype)
        return q, k, v.view(B, T, self.kvh, self.hd).transpose(1, 2), gate

    def update_cache(self, k, v, pos):
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        return self.k_cache, self.v_cache

    def mask(self, pos):
        """[T, S] True where key position s is visible from query position pos[t] (causal)."""
        visible = self.cache_pos[None, :] <= pos[:, None]
        # narrowed by torch.where, not a boolean and (IREE 3.13 does not legalize aten.__and__ on i1)
        if self.window is not None:
            visible = torch.where(pos[:, None] - self.cache_pos[None, :] < self.window, visible, False)
        if self.chunk is not None:
            visible = torch.where(self.cache_pos[None, :] // self.chunk == pos[:, None] // self.chunk, visible, False)
        return visible

    def attend(self, q, kc, vc, visible):
        B, _, T, _ = q.shape
        rep = self.nh // self.kvh
        kc = kc.repeat_interleave(rep, dim=1)  # [B, nh, S, hd]
        vc = vc.repeat_interleave(rep, dim=1)
        scores = (q @ kc.transpose(2, 3)) * self.scale  # [B, nh, T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        if hasattr(self, "sinks"):  # one more logit per head, whose probability is dropped
            sink = self.sinks.to(scores.dtype)[None, :, None, None].expand(B, -1, T, 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
            probs = probs.to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return (probs @ vc).transpose(1, 2).reshape(B, T, self.nh * self.hd)


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA). Per position the cache holds the
    normalised kv latent [kv_lora_rank] and one rotary key shared by every head [qk_rope]
    (latent_cache [B, S, r], rope_key_cache [B, S, dr]); keys and values are expanded from the
    latent by kv_b_proj at every call. q.k runs over qk_nope + qk_rope dims per head; the
    values have v_head_dim. The low-rank norms use eps 1e-6 (HF's, not rms_norm_eps)."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        m, bias = a.attention.mla, a.attention.qkv_bias
        self.nh, self.r = a.num_attention_heads, m.kv_lora_rank
        self.dn, self.dr, self.dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        qk = self.dn + self.dr
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(a.hidden_size, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(a.hidden_size, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, self.nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, a.hidden_size, bias=a.attention.o_bias)
        self.rope = Rope(self.dr, a.rope, partial=1.0)
        self.scale = qk**-0.5
        y = a.rope.scaling
        if a.rope.kind == "yarn" and y.mscale_all_dim:  # the softmax scale times mscale^2 (HF yarn_apply_mscale)
            self.scale = self.scale * yarn_mscale(y.factor, y.mscale_all_dim) ** 2
        S = a.max_seq_len
        self.register_buffer("latent_cache", torch.zeros(1, S, self.r, dtype=dtype))
        self.register_buffer("rope_key_cache", torch.zeros(1, S, self.dr, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q, latent, k_rot = self.project(x, pos)
        latents, rope_keys = self.update_cache(latent, k_rot, pos)
        return self.attend(q, latents, rope_keys, pos)

    def project(self, x, pos):
        """q [B, nh, T, dn + dr] (its rotary part rotated), the normalised latent [B, T, r] and
        the rotated shared key [B, T, dr]."""
        B, T, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q_nope, q_rot = self.split_q(q.view(B, T, self.nh, self.dn + self.dr).transpose(1, 2))
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.r, self.dr], dim=-1)
        k_rot = self.rope(k_rot.view(B, 1, T, self.dr), pos)[:, 0]
        return torch.cat((q_nope, self.rope(q_rot, pos)), dim=-1), self.kv_a_layernorm(latent), k_rot

    def split_q(self, q):  # [..., dn + dr] -> the no-rope part, the rotary part
        return torch.split(q, [self.dn, self.dr], dim=-1)

    def update_cache(self, latent, k_rot, pos):
        self.latent_cache[:, pos] = latent
        self.rope_key_cache[:, pos] = k_rot
        return self.latent_cache, self.rope_key_cache

    def attend(self, q, latents, rope_keys, pos):  # keys and values expanded from every cached latent
        B, S = q.shape[0], latents.shape[1]
        kv = self.kv_b_proj(latents).view(B, S, self.nh, self.dn + self.dv).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.dn, self.dv], dim=-1)  # [B, nh, S, dn], [B, nh, S, dv]
        k = torch.cat((k_nope, rope_keys[:, None].expand(B, self.nh, S, self.dr)), dim=-1)
        scores = (q @ k.transpose(2, 3)) * self.scale  # [B, nh, T, S]
        visible = self.cache_pos[None, :] <= pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(B, q.shape[2], self.nh * self.dv))


def l2norm(x, eps=1e-6):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def l2_rms(x, eps):  # Llama 4's weightless q/k norm: x / rms(x), in fp32
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x)


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
        if TAPS is not None:  # the causal conv's output as the recurrence takes it (oracle/points.py)
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
        keep = (pos[0] != 0).to(self.conv_state.dtype)  # a call at position 0 starts a new sequence
        self.conv_state.mul_(keep)
        self.recurrent_state.mul_(keep.float())

    def conv(self, qkv):  # [B, C, T] -> silu(causal depthwise conv) [B, C, T], carrying conv_state
        conv_in = torch.cat([self.conv_state, qkv], dim=-1)  # [B, C, K-1+T]
        self.conv_state.copy_(conv_in[:, :, -(self.K - 1) :])
        return F.silu(F.conv1d(conv_in, self.conv1d.weight, groups=self.conv_dim))

    def delta_rule(self, q, k, v, g, beta):  # carrying recurrent_state
        o, state = gated_delta_rule(q, k, v, g, beta, self.recurrent_state, self.max_len)
        self.recurrent_state.copy_(state)
        return o


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """scores (softmax over all experts, or a sigmoid each; fp32) -> the top-k of the selection
    scores (models.routing: + correction bias, group limit) -> their scores as weights,
    optionally renormalised, times routed_scaling_factor."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        r = a.router
        self.weight = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))
        if r.logit_bias:
            self.bias = nn.Parameter(torch.zeros(a.num_experts))
        if r.correction_bias:  # selection only (DeepSeek-V3's e_score_correction_bias)
            self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts))
        self.top_k, self.norm_topk = a.num_experts_per_tok, r.norm_topk_prob
        self.cast = r.weights_in_model_dtype
        self.softmax_only = (r.scoring == "softmax" and not r.correction_bias and r.n_group <= 1
                             and r.routed_scaling_factor == 1.0 and not r.fp32 and not r.norm_topk_min)

    def forward(self, x):  # x [N, H] -> weights [N, k], indices [N, k]
        bias = getattr(self, "bias", None)
        if self.args.router.fp32:
            logits = F.linear(x.float(), self.weight.float(), None if bias is None else bias.float())
        else:
            logits = F.linear(x, self.weight, bias)
        w, idx = self.route(tap("logits", logits))
        return (w.to(logits.dtype) if self.cast else w), idx

    def route(self, logits):  # [N, E] -> fp32 top-k weights, indices
        if self.softmax_only:
            probs = tap("selection", tap("scores", torch.softmax(logits, dim=-1, dtype=torch.float32)))
            w, idx = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk:
                w = w / w.sum(dim=-1, keepdim=True)
            return tap("weights", w), tap("topk", idx)
        a = self.args  # read at every call: a seeded fault routes by other fields (models/faults.py)
        probs = tap("scores", routing.scores(logits, a))
        bias = self.e_score_correction_bias if a.router.correction_bias else None
        idx = tap("topk", torch.topk(tap("selection", routing.selection(probs, bias, a)), self.top_k, dim=-1).indices)
        # idx is also used by weights(): a node used inside the router is not one of its outputs
        # to ExecuTorch's module-path taps, so the indices leave the router as their own node
        return tap("weights", self.weights(probs, idx)), idx.clone()

    def weights(self, probs, idx):  # the selected experts' scores [N, k], renormalised, scaled
        return routing.topk_weights(probs, idx, self.args, self.norm_topk)


class Experts(nn.Module):
    """Stacked expert weights. Traced (torch.export, torch.compile): a fixed graph with no
    per-expert loop, in one of two forms (`traced_form`, chosen by an exporter per method):
    "gather", each token's k experts' weights gathered by index (right for a decode step, but
    a copy of 100-200 MB per token and layer at real sizes), or "dense", every expert run on
    every token with the weights as they are and the k results picked by index (no weight
    copy; E/k times the arithmetic: for prefill). Eager: tokens grouped by expert, one matmul
    per expert that is hit, so no per-token copy of the weights is made."""

    traced_form = "gather"

    def __init__(self, a: ModelArgs):
        super().__init__()
        E, H, I = a.num_experts, a.hidden_size, a.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))  # gate rows, then up rows
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        if a.experts.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * I))
            self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        self.act = a.experts.activation
        self.limit, self.alpha = a.experts.swiglu_limit, a.experts.swiglu_alpha
        self.on_input = a.router.weights_on_input

    def forward(self, x, idx, w):  # x [N, H], idx/w [N, k]
        if self.on_input:  # Llama 4: each expert's input scaled by its weight (one expert per token)
            y = self.expert_mlp(x, idx, w)  # [N, k, H]
            return y.sum(dim=1).to(x.dtype)
        y = self.expert_mlp(x, idx)  # [N, k, H]
        return (y * w[..., None]).sum(dim=1).to(x.dtype)

    def activation(self, gate, up):  # [..., I] each
        if self.act == "clamped_swiglu":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return gate * torch.sigmoid(gate * self.alpha) * (up + 1)
        return F.silu(gate) * up

    def expert_mlp(self, x, idx, w=None):  # x [N, H], idx [N, k] (w [N, k]: scale the input) -> [N, k, H]
        if not torch.compiler.is_compiling():
            return self.grouped_mlp(x, idx, w)
        if self.traced_form == "dense":
            return self.dense_mlp(x, idx, w)
        xs = x[:, None, :] if w is None else x[:, None, :] * w[..., None].to(x.dtype)  # [N, 1 or k, H]
        gu = (self.gate_up_proj[idx] @ xs[..., None]).squeeze(-1)  # [N, k, 2I]
        if hasattr(self, "gate_up_proj_bias"):
            gu = gu + rows(self.gate_up_proj_bias, idx)
        gate, up = gu.chunk(2, dim=-1)
        y = (self.down_proj[idx] @ self.activation(gate, up)[..., None]).squeeze(-1)
        return y + rows(self.down_proj_bias, idx) if hasattr(self, "down_proj_bias") else y

    def dense_mlp(self, x, idx, w=None):  # traced, "dense": every expert on every token, no weight copy
        E = self.gate_up_proj.shape[0]
        if w is not None:  # the input scaled per expert: each token's weight where it is routed, 0 elsewhere
            scale = torch.where(idx[..., None] == torch.arange(E, device=idx.device), w[..., None], 0.0).sum(1)
            xt = (x[None] * scale.t()[..., None].to(x.dtype)).transpose(1, 2)  # [E, H, N]
        else:
            xt = x.t().unsqueeze(0).expand(E, -1, -1)  # [E, H, N]
        gu = torch.bmm(self.gate_up_proj, xt)  # [E, 2I, N]
        if hasattr(self, "gate_up_proj_bias"):
            gu = gu + self.gate_up_proj_bias[..., None]
        gate, up = gu.chunk(2, dim=1)  # [E, I, N] each
        y = torch.bmm(self.down_proj, self.activation(gate, up))  # [E, H, N]
        if hasattr(self, "down_proj_bias"):
            y = y + self.down_proj_bias[..., None]
        y = y.permute(2, 0, 1)  # [N, E, H]
        return y.gather(1, idx[..., None].expand(-1, -1, y.shape[-1]))  # [N, k, H]

    def grouped_mlp(self, x, idx, w=None):  # eager: per hit expert, its tokens in one matmul
        N, k = idx.shape
        flat = idx.reshape(-1)  # [N k]
        out = x.new_empty(N * k, x.shape[-1])
        bias = hasattr(self, "gate_up_proj_bias")
        for e in flat.unique().tolist():
            slots = (flat == e).nonzero().squeeze(-1)  # positions in [N k]
            xe = x[slots // k]  # [n_e, H]
            if w is not None:
                xe = xe * w.reshape(-1)[slots, None].to(x.dtype)
            gu = F.linear(xe, self.gate_up_proj[e], self.gate_up_proj_bias[e] if bias else None)
            gate, up = gu.chunk(2, dim=-1)  # [n_e, I] each
            out[slots] = F.linear(self.activation(gate, up), self.down_proj[e], self.down_proj_bias[e] if bias else None)
        return out.view(N, k, -1)


def rows(t, idx):  # t [E, D] at idx [N, k] -> [N, k, D], gathered by a flat index (the MLX delegate
    # lowers a 2-D index into a 2-D tensor as a take_along_axis that cannot broadcast: measured)
    return t[idx.reshape(-1)].view(*idx.shape, t.shape[-1])


@contextlib.contextmanager
def traced_experts(model: nn.Module, form: str):
    """Trace `model`'s experts in `form` ("gather" or "dense": see Experts) inside the block."""
    mods = [m for m in model.modules() if isinstance(m, Experts)]
    for m in mods:
        m.traced_form = form
    try:
        yield
    finally:
        for m in mods:
            del m.traced_form  # back to the class default


class SparseMoE(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate = Router(a)
        self.experts = Experts(a)
        self.shared_expert = None
        if a.shared_expert_intermediate_size and a.shared_expert_gated:
            self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size, a.mlp_bias)
            self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)
        elif a.shared_expert_intermediate_size:  # always on, no gate (DeepSeek)
            self.shared_experts = MLP(a.hidden_size, a.shared_expert_intermediate_size, a.mlp_bias)

    def forward(self, x):  # [B, T, H]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x)
        y = self.experts(x, idx, w)
        if self.shared_expert is not None or hasattr(self, "shared_experts"):
            y = y + self.shared(x)
        return y.view(shape)

    def shared(self, x):
        if self.shared_expert is None:  # always on
            return self.shared_experts(x)
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int, dtype=torch.float32):
        super().__init__()
        self.layer_type = a.layer_types[i]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(a, dtype)
        elif a.attention.kind == "mla":
            self.self_attn = LatentAttention(a, dtype)
        else:
            self.self_attn = Attention(a, dtype, i)
        self.mlp = SparseMoE(a) if mlp_type(a, i) == SPARSE else MLP(a.hidden_size, a.intermediate_size, a.mlp_bias)
        self.input_layernorm = norm(a, a.hidden_size)
        self.post_attention_layernorm = norm(a, a.hidden_size)
        self.residual_multiplier = a.multipliers.residual

    @property
    def attn(self) -> nn.Module:
        return self.linear_attn if self.layer_type == LINEAR else self.self_attn

    def forward(self, x, pos):
        if self.residual_multiplier != 1.0:  # Granite
            h = x + self.attn(self.input_layernorm(x), pos) * self.residual_multiplier
            return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_multiplier
        h = x + self.attn(self.input_layernorm(x), pos)
        return h + self.mlp(self.post_attention_layernorm(h))


class Transformer(nn.Module):
    """tokens [B, T] + positions [T] -> logits [B, T, V]; state carried in buffers."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        self.args = a
        # weights come from the checkpoint: no init (normal_ on meta imports torch._dynamo, 2 s)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(a, i, dtype) for i in range(a.num_hidden_layers))
        self.norm = norm(a, a.hidden_size)
        self.lm_head = LMHead(a)

    def forward(self, tokens, pos):
        x = self.embed_tokens(tokens)
        if self.args.multipliers.embedding != 1.0:  # Granite
            x = x * self.args.multipliers.embedding
        for layer in self.layers:
            x = layer(x, pos)
        return self.lm_head(self.norm(x))


class LMHead(nn.Linear):
    """The output projection (with PhiMoE's bias; Granite divides the logits by logits_scaling)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a.hidden_size, a.vocab_size, bias=a.lm_head_bias)
        self.logits_scaling = a.multipliers.logits_scaling

    def forward(self, x):
        y = super().forward(x)
        return y / self.logits_scaling if self.logits_scaling != 1.0 else y


def reset_state(module: nn.Module) -> None:
    """Zero every state buffer under `module` (KV cache, conv and recurrent state)."""
    for name, buf in module.named_buffers():
        if name.rsplit(".", 1)[-1] in STATE_BUFFERS:
            buf.zero_()


def block_fn(model: Transformer, layer: int | None, kind: str):
    """(module to reset, fn(x [1, T, H], pos [T]) -> output) for one block of the production model:
    the module at models.args.block_path (the one (layer, kind) -> module map every backend uses)."""
    module = model.get_submodule(block_path(model.args, layer, kind))
    if kind in ("attention", "layer"):
        return module, module
    if kind == "router":
        return module, lambda x, pos: module(x.reshape(-1, x.shape[-1]))
    return module, lambda x, pos: module(x)
