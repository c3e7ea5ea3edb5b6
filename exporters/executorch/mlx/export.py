"""Everything that determines an `executorch-mlx` .pte (its artifact cache key hashes this file
and models/layers/): the MLX source transformations of the production model, the export of
its methods, and the lowering to ExecuTorch's MLX delegate.

The source transformations, in the spirit of ExecuTorch's
`examples/models/qwen3_5_moe/mlx_source_transformations.py`:

- RMSNorm (plain, (1 + w), gated) -> `F.rms_norm` (MLX `fast::rms_norm`), no fp32 casts; the
  (1 + w) offset folded into the weight once
- router: softmax / top-k / renormalisation in the model's dtype (no fp32 casts)
- stacked experts -> `mlx::moe_gather_inputs` + `mlx::gather_mm` (ExecuTorch's SwitchLinear,
  gate / up / down) + `mlx::moe_scatter_outputs`, sorted by expert for prefill
- RoPE -> `mlx::rope` (base theta; explicit frequencies only when the module's differ from it)
- KV cache -> `mlx::kv_cache_update`; causal attention -> `mlx::custom_sdpa` (MLX `fast::sdpa`); every other state
  written per position (indexer caches and DSA's kept choice, ZAYA's router state) -> the same op, held as one head
- gathers the delegate does not take (Inkling's relative bias, GLM-5.3's visible pools) -> exact one-hot forms
- Gated DeltaNet -> the `mlx::gated_delta_rule` custom op, without fp32 casts, its recurrent
  state in the model's dtype (MetalKernelNode, or ScanNode with `use_custom_kernel=False`)

Each replacement overrides one method of one module instance, the same methods the seeded
faults (models/faults/) override. A method a fault has already overridden on an instance
is left alone (`swap` returns False), so a fault injected before the transformations stays in
the lowered program, computed by the production model's own torch code.

The program: `forward(tokens [1, T], pos [T]) -> logits [1, T, V]`, T dynamic in [1, S - 1], as
ExecuTorch's MLX LLM exports have it (prefill and decode are one method; the KV cache, conv and
recurrent state are the delegate's mutable buffers, carried across calls; a call at position 0
starts a new sequence). The check's program adds one method per block (`Block`).
"""

from __future__ import annotations

import logging
import os
import re
import types

import torch
import torch.nn.functional as F
from torch import nn

from exporters.shared.blocks import block_rows
from models.args import SPARSE, layer_kinds, mlp_type
from models.layers.attention import Attention
from models.layers.compressed_attention import CompressedAttention
from models.layers.compressed_kv import WindowCompressor
from models.layers.experts import Experts
from models.layers.gated_deltanet import GatedDeltaNet
from models.layers.mla import LatentAttention
from models.layers.norms import RMSNorm
from models.layers.relative_logits import RelativeAttention
from models.layers.router import Router
from models.layers.zaya_router import ZayaRouter
from models.layers.moe import SparseMoE
from models.layers.transformer import Transformer
from models.layers.taps import tap


def swap(obj, name: str, fn) -> bool:
    """Override `obj.name` with `fn` bound to `obj`, unless the instance already overrides it."""
    if name in obj.__dict__:
        return False
    setattr(obj, name, types.MethodType(fn, obj))
    return True


def start_of(pos, limit: int):
    """The first position of the call as a SymInt (what the MLX ops take), bounded for export."""
    start = pos[0].item()
    torch._check(start >= 0)
    torch._check(start + pos.shape[0] <= limit)
    return start


# ---------------------------------------------------------------- norms
def rms_norm_forward(self, x):
    return F.rms_norm(x, (x.shape[-1],), self.mlx_weight, self.eps)


def gated_rms_norm_forward(self, x, z):
    return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps) * F.silu(z)


def transform_norm(norm: RMSNorm) -> None:
    # a subclass's own forward (Qwen4-Exp's per-group norm, Muse Spark's centered norm) is not the plain RMSNorm
    if "forward" in norm.__dict__ or type(norm).forward is not RMSNorm.forward:
        return
    w = norm.weight.detach().float()
    norm.register_buffer("mlx_weight", ((1.0 + w) if norm.offset else w).to(norm.weight.dtype))
    swap(norm, "forward", rms_norm_forward)


# ---------------------------------------------------------------- router and experts
def route(self, logits):
    w, idx = torch.topk(tap("selection", tap("scores", torch.softmax(logits, dim=-1))), self.top_k, dim=-1)
    if self.norm_topk:
        w = w / w.sum(dim=-1, keepdim=True)
    return tap("weights", w), tap("topk", idx)


def transform_router(router: Router) -> None:
    if router.softmax_only:  # other routings (sigmoid, bias, groups) lower as the production model has them
        swap(router, "route", route)  # weights in the model's dtype: Router.forward's cast is a no-op


def expert_mlp(self, x, idx):  # x [N, H], idx [N, k] -> [N, k, H]
    k = idx.shape[-1]
    xs, flat, srt, inv = torch.ops.mlx.moe_gather_inputs(x, idx, k, self.sort_cutoff)
    h = F.silu(self.gate(xs, flat, sorted_indices=srt)) * self.up(xs, flat, sorted_indices=srt)
    return torch.ops.mlx.moe_scatter_outputs(self.down(h, flat, sorted_indices=srt), srt, inv, k)


def transform_experts(ex: Experts, sort_cutoff: int = 1) -> None:
    """Stacked [E, out, in] weights -> ExecuTorch's SwitchLinear ([E, in, out] for gather_mm)."""
    from executorch.backends.mlx.llm.switch import SwitchLinear

    if "expert_mlp" in ex.__dict__:
        return
    if ex.act != "swiglu" or hasattr(ex, "gate_up_proj_bias") or ex.on_input:
        return  # gpt-oss's clamped SwiGLU and biases, Llama 4's scaled input: the production model's torch code
    E, I2, H = ex.gate_up_proj.shape
    I = I2 // 2
    for name, w in (("gate", ex.gate_up_proj[:, :I]), ("up", ex.gate_up_proj[:, I:]), ("down", ex.down_proj)):
        lin = SwitchLinear(w.shape[2], w.shape[1], E).to(w.dtype)
        with torch.no_grad():
            for e in range(E):
                lin.experts[e].weight.copy_(w[e])
        lin.pack()  # [E, in, out] buffer
        setattr(ex, name, lin)
    ex.sort_cutoff = sort_cutoff  # sort tokens by expert when more than this many (prefill)
    swap(ex, "expert_mlp", expert_mlp)
    del ex.gate_up_proj, ex.down_proj


# ---------------------------------------------------------------- attention
def rope_forward(self, x, pos):  # x [B, h, T, hd]
    start = start_of(pos, self.mlx_limit)
    return torch.ops.mlx.rope(x, self.rotary_dim, start, False, self.mlx_base, 1.0, self.mlx_freqs)


def transform_rope(rope, theta: float, limit: int) -> None:
    rd = rope.rotary_dim
    standard = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))
    rope.mlx_limit, rope.mlx_base, rope.mlx_freqs = limit, float(theta), None
    if not torch.equal(rope.inv_freq, standard):  # a module with other frequencies than theta's
        rope.mlx_freqs = 1.0 / rope.inv_freq.detach()
    swap(rope, "forward", rope_forward)


def update_cache(self, k, v, pos):
    start = start_of(pos, self.k_cache.shape[2])
    torch.ops.mlx.kv_cache_update(self.k_cache, k, start)
    torch.ops.mlx.kv_cache_update(self.v_cache, v, start)
    return self.k_cache[:, :, :, :], self.v_cache[:, :, :, :]


def update_cache_off_by_one(self, k, v, pos):
    """The seeded fault kv_cache_write_off_by_one in this program's own KV cache op: written one
    position late, wrapping at the cache end (the fault's torch form, index_put on the cache
    buffer, is not something the MLX delegate lowers)."""
    start, S = start_of(pos, self.k_cache.shape[2]), self.k_cache.shape[2]
    torch.ops.mlx.kv_cache_update(self.k_cache, k, start + 1, S)
    torch.ops.mlx.kv_cache_update(self.v_cache, v, start + 1, S)
    return self.k_cache[:, :, :, :], self.v_cache[:, :, :, :]


def mask_positions(self, pos):
    """The MLX attention takes the causal mask as the call's positions (see `attend`)."""
    return pos


def attend(self, q, kc, vc, pos):  # pos: what `mask_positions` returned
    B, _, T, _ = q.shape
    start = start_of(pos, kc.shape[2])
    y = torch.ops.mlx.custom_sdpa(q, kc, vc, start, None, 0.0, True, self.scale)  # [B, nh, T, vd]
    return y.transpose(1, 2).reshape(B, T, self.nh * vc.shape[-1])  # (the values' width: MiMo-V2-Flash's v_head_dim)


def transform_attention(attn: Attention, theta: float) -> None:
    S = attn.k_cache.shape[2]
    transform_indexer(getattr(attn, "indexer", None))  # (Qwen4-Exp's QSA)
    # mlx's rope op: rotate-half with plain frequencies (interleaved pairs, YaRN's cos/sin factor
    # or LongRoPE's scale stay the production model's torch code)
    rope = attn.rope  # (and Gemma 4's proportional RoPE, whose unrotated slots have frequency 0)
    if ("forward" not in rope.__dict__ and not rope.interleave and rope.factor == 1.0 and rope.longrope is None
            and bool((rope.inv_freq > 0).all())):
        transform_rope(rope, theta, S)
    swap(attn, "update_cache", update_cache)
    # the causal mask and the attention together, or neither (a fault in one keeps both in torch);
    # mlx's causal sdpa has no window, chunk or sink. Values narrower than the heads (MiMo-V2-Flash's v_head_dim)
    # stay torch too: the op's fake kernel (executorch 1.5.1, backends/mlx/custom_ops.py) gives its output the
    # query's shape, so the export fails ("shape '[1, T, nh * vd]' is invalid for input of size nh * hd * T")
    plain = attn.window is None and attn.chunk is None and not hasattr(attn, "sinks") and attn.vd == attn.hd
    # and the attention's own forward: a subclass's narrows the causal mask (the keys a sparse attention's indexer
    # kept: MiniMax-M3's block-sparse, Qwen4-Exp's QSA) or reads it as a bool (Doge's dynamic mask), which the causal
    # sdpa would drop or break
    plain = plain and type(attn).forward is Attention.forward
    if plain and "mask" not in attn.__dict__ and "attend" not in attn.__dict__:
        swap(attn, "mask", mask_positions)
        swap(attn, "attend", attend)


def update_latent_cache(self, latent, k_rot, pos):
    """MLA's cache write in the MLX delegate's KV cache op: the latent [B, T, r] and the shared
    rotary key [B, T, dr] go into caches held as one head ([B, 1, S, r], [B, 1, S, dr]; the torch
    form, index_put on [B, S, r], is not something the delegate lowers: deepseek_v2/v3 were refused
    before, naming aten::index_put and aten::copy_)."""
    start = start_of(pos, self.latent_cache.shape[2])
    torch.ops.mlx.kv_cache_update(self.latent_cache, latent[:, None], start)
    torch.ops.mlx.kv_cache_update(self.rope_key_cache, k_rot[:, None], start)
    return self.latent_cache[:, 0], self.rope_key_cache[:, 0]


def update_index_cache(self, k, pos):
    """DeepSeek sparse attention's indexer key cache write (models/layers/dsa.py) in the delegate's KV cache op, the
    keys [B, T, d] into a cache held as one head [B, 1, S, d] (as MLA's latent cache: index_put is not lowered)."""
    start = start_of(pos, self.index_key_cache.shape[2])
    torch.ops.mlx.kv_cache_update(self.index_key_cache, k[:, None], start)
    return self.index_key_cache[:, 0]


def keep_selection(self, chosen, pos):  # DSA's choice [B, T, k] kept for a shared layer, in the cache op
    torch.ops.mlx.kv_cache_update(self.index_selection, chosen[:, None], start_of(pos, self.index_selection.shape[2]))


def selection_at(self, pos):  # [B, T, k] from the selection held as one head [B, 1, S, k]
    return self.index_selection[:, 0][:, pos]


def update_gate_cache(self, g, pos):  # GLM-5.3's pool gate logits [B, T, d] into a cache held as one head
    torch.ops.mlx.kv_cache_update(self.index_gate_cache, g[:, None], start_of(pos, self.index_gate_cache.shape[2]))
    return self.index_gate_cache[:, 0]


def pick_visible(self, visible, pools):  # visible [T, P] at pools [B, T, k], without a gather (exact)
    hit = pools[..., None] == torch.arange(visible.shape[-1])  # [B, T, k, P]
    return torch.where(hit, visible[None, :, None, :], False).sum(dim=-1) > 0


def as_head(module, name: str) -> None:
    """A state buffer [B, S, d] held as one head [B, 1, S, d] (mlx::kv_cache_update's layout)."""
    setattr(module, name, getattr(module, name)[:, None].clone())


def transform_indexer(ix) -> None:
    """An indexer's key cache [1, S, d] with update_cache(key, pos) (DeepSeek's DSA, Qwen4-Exp's QSA, MiniMax-M3's
    block indexer), DSA's kept choice and GLM-5.3's pool gates -> the delegate's KV cache op; GLM-5.3's gather of
    the visible pools -> comparisons and a sum."""
    if not torch.is_tensor(getattr(ix, "index_key_cache", None)):
        return  # (another indexer, Doge's dynamic mask, has no key cache)
    # (a seeded fault's own method: kept as it is)
    for buf, methods in (("index_key_cache", {"update_cache": update_index_cache}),
                         ("index_selection", {"keep_selection": keep_selection, "selection_at": selection_at}),
                         ("index_gate_cache", {"update_gate_cache": update_gate_cache})):
        if torch.is_tensor(getattr(ix, buf, None)) and all(hasattr(ix, m) and m not in ix.__dict__ for m in methods):
            as_head(ix, buf)
            for m, fn in methods.items():
                swap(ix, m, fn)
    if hasattr(ix, "pick_visible"):
        swap(ix, "pick_visible", pick_visible)


def transform_latent_attention(attn: LatentAttention) -> None:
    transform_indexer(getattr(attn, "indexer", None))
    if "update_cache" in attn.__dict__:  # a seeded fault's own cache write: kept as it is
        return
    for name in ("latent_cache", "rope_key_cache"):
        as_head(attn, name)
    swap(attn, "update_cache", update_latent_cache)


# ---------------------------------------------------------------- Inkling's relative attention, ZAYA's router state
def pick_one_hot(self, rel, index):  # rel [B, nh, T, E] at index [B, nh, T, S]: a one-hot matmul (exact: one term)
    one_hot = (index[..., None] == torch.arange(rel.shape[-1])).to(rel.dtype)  # [B, nh, T, S, E]
    return (one_hot @ rel[..., None])[..., 0]


def transform_relative_attention(attn: RelativeAttention) -> None:
    """The KV cache write in the delegate's KV cache op, the relative bias's gather (the delegate takes none) as a
    one-hot matmul."""
    swap(attn, "update_cache", update_cache)
    swap(attn.rel_logits_proj, "pick", pick_one_hot)


def read_router_state(self, pos):  # the state held as one head [B, 1, S, R] -> [B, T, R]
    return self.router_state[:, 0][:, pos]


def write_router_state(self, new, pos):  # new [B, T, R]
    torch.ops.mlx.kv_cache_update(self.router_state, new[:, None], start_of(pos, self.router_state.shape[2]))


def transform_zaya_router(router: ZayaRouter) -> None:
    """ZAYA's cross-layer router state [B, S, R] written in the delegate's KV cache op (index_put is not lowered)."""
    if "read_state" in router.__dict__ or "write_state" in router.__dict__:
        return
    as_head(router, "router_state")
    swap(router, "read_state", read_router_state)
    swap(router, "write_state", write_router_state)


# ---------------------------------------------------------------- DeepSeek-V4's compressed attention
def update_compressed_cache(self, kv, pos):  # the sliding keys [B, T, hd] into a cache held as one head
    torch.ops.mlx.kv_cache_update(self.k_cache, kv[:, None], start_of(pos, self.k_cache.shape[2]))
    return self.k_cache[:, 0]


def update_windows(self, x, pos):  # a compressor's per-position kv and gate [B, T, width], each as one head
    start = start_of(pos, self.compress_kv.shape[2])
    torch.ops.mlx.kv_cache_update(self.compress_kv, self.kv_proj(x)[:, None], start)
    torch.ops.mlx.kv_cache_update(self.compress_gate, self.gate_proj(x)[:, None], start)
    return self.compress_kv[:, 0], self.compress_gate[:, 0]


def transform_compressed(m) -> None:
    """DeepSeek-V4's sliding key cache and its compressors' series ([B, S, d], index_put) in mlx::kv_cache_update."""
    if isinstance(m, CompressedAttention) and "update_cache" not in m.__dict__:
        as_head(m, "k_cache")
        swap(m, "update_cache", update_compressed_cache)
    elif isinstance(m, WindowCompressor) and "update" not in m.__dict__:
        as_head(m, "compress_kv")
        as_head(m, "compress_gate")
        swap(m, "update", update_windows)


# seeded faults (models/faults/) whose torch code the MLX delegate cannot lower, in this
# program's own ops: fault name -> apply(module at the fault's target, args)
MLX_FAULTS = {"kv_cache_write_off_by_one": lambda attn, a: swap(attn, "update_cache", update_cache_off_by_one)}
# and those it cannot express at all, with the reason (none now: gdn_chunked_prefill_differs's
# branch on the call's length, which torch.export refused with T dynamic, is a decay reset since 2026-11-26)
NOT_EXPRESSIBLE: dict[str, str] = {}


# ---------------------------------------------------------------- Gated DeltaNet
def gdn_forward(self, x, pos):  # x [B, T, H], pos [T]
    B, T, _ = x.shape
    self.reset_at_start(pos)
    z = self.in_proj_z(x).view(B, T, self.nv, self.dv)
    b, a = self.in_proj_b(x), self.in_proj_a(x)  # [B, T, nv]
    conv = self.conv(self.in_proj_qkv(x).transpose(1, 2)).transpose(1, 2)  # [B, T, C]
    q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    # l2norm(x, eps) = rms_norm(x, eps / dk) / sqrt(dk); q also carries the dk^-1/2 attention scale
    # (the scales as tensors of the model's dtype: a Python float becomes an fp32 constant and a cast)
    scale = torch.tensor(self.dk**-0.5, dtype=x.dtype)
    tap("conv", conv)  # the drill's points (oracle/drill/points.py), in the production model's layout
    hf = lambda u: (u * self.dk**-0.5).repeat_interleave(self.nv // self.nk, dim=2)  # noqa: E731  (l2norm, heads as v's)
    q = tap("q_l2norm", F.rms_norm(q.reshape(B, T, self.nk, self.dk), (self.dk,), None, 1e-6 / self.dk), hf) * (scale * scale)
    k = tap("k_l2norm", F.rms_norm(k.reshape(B, T, self.nk, self.dk), (self.dk,), None, 1e-6 / self.dk), hf) * scale
    beta = tap("beta", torch.sigmoid(b))
    ab = a + self.dt_bias
    g = tap("g", -torch.exp(self.A_log) * torch.logaddexp(ab, torch.zeros_like(ab)))  # log decay (softplus)
    o = tap("recurrence", self.delta_rule(q, k, v.reshape(B, T, self.nv, self.dv), g, beta))  # [B, T, nv, dv]
    o = self.norm(o.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(B, T, self.value_dim)
    return self.out_proj(o)


def reset_at_start(self, pos):
    keep = (pos[0] != 0).to(self.conv_state.dtype)  # a call at position 0 starts a new sequence
    self.conv_state.mul_(keep)
    self.recurrent_state.mul_(keep)


def delta_rule(self, q, k, v, g, beta):
    """q, k [B, T, nk, dk], v [B, T, nv, dv], g (log decay), beta [B, T, nv] -> [B, T, nv, dv]."""
    return torch.ops.mlx.gated_delta_rule(q, k, v, torch.exp(g), beta, self.recurrent_state, self.use_custom_kernel)


def delta_rule_torch_layout(self, q, k, v, g, beta):
    """The production model's own delta_rule (overridden by a fault): its layout, fp32 and state."""
    t = lambda u: u.transpose(1, 2).float()  # noqa: E731
    rep = self.nv // self.nk
    q, k = (u.repeat_interleave(rep, dim=2) if rep > 1 else u for u in (q, k))
    return self.mlx_torch_delta_rule(t(q), t(k), t(v), t(g), t(beta)).transpose(1, 2).to(v.dtype)


def transform_gdn(gdn: GatedDeltaNet, dtype, use_custom_kernel: bool) -> None:
    """The recurrent state moves to the model's dtype and to the op's layout [B, nv, dv, dk]."""
    if "forward" in gdn.__dict__:
        return
    gdn.use_custom_kernel = use_custom_kernel
    if "delta_rule" in gdn.__dict__:  # a fault: its own delta rule, on the production state
        gdn.mlx_torch_delta_rule = gdn.delta_rule
        del gdn.delta_rule
        swap(gdn, "delta_rule", delta_rule_torch_layout)
    else:
        state = gdn.recurrent_state.transpose(-1, -2).contiguous().to(dtype)
        del gdn.recurrent_state
        gdn.register_buffer("recurrent_state", state)
        swap(gdn, "delta_rule", delta_rule)
        swap(gdn, "reset_at_start", reset_at_start)
    swap(gdn, "forward", gdn_forward)
    swap(gdn.norm, "forward", gated_rms_norm_forward)


# ---------------------------------------------------------------- the model
def mlx_source_transformations(model: Transformer, use_custom_kernel: bool = True) -> Transformer:
    """Apply every transformation the model has modules for (in place); returns the model."""
    import executorch.backends.mlx.custom_kernel_ops.gated_delta_rule  # noqa: F401  registers the op
    import executorch.backends.mlx.custom_ops  # noqa: F401  registers mlx::rope, gather_mm, ...

    dtype = model.embed_tokens.weight.dtype
    for m in list(model.modules()):
        if isinstance(m, RMSNorm):
            transform_norm(m)
        elif isinstance(m, Router):
            transform_router(m)
        elif isinstance(m, Experts):
            transform_experts(m)
        elif isinstance(m, Attention):
            transform_attention(m, model.args.rope.theta)
        elif isinstance(m, LatentAttention):
            transform_latent_attention(m)
        elif isinstance(m, GatedDeltaNet):
            transform_gdn(m, dtype, use_custom_kernel)
        elif isinstance(m, RelativeAttention):
            transform_relative_attention(m)
        elif isinstance(m, ZayaRouter):
            transform_zaya_router(m)
        elif isinstance(m, (CompressedAttention, WindowCompressor)):
            transform_compressed(m)
    return model


# ---------------------------------------------------------------- the program
class Block(nn.Module):
    """One block of the model as a method: x [1, T, H] (+ pos [T]) -> its output."""

    def __init__(self, name: str, module: nn.Module, kind: str):
        super().__init__()
        # the module under the method's name: the delegate keys its constants by a hash of the
        # graph and their names, and the graphs of two layers' blocks are otherwise the same
        self.add_module(name, module)
        self.name, self.kind = name, kind

    def forward(self, x, pos=None):
        block = getattr(self, self.name)
        if self.kind in ("attention", "layer"):
            return block(x, pos)
        if self.kind == "moe":  # the MoE block and its router: (moe [1, T, H], weights [T, k], indices [T, k])
            w, idx = block.gate(x.reshape(-1, x.shape[-1]))
            return block(x), w, idx
        return block(x)


class RoutesForward(nn.Module):
    """The model's forward with the experts each sparse layer's router selects and their weights as more
    outputs (routing replay, oracle/verdict/replay.py): (tokens, pos) -> (logits, then indices [T, k] and weights
    [T, k] per sparse layer, in layer order; the weights show a decision that sets them, sparsemixer's masks).
    A method of the check's program with its own state, run beside `forward` on the same tokens."""

    def __init__(self, model: Transformer):
        super().__init__()
        self.model = model
        self.chosen: list = []
        for layer in model.layers:
            if isinstance(getattr(layer, "mlp", None), SparseMoE):
                layer.mlp.gate.register_forward_hook(lambda m, a, out: self.chosen.extend((out[1], out[0])))

    def forward(self, tokens, pos):
        self.chosen.clear()
        logits = self.model(tokens, pos)
        return (logits, *self.chosen)


def export_methods(model: Transformer, check: bool, sampling: bool = False) -> dict:
    """torch.export (strict) of `forward`, and for the check's program of every block; with
    `sampling` also `sample_forward` (the model with the sampler fused, models/layers/sampling.py:
    its own state) and `sample_logits` (the head alone)."""
    from torch.export import Dim, export

    from models.layers.sampling import Sampler, SampledModel, example_args

    a = model.args
    S, dtype = a.max_seq_len, model.embed_tokens.weight.dtype
    T = Dim("T", min=1, max=S - 1)
    pos = torch.arange(2)
    with torch.no_grad():
        out = {"forward": export(model, (torch.zeros(1, 2, dtype=torch.long), pos),
                                 dynamic_shapes=({1: T}, {0: T}), strict=True)}
        if check:
            blocks = [Block("final_norm", model.norm, "final_norm"), Block("logits", model.lm_head, "logits")]
            for i, layer in enumerate(model.layers):
                kinds = layer_kinds(a, i)  # (Nemotron-H's layers: a mixer or an MLP alone)
                mlp = "moe" if mlp_type(a, i) == SPARSE else "mlp"  # the moe method also gives the router's outputs
                blocks += ([Block(f"attention_{i}", layer.attn, "attention")] if "attention" in kinds else []) + (
                    [Block(f"{mlp}_{i}", layer.mlp, mlp)] if mlp in kinds else []) + [Block(f"layer_{i}", layer, "layer")]
            for b in blocks:
                stateful = b.kind in ("attention", "layer")
                rows, width = block_rows(a, b.kind)  # (a layer on N residual streams: N rows a position, or N*H wide)
                xb, n = torch.zeros(1, 2 * rows, width, dtype=dtype), T if rows == 1 else rows * T
                out[b.name] = export(b, (xb, pos) if stateful else (xb,),
                                     dynamic_shapes=({1: n}, {0: T}) if stateful else ({1: n},), strict=True)
            if any(isinstance(getattr(layer, "mlp", None), SparseMoE) for layer in model.layers):
                out["routes"] = export(RoutesForward(model), (torch.zeros(1, 2, dtype=torch.long), pos),
                                       dynamic_shapes=({1: T}, {0: T}), strict=True)
        if sampling:
            tokens = torch.zeros(1, 2, dtype=torch.long)
            out["sample_forward"] = export(SampledModel(model), (tokens, pos, *example_args()),
                                           dynamic_shapes=({1: T}, {0: T}, None, None, None), strict=True)
            out["sample_logits"] = export(Sampler(), (torch.zeros(1, a.vocab_size, dtype=dtype), *example_args()),
                                          strict=True)
    return out


def export_points(model: Transformer, layer, kind: str) -> tuple[dict, dict]:
    """The drill's method of block (layer, kind) (oracle/drill/points.py): the block as the check's block
    methods have it (its state as the method's buffers, T dynamic) with its points as more outputs
    (eager.PointsCall), strict as they are (ExecuTorch's to_edge refuses a non-strict export's buffer
    mutations), the recorder set up outside the trace. ({"points":
    the export}, {"fired": the points in output order, "registered": the block's submodule paths})."""
    from torch.export import Dim, export

    from exporters.torch.candidate import PointsCall
    from models.layers.transformer import block_fn, reset_state

    a, dtype = model.args, model.embed_tokens.weight.dtype
    call = PointsCall(*block_fn(model, layer, kind), kind)
    rows, width = block_rows(a, kind)  # (a layer on N residual streams: N rows a position, or N*H wide)
    x, pos = torch.zeros(1, 2 * rows, width, dtype=dtype), torch.arange(2)
    T = Dim("T", min=1, max=a.max_seq_len - 1)
    with torch.no_grad():
        call(x, pos)  # eagerly, for the names (the export runs a copy of the module) ...
        reset_state(call.m)  # ... its state written back to zeros: the program's initial state
        with call.recording():
            ep = export(call, (x, pos), dynamic_shapes=({1: T if rows == 1 else rows * T}, {0: T}), strict=True)
    return {"points": ep}, {"fired": list(call.fired), "registered": list(call.registered)}


def metadata(a) -> dict:
    """Constant methods (for ModelArgs `a`), as ExecuTorch's MLX LLM exports carry them for their runners."""
    return {"get_max_seq_len": a.max_seq_len, "get_vocab_size": a.vocab_size, "get_n_layers": a.num_hidden_layers,
            "get_max_prefill_chunk": a.max_seq_len - 1, "use_kv_cache": True, "use_sdpa_with_kv_cache": False,
            "enable_dynamic_shape": True, "use_sampling": False}


def _unsupported_only(record) -> bool:
    """The MLX partitioner logs an op-support summary at INFO for every method: keep its
    `[UNSUPPORTED xN] op` lines and warnings, drop the banners (ET_MLX_DEBUG=1 shows all)."""
    return record.levelno > logging.INFO or "[UNSUPPORTED" in record.getMessage() or bool(os.environ.get("ET_MLX_DEBUG"))


class Unsupported(logging.Filter):
    """Records the ops the MLX partitioner reports it does not take (`[UNSUPPORTED xN] <EdgeOpOverload: ns.op.overload>`)
    as ExecuTorch names operators (`ns::op`), while it is a filter of the delegate's logger."""

    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def filter(self, record) -> bool:
        m = re.search(r"\[UNSUPPORTED x\d+\] (?:<EdgeOpOverload: )?(\w+)\.(\w+)", record.getMessage())
        if m:
            self.ops.add(f"{m.group(1)}::{m.group(2)}")
        return True


def lower(methods: dict, constant_methods: dict | None = None):
    """MLX partitioner with the delegate's default passes, as ExecuTorch's MLX LLM exports lower; each method
    once per process (exporters.executorch.lower.lowered_methods: a seeded fault's program takes the block methods
    it leaves from the clean program's lowering)."""
    from executorch.backends.mlx import MLXPartitioner
    from executorch.backends.mlx._logging import logger
    from executorch.backends.mlx.passes import get_default_passes
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    from exporters.executorch.lower import edge_manager, lowered_methods

    if _unsupported_only not in logger.filters:
        logger.addFilter(_unsupported_only)

    from torch._export.verifier import SpecViolationError

    from exporters.executorch.mlx.interpreter import NotDelegated

    seen = Unsupported()
    logger.addFilter(seen)
    try:
        programs = lowered_methods(methods, "mlx", lambda todo: to_edge_transform_and_lower(
            todo, transform_passes=get_default_passes(), partitioner=[MLXPartitioner()],
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True)))
    except SpecViolationError as e:
        # ExecuTorch 1.5.1's to_backend fails its own verifier where a method is delegated in part and the delegate
        # writes state buffers ("Buffer output ... does not point to a buffer that exists"): the ops left outside
        # are what the delegate lacks, what the interpreter would name (interpreter.Method) had it lowered
        if not seen.ops:
            raise
        raise NotDelegated(f"the MLX delegate did not take {', '.join(sorted(seen.ops))} (ExecuTorch's to_backend "
                           f"then fails on the state the delegate writes: {str(e).splitlines()[0]})") from None
    finally:
        logger.removeFilter(seen)
    return edge_manager(programs, constant_methods).to_executorch(ExecutorchBackendConfig(
        extract_delegate_segments=True, memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False)))
