"""Port bugs of the Mamba2 mixer: its scan state or conv state not carried into decode, the decay's sign flipped,
the time step computed without dt_bias or rounded to bf16, the state handed from one prefill chunk to the next
leaving out the chunk's last token (a chunk boundary off by one)."""

from __future__ import annotations

import torch

from models.faults.fault import patch, state_not_carried
from models.layers.mamba2 import Mamba2, ssd_chunked


def mamba2_state_not_carried(m: Mamba2, a):
    state_not_carried(m, "scan", "recurrent_state")


def mamba2_conv_state_not_carried(m: Mamba2, a):
    state_not_carried(m, "conv", "conv_state")


def mamba2_decay_sign(m: Mamba2, a):  # A = +e^A_log: the state grows where it should decay
    patch(m, "decay_rate", lambda: m.A_log.float().exp())


def mamba2_dt_bias_dropped(m: Mamba2, a):
    def discretized(dt):
        dt = torch.nn.functional.softplus(dt.float())
        return dt.clamp(m.dt_min, m.dt_max) if m.dt_min > 0.0 or m.dt_max != float("inf") else dt

    patch(m, "discretized", discretized)


def mamba2_dt_bf16(m: Mamba2, a):  # the time step rounded to bf16 in an fp32 model (a decay in the wrong dtype)
    patch(m, "discretized", lambda dt: Mamba2.discretized(m, dt).to(torch.bfloat16).float())


def mamba2_chunk_boundary_off_by_one(m: Mamba2, a):
    """Each chunk's scan starts from the state of the previous chunk without its last token (the boundary one
    token early); the state after the prompt likewise. Chunks split at static positions (T is static per call)."""
    def chunked(xs, dt, A, B, C, state):
        ys, T = [], xs.shape[1]
        for start in range(0, T, m.chunk):
            part = slice(start, min(start + m.chunk, T))
            y, _ = ssd_chunked(xs[:, part], dt[:, part], A, B[:, part], C[:, part], m.chunk, state)
            ys.append(y)
            n = part.stop - part.start
            short = slice(part.start, part.stop - 1)  # the chunk without its last token
            state = (ssd_chunked(xs[:, short], dt[:, short], A, B[:, short], C[:, short], m.chunk, state)[1]
                     if n > 1 else state)
        return torch.cat(ys, dim=1), state

    patch(m, "chunked", chunked)
