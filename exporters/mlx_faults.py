"""Seeded faults on mlx-lm's model, keyed by the names in models/faults.py.

Each transform changes one block of a loaded mlx-lm model in place, the way the bug would
look in an MLX port: a module attribute (rope, scale, eps, norm), weights, or one module
instance's `__call__`. `inject(fault, model)` applies it where models/faults.py expects the
oracle to localise it (fault.target / fault.kind). Faults with no natural form on mlx-lm's
model are absent (`MLXBackend.with_fault` returns None for them): the bf16 dtype faults
(mlx's CPU gather_mm is fp32 only, so mlx runs bf16 MoE models on the GPU only).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exporters.mlx_model import attention_block, moe_block, text_model
from exporters.mlx_model import route as mlx_route


def patch_call(module, fn) -> None:
    """Override `__call__` of this one instance (Python looks it up on the type)."""
    cls = type(module)
    module.__class__ = type(cls.__name__, (cls,), {"__call__": fn})


# ------------------------------------------------------------------ router / moe
def _topk(scores, k):
    inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(scores, inds, axis=-1), inds


def _scores(logits, k, renorm, score=lambda v: mx.softmax(v, axis=-1, precise=True)):
    """Score all experts, top-k, renormalised where the family does (Mixtral's softmax over
    the top-k logits is the same)."""
    s, inds = _topk(score(logits), k)
    return (s / s.sum(axis=-1, keepdims=True) if renorm else s), inds


def _moe(layer, route=None, renorm=None, weighted=True, shared=True, shared_sigmoid=True):
    """The layer's MoE block computing mlx-lm's MoE with one step changed. A changed routing
    `route(logits, k, renorm)` is set as the block's `oracle_route`, which the router block
    program uses too; otherwise the routing is mlx-lm's (exporters.mlx.route)."""
    moe = moe_block(layer)
    if route is not None:
        k = getattr(moe, "top_k", None) or moe.num_experts_per_tok
        renorm = getattr(moe, "norm_topk_prob", "block_sparse_moe" in layer) if renorm is None else renorm
        moe.oracle_route = lambda x: route(moe.gate(x), k, renorm)

    def call(self, x):
        scores, inds = mlx_route(self, x)
        y = self.switch_mlp(x, inds)
        y = (y * scores[..., None]).sum(axis=-2) if weighted else y.sum(axis=-2)
        if shared and "shared_expert" in self:
            g = self.shared_expert_gate(x)
            y = y + (mx.sigmoid(g) if shared_sigmoid else g) * self.shared_expert(x)
        return y

    patch_call(moe, call)


def _softmax_after_topk(logits, k, renorm):
    v, inds = _topk(logits, k)
    return mx.softmax(v, axis=-1, precise=True), inds


def _gate_up_swapped(layer):
    sw = moe_block(layer).switch_mlp
    sw["gate_proj"], sw["up_proj"] = sw["up_proj"], sw["gate_proj"]


def _one_expert_off(layer):
    """The most-routed-to expert (largest router row norm) off by 1e-3 in all its weights."""
    moe = moe_block(layer)
    e = int(mx.argmax(mx.linalg.norm(moe.gate.weight, axis=1)))
    for proj in (moe.switch_mlp.gate_proj, moe.switch_mlp.up_proj, moe.switch_mlp.down_proj):
        hit = (mx.arange(proj.weight.shape[0]) == e)[:, None, None]
        proj.weight = proj.weight + 1e-3 * hit


def _expert_index_off_by_one(layer):
    sw = moe_block(layer).switch_mlp
    n, call = sw.gate_proj.weight.shape[0], type(sw).__call__
    patch_call(sw, lambda self, x, inds: call(self, x, (inds + 1) % n))


def _stray_bf16(layer):
    moe = moe_block(layer)
    call = type(moe).__call__
    patch_call(moe, lambda self, x: call(self, x).astype(mx.bfloat16).astype(x.dtype))


# ------------------------------------------------------------------ full attention
def _head_dim(attn) -> int:
    return getattr(attn, "head_dim", None) or attn.rope.dims


def _rope(attn, **kw):
    r = attn.rope
    attn.rope = nn.RoPE(**{"dims": r.dims, "traditional": r.traditional, "base": r.base, "scale": r.scale, **kw})


def _rope_theta_wrong(attn):
    _rope(attn, base=1e4 if attn.rope.base != 1e4 else 1e6)  # the qwen2_moe / mlx-lm default mix-up


def _rotary_fraction_wrong(attn):
    hd = _head_dim(attn)
    _rope(attn, dims=hd if attn.rope.dims < hd else hd // 2)


def _qk_norm_missing(attn):
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


def _qk_norm_per_head_for_flat(attn):  # olmoe: the norm spans the whole projection
    hd = _head_dim(attn)
    attn.q_norm, attn.k_norm = _RegroupedNorm(attn.q_norm, hd, False), _RegroupedNorm(attn.k_norm, hd, False)


def _qk_norm_flat_for_per_head(attn):  # applied to [B, L, heads, hd]: normalise over heads * hd
    hd = _head_dim(attn)
    attn.q_norm, attn.k_norm = _RegroupedNorm(attn.q_norm, hd, True), _RegroupedNorm(attn.k_norm, hd, True)


def _not_causal(attn):
    call = type(attn).__call__
    patch_call(attn, lambda self, x, mask=None, cache=None: call(self, x, None, cache))


def _scale_wrong(attn):
    attn.scale = 1.0 / _head_dim(attn)


def _gqa_repeat_wrong(attn):
    """kv heads tiled (0, 1, 0, 1) instead of repeated (0, 0, 1, 1): k/v projections widened
    to one kv head per query head, in tiled order."""
    nh_attr = next(a for a in ("n_heads", "num_heads", "num_attention_heads") if a in attn.__dict__)
    kv_attr = next(a for a in ("n_kv_heads", "num_key_value_heads") if a in attn.__dict__)
    nh, kvh, hd = getattr(attn, nh_attr), getattr(attn, kv_attr), _head_dim(attn)
    for p in (attn.k_proj, attn.v_proj):
        p.weight = mx.tile(p.weight.reshape(kvh, hd, -1), (nh // kvh, 1, 1)).reshape(nh * hd, -1)
        if "bias" in p:
            p.bias = mx.tile(p.bias.reshape(kvh, hd), (nh // kvh, 1)).reshape(-1)
    setattr(attn, kv_attr, nh)


def _output_gate_no_sigmoid(attn):
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


def _gdn_chunked_prefill(gdn):
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
def _input_norm_eps(layer):
    layer.input_layernorm.eps *= 1e3


def _norm_offset_missing(layer):  # sanitize()'s +1 on (1 + w) weights lost (conv1d-shape trap)
    layer.post_attention_layernorm.weight = layer.post_attention_layernorm.weight - 1.0


def _residual_missing(layer):
    def call(self, x, mask=None, cache=None):
        h = attention_block(self)(self.input_layernorm(x), mask, cache)
        return h + moe_block(self)(self.post_attention_layernorm(h))

    patch_call(layer, call)


def _final_norm_eps(model):
    text_model(model).model.norm.eps *= 1e3


FAULTS = {
    "router_softmax_after_topk": lambda layer: _moe(layer, _softmax_after_topk),
    "router_no_renorm": lambda layer: _moe(layer, _scores, renorm=False),
    "router_wrong_num_experts": lambda layer: _moe(layer, lambda v, k, renorm: _scores(v[..., :-1], k, renorm)),
    "router_sigmoid": lambda layer: _moe(layer, lambda v, k, renorm: _scores(v, k, renorm, mx.sigmoid)),
    "expert_gate_up_swapped": _gate_up_swapped,
    "expert_weights_off_1e-3": _one_expert_off,
    "expert_index_off_by_one": _expert_index_off_by_one,
    "expert_weights_not_applied": lambda layer: _moe(layer, weighted=False),
    "shared_expert_gate_no_sigmoid": lambda layer: _moe(layer, shared_sigmoid=False),
    "shared_expert_missing": lambda layer: _moe(layer, shared=False),
    "stray_bf16_downcast": _stray_bf16,
    "rope_theta_wrong": _rope_theta_wrong,
    "rope_interleaved": lambda attn: _rope(attn, traditional=True),
    "rotary_fraction_wrong": _rotary_fraction_wrong,
    "qk_norm_missing": _qk_norm_missing,
    "qk_norm_per_head_for_flat": _qk_norm_per_head_for_flat,
    "qk_norm_flat_for_per_head": _qk_norm_flat_for_per_head,
    "kv_cache_write_off_by_one": _kv_off_by_one,
    "attention_not_causal": _not_causal,
    "attention_scale_wrong": _scale_wrong,
    "gqa_kv_heads_tiled": _gqa_repeat_wrong,
    "attention_gate_no_sigmoid": _output_gate_no_sigmoid,
    "gdn_state_not_carried": lambda gdn: _gdn_forget(gdn, 1),
    "gdn_conv_state_not_carried": lambda gdn: _gdn_forget(gdn, 0),
    "gdn_chunked_prefill_differs": _gdn_chunked_prefill,
    "rmsnorm_eps_wrong": _input_norm_eps,
    "norm_offset_missing": _norm_offset_missing,
    "residual_missing": _residual_missing,
    "final_norm_eps_wrong": _final_norm_eps,
}


MODEL_LEVEL = {"kv_cache_write_off_by_one"}  # transforms taking (model, layer index)


def target_layer(fault, model) -> int | None:
    """The layer index models/faults.py expects for `fault` (None: the model)."""
    if fault.target == "model":
        return None
    layers = model.layers
    if fault.target == "last":
        return len(layers) - 1
    want = fault.target == "linear"
    return max(i for i, layer in enumerate(layers) if getattr(layer, "is_linear", False) == want)


def inject(fault, model) -> None:
    i = target_layer(fault, model)
    if fault.name in MODEL_LEVEL:
        FAULTS[fault.name](model, i)
    elif i is None:
        FAULTS[fault.name](model)
    elif fault.kind == "attention":
        FAULTS[fault.name](attention_block(model.layers[i]))
    else:
        FAULTS[fault.name](model.layers[i])


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
