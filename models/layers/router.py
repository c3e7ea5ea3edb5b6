"""The MoE router: scores (softmax or sigmoid, fp32), the top-k of the selection scores
(models/layers/routing.py: correction bias, group limit), their weights renormalised and scaled."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import routing
from models.layers.norms import l2_rms
from models.layers.taps import tap


class Router(nn.Module):
    """scores (softmax over all experts, or a sigmoid each; fp32) -> the top-k of the selection
    scores (models.layers.routing: + correction bias, group limit) -> their scores as weights,
    optionally renormalised, times routed_scaling_factor."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        r = a.router
        self.weight = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))
        if r.logit_bias:
            self.bias = nn.Parameter(torch.zeros(a.num_experts))
        if r.correction_bias:  # selection only (DeepSeek-V3's e_score_correction_bias)
            self.e_score_correction_bias = nn.Parameter(torch.zeros(a.num_experts))
        if r.input_norm:  # Gemma 4: the input RMS-normed (no gain), times scale and H^-0.5
            self.scale = nn.Parameter(torch.ones(a.hidden_size))
            self.eps, self.root = a.rms_norm_eps, a.hidden_size**-0.5
        if r.per_expert_scale:  # Gemma 4: held here, applied by its MoE block (models/layers/moe_beside.py)
            self.per_expert_scale = nn.Parameter(torch.ones(a.num_experts))
        self.top_k, self.norm_topk = a.num_experts_per_tok, r.norm_topk_prob
        self.cast = r.weights_in_model_dtype
        self.softcap = r.logit_softcap
        self.softmax_only = (r.scoring == "softmax" and not r.correction_bias and r.n_group <= 1 and r.choice_on == "scores"
                             and r.routed_scaling_factor == 1.0 and not r.fp32 and not r.norm_topk_min
                             and r.norm_p == 1.0 and not r.logit_softcap)

    def forward(self, x):  # x [N, H] -> weights [N, k], indices [N, k]
        bias = getattr(self, "bias", None)
        if hasattr(self, "scale"):
            x = self.normed(x)
        if self.args.router.fp32:
            logits = F.linear(x.float(), self.weight.float(), None if bias is None else bias.float())
        else:
            logits = F.linear(x, self.weight, bias)
        if self.softcap:  # (the logits a router returns are the capped ones: HF's Laguna router's)
            logits = torch.tanh(logits.float() / self.softcap) * self.softcap
        w, idx = self.route(tap("logits", logits))
        return (w.to(logits.dtype) if self.cast else w), idx

    def normed(self, x):  # Gemma 4's router input (HF's Gemma4TextRouter: the norm in fp32, rounded, then the scales)
        return l2_rms(x, self.eps) * self.scale * self.root

    def route(self, logits):  # [N, E] -> fp32 top-k weights, indices
        if self.softmax_only:
            probs = tap("selection", tap("scores", torch.softmax(logits, dim=-1, dtype=torch.float32)))
            w, idx = torch.topk(probs, self.top_k, dim=-1)
            if self.norm_topk:
                w = w / w.sum(dim=-1, keepdim=True)
            return tap("weights", w), tap("topk", idx)
        a = self.args  # read at every call: a seeded fault routes by other fields (models/faults/)
        probs = tap("scores", routing.scores(logits, a))
        bias = self.e_score_correction_bias if a.router.correction_bias else None
        choice = routing.choice_scores(logits, probs, a)
        idx = tap("topk", torch.topk(tap("selection", routing.selection(choice, bias, a)), self.top_k, dim=-1).indices)
        # idx is also used by weights(): a node used inside the router is not one of its outputs
        # to ExecuTorch's module-path taps, so the indices leave the router as their own node
        return tap("weights", self.weights(probs, idx)), idx.clone()

    def weights(self, probs, idx):  # the selected experts' scores [N, k], renormalised, scaled
        return routing.topk_weights(probs, idx, self.args, self.norm_topk)
