"""Seeded faults on mlx-lm's model, keyed by the names in models/faults.py.

Each transform changes one block of a loaded mlx-lm model in place, the way the bug would
look in an MLX port: a module attribute (rope, scale, eps, norm), weights, or one module
instance's `__call__`. `inject(fault, model, args)` applies it at the layer models/faults.py
expects the oracle to localise it (`fault.layer(args)`, `fault.kind`), reading the checkpoint's
ModelArgs for what mlx-lm's modules do not all carry (top-k, renormalisation, head_dim, rope theta).
mlx-lm's families name their parts differently (exporters/mlx_model.py: `switch_mlp` or `experts`,
a router that routes by itself or a linear gate whose logits the block routes inline, Granite's
`router.layer`, GPT-OSS's `sm_scale`, Llama 4's `use_qk_norm`, ropes with explicit frequencies):
every transform goes through those accessors, so each fault has its own form on every family.
Faults with no form on mlx-lm's model (the bf16 dtype faults; ERNIE's correction-bias faults, whose
bias mlx-lm drops) are refused: `MLXBackend.with_fault` returns None for them and `not_applicable`
says why.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exporters.mlx_model import attention_block, experts_of, moe_block, router_linear, router_logits, router_module, \
    text_model
from exporters.mlx_model import route as mlx_route


def patch_call(module, fn) -> None:
    """Override `__call__` of this one instance (Python looks it up on the type). The subclass keeps
    the class's name and module (exporters.mlx_model.route finds its routing mirror through the MRO)."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"__call__": fn, "__module__": cls.__module__})


# ------------------------------------------------------------------ router / moe
def _topk(scores, k):
    inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(scores, inds, axis=-1), inds


def _scores(logits, k, renorm, score=lambda v: mx.softmax(v, axis=-1, precise=True)):
    """Score all experts, top-k, renormalised where the family does (Mixtral's softmax over
    the top-k logits is the same)."""
    s, inds = _topk(score(logits.astype(mx.float32)), k)
    return (s / s.sum(axis=-1, keepdims=True) if renorm else s), inds


def _softmax_after_topk(logits, k, renorm):
    v, inds = _topk(logits.astype(mx.float32), k)
    return mx.softmax(v, axis=-1, precise=True), inds


def combine(moe, x, scores, inds, a, weighted=True, shared=True, shared_sigmoid=True):
    """What the family's mlx-lm MoE block computes from its routing (scores [.., k], inds [.., k]):
    the routed experts weighted and summed (Llama 4: each expert's input scaled by its weight),
    plus the shared expert(s) (Qwen's behind a sigmoid gate). One step changed by the flags."""
    ex = experts_of(moe)
    if a.router.weights_on_input:  # Llama 4 (top-1): experts(x * sigmoid score)
        y = ex(x * scores.astype(x.dtype) if weighted else x, inds).sum(axis=-2)
    else:
        y = ex(x, inds)
        y = (y * scores[..., None] if weighted else y).sum(axis=-2).astype(x.dtype)
    if shared and a.shared_expert_intermediate_size > 0:
        if "shared_expert" in moe:
            s = moe.shared_expert(x)
            if "shared_expert_gate" in moe:
                g = moe.shared_expert_gate(x)
                s = (mx.sigmoid(g) if shared_sigmoid else g) * s
        else:
            s = moe.shared_experts(x)
        y = y + s
    return y


def _moe(layer, a, **changed):
    """The layer's MoE block computing mlx-lm's MoE (its own routing: exporters.mlx_model.route)
    with one step of the combine changed (combine's flags)."""
    patch_call(moe_block(layer), lambda self, x: combine(self, x, *mlx_route(self, x), a, **changed))


def _reroute(layer, a, route):
    """The layer's routing replaced by `route(logits, k, renorm) -> (weights, indices)` on the
    router's logits. A router module that routes by itself (DeepSeek's MoEGate, dots1, Granite) is
    patched: the block calls it as before. A block that routes inline gets `oracle_route`, which
    both its patched __call__ and the router block program use (mlx-lm has no router module there)."""
    moe = moe_block(layer)
    k, renorm = a.num_experts_per_tok, a.router.norm_topk_prob

    def faulty(x):
        return route(router_logits(moe, x), k, renorm)

    gate = router_module(moe)
    if gate is not None:  # returns (indices, weights)
        patch_call(gate, lambda self, x: tuple(reversed(faulty(x))))
    else:
        moe.oracle_route = faulty
        _moe(layer, a)


def _no_renorm(layer, a):
    gate = router_module(moe_block(layer))
    if gate is not None and hasattr(gate, "norm_topk_prob"):  # DeepSeek-V3, GLM-4, dots1: the gate's own flag
        gate.norm_topk_prob = False
    elif hasattr(moe_block(layer), "norm_topk_prob"):  # Qwen3's block reads its flag at every call
        moe_block(layer).norm_topk_prob = False
    else:
        _reroute(layer, a, lambda v, k, renorm: _scores(v, k, False))


def _one_expert_fewer(layer, a):
    """The router's linear layer with its last expert's row dropped: every family's own routing
    then runs over one expert fewer than the checkpoint has."""
    r = router_linear(moe_block(layer))
    r.weight = r.weight[:-1]
    if "bias" in r:
        r.bias = r.bias[:-1]


def _sigmoid(layer, a):
    moe = moe_block(layer)
    if "gate_act" in moe:  # ERNIE's block has the choice itself
        moe.gate_act = nn.Sigmoid()
    else:
        _reroute(layer, a, lambda v, k, renorm: _scores(v, k, renorm, mx.sigmoid))


def _gate_up_swapped(layer, a):
    sw = experts_of(moe_block(layer))
    sw["gate_proj"], sw["up_proj"] = sw["up_proj"], sw["gate_proj"]


def _one_expert_off(layer, a):
    """The most-routed-to expert (largest router row norm) off by 1e-3 in all its weights."""
    moe = moe_block(layer)
    e = int(mx.argmax(mx.linalg.norm(router_linear(moe).weight, axis=1)))
    sw = experts_of(moe)
    for proj in (sw.gate_proj, sw.up_proj, sw.down_proj):
        hit = (mx.arange(proj.weight.shape[0]) == e)[:, None, None]
        proj.weight = proj.weight + 1e-3 * hit


def _expert_index_off_by_one(layer, a):
    sw = experts_of(moe_block(layer))
    n, call = sw.gate_proj.weight.shape[0], type(sw).__call__
    patch_call(sw, lambda self, x, inds: call(self, x, (inds + 1) % n))


def _stray_bf16(layer, a):
    moe = moe_block(layer)
    call = type(moe).__call__
    patch_call(moe, lambda self, x: call(self, x).astype(mx.bfloat16).astype(x.dtype))


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


def _rope_theta_wrong(attn, a):
    theta = 1e4 if a.rope.theta != 1e4 else 1e6  # the qwen2_moe / mlx-lm default mix-up
    if isinstance(attn.rope, nn.RoPE):
        return _rope(attn, base=theta)
    r = rotary(attn.rope)  # the same scaled frequencies, from the other theta
    r._freqs = r._freqs * (theta / a.rope.theta) ** _exponents(r.dims)
    attn.rope = r


def _rope_interleaved(attn, a):
    if isinstance(attn.rope, nn.RoPE):
        return _rope(attn, traditional=True)
    r = rotary(attn.rope)
    r.traditional = True
    attn.rope = r


def _rotary_fraction_wrong(attn, a):
    """The rotated dims wrong (all of head_dim where the family rotates a part, else half), their
    frequencies computed for that width (as a port with the wrong fraction would)."""
    hd = a.head_dim
    if isinstance(attn.rope, nn.RoPE):
        return _rope(attn, dims=hd if attn.rope.dims < hd else hd // 2)
    r = rotary(attn.rope)
    dims = hd if r.dims < hd else hd // 2
    attn.rope = _Rotary(dims, r.traditional, a.rope.theta ** _exponents(dims), r.scale)


def _qk_norm_missing(attn, a):
    if hasattr(attn, "use_qk_norm"):  # Llama 4's weightless L2-style norm is a flag in its __call__
        attn.use_qk_norm = False
    else:
        attn.q_norm, attn.k_norm = nn.Identity(), nn.Identity()


class _RegroupedNorm(nn.Module):
    """RMSNorm over groups of `size` features (x viewed as [..., -1, size]), then the weight."""

    def __init__(self, norm, size: int, flat: bool):
        super().__init__()
        self.weight, self.eps, self.size, self.flat = norm.weight, norm.eps, size, flat

    def __call__(self, x):
        shape = x.shape
        g = x.reshape(*shape[:-2], -1) if self.flat else x.reshape(*shape[:-1], -1, self.size)
        return mx.fast.rms_norm(g, None, self.eps).reshape(shape) * self.weight


def _qk_norm_per_head_for_flat(attn, a):  # olmoe: the norm spans the whole projection
    hd = a.head_dim
    attn.q_norm, attn.k_norm = _RegroupedNorm(attn.q_norm, hd, False), _RegroupedNorm(attn.k_norm, hd, False)


def _qk_norm_flat_for_per_head(attn, a):  # applied to [B, L, heads, hd]: normalise over heads * hd
    hd = a.head_dim
    attn.q_norm, attn.k_norm = _RegroupedNorm(attn.q_norm, hd, True), _RegroupedNorm(attn.k_norm, hd, True)


def _not_causal(attn, a):
    call = type(attn).__call__
    patch_call(attn, lambda self, x, mask=None, cache=None: call(self, x, None, cache))


def _scale_wrong(attn, a):
    # GPT-OSS's attention (with sinks) keeps its softmax scale as sm_scale, the others as scale
    setattr(attn, "sm_scale" if hasattr(attn, "sm_scale") else "scale", 1.0 / a.head_dim)


def _gqa_repeat_wrong(attn, a):
    """kv heads tiled (0, 1, 0, 1) instead of repeated (0, 0, 1, 1): k/v projections widened
    to one kv head per query head, in tiled order."""
    nh_attr = next(n for n in ("n_heads", "num_heads", "num_attention_heads") if n in attn.__dict__)
    kv_attr = next(n for n in ("n_kv_heads", "num_key_value_heads") if n in attn.__dict__)
    nh, kvh, hd = getattr(attn, nh_attr), getattr(attn, kv_attr), a.head_dim
    for p in (attn.k_proj, attn.v_proj):
        p.weight = mx.tile(p.weight.reshape(kvh, hd, -1), (nh // kvh, 1, 1)).reshape(nh * hd, -1)
        if "bias" in p:
            p.bias = mx.tile(p.bias.reshape(kvh, hd), (nh // kvh, 1)).reshape(-1)
    setattr(attn, kv_attr, nh)


def _output_gate_no_sigmoid(attn, a):
    """Qwen3.5's gated attention with o_proj fed output * gate instead of output *
    sigmoid(gate): mlx-lm's own __call__ runs with o_proj set aside, then the sigmoid is
    swapped for the raw gate (the gate as Qwen3NextAttention splits it off q_proj)."""
    call, o_proj = type(attn).__call__, attn.o_proj

    def fn(self, x, mask=None, cache=None):
        B, L, _ = x.shape
        gate = mx.split(self.q_proj(x).reshape(B, L, self.num_attention_heads, -1), 2, axis=-1)[1]
        gate = gate.reshape(B, L, -1)
        self["o_proj"] = nn.Identity()
        try:
            gated = call(self, x, mask, cache)  # output * sigmoid(gate)
        finally:
            self["o_proj"] = o_proj
        return o_proj(gated / mx.sigmoid(gate) * gate)

    patch_call(attn, fn)


def _kv_off_by_one(model, layer: int):
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
    model.make_cache = lambda: [OffByOne() if i == layer else c for i, c in enumerate(make())]


# ------------------------------------------------------------------ Gated DeltaNet
def _gdn_forget(gdn, slot: int):
    """Drop the cache's conv state (slot 0) or recurrent state (slot 1) before every call."""
    call = type(gdn).__call__

    def fn(self, x, mask=None, cache=None):
        if cache is not None:
            cache[slot] = None
        return call(self, x, mask, cache)

    patch_call(gdn, fn)


def _gdn_chunked_prefill(gdn, a):
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


# ------------------------------------------------------------------ layer / model
def _input_norm_eps(layer, a):
    layer.input_layernorm.eps *= 1e3


def _norm_offset_missing(layer, a):  # sanitize()'s +1 on (1 + w) weights lost (conv1d-shape trap)
    layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight - 1.0


def _residual_missing(layer, a):
    def call(self, x, mask=None, cache=None):
        h = attention_block(self)(self.input_layernorm(x), mask, cache)
        return h + moe_block(self)(self.post_attention_layernorm(h))

    patch_call(layer, call)


def _final_norm_eps(model, a):
    text_model(model).model.norm.eps *= 1e3


# ------------------------------------------------------------------ DeepSeek-style routing
# DeepSeek-V2/V3, GLM-4 and dots1 route in a gate module (MoEGate / TopkRouter) that keeps its
# routing fields as attributes: most of these faults are one of them set wrong.
def _gate(layer):
    return router_module(moe_block(layer))


def _set_gate(**fields):
    def apply(layer, a):
        g = _gate(layer)
        for k, v in fields.items():
            setattr(g, k, v(a) if callable(v) else v)

    return apply


def _group_limit_ignored(layer, a):
    g = _gate(layer)
    g.n_group, g.topk_group = 1, 1  # V3 / GLM-4: `if n_group > 1`; dots1: `n_group - topk_group` groups dropped
    if hasattr(g, "topk_method"):  # V2's group_limited_greedy reads its method
        g.topk_method = "greedy"


def _bias_ignored(layer, a):
    g = _gate(layer)
    g.e_score_correction_bias = mx.zeros_like(g.e_score_correction_bias)


def _bias_in_weights(layer, a):
    """The gate's own choice, its weights taken from sigmoid + correction bias (not the sigmoid alone)."""
    g = _gate(layer)
    call = type(g).__call__

    def fn(self, x):
        inds, _ = call(self, x)
        s = mx.take_along_axis(mx.sigmoid((x @ self.weight.T).astype(mx.float32)) + self.e_score_correction_bias,
                               inds, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            s = s / s.sum(axis=-1, keepdims=True)
        return inds, s * self.routed_scaling_factor

    patch_call(g, fn)


def _softmax_for_sigmoid(layer, a):
    """Softmax scores where the family's are sigmoid. A routing gate runs its module's own
    group_expert_select (which takes the sigmoid of what it is given) on logit(softmax): its scores
    are then the softmax probabilities. Llama 4 (inline): softmax over all experts, top-k of those."""
    import sys

    g = _gate(layer)
    if g is None:
        return _reroute(layer, a, lambda v, k, renorm: _scores(v, k, False))
    select = sys.modules[type(g).__module__].group_expert_select

    def fn(self, x):
        p = mx.softmax((x @ self.weight.T).astype(mx.float32), axis=-1, precise=True)
        return select(mx.log(p) - mx.log1p(-p), self.e_score_correction_bias, self.top_k, self.n_group,
                      self.topk_group, self.routed_scaling_factor, self.norm_topk_prob)

    patch_call(g, fn)


def _dense_layer_routed(layer, a):
    mlp = moe_block(layer)
    call = type(mlp).__call__
    patch_call(mlp, lambda self, x: call(self, x) * a.router.routed_scaling_factor)


def _moe_layer_as_dense(layer, a):
    """A wrong MoE/dense interleave: the layer's routed experts left out, its shared expert(s) all it computes."""
    moe = moe_block(layer)
    patch_call(moe, lambda self, x: (self["shared_expert"] if "shared_expert" in self else self["shared_experts"])(x))


# ------------------------------------------------------------------ multi-head latent attention
def _mla_rope_nope_swapped(attn, a):
    """q's rotary part taken from the front of each head instead of the back: the q projection's rows
    of each head rotated by the rope width, so mlx-lm's split [nope | rope] gets [rope | nope]."""
    p = attn.q_proj if "q_proj" in attn else attn.q_b_proj
    nh, d = attn.num_heads, attn.q_head_dim
    p.weight = mx.roll(p.weight.reshape(nh, d, -1), -attn.qk_rope_head_dim, axis=1).reshape(nh * d, -1)


def _mla_cache_not_carried(attn, a):
    """The compressed KV cache (V3: the latent and the rotary key; V2: its keys and values) zeroed
    before every call: positions kept, what was written before lost."""
    call = type(attn).__call__

    def fn(self, x, mask=None, cache=None):
        if cache is not None and cache.keys is not None:
            cache.keys, cache.values = mx.zeros_like(cache.keys), mx.zeros_like(cache.values)
        return call(self, x, mask, cache)

    patch_call(attn, fn)


def _yarn_mscale_missing(attn, a):
    attn.scale = attn.q_head_dim ** -0.5


# ------------------------------------------------------------------ the variants
def _sinks_dropped(attn, a):
    attn.sinks = None  # a plain softmax (mlx-lm's sdpa takes sinks=None)


def _window_off_by_one(model, layer: int):
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


def _clamp_missing(layer, a):
    experts_of(moe_block(layer)).activation._limit = float("inf")  # SwigluOAI's limit (7)


def _router_logit_bias_ignored(layer, a):
    moe_block(layer).router.pop("bias")  # nn.Linear adds a bias only when it has one


def _sparsemixer_first_unmasked(layer, a):
    from mlx_lm.models.phimoe import sparsemixer

    def route(logits, k, renorm):
        inds, scores = sparsemixer(logits, top_k=k, jitter_eps=a.router.jitter_eps)
        return mx.repeat(scores[..., :1], k, axis=-1), mx.repeat(inds[..., :1], k, axis=-1)

    _reroute(layer, a, route)


def _layernorm_as_rmsnorm(layer, a):
    ln = layer.input_layernorm
    rms = nn.RMSNorm(ln.weight.shape[0], eps=ln.eps)
    rms.weight = ln.weight
    layer.input_layernorm = rms


def _rope_on_nope_layer(model, layer: int):
    """Llama 4's no-rope layer rotated as the rope layers are (their rope, no q/k norm there: mlx-lm's
    use_qk_norm is off on that layer; its temperature tuning, for no-rope layers, then stops)."""
    attn = attention_block(model.layers[layer])
    donor = next(attention_block(lay) for lay in reversed(model.layers) if getattr(attention_block(lay), "use_rope", 0))
    attn.rope, attn.use_rope = donor.rope, 1


def _logits_scaling_missing(model, a):
    text_model(model).logits_scaling = 1.0  # mlx-lm's Granite divides by it (so does the logits block)


def _set(name, value):
    def apply(obj, a):
        setattr(obj, name, value(a) if callable(value) else value)

    return apply


# name -> transform(target, args): target the layer, its attention block (fault.kind attention),
# or the model (fault.target model; MODEL_LEVEL: the model and the layer index)
FAULTS = {
    "router_softmax_after_topk": lambda layer, a: _reroute(layer, a, _softmax_after_topk),
    "router_no_renorm": _no_renorm,
    "router_wrong_num_experts": _one_expert_fewer,
    "router_sigmoid": _sigmoid,
    "expert_gate_up_swapped": _gate_up_swapped,
    "expert_weights_off_1e-3": _one_expert_off,
    "expert_index_off_by_one": _expert_index_off_by_one,
    "expert_weights_not_applied": lambda layer, a: _moe(layer, a, weighted=False),
    "shared_expert_gate_no_sigmoid": lambda layer, a: _moe(layer, a, shared_sigmoid=False),
    "shared_expert_missing": lambda layer, a: _moe(layer, a, shared=False),
    "stray_bf16_downcast": _stray_bf16,
    "rope_theta_wrong": _rope_theta_wrong,
    "rope_interleaved": _rope_interleaved,
    "rotary_fraction_wrong": _rotary_fraction_wrong,
    "qk_norm_missing": _qk_norm_missing,
    "qk_norm_per_head_for_flat": _qk_norm_per_head_for_flat,
    "qk_norm_flat_for_per_head": _qk_norm_flat_for_per_head,
    "kv_cache_write_off_by_one": _kv_off_by_one,
    "attention_not_causal": _not_causal,
    "attention_scale_wrong": _scale_wrong,
    "gqa_kv_heads_tiled": _gqa_repeat_wrong,
    "attention_gate_no_sigmoid": _output_gate_no_sigmoid,
    "gdn_state_not_carried": lambda gdn, a: _gdn_forget(gdn, 1),
    "gdn_conv_state_not_carried": lambda gdn, a: _gdn_forget(gdn, 0),
    "gdn_chunked_prefill_differs": _gdn_chunked_prefill,
    "rmsnorm_eps_wrong": _input_norm_eps,
    "norm_offset_missing": _norm_offset_missing,
    "residual_missing": _residual_missing,
    "final_norm_eps_wrong": _final_norm_eps,
    "router_bias_in_weights": _bias_in_weights,
    "router_bias_ignored": _bias_ignored,
    "router_group_limit_ignored": _group_limit_ignored,
    "routed_scaling_missing": _set_gate(routed_scaling_factor=1.0),
    "routed_scaling_twice": _set_gate(routed_scaling_factor=lambda a: a.router.routed_scaling_factor ** 2),
    "router_softmax_for_sigmoid": _softmax_for_sigmoid,
    "dense_layer_routed": _dense_layer_routed,
    "mla_rope_nope_swapped": _mla_rope_nope_swapped,
    "mla_cache_not_carried": _mla_cache_not_carried,
    "yarn_mscale_missing": _yarn_mscale_missing,
    "attention_sinks_dropped": _sinks_dropped,
    "sliding_window_off_by_one": _window_off_by_one,
    "swiglu_clamp_missing": _clamp_missing,
    "router_logit_bias_ignored": _router_logit_bias_ignored,
    "sparsemixer_first_unmasked": _sparsemixer_first_unmasked,
    "layernorm_as_rmsnorm": _layernorm_as_rmsnorm,
    "moe_interleave_wrong": _moe_layer_as_dense,
    "residual_multiplier_missing": _set("residual_multiplier", 1.0),
    "attention_multiplier_missing": _set("scale", lambda a: a.head_dim ** -0.5),
    "logits_scaling_missing": _logits_scaling_missing,
    "rope_on_nope_layer": _rope_on_nope_layer,
}

# transforms taking (model, layer index): what they change is also outside the layer (its cache, a donor rope)
MODEL_LEVEL = {"kv_cache_write_off_by_one", "sliding_window_off_by_one", "rope_on_nope_layer"}

# faults of the catalogue with no form on mlx-lm's model, and why (None from MLXBackend.with_fault)
NOT_APPLICABLE = {
    "moe_output_upcast": "a bf16 dtype fault: mlx's CPU gather_mm (the experts) is float32-only, so mlx runs bf16 "
                         "on Apple GPUs only, where no form of it is written yet",
    "logits_cast_to_float": "a bf16 dtype fault: mlx's CPU gather_mm (the experts) is float32-only, so mlx runs "
                            "bf16 on Apple GPUs only, where no form of it is written yet",
}
# ... and on one family's mlx-lm model only: (fault, mlx-lm module) -> why
NOT_APPLICABLE_ON = {
    ("router_bias_in_weights", "ernie4_5_moe"): "mlx-lm's ernie4_5_moe has no correction bias (its sanitize() drops "
                                                "it: the known divergence), so there is no bias to misuse",
    ("router_bias_ignored", "ernie4_5_moe"): "mlx-lm's ernie4_5_moe already ignores the correction bias (the known "
                                             "divergence): the fault is the candidate as it is",
}


def not_applicable(fault, module: str) -> str | None:
    """Why `fault` has no form on the mlx-lm model `module` (None: it has one)."""
    return NOT_APPLICABLE_ON.get((fault.name, module)) or NOT_APPLICABLE.get(fault.name) or (
        None if fault.name in FAULTS else "no form on mlx-lm's model in exporters/mlx_faults.py")


def inject(fault, model, args) -> None:
    """Apply `fault` to the loaded mlx-lm model where models/faults.py expects it (fault.layer(args))."""
    why = NOT_APPLICABLE_ON.get((fault.name, type(model).__module__.rsplit(".", 1)[-1]))
    if why:  # refused for this family's mlx-lm model (the selftest lists it as not applicable)
        from oracle.backend import InputError

        raise InputError(f"{fault.name}: {why}")
    i = fault.layer(args)
    if fault.name in MODEL_LEVEL:
        FAULTS[fault.name](model, i)
    elif i is None:
        FAULTS[fault.name](model, args)
    elif fault.kind == "attention":
        FAULTS[fault.name](attention_block(model.layers[i]), args)
    else:
        FAULTS[fault.name](model.layers[i], args)


# ------------------------------------------------------------------ a quantized runtime's faults
# Seeded into the candidate loaded from a shipped directory (--candidate-dir), in one decoder
# layer's experts: the weights in the file are right, the runtime dequantizes them wrongly. The
# implementation rows must fail at that layer's moe; the quantization rows (HF original vs HF on
# the file's weights) cannot see a runtime fault and must not change.
def _experts_quantized(layer) -> list:
    sw = moe_block(layer).switch_mlp
    mods = [getattr(sw, name) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all("scales" in m for m in mods):
        raise ValueError("the layer's experts are not quantized: a quantized runtime fault needs a quantized candidate")
    return mods


def _scale_bias_swap(layer):  # each group's scale read as its bias and its bias as its scale
    for m in _experts_quantized(layer):
        m.scales, m.biases = m.biases, m.scales


def _group_size_doubled(layer):  # each scale and bias applied to two groups: group size read as 2x the file's
    for m in _experts_quantized(layer):
        idx = mx.array([(g // 2) * 2 for g in range(m.scales.shape[-1])])
        m.scales, m.biases = m.scales[..., idx], m.biases[..., idx]


QUANTIZED_FAULTS = {"dequant_scale_bias_swap": _scale_bias_swap, "dequant_group_size_doubled": _group_size_doubled}


# the point inside its block each fault's form here breaks, where it is not the catalogue's
# (models.faults.POINTS): these forms edit a projection's weights, so that projection diverges first
POINTS = {
    "gqa_kv_heads_tiled": ("k_proj", "v_proj"),  # k/v projections widened to one head per query head
    "mla_rope_nope_swapped": ("q_proj", "q_b_proj"),  # the q projection's rows rolled by the rope width
    "router_wrong_num_experts": "logits",  # the gate's rows sliced: the logits have fewer experts
}
