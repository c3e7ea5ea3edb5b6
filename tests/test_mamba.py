"""The Mamba2 and Mamba mixers (models/layers/mamba2.py, mamba.py): the closed-form prefill, the one-step recurrence and HF's torch path
(transformers 5.23 granitemoehybrid) compute one scan; the mixer with its state carried equals one call over
the whole sequence; mlx-lm's gated norm ignores the groups (the known divergence)."""

import pytest
import torch

from models import get_family
from models.layers.mamba2 import Mamba2, ssd_prefill, ssd_step
from tests.mixers import randomised, same_weights

hf = pytest.importorskip("transformers.models.granitemoehybrid.modeling_granitemoehybrid")


def _inputs(T, h=8, p=4, n=6, g=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    return dict(x=r(1, T, h, p), dt=r(1, T, h), A=-torch.rand(h, generator=gen) - 0.3, B=r(1, T, g, n),
                C=r(1, T, g, n), D=r(h), bias=r(h), state=0.3 * r(1, h, p, n))


@pytest.mark.parametrize("T,chunk", [(1, 4), (7, 4), (8, 4), (13, 6), (16, 256)])
def test_prefill_recurrence_and_hf_are_one_scan(T, chunk):
    """HF's chunked scan (mamba2_chunk_scan: whole chunks, a padded last chunk, one chunk longer than the prompt) from
    a non-zero state, the closed-form prefill, the token-by-token recurrence and HF's one-step update
    (mamba2_selective_state_update) agree within fp32's rounding of other summation orders."""
    i = _inputs(T)
    h, g = i["x"].shape[2], i["B"].shape[2]
    ref, ref_state = hf.mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=chunk, D=i["D"],
                                          dt_bias=i["bias"], dt_softplus=True, initial_states=i["state"].clone(),
                                          return_final_states=True)
    dt = torch.nn.functional.softplus(i["dt"] + i["bias"])
    B, C = (t.repeat_interleave(h // g, dim=2) for t in (i["B"], i["C"]))
    y, state = ssd_prefill(i["x"] * dt[..., None], dt * i["A"], B, C, i["state"].clone())
    y = y + i["D"][:, None] * i["x"]
    scale = ref.abs().max()
    assert (y - ref).abs().max() <= 1e-6 * scale and (state - ref_state).abs().max() <= 1e-6 * ref_state.abs().max()
    s, hf_state, steps, hf_steps = i["state"].clone(), i["state"].clone(), [], []
    p, n = i["x"].shape[-1], i["B"].shape[-1]
    for t in range(T):
        yt, s = ssd_step(i["x"][:, t], dt[:, t], i["A"], B[:, t], C[:, t], s)
        steps.append(yt.squeeze(-1) + i["D"][:, None] * i["x"][:, t])
        hf_steps.append(hf.mamba2_selective_state_update(
            hf_state, i["x"][:, t], i["dt"][:, t, :, None].expand(-1, -1, p), i["A"][:, None, None].expand(-1, p, n),
            i["B"][:, t], i["C"][:, t], i["D"][:, None].expand(-1, p), dt_bias=i["bias"][:, None].expand(-1, p),
            dt_softplus=True))
    steps, hf_steps = torch.stack(steps, 1), torch.stack(hf_steps, 1)
    assert (steps - ref).abs().max() <= 1e-5 * scale and (s - ref_state).abs().max() <= 1e-5 * ref_state.abs().max()
    assert (hf_steps - steps).abs().max() <= 1e-5 * scale


def _mixers(**config):
    """HF's GraniteMoeHybridMambaLayer and the production Mamba2 with the same (random) weights."""
    fam = get_family("granitemoehybrid")
    cfg = {**fam.tiny_config, **config}
    c = fam.hf_config(cfg)
    torch.manual_seed(0)
    ref = randomised(hf.GraniteMoeHybridMambaLayer(c, 0))
    ours = same_weights(ref, Mamba2(fam.args(cfg)), {"conv_state", "recurrent_state"})
    return ref, ours, c


@pytest.mark.parametrize("groups", [1, 2])
def test_the_mixer_is_hfs_in_prefill_and_carries_its_state_into_decode(groups):
    ref, ours, _ = _mixers(mamba_n_groups=groups)
    x = torch.randn(1, 11, ref.hidden_size)
    with torch.no_grad():
        want = ref(x)  # HF without a cache: the chunked scan over all 11 tokens (chunks of 6)
        whole = ours(x, torch.arange(11))
        parts = [ours(x[:, :8], torch.arange(8))] + [ours(x[:, t:t + 1], torch.tensor([t])) for t in range(8, 11)]
    assert (whole - want).abs().max() <= 1e-5 * want.abs().max()
    assert (torch.cat(parts, 1) - want).abs().max() <= 1e-5 * want.abs().max()  # prefill, then three decode steps


def test_mlx_lm_gated_norm_ignores_the_groups():
    """mlx-lm 0.32.2's GraniteMoeHybridRMSNormGated normalises over the whole inner width, HF's per group: equal with
    one group, not with two (goldens/known_divergences.toml). When the second assertion fails, mlx-lm has fixed it:
    remove the entry."""
    mx = pytest.importorskip("mlx.core")
    mlx_gmh = pytest.importorskip("mlx_lm.models.granitemoehybrid")
    import numpy as np

    y, z = torch.randn(3, 32), torch.randn(3, 32)
    out = {}
    for groups in (1, 2):
        norm = hf.GraniteMoeHybridRMSNormGated(32, group_size=32 // groups, eps=1e-5)
        theirs = mlx_gmh.GraniteMoeHybridRMSNormGated(32, eps=1e-5)
        out[groups] = np.abs(np.array(theirs(mx.array(y.numpy()), mx.array(z.numpy()))) - norm(y, z).detach().numpy())
    assert out[1].max() < 1e-5
    assert out[2].max() > 1e-2


# ------------------------------------------------------------------ Mamba (Jamba's)
jamba = pytest.importorskip("transformers.models.jamba.modeling_jamba")


@pytest.mark.parametrize("T", [1, 2, 7, 16, 40])
def test_scan_by_doubling_is_the_recurrence(T):
    """The prefill's scan by doubling (ceil(log2(max_len)) steps) from a non-zero state equals the token-by-token
    recurrence, at lengths below, at and above a power of two."""
    from models.layers.mamba import scan_step, selective_scan

    gen = torch.Generator().manual_seed(T)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    d, n = 6, 4
    x, dt, A = r(1, T, d), torch.rand(1, T, d, generator=gen), -torch.rand(d, n, generator=gen) - 0.1
    B, C, s0 = r(1, T, n), r(1, T, n), r(1, d, n)
    y, state = selective_scan(x, dt, A, B, C, s0.clone(), max_len=64)
    s, steps = s0.clone(), []
    for t in range(T):
        yt, s = scan_step(x[:, t], dt[:, t], A, B[:, t], C[:, t], s)
        steps.append(yt)
    steps = torch.stack(steps, 1)
    assert (y - steps).abs().max() <= 1e-5 * steps.abs().max() and (state - s).abs().max() <= 1e-5 * s.abs().max()


def test_the_mamba_mixer_is_jambas_in_prefill_and_carries_its_state_into_decode():
    from models.layers.mamba import Mamba

    fam = get_family("jamba")
    c = fam.hf_config(fam.tiny_config)
    torch.manual_seed(0)
    ref = randomised(jamba.JambaMambaMixer(c, 0))
    ours = same_weights(ref, Mamba(fam.args(fam.tiny_config)), {"conv_state", "recurrent_state"})
    x = torch.randn(1, 11, c.hidden_size)
    with torch.no_grad():
        want = ref(x)  # HF's torch path without a cache: its loop over the 11 tokens
        whole = ours(x, torch.arange(11))
        parts = [ours(x[:, :8], torch.arange(8))] + [ours(x[:, t:t + 1], torch.tensor([t])) for t in range(8, 11)]
    assert (whole - want).abs().max() <= 1e-5 * want.abs().max()
    assert (torch.cat(parts, 1) - want).abs().max() <= 1e-5 * want.abs().max()


def test_mlx_lm_jamba_renormalises_the_top_k_weights():
    """mlx-lm 0.32.2's JambaSparseMoeBlock weighs the chosen experts by a softmax over their k logits, HF's
    JambaTopKRouter by their probabilities among all the experts (goldens/known_divergences.toml). When this fails,
    mlx-lm has fixed it: remove the entry."""
    mx = pytest.importorskip("mlx.core")
    mlx_jamba = pytest.importorskip("mlx_lm.models.jamba")
    import numpy as np

    c = get_family("jamba").hf_config(get_family("jamba").tiny_config)
    router = jamba.JambaTopKRouter(c)
    with torch.no_grad():
        router.weight.copy_(torch.randn_like(router.weight) * 0.05)  # a spread softmax: the top 2 of 8 far below 1
    x = torch.randn(5, c.hidden_size)
    _, hf_w, hf_idx = router(x)
    logits = mx.array((x @ router.weight.detach().t()).numpy())
    inds = np.array(mx.argpartition(-logits, kth=1, axis=-1)[..., :2])
    theirs = np.array(mx.softmax(mx.take_along_axis(logits, mx.array(inds), axis=-1), axis=-1))
    assert sorted(map(tuple, np.sort(inds, -1).tolist())) == sorted(map(tuple, hf_idx.sort(-1)[0].tolist()))
    np.testing.assert_allclose(theirs.sum(-1), 1.0, rtol=1e-6)  # renormalised
    assert (hf_w.sum(-1) < 0.9).all()  # HF's are not
    src = __import__("inspect").getsource(mlx_jamba.JambaSparseMoeBlock.__call__)
    assert "mx.softmax(scores" in src  # mlx-lm's own block computes it so
