"""The seeded faults' forms on mlx-lm's gemma4_text (models/faults/gemma4.py; its MoE block regrouped as one module,
`Gemma4MoEBlock`: models.gemma4.mlx_regroup). mlx-lm's Router normalises, scales and projects its input, takes the
top-k logits and their softmax and multiplies by per_expert_scale; its Experts apply a SwitchGLU with GeGLU; its
Attention takes v from the keys' projection on the k = v layers and norms it with RMSNormNoScale. A form that changes
the routing sets `oracle_route` on the block (the routing mirror, exporters.mlx.model.route, reads it) and patches
the router's call the same way: (weights before the per-expert scale, indices)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from exporters.mlx.model import moe_block, patch_call, text_model


# ------------------------------------------------------------------ the router
def route_as(layer, routing) -> None:
    """The block's routing replaced by routing(router, x) -> (weights [.., k] before the per-expert scale, indices)."""
    moe = moe_block(layer)
    r = moe.router
    moe.oracle_route = lambda x: routing(r, x)

    def call(self, x):
        w, inds = routing(self, x)
        return inds, w * self.per_expert_scale[inds]

    patch_call(r, call)


def _topk_softmax(r, logits, renorm: bool = True, score=None):
    """The top-k experts of the logits and their weights: mlx-lm's softmax over the k logits (renorm), or the
    `score` of every expert (softmax over all, a sigmoid) taken at the k, not renormalised."""
    k = r.config.top_k_experts
    inds = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
    if score is None and renorm:
        return mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1), inds
    scores = (score or (lambda v: mx.softmax(v, axis=-1)))(logits)
    return mx.take_along_axis(scores, inds, axis=-1), inds


def _logits(r, x, normed: bool = True):
    return r.proj(mx.fast.rms_norm(x, r.scale * r._root_size, r.eps) if normed else x * r.scale * r._root_size)


def router_input_norm_missing(layer, a):
    route_as(layer, lambda r, x: _topk_softmax(r, _logits(r, x, normed=False)))


def router_root_size_missing(layer, a):
    moe_block(layer).router._root_size = 1.0  # (mlx-lm's Router and the mirror read it at every call)


def router_no_renorm(layer, a):
    route_as(layer, lambda r, x: _topk_softmax(r, _logits(r, x), renorm=False))


def router_sigmoid(layer, a):
    route_as(layer, lambda r, x: _topk_softmax(r, _logits(r, x), score=mx.sigmoid))


def router_wrong_num_experts(layer, a):
    r = moe_block(layer).router
    r.proj.weight = r.proj.weight[:-1]


def per_expert_scale_missing(layer, a):
    r = moe_block(layer).router
    r.per_expert_scale = mx.ones_like(r.per_expert_scale)


# ------------------------------------------------------------------ the experts
class _ExactGeGLU(nn.Module):
    def __call__(self, x, gate):
        return nn.gelu(gate) * x


def experts_exact_gelu(layer, a):
    moe_block(layer).experts.switch_glu.activation = _ExactGeGLU()


def expert_weights_not_applied(layer, a):
    ex = moe_block(layer).experts
    patch_call(ex, lambda self, x, inds, w: self.switch_glu(x, inds).sum(-2))


# ------------------------------------------------------------------ attention (the full layers: k = v)
def v_norm_missing(attn, a):
    attn.v_norm = nn.Identity()


def proportional_rope_as_partial(attn, a):
    rp = text_model_args_rope(attn)
    attn.rope = nn.RoPE(int(attn.head_dim * rp.get("partial_rotary_factor", 1.0)), base=rp["rope_theta"])


def text_model_args_rope(attn) -> dict:
    return attn.config.rope_parameters["full_attention"]


def values_of_the_rotated_keys(attn, a):
    """v taken from k after its norm and rotation (mlx-lm: the keys' projection), then v's norm."""
    def call(self, x, mask=None, cache=None, shared_kv=None, offset=None):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim))
        offset = mx.array(cache.offset) if cache is not None else 0
        k = self.rope(k.transpose(0, 2, 1, 3), offset=offset)
        v = self.v_norm(k)
        q = self.rope(q.transpose(0, 2, 1, 3), offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        from mlx_lm.models.base import scaled_dot_product_attention

        o = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1)), (k, v), offset

    patch_call(attn, call)


# ------------------------------------------------------------------ the layer, the head
def _feed(self, h):  # the dense MLP's and the MoE block's outputs (mlx_regroup's)
    return self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h))) + self.oracle_moe(h)


def _layer(feed=_feed, residual: bool = True):
    """The regrouped decoder layer's call (models.gemma4.mlx_regroup) with its feed-forward part `feed(self, h)`, the
    attention's residual dropped (residual False)."""
    def call(self, x, mask=None, cache=None, per_layer_input=None, shared_kv=None, offset=None):
        h, shared_kv, offset = self.self_attn(self.input_layernorm(x), mask, cache, shared_kv=shared_kv, offset=offset)
        h = (x if residual else 0) + self.post_attention_layernorm(h)
        return (h + self.post_feedforward_layernorm(feed(self, h))) * self.layer_scalar, shared_kv, offset
    return call


def residual_missing(layer, a):
    patch_call(layer, _layer(residual=False))


def moe_fed_the_normed_stream(layer, a):
    def feed(self, h):
        x = self.pre_feedforward_layernorm(h)
        return self.post_feedforward_layernorm_1(self.mlp(x)) + self.oracle_moe(x)
    patch_call(layer, _layer(feed))


def dense_mlp_dropped(layer, a):
    patch_call(layer, _layer(lambda self, h: self.oracle_moe(h)))


def layer_scalar_missing(layer, a):
    layer.layer_scalar = mx.ones_like(layer.layer_scalar)


def logit_softcap_missing(model, a):
    text_model(model).final_logit_softcapping = None


FAULTS = {
    "router_input_norm_missing": router_input_norm_missing, "router_root_size_missing": router_root_size_missing,
    "per_expert_scale_missing": per_expert_scale_missing, "experts_exact_gelu": experts_exact_gelu,
    "v_norm_missing": v_norm_missing, "proportional_rope_as_partial": proportional_rope_as_partial,
    "values_of_the_rotated_keys": values_of_the_rotated_keys, "moe_fed_the_normed_stream": moe_fed_the_normed_stream,
    "dense_mlp_dropped": dense_mlp_dropped, "layer_scalar_missing": layer_scalar_missing,
    "logit_softcap_missing": logit_softcap_missing,
}
# the common faults' forms on gemma4_text, where the common form reads a block it does not have (its router's logits
# are of the normed input; its experts are weighted inside mlx-lm's Experts)
ON_GEMMA4 = {"router_no_renorm": router_no_renorm, "router_sigmoid": router_sigmoid,
             "router_wrong_num_experts": router_wrong_num_experts,
             "expert_weights_not_applied": expert_weights_not_applied, "residual_missing": residual_missing}
