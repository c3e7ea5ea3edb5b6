"""ZAYA's compressed convolutional attention (CCA, HF 5.23's ZayaCCAProjection + ZayaQKNorm + ZayaAttention), with its
two states carried from prefill to decode in buffers:

    pq, pk = q_proj(x) [T, nh*hd], k_proj(x) [T, kvh*hd]
    q_res  = (pq + repeat_kv(pk)) / 2 per head;  k_res = q_res's mean over each kv head's group of q heads
    conv   = grouped_conv(depthwise_conv([conv_state | (pq | pk)]))   causal: the last (t0 - 1) + (t1 - 1) inputs carried
    q, k   = conv's q part + q_res, conv's k part + k_res
    v      = (v_proj_current(x) | v_proj_delayed(x) one token late), viewed as kvh heads   the last token's delayed
                                                                                              projection carried
    q, k   = q, k l2-normed to sqrt(hd) (k then times a learned scale per kv head: `temp`), rotated (partial rotary)

then the usual causal (or sliding-window) attention over the KV cache and o_proj."""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.layers.attention import Attention
from models.layers.state import reset_at_start
from models.layers.taps import tap


class CCAProjection(nn.Module):
    """HF's qkv_proj (ZayaCCAProjection): q, k [B, T, heads, hd] and v [B, T, kvh, hd]."""

    def __init__(self, a: ModelArgs, nh: int, kvh: int, hd: int, dtype=torch.float32):
        super().__init__()
        H, t0, t1 = a.hidden_size, a.zaya.cca_time0, a.zaya.cca_time1
        self.nh, self.kvh, self.hd = nh, kvh, hd
        self.q_proj = nn.Linear(H, nh * hd, bias=False)
        self.k_proj = nn.Linear(H, kvh * hd, bias=False)
        self.v_proj_current = nn.Linear(H, kvh * hd // 2, bias=False)
        self.v_proj_delayed = nn.Linear(H, kvh * hd // 2, bias=False)
        C = (nh + kvh) * hd
        self.conv_qk_depthwise = nn.Conv1d(C, C, t0, groups=C)
        self.conv_qk_grouped = nn.Conv1d(C, C, t1, groups=nh + kvh)
        self.K = (t0 - 1) + (t1 - 1)
        # the last K inputs of the convolution (HF's conv state) and the last token's delayed value projection
        # (HF's recurrent state); zero at a sequence's start (HF pads the conv with zeros; its first delayed value
        # is v_proj_delayed of zeros, 0 without a bias)
        self.register_buffer("conv_state", torch.zeros(1, C, self.K, dtype=dtype))
        self.register_buffer("recurrent_state", torch.zeros(1, 1, kvh * hd // 2, dtype=dtype))
        self.carried = True  # read at every call: a seeded fault drops the carried states (models/faults/zaya.py)
        self.delayed = True  # read at every call: a seeded fault takes the delayed half from the current token

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        reset_at_start(pos, self.conv_state, self.recurrent_state)
        if not self.carried:  # (the fault: every call a new sequence)
            self.conv_state.zero_()
            self.recurrent_state.zero_()
        B, T, _ = x.shape
        pq, pk = self.q_proj(x), self.k_proj(x)
        rep = self.nh // self.kvh
        q_res = (pq.view(B, T, self.nh, self.hd) + pk.view(B, T, self.kvh, self.hd).repeat_interleave(rep, dim=2)) * 0.5
        k_res = q_res.view(B, T, self.kvh, rep, self.hd).mean(dim=-2)
        conv_in = torch.cat([self.conv_state, torch.cat([pq, pk], dim=-1).transpose(1, 2)], dim=-1)  # [B, C, K + T]
        self.conv_state.copy_(conv_in[:, :, -self.K:])
        y = self.conv_qk_grouped(self.conv_qk_depthwise(conv_in))  # [B, C, T]
        y = tap("conv", y, lambda t: t.transpose(1, 2)).transpose(1, 2)  # [B, T, C]
        q = y[..., :self.nh * self.hd].reshape(B, T, self.nh, self.hd) + q_res
        k = y[..., self.nh * self.hd:].reshape(B, T, self.kvh, self.hd) + k_res
        current, dly = self.v_proj_current(x), self.v_proj_delayed(x)
        late = torch.cat([self.recurrent_state, dly], dim=1)  # [B, 1 + T, kvh*hd/2]
        self.recurrent_state.copy_(late[:, -1:])
        v = torch.cat([current, late[:, :-1] if self.delayed else dly], dim=-1).view(B, T, self.kvh, self.hd)
        return q, k, v


class CCAAttention(Attention):
    """ZAYA's attention: CCA's q, k, v; q and k l2-normed to sqrt(hd), k times `qk_norm.temp` per kv head; partial
    rotary per layer type; causal or sliding-window attention over the static KV cache; o_proj."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        del self.q_proj, self.k_proj, self.v_proj  # (CCA's own, under qkv_proj)
        self.qkv_proj = CCAProjection(a, self.nh, self.kvh, self.hd, dtype)
        self.qk_norm = nn.Module()  # HF's ZayaQKNorm holds the key scale
        self.qk_norm.temp = nn.Parameter(torch.zeros(self.kvh))
        self.root = self.hd**0.5

    def project(self, x, pos):
        q, k, v = self.qkv_proj(x, pos)
        eps = torch.finfo(q.dtype).eps
        q = q * (self.root / q.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * (self.root / k.norm(p=2, dim=-1, keepdim=True).clamp_min(eps))
        k = k * self.qk_norm.temp[None, None, :, None]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.use_rope:
            q = tap("q_rope", self.rope(q, pos), self.rope.hf_layout)
            k = tap("k_rope", self.rope(k, pos), self.rope.hf_layout)
        return q, k, v, None

