"""Port bugs of the gated short convolution (LFM2): its conv state not carried into decode, the C gate left
out, the conv's taps in reverse order (a kernel layout misread: [H, 1, K] read back to front)."""

from __future__ import annotations

import torch

from models.faults.fault import patch, state_not_carried
from models.layers.short_conv import ShortConv


def short_conv_state_not_carried(sc: ShortConv, a):
    state_not_carried(sc, "causal_conv", "conv_state")


def short_conv_gate_missing(sc: ShortConv, a):
    patch(sc, "gated", lambda c, y: y)


def short_conv_taps_reversed(sc: ShortConv, a):
    """Applied to the weights (static, so it exports)."""
    with torch.no_grad():
        sc.conv.weight.copy_(sc.conv.weight.flip(-1))
