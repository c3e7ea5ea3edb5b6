"""The seeded faults' forms on mlx-lm's attention (exporters/mlx/faults.py applies them): its rope
(a rotary with explicit frequencies in place of the family's), q/k norms, the cache, the mask, the scale,
grouped-query heads, the output gate, MLA, sinks and windows, and the Gated DeltaNet's state."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exporters.mlx.model import attention_block, cache_index, named, patch_call, text_model


# ------------------------------------------------------------------ full attention
class _Rotary(nn.Module):
    """mx.fast.rope with explicit frequencies: an mlx-lm rope (YaRN, Llama 3, LongRoPE, DeepSeek-V2's
    YaRN) rebuilt with one thing changed. `scale` multiplies the rotated features first (YaRN's
    mscale, LongRoPE's scale)."""

    def __init__(self, dims: int, traditional: bool, freqs, scale: float = 1.0):
        super().__init__()
        self.dims, self.traditional, self.scale, self._freqs = dims, traditional, scale, freqs

    def __call__(self, x, offset=0):
        if self.scale != 1.0:
            x = x.at[..., : self.dims].multiply(self.scale)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset,
                            freqs=self._freqs)


# ropes with explicit frequencies whose rotation order is fixed in their __call__
FIXED_ORDER = {"SuScaledRoPE": False, "DeepseekV2YarnRotaryEmbedding": True}


def rotary(r) -> _Rotary:
    """An mlx-lm rope with explicit frequencies (`_freqs`) as a _Rotary that computes the same."""
    freqs = r._freqs
    dims = getattr(r, "dims", None) or getattr(r, "dim", None) or 2 * freqs.shape[0]
    traditional = FIXED_ORDER.get(type(r).__name__, getattr(r, "traditional", False))
    scale = getattr(r, "mscale", None) or getattr(r, "_scale", None) or 1.0
    return _Rotary(dims, traditional, freqs, float(scale))


def _rope(attn, **kw):
    r = attn.rope
    attn.rope = nn.RoPE(**{"dims": r.dims, "traditional": r.traditional, "base": r.base, "scale": r.scale, **kw})


def _exponents(dims):
    return mx.arange(0, dims, 2, dtype=mx.float32) / dims


def rope_theta_wrong(attn, a):
    own = getattr(attn.rope, "base", None) or a.rope.theta  # the layer's own (a per-type rope's) where it says
    theta = 1e4 if own != 1e4 else 1e6  # the qwen2_moe / mlx-lm default mix-up
    if isinstance(attn.rope, nn.RoPE):
        return _rope(attn, base=theta)
    r = rotary(attn.rope)  # the same scaled frequencies, from the other theta
    r._freqs = r._freqs * (theta / a.rope.theta) ** _exponents(r.dims)
    attn.rope = r


def rope_of_the_model(attn, a):
    """The model's rope (the first type's theta and rotary fraction, the global theta) on a layer with its own."""
    if not isinstance(attn.rope, nn.RoPE):
        from oracle.backend import InputError

        raise InputError(f"mlx-lm's rope here is a {type(attn.rope).__name__}, not an nn.RoPE to give the model's base")
    return _rope(attn, base=a.rope.theta, dims=int(a.head_dim * a.rope.partial_rotary_factor))


def rope_interleaved(attn, a):
    if isinstance(attn.rope, nn.RoPE):
        return _rope(attn, traditional=True)
    r = rotary(attn.rope)
    r.traditional = True
    attn.rope = r


def rotary_fraction_wrong(attn, a):
    """The rotated dims wrong (all of head_dim where the family rotates a part, else half), their
    frequencies computed for that width (as a port with the wrong fraction would)."""
    hd = a.head_dim
    if isinstance(attn.rope, nn.RoPE):
        return _rope(attn, dims=hd if attn.rope.dims < hd else hd // 2)
    r = rotary(attn.rope)
    dims = hd if r.dims < hd else hd // 2
    attn.rope = _Rotary(dims, r.traditional, a.rope.theta ** _exponents(dims), r.scale)


def _qk_norms(attn, make) -> None:
    """The attention's q and k norms (under their names on this model: LFM2's q_layernorm) replaced by make(norm)."""
    for role in ("q_norm", "k_norm"):
        name = named(attn, role)
        setattr(attn, name, make(getattr(attn, name)))


def qk_norm_missing(attn, a):
    if hasattr(attn, "use_qk_norm"):  # Llama 4's weightless L2-style norm is a flag in its __call__
        attn.use_qk_norm = False
    else:
        _qk_norms(attn, lambda norm: nn.Identity())


class _NormedFirst(nn.Module):
    """A rope that norms its input first: HunYuan's attention calls its rope on the queries, then on the
    keys (each __call__), so the calls alternate the query and the key norm."""

    def __init__(self, rope, q_norm, k_norm):
        super().__init__()
        self.rope, self.norms, self.calls = rope, (q_norm, k_norm), 0

    def __call__(self, x, offset=0):
        norm = self.norms[self.calls % 2]
        self.calls += 1
        return self.rope(norm(x), offset=offset)


def qk_norm_before_rope(attn, a):  # hunyuan: the per-head norms moved before the rotation
    attn.rope = _NormedFirst(attn.rope, attn.query_layernorm, attn.key_layernorm)
    attn.use_qk_norm = False


class _RegroupedNorm(nn.Module):
    """RMSNorm over groups of `size` features (x viewed as [..., -1, size]), then the weight."""

    def __init__(self, norm, size: int, flat: bool):
        super().__init__()
        self.weight, self.eps, self.size, self.flat = norm.weight, norm.eps, size, flat

    def __call__(self, x):
        shape = x.shape
        g = x.reshape(*shape[:-2], -1) if self.flat else x.reshape(*shape[:-1], -1, self.size)
        return mx.fast.rms_norm(g, None, self.eps).reshape(shape) * self.weight


def qk_norm_per_head_for_flat(attn, a):  # olmoe: the norm spans the whole projection
    _qk_norms(attn, lambda norm: _RegroupedNorm(norm, a.head_dim, False))


def qk_norm_flat_for_per_head(attn, a):  # applied to [B, L, heads, hd]: normalise over heads * hd
    _qk_norms(attn, lambda norm: _RegroupedNorm(norm, a.head_dim, True))


def not_causal(attn, a):
    call = type(attn).__call__
    patch_call(attn, lambda self, x, mask=None, cache=None: call(self, x, None, cache))


def scale_wrong(attn, a):
    # GPT-OSS's attention (with sinks) keeps its softmax scale as sm_scale, the others as scale
    setattr(attn, "sm_scale" if hasattr(attn, "sm_scale") else "scale", 1.0 / a.head_dim)


def gqa_repeat_wrong(attn, a):
    """kv heads tiled (0, 1, 0, 1) instead of repeated (0, 0, 1, 1): k/v projections widened
    to one kv head per query head, in tiled order."""
    nh_attr = next(n for n in ("n_heads", "num_heads", "num_attention_heads") if n in attn.__dict__)
    kv_attr = next(n for n in ("n_kv_heads", "num_key_value_heads") if n in attn.__dict__)
    # (a layer's own head width: Gemma 4's full layers)
    nh, kvh, hd = getattr(attn, nh_attr), getattr(attn, kv_attr), attn.head_dim if a.layer_head_dim else a.head_dim
    if "Wqkv" in attn:  # DBRX's fused projection (rows q, k, v): its k and v rows widened the same way
        q, k, v = mx.split(attn.Wqkv.weight, [nh * hd, (nh + kvh) * hd])
        k, v = (mx.tile(t.reshape(kvh, hd, -1), (nh // kvh, 1, 1)).reshape(nh * hd, -1) for t in (k, v))
        attn.Wqkv.weight = mx.concatenate([q, k, v])
        setattr(attn, kv_attr, nh)
        return
    for p in (attn.k_proj, *([attn.v_proj] if "v_proj" in attn else [])):  # (Gemma 4's k = v layers: v is k's)
        p.weight = mx.tile(p.weight.reshape(kvh, hd, -1), (nh // kvh, 1, 1)).reshape(nh * hd, -1)
        if "bias" in p:
            p.bias = mx.tile(p.bias.reshape(kvh, hd), (nh // kvh, 1)).reshape(-1)
    if a.attention.qk_norm == "flat" and "k_norm" in attn:  # a flat k norm (MiniMax-M2) over the widened k:
        # its gains tiled the same way (the tiled vector's mean square is the original's: k normed as before)
        attn.k_norm.weight = mx.tile(attn.k_norm.weight, (nh // kvh,))
    setattr(attn, kv_attr, nh)


def output_gate_no_sigmoid(attn, a):
    """Qwen3.5's gated attention with o_proj fed output * gate instead of output *
    sigmoid(gate): mlx-lm's own __call__ runs with o_proj set aside, then the sigmoid is
    swapped for the raw gate (the gate as Qwen3NextAttention splits it off q_proj; AFMoE's: its own gate_proj)."""
    call, o_proj = type(attn).__call__, attn.o_proj

    def fn(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        if "gate_proj" in self:
            gate = self.gate_proj(x)
        else:
            gate = mx.split(self.q_proj(x).reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)[1]
            gate = gate.reshape(B, L, -1)
        self["o_proj"] = nn.Identity()
        try:
            gated = call(self, x, mask, cache)  # output * sigmoid(gate)
        finally:
            self["o_proj"] = o_proj
        return o_proj(gated / mx.sigmoid(gate) * gate)

    patch_call(attn, fn)


def kv_off_by_one(model, layer: int):
    """The layer's KV cache writes each token one position late (a zero key/value first), so
    a query never sees its own token: the model's make_cache hands out a faulty cache there."""
    from mlx_lm.models.cache import KVCache

    class OffByOne(KVCache):
        def update_and_fetch(self, keys, values):
            head = self.pending if self.keys is not None else (mx.zeros_like(keys[..., :1, :]),) * 2
            self.pending = keys[..., -1:, :], values[..., -1:, :]
            return super().update_and_fetch(mx.concatenate([head[0], keys[..., :-1, :]], axis=2),
                                            mx.concatenate([head[1], values[..., :-1, :]], axis=2))

    make = getattr(model, "make_cache", None) or (lambda: [KVCache() for _ in model.layers])  # mlx-lm's default
    at = cache_index(model, layer)  # (Nemotron-H: its mixers' caches only)
    model.make_cache = lambda: [OffByOne() if i == at else c for i, c in enumerate(make())]


# ------------------------------------------------------------------ Gated DeltaNet
def gdn_forget(gdn, *slots: int):
    """Drop the cache's states in `slots` before every call (a Gated DeltaNet's conv state 0 or recurrent state 1;
    Kimi delta attention's q, k, v conv states 0, 1, 2 or recurrent state 3)."""
    call = type(gdn).__call__

    def fn(self, x, mask=None, cache=None):
        if cache is not None:
            for slot in slots:
                cache[slot] = None
        return call(self, x, mask, cache)

    patch_call(gdn, fn)


def gdn_chunked_prefill(gdn, a):
    """Prefill in two chunks, the second from a zero recurrent state (conv state carried)."""
    call = type(gdn).__call__

    def fn(self, x, mask=None, cache=None):
        T = x.shape[1]
        if T < 2 or cache is None:
            return call(self, x, mask, cache)
        h = T // 2
        o1 = call(self, x[:, :h], None if mask is None else mask[:, :h], cache)
        cache[1] = None
        return mx.concatenate([o1, call(self, x[:, h:], None if mask is None else mask[:, h:], cache)], axis=1)

    patch_call(gdn, fn)


# ------------------------------------------------------------------ multi-head latent attention
def mla_rope_nope_swapped(attn, a):
    """q's rotary part taken from the front of each head instead of the back: the q projection's rows
    of each head rotated by the rope width, so mlx-lm's split [nope | rope] gets [rope | nope]."""
    p = attn.q_proj if "q_proj" in attn else attn.q_b_proj
    nh, d = attn.num_heads, head_width(attn)
    p.weight = mx.roll(p.weight.reshape(nh, d, -1), -attn.qk_rope_head_dim, axis=1).reshape(nh * d, -1)


def mla_cache_not_carried(attn, a):
    """The compressed KV cache (V3: the latent and the rotary key; V2: its keys and values) zeroed
    before every call: positions kept, what was written before lost."""
    import inspect

    call = type(attn).__call__
    signature = inspect.signature(call)

    def fn(self, x, *args, **kw):  # (mask, cache), or with what the model passes beside them (Mistral 4's attn_scale)
        cache = signature.bind(self, x, *args, **kw).arguments.get("cache")
        if cache is not None and hasattr(cache, "caches"):  # DeepSeek-V3.2's CacheList: the latent's is the first
            cache = cache[0]
        if cache is not None and cache.keys is not None:
            cache.keys, cache.values = mx.zeros_like(cache.keys), mx.zeros_like(cache.values)
        return call(self, x, *args, **kw)

    patch_call(attn, fn)


def head_width(attn) -> int:  # q's width per head, nope + rope (mlx-lm's DeepSeek: q_head_dim; Bailing's: qk_head_dim)
    return attn.q_head_dim if hasattr(attn, "q_head_dim") else attn.qk_head_dim


def yarn_mscale_missing(attn, a):
    attn.scale = head_width(attn) ** -0.5


def q_position_scale_missing(attn, a):
    """Mistral 4's position-dependent query scale left out: the attention takes its model's attn_scale as ones."""
    call = type(attn).__call__

    def fn(self, x, attn_scale, mask=None, cache=None):
        return call(self, x, mx.ones_like(attn_scale), mask, cache)

    patch_call(attn, fn)


# ------------------------------------------------------------------ the variants
def sinks_dropped(attn, a):
    attn.sinks = None  # a plain softmax (mlx-lm's sdpa takes sinks=None)


def window_off_by_one(model, layer: int):
    """The sliding layer's window one key wider: its cache holds window + 1 keys and its attention
    builds its mask for window + 1 (mlx-lm's model hands every sliding layer the same mask)."""
    from mlx_lm.models.base import create_attention_mask
    from mlx_lm.models.cache import RotatingKVCache

    w = text_model(model).args.sliding_window + 1
    make = model.make_cache
    model.make_cache = lambda: [RotatingKVCache(max_size=w) if i == layer else c for i, c in enumerate(make())]
    attn = attention_block(model.layers[layer])
    call = type(attn).__call__

    def fn(self, x, mask=None, cache=None):
        mask = create_attention_mask(x, cache, window_size=w, return_array=isinstance(mask, mx.array))
        return call(self, x, mask, cache)

    patch_call(attn, fn)


def a_theta(model) -> float:  # the rope base mlx-lm's args carry (rope_theta)
    return float(getattr(text_model(model).args, "rope_theta", 10000.0))


def rope_on_nope_layer(model, layer: int):
    """Llama 4's no-rope layer rotated as the rope layers are (their rope, no q/k norm there: mlx-lm's
    use_qk_norm is off on that layer; its temperature tuning, for no-rope layers, then stops)."""
    attn = attention_block(model.layers[layer])
    if hasattr(attn, "is_local_attention"):  # AFMoE: its rope only on the local (sliding) layers, by that flag
        donor = next(attention_block(lay) for lay in model.layers if attention_block(lay).is_local_attention)
        attn.rope, attn.is_local_attention = donor.rope, True
        return
    donor = next((attention_block(lay) for lay in reversed(model.layers) if getattr(attention_block(lay), "use_rope", 0)),
                 None)
    if donor is None:  # no layer rotates (Granite 4.0-H): the family's rope, as mlx-lm builds one where it rotates
        attn.rope, attn.use_rope = nn.RoPE(attn.head_dim, traditional=False, base=a_theta(model)), 1
        return
    attn.rope, attn.use_rope = donor.rope, 1
