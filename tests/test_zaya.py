"""ZAYA (models/zaya.py) against HF 5.23's modules on the same random weights: its compressed convolutional attention
(models/layers/cca.py) through a prefill and decode steps with the conv and delayed-value states carried; its router
(models/layers/zaya_router.py) with the previous layer's state, the skip expert a choice at weight 0, and alone (an
expert probe: HF's router with no state); the whole model through HF's cache, with the seeded faults of both
mechanisms caught; the reference's repair of HF's load (the checkpoint's skip-expert balancing bias kept)."""

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
    the same). With the value not delayed or the states not carried (the seeded faults) the outputs differ."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.zaya import modeling_zaya as m

    from models.faults.zaya import cca_state_not_carried, cca_value_not_delayed
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
    calls = ((0, 6), (6, 7), (7, 8))
    wants, got_all = [], []
    for lo, hi in calls:
        pos = torch.arange(lo, hi)
        mask = mask_fn(config=c, inputs_embeds=x[:, lo:hi], attention_mask=None, past_key_values=cache,
                       position_ids=pos[None])
        with torch.no_grad():
            want, _ = ref(x[:, lo:hi], attention_mask={"causal": mask, "conv": None}, past_key_values=cache,
                          position_embeddings=rope(x, pos[None], kind))
            got = ours(x[:, lo:hi], pos)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        wants.append(want)
        got_all.append(got)
    with torch.no_grad():
        whole = ours(x, torch.arange(8))
    torch.testing.assert_close(torch.cat(got_all, dim=1), whole, atol=2e-6, rtol=1e-5)
    for fault in (cca_value_not_delayed, cca_state_not_carried):
        bad = CCAAttention(a, torch.float32, layer).eval()
        bad.load_state_dict(ref.state_dict(), strict=False)
        fault(bad, a)
        with torch.no_grad():
            outs = [bad(x[:, lo:hi], torch.arange(lo, hi)) for lo, hi in calls]
        assert max((o - w).abs().max() for o, w in zip(outs, wants)) > 1e-3, fault.__name__


def test_router_is_hf_s_with_the_cross_layer_state(setup):
    """The second layer's router: its down-projection plus the previous layer's (scaled), the MLP, softmax over the
    experts and the skip expert, the choice with the balancing biases; the skip expert's weight 0. The previous layer's
    state is read per position from its router_state; this router's own is written there for the next. Run alone (an
    expert probe) it is HF's router given no state, and writes none."""
    from transformers.models.zaya import modeling_zaya as m

    from models.layers.zaya_router import ZayaRouter, alone, link_routers

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
        _, w_alone_ref, idx_alone_ref, _ = ref(x[:, :1])
        written = ours.router_state.clone()
        with alone(ours):  # (a probe)
            w_alone, idx_alone = ours(x[0, :1], torch.tensor([0]))
    skip = idx == c.num_experts
    assert skip.any() and not skip.all()
    assert torch.equal(torch.where(skip, 0, idx), idx_ref)
    torch.testing.assert_close(w, w_ref)
    assert (w[skip] == 0).all()
    torch.testing.assert_close(ours.router_state[0, :8], nxt[0])
    torch.testing.assert_close(w_alone, w_alone_ref)
    assert torch.equal(torch.where(idx_alone == c.num_experts, 0, idx_alone), idx_alone_ref)
    assert torch.equal(ours.router_state, written)


def _tiny_pair(seed=0, fault=None):
    """HF's model (the family's reference class) and the production model on the tiny checkpoint's weights (drawn as
    the seeded checkpoint draws them), the production one with `fault` applied to its layer (a models/faults/zaya.py
    function; its target layer the fault's)."""
    from transformers.models.zaya import ZayaConfig

    from models.faults.catalogue import get
    from models.layers.transformer import Transformer
    from models.zaya import FAMILY, TINY
    from oracle.source.seeded import draw_weights

    c = ZayaConfig(**TINY)
    c._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = FAMILY.hf_class()(c).eval()
    draw_weights(hf, seed, c, FAMILY.tiny_std)  # (the seeded checkpoint's weights, in memory)
    a = FAMILY.args(c.to_dict(), 32)
    ours = Transformer(a).eval()
    missing = ours.load_state_dict(FAMILY.sanitize(hf.state_dict(), a), strict=False)
    assert not missing.unexpected_keys and all(k.endswith(("_cache", "_state")) for k in missing.missing_keys)
    if fault is not None:
        get(fault).inject(ours)
    return c, a, hf, ours


def _run(hf, ours, ids, prompt=8):
    """Logits of a prefill of `prompt` then one decode step per further token, HF's (through its cache) and ours; the
    routes (indices per layer and call) of both, HF's read by the family (the skip expert as index E)."""
    from models.zaya import router_output

    a = ours.args
    routes = {"hf": [], "ours": []}
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, i, o: routes["hf"].append(router_output(o, a)[2]))
             for layer in hf.model.layers]
    hooks += [layer.mlp.gate.register_forward_hook(lambda mod, i, o: routes["ours"].append(o[1]))
              for layer in ours.layers]
    with torch.no_grad():
        out = hf(ids[:, :prompt], use_cache=True)
        want, got = [out.logits[0]], [ours(ids[:, :prompt], torch.arange(prompt))[0]]
        for t in range(prompt, ids.shape[1]):
            out = hf(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            want.append(out.logits[0])
            got.append(ours(ids[:, t:t + 1], torch.tensor([t]))[0])
    for h in hooks:
        h.remove()
    return torch.cat(want), torch.cat(got), routes


def test_whole_model_is_hf_s():
    """The tiny checkpoint's model (seed 0: the sliding layer's window 4 below the prompt of 8, the skip expert chosen)
    through a prefill and 4 decode steps: HF's logits within 2e-6 of their scale, the same experts on every token of
    every layer, the skip expert among them (HF masks it to expert 0: read back by the family's router_output)."""
    c, a, hf, ours = _tiny_pair()
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    want, got, routes = _run(hf, ours, ids)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()
    assert all(torch.equal(h, o) for h, o in zip(routes["hf"], routes["ours"]))
    assert any((o == c.num_experts).any() for o in routes["ours"])


@pytest.mark.parametrize("fault", ["zaya_router_state_not_passed", "zaya_router_state_unscaled",
                                   "zaya_skip_expert_weighted"])
def test_router_faults_change_the_model(fault):
    """Each seeded router fault moves the whole model's logits off HF's by more than 1e-3 of their scale."""
    c, a, hf, ours = _tiny_pair(fault=fault)
    ids = torch.randint(0, c.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    want, got, _ = _run(hf, ours, ids)
    assert (got - want).abs().max() > 1e-3 * want.abs().max()


def test_reference_keeps_the_checkpoints_skip_bias(tmp_path):
    """HF 5.23's from_pretrained overwrites the skip expert's balancing bias with -1.0 (its _init_weights, run after
    loading); the family's reference class keeps the checkpoint's value."""
    from transformers.models.zaya import ZayaConfig, ZayaForCausalLM

    from models.zaya import FAMILY, TINY

    c = ZayaConfig(**{**TINY, "num_hidden_layers": 1, "layer_types": ["hybrid"]})
    model = ZayaForCausalLM(c)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.balancing_biases.copy_(torch.linspace(-0.1, 0.3, c.num_experts + 1))
    model.save_pretrained(tmp_path)
    hf = ZayaForCausalLM.from_pretrained(tmp_path).model.layers[0].mlp.gate.balancing_biases
    ours = FAMILY.hf_class().from_pretrained(tmp_path).model.layers[0].mlp.gate.balancing_biases
    assert hf[-1] == -1.0 and torch.equal(hf[:-1], torch.linspace(-0.1, 0.3, c.num_experts + 1)[:-1])
    assert torch.equal(ours, torch.linspace(-0.1, 0.3, c.num_experts + 1))
    assert FAMILY.hf_class().__name__ == "ZayaForCausalLM"
