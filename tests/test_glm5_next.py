"""GLM-5.3 (models/glm5_next.py) against transformers 5.23's glm5_next modules on the same random weights: the k-pool
DSA attention (models/layers/dsa_pool.py: the pools' learned key mix, the pools chosen, the query's incomplete pool
kept) is Glm5NextTextAttention's over a prefill and decode steps through HF's cache, and the oracle records the pools
each indexer chose (oracle/verdict/selection.py: a grouped choice) the same on both sides; the whole text model (KDA,
NoPE MLA with the shared indexer, mHC with the mean head) is HF's text tower through its cache."""

import pytest
import torch

from models import get_family
from models.layers.mla import LatentAttention
from tests.mixers import randomised, same_weights

pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

T, P = 11, 8  # a prefill of 8 tokens (pools of 2, 2 kept: from the sixth query on, not every key), 3 decode steps
STATE = {"latent_cache", "rope_key_cache", "indexer.index_key_cache", "indexer.index_gate_cache"}
FAMILY = get_family("glm5_next")


def _setup():
    from transformers.models.glm5_next import modeling_glm5_next as hf

    c = FAMILY.hf_config(FAMILY.tiny_config)
    c._attn_implementation = "eager"
    return hf, c, FAMILY.args(FAMILY.tiny_config, max_seq_len=32)


def _keys(chosen, start):  # per query: the keys it attends to (-1: none), sorted
    return [sorted(int(j) for j in row if int(j) >= 0) for row in chosen[0]]


def test_pooled_attention_is_hfs():
    """HF's indexed attention (layer 1: its own indexer, its choice shared with layer 2) and the production
    LatentAttention with its PooledIndexer (std 0.2 weights), a prefill of 8 then 3 decode steps through HF's cache:
    the same keys for every query and outputs within 1e-5 of their largest value; the oracle's selection log records
    the same pools (the top-k's choice, narrower than the keys returned) on both sides. The sparsity bites (some query
    attends to fewer keys than it sees), and the indexer's key cache not carried into decode (the seeded fault
    dsa_index_cache_not_carried) chooses other keys in decode."""
    from transformers.cache_utils import DynamicCache

    from models.faults.dsa import dsa_index_cache_not_carried
    from oracle.verdict.selection import SelectionLog, visible

    hf, c, args = _setup()
    assert args.attention.dsa.kpool == 2 and args.attention.mla.norm_eps == c.rms_norm_eps
    torch.manual_seed(0)
    ref = randomised(hf.Glm5NextTextAttention(c, 1), std=0.2)
    ours = same_weights(ref, LatentAttention(args, layer=1), STATE | {"indexer.index_selection"})
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(3))
    cache = DynamicCache(config=c)
    logs = SelectionLog({1: ref.indexer}), SelectionLog({1: ours.indexer})
    seen, mine = [], []
    ref.indexer.register_forward_hook(lambda m, a, out: seen.append(out))
    ours.indexer.register_forward_hook(lambda m, a, out: mine.append(out))
    want, got, want_keys, got_keys = [], [], [], []
    with torch.no_grad():
        for start, n in [(0, P)] + [(t, 1) for t in range(P, T)]:
            out, _, _ = ref(x[:, start:start + n], torch.ones(1, n, dtype=torch.bool), past_key_values=cache)
            want.append(out)
            got.append(ours(x[:, start:start + n], torch.arange(start, start + n)))
            want_keys += _keys(seen[-1], start)
            got_keys += _keys(mine[-1], start)
            (_, hp, hs), (_, op, _) = logs[0].entries[-1], logs[1].entries[-1]
            assert hp.shape[-1] <= 2 and visible(op, hs) == visible(hp, hs)  # the pools, as the scores' columns
        dsa_index_cache_not_carried(ours.indexer, args)
        uncarried = []
        for start, n in [(0, P)] + [(t, 1) for t in range(P, T)]:
            ours(x[:, start:start + n], torch.arange(start, start + n))
            uncarried += _keys(mine[-1], start) if start else []
    want, got = torch.cat(want, 1), torch.cat(got, 1)
    assert got_keys == want_keys
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    assert any(len(keys) < p + 1 for p, keys in enumerate(want_keys))
    assert uncarried != want_keys[P:]


def _tiny_pair(seed: int = 0):
    """HF's text tower (the reference's CausalLM) and the production model on the weights the seeded checkpoint draws."""
    from models.layers.transformer import Transformer
    from oracle.source.seeded import draw_weights

    _, c, _ = _setup()
    hf = FAMILY.hf_class()(c).eval()
    draw_weights(hf, seed, c, FAMILY.tiny_std)  # (the seeded checkpoint's weights, in memory)
    a = FAMILY.args(c.to_dict(), 32)
    ours = Transformer(a).eval()
    missing = ours.load_state_dict(FAMILY.sanitize(hf.state_dict(), a), strict=False)
    assert not missing.unexpected_keys and all(k.endswith(("_cache", "_state", "index_selection"))
                                               for k in missing.missing_keys), missing
    return c, hf, ours


def test_whole_model_is_hfs():
    """The tiny config's model (KDA, indexed, shared indexed, indexed, KDA; 4 mHC streams) through a prefill of 8 and 4
    decode steps: HF's logits within 1e-5 of their scale (fp32; measured 4e-7), the same pools chosen by both indexers
    at every call."""
    from oracle.verdict.selection import SelectionLog, indexers, visible

    c, hf, ours = _tiny_pair()
    tower = hf.model.language_model
    logs = SelectionLog(indexers(tower.layers)), SelectionLog(indexers(ours.layers))
    assert sorted(logs[0].call()) == sorted(logs[1].call()) == []
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    want, got, calls = [], [], []
    with torch.no_grad():
        out = hf(ids[:, :P], use_cache=True)
        want.append(out.logits[0])
        got.append(ours(ids[:, :P], torch.arange(P))[0])
        calls.append((logs[0].take(), logs[1].take()))
        for t in range(P, ids.shape[1]):
            out = hf(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            want.append(out.logits[0])
            got.append(ours(ids[:, t:t + 1], torch.tensor([t]))[0])
            calls.append((logs[0].take(), logs[1].take()))
    want, got = torch.cat(want), torch.cat(got)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    for theirs, mine in calls:
        assert sorted(theirs) == sorted(mine) == [1, 3]  # the layers with an indexer of their own
        for layer, (idx, scores) in theirs.items():
            assert visible(mine[layer][0], scores) == visible(idx, scores)
