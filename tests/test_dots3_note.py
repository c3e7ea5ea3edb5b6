"""dots3 (models/dots3_note.py) against HF's attention (transformers 5.23 dots3_note: Dots3NoteTextAttention) on the
same random weights, both layer kinds of the tiny config: the indexed layer (DSA: its lightning indexer, GLM-5's
interleaved rotation, the scaled q latent) and the sliding layer (a window of 4, its own heads, kv rank, widths and
rope base); HF's over the whole sequence at once, the production one as a prefill of 8 then 3 decode steps through its
caches (causal: the same outputs). Each beside a seeded fault (models/faults/dsa2.py) that breaks it."""

import pytest
import torch

from models.layers.mla_scaled import ScaledLatentAttention
from tests.mixers import randomised, same_weights
from tests.test_dsa import CALLS, STATE, T, _hf

pytest.importorskip("transformers.models.dots3_note.modeling_dots3_note")

MIN = torch.finfo(torch.float32).min


def _mask(window=None):  # HF's eager mask of the whole sequence [1, 1, T, T]: causal, within the window
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    hidden = (k > q) | ((q - k >= window) if window else False)
    return torch.zeros(T, T).masked_fill(hidden, MIN)[None, None]


@pytest.mark.parametrize("layer", [0, 1], ids=["indexed", "sliding"])
def test_scaled_latent_attention_is_hfs(layer):
    """Dots3NoteTextAttention and the production ScaledLatentAttention of one layer on the same random weights (std
    0.2): the same keys chosen by the indexed layer's indexer (index_topk 4 bites from the fifth query on), the outputs
    within 1e-5 of their largest value (measured ~1e-7). Without the kv latent's scale (dots3_kv_lora_scale_missing)
    the outputs are off by more than 0.05 of it; with the window one key wider (sliding_window_off_by_one: the sliding
    layer) by more than 0.01."""
    from models.faults.attention import window_off_by_one
    from models.faults.dsa2 import dots3_kv_lora_scale_missing

    hf, c, args = _hf("dots3_note")
    kind = c.layer_types[layer]
    assert (kind, args.layer_types[layer]) == (("indexed_attention", "full_attention"), ("sliding_attention",
                                                                                        "sliding_attention"))[layer]
    torch.manual_seed(0)
    ref = randomised(hf.Dots3NoteTextAttention(c, layer), std=0.2)
    rotary = hf.Dots3NoteTextRotaryEmbedding(c)
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.arange(T)[None]
    seen, mine = [], []
    if ref.indexer is not None:
        ref.indexer.register_forward_hook(lambda m, a, out: seen.append(out))
    state = STATE if ref.indexer is not None else STATE - {"indexer.index_key_cache"}

    def ours_with(fault=None):
        ours = same_weights(ref, ScaledLatentAttention(args, layer=layer), state)
        assert hasattr(ours, "indexer") == (ref.indexer is not None)
        if hasattr(ours, "indexer"):
            ours.indexer.register_forward_hook(lambda m, a, out: mine.append(out))
        if fault is not None:
            fault(ours, args)
        outs, keys = [], []
        for start, n in CALLS:
            outs.append(ours(x[:, start:start + n], torch.arange(start, start + n)))
            if mine:
                keys += [sorted(int(j) for j in row if int(j) <= start + i) for i, row in enumerate(mine[-1][0])]
        return torch.cat(outs, 1), keys

    with torch.no_grad():
        pe = rotary(x.float() if kind == "indexed_attention" else x, pos, kind)
        want = ref(x, pe, _mask(c.sliding_window if kind == "sliding_attention" else None))[0]
        want_keys = [sorted(int(j) for j in row if int(j) <= i) for i, row in enumerate(seen[0][0])] if seen else []
        got, got_keys = ours_with()
        mine.clear()
        unscaled, _ = ours_with(dots3_kv_lora_scale_missing)
        wider = ours_with(window_off_by_one)[0] if kind == "sliding_attention" else None
    scale = want.abs().max()
    assert got_keys == want_keys and (not want_keys or all(len(ch) == 4 for ch in got_keys[4:]))
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (unscaled - want).abs().max() > 0.05 * scale
    assert wider is None or (wider - want).abs().max() > 0.01 * scale
