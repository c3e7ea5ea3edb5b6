"""Hyper-connections (models/layers/hyper.py) against transformers 5.23's modules on the same random weights:
DeepSeek-V4's manifold-constrained HyperConnection and HyperHead (mHC: pre, post, the Sinkhorn-projected comb),
GLM-5.3's (the same connection, a mean for its head), HY-V4's independent ones (iHC: no comb, hc_magnitude, fp32);
and a decoder layer's stream update (hyper_stream) against HF's decoder-layer formula around the same blocks."""

import pytest
import torch

from models.hyper_args import HyperArgs
from models.layers.hyper import HyperConnection, HyperHead, expand, hyper_stream
from tests.mixers import same_weights

dsv4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hyv4 = pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")
glm5n = pytest.importorskip("transformers.models.glm5_next.modeling_glm5_next")

N, D = 3, 16


def _config(form):
    if form == "mhc":
        from transformers import DeepseekV4Config

        return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=7, hc_eps=1e-6, rms_norm_eps=1e-6)
    from transformers import HYV4Config

    return HYV4Config(hidden_size=D, hc_mult=N, hc_magnitude=1.5, hc_eps=1e-6, rms_norm_eps=1e-5)


def _args(form, head="weighted"):
    c = _config(form)
    if form == "mhc":
        return HyperArgs(N, "mhc", c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps, head=head)
    return HyperArgs(N, "ihc", 0, c.hc_eps, c.rms_norm_eps, magnitude=c.hc_magnitude, head=head)


def _randomised(module, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():  # scale and base far from 1 and 0: the terms each matter
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if name.endswith(("fn", "hc_fn")) else 1.0))
    return module.eval()


def _streams(seed, dtype=torch.float32, T=5):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, N, D, generator=gen).to(dtype)


def _pair(form, seed=0):
    cls = dsv4.DeepseekV4HyperConnection if form == "mhc" else hyv4.HYV4HyperConnection
    ref = _randomised(cls(_config(form)), seed)
    return ref, same_weights(ref, HyperConnection(_args(form), D), set())


@pytest.mark.parametrize("form", ["mhc", "ihc"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_connection_is_hfs(form, dtype):
    """pre's collapse, post and comb are HF's (fp32: 1e-6 of the largest value, the same operations in the same
    order; bf16: the collapse rounds once, both ways, so equal within one bf16 ulp of it), and so is the mix."""
    ref, ours = _pair(form)
    x = _streams(1, dtype)
    with torch.no_grad():
        want, got = ref(x), ours(x)
        if form == "mhc":
            post_r, comb_r, coll_r = want
            torch.testing.assert_close(got[1], comb_r, rtol=0, atol=1e-6)
            assert torch.allclose(comb_r.sum(-1), torch.ones(()), atol=1e-3)  # doubly stochastic (7 iterations)
        else:
            (post_r, coll_r), comb_r = want, None
            assert got[1] is None
        torch.testing.assert_close(got[0], post_r, rtol=0, atol=1e-6)
        tol = 0 if dtype == torch.float32 else 8e-3 * coll_r.float().abs().max().item()
        assert (got[2].float() - coll_r.float()).abs().max() <= max(tol, 1e-6 * coll_r.float().abs().max().item())
        out = torch.randn(1, x.shape[1], D).to(dtype)
        mixed = ours.mix(got[0], got[1], out, x)
        if form == "mhc":  # DeepseekV4DecoderLayer's (and Glm5NextTextDecoderLayer's) update
            hf_mixed = post_r.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
                comb_r.to(dtype).transpose(-1, -2), x)
        else:  # HYV4DecoderLayer's
            hf_mixed = (post_r.float().unsqueeze(-1) * out.float().unsqueeze(-2) + x.float()).to(dtype)
        torch.testing.assert_close(mixed.float(), hf_mixed.float(), rtol=0, atol=1e-6 if dtype == torch.float32
                                   else 1e-2 * hf_mixed.float().abs().max().item())


@pytest.mark.parametrize("form,head", [("mhc", "weighted"), ("ihc", "weighted"), ("mhc", "mean")])
def test_head_is_hfs(form, head):
    """The final collapse: DeepSeek-V4's and HY-V4's weighted heads, GLM-5.3's mean, fp32 within 1e-6."""
    if head == "mean":
        ref = glm5n.Glm5NextTextHyperHead()
    else:
        cls = dsv4.DeepseekV4HyperHead if form == "mhc" else hyv4.HYV4HyperHead
        ref = _randomised(cls(_config(form)), 2)
    ours = same_weights(ref, HyperHead(_args(form, head), D), set())
    x = _streams(3)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=1e-6)


class _Layer(torch.nn.Module):
    """A decoder layer's parts hyper_stream uses: two blocks (here linear maps) and their norms."""

    def __init__(self, form):
        super().__init__()
        from models.layers.hyper import add_hyper

        add_hyper(self, _args(form), D)
        self.attn_block, self.mlp_block = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.input_layernorm, self.post_attention_layernorm = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)

    def attn(self, x, pos):
        return self.attn_block(x)

    def ffn(self, x):
        return self.mlp_block(x)


@pytest.mark.parametrize("form", ["mhc", "ihc"])
def test_layer_stream(form):
    """hyper_stream is HF's decoder layer around the same blocks (DeepseekV4DecoderLayer / HYV4DecoderLayer's forward,
    written out), fed the streams either as [B, T, N, H] or flattened to [B, T*N, H] (the oracle's layer rows)."""
    torch.manual_seed(0)
    layer = _Layer(form).eval()
    cls = dsv4.DeepseekV4HyperConnection if form == "mhc" else hyv4.HYV4HyperConnection
    for hc in (layer.attn_hc, layer.ffn_hc):
        _randomised(hc, 5)
    refs = [same_weights(hc, cls(_config(form)), set()) for hc in (layer.attn_hc, layer.ffn_hc)]
    x = expand(_args(form), torch.randn(1, 4, D))
    with torch.no_grad():
        s = x
        for hc, norm, block in zip(refs, (layer.input_layernorm, layer.post_attention_layernorm),
                                   (layer.attn_block, layer.mlp_block)):
            if form == "mhc":
                post, comb, h = hc(s)
                s = post.unsqueeze(-1) * block(norm(h)).unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), s)
            else:
                post, h = hc(s)
                s = post.unsqueeze(-1) * block(norm(h)).unsqueeze(-2) + s
        torch.testing.assert_close(hyper_stream(layer, x, None), s, rtol=0, atol=1e-6)
        torch.testing.assert_close(hyper_stream(layer, x.reshape(1, -1, D), None), s, rtol=0, atol=1e-6)
