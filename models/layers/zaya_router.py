"""ZAYA's router (HF 5.23's ZayaRouter, ZayaRouterMLP) and residual scaling (ZayaResidualScaling):

    r      = down_proj(x) [+ the previous layer's r at the same position * router_states_scale]   (layers after the first)
    logits = out_proj(gelu(fc2(gelu(fc1(RMSNorm(r))))))      E + 1 classes: the experts and the skip expert
    p      = softmax(logits);  choice = top-1 of p (fp32) + balancing_biases;  weight = p[choice], 0 for the skip expert

r is the cross-layer state: each router keeps it per position in `router_state` [1, S, R] (a static buffer, written at
the call's positions) and the next layer's router reads it there (`link_routers`: the same positions of the same call,
or, for a block run alone, those its previous layer's block wrote on the reference's inputs). The router returns the
real choice (the skip expert as index E, weight 0: what the routes record); its MoE block runs expert 0 at weight 0
there, as HF's masked index does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.norms import RMSNorm
from models.layers.taps import tap


class RouterMLP(nn.Module):
    def __init__(self, R: int, classes: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(R, eps)
        self.fc1 = nn.Linear(R, R)
        self.fc2 = nn.Linear(R, R)
        self.out_proj = nn.Linear(R, classes, bias=False)

    def forward(self, r):
        return self.out_proj(F.gelu(self.fc2(F.gelu(self.fc1(self.norm(r))))))


class ZayaRouter(nn.Module):
    """x [N, H] at positions pos [N] -> weights [N, 1], indices [N, 1] (the skip expert: index E, weight 0)."""

    def __init__(self, a: ModelArgs, layer: int, dtype=torch.float32):
        super().__init__()
        R, E = a.zaya.router_hidden_size, a.num_experts
        self.skip, self.top_k = E, a.num_experts_per_tok
        self.down_proj = nn.Linear(a.hidden_size, R)
        self.use_eda = layer != 0
        if self.use_eda:
            self.router_states_scale = nn.Parameter(torch.ones(R))
        self.router_mlp = RouterMLP(R, E + 1, a.rms_norm_eps)
        self.balancing_biases = nn.Parameter(torch.zeros(E + 1))  # (HF's fp32 buffer, the choice only)
        self.register_buffer("router_state", torch.zeros(1, a.max_seq_len, R, dtype=dtype))
        self.passed = True  # read at every call: a seeded fault leaves the previous layer's state out
        self.skip_weighted = False  # ... a seeded fault gives the skip expert its probability as a weight
        self._source = ()  # the previous layer's router (link_routers), not a submodule

    def forward(self, x, pos):
        r = self.down_proj(x)
        if self.use_eda and self.passed and self._source:
            r = r + self._source[0].router_state[0, pos] * self.router_states_scale
        self.router_state[0, pos] = r
        logits = tap("logits", self.router_mlp(r))
        probs = tap("scores", torch.softmax(logits, dim=-1))
        choice = tap("selection", probs.float() + self.balancing_biases.float())
        idx = tap("topk", torch.topk(choice, self.top_k, dim=-1).indices)
        w = probs.gather(1, idx)
        if not self.skip_weighted:
            w = w.masked_fill(idx == self.skip, 0.0)
        return tap("weights", w), idx.clone()


def link_routers(layers) -> None:
    """Each ZAYA router after the first reads the previous layer's router_state."""
    routers = [layer.mlp.gate for layer in layers if isinstance(getattr(getattr(layer, "mlp", None), "gate", None),
                                                                 ZayaRouter)]
    for prev, router in zip(routers, routers[1:]):
        router._source = (prev,)


class ResidualScaling(nn.Module):
    """(h + hidden_states_bias) * hidden_states_scale + (residual + residual_bias) * residual_scale."""

    def __init__(self, hidden: int):
        super().__init__()
        self.hidden_states_scale = nn.Parameter(torch.ones(hidden))
        self.hidden_states_bias = nn.Parameter(torch.zeros(hidden))
        self.residual_scale = nn.Parameter(torch.ones(hidden))
        self.residual_bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, h, residual):
        return (h + self.hidden_states_bias) * self.hidden_states_scale + \
            (residual + self.residual_bias) * self.residual_scale
