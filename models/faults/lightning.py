"""Port bugs of lightning attention (MiniMax-Text-01's): its state not carried into decode, the slopes without their
per-layer factor (every layer decaying as the first), the output gate without its sigmoid."""

from __future__ import annotations

import torch

from models.faults.fault import patch, state_not_carried
from models.layers.lightning import Lightning


def lightning_state_not_carried(m: Lightning, a):
    state_not_carried(m, "scan", "recurrent_state")


def lightning_slope_layer_factor_missing(m: Lightning, a):
    base = 1 / (2 ** (8 / m.h))
    patch(m, "slopes", lambda: base ** (torch.arange(m.h, device=m.slope.device) + 1.0))


def lightning_gate_no_sigmoid(m: Lightning, a):
    patch(m, "gated", lambda o, x: m.output_gate(x) * o)
