"""Gemma 4's sparse feed-forward: a dense MLP and an MoE block side by side on the same stream, each with its own
norms, their normed outputs summed and normed once more before the residual add (ModelArgs.moe_beside_mlp).

    h    the stream after the attention's residual add
    d  = post_feedforward_layernorm_1(dense_mlp(pre_feedforward_layernorm(h)))
    m  = mlp(h) = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), idx, w * per_expert_scale[idx]))
         where w, idx = router(h)
    out = h + post_feedforward_layernorm(d + m)

The router reads the stream itself (HF: "hidden states before MLP"), RMS-normed inside it (RouterArgs.input_norm);
the experts read it through their own pre-norm. HF's router multiplies its weights by a learned scale per expert
before it returns them; here the router's weights are the routing's (renormalised top-k softmax, what the family's
routing computes from the logits alone: routing replay, the router rows) and the block applies the scale (the
reference, models/gemma4.py, is regrouped so: the same product). The MoE block (`mlp`, here) is the production model's sparse block
with both: its input is the stream, as the router's is (models.args.block_input_path)."""

from __future__ import annotations

from models.args import ModelArgs
from models.layers.moe import MLP, SparseMoE
from models.layers.norms import norm


class MoEBeside(SparseMoE):
    """The MoE block of a Gemma 4 layer: routed on its input, the experts on its input normed, the output normed."""

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        self.pre_feedforward_layernorm_2 = norm(a, a.hidden_size)
        self.post_feedforward_layernorm_2 = norm(a, a.hidden_size)
        self.scaled = a.router.per_expert_scale  # read at every call: a seeded fault drops the scale (models/faults/)

    def forward(self, x):  # [B, T, H]
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = self.gate(x)
        if self.scaled:  # (the router's weights are the routing's; the scale is the block's)
            w = w * self.gate.per_expert_scale[idx]
        y = self.experts(self.pre_feedforward_layernorm_2(x), idx, w)
        return self.post_feedforward_layernorm_2(y).view(shape)


def add_dense_beside(layer, a: ModelArgs) -> None:
    """The decoder layer's dense MLP beside its MoE block, and the dense MLP's own post-norm."""
    layer.dense_mlp = MLP(a.hidden_size, a.intermediate_size, a.mlp_bias, a.mlp_activation)
    layer.post_feedforward_layernorm_1 = norm(a, a.hidden_size)


def feed_forward(layer, h):
    """What the layer adds to the stream h for its dense MLP and MoE block (the sum of both, normed)."""
    d = layer.post_feedforward_layernorm_1(layer.dense_mlp(layer.pre_feedforward_layernorm(h)))
    return layer.post_feedforward_layernorm(d + layer.mlp(h))
