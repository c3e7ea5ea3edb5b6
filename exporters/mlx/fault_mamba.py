"""The seeded Mamba2 and Mamba faults' forms on mlx-lm's mixers: granitemoehybrid's GraniteMoeHybridMamba2Mixer (its
conv state the cache's slot 0, its scan state slot 1; `_ssm` runs mlx_lm.models.ssm.ssm_update) and jamba's
JambaMambaMixer (the same slots; `ssm_step` its scan)."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx_lm.models.ssm  # noqa: F401  (compute_dt, read from the module at each call)

from exporters.mlx.fault_attention import gdn_forget
from exporters.mlx.model import patch_call, patch_method


def state_not_carried(mixer, a):
    gdn_forget(mixer, 1)


def conv_state_not_carried(mixer, a):
    gdn_forget(mixer, 0)


def decay_sign_flipped(mixer, a):
    """The scan with A = +e^A_log, token by token (mlx-lm's own ssm_update always negates)."""
    def _ssm(self, x, B, C, dt, cache, mask):
        b, T, _ = x.shape
        h, p, n, g = self.num_heads, self.head_dim, self.ssm_state_size, self.n_groups
        x = x.reshape(b, T, h, p).astype(mx.float32)
        B = mx.repeat(B.reshape(b, T, g, n), h // g, axis=2).astype(mx.float32)
        C = mx.repeat(C.reshape(b, T, g, n), h // g, axis=2).astype(mx.float32)
        # [b, T, h]: mlx-lm's own discretisation, looked up at the call (the drill's dt point records it)
        dt = sys.modules["mlx_lm.models.ssm"].compute_dt(dt, self.dt_bias, self.time_step_limit)
        A = mx.exp(self.A_log.astype(mx.float32))  # the fault: + where mlx-lm has -
        state = cache[1] if cache is not None and cache[1] is not None else mx.zeros((b, h, p, n), mx.float32)
        ys = []
        for t in range(T):
            state = state * mx.exp(dt[:, t] * A)[..., None, None] + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
            ys.append((state @ C[:, t, :, :, None])[..., 0] + x[:, t] * self.D[:, None])
        if cache is not None:
            cache[1] = state
        return mx.stack(ys, axis=1).reshape(b, T, h * p)

    patch_method(mixer, "_ssm", _ssm)


def dt_bias_dropped(mixer, a):
    mixer.dt_bias = mx.zeros_like(mixer.dt_bias)


def dt_bf16(mixer, a):
    """The time step rounded to bf16 before it is discretised (an fp32 model)."""
    ssm = type(mixer)._ssm

    def _ssm(self, x, B, C, dt, cache, mask):
        return ssm(self, x, B, C, dt.astype(mx.bfloat16).astype(dt.dtype), cache, mask)

    patch_method(mixer, "_ssm", _ssm)


FAULTS = {"mamba2_state_not_carried": state_not_carried, "mamba2_conv_state_not_carried": conv_state_not_carried,
          "mamba2_decay_sign_flipped": decay_sign_flipped, "mamba2_dt_bias_dropped": dt_bias_dropped,
          "mamba2_dt_bf16": dt_bf16}


# ------------------------------------------------------------------ Mamba (jamba's JambaMambaMixer: __call__(x, cache))
def _forget(mixer, slot: int) -> None:
    """Drop the cache's conv state (slot 0) or scan state (slot 1) before every call."""
    call = type(mixer).__call__

    def fn(self, x, cache=None):
        if cache is not None:
            cache[slot] = None
        return call(self, x, cache)

    patch_call(mixer, fn)


def mamba_decay_sign_flipped(mixer, a):  # its ssm_step given A = +e^A_log
    step = type(mixer).ssm_step
    patch_method(mixer, "ssm_step", lambda self, x, A, state=None: step(self, x, -A, state))


def mamba_dt_bias_dropped(mixer, a):
    mixer.dt_proj.bias = mx.zeros_like(mixer.dt_proj.bias)


def mamba_inner_norms_missing(mixer, a):
    for norm in (mixer.dt_layernorm, mixer.b_layernorm, mixer.c_layernorm):
        patch_call(norm, lambda self, x: x)


FAULTS.update({"mamba_state_not_carried": lambda m, a: _forget(m, 1),
               "mamba_conv_state_not_carried": lambda m, a: _forget(m, 0),
               "mamba_decay_sign_flipped": mamba_decay_sign_flipped, "mamba_dt_bias_dropped": mamba_dt_bias_dropped,
               "mamba_inner_norms_missing": mamba_inner_norms_missing})
