"""dots3's latent attention (HF's Dots3NoteTextAttention): DeepSeek's MLA (models/layers/mla.py) per layer type —
the DSA layers ("indexed_attention": FULL here) with their lightning indexer (models/layers/dsa.py, GLM-5's interleaved
rotation), the sliding-window layers (SLIDING) with dimensions of their own (AttentionArgs.mla_sliding, their heads
ModelArgs.layer_heads, their rope RopeArgs.sliding) and no indexer; and on both:
- the normalised q latent times (hidden_size / q_lora_rank)^1/2 (the indexer reads it scaled too), the normalised kv
  latent times (hidden_size / kv_lora_rank)^1/2 (cached scaled);
- the shared rotary key RMS-normed (k_rope_only_layernorm) before its rotation;
- the low-rank norms' eps rms_norm_eps (DeepSeek's: 1e-6);
- a sigmoid gate per head from the attention's input (AttentionArgs.gate_act "sigmoid", g_proj);
- the softmax scale (qk_nope + qk_rope)^-1/2."""

from __future__ import annotations

from dataclasses import replace

import torch

from models.args import SLIDING, ModelArgs, heads
from models.layers.mla import LatentAttention
from models.layers.norms import RMSNorm


def layer_args(a: ModelArgs, layer: int) -> ModelArgs:
    """The ModelArgs one layer's attention is built from: a sliding layer's own dimensions, heads and rope, no DSA."""
    at, kind = a.attention, a.layer_types[layer]
    if kind != SLIDING:
        return a
    return replace(a, num_attention_heads=heads(a, layer)[0], rope=a.rope.of_layer(layer, kind),
                   attention=replace(at, mla=at.mla_sliding or at.mla, dsa=None))


class ScaledLatentAttention(LatentAttention):
    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        own = layer_args(a, layer)
        super().__init__(own, dtype, layer)
        m, H = own.attention.mla, a.hidden_size
        self.q_a_layernorm.eps = self.kv_a_layernorm.eps = a.rms_norm_eps
        self.k_rope_only_layernorm = RMSNorm(self.dr, a.rms_norm_eps)
        self.q_lora_scale, self.kv_lora_scale = (H / m.q_lora_rank) ** 0.5, (H / m.kv_lora_rank) ** 0.5
        self.window = a.attention.sliding_window if a.layer_types[layer] == SLIDING else None
        self.hd = self.dr  # (the rotated width, as Attention's head_dim: a fault that rebuilds the rotation reads it)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) * self.q_lora_scale
        q, latent, k_rot = self.project(x, pos, q_resid)
        latents, rope_keys = self.update_cache(latent, k_rot, pos)
        selected = self.select(x, q_resid, pos) if self.dsa else None
        return self.attend(q, latents, rope_keys, pos, self.head_gate(x) if hasattr(self, "g_proj") else None, selected)

    def project(self, x, pos, q_resid=None):
        B, T, _ = x.shape
        q_nope, q_rot = self.split_q(self.q_b_proj(q_resid).view(B, T, self.nh, self.dn + self.dr).transpose(1, 2))
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.r, self.dr], dim=-1)
        k_rot = self.k_rope_only_layernorm(k_rot)
        k_rot, q_rot = self.rope(k_rot.view(B, 1, T, self.dr), pos)[:, 0], self.rope(q_rot, pos)
        return torch.cat((q_nope, q_rot), dim=-1), self.kv_a_layernorm(latent) * self.kv_lora_scale, k_rot

    def visible(self, pos):  # a sliding layer's: the last `window` positions up to the query's
        visible = super().visible(pos)
        if self.window is None:
            return visible
        return torch.where(pos[:, None] - self.cache_pos[None, :] < self.window, visible, False)
