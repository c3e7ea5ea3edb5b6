"""Port bugs of ZAYA's mechanisms (models/layers/cca.py, models/layers/zaya_router.py): CCA's value half from the
current token where it is the previous token's (not delayed), CCA's carried states (the convolution's last inputs and
the last delayed value) dropped between calls, the previous layer's router state left out of the router or added
without its router_states_scale, the skip expert given its probability as a weight (HF's weight 0: the block runs
expert 0 at that weight). NOT_FOR: the common router faults whose code is the standard router's (its route, weights
and RouterArgs), which ZAYA's MLP router does not run (so they could not be seen)."""

from __future__ import annotations

from models.faults.fault import Fault


def _zaya(a) -> bool:
    return a.zaya is not None


def cca_value_not_delayed(attn, a):
    """The value's delayed half from the current token's v_proj_delayed."""
    attn.qkv_proj.delayed = False


def cca_state_not_carried(attn, a):
    """Every call a new sequence for CCA: the convolution's last inputs and the last delayed value zeroed."""
    attn.qkv_proj.carried = False


def zaya_router_state_not_passed(layer, a):
    """The router without the previous layer's state (HF adds its down-projection, scaled)."""
    layer.mlp.gate.passed = False


def zaya_router_state_unscaled(layer, a):
    """The previous layer's router state added without router_states_scale."""
    layer.mlp.gate.scaled = False


def zaya_skip_expert_weighted(layer, a):
    """The skip expert's probability kept as its weight (HF masks it to 0: the skip expert computes nothing)."""
    layer.mlp.gate.skip_weighted = True


ZAYA: tuple[Fault, ...] = (
    Fault("cca_value_not_delayed", "attention", "full", "CCA: the value's delayed half from the current token",
          cca_value_not_delayed, _zaya),
    Fault("cca_state_not_carried", "attention", "full", "CCA: the convolution's and the delayed value's state not "
          "carried into decode", cca_state_not_carried, _zaya),
    Fault("zaya_router_state_not_passed", "router", "last", "ZAYA's router without the previous layer's router state",
          zaya_router_state_not_passed, _zaya),
    Fault("zaya_router_state_unscaled", "router", "last", "ZAYA's router: the previous layer's state added without "
          "router_states_scale", zaya_router_state_unscaled, _zaya),
    # (the first layer: the tiny checkpoint's router chooses the skip expert there)
    Fault("zaya_skip_expert_weighted", "router", "first", "ZAYA's skip expert weighted by its probability (HF: 0)",
          zaya_skip_expert_weighted, _zaya),
)

# the drill's first diverging point (oracle/drill/points.py)
POINTS = {"cca_value_not_delayed": "context", "cca_state_not_carried": "conv",
          "zaya_router_state_not_passed": "router_mlp.norm", "zaya_router_state_unscaled": "router_mlp.norm",
          "zaya_skip_expert_weighted": "weights"}

NOT_FOR = ("router_softmax_after_topk", "router_wrong_num_experts", "router_sigmoid", "router_bias_in_weights",
           "router_bias_ignored")
