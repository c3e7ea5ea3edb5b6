"""HY-V4 (models/hy_v4.py) against transformers 5.23's modules on the same random weights: its indexer (the rotation
on the last qk_rope_head_dim dims, the keys' fp32 LayerNorm with rms_norm_eps: DSA.rope_last, k_norm_eps) chooses
HF's keys over a prefill and decode steps; its latent attention (a sink logit per head, a sigmoid gate per value
channel, DSA) is HYV4Attention's; the release's tensor names (what save_pretrained writes: hc_pre.hc_attn_layer.*,
learnable_sink_param, linear_gate) map onto the production model's. The whole model (iHC between the layers) is the
eager oracle check's (tests/test_eager_hf.py)."""

import pytest
import torch

from models import get_family
from models.layers.dsa import Indexer
from models.layers.mla import LatentAttention
from tests.mixers import randomised, same_weights
from tests.test_dsa import CALLS, STATE, T, _hf, _mask, _run

pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")


def test_indexer_chooses_hfs_keys():
    """HYV4Indexer and the production Indexer (std 0.3 weights, a prefill of 8 then 3 decode steps): the same keys for
    every query; the same indexer rotating the first dims (DeepSeek-V3.2's place) chooses others for some query."""
    from dataclasses import replace

    from transformers.cache_utils import DynamicCache

    hf, c, args = _hf("hy_v4")
    assert args.attention.dsa.rope_last and args.attention.dsa.k_norm_eps == c.rms_norm_eps
    torch.manual_seed(0)
    ref = randomised(hf.HYV4Indexer(c, 0))
    ours = same_weights(ref, Indexer(args), {"index_key_cache", "index_selection"})
    first = replace(args, attention=replace(args.attention, dsa=replace(args.attention.dsa, rope_last=False)))
    front = same_weights(ref, Indexer(first), {"index_key_cache", "index_selection"})
    rotary = hf.HYV4RotaryEmbedding(c)
    gen = torch.Generator().manual_seed(1)
    x, q_resid = torch.randn(1, T, c.hidden_size, generator=gen), torch.randn(1, T, c.q_lora_rank, generator=gen)
    cache = DynamicCache(config=c)

    def hf_call(start, n):
        pos = torch.arange(start, start + n)
        chosen = ref(x[:, start:start + n], q_resid[:, start:start + n], rotary(x, pos[None]), _mask(n, start)[:, 0],
                     pos[None], past_key_values=cache)
        return chosen, chosen

    def call(ix):
        return lambda start, n: (lambda ch: (ch, ch))(ix(x[:, start:start + n], q_resid[:, start:start + n],
                                                         torch.arange(start, start + n)))

    with torch.no_grad():
        _, want = _run(CALLS, hf_call)
        _, got = _run(CALLS, call(ours))
        _, other = _run(CALLS, call(front))
    assert got == want
    assert all(len(ch) == 4 for ch in got[4:])  # the sparsity bites from the fifth query on
    assert other != want


def test_gated_sink_attention_is_hfs():
    """HYV4Attention (layer 0: a full one) and the production LatentAttention with its sinks and per-channel gate
    (std 0.2 weights; HF's gate_proj is its g_proj): a prefill of 8 and 3 decode steps through HF's cache, the same
    keys chosen and the outputs within 1e-5 of their largest value (fp32 rounding of other summation orders). Without
    the sinks (the seeded fault attention_sinks_dropped) the outputs are off by more than 1e-3 of it."""
    from transformers.cache_utils import DynamicCache

    from models.faults.attention import sinks_dropped

    hf, c, args = _hf("hy_v4")
    torch.manual_seed(0)
    ref = randomised(hf.HYV4Attention(c, 0), std=0.2)
    sd = {k.replace("gate_proj.", "g_proj."): v for k, v in ref.state_dict().items()}
    ours = LatentAttention(args, layer=0)
    missing = ours.load_state_dict(sd, strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) == STATE | {"indexer.index_selection"}, missing
    rotary = hf.HYV4RotaryEmbedding(c)
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(3))
    cache, seen, mine = DynamicCache(config=c), [], []
    ref.indexer.register_forward_hook(lambda m, a, out: seen.append(out))
    ours.indexer.register_forward_hook(lambda m, a, out: mine.append(out))

    def hf_call(start, n):
        pos = torch.arange(start, start + n)
        out = ref(x[:, start:start + n], rotary(x, pos[None]), _mask(n, start), past_key_values=cache,
                  position_ids=pos[None])[0]
        return out, seen[-1]

    def our_call(start, n):
        return ours(x[:, start:start + n], torch.arange(start, start + n)), mine[-1]

    with torch.no_grad():
        want, want_keys = _run(CALLS, hf_call)
        got, got_keys = _run(CALLS, our_call)
        sinks_dropped(ours, args)
        unsunk, _ = _run(CALLS, our_call)
    scale = want.abs().max()
    assert got_keys == want_keys
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (unsunk - want).abs().max() > 1e-3 * scale


def test_release_names():
    """The names save_pretrained writes (the release's, transformers 5.23's conversion_mapping reversed) become the
    production model's: the iHC parameters, the sinks, the attention's gate (g_proj); the MTP layers are dropped."""
    fam = get_family("hy_v4")
    args = fam.args(fam.tiny_config)
    saved = ["model.layers.1.hc_pre.hc_attn_layer.hc_fn", "model.layers.1.hc_pre.hc_mlp_layer.hc_scale",
             "model.hc_pre.hc_head.hc_head_base", "model.layers.0.self_attn.learnable_sink_param",
             "model.layers.0.self_attn.linear_gate.weight", "model.layers.1.mlp.shared_experts.linear_gate.weight",
             "model.mtp_layers.0.eh_proj.weight"]
    release = sorted(fam.release_names({n: None for n in saved}))  # llama.cpp's converter's names
    assert release == ["model.hc_head.hc_head_base", "model.layers.0.self_attn.learnable_sink_param",
                       "model.layers.0.self_attn.linear_gate.weight", "model.layers.1.hc_attn_layer.hc_pre.hc_fn",
                       "model.layers.1.hc_mlp_layer.hc_pre.hc_scale", "model.layers.1.mlp.shared_experts.gate_proj.weight",
                       "model.mtp_layers.0.eh_proj.weight"]
    want = ["hc_head.hc_base", "layers.0.self_attn.g_proj.weight", "layers.0.self_attn.sinks", "layers.1.attn_hc.fn",
            "layers.1.ffn_hc.scale", "layers.1.mlp.shared_experts.gate_proj.weight"]
    for names in (saved, release):
        assert sorted(fam.sanitize({n: torch.zeros(1) for n in names}, args)) == want
