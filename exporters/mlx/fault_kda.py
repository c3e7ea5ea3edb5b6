"""The seeded Kimi delta attention (KDA) faults' forms on mlx-lm's mixers: kimi_linear's KimiDeltaAttention and
bailing_moe_v3's BailingKDA. Both keep their q, k and v convs' states in the cache's slots 0, 1, 2 (the torch model's
one conv over q | k | v, one conv_state) and the recurrent state in slot 3; both hand the raw forget gate, A_log
[h, 1] and dt_bias [h, d] to mlx_lm.models.gated_delta.gated_delta_update, which makes the per-channel decay e^g with
its module's compute_g (-e^A_log softplus(f + dt_bias)) or, given a lower bound (Bailing's safe gate),
compute_lower_bound_g (lower_bound * sigmoid(e^A_log (f + dt_bias))); both gate the output inline,
o_norm(o) * sigmoid(gate), the gate kimi_linear's g_b_proj(g_a_proj(x)), Bailing's g_proj(x)."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.models.gated_delta  # noqa: F401  (compute_g, compute_lower_bound_g: swapped in the module for a call)

from exporters.mlx.fault_attention import gdn_forget
from exporters.mlx.model import patch_call


def state_not_carried(mixer, a):
    gdn_forget(mixer, 3)


def conv_state_not_carried(mixer, a):
    gdn_forget(mixer, 0, 1, 2)


def _decay(mixer, log_decay) -> None:
    """The mixer's decay e^g with g = log_decay(A_log, u, lower_bound), u = f + dt_bias in fp32 (lower_bound None: the
    unbounded gate): gated_delta_update's compute_g and compute_lower_bound_g swapped in their module for this
    mixer's call only (gated_delta_update reads them there at each call; the drill's recurrence point, which wraps
    gated_delta_update in the mixer's module, still records)."""
    call = type(mixer).__call__
    gd = sys.modules["mlx_lm.models.gated_delta"]

    def compute_g(A_log, f, dt_bias):
        return mx.exp(log_decay(A_log.astype(mx.float32), f + dt_bias, None))

    def compute_lower_bound_g(A_log, f, dt_bias, lower_bound):
        return mx.exp(log_decay(A_log.astype(mx.float32), f.astype(mx.float32) + dt_bias, lower_bound))

    def fn(self, x, mask=None, cache=None):
        saved = gd.compute_g, gd.compute_lower_bound_g
        gd.compute_g, gd.compute_lower_bound_g = compute_g, compute_lower_bound_g
        try:
            return call(self, x, mask, cache)
        finally:
            gd.compute_g, gd.compute_lower_bound_g = saved

    patch_call(mixer, fn)


def _log_decay(rate, u, lower_bound):
    """The forget gate's log decay per channel for the decay rate `rate` (-e^A_log: mlx-lm's), as mlx-lm's
    compute_g / compute_lower_bound_g (models.layers.kda.ForgetGate)."""
    if lower_bound is None:
        return rate * nn.softplus(u)
    return lower_bound * mx.sigmoid(-rate * u)


def decay_sign_flipped(mixer, a):  # the decay rate +e^A_log: the state grows where it should decay
    _decay(mixer, lambda A_log, u, lb: _log_decay(mx.exp(A_log), u, lb))


def decay_per_head(mixer, a):
    """One log decay per head (the mean of its channels'), every key channel of the head decaying alike."""
    def log_decay(A_log, u, lb):
        g = _log_decay(-mx.exp(A_log), u, lb)  # [B, T, h, d]
        return mx.broadcast_to(g.mean(axis=-1, keepdims=True), g.shape)

    _decay(mixer, log_decay)


def gate_bound_dropped(mixer, a):
    """Bailing's bounded forget gate computed as Kimi-Linear's unbounded -e^A_log softplus(f + dt_bias): the mixer
    hands gated_delta_update no lower bound (a port of Kimi's KDA that ignores kda_safe_gate)."""
    mixer.lower_bound = None


class _Seen:
    """A submodule run as it is, its output kept (the mixer's own call computes it once)."""

    def __init__(self, module, seen: dict, name: str):
        self.module, self.seen, self.name = module, seen, name

    def __call__(self, x):
        out = self.module(x)
        self.seen[self.name] = out
        return out


def output_gate_no_sigmoid(mixer, a):
    """The output o_norm(o) * gate instead of o_norm(o) * sigmoid(gate): mlx-lm's own __call__ runs with o_proj set
    aside and its o_norm's output and its gate projection's kept, then o_proj takes their ungated product."""
    call = type(mixer).__call__
    gate_name = "g_b_proj" if "g_b_proj" in mixer else "g_proj"  # kimi_linear's low-rank gate; Bailing's full-rank

    def fn(self, x, mask=None, cache=None):
        B, T, _ = x.shape
        o_norm, gate_proj, o_proj, seen = self.o_norm, self[gate_name], self.o_proj, {}
        self["o_norm"], self[gate_name] = _Seen(o_norm, seen, "o"), _Seen(gate_proj, seen, "gate")
        self["o_proj"] = nn.Identity()
        try:
            call(self, x, mask, cache)
        finally:
            self["o_norm"], self[gate_name], self["o_proj"] = o_norm, gate_proj, o_proj
        o = seen["o"]  # [B, T, h, d]
        return o_proj((o * seen["gate"].reshape(o.shape).astype(o.dtype)).reshape(B, T, -1))

    patch_call(mixer, fn)


FAULTS = {"kda_state_not_carried": state_not_carried, "kda_conv_state_not_carried": conv_state_not_carried,
          "kda_decay_sign_flipped": decay_sign_flipped, "kda_decay_per_head": decay_per_head,
          "kda_output_gate_no_sigmoid": output_gate_no_sigmoid, "kda_gate_bound_dropped": gate_bound_dropped}
