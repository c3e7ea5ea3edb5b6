"""Port bugs of multi-head latent attention: the rope/no-rope split, the compressed cache, YaRN's
mscale, the head gate's activation."""

from __future__ import annotations

import torch

from models.faults.fault import patch
from models.layers.mla import LatentAttention


# ------------------------------------------------------------------ multi-head latent attention
def mla_rope_nope_swapped(attn: LatentAttention, a):
    """q's rotary part taken from the front of each head instead of the back."""
    patch(attn, "split_q", lambda q: tuple(reversed(torch.split(q, [attn.dr, attn.dn], dim=-1))))


def mla_cache_not_carried(attn: LatentAttention, a):
    """The compressed KV cache (latent + rotary key) starts empty at every call: attention reads
    this call's entries and zeros elsewhere. (A mask where attention reads the cache, the cache write
    left to the program: zeroing the buffers before the write, a second write of one buffer in a
    method, made ExecuTorch 1.5.1's to_edge raise `SpecViolationError: Buffer output ... does not
    point to a buffer that exists`, and a cache write of the fault's own is not the delegate's KV
    cache op, so the MLX delegate refused it: a crash or a refusal where the port's bug computes
    wrong numbers.)"""
    def attend(q, latents, rope_keys, pos, gate=None, selected=None):  # latents [B, S, r], rope_keys [B, S, dr]
        # this call's run (narrowed by torch.where: IREE 3.13 does not legalize aten.__and__ on i1)
        written = torch.where(attn.cache_pos >= pos[0], attn.cache_pos <= pos[-1], False)[None, :, None]
        return LatentAttention.attend(attn, q, latents * written.to(latents.dtype),
                                      rope_keys * written.to(rope_keys.dtype), pos, gate, selected)

    patch(attn, "attend", attend)


def yarn_mscale_missing(attn: LatentAttention, a):
    attn.scale = (attn.dn + attn.dr) ** -0.5


def q_position_scale_missing(attn: LatentAttention, a):
    """Mistral 4's position-dependent query scale (llama_4_scaling_beta) left out: every query at scale 1."""
    attn.q_position = None


def mla_head_gate_no_activation(attn: LatentAttention, a):
    """The head gate's projection applied as it is, without its activation (sigmoid): each head's context times
    g_proj(x)."""
    patch(attn, "head_gate", lambda x: attn.g_proj(x))
