"""Seeded faults on HF transformers' own model, keyed by the names in models/faults/:
`oracle selftest --backend hf`.

The `hf` backend runs transformers' modules as the candidate (exporters/torch/hf.py), so its self-test
asks whether the block rows catch a bug in a candidate whose blocks are replayed inside a whole
HF model (the hooks that feed each block the reference's input), not whether transformers is
right. A catalogue fault is an edit of one production-model method; here it has a form only
where every family's HF modules can take it without rewriting their forward:

- an attribute the modules keep (an RMSNorm's eps, the attention's `scaling`, a router's
  `norm_topk_prob`, `routed_scaling_factor` or group count, Granite's `residual_multiplier`,
  the clamp `limit` of GPT-OSS's experts, DBRX's `clip_qkv`, Cohere2-MoE's
  `shared_expert_combination_strategy`);
- a weight or buffer (one expert's weights, the routers' correction bias or logit bias, the
  attention sinks; gate and up exchanged in the fused experts, in the layout the family states:
  models.Family.hf_gate_up);
- a module's output (a stray cast, a dropped shared expert, skipped q/k norms).

The block modules are the family's HF paths (oracle.reference.run.block_modules); nothing here names
a family. A fault whose attribute or module a family's HF code lacks is refused when the faulted
candidate loads (InputError, listed by the self-test as not applicable with the reason). The
faults with no form here are in NOT_APPLICABLE, each with why.
"""

from __future__ import annotations

import torch
from torch import nn

from oracle.backend import InputError

# ------------------------------------------------------------------ forms
# Each form is (blocks, args) -> None: `blocks` the HF modules to search by block kind, the fault's own
# block first, then its layer's router and MoE block (a router fault's attributes may be on the MoE
# block; an expert fault picks its expert by the router's weight).


def submodules(block, a) -> dict:
    """A block's submodules by path, each also under its production name where the family's HF names it otherwise
    (Family.hf_point_names: LFM2's operator_norm is input_layernorm, Kolibri-1's post_self_attn_layernorm the
    attention's post-norm): a form names the module by its role, the production name first."""
    from models import get_family
    from models.mapping import renamed

    names = get_family(a.family).hf_point_names or {}
    subs = dict(block.named_modules())
    return {**subs, **{renamed(p, names): m for p, m in subs.items()}}


def attribute(names: tuple, value, path: str | None = None):
    """Set the first of `names` found on a block or its submodules (`path`: that submodule only, by
    its production name: submodules) to value(old, args)."""
    def apply(blocks, a):
        for block in blocks.values():
            subs = submodules(block, a)
            for m in (dict(block.named_modules()).values() if path is None else
                      [subs[path]] if path in subs else []):
                for n in names:
                    old = m.__dict__.get(n)  # a plain attribute, not a parameter, buffer or submodule
                    if isinstance(old, (bool, int, float, str)):
                        setattr(m, n, value(old, a))
                        return
        raise InputError(f"HF's module has no {' or '.join(names)} attribute"
                         + (f" at {path}" if path else "") + " to change")
    return apply


def tensor(names: tuple, edit, path: str | None = None):
    """Edit in place the first parameter or buffer whose own name is one of `names` (`path`: of that submodule
    only)."""
    def apply(blocks, a):
        for block in blocks.values():
            for n, t in (*block.named_parameters(), *block.named_buffers()):
                owner, _, own = n.rpartition(".")
                if own in names and (path is None or owner == path):
                    with torch.no_grad():
                        edit(t)
                    return
        raise InputError(f"HF's module has no {' or '.join(names)} tensor" + (f" at {path}" if path else "")
                         + " to change")
    return apply


def output(change, paths: tuple = ("",)):
    """Replace the output of the block (path "") or of its first submodule at one of `paths` by
    change(output, input); a tuple output (an MoE block returning its router logits too) changes its
    first item."""
    def hook(mod, args, out):
        if isinstance(out, tuple):
            return (change(out[0], args[0] if args else None), *out[1:])
        return change(out, args[0] if args else None)

    def apply(blocks, a):
        for block in blocks.values():
            subs = submodules(block, a)
            hooked = [subs[p] for p in paths if p in subs]
            if hooked:
                for m in hooked:
                    m.register_forward_hook(hook)
                return
        raise InputError(f"HF's block has no {' or '.join(p or 'output' for p in paths)} module")
    return apply


def _one_expert_off(blocks, a):
    """The expert with the largest router row norm (the most often routed to): every element of its
    weight matrices + 1e-3, in whatever layout HF stores them (fused [E, ...] tensors or one module
    per expert)."""
    E, H = a.num_experts, a.hidden_size
    moe, router = blocks["moe"], blocks.get("router")
    w = next((t for t in (router or moe).parameters() if t.dim() == 2 and set(t.shape) == {E, H}), None)
    if w is None:
        raise InputError("HF's router has no [experts, hidden] weight to pick the expert by")
    e = int(w.float().norm(dim=1 if w.shape[0] == E else 0).argmax())
    fused = [t for t in moe.parameters() if t.dim() == 3 and t.shape[0] == E]
    per_expert = next((m for m in moe.modules() if isinstance(m, nn.ModuleList) and len(m) == E), None)
    with torch.no_grad():
        if fused:
            for t in fused:
                t[e] += 1e-3
        elif per_expert is not None:
            for t in per_expert[e].parameters():
                if t.dim() == 2:
                    t += 1e-3
        else:
            raise InputError("HF's MoE block has neither fused [experts, ...] weights nor one module per expert")


def _gate_up_swapped(blocks, a):
    """Every routed expert's gate and up exchanged in HF's fused weights (and bias), in the layout
    the family's HF code reads (models.Family.hf_gate_up)."""
    from models import get_family

    layout = get_family(a.family).hf_gate_up
    fused = [t for n, t in blocks["moe"].named_parameters() if n in ("experts.gate_up_proj",
                                                                     "experts.gate_up_proj_bias")]
    if not fused:
        raise InputError("HF's MoE block has no fused experts.gate_up_proj")
    with torch.no_grad():
        for t in fused:
            if layout == "interleaved":  # [..., 2I]: even and odd columns
                t.copy_(torch.stack([t[..., 1::2], t[..., ::2]], dim=-1).flatten(-2))
            else:  # halves: of the rows ([E, 2I, H]) or of the last dimension ([E, H, 2I], a bias [E, 2I])
                dim = 1 if layout == "rows" and t.dim() == 3 else -1
                gate, up = t.chunk(2, dim=dim)
                t.copy_(torch.cat([up, gate], dim=dim))


FORMS = {
    # router
    "router_no_renorm": attribute(("norm_topk_prob",), lambda v, a: False),
    "routed_scaling_missing": attribute(("routed_scaling_factor",), lambda v, a: 1.0),
    "routed_scaling_twice": attribute(("routed_scaling_factor",), lambda v, a: v * v),
    "router_group_limit_ignored": lambda blocks, a: [attribute(names, lambda v, a: 1)(blocks, a)
                                                     for names in (("n_group", "num_group"), ("topk_group",))],
    "router_bias_ignored": tensor(("e_score_correction_bias", "expert_bias"), lambda t: t.zero_()),  # (LFM2's)
    "router_logit_bias_ignored": tensor(("bias",), lambda t: t.zero_()),
    # experts and the MoE block
    "expert_weights_off_1e-3": _one_expert_off,
    "expert_gate_up_swapped": _gate_up_swapped,
    "swiglu_clamp_missing": attribute(("limit",), lambda v, a: float("inf")),
    "shared_expert_summed": attribute(("shared_expert_combination_strategy",), lambda v, a: "sum"),
    "moe_bias_missing": tensor(("bias",), lambda t: t.zero_()),
    "shared_expert_missing": output(lambda out, x: torch.zeros_like(out), ("shared_expert", "shared_experts")),
    "stray_bf16_downcast": output(lambda out, x: out.to(torch.bfloat16).to(out.dtype)),
    "moe_output_norm_missing": output(lambda out, x: x, ("post_mlp_layernorm",)),
    # attention
    "qk_norm_missing": output(lambda out, x: x, ("q_norm", "k_norm", "qk_norm")),
    "post_norm_missing": output(lambda out, x: x, ("post_attention_layernorm",)),
    "attention_scale_wrong": attribute(("scaling",), lambda v, a: 1.0 / a.head_dim),
    "attention_multiplier_missing": attribute(("scaling",), lambda v, a: a.head_dim ** -0.5),
    "attention_sinks_dropped": tensor(("sinks",), lambda t: t.fill_(float("-inf"))),
    "clip_qkv_missing": attribute(("clip_qkv",), lambda v, a: float("inf")),  # (HF's clamp takes no None bound)
    "value_scale_missing": attribute(("v_scale",), lambda v, a: 1.0),
    "router_softcap_missing": attribute(("router_logit_softcapping",), lambda v, a: 0.0),
    # LFM2's short convolution: its kernel [H, 1, K] back to front; the C gate (in_proj's middle third) all ones
    "short_conv_taps_reversed": tensor(("weight",), lambda t: t.copy_(t.flip(-1)), path="conv"),
    "short_conv_gate_missing": output(lambda out, x: torch.cat([out[..., : out.shape[-1] // 3],
                                                                 torch.ones_like(out[..., : out.shape[-1] // 3]),
                                                                 out[..., 2 * out.shape[-1] // 3:]], dim=-1),
                                      ("in_proj",)),
    # layer, final norm, head
    "rmsnorm_eps_wrong": attribute(("variance_epsilon", "eps"), lambda v, a: v * 1e3, path="input_layernorm"),
    "residual_multiplier_missing": attribute(("residual_multiplier",), lambda v, a: 1.0),
    "shared_mlp_missing": output(lambda out, x: torch.zeros_like(out), ("shared_mlp",)),
    "final_norm_eps_wrong": attribute(("variance_epsilon", "eps"), lambda v, a: v * 1e3),
    "logits_cast_to_float": output(lambda out, x: out.float()),
}

_CODE = "HF computes it inside its module's forward (transformers' code) with no attribute, weight or output to change"
_MODEL = "HF computes it once for the whole model, outside the layer's modules"
# the catalogue's faults with no form on HF's modules, and why
NOT_APPLICABLE = {
    **dict.fromkeys(("router_softmax_after_topk", "router_wrong_num_experts", "router_sigmoid",
                     "router_bias_in_weights", "router_softmax_for_sigmoid", "sparsemixer_first_unmasked",
                     "expert_index_off_by_one", "expert_weights_not_applied",
                     "shared_expert_gate_no_sigmoid", "dense_layer_routed", "moe_interleave_wrong",
                     "rope_interleaved", "qk_norm_per_head_for_flat", "qk_norm_flat_for_per_head",
                     "gqa_kv_heads_tiled", "attention_gate_no_sigmoid", "mla_rope_nope_swapped",
                     "yarn_mscale_missing", "gdn_chunked_prefill_differs", "layernorm_as_rmsnorm",
                     "norm_offset_missing", "residual_missing", "moa_kv_heads_interleaved", "kv_groups_of_the_model",
                     "attention_gate_sigmoid_for_softplus", "post_norm_misplaced", "qk_norm_before_rope",
                     "moe_output_norm_before_shared"), _CODE),
    **dict.fromkeys(("rope_theta_wrong", "rotary_fraction_wrong", "rope_on_nope_layer",
                     "rope_of_the_model_on_own_layer"),
                    f"{_MODEL}: the rotary embedding (the model's rotary_emb, one for every layer)"),
    **dict.fromkeys(("kv_cache_write_off_by_one", "mla_cache_not_carried", "gdn_state_not_carried",
                     "gdn_conv_state_not_carried", "short_conv_state_not_carried"),
                    f"{_MODEL}: the cache (a DynamicCache the model's forward owns)"),
    **dict.fromkeys(("attention_not_causal", "sliding_window_off_by_one"),
                    f"{_MODEL}: the attention mask (built from the config by the model's forward)"),
    "logits_scaling_missing": f"{_MODEL}: the logits' scaling (the causal-LM head's forward)",
    # measured: every row of the faulted check raised ("expected m1 and m2 to have the same dtype")
    "moe_output_upcast": "HF's next module multiplies the float output by its bf16 weights and raises: on HF's "
                         "model the fault is a crash, not a wrong number (its form on the production model runs)",
}


def not_applicable(fault) -> str | None:
    """Why `fault` has no form on HF's modules (None: it has one)."""
    if fault.name in FORMS:
        return None
    return NOT_APPLICABLE.get(fault.name, "no form on HF's modules in exporters/torch/hf_faults.py")


def inject(fault, candidate) -> None:
    """Apply `fault` to the loaded HF candidate (exporters/hf.HFCandidate) at the block models/faults/
    expects it (fault.layer(args), fault.kind)."""
    a, i = candidate.args, fault.layer(candidate.args)
    if (i, fault.kind) not in candidate.modules:
        raise InputError(f"{fault.name}: HF's model has no {fault.kind} block at layer {i}")
    try:
        blocks = {k: candidate.modules[i, k] for k in (fault.kind, "router", "moe") if (i, k) in candidate.modules}
        FORMS[fault.name](blocks, a)
    except InputError as e:
        raise InputError(f"{fault.name}: {e}") from None
