"""DeepSeek-V4's mechanisms (models/layers/compressed_attention.py, compressed_kv.py, hash_router.py) against HF's
modules (transformers 5.23 deepseek_v4: DeepseekV4Attention with its CSA / HCA compressors, their indexer and the
CSA / HCA cache layers; DeepseekV4HashRouter) on the same random weights: a prefill of the default prompt's 8
tokens, then decode steps through HF's DynamicCache (its running compressor buffers, overlap state and emitted
entries) and the production modules' buffers (compress_kv, compress_gate, k_cache)."""

import pytest
import torch

from models import get_family
from models.layers.compressed_attention import CompressedAttention
from models.layers.hash_router import HashRouter
from tests.mixers import randomised, same_weights

pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

P, T = 8, 13  # the default prompt, then 5 decode steps (CSA every 2, HCA every 4: entries close in the decode too)
CALLS = [(0, P)] + [(t, 1) for t in range(P, T)]
STATE = {"k_cache", "compressor.compress_kv", "compressor.compress_gate", "compressor.indexer.compress_kv",
         "compressor.indexer.compress_gate"}


def _setup():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    fam = get_family("deepseek_v4")
    c = fam.hf_config(fam.tiny_config)
    c._attn_implementation = "eager"
    return hf, c, fam.args(fam.tiny_config, max_seq_len=32)


def _hf_attention_run(hf, c, attn, xs, layer):
    """HF's attention of `layer` over CALLS with its own cache: (outputs [1, T, H], the indexer's choices per call)."""
    from transformers.cache_utils import DynamicCache

    rotary, cache, outs, chosen = hf.DeepseekV4RotaryEmbedding(c), DynamicCache(config=c), [], []
    idx = getattr(getattr(attn, "compressor", None), "indexer", None)
    handle = idx.register_forward_hook(lambda m, a, o: chosen.append(o)) if idx is not None else None
    for start, n in CALLS:
        x, pos = xs[:, start:start + n], torch.arange(start, start + n)[None]
        mask = _window_mask(start, n, c.sliding_window)
        pe = {k: rotary(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        outs.append(attn(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, past_key_values=cache)[0])
    if handle is not None:
        handle.remove()
    return torch.cat(outs, 1), chosen


def _window_mask(start, n, window):
    """HF's eager sliding-window mask of a call of n tokens after `start` (its cache keeps window - 1 keys)."""
    kept = min(start, window - 1)
    q = torch.arange(start, start + n)[:, None]
    k = torch.arange(start - kept, start + n)[None, :]
    visible = (k <= q) & (q - k < window)
    return torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


def _ours_run(ours, xs):
    chosen = []
    idx = getattr(getattr(ours, "compressor", None), "indexer", None)
    handle = idx.register_forward_hook(lambda m, a, o: chosen.append(o)) if idx is not None else None
    outs = [ours(xs[:, s:s + n], torch.arange(s, s + n)) for s, n in CALLS]
    if handle is not None:
        handle.remove()
    return torch.cat(outs, 1), chosen


def _valid(chosen):  # per query: its valid picks (HF marks a window not closed yet -1), as a sorted list
    return [sorted(int(j) for j in row if int(j) >= 0) for call in chosen for row in call[0]]


@pytest.mark.parametrize("layer", [0, 1, 2], ids=["hca", "sliding", "csa"])
def test_attention_matches_hf(layer):
    """The production attention of each layer type against HF's on the same random weights (std 0.1) and input: a
    prefill of 8 then 5 decode steps, HF's cache against the production buffers. CSA (ratio 2, index_topk 2): every
    query kept the same entries as HF's indexer (the sparsity bites: 4 entries closed after the prompt), HCA (ratio 4)
    every closed window's entry, a window of 4 on all three."""
    hf, c, a = _setup()
    torch.manual_seed(layer)
    ref = randomised(hf.DeepseekV4Attention(c, layer), std=0.1)
    ours = same_weights(ref, CompressedAttention(a, torch.float32, layer), {s for s in STATE if
                                                                              s in CompressedAttention(a, torch.float32, layer).state_dict()})
    xs = torch.randn(1, T, c.hidden_size)
    with torch.no_grad():
        want, hf_chosen = _hf_attention_run(hf, c, ref, xs, layer)
        got, our_chosen = _ours_run(ours, xs)
    assert (got - want).abs().max() < 2e-6, (got - want).abs().max()
    if layer == 2:
        assert _valid(our_chosen) == _valid(hf_chosen)
        assert max(len(r) for r in _valid(hf_chosen)) == 2  # index_topk entries of more: the choice bites
        assert sum(len(r) for r in _valid(hf_chosen)) < sum(min(4, (p + 1) // 2) for p in range(T))


def test_hash_router_matches_hf():
    """HF's hash router and the production one: the experts tid2eid[token] (not a top-k of the scores), their
    sqrt(softplus) scores renormalised and times routed_scaling_factor."""
    hf, c, a = _setup()
    torch.manual_seed(0)
    ref = randomised(hf.DeepseekV4HashRouter(c), std=0.1)
    ref.tid2eid.copy_(torch.stack([torch.randperm(8)[:2] for _ in range(c.vocab_size)]))
    ours = same_weights(ref, HashRouter(a), set())
    x, tokens = torch.randn(6, c.hidden_size), torch.randint(0, c.vocab_size, (6,))
    with torch.no_grad():
        _, w_ref, i_ref = ref(x, tokens)
        w, i = ours(x, tokens)
    assert torch.equal(i, i_ref) and torch.allclose(w, w_ref, atol=1e-6)
