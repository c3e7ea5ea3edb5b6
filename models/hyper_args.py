"""Hyper-connections' configuration (models/layers/hyper.py): plain data, re-exported by models.args
(ModelArgs.hyper)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from models.kinds import check_kinds


@dataclass(frozen=True)
class HyperArgs:
    """The residual stream widened to `streams` copies (HF's hc_mult): [B, T, N, H] between the layers.

    form "mhc": DeepSeek-V4's manifold-constrained HC (GLM-5.3's too): fn [(2+N)*N, N*H], base [(2+N)*N], scale [3];
    pre = sigmoid(.) + eps, post = magnitude * sigmoid(.), comb = softmax(.) + eps made doubly stochastic by
    `sinkhorn_iters` Sinkhorn-Knopp steps; streams' = post * block(collapse) + comb^T @ streams (in the model's dtype).
    form "ihc": HY-V4's independent HC: fn [2N, N*H], base [2N], scale [2], no comb; post = magnitude * sigmoid(.) +
    eps; streams' = post * block + streams, all in fp32.
    head: the streams collapsed before the final norm: "weighted" (HyperHead's hc_fn, hc_base, hc_scale: sigmoid
    weights + eps) or "mean" (GLM-5.3's, no parameters).
    norm_eps: the weightless RMSNorm of the flattened streams (HF's rms_norm_eps); eps: HF's hc_eps.
    fp32_params: the parameter names (leaves) HF keeps in fp32 whatever the model's dtype."""

    streams: int
    form: Literal["mhc", "ihc"] = "mhc"
    sinkhorn_iters: int = 20
    eps: float = 1e-6
    norm_eps: float = 1e-6
    magnitude: float = 2.0
    head: Literal["weighted", "mean"] = "weighted"
    fp32_params: tuple[str, ...] = ("fn", "base", "scale", "hc_fn", "hc_base", "hc_scale")

    def __post_init__(self):
        check_kinds(self)
        if self.streams < 1:
            raise ValueError(f"HyperArgs.streams: {self.streams} (at least one stream)")
