"""Doge's cross-domain MoE (HF's DogeCDMoE): a dense SwiGLU MLP plus num_experts single-neuron "embedding experts"
retrieved by product keys.

    l = router_gate(x)                        [N, 2K] (K = floor(sqrt(num_experts)) keys per half)
    lx, ly = l.view(2, N, K)                  HF's view: over the N tokens' 2K logits in memory order, so in a
                                              prefill token n's halves are rows of tokens n // 2 and (N + n) // 2
                                              (HF keeps it for its checkpoints; in a decode step, N = 1, they
                                              are the token's own first and second half)
    logit[n, i * K + j] = lx[n, i] + ly[n, j] the expert of key pair (i, j): K * K = num_experts experts
    idx = top-k experts, w = softmax over the top-k logits (= the renormalised softmax top-k)
    y = sum_k act(down_embed[idx] . x) * w * up_embed[idx]  +  down_proj(act(gate_proj(x)) * up_proj(x))

The router (ProductKeyRouter) is the production Router on the combined logits [N, E] (softmax top-k, renormalised:
models/layers/router.py's taps and faults as for any softmax router); the embedding experts keep Experts' method
names (expert_mlp, forward) so the catalogue's index and weight faults apply; the dense MLP is the block's always-on
shared expert (`shared_experts`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.moe import MLP, SparseMoE
from models.layers.router import Router
from models.layers.taps import tap


def num_keys(num_experts: int) -> int:
    return math.floor(math.sqrt(num_experts))


def product_logits(lin, K: int):
    """[N, 2K] router_gate outputs -> [N, K * K] expert logits, expert i * K + j scored lx[i] + ly[j] (HF's view)."""
    N = lin.shape[0]
    # HF's .view(2, bsz * seq_len, -1), as the two halves of the flat memory: reshape(2, N, K) of [N, 2K] makes
    # torch.export guard on N's parity (its view algorithm), which a dynamic prefill length violates (ExecuTorch)
    flat = lin.reshape(-1)
    lx, ly = flat[: N * K].reshape(N, K), flat[N * K :].reshape(N, K)
    return (lx[:, :, None] + ly[:, None, :]).reshape(N, K * K)


class ProductKeyRouter(Router):
    """router_gate [2K, H] -> the product-key logits [N, E] -> softmax top-k renormalised (Router.route)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        self.K = num_keys(a.num_experts)
        self.weight = nn.Parameter(torch.zeros(2 * self.K, a.hidden_size))

    def forward(self, x):  # x [N, H] -> weights [N, k], indices [N, k]
        logits = self.combine(F.linear(x, self.weight))
        w, idx = self.route(tap("logits", logits))
        return (w.to(logits.dtype) if self.cast else w), idx

    def combine(self, lin):
        return product_logits(lin, self.K)


class EmbeddingExperts(nn.Module):
    """num_experts experts of one neuron each: down_embed [E, H] (its input weights), up_embed [E, H] (its output)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.down_embed = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))
        self.up_embed = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))

    def forward(self, x, idx, w):  # x [N, H], idx/w [N, k] -> [N, H]
        # HF: (act(down . x) * w) [N, 1, k] @ up [N, k, H]
        a = self.activation(x, idx) * w.to(x.dtype)
        return (a[:, None, :] @ self.up_embed[idx]).squeeze(1).to(x.dtype)

    def activation(self, x, idx):  # [N, k]: silu(down_embed[idx] . x)
        return F.silu((self.down_embed[idx] @ x[..., None]).squeeze(-1))

    def expert_mlp(self, x, idx, w=None):  # [N, k, H]: each chosen expert's output, unweighted (the catalogue's
        # expert_weights_not_applied sums these; forward computes HF's product instead)
        return self.activation(x, idx)[..., None] * self.up_embed[idx]


class ProductKeyMoE(SparseMoE):
    """The MoE block: ProductKeyRouter (`gate`), EmbeddingExperts (`experts`), the dense MLP (`shared_experts`,
    always on: ModelArgs.shared_expert_intermediate_size, not gated); forward: SparseMoE's."""

    def __init__(self, a: ModelArgs):
        nn.Module.__init__(self)  # (not SparseMoE's: its stacked experts would be made, E x 2I x H, to be replaced)
        self.gate = ProductKeyRouter(a)
        self.experts = EmbeddingExperts(a)
        self.shared_expert, self.average = None, False
        self.shared_experts = MLP(a.hidden_size, a.shared_expert_intermediate_size, a.mlp_bias, a.mlp_activation)
