"""Muse Spark's mechanisms' configuration (models/layers/muse.py): plain data, re-exported by models.args."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MuseArgs:
    """Muse Spark's text model: q times `qk_scale` after the weightless q/k norm (the attention's output weightless-normed
    per head before its sigmoid gate); the post-norms' `post_norm_eps`; each residual add gated by a learned vector at
    `gate_temperature` (MuseSparkResidualGate); the experts at `moe_hidden_size` between a down- and an up-projection,
    each expert's output input-scaled-RMS-normed; the router's logits (fp32) and the head's logits times
    `output_multiplier`; the embeddings weightless-normed."""

    qk_scale: float
    post_norm_eps: float
    gate_temperature: float
    moe_hidden_size: int
    output_multiplier: float
    gate_eps: float = 1e-3  # the residual gate's floor under alpha's square root
