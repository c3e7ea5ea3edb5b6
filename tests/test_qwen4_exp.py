"""Qwen4-Exp's mechanisms against HF's modules (transformers 5.23 qwen4_exp) on the same random weights: the QSA indexer
(models/layers/qsa.py: the keys each query sees, HF's Qwen4ExpTextQSAIndexer's mask), the n-gram embedding and the
per-layer embeddings (models/layers/ple.py), the gated residual (models/layers/gated_residual.py); each stateful one
as a prefill then decode steps carrying its buffers, against HF's run over the whole sequence. And the regrouped
reference (models.qwen4_exp.reference) against HF's own class: the same logits, bit for bit."""

import pytest
import torch

from models import get_family
from models.layers.gated_residual import GatedResidual
from models.layers.ple import PLE, NGramEmbedding
from models.layers.qsa import QSAIndexer, visible_keys
from models.qwen4_exp import DERIVED, reference
from tests.mixers import randomised, same_weights

q = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")

T, P = 11, 8  # a prefill of 8 tokens, then 3 decode steps
CALLS = [(0, P)] + [(P + i, 1) for i in range(T - P)]
EOS = 255


def _setup():
    fam = get_family("qwen4_exp")
    c = fam.hf_config(fam.tiny_config)
    c._attn_implementation = "eager"
    return c, fam.args(fam.tiny_config, max_seq_len=32)


def _tokens():
    tokens = torch.randint(0, 200, (1, T))
    tokens[0, 4] = EOS  # the hash restarts after it (in the prefill) ...
    tokens[0, P + 1] = EOS  # ... and in decode
    return tokens


def _split(fn):
    """fn(start, n) over the prefill then each decode step, the outputs joined along the sequence."""
    return torch.cat([fn(start, n) for start, n in CALLS], dim=1)


def test_qsa_indexer_matches_hf():
    torch.manual_seed(0)
    c, a = _setup()
    hf = randomised(q.Qwen4ExpTextQSAIndexer(c, 3), std=0.1)
    ours = same_weights(hf, QSAIndexer(a), {"index_key_cache"})
    x = torch.randn(1, T, c.hidden_size)
    cos, sin = q.Qwen4ExpTextRotaryEmbedding(c)(x, torch.arange(T).view(1, 1, -1).expand(3, 1, -1))
    causal = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        want = hf(x, (cos, sin), causal, None)[0, 0]  # [T, T] the keys each query attends to
        cache_pos = torch.arange(32)

        def call(start, n):
            pos = torch.arange(start, start + n)
            return visible_keys(ours(x[:, start:start + n], pos), pos, cache_pos, 2)[..., :T]

        got = _split(call)[0]
    assert torch.equal(got, want)
    assert not torch.equal(want, causal[0, 0] == 0)  # the sparsity bites: some query leaves out keys it could see


def test_ngram_embedding_matches_hf():
    torch.manual_seed(1)
    c, a = _setup()
    hf = randomised(q.Qwen4ExpTextNGramEmbedding(c, c.ple_embed_dim, 0, ple_layer_index=1), std=1.0)
    ours = same_weights(hf, NGramEmbedding(a, 1), {"ngram_context"}, skip=DERIVED)
    tokens = _tokens()
    with torch.no_grad():
        want = hf(tokens, None)
        got = _split(lambda start, n: ours(tokens[:, start:start + n], torch.arange(start, start + n)))
    assert torch.equal(got, want)


def test_ple_matches_hf():
    torch.manual_seed(2)
    c, a = _setup()
    hf = randomised(q.Qwen4ExpTextPLELayer(c, 0, 0), std=0.3)
    ours = same_weights(hf, PLE(a, 0), {"conv_state", "ple_embedding.ngram_context"}, skip=DERIVED)
    tokens, x = _tokens(), torch.randn(1, T, c.hc_count * c.hidden_size)
    with torch.no_grad():
        want = hf(x, tokens, None)
        got = _split(lambda s, n: ours(x[:, s:s + n], tokens[:, s:s + n], torch.arange(s, s + n)))
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)  # (fp32 rounding of the norms and the conv)


@pytest.mark.parametrize("combine", [True, False])
def test_gated_residual_matches_hf(combine):
    torch.manual_seed(3)
    c, a = _setup()
    hf = randomised(q.Qwen4ExpTextGatedResidual(c, use_combine=combine), std=0.3)
    ours = same_weights(hf, GatedResidual(a, combine), set())
    x = torch.randn(1, T, c.hc_count * c.hidden_size)
    with torch.no_grad():
        want, got = hf(x), ours(x)
    for w, g in zip(*((want, got) if combine else ((want,), (got,)))):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


def test_reference_is_hf():
    """The regrouped reference (HF's modules, the indexer's choice and the per-layer embeddings moved) computes HF's
    own logits, bit for bit, over a prefill and decode steps."""
    torch.manual_seed(4)
    c, _ = _setup()
    hf = randomised(q.Qwen4ExpForCausalLM(c), std=0.1)
    ref = reference()(c).eval()
    ref.load_state_dict(hf.state_dict())
    tokens = _tokens()
    with torch.no_grad():
        out = [hf(tokens[:, :P], use_cache=True), ref(tokens[:, :P], use_cache=True)]
        assert torch.equal(out[0].logits, out[1].logits)
        for i in range(P, T):
            out = [m(tokens[:, i:i + 1], past_key_values=o.past_key_values, use_cache=True) for m, o in zip((hf, ref), out)]
            assert torch.equal(out[0].logits, out[1].logits)
