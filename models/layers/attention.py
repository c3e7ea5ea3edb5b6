"""Softmax attention with a static KV cache: grouped-query heads, q/k norms (flat, per head,
weightless), partial rotary or none, an output gate, sinks, sliding and chunked windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import CHUNKED, FULL, SLIDING, ModelArgs, has_sinks, heads
from models.layers.norms import l2_rms, rms_norm
from models.layers.rope import Rope
from models.layers.taps import tap


class Attention(nn.Module):
    """Causal attention over a static KV cache [B, kvh, S, hd]: over every earlier position (FULL),
    the last `sliding_window` (SLIDING) or those in the same `chunk_size` chunk (CHUNKED: AttentionArgs);
    with rope or not (RopeArgs.per_layer), and optionally a learned sink logit per head. A layer's own
    head counts (ModelArgs.layer_heads / layer_kv_heads) and rope (RopeArgs.of_layer: per type, per layer);
    value heads of their own width, scaled (AttentionArgs.v_head_dim, value_scale); a layer's own head width
    (ModelArgs.layer_head_dim); Gemma 4's values: k's projection on FULL layers (k_eq_v), RMS-normed (v_norm)."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        (self.nh, self.kvh), self.hd = heads(a, layer), a.layer_head_dim[layer] if a.layer_head_dim else a.head_dim
        at = a.attention
        kind = a.layer_types[layer]
        self.k_eq_v = at.k_eq_v and kind == FULL  # Gemma 4: v is k's projection (before k's norm and rotation)
        self.v_norm = at.v_norm  # Gemma 4: v RMS-normed per head, no gain
        self.vd, self.value_scale = at.v_head_dim or self.hd, at.value_scale
        self.gated = at.output_gate
        q_out = self.nh * self.hd * (2 if self.gated else 1)
        self.q_proj = nn.Linear(a.hidden_size, q_out, bias=at.qkv_bias)
        self.k_proj = nn.Linear(a.hidden_size, self.kvh * self.hd, bias=at.qkv_bias)
        if not self.k_eq_v:
            self.v_proj = nn.Linear(a.hidden_size, self.kvh * self.vd, bias=at.qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.vd, a.hidden_size, bias=at.o_bias)
        self.qk_norm, self.qk_norm_after_rope = at.qk_norm, at.qk_norm_after_rope
        self.clip = at.clip_qkv  # read at every call: a seeded fault drops it (models/faults/)
        if at.qk_norm == "head":
            self.q_norm = rms_norm(a, self.hd)
            self.k_norm = rms_norm(a, self.hd)
        elif at.qk_norm == "flat":
            self.q_norm = rms_norm(a, self.nh * self.hd)
            self.k_norm = rms_norm(a, self.kvh * self.hd)
        self.use_rope = a.rope.rotates(layer)
        self.rope = Rope(self.hd, a.rope.of_layer(layer, kind))
        self.scale = a.multipliers.attention or self.hd**-0.5
        self.eps = a.rms_norm_eps
        self.window = at.sliding_window if kind == SLIDING else None
        self.chunk = at.chunk_size if kind == CHUNKED else None
        if at.gate_act != "none":  # from the attention's input, per head or per channel (Laguna's g_proj)
            self.gate_act, self.gate_per_head = at.gate_act, at.gate_width == "head"
            self.g_proj = nn.Linear(a.hidden_size, self.nh if self.gate_per_head else self.nh * self.vd, bias=False)
        if has_sinks(a, layer):
            self.sinks = nn.Parameter(torch.zeros(self.nh))
        # Llama 4's no-rope layers scale q with the position
        self.temperature = (at.floor_scale, at.attn_scale) if at.temperature_tuning and not self.use_rope else None
        S = a.max_seq_len
        self.register_buffer("k_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(1, self.kvh, S, self.vd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q, k, v, gate = self.project(x, pos)
        kc, vc = self.update_cache(k, v, pos)
        y = self.attend(q, kc, vc, self.mask(pos))  # [B, T, nh * hd]
        if self.gated:
            y = y * torch.sigmoid(gate)
        if hasattr(self, "g_proj"):
            y = self.projected_gate(x, y)
        return self.o_proj(y)

    def projected_gate(self, x, y):
        """y [B, T, nh * vd] times the activation (fp32) of g_proj(x), one value per head or per channel."""
        g = self.g_proj(x).float()
        g = (F.softplus(g) if self.gate_act == "softplus" else torch.sigmoid(g)).to(y.dtype)
        if not self.gate_per_head:
            return y * g
        B, T, _ = y.shape
        return (y.view(B, T, self.nh, self.vd) * g[..., None]).view(B, T, -1)

    def project(self, x, pos):
        """q [B, nh, T, hd], k/v [B, kvh, T, hd] after q/k norm and RoPE; the output gate."""
        B, T, _ = x.shape
        q, gate = self.q_proj(x), None
        if self.gated:
            q, gate = q.view(B, T, self.nh, 2 * self.hd).chunk(2, dim=-1)
            gate = gate.reshape(B, T, self.nh * self.hd)
        k = self.k_proj(x)
        v = k if self.k_eq_v else self.v_proj(x)
        if self.clip is not None:  # DBRX: the fused Wqkv's output clamped, q, k and v alike
            q, k, v = (t.clamp(min=-self.clip, max=self.clip) for t in (q, k, v))
        if self.qk_norm == "flat":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(B, T, self.nh, self.hd)
        k = k.view(B, T, self.kvh, self.hd)
        if self.qk_norm == "head" and not self.qk_norm_after_rope:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        if self.use_rope:
            q = tap("q_rope", self.rope(q, pos), self.rope.hf_layout)
            k = tap("k_rope", self.rope(k, pos), self.rope.hf_layout)
            if self.qk_norm == "l2":  # Llama 4: weightless, after the rotation, rope layers only
                q, k = l2_rms(q, self.eps), l2_rms(k, self.eps)
        if self.qk_norm == "head" and self.qk_norm_after_rope:  # HunYuan: on the rotated heads [B, h, T, hd]
            q, k = self.q_norm(q), self.k_norm(k)
        if self.temperature is not None:
            floor_scale, attn_scale = self.temperature
            t = torch.log(torch.floor((pos.float() + 1.0) / floor_scale) + 1.0) * attn_scale + 1.0  # [T]
            q = (q * t[:, None]).to(q.dtype)
        v = v.view(B, T, self.kvh, self.vd)
        v = (l2_rms(v, self.eps) if self.v_norm else v).transpose(1, 2)
        return q, k, (v * self.value_scale if self.value_scale != 1.0 else v), gate

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
        return (probs @ vc).transpose(1, 2).reshape(B, T, self.nh * self.vd)
