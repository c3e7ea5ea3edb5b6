"""A.X-K2 (models/axk2.py) against HF's modules (transformers 5.23 axk2) on the same random weights: its gated RMSNorm
(AXK2GatedRMSNorm: models/layers/gated_norm.py) and its DSA attention with the fused q/gate projection (AXK2Attention:
models/layers/mla_gated.py), a prefill of 8 then 3 decode steps through HF's cache; each beside the seeded fault that
breaks it (models/faults/dsa2.py)."""

import pytest
import torch

from models.layers.gated_norm import LowRankGatedRMSNorm
from models.layers.mla_gated import GatedLatentAttention
from tests.mixers import randomised, same_weights
from tests.test_dsa import CALLS, P, STATE, T, _hf, _mask, _run

pytest.importorskip("transformers.models.axk2.modeling_axk2")


def test_gated_norm_is_hfs():
    """AXK2GatedRMSNorm and the production norm on the same random weights (std 0.3): equal to 1e-6 of the largest
    value (fp32; measured 0-2e-7), in bf16 within one bf16 rounding; without its gate (the seeded fault
    axk2_norm_gate_dropped) off by more than 0.1 of it."""
    from models.faults.dsa2 import axk2_norm_gate_dropped

    hf, c, args = _hf("axk2")
    torch.manual_seed(0)
    ref = randomised(hf.AXK2GatedRMSNorm(c))
    ours = same_weights(ref, LowRankGatedRMSNorm(args), set())
    x = torch.randn(2, 5, c.hidden_size, generator=torch.Generator().manual_seed(1)) * 3
    with torch.no_grad():
        want, got = ref(x), ours(x)
        want16, got16 = ref.to(torch.bfloat16)(x.bfloat16()), ours.to(torch.bfloat16)(x.bfloat16())
        layer = type("L", (), {"input_layernorm": ours.float()})()
        axk2_norm_gate_dropped(layer, args)
        ungated = ours(x)
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-6 * scale
    assert got16.dtype == torch.bfloat16 and (got16.float() - want16.float()).abs().max() <= 2**-7 * scale
    assert (ungated - want).abs().max() > 0.1 * scale


def test_gated_sparse_attention_is_hfs():
    """AXK2Attention (layer 0, its indexer) and the production GatedLatentAttention on the same random weights (std
    0.2), a prefill of 8 then 3 decode steps through HF's cache: the same keys chosen (index_topk 4 bites from the fifth
    query on), the outputs within 1e-5 of their largest value (measured ~1e-7). The gate read from the query's half of
    the fused rows (axk2_gate_from_query_half) and the two q latents swapped (axk2_q_latents_swapped) are each off by
    more than 0.05 of it."""
    from transformers.cache_utils import DynamicCache

    from models.faults.dsa2 import axk2_gate_from_query_half, axk2_q_latents_swapped

    hf, c, args = _hf("axk2")
    torch.manual_seed(0)
    ref = randomised(hf.AXK2Attention(c, 0), std=0.2)
    rotary = hf.AXK2RotaryEmbedding(c)
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(3))
    cache, seen, mine = DynamicCache(config=c), [], []
    ref.indexer.register_forward_hook(lambda m, a, out: seen.append(out))

    def hf_call(start, n):
        pos = torch.arange(start, start + n)
        out = ref(x[:, start:start + n], rotary(x, pos[None]), _mask(n, start), past_key_values=cache,
                  position_ids=pos[None])[0]
        return out, seen[-1]

    def ours_with(fault=None):
        ours = same_weights(ref, GatedLatentAttention(args, layer=0), STATE)
        ours.indexer.register_forward_hook(lambda m, a, out: mine.append(out))
        if fault is not None:
            fault(ours, args)
        return lambda start, n: (ours(x[:, start:start + n], torch.arange(start, start + n)), mine[-1])

    with torch.no_grad():
        want, want_keys = _run(CALLS, hf_call)
        got, got_keys = _run(CALLS, ours_with())
        half, _ = _run(CALLS, ours_with(axk2_gate_from_query_half))
        swapped, _ = _run(CALLS, ours_with(axk2_q_latents_swapped))
    scale = want.abs().max()
    assert got_keys == want_keys and all(len(ch) == 4 for ch in got_keys[4:])
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (half - want).abs().max() > 0.05 * scale
    assert (swapped - want).abs().max() > 0.05 * scale
    assert P == 8
