"""A.X-K2's gated RMSNorm (HF's AXK2GatedRMSNorm, Megatron's GatedNormWrapper): y = RMSNorm(x), then y times a
low-rank input-dependent sigmoid gate of y itself, y * sigmoid(fc2(silu(fc1(y)))) (the sigmoid and the product in
fp32, the result in y's dtype). It wraps every layer's input norm and the post-attention norm of the sparse layers
(NormArgs.gate_rank: the gate's bottleneck rank; 0: none). Module names mirror HF's: `norm.weight`,
`mlp.fc1.weight`, `mlp.fc2.weight`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import SPARSE, ModelArgs, mlp_type
from models.layers.norms import rms_norm


class GateMLP(nn.Module):
    def __init__(self, hidden: int, rank: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, rank, bias=False)
        self.fc2 = nn.Linear(rank, hidden, bias=False)

    def forward(self, y):
        return self.fc2(F.silu(self.fc1(y)))


class LowRankGatedRMSNorm(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.norm = rms_norm(a, a.hidden_size)
        self.mlp = GateMLP(a.hidden_size, a.norm.gate_rank)

    def forward(self, x):
        y = self.norm(x)
        return (y * self.gate(y)).to(y.dtype)

    @property
    def eps(self) -> float:  # (the norm's: a fault on a layer's input norm eps reaches it)
        return self.norm.eps

    @eps.setter
    def eps(self, value: float) -> None:
        self.norm.eps = value

    def gate(self, y):  # [.., H] fp32: sigmoid of the low-rank gate of the normed input
        return torch.sigmoid(self.mlp(y).float())


def add_gated_norms(layer: nn.Module, a: ModelArgs, i: int) -> None:
    """A decoder layer's input norm (every layer) and its post-attention norm (a sparse layer) gated (A.X-K2)."""
    if hasattr(layer, "input_layernorm"):
        layer.input_layernorm = LowRankGatedRMSNorm(a)
    if hasattr(layer, "post_attention_layernorm") and mlp_type(a, i) == SPARSE:
        layer.post_attention_layernorm = LowRankGatedRMSNorm(a)
