"""The recurrent mixers' configuration (Gated DeltaNet, short convolution, Mamba, Mamba2, Kimi delta attention):
plain data, re-exported by models.args, where the layer kinds that use them are named."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearAttentionArgs:
    """The Gated DeltaNet of LINEAR layers (Qwen3.5, Qwen3-Next)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int = 4


@dataclass(frozen=True)
class ShortConvArgs:
    """The gated short convolution of CONV layers (LFM2): its taps and whether its three linear maps
    (in_proj, the conv, out_proj) have biases."""

    kernel: int = 3
    bias: bool = False

    def __post_init__(self):
        if self.kernel < 2:
            raise ValueError(f"ShortConvArgs.kernel: {self.kernel} (a causal conv of at least 2 taps carries a state)")


@dataclass(frozen=True)
class MambaArgs:
    """The Mamba mixer of MAMBA layers: its inner width (channels), the SSM state size per channel, the time step's
    rank, the conv's taps, the biases, and whether dt, B and C are RMS-normed (Jamba's)."""

    inner: int
    state_size: int
    dt_rank: int
    conv_kernel: int = 4
    conv_bias: bool = True
    proj_bias: bool = False
    inner_norms: bool = True

    def __post_init__(self):
        if self.conv_kernel < 2:
            raise ValueError(f"MambaArgs.conv_kernel: {self.conv_kernel} (a causal conv of at least 2 taps)")


@dataclass(frozen=True)
class Mamba2Args:
    """The Mamba2 mixer of MAMBA2 layers: heads x head_dim = its inner width, the SSM state size, the groups B and
    C are shared over, the conv's taps, the prefill's chunk, the time-step limits dt is clamped to, the biases."""

    num_heads: int
    head_dim: int
    state_size: int
    n_groups: int = 1
    conv_kernel: int = 4
    chunk_size: int = 256
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    conv_bias: bool = True
    proj_bias: bool = False

    def __post_init__(self):
        if self.conv_kernel < 2:
            raise ValueError(f"Mamba2Args.conv_kernel: {self.conv_kernel} (a causal conv of at least 2 taps)")
        if self.num_heads % self.n_groups:
            raise ValueError(f"Mamba2Args.n_groups: {self.n_groups} does not divide num_heads {self.num_heads}")
        if self.chunk_size < 1:
            raise ValueError(f"Mamba2Args.chunk_size: {self.chunk_size}")


@dataclass(frozen=True)
class KDAArgs:
    """Kimi delta attention of KDA layers (Kimi-Linear, Bailing-hybrid): heads x head_dim for q, k and v alike, the
    short conv's taps on q, k and v, and how its gates are made."""

    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    # the forget and output gates' projections: low-rank through head_dim (Kimi-Linear's f_a_proj / f_b_proj,
    # g_a_proj / g_b_proj), or one full-rank projection each (Bailing-hybrid's f_proj, g_proj)
    low_rank_gates: bool = True
    # the forget gate bounded: g = lower_bound * sigmoid(e^A_log * (f + dt_bias)) (Bailing-hybrid's kda_safe_gate with
    # its kda_lower_bound, negative); 0: unbounded, g = -e^A_log * softplus(f + dt_bias) (Kimi-Linear's)
    lower_bound: float = 0.0
    # the log decay rounded to the model's dtype before the recurrence (Bailing-hybrid's forget gate returns it in the
    # hidden states' dtype; Kimi-Linear's keeps fp32)
    decay_in_model_dtype: bool = False

    def __post_init__(self):
        if self.conv_kernel < 2:
            raise ValueError(f"KDAArgs.conv_kernel: {self.conv_kernel} (a causal conv of at least 2 taps)")
        if self.lower_bound > 0:
            raise ValueError(f"KDAArgs.lower_bound: {self.lower_bound} (a log decay's bound: negative, or 0 for none)")
