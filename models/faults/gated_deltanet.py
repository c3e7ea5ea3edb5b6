"""Port bugs of the Gated DeltaNet: the recurrent and conv state not carried, a chunked prefill
that differs from the one-shot one."""

from __future__ import annotations

import torch

from models.faults.fault import patch, state_not_carried
from models.layers.gated_deltanet import GatedDeltaNet


# ------------------------------------------------------------------ Gated DeltaNet
def gdn_state_not_carried(gdn: GatedDeltaNet, a):
    def delta_rule(q, k, v, g, beta):
        gdn.recurrent_state.zero_()
        return GatedDeltaNet.delta_rule(gdn, q, k, v, g, beta)

    patch(gdn, "delta_rule", delta_rule)


def gdn_conv_state_not_carried(gdn: GatedDeltaNet, a):
    state_not_carried(gdn, "conv", "conv_state")


def gdn_chunked_prefill(gdn: GatedDeltaNet, a):
    """Prefill in two chunks where the second, from token T // 2 on, starts from a zero state:
    chunked prefill that differs from one-shot prefill (decode, one token, is untouched). The
    reset is a decay of e^-60 (~1e-26) added at that token (S <- e^g S), not a branch on T nor
    slices at T // 2: a program whose one prefill method takes any length (torch.export, T dynamic)
    holds it too."""

    def delta_rule(q, k, v, g, beta):
        idx = torch.arange(g.shape[-1], device=g.device)
        # [T]: 1 at the second chunk's first token (a product, not `&`: IREE 3.13 does not legalize
        # aten.__and__ on i1)
        reset = (idx == g.shape[-1] // 2).to(g.dtype) * (idx > 0).to(g.dtype)
        return GatedDeltaNet.delta_rule(gdn, q, k, v, g - 60.0 * reset, beta)

    patch(gdn, "delta_rule", delta_rule)
