"""Port bugs of the MoE router: scoring, renormalisation, the expert count, the correction bias,
group limits, routed scaling, the logit bias, sparsemixer's second choice."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from models.faults.fault import patch
from models.layers.router import Router


# ------------------------------------------------------------------ router
def softmax_after_topk(layer, a):
    r: Router = layer.mlp.gate
    patch(r, "route", lambda logits: (lambda v, i: (torch.softmax(v.float(), -1), i))(*torch.topk(logits, r.top_k)))


def softcap_missing(layer, a):
    layer.mlp.gate.softcap = 0.0


def no_renorm(layer, a):
    layer.mlp.gate.norm_topk = False


def wrong_num_experts(layer, a):
    r: Router = layer.mlp.gate
    if hasattr(r, "e_score_correction_bias"):  # the router's own per-expert bias sees one fewer too (it
        # crashed the model, [N, E-1] + [E], instead of routing wrongly)
        r.e_score_correction_bias = nn.Parameter(r.e_score_correction_bias.detach()[:-1].clone(), requires_grad=False)
    patch(r, "route", lambda logits: Router.route(r, logits[:, :-1]))


def sigmoid_router(layer, a):
    r: Router = layer.mlp.gate

    def route(logits):
        w, idx = torch.topk(torch.sigmoid(logits.float()), r.top_k)
        return (w / w.sum(-1, keepdim=True) if r.norm_topk else w), idx

    patch(r, "route", route)


# ------------------------------------------------------------------ DeepSeek-style routing
def rerouted(change):
    """A fault that is the last layer's router with other routing fields: change(args) -> RouterArgs fields."""
    def apply(layer, a):
        r: Router = layer.mlp.gate
        r.args = replace(r.args, router=replace(r.args.router, **change(a)))

    return apply


def bias_in_weights(layer, a):
    r: Router = layer.mlp.gate
    patch(r, "weights", lambda probs, idx: Router.weights(r, probs + r.e_score_correction_bias, idx))


def is_sigmoid(a):
    return a.router.scoring == "sigmoid"


def is_scaled(a):
    return a.router.routed_scaling_factor != 1.0


def router_logit_bias_ignored(layer, a):
    del layer.mlp.gate.bias


def second_expert_unmasked(layer, a):
    """sparsemixer's second choice taken without masking the first: the best expert twice."""
    r: Router = layer.mlp.gate

    def route(logits):
        w, idx = Router.route(r, logits)
        return torch.stack([w[:, 0]] * w.shape[1], -1), torch.stack([idx[:, 0]] * idx.shape[1], -1)

    patch(r, "route", route)
