"""Port bugs of Inkling's mechanisms (models/inkling.py): the relative logits' distance bucket off by one and their
bias not zeroed past its extent, the k/v short convolutions' state not carried into decode, the blocks' own short
convolutions' state not carried, the FULL layers' logarithmic scaling left out, the shared experts taken outside
the router's normalisation, the dense MLP's global scale left out. NOT_FOR: the common faults whose code is the
standard router's or attention's and that Inkling's modules do not run (so they could not be seen)."""

from __future__ import annotations

from models.args import FULL, ModelArgs
from models.faults.fault import Fault


def _inkling(a: ModelArgs) -> bool:
    return a.inkling is not None


def _log_scaled(a: ModelArgs) -> bool:  # the last attention layer (the "full" target) is a FULL one that scales
    return _inkling(a) and bool(a.inkling.log_floor) and a.layer_types[-1] == FULL


# ------------------------------------------------------------------ attention
def relative_bucket_off_by_one(attn, a):
    """The bias of distance d read from the profile of d + 1 (a bucket index off by one)."""
    attn.rel_logits_proj.shift = 1


def relative_bias_past_extent(attn, a):
    """The bias beyond the extent clamped to the last bucket's value instead of zeroed."""
    attn.rel_logits_proj.bounded = False


def kv_conv_state_not_carried(attn, a):
    """The k and v short convolutions start every call from zeros (their prefill state not carried into decode)."""
    attn.k_sconv.carry = attn.v_sconv.carry = False


def log_scaling_missing(attn, a):
    attn.log_floor = 0


# ------------------------------------------------------------------ the layer, the router, the MLP
def block_conv_state_not_carried(layer, a):
    """The short convolutions on the attention's and the MLP's outputs start every call from zeros."""
    layer.attn_sconv.carry = layer.mlp_sconv.carry = False


def shared_experts_outside_normalisation(layer, a):
    """The routed experts' weights normalised among themselves, the shared experts always on at weight 1."""
    layer.mlp.gate.sink = False


def mlp_global_scale_missing(layer, a):
    layer.mlp.global_scale.data.fill_(1.0)


INKLING: tuple[Fault, ...] = (
    Fault("relative_bucket_off_by_one", "attention", "full", "relative logits: distance d read from bucket d + 1",
          relative_bucket_off_by_one, _inkling, attention=("relative",)),
    Fault("relative_bias_past_extent", "attention", "full", "relative logits: the bias past its extent (rel_extent, "
          "the window) clamped to the last bucket instead of zero", relative_bias_past_extent, _inkling,
          attention=("relative",)),
    Fault("kv_conv_state_not_carried", "attention", "full", "the k/v short convolutions' state not carried into decode",
          kv_conv_state_not_carried, _inkling, attention=("relative",)),
    Fault("log_scaling_missing", "attention", "full", "the full layers' logarithmic query and bias scaling left out",
          log_scaling_missing, _log_scaled, attention=("relative",)),
    Fault("block_conv_state_not_carried", "layer", "last", "the short convolutions on the blocks' outputs "
          "(attn_sconv, mlp_sconv) not carried into decode", block_conv_state_not_carried, _inkling),
    Fault("shared_experts_outside_normalisation", "router", "last", "the shared experts outside the router's "
          "normalisation (the routed weights normalised alone, the shared experts at weight 1)",
          shared_experts_outside_normalisation, _inkling),
    Fault("mlp_global_scale_missing", "mlp", "dense", "the dense MLP's global_scale left out", mlp_global_scale_missing,
          _inkling),
)

# the point inside its block each breaks (models.faults.catalogue.POINTS)
POINTS = {
    "relative_bucket_off_by_one": "output", "relative_bias_past_extent": "output", "kv_conv_state_not_carried": "output",
    "log_scaling_missing": "output", "block_conv_state_not_carried": "output",
    "shared_experts_outside_normalisation": "weights", "mlp_global_scale_missing": "output",
}

# the common faults whose code Inkling's modules never run (the standard Router's route / weights methods; the rope)
NOT_FOR = ("router_softmax_after_topk", "router_wrong_num_experts", "router_bias_in_weights", "rope_on_nope_layer")
