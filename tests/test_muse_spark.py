"""Muse Spark's text model (models/muse_spark.py, models/layers/muse.py): its mechanisms against HF 5.23's own modules
on the same random weights (the residual gate, the input-scaled norm, the attention through a prefill and a decode
step with its cache, the MoE block with its projected experts), and the tiny checkpoint's reference, whose soft cap
bites."""

import pytest
import torch

from models import get_family
from tests.mixers import randomised

FAM = get_family("muse_spark")


@pytest.fixture(scope="module")
def setup():
    from transformers.models.muse_spark import MuseSparkTextConfig

    c = MuseSparkTextConfig(**FAM.tiny_config)
    return c, FAM.to_args(c)


def test_residual_gate_and_input_scaled_norm_are_hf_s(setup):
    from transformers.models.muse_spark import modeling_muse_spark as m

    from models.layers.muse import CenteredNorm, InputScaledNorm, ResidualGate

    c, a = setup
    torch.manual_seed(0)
    ref = randomised(m.MuseSparkResidualGate(c), std=1.0)
    ours = ResidualGate(c.hidden_size, c.residual_gate_temperature, a.muse.gate_eps)
    ours.load_state_dict(ref.state_dict())
    r, h = torch.randn(2, 5, c.hidden_size), torch.randn(2, 5, c.hidden_size)
    assert torch.equal(ours(r, h), ref(r, h))
    assert not torch.allclose(ours(r, h), r + h, atol=0.1)  # the gate bites
    for hf, prod, eps in ((m.MuseSparkTextInputScaledRMSNorm, InputScaledNorm, c.post_norm_eps),
                          (m.MuseSparkTextCenteredRMSNorm, CenteredNorm, c.rms_norm_eps)):
        ref = randomised(hf(c.hidden_size, eps=eps))
        ours = prod(c.hidden_size, eps)
        ours.load_state_dict(ref.state_dict())
        for dtype in (torch.float32, torch.bfloat16):  # (1 + w) rounded to bf16 as HF's is
            x = (torch.randn(3, c.hidden_size) * 3).to(dtype)
            assert torch.equal(ours.to(dtype)(x), ref.to(dtype)(x))


def test_attention_is_hf_s_prefill_then_decode(setup):
    """The sliding-window rope layer and the NoPE full layer: a prefill of 6 (past the window of 4), then 2 decode
    steps through each one's cache; HF's gate_proj is the production g_proj."""
    from transformers.cache_utils import DynamicCache
    from transformers.models.muse_spark import modeling_muse_spark as m

    from models.layers.muse import MuseAttention

    c, a = setup
    c._attn_implementation = "eager"
    rope = m.MuseSparkTextRotaryEmbedding(c)
    torch.manual_seed(1)
    for layer in (0, 3):
        ref = randomised(m.MuseSparkTextAttention(c, layer), std=0.2)
        ours = MuseAttention(a, torch.float32, layer).eval()
        sd = {k.replace("gate_proj", "g_proj"): v for k, v in ref.state_dict().items()}
        missing = ours.load_state_dict(sd, strict=False)
        assert not missing.unexpected_keys and set(missing.missing_keys) == {"k_cache", "v_cache"}
        cache, x = DynamicCache(config=c), torch.randn(1, 8, c.hidden_size)
        for lo, hi in ((0, 6), (6, 7), (7, 8)):
            pos = torch.arange(lo, hi)
            full = m.create_causal_mask if c.layer_types[layer] == "full_attention" else m.create_sliding_window_causal_mask
            mask = full(config=c, inputs_embeds=x[:, lo:hi], attention_mask=None, past_key_values=cache,
                        position_ids=pos[None])
            pe = rope(x, pos[None]) if c.layer_rope_theta[layer] else None
            with torch.no_grad():
                want, _ = ref(x[:, lo:hi], position_embeddings=pe, attention_mask=mask, past_key_values=cache)
                got = ours(x[:, lo:hi], pos)
            torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_moe_block_is_hf_s(setup):
    """The router (fp32 logits times output_multiplier, sigmoid + correction bias, renormalised, scaled) and the
    experts in the projected space (each expert's output normed before its weight), on HF's weights."""
    from transformers.models.muse_spark import modeling_muse_spark as m

    from models.layers.muse import MuseMoE

    c, a = setup
    torch.manual_seed(2)
    ref = randomised(m.MuseSparkMoE(c), std=0.2)
    ours = MuseMoE(a).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, 7, c.hidden_size)
    with torch.no_grad():
        logits, w_ref, idx_ref = ref.gate(x)
        w, idx = ours.gate(x.view(-1, c.hidden_size))
        order, order_ref = idx.sort(-1), idx_ref.sort(-1)
        assert torch.equal(order.values, order_ref.values)
        torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices))
        torch.testing.assert_close(ours(x), ref(x), atol=2e-6, rtol=1e-5)


def test_the_reference_caps_the_logits():
    """The tiny checkpoint's reference: HF's text model, the release's head, its multiplier and soft cap (which bites)."""
    from oracle.source.seeded import tiny_checkpoint

    d = tiny_checkpoint(FAM, 0)
    model = FAM.hf_class().from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[3, 141, 59, 26, 5, 35, 89, 79]])).logits
    cap = FAM.tiny_config["final_logit_softcapping"]
    assert logits.abs().max() < cap and logits.abs().max() > 0.8 * cap
