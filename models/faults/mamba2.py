"""Port bugs of the Mamba2 mixer: its scan state or conv state not carried into decode, the decay's sign flipped,
the time step computed without dt_bias or rounded to bf16, a chunk boundary off by one (the decay at HF's chunk
boundary applied a token late)."""

from __future__ import annotations

import torch

from models.faults.fault import patch
from models.faults.mamba import mamba_conv_state_not_carried, mamba_decay_sign, mamba_state_not_carried
from models.layers.mamba2 import Mamba2


# the state, conv state and decay faults: Mamba's (models/faults/mamba.py), the same methods
mamba2_state_not_carried, mamba2_conv_state_not_carried, mamba2_decay_sign = (
    mamba_state_not_carried, mamba_conv_state_not_carried, mamba_decay_sign)


def mamba2_dt_bias_dropped(m: Mamba2, a):
    def discretized(dt, prefill: bool = True):
        dt = torch.nn.functional.softplus(dt.float())
        return dt.clamp(m.dt_min, m.dt_max) if prefill and (m.dt_min > 0.0 or m.dt_max != float("inf")) else dt

    patch(m, "discretized", discretized)


def mamba2_dt_bf16(m: Mamba2, a):  # the time step rounded to bf16 in an fp32 model (a decay in the wrong dtype)
    patch(m, "discretized", lambda dt, prefill=True: Mamba2.discretized(m, dt, prefill).to(torch.bfloat16).float())


def mamba2_chunk_boundary_off_by_one(m: Mamba2, a):
    """A chunked port's boundary off by one: the decay of the token that opens HF's second chunk (position
    chunk_size) applied one token later, so the state handed across the boundary decays one step late (decode,
    one token, is untouched). No branch on T, no slices at the boundary: index comparisons (a program whose one
    prefill method takes any length holds it too; a prompt shorter than the chunk never reaches it)."""
    def prefill(xdt, a_, B, C, state):
        idx = torch.arange(a_.shape[1], device=a_.device)[None, :, None]  # [1, T, 1]
        at, after = (idx == m.chunk).to(a_.dtype), (idx == m.chunk + 1).to(a_.dtype)
        earlier = torch.cat([torch.zeros_like(a_[:, :1]), a_[:, :-1]], dim=1)  # each token's predecessor's
        return Mamba2.prefill(m, xdt, a_ * (1 - at) + after * earlier, B, C, state)

    patch(m, "prefill", prefill)
