"""Kimi delta attention (models/layers/kda.py): the parallel prefill, the one-step recurrence and HF's torch path
(transformers 5.23 kimi_linear: chunk_kimi_delta_attention in chunks of 64, recurrent_kimi_delta_attention) compute one
gated delta rule with a per-channel decay; the production mixer is HF's KimiLinearDeltaAttention on the same weights,
prefill then decode with its conv and recurrent state carried (HF's through its cache). Bailing-hybrid's (transformers
5.23 bailing_hybrid): its KDA mixer (full-rank gates, the bounded decay) and its latent attention's head gate against
HF's modules the same way."""

import pytest
import torch

from models import get_family
from models.layers.kda import KimiDeltaAttention, kda_prefill, kda_step
from tests.mixers import randomised, same_weights

hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")


def _inputs(T, decay: float, h=3, d=16, seed=0, dtype=torch.float32):
    """q, k l2-normed (q scaled), v, the per-channel log decays g in [-decay, 0), beta in (0, 1), a non-zero state;
    [B, h, T, .] as the production functions take them."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    q, k = (torch.nn.functional.normalize(r(1, h, T, d), dim=-1) for _ in range(2))
    i = dict(q=q * d**-0.5, k=k, v=r(1, h, T, d), g=-decay * torch.rand(1, h, T, d, generator=gen, dtype=torch.float64),
             beta=torch.rand(1, h, T, generator=gen, dtype=torch.float64), state=0.3 * r(1, h, d, d))
    return {n: t.to(dtype) for n, t in i.items()}


def _steps(i):
    s, out = i["state"].clone(), []
    for t in range(i["q"].shape[2]):
        o, s = kda_step(*(i[n][:, :, t:t + 1] for n in ("q", "k", "v", "g", "beta")), s)
        out.append(o)
    return torch.cat(out, 2), s


@pytest.mark.parametrize("T", [2, 7, 80])
@pytest.mark.parametrize("decay", [0.05, 2.0])  # a long memory (e^-0.05 a token at most) and a short one
def test_parallel_prefill_is_the_recurrence(T, decay):
    """In fp64 the parallel form and the token-by-token recurrence are one computation (1e-10: the doubling solve is
    exact once 2^j reaches T, what is left is fp64 rounding: measured at most 1.1e-15); in fp32 both, and HF's
    chunked and recurrent torch paths, agree with it within fp32's rounding of other summation orders: 1e-5 of the
    largest value (measured at most 1.1e-6, at T 80 with the short memory; HF's chunks restart their intra-chunk sums
    at token 64, the parallel form does not)."""
    i = _inputs(T, decay, dtype=torch.float64)
    max_len = 128
    o, s = kda_prefill(**i, max_len=max_len)
    o_steps, s_steps = _steps(i)
    assert (o - o_steps).abs().max() <= 1e-10 * o_steps.abs().max()
    assert (s - s_steps).abs().max() <= 1e-10 * s_steps.abs().max()

    f = {n: t.float() for n, t in i.items()}
    o32, s32 = kda_prefill(**f, max_len=max_len)
    hf_in = dict(g=f["g"].transpose(1, 2), beta=f["beta"].transpose(1, 2), initial_state=f["state"].clone(),
                 output_final_state=True)
    qkv = [f[n].transpose(1, 2) for n in ("q", "k", "v")]
    qkv[0] = qkv[0] * 16**0.5  # HF scales q itself
    hf_o, hf_s = hf.chunk_kimi_delta_attention(*qkv, **hf_in)
    hf_ro, hf_rs = hf.recurrent_kimi_delta_attention(*qkv, **hf_in)
    scale, s_scale = o_steps.abs().max(), s_steps.abs().max()
    for out, state in ((o32, s32), (hf_o.transpose(1, 2), hf_s), (hf_ro.transpose(1, 2), hf_rs)):
        assert (out - o_steps).abs().max() <= 1e-5 * scale
        assert (state - s_steps).abs().max() <= 1e-5 * s_scale


def _mixers():
    """HF's KimiLinearDeltaAttention (the tiny config's layer 0) and the production mixer on the same random weights
    (std 0.3, A_log and dt_bias too: decays e^-(0.4..1.6) a token per channel, a short memory that still reaches the
    decode)."""
    fam = get_family("kimi_linear")
    c = fam.hf_config(fam.tiny_config)
    torch.manual_seed(0)
    ref = randomised(hf.KimiLinearDeltaAttention(c, 0))
    ours = same_weights(ref, KimiDeltaAttention(fam.args(fam.tiny_config, max_seq_len=128)),
                        {"conv_state", "recurrent_state"})
    return ref, ours, c


@pytest.mark.parametrize("T", [11, 80])  # within HF's first chunk of 64, and across it
def test_mixer_is_hfs_with_its_state_carried(T):
    """HF's prefill of T - 3 tokens, then 3 decode steps through its cache (conv and recurrent state), against the
    production mixer the same way, and against the production prefill of all T at once: within 2e-5 of the output's
    largest value (fp32 rounding of other summation orders, amplified by the per-head RMSNorm where a head's output
    is small: measured 4.9e-6 at T 80, 5.1e-7 at T 11; the states 6.4e-7 of their largest)."""
    from transformers.cache_utils import DynamicCache

    ref, ours, c = _mixers()
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(1))
    P = T - 3
    with torch.no_grad():
        cache = DynamicCache(config=c)
        want = [ref(x[:, :P], cache_params=cache)] + [ref(x[:, t:t + 1], cache_params=cache) for t in range(P, T)]
        want = torch.cat(want, 1)
        whole = ours(x, torch.arange(T))
        parts = [ours(x[:, :P], torch.arange(P))] + [ours(x[:, t:t + 1], torch.tensor([t])) for t in range(P, T)]
        hf_state = cache.get_recurrent_state(0, state_idx=0)
    scale = want.abs().max()
    assert (whole - want).abs().max() <= 2e-5 * scale
    assert (torch.cat(parts, 1) - want).abs().max() <= 2e-5 * scale
    assert (ours.recurrent_state - hf_state).abs().max() <= 1e-5 * hf_state.abs().max()
    # the last K - 1 inputs as they were (HF's cache keeps K, the oldest of them read by no later step)
    assert torch.equal(ours.conv_state, cache.get_conv_state(0, state_idx=0)[..., 1:])


def test_a_call_at_position_0_starts_a_new_sequence():
    """The state buffers are zeroed by a call at position 0: a second prefill is the first's, not its continuation."""
    _, ours, c = _mixers()
    x = torch.randn(1, 6, c.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        first = ours(x, torch.arange(6))
        again = ours(x, torch.arange(6))
    assert torch.equal(first, again)


# ------------------------------------------------------------------ Bailing-hybrid: full-rank gates, the bounded decay,
# and its latent attention's head gate
def _bailing():
    hb = pytest.importorskip("transformers.models.bailing_hybrid.modeling_bailing_hybrid")
    fam = get_family("bailing_hybrid")
    c = fam.hf_config(fam.tiny_config)
    c._attn_implementation = "eager"
    return hb, c, fam.args(fam.tiny_config, max_seq_len=128)


def _random_(module, std=0.3, seed=0):
    torch.manual_seed(seed)
    return randomised(module, std)


@pytest.mark.parametrize("T", [11, 80])  # within HF's first chunk of 64, and across it
def test_bailing_mixer_is_hfs_with_its_state_carried(T):
    """HF's BailingHybridDeltaAttention (f_proj and g_proj full-rank, the forget gate bounded: kda_lower_bound *
    sigmoid(e^A_log (f + dt_bias)), in (-1, 0) with the tiny config's bound) and the production mixer (KDAArgs
    low_rank_gates False, lower_bound -1) on the same random weights: HF's prefill of T - 3 tokens then 3 decode steps
    through its cache, against the production mixer the same way and prefilled whole, within 2e-5 of the output's
    largest value (as Kimi-Linear's above; measured 1.2e-6 at T 80, 3.7e-7 at T 11; the states 3.1e-7 of their
    largest). The decay is the bounded one: the same mixer with Kimi-Linear's unbounded decay (the seeded fault
    kda_gate_bound_dropped) is off by 0.56-0.62 of the output's largest value."""
    from transformers.cache_utils import DynamicCache

    from models.faults.kda import kda_gate_bound_dropped

    hb, c, args = _bailing()
    assert args.kda.lower_bound == -1.0 and not args.kda.low_rank_gates
    ref = _random_(hb.BailingHybridDeltaAttention(c, 0))
    ours = KimiDeltaAttention(args)
    state = {k: (v.reshape(1, 1, -1, 1) if k.endswith("A_log") else v) for k, v in ref.state_dict().items()}
    missing = ours.load_state_dict(state, strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) == {"conv_state", "recurrent_state"}
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(1))
    P = T - 3
    with torch.no_grad():
        cache = DynamicCache(config=c)
        want = torch.cat([ref(x[:, :P], cache_params=cache)] + [ref(x[:, t:t + 1], cache_params=cache)
                                                                for t in range(P, T)], 1)
        g = ref.forget_gate(x)
        whole = ours(x, torch.arange(T))
        parts = [ours(x[:, :P], torch.arange(P))] + [ours(x[:, t:t + 1], torch.tensor([t])) for t in range(P, T)]
        hf_state = cache.get_recurrent_state(0, state_idx=0)
        state, conv_state = ours.recurrent_state.clone(), ours.conv_state.clone()
        kda_gate_bound_dropped(ours, args)
        unbounded = ours(x, torch.arange(T))
    assert -1.0 <= float(g.min()) and float(g.max()) <= 0.0 and float(g.min()) < -0.5
    scale = want.abs().max()
    assert (whole - want).abs().max() <= 2e-5 * scale
    assert (torch.cat(parts, 1) - want).abs().max() <= 2e-5 * scale
    assert (state - hf_state).abs().max() <= 1e-5 * hf_state.abs().max()
    assert torch.equal(conv_state, cache.get_conv_state(0, state_idx=0)[..., 1:])
    assert (unbounded - want).abs().max() > 0.05 * scale


def test_bailing_latent_attention_head_gate_is_hfs():
    """HF's BailingHybridAttention (DeepSeek's MLA with q_proj directly, interleaved rotary pairs, and each head's
    output times sigmoid(g_proj(x)), one gate per head) and the production LatentAttention with its head gate
    (AttentionArgs.gate_act "sigmoid", gate_width "head") on the same random weights: a prefill of 9 tokens then 2
    decode steps through HF's cache, within 1e-5 of the output's largest value (fp32 rounding of other summation
    orders: the production model expands the keys from its latent cache at every call; measured 1.6e-7). Without the
    gate's sigmoid (the seeded fault mla_head_gate_no_activation) it is off by 1.9 times that value."""
    from transformers.cache_utils import DynamicCache

    from models.faults.mla import mla_head_gate_no_activation
    from models.layers.mla import LatentAttention

    hb, c, args = _bailing()
    layer = c.layer_types.index("full_attention")
    ref = _random_(hb.BailingHybridAttention(c, layer), std=0.2)
    ours = same_weights(ref, LatentAttention(args, layer=layer), {"latent_cache", "rope_key_cache"})
    rotary = hb.BailingHybridRotaryEmbedding(c)
    T, P = 11, 9
    x = torch.randn(1, T, c.hidden_size, generator=torch.Generator().manual_seed(3))

    def hf_call(xs, start, cache):
        n = xs.shape[1]
        pos = torch.arange(start, start + n)[None]
        mask = torch.full((n, start + n), float("-inf")).triu(start + 1)[None, None]
        return ref(xs, rotary(xs, pos), mask, past_key_values=cache)[0]

    with torch.no_grad():
        cache = DynamicCache(config=c)
        want = torch.cat([hf_call(x[:, :P], 0, cache)] + [hf_call(x[:, t:t + 1], t, cache) for t in range(P, T)], 1)
        got = torch.cat([ours(x[:, :P], torch.arange(P))] + [ours(x[:, t:t + 1], torch.tensor([t]))
                                                             for t in range(P, T)], 1)
        mla_head_gate_no_activation(ours, args)
        ungated = ours(x, torch.arange(T))
    scale = want.abs().max()
    assert (got - want).abs().max() <= 1e-5 * scale
    assert (ungated - want).abs().max() > 0.05 * scale
