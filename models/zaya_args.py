"""ZAYA's mechanisms' configuration (models/layers/cca.py, models/layers/zaya_router.py): plain data, re-exported by
models.args."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ZayaArgs:
    """ZAYA: CCA's two causal convolutions of q|k (`cca_time0` taps depthwise, then `cca_time1` taps grouped by head);
    the MLP router's width `router_hidden_size` (its down-projection carried to the next layer's router, the
    cross-layer state); one more routing class than experts, the skip expert (no computation, weight 0)."""

    cca_time0: int = 2
    cca_time1: int = 2
    router_hidden_size: int = 256
