"""Port bugs of the Mamba mixer (Jamba's): its scan state or conv state not carried into decode, the decay's sign
flipped, the time step computed without dt_proj's bias, Jamba's RMSNorms of dt, B and C left out (a Mamba port that
misses what Jamba adds)."""

from __future__ import annotations

import torch

from models.faults.fault import patch, state_not_carried
from models.layers.mamba import Mamba


# (Mamba's and Mamba2's: the two mixers carry their state through the same methods, scan and conv, and take their
# decay rate from decay_rate)
def mamba_state_not_carried(m: Mamba, a):
    state_not_carried(m, "scan", "recurrent_state")


def mamba_conv_state_not_carried(m: Mamba, a):
    state_not_carried(m, "conv", "conv_state")


def mamba_decay_sign(m: Mamba, a):  # A = +e^A_log: the state grows where it should decay
    patch(m, "decay_rate", lambda: m.A_log.float().exp())


def mamba_dt_bias_dropped(m: Mamba, a):
    patch(m, "discretized", lambda dt: torch.nn.functional.softplus((dt @ m.dt_proj.weight.t()).float()))


def mamba_inner_norms_missing(m: Mamba, a):
    for norm in (m.dt_layernorm, m.b_layernorm, m.c_layernorm):
        patch(norm, "forward", lambda x: x)
