"""Doge (models/doge.py): the production dynamic mask attention (models/layers/dynamic_mask.py) and product-key MoE
(models/layers/product_key_moe.py) against HF's DogeAttention and DogeCDMoE (transformers 5.23) on the same random
weights, a prefill of 8 then decode steps; the regrouped reference (models.doge.reference: the routing and the key
ranking as modules) against HF's own class, bit for bit; the Doge faults change what they say."""

import pytest
import torch

from models import get_family
from tests.mixers import randomised, same_weights

d = pytest.importorskip("transformers.models.doge.modeling_doge")

P, STEPS = 8, 3  # a prefill of 8 (keep_window 4: from the fifth query on, 4 of its keys), then 3 decode steps


def _config(**over):
    fam = get_family("doge")
    cfg = {**fam.tiny_config, **over}
    c = fam.hf_config(cfg)
    c._attn_implementation = "eager"
    return c, fam.args(cfg, max_seq_len=32)


def _mask(n, start):  # HF's eager causal mask of a call of n tokens after `start` cached ones [1, 1, n, start + n]
    return torch.full((n, start + n), torch.finfo(torch.float32).min).triu(start + 1)[None, None]


def _attention_pair(kv_heads, seed=0):
    from models.layers.dynamic_mask import DynamicMaskAttention

    c, a = _config(num_key_value_heads=kv_heads)
    torch.manual_seed(seed)
    hf = randomised(d.DogeAttention(c, layer_idx=0))
    ours = same_weights(hf, DynamicMaskAttention(a, layer=0).eval(), {"k_cache", "v_cache"})
    return c, hf, ours


def _run_attention(c, hf, ours, xs):
    """HF's attention and ours over the prefill then each decode step: their outputs [1, P + STEPS, H] each."""
    from transformers.cache_utils import DynamicCache

    rope = d.DogeRotaryEmbedding(c)
    cache = DynamicCache(config=c)
    calls = [(0, P)] + [(P + s, 1) for s in range(STEPS)]
    outs_hf, outs = [], []
    with torch.no_grad():
        for start, n in calls:
            x = xs[:, start:start + n]
            pos = torch.arange(start, start + n)
            y, _ = hf(x, rope(x, pos[None]), attention_mask=_mask(n, start), past_key_values=cache)
            outs_hf.append(y)
            outs.append(ours(x, pos))
    return torch.cat(outs_hf, 1), torch.cat(outs, 1)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_dynamic_mask_attention_matches_hf(kv_heads):
    """HF's DogeAttention (its dynamic mask through HF's own prepare_dynamic_mask) and the production attention on
    the same random weights (std 0.3): a prefill of 8 then 3 decode steps, HF's DynamicCache against the static
    cache; one kv head (the tiny config's) and two (a selection per kv head). The same outputs to fp32 rounding;
    the keep window bites (attending to every visible key instead differs by far more)."""
    c, hf, ours = _attention_pair(kv_heads)
    xs = torch.randn(1, P + STEPS, c.hidden_size, generator=torch.Generator().manual_seed(1))
    ref, got = _run_attention(c, hf, ours, xs)
    assert (ref - got).abs().max() < 1e-5, (ref - got).abs().max()
    ours.indexer.k = ours.k_cache.shape[2]  # every visible key kept: the keep window matters
    _, dense = _run_attention(c, hf, ours, xs)
    assert (ref - dense).abs().max() > 1e-2


def test_indexer_returns_the_kept_keys():
    """The production indexer's choice (int64 [B, T, kvh * k]) is HF's top-k of the dynamic mask at every query with
    more visible keys than keep_window (as sets: HF's topk is unsorted), and all visible keys where fewer."""
    from oracle.verdict.selection import indexers

    c, a = _config()
    fam = get_family("doge")
    torch.manual_seed(0)
    ref_cls = fam.hf_class()
    hf = randomised(ref_cls(c), std=0.1)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.A.normal_(0, 0.5)
    from models.layers.transformer import Transformer

    ours = Transformer(a).eval()
    ours.load_state_dict(fam.sanitize(hf.state_dict(), a), strict=False)
    got, want = {}, {}
    for store, model in ((got, ours), (want, hf)):
        for i, m in indexers(model.layers if store is got else model.model.layers).items():
            m.register_forward_hook(lambda mod, args, out, i=i, store=store: store.setdefault(i, out.clone()))
    ids = torch.randint(0, c.vocab_size, (1, P), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours(ids, torch.arange(P))
        hf(ids)
    assert set(got) == set(want) == {0, 1, 2}
    for i in got:
        assert got[i].dtype == torch.int64 and got[i].shape == (1, P, 4)
        for t in range(P):
            visible = lambda row: sorted(int(j) for j in row if int(j) <= t)  # noqa: E731
            assert visible(got[i][0, t]) == visible(want[i][0, t])
            assert len(visible(got[i][0, t])) == min(t + 1, 4)


def test_product_key_moe_matches_hf():
    """HF's DogeCDMoE and the production block on the same random weights: a prefill of 8 tokens (its router's
    logits viewed [2, tokens, keys] across the tokens, as HF's) then 3 single-token calls; the same outputs and
    the same experts (4 of 16 = 4 x 4 product keys)."""
    from models.layers.product_key_moe import ProductKeyMoE

    c, a = _config()
    fam = get_family("doge")
    torch.manual_seed(0)
    hf = randomised(d.DogeCDMoE(c), std=0.3)
    ours = ProductKeyMoE(a).eval()
    sd = fam.sanitize({f"model.layers.0.mlp.{k}": v for k, v in hf.state_dict().items()}, a)
    ours.load_state_dict({k[len("layers.0.mlp."):]: v for k, v in sd.items()})
    xs = torch.randn(1, P + STEPS, c.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        for x in [xs[:, :P]] + [xs[:, P + s:P + s + 1] for s in range(STEPS)]:
            y_hf, _ = hf(x)
            assert (y_hf - ours(x)).abs().max() < 1e-5
        lin = hf.router_gate(xs[:, :P])
        w, idx = ours.gate(xs[0, :P])
        # HF's experts: the top-4 of lx[i] + ly[j] over its view of the call's logits
        lx, ly = lin.view(2, P, -1)
        scores = (lx[:, :, None] + ly[:, None, :]).reshape(P, -1)
        assert torch.equal(idx.sort(-1).values, scores.topk(4, dim=-1).indices.sort(-1).values)
        # per token ([N, 2, K], the fault product_key_halves_per_token) routes otherwise in a prefill
        own = lin.view(P, 2, -1)
        assert not torch.equal(idx.sort(-1).values, (own[:, 0, :, None] + own[:, 1, None, :]).reshape(P, -1).topk(
            4, dim=-1).indices.sort(-1).values)


def test_reference_is_hfs_model():
    """The regrouped reference (the routing as mlp.router, the key ranking as self_attn.indexer) computes HF's own
    DogeForCausalLM's logits bit for bit, prefill and decode; its state dict is HF's."""
    c, _ = _config()
    fam = get_family("doge")
    torch.manual_seed(0)
    ref = randomised(fam.hf_class()(c), std=0.1)
    plain = d.DogeForCausalLM(c).eval()
    assert set(plain.state_dict()) == set(ref.state_dict())
    plain.load_state_dict(ref.state_dict())
    ids = torch.randint(0, c.vocab_size, (1, P), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = ref(ids, use_cache=True), plain(ids, use_cache=True)
        assert torch.equal(a.logits, b.logits)
        nxt = a.logits[:, -1:].argmax(-1)
        assert torch.equal(ref(nxt, past_key_values=a.past_key_values).logits,
                           plain(nxt, past_key_values=b.past_key_values).logits)
    # the router's probe weight: one token's expert logits are linear in it
    x = torch.randn(1, c.hidden_size)
    router = ref.model.layers[0].mlp.router
    assert torch.allclose(router(x)[0], x @ router.weight.T, atol=1e-5)
