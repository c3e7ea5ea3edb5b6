"""MiniMax-M3's block-sparse attention (models/layers/block_sparse.py) against HF's modules (transformers 5.23
minimax_m3_vl: MiniMaxM3VLIndexer, MiniMaxM3VLAttention of a `minimax_m3_sparse` layer) on the same random weights:
a prefill of 8 tokens, then 3 decode steps through HF's cache (MiniMaxM3VLSparseCacheLayer: its indexer keys) and the
production module's buffers (index_key_cache). The tiny config's blocks of 2 keys, 2 kept per query and head (its
own and the best other), so from the fifth query on each attends to at most 4 of its keys."""

import numpy as np
import pytest
import torch

from models import get_family
from models.layers.block_sparse import BlockIndexer, BlockSparseAttention
from tests.mixers import randomised, same_weights

hf = pytest.importorskip("transformers.models.minimax_m3_vl.modeling_minimax_m3_vl")

T, P = 11, 8
CALLS = [(0, P)] + [(t, 1) for t in range(P, T)]
STATE = {"k_cache", "v_cache", "indexer.index_key_cache"}


def _setup():
    fam = get_family("minimax_m3_vl")
    c = fam.hf_config(fam.tiny_config)
    c._attn_implementation = "eager"
    return c, fam.args(fam.tiny_config, max_seq_len=32)


def _mask(n, start):  # HF's eager causal mask of a call of n tokens after `start` cached ones [1, 1, n, start + n]
    return torch.full((n, start + n), torch.finfo(torch.float32).min).triu(start + 1)[None, None]


def _sets(chosen, start):
    """Per (query, head): the chosen blocks (without -1), as sorted lists; chosen [1, heads, n, k]."""
    return [[sorted(int(b) for b in chosen[0, h, i] if b >= 0) for h in range(chosen.shape[1])]
            for i in range(chosen.shape[2])]


def _run(fn):
    outs, choices = [], []
    for start, n in CALLS:
        out, chosen = fn(start, n)
        outs.append(out)
        choices += _sets(chosen, start)
    return torch.cat(outs, 1), choices


def test_block_sparse_attention_is_hfs():
    """HF's sparse layer (layer 1) and the production BlockSparseAttention (random weights, std 0.2): the same blocks
    chosen by every query and indexer head, their own block always among them; the outputs within 1e-5 of their largest
    value (fp32 rounding; measured ~1e-7). The sparsity bites: the same attention keeping every block differs by more
    than 0.05 of it. Each seeded fault (models/faults/block_sparse.py) changes the choice or the output, the key cache
    not carried the decode's alone."""
    from transformers.cache_utils import DynamicCache

    from models.faults import block_sparse as faults

    c, args = _setup()
    torch.manual_seed(0)
    ref = randomised(hf.MiniMaxM3VLAttention(c, 1), std=0.2)
    assert ref.indexer is not None
    rotary = hf.MiniMaxM3VLRotaryEmbedding(c)
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(3))

    def ours_fresh(fault=None):
        m = same_weights(ref, BlockSparseAttention(args, layer=1), STATE)
        if fault is not None:
            fault(m, args)
        seen = []
        m.indexer.register_forward_hook(lambda mod, a, out: seen.append(out))
        return lambda start, n: (m(x[:, start:start + n], torch.arange(start, start + n)), seen[-1])

    cache, seen = DynamicCache(config=c), []
    ref.indexer.register_forward_hook(lambda m, a, out: seen.append(out))

    def hf_call(start, n):
        pos = torch.arange(start, start + n)
        out = ref(x[:, start:start + n], rotary(x, pos[None]), _mask(n, start), past_key_values=cache,
                  position_ids=pos[None])[0]
        return out, seen[-1]

    with torch.no_grad():
        want, want_keys = _run(hf_call)
        got, got_keys = _run(ours_fresh())
        runs = {f.__name__: _run(ours_fresh(f)) for f in (
            faults.block_sparse_heads_tiled, faults.block_sparse_topk_off_by_one, faults.block_sparse_block_off_by_one,
            faults.block_sparse_index_cache_not_carried, faults.block_sparse_local_block_dropped)}
        every = _run(ours_fresh(lambda m, a: setattr(m.indexer, "k", m.indexer.blocks)))[0]
    scale = want.abs().max()
    assert got_keys == want_keys
    assert all(p // 2 in heads for p, per in enumerate(got_keys) for heads in per)  # the local block kept
    assert all(len(heads) == 2 for per in got_keys[4:] for heads in per)  # from the fifth query, 2 of its blocks
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (every - want).abs().max() > 0.05 * scale
    for name, (out, keys) in runs.items():
        moved = (out - want).abs().max() > 1e-3 * scale
        if name == "block_sparse_index_cache_not_carried":
            assert keys[:P] == want_keys[:P] and keys[P:] != want_keys[P:], name
        assert moved, name


def test_block_indexer_alone_is_hfs():
    """HF's MiniMaxM3VLIndexer and the production BlockIndexer fed the same x (std 0.3 weights): the same blocks, in
    the same [B, heads, T, k] layout with -1 where a slot has no visible block (the first two queries: one block)."""
    from transformers.cache_utils import DynamicCache

    c, args = _setup()
    torch.manual_seed(1)
    ref = randomised(hf.MiniMaxM3VLIndexer(c, 1))
    ours = same_weights(ref, BlockIndexer(args), {"index_key_cache"})
    rotary = hf.MiniMaxM3VLRotaryEmbedding(c)
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(2))
    cache = DynamicCache(config=c)
    with torch.no_grad():
        for start, n in CALLS:
            pos = torch.arange(start, start + n)
            want = ref(x[:, start:start + n], rotary(x, pos[None]), cache, pos[None])
            got = ours(x[:, start:start + n], pos)
            assert got.dtype == torch.int64 and got.shape == want.shape == (1, 2, n, 2)
            assert torch.equal(got.sort(-1).values, want.sort(-1).values)
    assert (want >= 0).all()


def test_per_head_choice_recorded_per_query():
    """oracle.verdict.selection's per-head rows: [B, heads, T, k] -> one row per query of entries block · heads +
    head, the scores laid out [blocks, heads] so that the entry indexes its score (whatever number of blocks a side
    scores); per_head gives the choice back."""
    from oracle.verdict.selection import per_head, per_query

    idx = np.array([[[[0, -1], [1, 0]], [[0, -1], [1, 2]]]])  # [1, 2 heads, 2 queries, 2]
    scores = np.arange(2 * 2 * 3, dtype=np.float32).reshape(1, 2, 2, 3)  # 3 blocks
    rows, flat = per_query(idx, scores)
    assert rows.tolist() == [[[0, -1, 1, -1], [2, 0, 3, 5]]]
    assert flat.shape == (1, 2, 6)
    assert flat[0, 1, 5] == scores[0, 1, 1, 2] and flat[0, 1, 2] == scores[0, 0, 1, 1]
    back = per_head(rows, 2, 2)
    assert back.tolist() == [[[[0, -1], [0, 1]], [[0, -1], [1, 2]]]]
