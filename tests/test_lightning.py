"""Lightning attention (models/layers/lightning.py): the closed-form prefill, the one-step recurrence and HF's block form
(transformers 5.23 MiniMaxLightningAttention) compute one attention; and HF's own MiniMax decode, whose cache does
not count the tokens it holds, is why the reference passes explicit position_ids (Family.hf_position_ids)."""

import pytest
import torch

from models import get_family
from models.layers.lightning import Lightning
from tests.mixers import randomised, same_weights

hf = pytest.importorskip("transformers.models.minimax.modeling_minimax")


def _pair(layer: int):
    fam = get_family("minimax")
    c = fam.hf_config(fam.tiny_config)
    torch.manual_seed(layer)
    ref = randomised(hf.MiniMaxLightningAttention(c, layer))
    ours = same_weights(ref, Lightning(fam.args(fam.tiny_config), layer), {"recurrent_state"},
                        skip=("slope_rate", "query_decay", "key_decay", "diagonal_decay"))  # (buffers HF derives)
    return ref, ours, c


@pytest.mark.parametrize("layer", [0, 2])  # (the slopes differ by layer)
def test_prefill_and_decode_are_hfs_block_form(layer):
    """HF's prefill in blocks of block_size (4: the 11 tokens in three blocks, the last partial) against the closed
    form, and the production decode (prefill 8, then 3 steps) against the same tokens at once."""
    ref, ours, c = _pair(layer)
    x = torch.randn(1, 11, c.hidden_size)
    assert torch.allclose(ours.slope, ref.slope_rate.flatten())
    with torch.no_grad():
        want = ref(x, position_embeddings=None, attention_mask=None)[0]
        whole = ours(x, torch.arange(11))
        parts = [ours(x[:, :8], torch.arange(8))] + [ours(x[:, t:t + 1], torch.tensor([t])) for t in range(8, 11)]
    assert (whole - want).abs().max() <= 1e-5 * want.abs().max()
    assert (torch.cat(parts, 1) - want).abs().max() <= 1e-5 * want.abs().max()


def test_hfs_minimax_cache_does_not_count_its_tokens():
    """transformers 5.23: MiniMaxCache reports 0 tokens seen (layer 0 is lightning, with no KV), so a cached decode
    step without position_ids is rotated at position 0 and differs from the uncached run; with explicit position_ids
    it is the same. When the first assertion fails, HF has fixed it: Family.hf_position_ids can go."""
    from transformers import AutoModelForCausalLM

    from oracle.source.seeded import tiny_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(get_family("minimax"), 0), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 33, 2, 90, 41, 7, 12, 60]])
    with torch.no_grad():
        full = model(ids).logits[0, -1]
        cache = model(ids[:, :8], use_cache=True).past_key_values
        assert cache.get_seq_length() == 0
        own = model(ids[:, 8:], past_key_values=cache, use_cache=True).logits[0, -1]
        cache = model(ids[:, :8], use_cache=True).past_key_values
        fed = model(ids[:, 8:], past_key_values=cache, use_cache=True, position_ids=torch.tensor([[8]])).logits[0, -1]
    scale = full.abs().max()
    assert (own - full).abs().max() > 1e-3 * scale
    assert (fed - full).abs().max() <= 1e-5 * scale
