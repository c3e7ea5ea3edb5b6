"""The seeded faults' forms on mlx-lm's routers, experts and MoE blocks (exporters/mlx/faults.py
applies them): a block's routing recomputed with one thing changed, its weights edited, its gate's fields
set."""

from __future__ import annotations

import inspect

import mlx.core as mx
import mlx.nn as nn

from exporters.mlx.model import (experts_of, expert_projections, moe_block, named, patch_call, router_linear,
                                 router_logits, router_module,
                                 route as mlx_route)


# ------------------------------------------------------------------ router / moe
def _topk(scores, k):
    inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    return mx.take_along_axis(scores, inds, axis=-1), inds


def _scores(logits, k, renorm, score=lambda v: mx.softmax(v, axis=-1, precise=True)):
    """Score all experts, top-k, renormalised where the family does (Mixtral's softmax over
    the top-k logits is the same)."""
    s, inds = _topk(score(logits.astype(mx.float32)), k)
    return (s / s.sum(axis=-1, keepdims=True) if renorm else s), inds


def softmax_after_topk(logits, k, renorm):
    v, inds = _topk(logits.astype(mx.float32), k)
    return mx.softmax(v, axis=-1, precise=True), inds


def _per_expert(ex) -> bool:  # DBRX: experts as a list of modules w1 (gate), v1 (up), w2 (down)
    return isinstance(ex, list)


def apply_experts(ex, x, inds):
    """Each token's selected experts on it [.., k, H]: mlx-lm's SwitchGLU (x, inds), or a list of one module per
    expert (DBRX's) run token by token as its block runs them."""
    if not _per_expert(ex):
        return ex(x, inds)
    flat, idx = x.reshape(-1, x.shape[-1]), inds.reshape(-1, inds.shape[-1])
    rows = [mx.stack([ex[e](xt) for e in it]) for xt, it in zip(flat, idx.tolist())]
    return mx.stack(rows).reshape(*inds.shape, x.shape[-1])


def combine(moe, x, scores, inds, a, weighted=True, shared=True, shared_sigmoid=True):
    """What the family's mlx-lm MoE block computes from its routing (scores [.., k], inds [.., k]):
    the routed experts weighted and summed (Llama 4: each expert's input scaled by its weight),
    plus the shared expert(s) (Qwen's behind a sigmoid gate). One step changed by the flags."""
    ex = experts_of(moe)
    if a.router.weights_on_input:  # Llama 4 (top-1): experts(x * sigmoid score)
        y = apply_experts(ex, x * scores.astype(x.dtype) if weighted else x, inds).sum(axis=-2)
    else:
        y = apply_experts(ex, x, inds)
        y = (y * scores[..., None] if weighted else y).sum(axis=-2).astype(x.dtype)
    # (Granite's shared MLP beside the block is the decoder layer's, not the block's)
    if shared and a.shared_expert_intermediate_size > 0 and not a.shared_expert_beside:
        if "shared_expert" in moe:
            s = moe.shared_expert(x)
            if "shared_expert_gate" in moe:
                g = moe.shared_expert_gate(x)
                s = (mx.sigmoid(g) if shared_sigmoid else g) * s
        else:  # DeepSeek's shared_experts, HunYuan's shared_mlp
            s = (moe.shared_experts if "shared_experts" in moe else moe.shared_mlp)(x)
        y = y + s
    return y


def patched_combine(layer, a, **changed):
    """The layer's MoE block computing mlx-lm's MoE (its own routing: exporters.mlx.model.route)
    with one step of the combine changed (combine's flags)."""
    patch_call(moe_block(layer), lambda self, x: combine(self, x, *mlx_route(self, x), a, **changed))


def reroute(layer, a, route):
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
        patched_combine(layer, a)


def no_renorm(layer, a):
    gate = router_module(moe_block(layer))
    if gate is not None and hasattr(gate, "norm_topk_prob"):  # DeepSeek-V3, GLM-4, dots1: the gate's own flag
        gate.norm_topk_prob = False
    elif hasattr(moe_block(layer), "norm_topk_prob"):  # Qwen3's block reads its flag at every call
        moe_block(layer).norm_topk_prob = False
    elif (g := _gate(layer)) is not None and hasattr(g, "moe_renormalize"):  # Kimi-Linear's block: its args' flag
        g.moe_renormalize = False
    else:
        reroute(layer, a, lambda v, k, renorm: _scores(v, k, False))


def one_expert_fewer(layer, a):
    """The router's linear layer with its last expert's row dropped: every family's own routing
    then runs over one expert fewer than the checkpoint has."""
    moe = moe_block(layer)
    r = router_linear(moe)
    r.weight = r.weight[:-1]
    if "bias" in r:
        r.bias = r.bias[:-1]
    # a block that routes inline with its own bias (MiniMax-M2), or a gate that holds one beside its weight
    # (the DeepSeek-style MoEGate, ungrouped: glm4_moe_lite): it sees one fewer too (as the torch form)
    # (Laguna's MoEGate holds its bias beside the `proj` it wraps)
    holders = [h for h in (moe, router_module(moe), r) if h is not None]
    for holder in {id(h): h for h in holders}.values():
        bias = named(holder, "e_score_correction_bias")  # (LFM2's expert_bias)
        if bias in holder:
            setattr(holder, bias, getattr(holder, bias)[:-1])


def sigmoid(layer, a):
    moe = moe_block(layer)
    if "gate_act" in moe:  # ERNIE's block has the choice itself
        moe.gate_act = nn.Sigmoid()
    else:
        reroute(layer, a, lambda v, k, renorm: _scores(v, k, renorm, mx.sigmoid))


def gate_up_swapped(layer, a):
    sw = experts_of(moe_block(layer))
    if _per_expert(sw):
        for e in sw:
            e["w1"], e["v1"] = e["v1"], e["w1"]
        return
    sw["gate_proj"], sw["up_proj"] = sw["up_proj"], sw["gate_proj"]


def one_expert_off(layer, a):
    """The most-routed-to expert (largest router row norm) off by 1e-3 in all its weights."""
    moe = moe_block(layer)
    e = int(mx.argmax(mx.linalg.norm(router_linear(moe).weight, axis=1)))
    sw = experts_of(moe)
    if _per_expert(sw):
        for proj in (sw[e].w1, sw[e].v1, sw[e].w2):
            proj.weight = proj.weight + 1e-3
        return
    for proj in expert_projections(sw):
        hit = (mx.arange(proj.weight.shape[0]) == e)[:, None, None]
        proj.weight = proj.weight + 1e-3 * hit


def expert_index_off_by_one(layer, a):
    moe = moe_block(layer)
    sw = experts_of(moe)
    if _per_expert(sw):  # the block's experts[e] is expert e + 1
        moe["experts"] = sw[1:] + sw[:1]
        return
    n, call = expert_projections(sw)[0].weight.shape[0], type(sw).__call__
    patch_call(sw, lambda self, x, inds: call(self, x, (inds + 1) % n))


def stray_bf16(layer, a):
    moe = moe_block(layer)
    call = type(moe).__call__
    patch_call(moe, lambda self, x: call(self, x).astype(mx.bfloat16).astype(x.dtype))


# ------------------------------------------------------------------ DeepSeek-style routing
# DeepSeek-V2/V3, GLM-4 and dots1 route in a gate module (MoEGate / TopkRouter) that keeps its
# routing fields as attributes: most of these faults are one of them set wrong.
def _gate(layer):
    """What holds the layer's routing fields (n_group, routed_scaling_factor, ...): its router module, or, for a block
    that routes inline by the model's ModelArgs (Mistral 4's `self.args`), a copy of those args of its own (the
    model's are every layer's)."""
    moe = moe_block(layer)
    g = router_module(moe)
    if g is None and hasattr(moe, "n_group"):  # a block that routes inline by fields of its own (AFMoE)
        return moe
    # (Kimi-Linear's args name it num_expert_group)
    if g is None and getattr(moe, "args", None) is not None and (hasattr(moe.args, "n_group")
                                                                 or hasattr(moe.args, "num_expert_group")):
        import copy

        moe.args = copy.copy(moe.args)
        return moe.args
    return g


def set_gate(**fields):
    def apply(layer, a):
        moe = moe_block(layer)
        g = _gate(layer)
        if g is None:  # a block that routes inline with the fields its own (LFM2)
            g = moe
        for k, v in fields.items():  # (under the block's name for it: AFMoE's route_scale)
            # a field the block holds beside its gate (Laguna's routed_scaling_factor, applied to the routed sum)
            owner = g if hasattr(g, named(g, k)) or not hasattr(moe, named(moe, k)) else moe
            setattr(owner, named(owner, k), v(a) if callable(v) else v)

    return apply


def group_limit_ignored(layer, a):
    g = _gate(layer)
    g.n_group, g.topk_group = 1, 1  # V3 / GLM-4: `if n_group > 1`; dots1: `n_group - topk_group` groups dropped
    if hasattr(g, "topk_method"):  # V2's group_limited_greedy reads its method
        g.topk_method = "greedy"


def bias_ignored(layer, a):
    g = _gate(layer)
    if g is None or not hasattr(g, named(g, "e_score_correction_bias")):  # a block that routes inline, its correction
        g = moe_block(layer)  # bias its own (MiniMax-M2, LFM2's and AFMoE's expert_bias)
    bias = named(g, "e_score_correction_bias")
    setattr(g, bias, mx.zeros_like(getattr(g, bias)))


def bias_in_weights(layer, a):
    """The gate's own choice, its weights taken from sigmoid + correction bias (not the sigmoid alone)."""
    g, moe = _gate(layer), moe_block(layer)
    if g is None or g is moe or not callable(g):  # a block that routes inline with its own correction bias
        # (MiniMax-M2, AFMoE; Kimi-Linear's, its routing fields in its args): its routing recomputed (AFMoE's
        # route_scale, Kimi-Linear's routed_scaling_factor kept)
        bias = getattr(moe, named(moe, "e_score_correction_bias"))
        scale = getattr(moe, named(moe, "routed_scaling_factor"), None)
        if scale is None:
            scale = getattr(g, "routed_scaling_factor", 1.0) if g is not None else 1.0

        def route(logits, k, renorm):
            biased = mx.sigmoid(logits.astype(mx.float32)) + bias
            inds = mx.argpartition(-biased, kth=k - 1, axis=-1)[..., :k]
            s = mx.take_along_axis(biased, inds, axis=-1)
            return (s / s.sum(axis=-1, keepdims=True) if renorm else s) * scale, inds

        reroute(layer, a, route)
        return
    call = type(g).__call__

    def fn(self, x):  # the gate's logits as its own call takes them (a bare weight, or Laguna's `proj` and softcap)
        inds, _ = call(self, x)
        logits = router_logits(moe, x).astype(mx.float32)
        if getattr(self, "softcap", 0.0) > 0.0:
            logits = mx.tanh(logits / self.softcap) * self.softcap
        scores = self._routing_scores(logits) if hasattr(self, "_routing_scores") else mx.sigmoid(logits)
        s = mx.take_along_axis(scores + getattr(self, named(self, "e_score_correction_bias")), inds, axis=-1)
        if self.top_k > 1 and getattr(self, "norm_topk_prob", True):  # (Laguna's gate always renormalises)
            s = s / s.sum(axis=-1, keepdims=True)
        return inds, s * getattr(self, "routed_scaling_factor", 1.0)  # (Laguna's block scales the routed sum)

    patch_call(g, fn)


def softmax_for_sigmoid(layer, a):
    """Softmax scores where the family's are sigmoid. A routing gate runs its module's own
    group_expert_select (which takes the sigmoid of what it is given) on logit(softmax): its scores
    are then the softmax probabilities. Llama 4 (inline): softmax over all experts, top-k of those."""
    import sys

    g = _gate(layer)
    if g is not None and hasattr(g, "_routing_scores"):  # Laguna's gate: its score function a method (an unknown
        g._routing_scores = lambda logits: mx.softmax(logits, axis=-1, precise=True)  # score_func name raises)
        return
    if g is not None and hasattr(g, "score_func"):  # a block that reads its score function at every call (AFMoE)
        g.score_func = "softmax"
        return
    if g is not None and hasattr(g, "moe_router_activation_func"):  # Kimi-Linear's block: its args name it
        g.moe_router_activation_func = "softmax"
        return
    if g is None:
        return reroute(layer, a, lambda v, k, renorm: _scores(v, k, False))
    module = sys.modules[type(g).__module__]
    # (Bailing's: _group_expert_select, which always renormalises and takes no norm_topk_prob)
    select = getattr(module, "group_expert_select", None) or module._group_expert_select
    renorm = (getattr(g, "norm_topk_prob", True),) if "norm_topk_prob" in inspect.signature(select).parameters else ()

    def fn(self, x):
        p = mx.softmax((x @ self.weight.T).astype(mx.float32), axis=-1, precise=True)
        return select(mx.log(p) - mx.log1p(-p), getattr(self, named(self, "e_score_correction_bias")), self.top_k,
                      self.n_group, self.topk_group, self.routed_scaling_factor, *renorm)

    patch_call(g, fn)


def dense_layer_routed(layer, a):
    mlp = moe_block(layer)
    call = type(mlp).__call__
    patch_call(mlp, lambda self, x: call(self, x) * a.router.routed_scaling_factor)


def moe_layer_as_dense(layer, a):
    """A wrong MoE/dense interleave: the layer's routed experts left out, its shared expert(s) all it computes."""
    moe = moe_block(layer)
    patch_call(moe, lambda self, x: next(self[n] for n in ("shared_expert", "shared_experts", "shared_mlp") if n in self)(x))


def clamp_missing(layer, a):
    experts_of(moe_block(layer)).activation._limit = float("inf")  # SwigluOAI's limit (7)


def router_logit_bias_ignored(layer, a):
    moe_block(layer).router.pop("bias")  # nn.Linear adds a bias only when it has one


def sparsemixer_first_unmasked(layer, a):
    from mlx_lm.models.phimoe import sparsemixer

    def route(logits, k, renorm):
        inds, scores = sparsemixer(logits, top_k=k, jitter_eps=a.router.jitter_eps)
        return mx.repeat(scores[..., :1], k, axis=-1), mx.repeat(inds[..., :1], k, axis=-1)

    reroute(layer, a, route)
