"""Port bugs of hyper-connections (models/layers/hyper.py), each in the last decoder layer's two connections (HF's
attn_hc and ffn_hc): the collapse's and the expansion's weights swapped (pre for post), the streams mixed by comb
where HF mixes by its transpose, the Sinkhorn-Knopp projection cut to its first column normalisation, the
flattened streams projected without their RMS norm, and (iHC) the expansion's magnitude DeepSeek-V4's constant 2
where the config's hc_magnitude differs. The attention and MLP blocks are fed HF's inputs: each is caught by the
layer row (the streams out of the layer) and localised there."""

from __future__ import annotations

import torch.nn.functional as F

from models.args import ModelArgs
from models.faults.fault import Fault, patch
from models.layers.hyper import HyperConnection


def _hc(a: ModelArgs) -> bool:
    return a.hyper is not None


def _mhc(a: ModelArgs) -> bool:
    return a.hyper is not None and a.hyper.form == "mhc"


def _connections(layer):
    return layer.attn_hc, layer.ffn_hc


def hc_pre_post_swapped(layer, a):
    """The block's input collapsed with the expansion's weights, its output expanded with the collapse's."""
    for hc in _connections(layer):
        def weights(streams, hc=hc):
            pre, post, comb = HyperConnection.weights(hc, streams)
            return post, pre, comb

        patch(hc, "weights", weights)


def hc_comb_transposed(layer, a):
    """The streams mixed as comb @ streams where HF's decoder layer mixes them by comb^T (Sinkhorn's doubly stochastic
    comb is not symmetric)."""
    for hc in _connections(layer):
        def weights(streams, hc=hc):
            pre, post, comb = HyperConnection.weights(hc, streams)
            return pre, post, comb.transpose(-1, -2)

        patch(hc, "weights", weights)


def hc_sinkhorn_cut(layer, a):
    """The Sinkhorn-Knopp projection cut to its first step (the columns normalised once, the rows never)."""
    for hc in _connections(layer):
        hc.iters = 1


def hc_projection_unnormed(layer, a):
    """The flattened streams projected without their RMS norm (HF's weightless input_norm left out)."""
    for hc in _connections(layer):
        patch(hc, "mixes", lambda flat, hc=hc: F.linear(flat, hc.fn.float()))


def hc_magnitude_constant(layer, a):
    """The expansion's weights 2 * sigmoid (DeepSeek-V4's constant) where the config's hc_magnitude is another."""
    for hc in _connections(layer):
        hc.magnitude = 2.0


HYPER: tuple[Fault, ...] = (
    Fault("hc_pre_post_swapped", "layer", "last", "hyper-connections: the block's input collapsed with the expansion's "
          "weights (post) and its output expanded with the collapse's (pre)", hc_pre_post_swapped, _hc),
    # (with two streams Sinkhorn's doubly stochastic comb is [[a, 1-a], [1-a, a]], symmetric: its transpose is the
    # same mix, nothing to catch; DeepSeek-V4's tiny config has 2, GLM-5.3's 4)
    Fault("hc_comb_transposed", "layer", "last", "mHC: the streams mixed by comb where HF mixes them by comb^T",
          hc_comb_transposed, lambda a: _mhc(a) and a.hyper.streams > 2),
    Fault("hc_sinkhorn_cut", "layer", "last", "mHC: the Sinkhorn-Knopp projection cut to one column normalisation",
          hc_sinkhorn_cut, lambda a: _mhc(a) and a.hyper.sinkhorn_iters > 1),
    Fault("hc_projection_unnormed", "layer", "last", "hyper-connections: the flattened streams projected without "
          "their RMS norm", hc_projection_unnormed, _hc),
    Fault("hc_magnitude_constant", "layer", "last", "iHC: the expansion's magnitude DeepSeek-V4's constant 2, not "
          "hc_magnitude", hc_magnitude_constant, lambda a: a.hyper is not None and a.hyper.form == "ihc"
          and a.hyper.magnitude != 2.0),
)

# the drill's first diverging point (oracle/drill/points.py; the connections return tuples, which it does not read):
# a wrong collapse shows in the attention's input norm, a wrong expansion or mix in the MLP's input norm
POINTS = {"hc_pre_post_swapped": "input_layernorm", "hc_comb_transposed": "post_attention_layernorm",
          "hc_sinkhorn_cut": "post_attention_layernorm", "hc_projection_unnormed": "input_layernorm",
          "hc_magnitude_constant": "post_attention_layernorm"}
