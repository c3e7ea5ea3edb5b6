"""Port bugs of the routed and shared experts and of the MoE block: swapped projections, weights
off, the gather index, routing weights, the shared expert's gate, the clamp, dtypes, the MoE/dense
interleave."""

from __future__ import annotations

import torch

from models.args import DENSE, SPARSE
from models.faults.fault import patch
from models.layers.experts import Experts


# ------------------------------------------------------------------ experts / moe
def gate_up_swapped(layer, a):
    """Every routed expert's gate and up exchanged: their weight rows and biases, under the family's own
    activation, on every path (static, so it exports). Until 2026-11-26 a patched expert_mlp with SiLU
    and no bias: on gpt-oss that was also another activation, unlike the hf and mlx forms."""
    ex: Experts = layer.mlp.experts
    with torch.no_grad():
        for t in (ex.gate_up_proj, getattr(ex, "gate_up_proj_bias", None)):  # [E, 2I, H], [E, 2I]
            if t is not None:
                t.copy_(torch.cat(t.chunk(2, dim=1)[::-1], dim=1))


def one_expert_off(layer, a):
    """One expert's weights off by 1e-3, applied to the weights (static, so it exports).
    The expert is the one with the largest router row norm: the most often routed to."""
    ex: Experts = layer.mlp.experts
    gate = layer.mlp.gate  # (ZAYA's router is an MLP: its output projection's rows, the skip expert's left out)
    rows = gate.weight if hasattr(gate, "weight") else gate.router_mlp.out_proj.weight[: a.num_experts]
    e = int(rows.norm(dim=1).argmax())
    with torch.no_grad():
        ex.gate_up_proj[e] += 1e-3
        ex.down_proj[e] += 1e-3


def expert_index_off_by_one(layer, a):
    ex: Experts = layer.mlp.experts
    patch(ex, "expert_mlp", lambda x, idx, w=None: Experts.expert_mlp(ex, x, (idx + 1) % a.num_experts, w))


def weights_not_applied(layer, a):
    ex: Experts = layer.mlp.experts
    patch(ex, "forward", lambda x, idx, w: ex.expert_mlp(x, idx).sum(dim=1).to(x.dtype))


def shared_gate_no_sigmoid(layer, a):
    moe = layer.mlp
    patch(moe, "shared", lambda x: moe.shared_expert_gate(x) * moe.shared_expert(x))


def shared_missing(layer, a):
    moe = layer.mlp
    patch(moe, "shared", lambda x: torch.zeros_like(x))


def stray_bf16(layer, a):
    moe = layer.mlp
    fwd = type(moe).forward
    patch(moe, "forward", lambda x, *pos: fwd(moe, x, *pos).to(torch.bfloat16).to(x.dtype))  # (pos: ZAYA's)


def moe_output_upcast(layer, a):
    """The MoE forward casts its output to float unconditionally (right for the CUDA
    kernels' fp32 accumulators, wrong elsewhere): the block's output dtype changes."""
    moe = layer.mlp
    fwd = type(moe).forward
    patch(moe, "forward", lambda x, *pos: fwd(moe, x, *pos).float())  # (pos: ZAYA's MoE block takes positions)


def has_shared(a):  # a shared expert inside the MoE block
    return a.shared_expert_intermediate_size > 0 and not a.shared_expert_beside


def shared_summed(layer, a):
    """The shared expert's output summed with the routed experts' where the family averages them."""
    layer.mlp.average = False


def moe_bias_missing(layer, a):
    """The bias on the MoE block's output (JetMoE's) left out."""
    moe = layer.mlp
    with torch.no_grad():
        moe.bias.zero_()


def has_shared_beside(a):  # a shared MLP beside the MoE block, on the decoder layer (Granite's)
    return a.shared_expert_intermediate_size > 0 and a.shared_expert_beside


def shared_beside_missing(layer, a):
    """The shared MLP beside the MoE block dropped: the layer computes the routed experts alone."""
    shared = layer.shared_mlp
    patch(shared, "forward", lambda x: torch.zeros_like(x))


def dense_layer_routed(layer, a):
    """The dense layer's MLP treated as a routed one: its output scaled by routed_scaling_factor."""
    mlp = layer.mlp
    fwd = type(mlp).forward
    patch(mlp, "forward", lambda x: fwd(mlp, x) * a.router.routed_scaling_factor)


def clamp_missing(layer, a):
    layer.mlp.experts.limit = float("inf")


def moe_layer_as_dense(layer, a):
    """A wrong MoE/dense interleave (the layer taken for a dense one): its routed experts left out,
    its shared experts' MLP all it computes."""
    moe = layer.mlp
    patch(moe, "forward", lambda x: moe.shared(x.reshape(-1, x.shape[-1])).view(x.shape))


def interleave_sparse(a):
    return SPARSE in a.mlp_types and DENSE in a.mlp_types and a.shared_expert_intermediate_size > 0 \
        and not a.shared_expert_gated


def moe_output_norm_missing(layer, a):
    """The MoE block's output norm (A.X-K1's post_mlp_layernorm) left out: the block returns routed + shared
    un-normalised."""
    norm = layer.mlp.post_mlp_layernorm
    patch(norm, "forward", lambda x: x)


def moe_output_norm_before_shared(layer, a):
    """The MoE block's output norm misplaced: applied to the routed experts' sum alone, the shared experts
    added after it (HF normalises their sum)."""
    moe = layer.mlp

    def forward(x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, idx = moe.gate(x)
        return (moe.post_mlp_layernorm(moe.experts(x, idx, w)) + moe.shared(x)).view(shape)

    patch(moe, "forward", forward)
