"""The seeded Mamba2 faults' forms on mlx-lm's Mamba2 mixer (granitemoehybrid's GraniteMoeHybridMamba2Mixer: its
conv state is the cache's slot 0, its scan state slot 1; `_ssm` runs mlx_lm.models.ssm.ssm_update)."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx_lm.models.ssm  # noqa: F401  (compute_dt, read from the module at each call)

from exporters.mlx.fault_attention import gdn_forget


def _patch_ssm(mixer, fn) -> None:
    """Override `_ssm` of this one mixer (a subclass keeping the class's name and module)."""
    cls = type(mixer)
    mixer.__class__ = type(cls.__name__, (cls,), {"_ssm": fn, "__module__": cls.__module__})


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

    _patch_ssm(mixer, _ssm)


def dt_bias_dropped(mixer, a):
    mixer.dt_bias = mx.zeros_like(mixer.dt_bias)


def dt_bf16(mixer, a):
    """The time step rounded to bf16 before it is discretised (an fp32 model)."""
    ssm = type(mixer)._ssm

    def _ssm(self, x, B, C, dt, cache, mask):
        return ssm(self, x, B, C, dt.astype(mx.bfloat16).astype(dt.dtype), cache, mask)

    _patch_ssm(mixer, _ssm)


FAULTS = {"mamba2_state_not_carried": state_not_carried, "mamba2_conv_state_not_carried": conv_state_not_carried,
          "mamba2_decay_sign_flipped": decay_sign_flipped, "mamba2_dt_bias_dropped": dt_bias_dropped,
          "mamba2_dt_bf16": dt_bf16}
