"""Inkling's configuration (thinkingmachines' Inkling, transformers 5.23 `inkling`): the relative-logit attention
without RoPE, the short convolutions (k and v, and on each block's output), the router whose shared experts take part
in its normalisation, the normed embedding and the muP head divisor: plain data, re-exported by models.args."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InklingArgs:
    """d_rel: the width per head of the relative states (r_proj) that mix the bias-vs-distance profiles; rel_extent:
    how far back the FULL layers' bias reaches (the SLIDING layers': their window); conv_kernel: the taps of every
    short convolution (x + causal depthwise conv(x), fp32, its last kernel - 1 inputs carried); log_floor /
    log_alpha: the FULL layers' queries and bias times 1 + alpha * log(max((pos + 1) / floor, 1)) (0: none);
    n_shared: the shared experts, scored by the router's last n_shared rows beside the chosen routed experts and
    normalised with them; route_scale: the weights' factor; head_divisor: the final norm's output divided by it
    before the head (logits_mup_width_multiplier)."""

    d_rel: int
    rel_extent: int
    conv_kernel: int = 4
    log_floor: int = 0
    log_alpha: float = 0.1
    n_shared: int = 1
    route_scale: float = 1.0
    head_divisor: float = 1.0

    def __post_init__(self):
        if self.conv_kernel < 2 or self.d_rel < 1 or self.rel_extent < 1 or self.n_shared < 1:
            raise ValueError(f"InklingArgs: {self} (a conv of at least 2 taps, d_rel, rel_extent, n_shared >= 1)")
