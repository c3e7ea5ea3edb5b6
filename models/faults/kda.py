"""Port bugs of Kimi delta attention (Kimi-Linear's): its recurrent state or conv state not carried into decode, the
decay's sign dropped (e^(+e^A_log softplus(.)): the state grows), the decay one per head where KDA's is one per channel
(a Gated DeltaNet port: the head's channels averaged), the output gate without its sigmoid, the bounded forget gate
(Bailing-hybrid's safe gate) computed as Kimi-Linear's unbounded one."""

from __future__ import annotations

from models.faults.fault import patch, state_not_carried
from models.layers.kda import ForgetGate, KimiDeltaAttention


def kda_state_not_carried(m: KimiDeltaAttention, a):
    state_not_carried(m, "delta_rule", "recurrent_state")


def kda_conv_state_not_carried(m: KimiDeltaAttention, a):
    state_not_carried(m, "conv", "conv_state")


def kda_decay_sign(m: KimiDeltaAttention, a):  # +e^A_log: the state grows where it should decay
    patch(m.forget_gate, "decay_rate", lambda: m.forget_gate.A_log.float().exp())


def kda_decay_per_head(m: KimiDeltaAttention, a):
    """One log decay per head (the mean of its channels'), every key channel of the head decaying alike."""
    gate = m.forget_gate
    patch(gate, "forward", lambda x: ForgetGate.forward(gate, x).mean(-1, keepdim=True).expand(*x.shape[:2], gate.h,
                                                                                               gate.d))


def kda_output_gate_no_sigmoid(m: KimiDeltaAttention, a):
    patch(m.o_norm, "activation", lambda gate: gate)


def kda_gate_bound_dropped(m: KimiDeltaAttention, a):
    """The bounded forget gate, lower_bound * sigmoid(e^A_log (f + dt_bias)), computed as Kimi-Linear's unbounded
    -e^A_log softplus(f + dt_bias) (a port of Kimi's KDA that ignores kda_safe_gate)."""
    m.forget_gate.lower_bound = 0.0
