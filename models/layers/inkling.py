"""Inkling's decoder layer and embedding (models/inkling.py): the relative-logit attention
(models/layers/relative_logits.py) in the attention's place, the sink-routed MoE or the scaled dense MLP
(models/layers/sink_moe.py), and a residual short convolution on each block's output before its residual add
(attn_sconv, mlp_sconv: models/layers/residual_conv.py); the embeddings RMS-normed (InklingNormedEmbedding)."""

from __future__ import annotations

import torch
from torch import nn

from models.args import SPARSE, ModelArgs, mlp_type
from models.layers.norms import norm
from models.layers.residual_conv import ResidualConv
from models.layers.sink_moe import ScaledMLP, SinkMoE


def inkling_blocks(layer: nn.Module, a: ModelArgs, i: int, dtype=torch.float32) -> None:
    """Give a production DecoderLayer (models/layers/transformer.py) Inkling's MoE or MLP and its two short convs (its
    attention, AttentionArgs.kind "relative", is built there)."""
    layer.mlp = SinkMoE(a) if mlp_type(a, i) == SPARSE else ScaledMLP(a)
    layer.attn_sconv = ResidualConv(a.hidden_size, a.inkling.conv_kernel)
    layer.mlp_sconv = ResidualConv(a.hidden_size, a.inkling.conv_kernel)


class NormedEmbedding(nn.Embedding):
    """The embedding RMS-normed (HF's embed_tokens.embed_norm)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        self.embed_norm = norm(a, a.hidden_size)

    def forward(self, tokens):
        return self.embed_norm(super().forward(tokens))
