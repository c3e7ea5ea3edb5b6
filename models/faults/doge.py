"""Port bugs of what Doge brought (models/doge.py): the dynamic mask's A with its sign dropped, its keep window one
key short, the product keys crossed (expert i * K + j scored by the second half's key i and the first's key j), the
router's halves split per token (HF views the call's logits as [2, tokens, keys]), a residual scale dropped."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.args import ModelArgs
from models.faults.fault import Fault, patch
from models.layers.dynamic_mask import DynamicMaskIndexer


def _dma(a: ModelArgs) -> bool:
    return bool(a.attention.keep_window)


def _pk(a: ModelArgs) -> bool:
    return a.product_key_moe


# ------------------------------------------------------------------ dynamic mask attention (the last layer's)
def dma_A_sign_flipped(attn, a):
    """dt = exp(-A * softplus(dt_proj(v))): A's sign dropped (a port that stores A as -exp(A_log) reading it as A)."""
    def dynamic_bias(vc):
        B, _, S, _ = vc.shape
        dt = attn.dt_proj(vc.transpose(1, 2).reshape(B, S, -1))
        return torch.exp(-attn.A * F.softplus(dt)).transpose(1, 2)

    patch(attn, "dynamic_bias", dynamic_bias)


def dma_keep_window_off_by_one(attn, a):
    """One key fewer kept than keep_window (k - 1; the best key given twice keeps the choice's shape)."""
    ix = attn.indexer

    def choose(ranked):
        idx = DynamicMaskIndexer.choose(ix, ranked)[..., : ix.k - 1]
        return torch.cat((idx, idx[..., :1]), dim=-1)

    patch(ix, "choose", choose)


# ------------------------------------------------------------------ the product-key router (the last layer's)
def pk_keys_crossed(layer, a):
    """Expert i * K + j scored lx[j] + ly[i]: the product keys crossed in the wrong order."""
    gate = layer.mlp.gate
    K = gate.K
    patch(gate, "combine", lambda lin: (lambda s: s.view(-1, K, K).transpose(1, 2).reshape(-1, K * K))(
        type(gate).combine(gate, lin)))


def pk_halves_per_token(layer, a):
    """Each token's logits split into its own two halves ([N, 2, K]) where HF views the call's [N, 2K] logits as
    [2, N, K] (the same in a decode step; a prefill's routing differs)."""
    gate = layer.mlp.gate
    K = gate.K

    def combine(lin):
        lx, ly = lin.reshape(-1, 2, K).unbind(1)
        return (lx[:, :, None] + ly[:, None, :]).reshape(-1, K * K)

    patch(gate, "combine", combine)


# ------------------------------------------------------------------ the layer (the last)
def input_residual_dropped(layer, a):
    """The attention's residual added unscaled (input_residual left out)."""
    with torch.no_grad():
        layer.input_residual.fill_(1.0)


DOGE: tuple[Fault, ...] = (
    Fault("dma_A_sign_flipped", "attention", "full", "dynamic mask: exp(-A softplus(dt)), A's sign dropped",
          dma_A_sign_flipped, _dma),
    Fault("dma_keep_window_off_by_one", "attention", "full", "dynamic mask: keep_window - 1 keys kept per query",
          dma_keep_window_off_by_one, _dma),
    Fault("product_keys_crossed", "router", "last", "product keys crossed: expert i*K+j scored by key j of the first "
          "half and key i of the second", pk_keys_crossed, _pk),
    Fault("product_key_halves_per_token", "router", "last", "product-key router: each token's logits split in its own "
          "halves where HF views the call's logits as [2, tokens, keys]", pk_halves_per_token, _pk),
    Fault("input_residual_dropped", "layer", "last", "the attention's residual without its learned scale "
          "(input_residual)", input_residual_dropped, lambda a: a.residual_scales),
)

# the point inside its block each breaks (models.faults.catalogue.POINTS)
POINTS = {
    # the keys kept (the indexer's output; the projections agree)
    "dma_A_sign_flipped": "indexer", "dma_keep_window_off_by_one": "indexer",
    "product_keys_crossed": "logits", "product_key_halves_per_token": "logits",
    # the first point after the residual sum
    "input_residual_dropped": "post_attention_layernorm",
}
