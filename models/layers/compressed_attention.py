"""DeepSeek-V4's attention (HF's DeepseekV4Attention): shared-KV multi-query attention, one key head of head_dim read
as the values too, over a sliding window of the last `sliding_window` positions plus a compressed layer's entries
(models/layers/compressed_kv.py: HCA every closed window's, CSA the indexer's choice), with a learned sink logit per
head (fp32) in the softmax.

q = q_b_proj(q_a_norm(q_a_proj(x))) per head RMS-normed without a gain; kv = kv_norm(kv_proj(x)); both rotated on
their trailing qk_rope_head_dim dims (interleaved pairs) with the main rope (sliding-only layers: ModelArgs.rope's
`sliding`) or the compress rope (compressed layers); the output's rope slice rotated back at the query's position
(the values carry the keys' rotation), then the grouped output projection: o_groups blocks of heads each projected to
o_lora_rank (o_a_proj, one weight [o_groups * o_lora_rank, heads * head_dim / o_groups]), then o_b_proj.

Export-friendly: the keys in a static cache (k_cache [1, S, head_dim]) carried into decode, the window a mask."""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.layers.compressed_kv import Compressor, TailRope
from models.layers.norms import RMSNorm
from models.layers.taps import tap


class GroupedLinear(nn.Linear):
    """HF's DeepseekV4GroupedLinear: x [..., g, d] -> [..., g, r], group i through rows i*r..(i+1)*r of the weight."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__(in_per_group, out_features, bias=False)
        self.groups = groups

    def forward(self, x):
        shape, d = x.shape[:-2], x.shape[-1]
        w = self.weight.view(self.groups, -1, d).transpose(1, 2)  # [g, d, r]
        y = torch.bmm(x.reshape(-1, self.groups, d).transpose(0, 1), w).transpose(0, 1)  # [N, g, r]
        return y.reshape(*shape, self.groups, -1)


def unweighted_rms(x, eps):  # HF's DeepseekV4UnweightedRMSNorm: the factor computed in fp32, applied in x's dtype
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class CompressedAttention(nn.Module):
    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        c = a.attention.compressed
        self.nh, self.hd, self.eps = a.num_attention_heads, a.head_dim, a.rms_norm_eps
        self.q_a_proj = nn.Linear(a.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(c.q_lora_rank, a.rms_norm_eps, gain_fp32=True)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.nh * self.hd, bias=False)
        self.kv_proj = nn.Linear(a.hidden_size, self.hd, bias=False)
        self.kv_norm = RMSNorm(self.hd, a.rms_norm_eps, gain_fp32=True)
        self.groups = c.o_groups
        self.o_a_proj = GroupedLinear(self.nh * self.hd // c.o_groups, c.o_groups * c.o_lora_rank, c.o_groups)
        self.o_b_proj = nn.Linear(c.o_groups * c.o_lora_rank, a.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.nh))  # fp32 (models.args.kept_fp32)
        self.rope = TailRope(c.qk_rope_head_dim, a.rope.of_layer(layer, a.layer_types[layer]))
        if c.ratios[layer]:
            self.compressor = Compressor(a, dtype, layer)
        self.window, self.scale = a.attention.sliding_window, self.hd**-0.5
        S = a.max_seq_len
        self.register_buffer("k_cache", torch.zeros(1, S, self.hd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        B, T, _ = x.shape
        q_resid = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms(self.q_b_proj(q_resid).view(B, T, self.nh, self.hd).transpose(1, 2), self.eps)
        q = tap("q_rope", self.rope(q, pos), lambda t: t[..., -self.rope.dim :])  # [B, nh, T, hd]
        kv = self.rope(self.kv_norm(self.kv_proj(x)), pos)  # [B, T, hd]
        keys, visible = self.update_cache(kv, pos), self.mask(pos)[None].expand(B, -1, -1)  # [B, S, hd], [B, T, S]
        if hasattr(self, "compressor"):
            entries, seen = self.compressor(x, q_resid, pos)
            keys, visible = torch.cat((keys, entries), dim=1), torch.cat((visible, seen), dim=-1)
        y = self.attend(q, keys, visible)  # [B, nh, T, hd]
        y = self.rope(y, pos, inverse=True).transpose(1, 2).reshape(B, T, self.groups, -1)
        return self.o_b_proj(self.o_a_proj(y).flatten(2))

    def update_cache(self, kv, pos):
        self.k_cache[:, pos] = kv
        return self.k_cache

    def mask(self, pos):
        """[T, S] True where key position s is within the window of query position pos[t] (causal)."""
        visible = self.cache_pos[None, :] <= pos[:, None]
        return torch.where(pos[:, None] - self.cache_pos[None, :] < self.window, visible, False)

    def attend(self, q, keys, visible):  # q [B, nh, T, hd], keys [B, K, hd] (the values too), visible [B, T, K]
        B, _, T, _ = q.shape
        scores = (q @ keys.transpose(-1, -2)[:, None]) * self.scale  # [B, nh, T, K]
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        sink = self.sinks[None, :, None, None].expand(B, -1, T, 1)  # (fp32: the softmax in fp32, as HF's cat promotes)
        logits = torch.cat((scores, sink.to(torch.promote_types(scores.dtype, sink.dtype))), dim=-1)
        probs = torch.softmax(logits - logits.amax(dim=-1, keepdim=True), dim=-1, dtype=logits.dtype)[..., :-1]
        return probs.to(q.dtype) @ keys[:, None]
