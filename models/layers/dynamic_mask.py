"""Doge's dynamic mask attention (HF's DogeAttention): grouped-query softmax attention (per-head q/k RMSNorm before
the rotation) whose scores get a learned, input-dependent bias per key, and only the keep_window keys with the
largest bias are attended to by each query.

    dt[b, h, s] = exp(A[h] * softplus(dt_proj(v[b, s, :])[h]))     v: the cached values of all kv heads, [kvh * hd]
    bias[b, h, t, s] = dt[b, h, s] where key s is visible from query t, else masked
    kept = the keep_window keys of largest bias per (kv head, query)  (the indexer: DynamicMaskIndexer)
    scores = q.k * hd^-0.5 + bias on the kept keys, masked elsewhere; softmax in fp32

HF computes the mask in prepare_dynamic_mask and ranks the keys with topk only when the cache holds more than
keep_window keys; ranking the static cache's S positions with the invisible ones at -inf keeps the same keys (all
visible ones when there are at most keep_window). The choice is exposed as a submodule named `indexer` whose forward
returns it (oracle/verdict/selection.py judges it like a routing decision): int64 [B, T, kvh * k], the k keys of kv
head 0, then of head 1, ..., ranked off a [B, T, kvh, S] tensor (the scores' rows per query). With one kv head (the
tiny config's) that is the harness's [B, T, k]; with more, the harness compares the union of the heads' keys.

Export-friendly: the mask is the comparison of the chosen indices with the cache positions (no scatter), and the
bias of every cache position is recomputed from the value cache at each call, as HF recomputes it from its cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.attention import Attention


class DynamicMaskIndexer(nn.Module):
    """(bias [B, kvh, T, S] with the invisible keys at -inf) -> the kept keys, int64 [B, T, kvh * k]."""

    def __init__(self, keep: int, S: int):
        super().__init__()
        self.k = min(keep, S)

    def forward(self, bias):
        B, kvh, T, S = bias.shape
        return self.choose(bias.transpose(1, 2)).reshape(B, T, kvh * self.k)  # ranked per (query, kv head)

    def choose(self, ranked):  # [B, T, kvh, S] -> [B, T, kvh, k]
        return ranked.topk(self.k, dim=-1).indices


def kept_mask(chosen, kvh: int, cache_pos):
    """[B, kvh, T, S] bool: True at the keys chosen ([B, T, kvh * k] indices into the cache's S positions)."""
    B, T, _ = chosen.shape
    per_head = chosen.view(B, T, kvh, -1).transpose(1, 2)  # [B, kvh, T, k]
    # (a sum, not any(): as models/layers/dsa.py's chosen_mask, for the MLX delegate's interpreter)
    return (per_head[..., None] == cache_pos).sum(dim=-2) > 0


class DynamicMaskAttention(Attention):
    """Attention (q/k norms, rope, GQA, static KV cache) with Doge's dynamic mask: A [kvh], dt_proj
    (kvh * hd -> kvh) and the indexer keeping AttentionArgs.keep_window keys per query."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        self.A = nn.Parameter(torch.zeros(self.kvh))
        self.dt_proj = nn.Linear(self.kvh * self.hd, self.kvh, bias=a.attention.qkv_bias)
        self.indexer = DynamicMaskIndexer(a.attention.keep_window, a.max_seq_len)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q, k, v, _ = self.project(x, pos)
        kc, vc = self.update_cache(k, v, pos)
        visible = self.mask(pos)  # [T, S]
        bias = self.dynamic_bias(vc)[:, :, None, :].masked_fill(~visible, float("-inf"))  # [B, kvh, T, S]
        chosen = self.indexer(bias)
        kept = torch.where(kept_mask(chosen, self.kvh, self.cache_pos), visible, False)
        return self.o_proj(self.attend_biased(q, kc, vc, bias, kept))

    def dynamic_bias(self, vc):
        """[B, kvh, S]: exp(A * softplus(dt_proj(values))) of every cached position (all kv heads' values, flat)."""
        B, _, S, _ = vc.shape
        dt = self.dt_proj(vc.transpose(1, 2).reshape(B, S, -1))  # [B, S, kvh]
        return torch.exp(self.A * F.softplus(dt)).transpose(1, 2)

    def attend_biased(self, q, kc, vc, bias, kept):
        """softmax(q.k * scale + bias) over the kept keys (bias [B, kvh, T, S], kept [B, kvh, T, S] bool)."""
        B, _, T, _ = q.shape
        rep = self.nh // self.kvh
        kc = kc.repeat_interleave(rep, dim=1)  # [B, nh, S, hd]
        vc = vc.repeat_interleave(rep, dim=1)
        bias, kept = bias.repeat_interleave(rep, dim=1), kept.repeat_interleave(rep, dim=1)
        scores = (q @ kc.transpose(2, 3)) * self.scale + torch.where(kept, bias, 0.0).to(q.dtype)  # [B, nh, T, S]
        scores = scores.masked_fill(~kept, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return (probs @ vc).transpose(1, 2).reshape(B, T, self.nh * self.vd)
