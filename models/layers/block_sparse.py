"""MiniMax-M3's block-sparse attention: its softmax attention (GQA, per-head (1+w) q/k norms, partial rotary) on
the `minimax_m3_sparse` layers attends, per query and kv head, only to the keys of the blocks of keys its block
indexer chose (AttentionArgs.block_sparse: models/block_sparse_args.py).

The block indexer (HF's MiniMaxM3VLIndexer, a submodule named `indexer` as there): queries q_proj(x)
[index_n_heads, index_head_dim] and one key per position k_proj(x) [index_head_dim], each RMS-normed ((1+w), per
head) and rotated on its first rotary dims with the attention's frequencies; the score of key t for query s and
head h is q[s, h] · k[t] in fp32 (no scale, no weights), keys after the query at -inf; the scores max-pooled over
blocks of block_size keys (block b: keys [b·block_size, (b+1)·block_size)); the local_blocks blocks ending at the
query's own (pos // block_size) scored +inf, so always chosen; the top min(topk_blocks, blocks) blocks by score
kept per query and head, a block with no visible key (-inf) given as -1.

**Its forward returns that choice as HF's does: block indices, int64 [B, index_n_heads, T, k], one choice per
indexer head** (index_n_heads == num_key_value_heads: head h's choice serves q heads h·g .. h·g + g - 1, g =
num_attention_heads / index_n_heads, as HF's repeat_interleave). The oracle records a per-head choice as one row
per query (oracle/verdict/selection.py: entry block · heads + head into the head scores laid out [blocks, heads]),
and judges it as a routing decision.

Export-friendly: the indexer's keys in a static buffer (index_key_cache [1, S, index_head_dim]) carried from the
prefill into decode; the blocks pooled over the whole cache (S padded to whole blocks), the local blocks marked by
comparisons (no scatter), the block mask by index comparison."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.attention import Attention
from models.layers.norms import rms_norm
from models.layers.rope import Rope


def is_block_sparse(a: ModelArgs, layer: int) -> bool:
    b = a.attention.block_sparse
    return b is not None and bool(b.layers) and bool(b.layers[layer])


class BlockIndexer(nn.Module):
    """(x [B, T, H], pos [T]) -> the blocks each query and indexer head keeps, int64 [B, nh, T, k] (-1: none)."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        b = a.attention.block_sparse
        self.nh, self.hd, self.bs = b.index_n_heads, b.index_head_dim, b.block_size
        self.local = b.local_blocks
        self.q_proj = nn.Linear(a.hidden_size, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(a.hidden_size, self.hd, bias=False)
        self.q_norm = rms_norm(a, self.hd)
        self.k_norm = rms_norm(a, self.hd)
        rotary = int(a.head_dim * a.rope.partial_rotary_factor)  # the attention's rotary dims (HF: cos[..., :hd])
        self.rope = Rope(self.hd, a.rope, partial=min(rotary, self.hd) / self.hd)
        S = a.max_seq_len
        self.blocks = -(-S // self.bs)
        self.k = min(b.topk_blocks, self.blocks)
        self.register_buffer("index_key_cache", torch.zeros(1, S, self.hd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)
        self.register_buffer("block_ids", torch.arange(self.blocks), persistent=False)

    def forward(self, x, pos):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.nh, self.hd)).transpose(1, 2)  # [B, nh, T, hd]
        k = self.k_norm(self.k_proj(x).view(B, T, 1, self.hd)).transpose(1, 2)  # [B, 1, T, hd]
        q, k = self.rope(q, pos), self.rope(k, pos)
        keys = self.update_cache(k[:, 0], pos)  # [1, S, hd]
        scores = self.index_scores(q, keys)  # [B, nh, T, S] fp32
        visible = self.cache_pos[None, :] <= pos[:, None]  # [T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        return self.choose(self.block_scores(scores, pos))

    def update_cache(self, k, pos):
        self.index_key_cache[:, pos] = k
        return self.index_key_cache

    def index_scores(self, q, keys):
        return q.float() @ keys.float().transpose(-1, -2)[:, None]  # [B, nh, T, hd] @ [1, 1, hd, S]

    def query_blocks(self, pos):  # [T]: the block of each query's position
        return pos // self.bs

    def block_scores(self, scores, pos):
        """[B, nh, T, blocks]: each block's best key score, the local blocks (the query's and the local - 1 before
        it) +inf."""
        B, nh, T, S = scores.shape
        pad = self.blocks * self.bs - S
        if pad:
            scores = F.pad(scores, (0, pad), value=float("-inf"))
        pooled = scores.view(B, nh, T, self.blocks, self.bs).amax(dim=-1)
        back = self.query_blocks(pos)[:, None] - self.block_ids[None, :]  # [T, blocks]
        local = torch.where(back >= 0, back < self.local, False)  # (torch.where: no aten.__and__ on i1 for IREE)
        return torch.where(local, float("inf"), pooled)

    def choose(self, block_scores):
        top, idx = block_scores.topk(self.k, dim=-1)  # by score, best first (HF's order)
        return idx.masked_fill(top == float("-inf"), -1)


class BlockSparseAttention(Attention):
    """Attention (models/layers/attention.py) whose every query attends, per q head, to the visible keys of the
    blocks its kv head's indexer choice keeps."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        self.indexer = BlockIndexer(a, dtype)
        self.group = self.nh // self.indexer.nh  # the q heads one indexer head's choice serves
        if self.group * self.indexer.nh != self.nh:
            raise ValueError(f"block-sparse attention: {self.nh} q heads over {self.indexer.nh} indexer heads")

    def forward(self, x, pos):
        q, k, v, _ = self.project(x, pos)
        kc, vc = self.update_cache(k, v, pos)
        keep = self.kept_keys(self.indexer(x, pos))  # [B, nh, T, S]
        visible = torch.where(keep, self.mask(pos), False)
        return self.o_proj(self.attend(q, kc, vc, visible))

    def key_blocks(self):  # [S]: the block of each cached key
        return self.cache_pos // self.indexer.bs

    def kept_keys(self, chosen):
        """[B, nh (q heads), T, S] bool: the keys in the blocks chosen (chosen [B, index heads, T, k]), each indexer
        head's for its group of q heads."""
        # (a sum, not any(): as models/layers/dsa.py's chosen_mask, for the MLX delegate)
        keep = (chosen[..., None] == self.key_blocks()).sum(dim=-2) > 0  # [B, ih, T, S]
        return self.q_heads(keep)

    def q_heads(self, keep):  # [B, ih, T, S] -> [B, nh, T, S]: head h's for q heads h·g .. h·g + g - 1
        return keep.repeat_interleave(self.group, dim=1)
