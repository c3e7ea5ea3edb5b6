"""Port bugs of softmax attention: rope (theta, pairs, rotary fraction, a no-rope layer), q/k norms,
the KV cache, the mask, the scale, grouped-query heads, the output gate, sinks, windows."""

from __future__ import annotations

import torch

from dataclasses import replace

from models.faults.fault import patch
from models.layers.attention import Attention
from models.layers.rope import Rope


# ------------------------------------------------------------------ full attention
def rope_theta_wrong(attn: Attention, a):
    theta = 1e4 if attn.rope.theta != 1e4 else 1e6  # the classic qwen2_moe / mlx-lm default mix-up
    rd = attn.rope.rotary_dim
    attn.rope.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd)))


def rope_interleaved(attn: Attention, a):
    rope = attn.rope

    def forward(x, pos):  # GPT-J pairs (x0, x1), (x2, x3) instead of rotate-half
        freqs = pos.float()[:, None] * rope.inv_freq[None, :]
        cos, sin = freqs.cos().to(x.dtype), freqs.sin().to(x.dtype)
        rot, rest = x[..., : rope.rotary_dim], x[..., rope.rotary_dim :]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
        return torch.cat((out, rest), dim=-1)

    patch(rope, "forward", forward)


def rotary_fraction_wrong(attn: Attention, a):
    rope = attn.rope
    rd = attn.hd if rope.rotary_dim < attn.hd else attn.hd // 2
    theta = rope.theta  # the layer's own
    rope.rotary_dim = rd
    rope.inv_freq = 1.0 / (theta ** (torch.arange(0, rd, 2, dtype=torch.float) / rd))


def clip_qkv_missing(attn: Attention, a):
    """DBRX's clip_qkv left out: q, k and v unclamped."""
    attn.clip = None


def moa_kv_interleaved(attn, a):
    """JetMoE's mixture of attention: the shared kv heads repeated per head (interleaved, GQA's pattern)
    where the k experts' query heads read them tiled."""
    attn.kv_repeat = "interleave"


def qk_norm_missing(attn: Attention, a):
    attn.qk_norm = "none"


def qk_norm_before_rope(attn: Attention, a):
    attn.qk_norm_after_rope = False  # the per-head norm on q/k before the rotation (the usual place)


def qk_norm_per_head_for_flat(attn: Attention, a):
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


def qk_norm_flat_for_per_head(attn: Attention, a):
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


def kv_off_by_one(attn: Attention, a):
    S = attn.k_cache.shape[2]
    patch(attn, "update_cache", lambda k, v, pos: Attention.update_cache(attn, k, v, (pos + 1) % S))


def not_causal(attn: Attention, a):
    patch(attn, "mask", lambda pos: (attn.cache_pos <= pos.max())[None, :].expand(pos.shape[0], -1))


def scale_wrong(attn: Attention, a):
    attn.scale = 1.0 / attn.hd


def gqa_repeat_wrong(attn: Attention, a):
    """kv heads tiled (0, 1, 0, 1) instead of repeated (0, 0, 1, 1) to match the q heads."""
    rep = attn.nh // attn.kvh

    def attend(q, kc, vc, visible):
        B, _, T, _ = q.shape
        kc, vc = kc.repeat(1, rep, 1, 1), vc.repeat(1, rep, 1, 1)
        scores = ((q @ kc.transpose(2, 3)) * attn.scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
        return (probs @ vc).transpose(1, 2).reshape(B, T, attn.nh * attn.vd)

    patch(attn, "attend", attend)


def output_gate_no_sigmoid(attn: Attention, a):
    def forward(x, pos):
        q, k, v, gate = attn.project(x, pos)
        kc, vc = attn.update_cache(k, v, pos)
        return attn.o_proj(attn.attend(q, kc, vc, attn.mask(pos)) * gate)

    patch(attn, "forward", forward)


# ------------------------------------------------------------------ variants: sinks, windows, clamped and
# input-scaled experts, router logit bias, sparsemixer, LayerNorm, multipliers, no-rope layers
def sinks_dropped(attn: Attention, a):
    del attn.sinks  # a plain softmax (Attention.attend uses sinks where the module has them)


def window_off_by_one(attn: Attention, a):
    attn.window = attn.window + 1  # q - k <= W: one key more than the checkpoint's window


def attention_multiplier_missing(attn: Attention, a):
    attn.scale = attn.hd**-0.5


def rope_on_nope_layer(attn: Attention, a):
    attn.use_rope, attn.qk_norm = True, "none"  # rotated as the rope layers are (without their q/k norm)


# ------------------------------------------------------------------ per-layer ropes and head counts
def rope_of_the_model(attn: Attention, a):
    """The model's rope (rope_parameters' first type, the global theta) on a layer whose own differs
    (the full layers' theta on a sliding one; a per-layer theta ignored)."""
    attn.rope = Rope(attn.hd, replace(a.rope, sliding=None, layer_theta=()))


def kv_groups_of_the_model(attn: Attention, a):
    """The q heads' kv heads from the model's head counts (num_attention_heads // num_key_value_heads
    per group) on a layer with its own: q head h reads kv head h // that, clamped to the layer's last."""
    rep = max(1, a.num_attention_heads // a.num_key_value_heads)
    index = (torch.arange(attn.nh) // rep).clamp(max=attn.kvh - 1)
    attend = attn.attend

    def wrong(q, kc, vc, visible):  # each q head's kv head repeated into its place, so attend's own repeat is 1
        kvh = attn.kvh
        attn.kvh = attn.nh
        try:
            return attend(q, kc[:, index], vc[:, index], visible)
        finally:
            attn.kvh = kvh

    patch(attn, "attend", wrong)


def gate_sigmoid_for_softplus(attn: Attention, a):
    attn.gate_act = "sigmoid"


def value_scale_missing(attn: Attention, a):
    attn.value_scale = 1.0
