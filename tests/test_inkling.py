"""Inkling (models/inkling.py): its mechanisms against HF's own modules on the same random weights (the relative
logits at prefill and decode positions, the residual short convolution carried from a prefill into decode steps, the
router whose shared experts sit inside its normalisation, the MoE block), the whole production model against HF's
through HF's cache (prefill then decode), and what is refused by name."""

import json

import pytest
import torch

from models import get_family
from models.checkpoint import CheckpointError
from oracle.source.seeded import tiny_checkpoint
from tests.mixers import randomised

FAM = get_family("inkling")


def _config(**over):
    from transformers.models.inkling import InklingTextConfig

    return InklingTextConfig(**{**FAM.tiny_config, **over})


def _args(**over):
    return FAM.to_args(_config(**over))


def test_relative_logits_are_hf_s_at_prefill_and_decode():
    """The bias of every (query, key) pair, zero past the extent and for future keys: HF's InklingRelativeLogits'
    exactly, for a prefill's positions and a decode step's (the production module sees the whole static cache)."""
    from transformers.models.inkling.modeling_inkling import InklingRelativeLogits

    from models.layers.relative_logits import RelativeLogits

    torch.manual_seed(0)
    ref = randomised(InklingRelativeLogits(4, 6), std=1.0)
    ours = RelativeLogits(4, 6)
    ours.load_state_dict(ref.state_dict())
    S = 16
    for q_pos in (torch.arange(8), torch.tensor([8]), torch.tensor([11])):
        r = torch.randn(1, len(q_pos), 3, 4)
        k_pos = torch.arange(int(q_pos[-1]) + 1)
        want = ref(r, q_pos, k_pos)
        got = ours(r, q_pos, torch.arange(S))
        assert torch.equal(got[..., : len(k_pos)], want)
        assert not got[..., len(k_pos):].any()  # future keys: no bias (the mask hides them anyway)
        assert (want != 0).any(-1).all() and (want == 0).any()  # the extent bites: distances >= 6 are zero


def test_short_conv_carried_from_prefill_into_decode_is_hf_s():
    """Prefill 8 tokens, then 3 single-token calls: the production conv with its carried state gives what HF's
    InklingShortConvolution gives on the whole sequence at once (fp32, the residual included)."""
    from transformers.models.inkling.modeling_inkling import InklingShortConvolution

    from models.layers.residual_conv import ResidualConv

    torch.manual_seed(1)
    ref = randomised(InklingShortConvolution(12, 3, layer_idx=0, conv_idx=0))
    ours = ResidualConv(12, 3)
    ours.load_state_dict(ref.state_dict(), strict=False)
    x = torch.randn(1, 11, 12)
    want = ref(x)
    got = [ours(x[:, :8], torch.arange(8))] + [ours(x[:, t:t + 1], torch.tensor([t])) for t in range(8, 11)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-6)
    ours.carry = False  # (the seeded fault: the state dropped) differs from the first decode step on
    assert not torch.allclose(ours(x[:, 8:9], torch.tensor([8])), want[:, 8:9], atol=1e-3)


def test_router_and_moe_are_hf_s():
    """The routed weights and choice, the shared experts' gammas (normalised with the chosen routed experts), and
    the whole MoE block: HF's InklingTopkRouter and InklingMoE on the same weights."""
    from transformers.models.inkling.modeling_inkling import InklingMoE

    from models.layers.sink_moe import SinkMoE

    cfg = _config()
    torch.manual_seed(2)
    ref = randomised(InklingMoE(cfg), std=0.2)
    with torch.no_grad():
        ref.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.1)
    ours = SinkMoE(_args())
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(1, 10, cfg.hidden_size)
    with torch.no_grad():
        logits, w, idx, gammas = ref.gate(x)
        w2, idx2 = ours.gate(x.reshape(-1, cfg.hidden_size))
        order, order2 = idx.argsort(-1), idx2.argsort(-1)
        assert torch.equal(idx.gather(-1, order), idx2.gather(-1, order2))
        torch.testing.assert_close(w2.gather(-1, order2), w.gather(-1, order), rtol=0, atol=1e-6)
        torch.testing.assert_close(ours.gate.gammas(x.reshape(-1, cfg.hidden_size), idx2), gammas, rtol=0, atol=1e-6)
        # the shared experts inside the normalisation: routed weights and gammas sum to route_scale * global_scale
        torch.testing.assert_close(w.sum(-1) + gammas.sum(-1), (cfg.route_scale * ref.gate.global_scale).expand(10))
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-6)


def test_model_prefill_then_decode_is_hf_s():
    """The tiny checkpoint: the production model against HF's InklingForCausalLM through HF's cache (its conv states
    and sliding layers), prefill of 8 then 3 decode steps; the mechanisms bite on it (the window 4 and the bias's
    extent 6 below the prompt, the log scaling from position 3)."""
    from safetensors.torch import load_file

    d = tiny_checkpoint(FAM, 0)
    cfg = json.loads((d / "config.json").read_text())
    model = FAM.build(cfg, load_file(str(d / "model.safetensors")))
    hf = FAM.hf_class().from_pretrained(d, attn_implementation="eager", experts_implementation="eager").eval()
    ids = torch.tensor([[3, 17, 99, 4, 200, 5, 61, 7, 8, 9, 10]])
    with torch.no_grad():
        out = hf(ids[:, :8], use_cache=True)
        torch.testing.assert_close(model(ids[:, :8], torch.arange(8)), out.logits, rtol=0, atol=1e-5)
        for t in range(8, 11):
            out = hf(ids[:, t:t + 1], past_key_values=out.past_key_values, use_cache=True)
            torch.testing.assert_close(model(ids[:, t:t + 1], torch.tensor([t])), out.logits, rtol=0, atol=1e-5)
        a = model.args
        assert a.attention.sliding_window < 8 and a.inkling.rel_extent < 8 and a.inkling.log_floor < 8
        attn = model.layers[2].self_attn  # a FULL layer: without its log scaling the logits move
        attn.log_floor = 0
        assert (model(ids[:, :8], torch.arange(8)) - hf(ids[:, :8]).logits).abs().max() > 1e-3


@pytest.mark.parametrize("over, says", [
    (dict(shared_expert_sink=False), "shared_expert_sink"),
    (dict(unpadded_vocab_size=200), "unpadded_vocab_size"),
])
def test_refused_by_name(over, says):
    with pytest.raises(CheckpointError, match=says):
        _args(**over)


# ------------------------------------------------------------------ Inkling2's mechanisms (models/layers/: l2_clip,
# dynamic_conv, block_residual) against HF's inkling2 modules
def test_inkling2_l2_clips_are_hf_s():
    """Both clips bite (some heads longer than the threshold, some shorter) and give HF's values exactly."""
    from transformers.models.inkling2.modeling_inkling2 import Inkling2L2Clip, Inkling2ScaledL2Clip

    from models.layers.l2_clip import L2Clip

    torch.manual_seed(3)
    x = torch.randn(1, 8, 3, 16) * torch.tensor([0.5, 1.0, 2.0])[:, None]
    ref, ours = Inkling2ScaledL2Clip(3, 16, 4.0), L2Clip(4.0, 3, 16)
    with torch.no_grad():
        ref.scale.copy_(1 + 0.3 * torch.randn(3, 16))
    ours.load_state_dict(ref.state_dict())
    norms = torch.linalg.vector_norm(x * ref.scale, dim=-1)
    assert (norms > 4.0).any() and (norms < 4.0).any()
    assert torch.equal(ours(x), ref(x)) and torch.equal(L2Clip(4.0)(x), Inkling2L2Clip(4.0)(x))
    ours.scaled = False  # (the seeded fault: the learned scale dropped) differs
    assert not torch.allclose(ours(x), ref(x))


def test_inkling2_dynamic_conv_carried_from_prefill_into_decode_is_hf_s():
    """Prefill 8 tokens, then 3 single-token calls with the carried state: HF's Inkling2DynamicShortConvolution on the
    whole sequence (static plus per-token, per-head taps; the residual; the 1/sqrt(2K+1) scale)."""
    from transformers.models.inkling2.modeling_inkling2 import Inkling2DynamicShortConvolution

    from models.layers.dynamic_conv import DynamicConv

    torch.manual_seed(4)
    ref = randomised(Inkling2DynamicShortConvolution(12, 20, 3, 4, layer_idx=0, conv_idx=0))
    ours = DynamicConv(12, 20, 3, 4)
    ours.load_state_dict(ref.state_dict(), strict=False)
    x, d = torch.randn(1, 11, 12), torch.randn(1, 11, 20)
    with torch.no_grad():
        want = ref(x, d)
        got = [ours(x[:, :8], d[:, :8], torch.arange(8))]
        got += [ours(x[:, t:t + 1], d[:, t:t + 1], torch.tensor([t])) for t in range(8, 11)]
    torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=0, atol=1e-6)


def test_inkling2_block_attention_residual_is_hf_s():
    """One query (a sliding layer's and every MLP's input) and three (the full layers' q, k and v inputs) over the
    completed blocks and the partial one: HF's Inkling2BlockAttentionResidual."""
    from transformers.models.inkling2 import Inkling2TextConfig
    from transformers.models.inkling2.modeling_inkling2 import Inkling2BlockAttentionResidual

    from models.layers.block_residual import BlockAttentionResidual

    torch.manual_seed(5)
    cfg = Inkling2TextConfig(hidden_size=32, num_hidden_layers=2)
    blocks, partial = torch.randn(1, 6, 3, 32), torch.randn(1, 6, 32)
    for q in (1, 3):
        ref = randomised(Inkling2BlockAttentionResidual(cfg, num_queries=q), std=1.0)
        ours = BlockAttentionResidual(32, q)
        ours.load_state_dict(ref.state_dict())
        with torch.no_grad():
            for a, b in zip(ours(blocks, partial), ref(blocks, partial), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
