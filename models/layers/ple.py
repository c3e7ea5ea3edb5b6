"""Qwen4-Exp's per-layer embeddings (HF's Qwen4ExpTextPLELayer and Qwen4ExpTextNGramEmbedding), added to the gated
residual's streams (models/layers/gated_residual.py) before some LINEAR layers' blocks.

The n-gram embedding: for n = 2..ngram_size, `heads_per_ngram` tables, each of a prime size p (the primes from
vocab_base on, numbered across the model's PLE layers), indexed by (t0 m0 ^ t-1 m1 ^ ... ^ t-(n-1) m(n-1)) mod p
(int64 products wrapping, odd multipliers m from splitmix64 of the seed and the layer's PLE index), where t-s is the
token s positions back, or `eos` where an eos lies between (the hash restarts after each eos; the sequence starts
after one). The last ngram_size - 1 tokens are carried into decode (`ngram_context`).

The layer: e = the heads' embeddings concatenated; per stream s a gate g_s = <RMSNorm(key_proj(e))_s,
RMSNorm(streams)_s> / sqrt(H), signed-square-rooted; v_s = sigmoid(g_s) value_proj(e); the output v + silu(a dilated
depthwise causal conv (kernel conv_kernel, dilation ngram_size) of RMSNorm(v)), its last (kernel - 1) * dilation
inputs carried (`conv_state`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.gated_residual import GroupedRMSNorm

MASK64 = (1 << 64) - 1
GAMMA, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
LAYER_PRIME = 10007


def splitmix64(x: int) -> int:
    x = (x + GAMMA) & MASK64
    x = ((x ^ (x >> 30)) * MIX1) & MASK64
    x = ((x ^ (x >> 27)) * MIX2) & MASK64
    return x ^ (x >> 31)


def multipliers(vocab: int, n: int, index: int, seed: int) -> list[int]:
    """The hash's odd multipliers of one PLE layer (its `index` among them), one per token of the n-gram."""
    half = max(1, ((1 << 63) - 1) // max(vocab, 1) // 2)
    base = seed + LAYER_PRIME * index
    return [2 * (splitmix64((base + GAMMA * (i + 1)) & MASK64) % half) + 1 for i in range(n)]


def is_prime(v: int) -> bool:
    return v == 2 or (v > 2 and v % 2 == 1 and all(v % d for d in range(3, math.isqrt(v) + 1, 2)))


def table_sizes(base: int, first: int, count: int) -> list[int]:
    """The prime sizes of `count` tables: the (first + 1)-th prime from `base` on, and the next ones."""
    primes, v = [], base - 1
    while len(primes) < first + count:
        v += 1
        if is_prime(v):
            primes.append(v)
    return primes[first:]


class NGramEmbedding(nn.Module):
    def __init__(self, a: ModelArgs, index: int):
        super().__init__()
        p = a.ple
        self.n, self.per, self.eos = p.ngram_size, p.heads_per_ngram, p.eos
        heads = (self.n - 1) * self.per
        sizes = table_sizes(p.vocab_base, index * heads, heads)
        offsets = [sum(sizes[:i]) for i in range(heads)]
        rows = math.ceil(sum(sizes) / p.divisible_by) * p.divisible_by
        self.ngram_embedding = nn.Embedding(rows, p.embed_dim // heads, _weight=torch.empty(rows, p.embed_dim // heads))
        self.register_buffer("mult", torch.tensor(multipliers(a.vocab_size, self.n, index, p.seed)), persistent=False)
        self.register_buffer("sizes", torch.tensor(sizes), persistent=False)
        self.register_buffer("offsets", torch.tensor(offsets), persistent=False)
        self.register_buffer("ngram_context", torch.zeros(1, self.n - 1, dtype=torch.int64))
        # the call's token ids [B, T] at [:, :T], written by the model (or a block's caller: feed_tokens) before the
        # call, as DeepSeek-V4's hash routers read them: the layer's own input stays HF's (the streams alone)
        self.register_buffer("call_tokens", torch.zeros(1, a.max_seq_len, dtype=torch.int64), persistent=False)

    def forward(self, tokens, pos):  # tokens [B, T] (None: call_tokens[:, :len(pos)]) -> [B, T, embed_dim]
        if tokens is None:
            tokens = self.call_tokens[:, : pos.shape[0]]
        start = (pos[0] == 0).to(torch.int64)  # a new sequence: the context is eos
        ctx = self.ngram_context * (1 - start) + self.eos * start
        hist = torch.cat([ctx.expand(tokens.shape[0], -1), tokens.long()], dim=-1)  # [B, n - 1 + T]
        self.ngram_context.copy_(hist[:1, -(self.n - 1):])
        back = [self.shifted(hist, s)[:, self.n - 1:] for s in range(self.n)]  # the token s back, per position
        ids = []
        for n in range(2, self.n + 1):
            mixed = back[0] * self.mult[0]
            for s in range(1, n):
                mixed = torch.bitwise_xor(mixed, back[s] * self.mult[s])
            heads = slice((n - 2) * self.per, (n - 1) * self.per)
            ids.append(torch.remainder(mixed[..., None], self.sizes[heads]) + self.offsets[heads])
        return self.ngram_embedding(torch.cat(ids, dim=-1)).flatten(-2)

    def shifted(self, hist, s: int):
        """hist shifted right by s: the token s back, or eos where an eos lies in the s tokens back (or before the
        history's start)."""
        if s == 0:
            return hist
        pad = torch.full_like(hist[:, :s], self.eos)
        back = torch.cat([pad, hist[:, :-s]], dim=-1)
        # (a count, not a boolean or: IREE 3.13 does not legalize aten.__or__ on i1)
        eos_between = sum((torch.cat([pad[:, :j], hist[:, :-j]], dim=-1) == self.eos).to(torch.int64)
                          for j in range(1, s + 1))
        return torch.where(eos_between > 0, self.eos, back)


class PLE(nn.Module):
    """(streams [B, T, N * H], tokens [B, T] or None, pos [T]) -> what the layer's per-layer embeddings add to the
    streams (inside the layer, before its blocks, as HF's Qwen4ExpTextDecoderLayer adds them)."""

    def __init__(self, a: ModelArgs, index: int, dtype=torch.float32):
        super().__init__()
        p, g = a.ple, a.gated_residual
        self.n, self.h = g.streams, a.hidden_size
        C = self.n * self.h
        self.ple_embedding = NGramEmbedding(a, index)
        self.key_proj = nn.Linear(p.embed_dim, C, bias=False)
        self.value_proj = nn.Linear(p.embed_dim, self.h, bias=False)
        self.norm_key = GroupedRMSNorm(C, self.h, a.rms_norm_eps)
        self.norm_query = GroupedRMSNorm(C, self.h, a.rms_norm_eps)
        self.norm_conv = GroupedRMSNorm(C, self.h, a.rms_norm_eps)
        self.dilation = p.ngram_size
        self.conv1d = nn.Conv1d(C, C, p.conv_kernel, groups=C, dilation=self.dilation, bias=False)
        self.L = (p.conv_kernel - 1) * self.dilation
        self.register_buffer("conv_state", torch.zeros(1, C, self.L, dtype=dtype))

    def forward(self, streams, tokens, pos):  # tokens None: the ids the caller wrote (feed_tokens)
        e = self.ple_embedding(tokens, pos)
        key = self.norm_key(self.key_proj(e)).unflatten(-1, (self.n, self.h))
        query = self.norm_query(streams).unflatten(-1, (self.n, self.h))
        gate = self.gate((key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.h))  # [B, T, N, 1]
        v = (torch.sigmoid(gate) * self.value_proj(e).unsqueeze(-2)).flatten(-2)  # [B, T, N * H]
        return v + self.conv(self.norm_conv(v), pos)

    def gate(self, g):  # the signed square root
        return g.abs().clamp_min(1e-6).sqrt() * g.sign()

    def conv(self, x, pos):  # [B, T, C] -> silu(the dilated causal conv) [B, T, C], carrying conv_state
        self.conv_state.mul_((pos[0] != 0).to(self.conv_state.dtype))
        x = torch.cat([self.conv_state, x.transpose(1, 2)], dim=-1)  # [B, C, L + T]
        self.conv_state.copy_(x[:, :, -self.L:])
        return F.silu(F.conv1d(x, self.conv1d.weight, groups=x.shape[1], dilation=self.dilation)).transpose(1, 2)
