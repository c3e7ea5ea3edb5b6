"""Qwen4-Exp's QSA sparse attention (HF's Qwen4ExpTextQSAIndexer and Qwen4ExpTextAttention): the gated full attention
(models/layers/attention.py) of a FULL layer attends, for each query, to the keys of the complete blocks its indexer
chooses and to those after its last complete block; the others are masked.

The indexer: index_qk_proj(x) gives n_heads queries and one key of head_dim per position; the queries (1 + w)
RMS-normed and rotated at their positions with the attention's own frequencies (its rotary dims, the first of the
index head); the keys cached raw (`index_key_cache`, carried into decode). A block is compress_ratio consecutive keys
from position 0 on; complete for a query at position p where it ends at or before p. A block's key is the keys' mean
(in fp32, then the model's dtype), (1 + w) RMS-normed, rotated at the block's first position; the score of block b for
query t is sum over heads of relu(q[t, h] . key[b]) / sqrt(head_dim), in fp32; the best budget / compress_ratio
complete blocks chosen. Its forward returns that choice, int64 block indices [B, T, k] (judged as a routing decision:
oracle/verdict/selection.py; a query with fewer complete blocks than k also gets incomplete ones, scored -inf, which
choose nothing)."""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.layers.attention import Attention
from models.layers.norms import RMSNorm
from models.layers.rope import Rope


class QSAIndexer(nn.Module):
    """(x [B, T, H], pos [T]) -> the chosen blocks, int64 [B, T, k]."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        s = a.qsa
        self.nh, self.hd, self.r = s.n_heads, s.head_dim, s.compress_ratio
        self.index_qk_proj = nn.Linear(a.hidden_size, (self.nh + 1) * self.hd, bias=False)
        self.q_layernorm = RMSNorm(self.hd, a.rms_norm_eps, offset=True)
        self.k_layernorm = RMSNorm(self.hd, a.rms_norm_eps, offset=True)
        # the attention's rotary dims and frequencies, on the first of the index head's dims
        self.rope = Rope(int(a.head_dim * a.rope.partial_rotary_factor), a.rope, partial=1.0)
        S = a.max_seq_len
        self.nb = S // self.r  # the blocks a static cache holds
        self.k = min(s.blocks, self.nb)
        self.register_buffer("index_key_cache", torch.zeros(1, S, self.hd, dtype=dtype))
        self.register_buffer("block_pos", torch.arange(self.nb) * self.r, persistent=False)

    def forward(self, x, pos):
        B, T, _ = x.shape
        q, key = self.project(x)
        q = self.rope(self.q_layernorm(q.view(B, T, self.nh, self.hd)).transpose(1, 2), pos)  # [B, nh, T, hd]
        keys = self.block_keys(self.update_cache(key, pos))  # [1, nb, hd]
        scores = self.scores(q, keys)  # [B, T, nb]
        complete = (self.block_pos[None, :] + self.r) <= (pos[:, None] + 1)  # [T, nb]
        return self.choose(scores.masked_fill(~complete, float("-inf")))

    def project(self, x):  # (queries [B, T, nh * hd], key [B, T, hd])
        return self.index_qk_proj(x).split([self.nh * self.hd, self.hd], dim=-1)

    def update_cache(self, key, pos):
        self.index_key_cache[:, pos] = key
        return self.index_key_cache

    def block_keys(self, cache):
        blocks = cache[:, : self.nb * self.r].unflatten(1, (self.nb, self.r)).float().mean(dim=2).to(cache.dtype)
        return self.rope(self.k_layernorm(blocks), self.block_pos)

    def scores(self, q, keys):
        per_head = torch.relu(q.float() @ keys.float().transpose(-1, -2)[:, None])  # [B, nh, T, nb]
        return per_head.sum(dim=1) / self.hd**0.5

    def choose(self, scores):
        return scores.topk(self.k, dim=-1).indices


def visible_keys(chosen, pos, cache_pos, r: int, causal=None):
    """[B, T, S] bool: the keys a query sees, those of its chosen complete blocks and the causal ones after its last
    complete block, all within `causal` [T, S] (the attention's own mask, Attention.mask; None: key <= query). A
    complete block's keys are all causal: the bound changes nothing in this model, and holds every key to the mask a
    port (or a seeded fault) computes."""
    block = cache_pos // r  # [S]
    complete = block[None, :] < ((pos + 1) // r)[:, None]  # [T, S]: the key's block is complete for the query
    causal = cache_pos[None, :] <= pos[:, None] if causal is None else causal
    # (a sum, not any(); a where, not a boolean and/or: the lowerings' limits, as models/layers/dsa.py)
    in_chosen = (chosen[..., None] == block).sum(dim=-2) > 0  # [B, T, S]
    return torch.where(complete, torch.where(causal, in_chosen, False), causal)


class QSAAttention(Attention):
    """The gated full attention with QSA's choice of keys; its indexer a submodule named `indexer`."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        self.indexer = QSAIndexer(a, dtype)
        self.r = a.qsa.compress_ratio

    def forward(self, x, pos):
        chosen = self.indexer(x, pos)
        q, k, v, gate = self.project(x, pos)
        kc, vc = self.update_cache(k, v, pos)
        y = self.attend(q, kc, vc, visible_keys(chosen, pos, self.cache_pos, self.r, self.mask(pos))[:, None])
        if self.gated:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y)
