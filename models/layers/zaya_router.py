"""ZAYA's router (HF 5.23's ZayaRouter, ZayaRouterMLP) and residual scaling (ZayaResidualScaling):

    r      = down_proj(x) [+ the previous layer's r at the same position * router_states_scale]   (layers after the first)
    logits = out_proj(gelu(fc2(gelu(fc1(RMSNorm(r))))))      E + 1 classes: the experts and the skip expert
    p      = softmax(logits);  choice = top-1 of p (fp32) + balancing_biases;  weight = p[choice], 0 for the skip expert

r is the cross-layer state: each router keeps it per position in `router_state` [B, S, R] (a state buffer, written at
the call's positions) and the next layer's router reads it there (`link_routers`: the same positions of the same call,
or, for a block run alone, those its previous layer's block wrote on the reference's inputs; an expert probe, a block
run `alone` or without positions, reads none and writes none, as HF's probe calls its router with no state). The
router returns the real choice (the skip expert as index E, weight 0: what the routes record); its MoE block (ZayaMoE)
runs expert 0 at weight 0 there, as HF's masked index does. Both take the call's positions (`takes_pos`:
models.layers.transformer.block_fn)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import routing
from models.layers.experts import Experts
from models.layers.moe import SparseMoE
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
    """x [B*T, H] at positions pos [T] -> weights [B*T, k], indices [B*T, k] (the skip expert: index E, weight 0)."""

    takes_pos = True

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
        self.scaled = True  # ... a seeded fault adds it unscaled
        self.skip_weighted = False  # ... a seeded fault gives the skip expert its probability as a weight
        self.reads, self.writes = True, True  # while run `alone`: False, or "fill" (a layer run alone)
        self._source = ()  # the previous layer's router (link_routers), not a submodule

    def forward(self, x, pos=None):  # (no positions: alone, as an expert probe program calls it)
        r = self.down_proj(x)
        B, R = self.router_state.shape[0], r.shape[-1]  # (B: a batch widens the state, batched_state)
        if self.use_eda and self.passed and self._source and self.reads and pos is not None:
            prev = self._source[0].read_state(pos).reshape(-1, R)
            r = r + (prev * self.router_states_scale if self.scaled else prev)
        if self.writes and pos is not None:
            new = r.reshape(B, -1, R)
            if self.writes == "fill":  # (only where its router row has not written)
                old = self.read_state(pos)
                new = torch.where((old != 0).any(-1, keepdim=True), old, new)
            self.write_state(new, pos)
        logits = tap("logits", self.router_mlp(r))
        probs = tap("scores", torch.softmax(logits, dim=-1))
        choice = tap("selection", probs.float() + self.balancing_biases.float())
        idx = tap("topk", torch.topk(choice, self.top_k, dim=-1).indices)
        w = routing.pick(probs, idx)  # (no gather: the MLX delegate takes none)
        if not self.skip_weighted:
            w = w.masked_fill(idx == self.skip, 0.0)
        return tap("weights", w), idx.clone()


    def read_state(self, pos):  # [B, T, R] at the call's positions (an exporter's own state layout overrides these)
        return self.router_state[:, pos]

    def write_state(self, new, pos):  # new [B, T, R]
        self.router_state[:, pos] = new


class ZayaMoE(SparseMoE):
    """ZAYA's MoE block, a SparseMoE (its router at `gate`: what the backends record a selection from): its router
    (with the cross-layer state, at the call's positions) and Qwen3-MoE's experts, the skip expert run as expert 0 at
    weight 0 (HF's masked index). x [B, T, H], pos [T] -> [B, T, H]."""

    takes_pos = True

    def __init__(self, a: ModelArgs, layer: int, dtype=torch.float32):
        nn.Module.__init__(self)  # (not SparseMoE's: its router is ZAYA's, no shared expert)
        self.gate = ZayaRouter(a, layer, dtype)
        self.experts = Experts(a)
        self.E = a.num_experts

    def forward(self, x, pos=None):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x, pos)
        return self.experts(x, idx.masked_fill(idx == self.E, 0), w).view(shape)


@contextlib.contextmanager
def alone(module: nn.Module, probe: bool = True):
    """Every ZAYA router under `module`, a block run by itself, while inside: an expert probe (`probe`) reads no
    cross-layer state and writes none (HF's probe calls its router with no state); a decoder layer reads the state its
    previous layer's router row wrote on the reference's inputs, and writes its own only where this layer's router row
    has not (the next layer's blocks read the router row's, not one this layer's own attention's error moved; a layer
    drilled alone still leaves one)."""
    routers = [m for m in module.modules() if isinstance(m, ZayaRouter)]
    for r in routers:
        r.reads, r.writes = not probe, False if probe else "fill"
    try:
        yield
    finally:
        for r in routers:
            r.reads = r.writes = True


def zaya_layer(layer: nn.Module, a: ModelArgs, i: int, dtype=torch.float32) -> None:
    """Give a production DecoderLayer (models/layers/transformer.py) ZAYA's attention, MoE block and residual
    scalings."""
    from models.layers.cca import CCAAttention

    layer.self_attn = CCAAttention(a, dtype, i)
    layer.mlp = ZayaMoE(a, i, dtype)
    layer.post_attention_residual_scale = ResidualScaling(a.hidden_size)
    layer.post_mlp_residual_scale = ResidualScaling(a.hidden_size)


def zaya_stream(layer: nn.Module, x, pos):
    """The stream after a ZAYA layer: each block's output and the residual scaled (with biases) and summed."""
    h = layer.post_attention_residual_scale(layer.self_attn(layer.input_layernorm(x), pos), x)
    return layer.post_mlp_residual_scale(layer.mlp(layer.post_attention_layernorm(h), pos), h)


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
