"""The seeded block-sparse attention faults' forms on mlx-lm's MiniMax-M3 attention (mlx_lm.models.minimax_m3_vl.
Attention, whose indexer is inline: index_{q,k}_proj, its block mask built by `_block_mask`, its keys in the
attention's cache slot 1): the block mask rebuilt as mlx-lm builds it with the fault's one change (its heads tiled,
its blocks expanded a key late), its index_topk_blocks one less, its local blocks none, its key cache zeroed."""

from __future__ import annotations

import mlx.core as mx

from exporters.mlx.model import patch_call, patch_method


def _block_mask(attn, x, mask, offset, cache, shift: int = 0, tiled: bool = False):
    """mlx-lm 0.32.2's Attention._block_mask (the same steps), with the keys' block taken `shift` keys later and the
    index heads' choices tiled over the q heads where `tiled`."""
    B, L, _ = x.shape
    H, D = attn.index_n_heads, attn.index_head_dim
    k = attn.index_k_norm(attn.index_k_proj(x).reshape(B, L, 1, D)).transpose(0, 2, 1, 3)
    k = attn.index_rope(k, offset=offset)
    if cache is not None:
        k, _ = cache.update_and_fetch(k, mx.zeros((B, 1, L, 0), k.dtype))
    bs, topk, S = attn.index_block_size, attn.index_topk_blocks, k.shape[2]
    full_blocks, tail_keys = divmod(S, bs)
    n_blocks = full_blocks + bool(tail_keys)
    if topk >= n_blocks:
        return mask
    q = attn.index_q_norm(attn.index_q_proj(x).reshape(B, L, H, D)).transpose(0, 2, 1, 3)
    q = attn.index_rope(q, offset=offset)
    qpos = mx.arange(S - L, S)
    causal = mx.arange(S)[None] <= qpos[:, None]
    scores = q.astype(mx.float32) @ k.astype(mx.float32).swapaxes(-1, -2)
    per_key = mask if isinstance(mask, mx.array) else causal
    scores = mx.where(per_key, scores, -mx.inf)
    split = full_blocks * bs
    block_scores = scores[..., :split].reshape(B, H, L, full_blocks, bs).max(axis=-1)
    if tail_keys:
        block_scores = mx.concatenate([block_scores, scores[..., split:].max(axis=-1, keepdims=True)], axis=-1)
    if attn.index_local_blocks > 0:
        q_block = (qpos // bs)[:, None]
        ids = mx.arange(n_blocks)
        block_scores = mx.where((ids <= q_block) & (ids > q_block - attn.index_local_blocks), mx.inf, block_scores)
    inds = mx.argpartition(-block_scores, kth=topk - 1, axis=-1)[..., :topk]
    keep = mx.put_along_axis(mx.zeros(block_scores.shape, dtype=mx.bool_), inds, mx.array(True), axis=-1)
    # each key's block (shift 0: mlx-lm's repeat); a key shifted past the last block is in none (as the production
    # fault's static cache: the block after the query's is never chosen)
    keep = mx.concatenate([keep, mx.zeros((*keep.shape[:-1], 1), dtype=mx.bool_)], axis=-1)
    keep = keep[..., (mx.arange(S) + shift) // bs] & per_key
    g = attn.num_attention_heads // H
    return mx.tile(keep, (1, g, 1, 1)) if tiled else mx.repeat(keep, g, axis=1)


def heads_tiled(attn, a):
    """Each index head's choice given to the q heads tiled, as models.faults.block_sparse.block_sparse_heads_tiled."""
    patch_method(attn, "_block_mask", lambda self, x, mask, offset, cache: _block_mask(self, x, mask, offset, cache,
                                                                                       tiled=True))


def block_off_by_one(attn, a):
    """The chosen blocks expanded to keys a key late, as models.faults.block_sparse.block_sparse_block_off_by_one."""
    patch_method(attn, "_block_mask",
                 lambda self, x, mask, offset, cache: _block_mask(self, x, mask, offset, cache, shift=1))


def topk_off_by_one(attn, a):
    attn.index_topk_blocks -= 1


def local_block_dropped(attn, a):
    attn.index_local_blocks = 0


def index_cache_not_carried(attn, a):
    """The indexer's cached keys zeroed before every call (its cache slot 1: positions kept, what was written before
    lost), as models.faults.block_sparse.block_sparse_index_cache_not_carried."""
    call = type(attn).__call__

    def fn(self, x, mask=None, cache=None):
        ix = cache[1] if cache is not None else None
        if ix is not None and ix.keys is not None:
            ix.keys, ix.values = mx.zeros_like(ix.keys), mx.zeros_like(ix.values)
        return call(self, x, mask, cache)

    patch_call(attn, fn)


FAULTS = {"block_sparse_heads_tiled": heads_tiled, "block_sparse_topk_off_by_one": topk_off_by_one,
          "block_sparse_block_off_by_one": block_off_by_one,
          "block_sparse_index_cache_not_carried": index_cache_not_carried,
          "block_sparse_local_block_dropped": local_block_dropped}
