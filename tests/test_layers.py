"""The production model's layers: the eager expert dispatch against the traced (gathered) form."""

import torch

from models.args import ModelArgs, RopeArgs
from models.layers.experts import Experts


def _experts(E=8, H=64, I=32):
    a = ModelArgs(family="t", vocab_size=16, hidden_size=H, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6, rope=RopeArgs(1e4), num_experts=E,
                  num_experts_per_tok=2, moe_intermediate_size=I, layer_types=("full_attention",))
    ex = Experts(a)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.1)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.1)
    return ex


def test_grouped_dispatch_equals_the_gathered_form():
    """Eager groups tokens by expert (no per-token weight copy); torch.export/compile trace the
    gathered form. Both compute the same per-token expert MLP."""
    ex = _experts()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(37, 64, generator=g)
    idx = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(37)])
    grouped = ex.expert_mlp(x, idx)  # eager
    traced = torch.export.export(_Gathered(ex), (x, idx), strict=False).module()(x, idx)
    assert grouped.shape == traced.shape == (37, 2, 64)
    assert torch.allclose(grouped, traced, atol=1e-6, rtol=0), (grouped - traced).abs().max()


class _Gathered(torch.nn.Module):
    def __init__(self, ex):
        super().__init__()
        self.ex = ex

    def forward(self, x, idx):
        return self.ex.expert_mlp(x, idx)


def test_sparsemixer_weights_are_transformers_own():
    """models.layers.routing.sparsemixer_weights (comparisons and sums, for export) against the function
    transformers' PhiMoE router calls, at inference, on random logits with near ties planted."""
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    from models.layers import routing

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 8, generator=g)
    logits[::4, 1] = logits[::4, 0] * (1 - 1e-3)  # within the 2 * 0.01 band of another expert
    logits[1::4] = -logits[1::4].abs()  # negative maxima (the factor's clamp)
    w_hf, idx_hf = sparsemixer(logits, jitter_eps=0.01, training=False, top_k=2)
    idx = torch.topk(logits, 2, dim=-1).indices
    torch.testing.assert_close(idx, idx_hf)
    w = routing.sparsemixer_weights(logits, idx, 0.01)
    torch.testing.assert_close(w, w_hf, atol=1e-6, rtol=1e-6)
    assert (w_hf < 0.99).any()  # the band decided some weights (not all 1)


def test_mixtral_sliding_window_applies_to_every_layer():
    """Mixtral's sliding_window has no per-layer form: every layer is a SLIDING one."""
    from models import get_family
    from models.args import SLIDING
    from models.layers.attention import Attention

    fam = get_family("mixtral")
    a = fam.args({**fam.tiny_config, "sliding_window": 4})
    assert a.layer_types == (SLIDING,) * a.num_hidden_layers
    attn = Attention(a, layer=1)
    visible = attn.mask(torch.arange(6))
    assert visible[5].nonzero().flatten().tolist() == [2, 3, 4, 5]  # q - k < 4
