"""ZAYA (models/zaya.py): its compressed convolutional attention (models/layers/cca.py) against HF 5.23's ZayaAttention
on the same random weights, through a prefill and decode steps with the conv and delayed-value states carried."""

import pytest
import torch

from tests.mixers import randomised


@pytest.fixture(scope="module")
def setup():
    from transformers.models.zaya import ZayaConfig

    from models.zaya import TINY, to_args

    c = ZayaConfig(**TINY)
    c._attn_implementation = "eager"
    return c, to_args(c)


@pytest.mark.parametrize("layer", [0, 1])
def test_cca_attention_is_hf_s_prefill_then_decode(setup, layer):
    """A full and a sliding-window layer: a prefill of 6 (past the window of 4), then 2 decode steps, each carrying the
    convolution's last inputs and the last delayed value projection; the states matter (a prefill of 8 at once is
    the same)."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.zaya import modeling_zaya as m

    from models.layers.cca import CCAAttention

    c, a = setup
    rope = m.ZayaRotaryEmbedding(c)
    kind = c.layer_types[layer]
    torch.manual_seed(layer)
    ref = randomised(m.ZayaAttention(c, layer), std=0.2)
    ours = CCAAttention(a, torch.float32, layer).eval()
    missing = ours.load_state_dict(ref.state_dict(), strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) == {
        "k_cache", "v_cache", "qkv_proj.conv_state", "qkv_proj.recurrent_state"}
    cache, x = DynamicCache(config=c), torch.randn(1, 8, c.hidden_size)
    mask_fn = m.create_causal_mask if kind == "hybrid" else m.create_sliding_window_causal_mask
    got_all = []
    for lo, hi in ((0, 6), (6, 7), (7, 8)):
        pos = torch.arange(lo, hi)
        mask = mask_fn(config=c, inputs_embeds=x[:, lo:hi], attention_mask=None, past_key_values=cache,
                       position_ids=pos[None])
        with torch.no_grad():
            want, _ = ref(x[:, lo:hi], attention_mask={"causal": mask, "conv": None}, past_key_values=cache,
                          position_embeddings=rope(x, pos[None], kind))
            got = ours(x[:, lo:hi], pos)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        got_all.append(got)
    with torch.no_grad():
        whole = ours(x, torch.arange(8))
    torch.testing.assert_close(torch.cat(got_all, dim=1), whole, atol=2e-6, rtol=1e-5)


def test_router_is_hf_s_with_the_cross_layer_state(setup):
    """The second layer's router: its down-projection plus the previous layer's (scaled), the MLP, softmax over the
    experts and the skip expert, the choice with the balancing biases; the skip expert's weight 0. The previous layer's
    state is read per position from its router_state; this router's own is written there for the next."""
    from transformers.models.zaya import modeling_zaya as m

    from models.layers.zaya_router import ZayaRouter, link_routers

    c, a = setup
    torch.manual_seed(3)
    ref = randomised(m.ZayaRouter(c, 1), std=0.3)
    with torch.no_grad():
        ref.balancing_biases.copy_(torch.randn(c.num_experts + 1) * 0.1)
        ref.balancing_biases[-1] = 0.2  # the skip expert chosen on some tokens
    first, ours = ZayaRouter(a, 0).eval(), ZayaRouter(a, 1).eval()
    ours.load_state_dict({**ref.state_dict(), "router_state": ours.router_state})
    layers = [torch.nn.Module(), torch.nn.Module()]
    for layer, router in zip(layers, (first, ours)):
        layer.mlp = torch.nn.Module()
        layer.mlp.gate = router
    link_routers(layers)
    x, prev = torch.randn(1, 8, c.hidden_size), torch.randn(1, 8, c.router_hidden_size)
    first.router_state[0, :8] = prev[0]
    with torch.no_grad():
        _, w_ref, idx_ref, nxt = ref(x, router_states=prev)
        w, idx = ours(x[0], torch.arange(8))
    skip = idx == c.num_experts
    assert skip.any() and not skip.all()
    assert torch.equal(torch.where(skip, 0, idx), idx_ref)
    torch.testing.assert_close(w, w_ref)
    assert (w[skip] == 0).all()
    torch.testing.assert_close(ours.router_state[0, :8], nxt[0])
