"""Port bugs of DeepSeek sparse attention (models/layers/dsa.py): the indexer's head weights on the wrong heads, its
top-k one key short, its key cache not carried into decode, its rotation on the other pairs."""

from __future__ import annotations

import torch

from models.faults.fault import patch
from models.layers.dsa import Indexer


def indexer_of(m) -> Indexer:
    """The indexer a fault modifies: `m` itself, its attention's own, or (a shared layer) the one it reads."""
    return m if isinstance(m, Indexer) else getattr(m, "indexer", None) or m.source


def dsa_index_heads_rolled(m, a):
    """The indexer's per-head weights (weights_proj) applied to the next head's scores (rolled by one head)."""
    ix = indexer_of(m)
    patch(ix, "head_weights", lambda x: torch.roll(Indexer.head_weights(ix, x), 1, dims=-1))


def dsa_topk_off_by_one(m, a):
    """One key fewer chosen than index_topk (k - 1; the best key given twice keeps the choice's shape)."""
    ix = indexer_of(m)

    def choose(scores):
        idx = scores.topk(ix.k - 1, dim=-1).indices
        return torch.cat((idx, idx[..., :1]), dim=-1)

    patch(ix, "choose", choose)


def dsa_index_cache_not_carried(m, a):
    """The indexer's key cache starts empty at every call: the decode scores this call's key and zeros elsewhere."""
    ix = indexer_of(m)

    def update_cache(k, pos):
        keys = Indexer.update_cache(ix, k, pos)
        # this call's keys only (torch.where: IREE 3.13 does not legalize aten.__and__ on i1)
        written = torch.where(ix.cache_pos >= pos[0], ix.cache_pos <= pos[-1], False)[None, :, None]
        return keys * written.to(keys.dtype)

    patch(ix, "update_cache", update_cache)


def dsa_rope_interleave_swapped(m, a):
    """The indexer's rotation on the other pairs: interleaved where the family's is half-split (DeepSeek-V3.2: the
    MLA's own interleaved rotation reused), half-split where it is interleaved (GLM-5)."""
    ix = indexer_of(m)
    ix.rope.interleave = not ix.rope.interleave
