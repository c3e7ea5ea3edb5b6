"""The seeded DeepSeek sparse attention faults' forms on mlx-lm's indexer (mlx_lm.models.deepseek_v32.Indexer, which
glm_moe_dsa's model reuses): its head weights weights_proj(x) [B, T, h], its index_topk (the argpartition's k), its key
cache (the attention's cache slot 1, a KVCache) and its rope (initialize_rope's, `traditional` the interleaved
rotation)."""

from __future__ import annotations

import mlx.core as mx

from exporters.mlx.model import patch_call


def index_heads_rolled(attn, a):
    """weights_proj's output rolled by one head, as models.faults.dsa.dsa_index_heads_rolled."""
    wp = attn.indexer.weights_proj
    call = type(wp).__call__
    patch_call(wp, lambda self, x: mx.roll(call(self, x), 1, axis=-1))


def topk_off_by_one(attn, a):
    attn.indexer.index_topk -= 1


def index_cache_not_carried(attn, a):
    """The indexer's cached keys zeroed before every call (positions kept, what was written before lost): the
    decode scores this call's key and zeros elsewhere, as models.faults.dsa.dsa_index_cache_not_carried."""
    ix = attn.indexer
    call = type(ix).__call__

    def fn(self, x, qr, mask, cache=None):
        if cache is not None and cache.keys is not None:
            cache.keys, cache.values = mx.zeros_like(cache.keys), mx.zeros_like(cache.values)
        return call(self, x, qr, mask, cache)

    patch_call(ix, fn)


def rope_interleave_swapped(attn, a):
    rope = attn.indexer.rope
    rope.traditional = not rope.traditional


FAULTS = {"dsa_index_heads_rolled": index_heads_rolled, "dsa_topk_off_by_one": topk_off_by_one,
          "dsa_index_cache_not_carried": index_cache_not_carried,
          "dsa_rope_interleave_swapped": rope_interleave_swapped}
