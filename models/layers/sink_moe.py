"""Inkling's MoE (HF's InklingMoE): a router whose shared experts take part in its normalisation. The router's
logits (fp32) cover the routed experts and, in its last n_shared rows, the shared ones; the choice is the top-k of
sigmoid(routed logits) + the correction bias; the chosen routed experts' and the shared experts' sigmoids are then
normalised together (exp(logsigmoid - logsumexp(logsigmoid)): the shared experts a sink of the weight) and scaled
by route_scale and a learned global_scale. The routed experts take their weights, the shared experts (HF's
InklingSharedExperts, one SwiGLU each, [n, I, H] stacked) theirs (the gammas, inside the activation, before down).
The dense layers' MLP is SwiGLU times a learned global_scale (InklingMLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import routing
from models.layers.experts import Experts
from models.layers.moe import MLP, SparseMoE
from models.layers.taps import tap


class SinkRouter(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.E, self.top_k, self.n_shared = a.num_experts, a.num_experts_per_tok, a.inkling.n_shared
        self.weight = nn.Parameter(torch.zeros(self.E + self.n_shared, a.hidden_size))
        self.global_scale = nn.Parameter(torch.ones(1))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.E))  # the choice only
        self.args = a
        self.sink = True  # read at every call: a seeded fault normalises the routed weights alone (models/faults/)

    def forward(self, x):  # x [N, H] -> weights [N, k] (the model's dtype), indices [N, k]
        a = self.args  # read at every call: a seeded fault routes by other fields (models/faults/)
        logits = tap("logits", F.linear(x.float(), self.weight.float()))
        scores = tap("scores", routing.scores(logits[:, : self.E], a))  # (sigmoid: HF's)
        bias = self.e_score_correction_bias.float() if a.router.correction_bias else None
        idx = tap("topk", torch.topk(tap("selection", routing.selection(scores, bias, a)), self.top_k, dim=-1).indices)
        w = self.weights(logits, idx)[:, : self.top_k]
        return tap("weights", w.to(x.dtype)), idx.clone()

    def weights(self, logits, idx):  # fp32 [N, k + n_shared]: the chosen routed experts', then the shared ones'
        rs, gs = self.args.router.routed_scaling_factor, self.global_scale.float()  # (route_scale; HF's order)
        chosen = routing.pick(logits[:, : self.E], idx)  # (no gather: the MLX delegate takes none; exact)
        if not self.sink:  # (the fault: the shared experts outside the normalisation, each weighted 1)
            lp = F.logsigmoid(chosen)
            w = torch.exp(lp - torch.logsumexp(lp, dim=-1, keepdim=True)) * rs * gs
            return torch.cat([w, torch.ones_like(logits[:, self.E:])], dim=-1)
        lp = F.logsigmoid(torch.cat([chosen, logits[:, self.E:]], dim=-1))
        return torch.exp(lp - torch.logsumexp(lp, dim=-1, keepdim=True)) * rs * gs

    def gammas(self, x, idx):  # the shared experts' weights [N, n_shared] (the model's dtype)
        return self.weights(F.linear(x.float(), self.weight.float()), idx)[:, self.top_k:].to(x.dtype)


class SharedExperts(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        n, I, H = a.inkling.n_shared, a.moe_intermediate_size, a.hidden_size
        self.gate_proj = nn.Parameter(torch.zeros(n, I, H))  # HF's names and layout
        self.up_proj = nn.Parameter(torch.zeros(n, I, H))
        self.down_proj = nn.Parameter(torch.zeros(n, H, I))

    def forward(self, x, gammas):  # x [N, H], gammas [N, n] -> [N, H]
        h = x[None].expand(self.gate_proj.shape[0], -1, -1)
        act = F.silu(torch.bmm(h, self.gate_proj.transpose(1, 2))) * torch.bmm(h, self.up_proj.transpose(1, 2))
        down = torch.bmm(act * gammas.t()[:, :, None], self.down_proj.transpose(1, 2))
        return down.float().sum(dim=0).to(x.dtype)


class SinkMoE(SparseMoE):
    """A SparseMoE (its router at `gate`: what the backends record a selection from) with Inkling's modules."""

    def __init__(self, a: ModelArgs):
        nn.Module.__init__(self)  # (not SparseMoE's: its router and shared expert are not Inkling's)
        self.gate = SinkRouter(a)
        self.experts = Experts(a)
        self.shared_experts = SharedExperts(a)

    def forward(self, x):  # [B, T, H]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x)
        y = self.experts(x, idx, w) + self.shared_experts(x, self.gate.gammas(x, idx))
        return y.view(shape)


class ScaledMLP(MLP):
    """SwiGLU times a learned scalar (InklingMLP's global_scale)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a.hidden_size, a.intermediate_size)
        self.global_scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return super().forward(x) * self.global_scale
