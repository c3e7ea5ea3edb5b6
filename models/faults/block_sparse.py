"""Port bugs of MiniMax-M3's block-sparse attention (models/layers/block_sparse.py): each indexer head's choice of
blocks given to the wrong q heads, one block fewer kept than index_topk_blocks, a block's keys one position off
where the blocks are expanded to keys, the indexer's key cache not carried into decode, the local block not kept."""

from __future__ import annotations

import torch

from models.args import ModelArgs
from models.faults.fault import Fault, patch
from models.layers.block_sparse import BlockIndexer, BlockSparseAttention


def _sparse(attn) -> BlockSparseAttention:
    if not isinstance(attn, BlockSparseAttention):
        raise TypeError(f"a block-sparse fault on {type(attn).__name__} (the target layer is not block-sparse)")
    return attn


def block_sparse_heads_tiled(attn, a):
    """Each indexer head's choice given to the q heads tiled (head h's to q heads h, h + n, ...) where HF gives it
    to its kv head's group (h·g .. h·g + g - 1: repeat_interleave)."""
    attn = _sparse(attn)
    patch(attn, "q_heads", lambda keep: keep.repeat(1, attn.group, 1, 1))


def block_sparse_topk_off_by_one(attn, a):
    """One block fewer kept than index_topk_blocks (k - 1; the best block given twice keeps the choice's shape)."""
    ix = _sparse(attn).indexer

    def choose(block_scores):
        top, idx = block_scores.topk(ix.k - 1, dim=-1)
        idx = idx.masked_fill(top == float("-inf"), -1)
        return torch.cat((idx, idx[..., :1]), dim=-1)

    patch(ix, "choose", choose)


def block_sparse_block_off_by_one(attn, a):
    """The chosen blocks expanded to keys one position late: key s taken for block (s + 1) // block_size, so a
    block's first key is left out and the next block's first let in."""
    attn = _sparse(attn)
    patch(attn, "key_blocks", lambda: (attn.cache_pos + 1) // attn.indexer.bs)


def block_sparse_index_cache_not_carried(attn, a):
    """The indexer's key cache starts empty at every call: the decode scores this call's key and zeros elsewhere."""
    ix = _sparse(attn).indexer

    def update_cache(k, pos):
        keys = BlockIndexer.update_cache(ix, k, pos)
        # this call's keys only (torch.where: IREE 3.13 does not legalize aten.__and__ on i1)
        written = torch.where(ix.cache_pos >= pos[0], ix.cache_pos <= pos[-1], False)[None, :, None]
        return keys * written.to(keys.dtype)

    patch(ix, "update_cache", update_cache)


def block_sparse_local_block_dropped(attn, a):
    """The local blocks not forced into the choice (their +inf left out): each query keeps the best-scored blocks
    alone."""
    ix = _sparse(attn).indexer

    def block_scores(scores, pos):
        B, nh, T, S = scores.shape
        pad = ix.blocks * ix.bs - S
        if pad:
            scores = torch.nn.functional.pad(scores, (0, pad), value=float("-inf"))
        return scores.view(B, nh, T, ix.blocks, ix.bs).amax(dim=-1)

    patch(ix, "block_scores", block_scores)


def _block_sparse(a: ModelArgs) -> bool:  # the last softmax-attention layer (the faults' target) block-sparse
    b = a.attention.block_sparse
    return b is not None and bool(b.layers) and bool(b.layers[-1])


BLOCK_SPARSE: tuple[Fault, ...] = (
    Fault("block_sparse_heads_tiled", "attention", "full", "block-sparse attention: each indexer head's choice of "
          "blocks given to the q heads tiled, not to its kv head's group", block_sparse_heads_tiled,
          lambda a: _block_sparse(a) and a.num_attention_heads > a.attention.block_sparse.index_n_heads > 1),
    Fault("block_sparse_topk_off_by_one", "attention", "full", "block-sparse attention: index_topk_blocks - 1 blocks "
          "kept", block_sparse_topk_off_by_one, lambda a: _block_sparse(a) and a.attention.block_sparse.topk_blocks > 1),
    Fault("block_sparse_block_off_by_one", "attention", "full", "block-sparse attention: the chosen blocks expanded "
          "to keys one position late", block_sparse_block_off_by_one,
          lambda a: _block_sparse(a) and a.attention.block_sparse.block_size > 1),
    Fault("block_sparse_index_cache_not_carried", "attention", "full", "block-sparse attention: the indexer's key "
          "cache not carried into decode", block_sparse_index_cache_not_carried, _block_sparse),
    Fault("block_sparse_local_block_dropped", "attention", "full", "block-sparse attention: the query's local blocks "
          "not forced into the choice", block_sparse_local_block_dropped,
          lambda a: _block_sparse(a) and a.attention.block_sparse.local_blocks > 0),
)

# the indexer's choice where it is the indexer's own bug; the attention's context where the choice is right and its
# expansion to keys or heads is wrong
POINTS = {"block_sparse_heads_tiled": "context", "block_sparse_topk_off_by_one": "indexer",
          "block_sparse_block_off_by_one": "context", "block_sparse_index_cache_not_carried": "indexer",
          "block_sparse_local_block_dropped": "indexer"}
