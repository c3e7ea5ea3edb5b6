"""A catalogue of seeded faults in the production model: the bugs seen in real ports.

Each fault modifies one block of a built production model in place (by overriding one
small method or attribute of one module instance), so it works for every backend that
runs or exports the production model. `expected(args)` is where a correct oracle must
localise it: (layer, block kind).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models import routing
from models.args import DENSE, SLIDING, SPARSE, mlp_type
from models.layers import LINEAR, Attention, Experts, GatedDeltaNet, LatentAttention, ModelArgs, Router, Transformer


@dataclass(frozen=True)
class Fault:
    name: str
    kind: str  # the block kind the oracle must name
    # which layer: full (last softmax-attention layer: full, sliding or chunked), rope (last that rotates),
    # nope (last that does not), sliding (last sliding-window), linear (last Gated DeltaNet),
    # dense (first dense), last, model; first, first_<target> and last_sparse (a fault of a hyper-parameter
    # every layer reads shows first in the first layer it touches: exporters/llamacpp_faults.py)
    target: str
    what: str
    apply: Callable  # (module at the target, args) -> None
    applies: Callable = lambda a: True
    precision: str = "fp32"  # the precision the fault shows at (dtype faults need bf16)
    attention: tuple = ("gqa",)  # an attention fault: the attention kinds (AttentionArgs.kind) its code is for

    @functools.cached_property
    def id(self) -> str:
        """`name@digest`: what a compiled backend's cache key names this fault by. The digest covers the
        code the fault runs (its apply and applies, and the functions of their own modules they call,
        transitively: oracle-side code only) and its fields: a change to one fault rebuilds that
        fault's programs, not every faulted program (issue 52). The production code it patches is in
        every program's key already."""
        h = hashlib.sha256("\n".join(code_of(Fault.inject) + code_of(Fault.layer)).encode())
        for f in fields(self):
            v = getattr(self, f.name)
            h.update(f.name.encode() + b"=" + ("\n".join(code_of(v)) if callable(v) else repr(v)).encode() + b"\0")
        return f"{self.name}@{h.hexdigest()[:12]}"

    def layer(self, a: ModelArgs) -> int | None:
        if self.target == "model":
            return None
        if self.target == "last":
            return a.num_hidden_layers - 1
        if self.target == "first":
            return 0
        if self.target == "dense":
            return min(i for i in range(a.num_hidden_layers) if mlp_type(a, i) == DENSE)
        if self.target.startswith("first_"):  # a fault of every layer (a hyper-parameter) shows first here
            return min(_targets(a, self.target[6:]))
        if self.target == "last_sparse":
            return max(_targets(a, "sparse"))
        return max(_targets(a, self.target))

    def is_applicable(self, a: ModelArgs) -> bool:
        if self.target not in ("model", "last", "first", "dense") and not _targets(a, self.target.split("_")[-1]):
            return False
        if self.target == "dense" and DENSE not in a.mlp_types:
            return False
        if self.kind == "attention" and self.target in ("full", "rope") and a.attention.kind not in self.attention:
            return False
        return self.applies(a)

    def inject(self, model: Transformer) -> None:
        a = model.args
        i = self.layer(a)
        if i is None:
            self.apply(model, a)
        elif self.kind == "attention":
            self.apply(model.layers[i].attn, a)
        else:
            self.apply(model.layers[i], a)


def _targets(a: ModelArgs, target: str) -> list[int]:
    """The layers a target names (its fault goes to the last)."""
    rotates = a.rope.rotates
    pick = {"full": lambda i, t: t != LINEAR, "linear": lambda i, t: t == LINEAR, "sliding": lambda i, t: t == SLIDING,
            "rope": lambda i, t: t != LINEAR and rotates(i), "nope": lambda i, t: t != LINEAR and not rotates(i),
            "sparse": lambda i, t: mlp_type(a, i) == SPARSE}[target]
    return [i for i, t in enumerate(a.layer_types) if pick(i, t)]


def code_of(fn: Callable, seen: set | None = None) -> list[str]:
    """The source of `fn` and of every function of its own module it names (transitively, nested
    functions and lambdas included): the code a fault runs, for its cache digest (Fault.id)."""
    seen = set() if seen is None else seen
    fn = getattr(fn, "__func__", fn)
    if fn in seen or not inspect.isfunction(fn):
        return [] if fn in seen else [repr(fn)]
    seen.add(fn)
    try:
        out = [inspect.getsource(fn)]
    except (OSError, TypeError):  # defined at a prompt: its bytecode stands for it
        out = [fn.__code__.co_code.hex()]
    names, stack = set(), [fn.__code__]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack += [k for k in c.co_consts if isinstance(k, types.CodeType)]
    for n in sorted(names):
        v = fn.__globals__.get(n)
        if inspect.isfunction(v) and v.__module__ == fn.__module__:
            out += code_of(v, seen)
    return out


def patch(obj, name: str, fn) -> None:
    """Override one method on this instance only."""
    setattr(obj, name, fn)


# ------------------------------------------------------------------ router
def _softmax_after_topk(layer, a):
    r: Router = layer.mlp.gate
    patch(r, "route", lambda logits: (lambda v, i: (torch.softmax(v.float(), -1), i))(*torch.topk(logits, r.top_k)))


def _no_renorm(layer, a):
    layer.mlp.gate.norm_topk = False


def _wrong_num_experts(layer, a):
    r: Router = layer.mlp.gate
    if hasattr(r, "e_score_correction_bias"):  # the router's own per-expert bias sees one fewer too (it
        # crashed the model, [N, E-1] + [E], instead of routing wrongly)
        r.e_score_correction_bias = nn.Parameter(r.e_score_correction_bias.detach()[:-1].clone(), requires_grad=False)
    patch(r, "route", lambda logits: Router.route(r, logits[:, :-1]))


def _sigmoid_router(layer, a):
    r: Router = layer.mlp.gate

    def route(logits):
        w, idx = torch.topk(torch.sigmoid(logits.float()), r.top_k)
        return (w / w.sum(-1, keepdim=True) if r.norm_topk else w), idx

    patch(r, "route", route)


# ------------------------------------------------------------------ experts / moe
def _gate_up_swapped(layer, a):
    """Every routed expert's gate and up exchanged: their weight rows and biases, under the family's own
    activation, on every path (static, so it exports). Until 2026-11-26 a patched expert_mlp with SiLU
    and no bias: on gpt-oss that was also another activation, unlike the hf and mlx forms."""
    ex: Experts = layer.mlp.experts
    with torch.no_grad():
        for t in (ex.gate_up_proj, getattr(ex, "gate_up_proj_bias", None)):  # [E, 2I, H], [E, 2I]
            if t is not None:
                t.copy_(torch.cat(t.chunk(2, dim=1)[::-1], dim=1))


def _one_expert_off(layer, a):
    """One expert's weights off by 1e-3, applied to the weights (static, so it exports).
    The expert is the one with the largest router row norm: the most often routed to."""
    ex: Experts = layer.mlp.experts
    e = int(layer.mlp.gate.weight.norm(dim=1).argmax())
    with torch.no_grad():
        ex.gate_up_proj[e] += 1e-3
        ex.down_proj[e] += 1e-3


def _expert_index_off_by_one(layer, a):
    ex: Experts = layer.mlp.experts
    patch(ex, "expert_mlp", lambda x, idx, w=None: Experts.expert_mlp(ex, x, (idx + 1) % a.num_experts, w))


def _weights_not_applied(layer, a):
    ex: Experts = layer.mlp.experts
    patch(ex, "forward", lambda x, idx, w: ex.expert_mlp(x, idx).sum(dim=1).to(x.dtype))


def _shared_gate_no_sigmoid(layer, a):
    moe = layer.mlp
    patch(moe, "shared", lambda x: moe.shared_expert_gate(x) * moe.shared_expert(x))


def _shared_missing(layer, a):
    moe = layer.mlp
    patch(moe, "shared", lambda x: torch.zeros_like(x))


def _stray_bf16(layer, a):
    moe = layer.mlp
    fwd = type(moe).forward
    patch(moe, "forward", lambda x: fwd(moe, x).to(torch.bfloat16).to(x.dtype))


def _moe_output_upcast(layer, a):
    """The MoE forward casts its output to float unconditionally (right for the CUDA
    kernels' fp32 accumulators, wrong elsewhere): the block's output dtype changes."""
    moe = layer.mlp
    fwd = type(moe).forward
    patch(moe, "forward", lambda x: fwd(moe, x).float())


def _logits_to_float(model, a):
    head = model.lm_head
    fwd = type(head).forward
    patch(head, "forward", lambda x: fwd(head, x).float())


# ------------------------------------------------------------------ full attention
def _rope_theta_wrong(attn: Attention, a):
    theta = 1e4 if a.rope.theta != 1e4 else 1e6  # the classic qwen2_moe / mlx-lm default mix-up
    rd = attn.rope.rotary_dim
    attn.rope.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd)))


def _rope_interleaved(attn: Attention, a):
    rope = attn.rope

    def forward(x, pos):  # GPT-J pairs (x0, x1), (x2, x3) instead of rotate-half
        freqs = pos.float()[:, None] * rope.inv_freq[None, :]
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        rot, rest = x[..., : rope.rotary_dim], x[..., rope.rotary_dim :]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1)

    patch(rope, "forward", forward)


def _rotary_fraction_wrong(attn: Attention, a):
    rope = attn.rope
    rd = attn.hd if rope.rotary_dim < attn.hd else attn.hd // 2
    theta = a.rope.theta
    rope.rotary_dim = rd
    rope.inv_freq = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))


def _qk_norm_missing(attn: Attention, a):
    attn.qk_norm = "none"


def _qk_norm_per_head_for_flat(attn: Attention, a):
    """Normalise each head although the checkpoint's norm spans the whole projection."""
    qn, kn = attn.q_norm, attn.k_norm

    def per_head(norm, heads):
        def fwd(x):  # x [B, T, heads*hd]
            xs = x.view(*x.shape[:-1], heads, attn.hd).float()
            xs = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + norm.eps)
            return norm.weight * xs.flatten(-2).to(x.dtype)

        return fwd

    patch(qn, "forward", per_head(qn, attn.nh))
    patch(kn, "forward", per_head(kn, attn.kvh))


def _qk_norm_flat_for_per_head(attn: Attention, a):
    """Normalise the whole projection although the checkpoint's norm is per head."""
    qn, kn = attn.q_norm, attn.k_norm

    def flat(norm):
        def fwd(x):  # x [B, T, heads, hd]
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean((-2, -1), keepdim=True) + norm.eps)
            w = (1.0 + norm.weight.float()) if norm.offset else norm.weight.float()
            return (xf * w).to(x.dtype)

        return fwd

    patch(qn, "forward", flat(qn))
    patch(kn, "forward", flat(kn))


def _kv_off_by_one(attn: Attention, a):
    S = attn.k_cache.shape[2]
    patch(attn, "update_cache", lambda k, v, pos: Attention.update_cache(attn, k, v, (pos + 1) % S))


def _not_causal(attn: Attention, a):
    patch(attn, "mask", lambda pos: (attn.cache_pos <= pos.max())[None, :].expand(pos.shape[0], -1))


def _scale_wrong(attn: Attention, a):
    attn.scale = 1.0 / attn.hd


def _gqa_repeat_wrong(attn: Attention, a):
    """kv heads tiled (0, 1, 0, 1) instead of repeated (0, 0, 1, 1) to match the q heads."""
    rep = attn.nh // attn.kvh

    def attend(q, kc, vc, visible):
        B, _, T, _ = q.shape
        kc, vc = kc.repeat(1, rep, 1, 1), vc.repeat(1, rep, 1, 1)
        scores = ((q @ kc.transpose(2, 3)) * attn.scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
        return (probs @ vc).transpose(1, 2).reshape(B, T, attn.nh * attn.hd)

    patch(attn, "attend", attend)


def _output_gate_no_sigmoid(attn: Attention, a):
    def forward(x, pos):
        q, k, v, gate = attn.project(x, pos)
        kc, vc = attn.update_cache(k, v, pos)
        return attn.o_proj(attn.attend(q, kc, vc, attn.mask(pos)) * gate)

    patch(attn, "forward", forward)


# ------------------------------------------------------------------ Gated DeltaNet
def _gdn_state_not_carried(gdn: GatedDeltaNet, a):
    def delta_rule(q, k, v, g, beta):
        gdn.recurrent_state.zero_()
        return GatedDeltaNet.delta_rule(gdn, q, k, v, g, beta)

    patch(gdn, "delta_rule", delta_rule)


def _gdn_conv_state_not_carried(gdn: GatedDeltaNet, a):
    def conv(qkv):
        gdn.conv_state.zero_()
        return GatedDeltaNet.conv(gdn, qkv)

    patch(gdn, "conv", conv)


def _gdn_chunked_prefill(gdn: GatedDeltaNet, a):
    """Prefill in two chunks where the second, from token T // 2 on, starts from a zero state:
    chunked prefill that differs from one-shot prefill (decode, one token, is untouched). The
    reset is a decay of e^-60 (~1e-26) added at that token (S <- e^g S), not a branch on T nor
    slices at T // 2: a program whose one prefill method takes any length (torch.export, T dynamic)
    holds it too."""

    def delta_rule(q, k, v, g, beta):
        idx = torch.arange(g.shape[-1], device=g.device)
        # [T]: 1 at the second chunk's first token (a product, not `&`: IREE 3.13 does not legalize
        # aten.__and__ on i1)
        reset = (idx == g.shape[-1] // 2).to(g.dtype) * (idx > 0).to(g.dtype)
        return GatedDeltaNet.delta_rule(gdn, q, k, v, g - 60.0 * reset, beta)

    patch(gdn, "delta_rule", delta_rule)


# ------------------------------------------------------------------ layer / model
def _input_norm_eps(layer, a):
    layer.input_layernorm.eps = a.rms_norm_eps * 1e3


def _norm_offset_missing(layer, a):
    layer.post_attention_layernorm.offset = False


def _residual_missing(layer, a):
    patch(layer, "forward", lambda x, pos: (lambda h: h + layer.mlp(layer.post_attention_layernorm(h)))(
        layer.attn(layer.input_layernorm(x), pos)))


def _final_norm_eps(model, a):
    model.norm.eps = a.rms_norm_eps * 1e3


def _has_shared(a):
    return a.shared_expert_intermediate_size > 0


# every MoE family's mechanisms: softmax top-k routing, SwiGLU experts, GQA attention with rope and
# q/k norms, RMSNorm, KV and recurrent state, Gated DeltaNet, dtypes
COMMON: tuple[Fault, ...] = (
    Fault("router_softmax_after_topk", "router", "last", "softmax over the top-k logits instead of over all experts",
          _softmax_after_topk, lambda a: not a.router.norm_topk_prob),
    Fault("router_no_renorm", "router", "last", "missing norm_topk_prob renormalisation", _no_renorm,
          lambda a: a.router.norm_topk_prob),
    Fault("router_wrong_num_experts", "router", "last", "router sees one expert fewer than the checkpoint has",
          _wrong_num_experts, lambda a: not routing.grouped(a)),
    Fault("router_sigmoid", "router", "last", "sigmoid scoring instead of softmax", _sigmoid_router,
          lambda a: a.router.scoring == "softmax"),
    Fault("expert_gate_up_swapped", "moe", "last", "expert gate and up projections swapped", _gate_up_swapped),
    Fault("expert_weights_off_1e-3", "moe", "last", "one (used) expert's weights off by 1e-3", _one_expert_off),
    Fault("expert_index_off_by_one", "moe", "last", "expert weights gathered at index + 1", _expert_index_off_by_one),
    # (sparsemixer's weights are 1 but inside its jitter band: nothing to see there)
    Fault("expert_weights_not_applied", "moe", "last", "expert outputs summed without routing weights",
          _weights_not_applied, lambda a: a.router.scoring != "sparsemixer"),
    Fault("shared_expert_gate_no_sigmoid", "moe", "last", "shared-expert gate used without sigmoid",
          _shared_gate_no_sigmoid, lambda a: _has_shared(a) and a.shared_expert_gated),
    Fault("shared_expert_missing", "moe", "last", "shared expert dropped", _shared_missing, _has_shared),
    Fault("stray_bf16_downcast", "moe", "last", "a stray downcast to bf16 inside an fp32 program", _stray_bf16),
    Fault("rope_theta_wrong", "attention", "rope", "wrong rope theta (1e4 vs the checkpoint's)", _rope_theta_wrong,
          attention=("gqa", "mla")),
    Fault("rope_interleaved", "attention", "rope", "interleaved (GPT-J) rotation instead of rotate-half",
          _rope_interleaved, lambda a: not a.rope.interleave),
    Fault("rotary_fraction_wrong", "attention", "rope", "partial-rotary fraction wrong", _rotary_fraction_wrong),
    Fault("qk_norm_missing", "attention", "rope", "q/k RMSNorm missing", _qk_norm_missing,
          lambda a: a.attention.qk_norm != "none"),
    Fault("qk_norm_per_head_for_flat", "attention", "full", "per-head q/k norm where the family's is flat",
          _qk_norm_per_head_for_flat, lambda a: a.attention.qk_norm == "flat"),
    Fault("qk_norm_flat_for_per_head", "attention", "full", "flat q/k norm where the family's is per head",
          _qk_norm_flat_for_per_head, lambda a: a.attention.qk_norm == "head"),
    Fault("kv_cache_write_off_by_one", "attention", "full", "KV cache written one position late", _kv_off_by_one),
    Fault("attention_not_causal", "attention", "full", "attention mask not causal", _not_causal),
    Fault("attention_scale_wrong", "attention", "full", "softmax scale 1/d instead of 1/sqrt(d)", _scale_wrong),
    Fault("gqa_kv_heads_tiled", "attention", "full", "kv heads tiled instead of repeated for GQA",
          _gqa_repeat_wrong, lambda a: a.num_attention_heads != a.num_key_value_heads),
    Fault("attention_gate_no_sigmoid", "attention", "full", "attention output gate without sigmoid",
          _output_gate_no_sigmoid, lambda a: a.attention.output_gate),
    Fault("gdn_state_not_carried", "attention", "linear", "Gated DeltaNet recurrent state not carried",
          _gdn_state_not_carried),
    Fault("gdn_conv_state_not_carried", "attention", "linear", "Gated DeltaNet conv state not carried",
          _gdn_conv_state_not_carried),
    Fault("gdn_chunked_prefill_differs", "attention", "linear", "chunked prefill differs from one-shot prefill",
          _gdn_chunked_prefill),
    Fault("rmsnorm_eps_wrong", "layer", "last", "input RMSNorm eps 1000x too large", _input_norm_eps),
    Fault("norm_offset_missing", "layer", "last", "(1 + w) RMSNorm offset missing", _norm_offset_missing,
          lambda a: a.norm.offset),
    Fault("residual_missing", "layer", "last", "attention residual connection dropped", _residual_missing),
    Fault("final_norm_eps_wrong", "final_norm", "model", "final RMSNorm eps 1000x too large", _final_norm_eps),
    Fault("moe_output_upcast", "moe", "last", "an unconditional cast that changes the MoE output dtype (bf16 model)",
          _moe_output_upcast, precision="bf16"),
    Fault("logits_cast_to_float", "logits", "model", "final logits cast to float where the model's dtype is bf16",
          _logits_to_float, precision="bf16"),
)


# ------------------------------------------------------------------ DeepSeek-style routing
def _rerouted(change):
    """A fault that is the last layer's router with other routing fields: change(args) -> RouterArgs fields."""
    def apply(layer, a):
        r: Router = layer.mlp.gate
        r.args = replace(r.args, router=replace(r.args.router, **change(a)))

    return apply


def _bias_in_weights(layer, a):
    r: Router = layer.mlp.gate
    patch(r, "weights", lambda probs, idx: Router.weights(r, probs + r.e_score_correction_bias, idx))


def _dense_layer_routed(layer, a):
    """The dense layer's MLP treated as a routed one: its output scaled by routed_scaling_factor."""
    mlp = layer.mlp
    fwd = type(mlp).forward
    patch(mlp, "forward", lambda x: fwd(mlp, x) * a.router.routed_scaling_factor)


def _is_sigmoid(a):
    return a.router.scoring == "sigmoid"


def _is_scaled(a):
    return a.router.routed_scaling_factor != 1.0


# ------------------------------------------------------------------ multi-head latent attention
def _mla_rope_nope_swapped(attn: LatentAttention, a):
    """q's rotary part taken from the front of each head instead of the back."""
    patch(attn, "split_q", lambda q: tuple(reversed(torch.split(q, [attn.dr, attn.dn], dim=-1))))


def _mla_cache_not_carried(attn: LatentAttention, a):
    """The compressed KV cache (latent + rotary key) starts empty at every call: attention reads
    this call's entries and zeros elsewhere. (A mask where attention reads the cache, the cache write
    left to the program: zeroing the buffers before the write, a second write of one buffer in a
    method, made ExecuTorch 1.5.1's to_edge raise `SpecViolationError: Buffer output ... does not
    point to a buffer that exists`, and a cache write of the fault's own is not the delegate's KV
    cache op, so the MLX delegate refused it: a crash or a refusal where the port's bug computes
    wrong numbers.)"""
    def attend(q, latents, rope_keys, pos):  # latents [B, S, r], rope_keys [B, S, dr]
        # this call's run (narrowed by torch.where: IREE 3.13 does not legalize aten.__and__ on i1)
        written = torch.where(attn.cache_pos >= pos[0], attn.cache_pos <= pos[-1], False)[None, :, None]
        return LatentAttention.attend(attn, q, latents * written.to(latents.dtype),
                                      rope_keys * written.to(rope_keys.dtype), pos)

    patch(attn, "attend", attend)


def _yarn_mscale_missing(attn: LatentAttention, a):
    attn.scale = (attn.dn + attn.dr) ** -0.5


# biased routing (sigmoid scores with a correction bias, groups, routed scaling), dense layers, MLA, YaRN
BIASED_ROUTING_AND_MLA: tuple[Fault, ...] = (
    Fault("router_bias_in_weights", "router", "last", "correction bias added to the weights too (not only the choice)",
          _bias_in_weights, lambda a: a.router.correction_bias),
    Fault("router_bias_ignored", "router", "last", "correction bias left out of the expert choice",
          _rerouted(lambda a: {"correction_bias": False}), lambda a: a.router.correction_bias),
    Fault("router_group_limit_ignored", "router", "last", "group limit ignored (top-k over every expert)",
          _rerouted(lambda a: {"n_group": 1, "topk_group": 1}), routing.grouped),
    Fault("routed_scaling_missing", "router", "last", "routed_scaling_factor not applied",
          _rerouted(lambda a: {"routed_scaling_factor": 1.0}), _is_scaled),
    Fault("routed_scaling_twice", "router", "last", "routed_scaling_factor applied twice",
          _rerouted(lambda a: {"routed_scaling_factor": a.router.routed_scaling_factor ** 2}), _is_scaled),
    Fault("router_softmax_for_sigmoid", "router", "last", "softmax scores where the family's are sigmoid",
          _rerouted(lambda a: {"scoring": "softmax"}), _is_sigmoid),
    Fault("dense_layer_routed", "mlp", "dense", "a dense layer's MLP treated as routed (scaled by routed_scaling_factor)",
          _dense_layer_routed, _is_scaled),
    Fault("mla_rope_nope_swapped", "attention", "full", "MLA: q's rope and no-rope parts swapped",
          _mla_rope_nope_swapped, attention=("mla",)),
    Fault("mla_cache_not_carried", "attention", "full", "MLA: compressed KV cache not carried across calls",
          _mla_cache_not_carried, attention=("mla",)),
    Fault("yarn_mscale_missing", "attention", "full", "YaRN mscale missing from the softmax scale",
          _yarn_mscale_missing, lambda a: a.rope.kind == "yarn" and bool(a.rope.scaling.mscale_all_dim),
          attention=("mla",)),
)

# ------------------------------------------------------------------ variants: sinks, windows, clamped and
# input-scaled experts, router logit bias, sparsemixer, LayerNorm, multipliers, no-rope layers
def _sinks_dropped(attn: Attention, a):
    del attn.sinks  # a plain softmax (Attention.attend uses sinks where the module has them)


def _window_off_by_one(attn: Attention, a):
    attn.window = attn.window + 1  # q - k <= W: one key more than the checkpoint's window


def _clamp_missing(layer, a):
    layer.mlp.experts.limit = float("inf")


def _router_logit_bias_ignored(layer, a):
    del layer.mlp.gate.bias


def _second_expert_unmasked(layer, a):
    """sparsemixer's second choice taken without masking the first: the best expert twice."""
    r: Router = layer.mlp.gate

    def route(logits):
        w, idx = Router.route(r, logits)
        return torch.stack([w[:, 0]] * w.shape[1], -1), torch.stack([idx[:, 0]] * idx.shape[1], -1)

    patch(r, "route", route)


def _layernorm_as_rmsnorm(layer, a):
    norm = layer.input_layernorm
    patch(norm, "forward", lambda x: F.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps))


def _moe_layer_as_dense(layer, a):
    """A wrong MoE/dense interleave (the layer taken for a dense one): its routed experts left out,
    its shared experts' MLP all it computes."""
    moe = layer.mlp
    patch(moe, "forward", lambda x: moe.shared(x.reshape(-1, x.shape[-1])).view(x.shape))


def _residual_multiplier_missing(layer, a):
    layer.residual_multiplier = 1.0


def _attention_multiplier_missing(attn: Attention, a):
    attn.scale = attn.hd**-0.5


def _logits_scaling_missing(model, a):
    model.lm_head.logits_scaling = 1.0


def _rope_on_nope_layer(attn: Attention, a):
    attn.use_rope, attn.qk_norm = True, "none"  # rotated as the rope layers are (without their q/k norm)


def _interleave_sparse(a):
    return SPARSE in a.mlp_types and DENSE in a.mlp_types and a.shared_expert_intermediate_size > 0 \
        and not a.shared_expert_gated


# the variants: attention sinks, sliding windows, clamped SwiGLU, router logit bias, sparsemixer,
# LayerNorm, interleaved MoE layers, Granite's multipliers, NoPE layers
VARIANTS: tuple[Fault, ...] = (
    Fault("attention_sinks_dropped", "attention", "full", "attention sinks left out of the softmax",
          _sinks_dropped, lambda a: a.attention.sinks),
    Fault("sliding_window_off_by_one", "attention", "sliding", "sliding window one position too wide",
          _window_off_by_one),
    Fault("swiglu_clamp_missing", "moe", "last", "the experts' SwiGLU without its clamp", _clamp_missing,
          lambda a: a.experts.activation == "clamped_swiglu"),
    Fault("router_logit_bias_ignored", "router", "last", "the router's bias left out of its logits",
          _router_logit_bias_ignored, lambda a: a.router.logit_bias),
    Fault("sparsemixer_first_unmasked", "router", "last", "sparsemixer's second expert chosen without masking the first",
          _second_expert_unmasked, lambda a: a.router.scoring == "sparsemixer"),
    Fault("layernorm_as_rmsnorm", "layer", "last", "LayerNorm computed as RMSNorm (no mean, no bias)",
          _layernorm_as_rmsnorm, lambda a: a.norm.kind == "layer"),
    Fault("moe_interleave_wrong", "moe", "last", "an MoE layer taken for a dense one (wrong MoE/dense interleave)",
          _moe_layer_as_dense, _interleave_sparse),
    Fault("residual_multiplier_missing", "layer", "last", "residual_multiplier not applied",
          _residual_multiplier_missing, lambda a: a.multipliers.residual != 1.0),
    Fault("attention_multiplier_missing", "attention", "full", "attention_multiplier replaced by 1/sqrt(head_dim)",
          _attention_multiplier_missing, lambda a: bool(a.multipliers.attention)
          and a.multipliers.attention != a.head_dim**-0.5),
    Fault("logits_scaling_missing", "logits", "model", "logits not divided by logits_scaling",
          _logits_scaling_missing, lambda a: a.multipliers.logits_scaling != 1.0),
    Fault("rope_on_nope_layer", "attention", "nope", "rope applied on a no-rope layer", _rope_on_nope_layer),
)

CATALOGUE: tuple[Fault, ...] = COMMON + BIASED_ROUTING_AND_MLA + VARIANTS


def get(name: str) -> Fault:
    for f in CATALOGUE:
        if f.name == name:
            return f
    raise KeyError(f"unknown fault {name!r}; known: {', '.join(f.name for f in CATALOGUE)}")


def applicable(a: ModelArgs) -> list[Fault]:
    return [f for f in CATALOGUE if f.is_applicable(a)]


# The point inside its block each fault breaks (oracle/points.py): what the drill-down should name
# first (a tuple: any of these, where families differ). `output` where the fault is in the block's
# own arithmetic after its last point (a combine, a cast) or where no finer point exists (a final
# norm, the head); the first point after a residual sum for a residual fault. None: a dtype fault
# whose numbers agree (the drill compares values; the dtype gate and the block's dtype check name it).
POINTS: dict[str, str | tuple | None] = {
    # router
    "router_softmax_after_topk": "scores", "router_no_renorm": "weights", "router_wrong_num_experts": "scores",
    "router_sigmoid": "scores", "router_bias_in_weights": "weights", "router_bias_ignored": "selection",
    "router_group_limit_ignored": "selection", "routed_scaling_missing": "weights", "routed_scaling_twice": "weights",
    "router_softmax_for_sigmoid": "scores", "router_logit_bias_ignored": "logits",
    "sparsemixer_first_unmasked": "weights",
    # experts and the MoE block
    "expert_gate_up_swapped": "experts", "expert_weights_off_1e-3": "experts", "expert_index_off_by_one": "experts",
    "expert_weights_not_applied": "experts", "swiglu_clamp_missing": "experts",
    # the routed experts and their router never run: the router's logits come first where HF's router is
    # inside the block (measured: the DeepSeek-style families, ERNIE, Llama 4), else the experts' output
    "moe_interleave_wrong": ("logits", "experts"),
    "stray_bf16_downcast": "output", "shared_expert_gate_no_sigmoid": "output",
    # the shared expert never runs: its first projection, which HF computes (an always-on one: DeepSeek's
    # shared_experts); where the module is gone from the candidate, the block's output
    "shared_expert_missing": ("shared_expert.gate_proj", "shared_experts.gate_proj", "output"),
    "moe_output_upcast": None, "dense_layer_routed": "output",
    # attention
    # (MLA's rotation has no tap: the attention's context there)
    "rope_theta_wrong": ("q_rope", "context"), "rope_interleaved": "q_rope", "rotary_fraction_wrong": "q_rope",
    "yarn_mscale_missing": ("q_rope", "context"), "rope_on_nope_layer": "q_rope",
    "qk_norm_missing": "q_norm", "qk_norm_per_head_for_flat": "q_norm", "qk_norm_flat_for_per_head": "q_norm",
    "kv_cache_write_off_by_one": "context", "attention_not_causal": "context", "attention_scale_wrong": "context",
    "gqa_kv_heads_tiled": "context", "attention_gate_no_sigmoid": "context", "attention_sinks_dropped": "context",
    "sliding_window_off_by_one": "context", "attention_multiplier_missing": "context",
    "mla_rope_nope_swapped": "context", "mla_cache_not_carried": "context",
    "gdn_state_not_carried": "recurrence", "gdn_chunked_prefill_differs": "recurrence",
    "gdn_conv_state_not_carried": "conv",
    # layer, final norm, head
    "rmsnorm_eps_wrong": "input_layernorm", "norm_offset_missing": "post_attention_layernorm",
    "layernorm_as_rmsnorm": "input_layernorm", "residual_missing": "post_attention_layernorm",
    "residual_multiplier_missing": "post_attention_layernorm",
    "final_norm_eps_wrong": "output", "logits_cast_to_float": None, "logits_scaling_missing": "output",
}
