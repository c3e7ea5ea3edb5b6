"""The MoE block (router, routed experts, a gated or always-on shared expert) and the dense MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.experts import Experts
from models.layers.norms import norm
from models.layers.router import Router


def clamp_of(a: ModelArgs) -> tuple | None:
    """The clamped SwiGLU's (limit, alpha) of the dense and shared MLPs (mlp_activation "clamped_swiglu": the
    experts' own, MiniMax-M3's), else None."""
    if a.mlp_activation == "cswiglu":  # DeepSeek-V4's shared expert: silu(gate <= limit) * (|up| <= limit)
        return (a.experts.swiglu_limit, None)
    return (a.experts.swiglu_limit, a.experts.swiglu_alpha) if a.mlp_activation == "clamped_swiglu" else None


class MLP(nn.Module):
    """SwiGLU down(silu(gate) * up), "geglu" down(gelu_tanh(gate) * up) (Gemma 4), "relu2" down(relu(up)^2) with
    no gate (Nemotron-H), or "clamped_swiglu" (MiniMax-M3; `clamp` its (limit, alpha)) as the experts' (gpt-oss's)."""

    def __init__(self, hidden: int, inter: int, bias: bool = False, activation: str = "swiglu", clamp=None):
        super().__init__()
        if activation != "relu2":
            self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.geglu = activation == "geglu"
        self.clamp = clamp if activation in ("clamped_swiglu", "cswiglu") else None

    def forward(self, x):
        if not hasattr(self, "gate_proj"):
            return self.down_proj(F.relu(self.up_proj(x)).square())
        if self.clamp is not None:  # gate <= limit, |up| <= limit, gate * sigmoid(alpha * gate) * (up + 1)
            limit, alpha = self.clamp
            gate, up = self.gate_proj(x).clamp(max=limit), self.up_proj(x).clamp(min=-limit, max=limit)
            if alpha is None:  # cswiglu
                return self.down_proj(F.silu(gate) * up)
            return self.down_proj(gate * torch.sigmoid(gate * alpha) * (up + 1))
        if self.geglu:  # Gemma 4: gelu (tanh approximation) gating
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate = Router(a)
        self.experts = Experts(a)
        self.shared_expert = None
        if a.moe_bias:  # JetMoE: a bias on the block's output
            self.bias = nn.Parameter(torch.zeros(a.hidden_size))
        self.average = a.shared_expert_average  # read at every call: a seeded fault sums instead (models/faults/)
        if a.shared_expert_beside:  # on the decoder layer (models.layers.transformer.DecoderLayer)
            pass
        elif a.shared_expert_intermediate_size and a.shared_expert_gated:
            self.shared_expert = MLP(a.hidden_size, a.shared_expert_intermediate_size, a.mlp_bias, a.mlp_activation, clamp_of(a))
            self.shared_expert_gate = nn.Linear(a.hidden_size, 1, bias=False)
        elif a.shared_expert_intermediate_size:  # always on, no gate (DeepSeek)
            self.shared_experts = MLP(a.hidden_size, a.shared_expert_intermediate_size, a.mlp_bias, a.mlp_activation, clamp_of(a))
        if a.moe_output_norm:  # the block's output normalised (A.X-K1)
            self.post_mlp_layernorm = norm(a, a.hidden_size)

    def forward(self, x):  # [B, T, H]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x)
        y = self.experts(x, idx, w)
        if self.shared_expert is not None or hasattr(self, "shared_experts"):
            y = y + self.shared(x)
            if self.average:  # Cohere2-MoE: (routed + shared) / 2
                y = y / 2
        if hasattr(self, "bias"):
            y = y + self.bias
        if hasattr(self, "post_mlp_layernorm"):
            y = self.post_mlp_layernorm(y)
        return y.view(shape)

    def shared(self, x):
        if self.shared_expert is None:  # always on
            return self.shared_experts(x)
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
