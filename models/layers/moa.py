"""JetMoE's mixture of attention heads (MoA): each token routes to k of E attention experts; expert e
owns a query projection [kvh * hd, H] and an output projection [H, kvh * hd]; keys and values come from
one shared projection (kv_proj) and are cached once; the k experts' query heads (k * kvh of them) attend
over the shared kv heads tiled k times (head j * kvh + g reads kv head g, HF's `repeat`), their outputs
go through their experts' output projections, weighted by the routing gates (softmax over the top-k
logits) and summed, plus a bias."""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.layers.rope import Rope
from models.layers.taps import tap


class MixtureOfAttention(nn.Module):
    """x [B, T, H] at positions pos [T] -> [B, T, H], over a static KV cache [B, kvh, S, hd]."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        E, H = a.num_experts, a.hidden_size
        self.kvh, self.hd, self.k = a.num_key_value_heads, a.head_dim, a.num_experts_per_tok
        D = self.kvh * self.hd
        self.router = nn.Linear(H, E, bias=False)  # the attention experts' router (its logits in fp32)
        self.q_experts = nn.Parameter(torch.zeros(E, D, H))  # each expert's query projection
        self.o_experts = nn.Parameter(torch.zeros(E, H, D))  # each expert's output projection
        self.o_bias = nn.Parameter(torch.zeros(H))
        self.kv_proj = nn.Linear(H, 2 * D, bias=False)  # keys then values, shared by the experts
        self.rope = Rope(self.hd, a.rope)
        self.scale = self.hd**-0.5
        # how the k experts' query heads read the shared kv heads: "tile" (head j * kvh + g reads kv head g,
        # HF's repeat); a seeded fault interleaves them (models/faults/)
        self.kv_repeat = "tile"
        S = a.max_seq_len
        self.register_buffer("k_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(1, self.kvh, S, self.hd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        B, T, H = x.shape
        xf = x.reshape(-1, H)  # [N, H]
        top, idx = self.router(xf).float().topk(self.k, dim=-1)  # [N, k], the slots in top-k order
        gates = torch.softmax(top, dim=-1).to(x.dtype)
        flat = idx.reshape(-1)  # a flat index (the MLX delegate takes no 2-D gather into a 2-D tensor)
        wq = self.q_experts[flat].view(-1, self.k, *self.q_experts.shape[1:])  # [N, k, D, H]
        q = (wq @ xf[:, None, :, None]).squeeze(-1)  # [N, k, D]
        k, v = self.kv_proj(x).chunk(2, dim=-1)
        q = q.reshape(B, T, self.k * self.kvh, self.hd).transpose(1, 2)  # [B, k kvh, T, hd]
        k = k.reshape(B, T, self.kvh, self.hd).transpose(1, 2)
        v = v.reshape(B, T, self.kvh, self.hd).transpose(1, 2)
        q = tap("q_rope", self.rope(q, pos))
        k = tap("k_rope", self.rope(k, pos))
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        if self.kv_repeat == "tile":
            kc, vc = self.k_cache.repeat(1, self.k, 1, 1), self.v_cache.repeat(1, self.k, 1, 1)
        else:
            kc, vc = self.k_cache.repeat_interleave(self.k, dim=1), self.v_cache.repeat_interleave(self.k, dim=1)
        scores = (q @ kc.transpose(2, 3)) * self.scale  # [B, k kvh, T, S]
        scores = scores.masked_fill(~(self.cache_pos[None, :] <= pos[:, None]), float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = (probs @ vc).transpose(1, 2).reshape(-1, self.k, self.kvh * self.hd)  # [N, k, D]
        wo = self.o_experts[flat].view(-1, self.k, *self.o_experts.shape[1:])  # [N, k, H, D]
        y = (wo @ o[..., None]).squeeze(-1)  # [N, k, H]
        y = (y * gates[..., None]).sum(dim=1) + self.o_bias
        return y.view(B, T, H)
