"""Routed experts with stacked weights: gathered by index or run densely when traced, grouped
by expert when eager; SwiGLU, GeGLU, the clamped SwiGLU or relu^2 (no gate), with or without biases."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs


class Experts(nn.Module):
    """Stacked expert weights. Traced (torch.export, torch.compile): a fixed graph with no
    per-expert loop, in one of two forms (`traced_form`, chosen by an exporter per method):
    "gather", each token's k experts' weights gathered by index (right for a decode step, but
    a copy of 100-200 MB per token and layer at real sizes), or "dense", every expert run on
    every token with the weights as they are and the k results picked by index (no weight
    copy; E/k times the arithmetic: for prefill). Eager: tokens grouped by expert, one matmul
    per expert that is hit, so no per-token copy of the weights is made."""

    traced_form = "gather"

    def __init__(self, a: ModelArgs):
        super().__init__()
        E, H, I = a.num_experts, a.hidden_size, a.moe_intermediate_size
        gated = 1 if a.experts.activation == "relu2" else 2  # (relu2: no gate, the up rows alone)
        self.gate_up_proj = nn.Parameter(torch.zeros(E, gated * I, H))  # gate rows, then up rows
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        if a.experts.bias:
            self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, gated * I))
            self.down_proj_bias = nn.Parameter(torch.zeros(E, H))
        self.act = a.experts.activation
        self.limit, self.alpha = a.experts.swiglu_limit, a.experts.swiglu_alpha
        self.on_input = a.router.weights_on_input

    def forward(self, x, idx, w):  # x [N, H], idx/w [N, k]
        if self.on_input:  # Llama 4: each expert's input scaled by its weight (one expert per token)
            y = self.expert_mlp(x, idx, w)  # [N, k, H]
            return y.sum(dim=1).to(x.dtype)
        y = self.expert_mlp(x, idx)  # [N, k, H]
        return (y * w[..., None]).sum(dim=1).to(x.dtype)

    def gated(self, gu, dim: int = -1):  # gate_up's output [.., 2I (or I: relu2), ..] along dim -> [.., I, ..]
        if self.act == "relu2":
            return F.relu(gu).square()
        return self.activation(*gu.chunk(2, dim=dim))

    def activation(self, gate, up):  # [..., I] each
        if self.act == "clamped_swiglu":
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return gate * torch.sigmoid(gate * self.alpha) * (up + 1)
        if self.act == "cswiglu":  # HY-V4, GLM-5.3: silu of the clamped gate, no alpha, no + 1
            return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)
        if self.act == "geglu":  # Gemma 4
            return F.gelu(gate, approximate="tanh") * up
        return F.silu(gate) * up

    def expert_mlp(self, x, idx, w=None):  # x [N, H], idx [N, k] (w [N, k]: scale the input) -> [N, k, H]
        if not torch.compiler.is_compiling():
            return self.grouped_mlp(x, idx, w)
        if self.traced_form == "dense":
            return self.dense_mlp(x, idx, w)
        xs = x[:, None, :] if w is None else x[:, None, :] * w[..., None].to(x.dtype)  # [N, 1 or k, H]
        gu = (self.gate_up_proj[idx] @ xs[..., None]).squeeze(-1)  # [N, k, 2I]
        if hasattr(self, "gate_up_proj_bias"):
            gu = gu + rows(self.gate_up_proj_bias, idx)
        y = (self.down_proj[idx] @ self.gated(gu)[..., None]).squeeze(-1)
        return y + rows(self.down_proj_bias, idx) if hasattr(self, "down_proj_bias") else y

    def dense_mlp(self, x, idx, w=None):  # traced, "dense": every expert on every token, no weight copy
        E = self.gate_up_proj.shape[0]
        if w is not None:  # the input scaled per expert: each token's weight where it is routed, 0 elsewhere
            scale = torch.where(idx[..., None] == torch.arange(E, device=idx.device), w[..., None], 0.0).sum(1)
            xt = (x[None] * scale.t()[..., None].to(x.dtype)).transpose(1, 2)  # [E, H, N]
        else:
            xt = x.t().unsqueeze(0).expand(E, -1, -1)  # [E, H, N]
        gu = torch.bmm(self.gate_up_proj, xt)  # [E, 2I, N]
        if hasattr(self, "gate_up_proj_bias"):
            gu = gu + self.gate_up_proj_bias[..., None]
        y = torch.bmm(self.down_proj, self.gated(gu, dim=1))  # [E, H, N]
        if hasattr(self, "down_proj_bias"):
            y = y + self.down_proj_bias[..., None]
        y = y.permute(2, 0, 1)  # [N, E, H]
        return y.gather(1, idx[..., None].expand(-1, -1, y.shape[-1]))  # [N, k, H]

    def grouped_mlp(self, x, idx, w=None):  # eager: per hit expert, its tokens in one matmul
        N, k = idx.shape
        flat = idx.reshape(-1)  # [N k]
        out = x.new_empty(N * k, x.shape[-1])
        bias = hasattr(self, "gate_up_proj_bias")
        for e in flat.unique().tolist():
            slots = (flat == e).nonzero().squeeze(-1)  # positions in [N k]
            xe = x[slots // k]  # [n_e, H]
            if w is not None:
                xe = xe * w.reshape(-1)[slots, None].to(x.dtype)
            gu = F.linear(xe, self.gate_up_proj[e], self.gate_up_proj_bias[e] if bias else None)
            out[slots] = F.linear(self.gated(gu), self.down_proj[e], self.down_proj_bias[e] if bias else None)
        return out.view(N, k, -1)


def rows(t, idx):  # t [E, D] at idx [N, k] -> [N, k, D], gathered by a flat index (the MLX delegate
    # lowers a 2-D index into a 2-D tensor as a take_along_axis that cannot broadcast: measured)
    return t[idx.reshape(-1)].view(*idx.shape, t.shape[-1])


@contextlib.contextmanager
def traced_experts(model: nn.Module, form: str):
    """Trace `model`'s experts in `form` ("gather" or "dense": see Experts) inside the block."""
    mods = [m for m in model.modules() if isinstance(m, Experts)]
    for m in mods:
        m.traced_form = form
    try:
        yield
    finally:
        for m in mods:
            del m.traced_form  # back to the class default
