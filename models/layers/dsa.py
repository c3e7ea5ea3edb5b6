"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): the lightning indexer that picks, for every query, the
index_topk keys its latent attention (models/layers/mla.py) attends to; the others are masked.

The indexer (HF's DeepseekV32Indexer): queries wq_b(q_resid) [index_n_heads, index_head_dim] from the MLA's
normalised q latent, one key per position LayerNorm(wk(x)) [index_head_dim]; both rotated on their first
qk_rope_head_dim dims with the MLA's frequencies, half-split (DeepSeek-V3.2, where the MLA rotates interleaved
pairs) or interleaved (GLM-5: DSA.rope_interleave); the score of key t for query s is
sum_h w[s, h] · relu(q[s, h] · k[t] · index_head_dim^-1/2), w = weights_proj(x) (fp32, HF's
_keep_in_fp32_modules) · index_n_heads^-1/2, in fp32; keys after the query masked; the top
min(index_topk, keys) keys by score chosen. Its forward returns that choice, int64 [B, T, k] (a routing
decision: a forward hook on `indexer` records it as HF's `self_attn.indexer`'s int32 one). With fewer valid keys
than k the valid ones all come first and masked ones fill the rest (as HF's topk does): harmless, the causal
mask stays.

Export-friendly: the indexer's keys are cached in a static buffer (index_key_cache [1, S, index_head_dim], like
the KV cache) carried from the prefill into decode; a choice later layers share (GLM-5's "shared" layers:
DSA.shared) is kept per position too (index_selection [1, S, k]), written at the call's positions."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.rope import Rope
from models.layers.taps import tap


def source_layer(a: ModelArgs, layer: int) -> int:
    """The layer whose indexer chooses `layer`'s keys: itself, or for a shared layer the last full one before it."""
    shared = a.attention.dsa.shared
    src = layer
    while shared and shared[src]:
        src -= 1
        if src < 0:
            raise ValueError(f"DSA: layer {layer} shares the selection of a full layer before it, and there is none")
    return src


def has_indexer(a: ModelArgs, layer: int) -> bool:
    return a.attention.dsa is not None and source_layer(a, layer) == layer


def shared_by_later(a: ModelArgs, layer: int) -> bool:
    """Does a later layer attend to the keys `layer`'s indexer chooses (a following shared layer)?"""
    return any(source_layer(a, j) == layer for j in range(layer + 1, a.num_hidden_layers))


class Indexer(nn.Module):
    """The lightning indexer: (x [B, T, H], q_resid [B, T, q_lora_rank], pos [T]) -> the chosen keys, int64
    [B, T, k] (k = min(index_topk, S))."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        d, m = a.attention.dsa, a.attention.mla
        self.nh, self.hd, self.dr = d.index_n_heads, d.index_head_dim, m.qk_rope_head_dim
        self.wq_b = nn.Linear(m.q_lora_rank, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(a.hidden_size, self.hd, bias=False)
        self.k_norm = nn.LayerNorm(self.hd, eps=d.k_norm_eps)
        self.rope_last, self.k_norm_fp32 = d.rope_last, d.k_norm_fp32  # (HY-V4's)
        self.weights_proj = nn.Linear(a.hidden_size, self.nh, bias=False)  # fp32 (models.args.kept_fp32)
        # the MLA's frequencies (and YaRN's cos/sin factor) on the first qk_rope_head_dim dims, in the indexer's order
        self.rope = Rope(self.dr, replace(a.rope, interleave=d.rope_interleave), partial=1.0)
        self.scale = self.hd**-0.5
        S = a.max_seq_len
        self.k = min(d.index_topk, S)
        self.register_buffer("index_key_cache", torch.zeros(1, S, self.hd, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)
        if shared_by_later(a, layer):
            self.register_buffer("index_selection", torch.zeros(1, S, self.k, dtype=torch.int64))

    def forward(self, x, q_resid, pos):
        B, T, _ = x.shape
        # the rotated parts are the drill's q_rope / k_rope in HF's layout ([B, T, nh, dr], [B, T, 1, dr]): HF's indexer
        # rotates with apply_rotary_pos_emb, the function the drill reads (its MLA's interleaved rotation is not read)
        q = tap("q_rope", self.rotate(self.wq_b(q_resid).view(B, T, self.nh, self.hd).transpose(1, 2), pos),
                lambda t: self.rotary(t).transpose(1, 2))  # [B, nh, T, hd]
        k = tap("k_rope", self.rotate(self.key(x)[:, None], pos)[:, 0], lambda t: self.rotary(t)[..., None, :])
        keys = self.update_cache(k, pos)  # [1, S, hd]
        scores = self.index_scores(x, q, keys)
        visible = self.cache_pos[None, :] <= pos[:, None]  # [T, S]
        chosen = self.choose(scores.masked_fill(~visible, float("-inf")))
        if hasattr(self, "index_selection"):
            self.keep_selection(chosen, pos)
        return chosen

    def keep_selection(self, chosen, pos):  # (every sequence's: a batch widens the buffer, batched_state)
        self.index_selection[:, pos] = chosen

    def selection_at(self, pos):  # [B, T, k] (an exporter's own state layout overrides these two)
        return self.index_selection[:, pos]

    def key(self, x):  # [B, T, hd]: LayerNorm(wk(x)) (HY-V4: the norm in fp32, DSA.k_norm_fp32)
        if self.k_norm_fp32:
            return self.k_norm(self.wk(x).to(self.k_norm.weight.dtype)).to(x.dtype)
        return self.k_norm(self.wk(x))

    def rotate(self, t, pos):  # the rotary part rotated: the first dr dims, or the last (HY-V4: DSA.rope_last)
        if not self.rope_last:
            return self.rope(t, pos)
        return torch.cat((t[..., : -self.dr], self.rope(t[..., -self.dr :], pos)), dim=-1)

    def rotary(self, t):  # the rotary part of a rotated q or k
        return t[..., -self.dr :] if self.rope_last else t[..., : self.dr]

    def update_cache(self, k, pos):
        self.index_key_cache[:, pos] = k
        return self.index_key_cache

    def head_weights(self, x):  # [B, T, nh] in fp32: weights_proj on x in its (fp32) dtype, times nh^-1/2
        return self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.nh**-0.5

    def index_scores(self, x, q, keys):
        """[B, T, S]: sum over heads of w[b, t, h] · relu(q[b, h, t] · keys[s] · scale), in fp32."""
        per_head = F.relu((q.float() @ keys.float().transpose(-1, -2)[:, None]) * self.scale)  # [B, nh, T, S]
        return (self.head_weights(x)[:, :, None] @ per_head.transpose(1, 2))[:, :, 0]  # [B, T, 1, nh] @ [B, T, nh, S]

    def choose(self, scores):
        return scores.topk(self.k, dim=-1).indices  # [B, T, k] int64, by score, best first


def chosen_mask(chosen, cache_pos):
    """[B, T, S] bool: True at the keys chosen ([B, T, k] indices into the cache's S positions)."""
    # (a sum, not any(): the MLX delegate's AnyNode is not run by the MLX-graph interpreter here)
    return (chosen[..., None] == cache_pos).sum(dim=-2) > 0


def shared_selection(source: Indexer, pos):
    """A shared layer's choice: its source indexer's, at the call's positions ([1, T, k])."""
    return source.selection_at(pos)


def link_sources(layers) -> None:
    """Each shared DSA layer's attention told which indexer chooses its keys (the last full layer's before it): a
    plain reference, not a submodule (the indexer's weights and state stay its own layer's)."""
    last = None
    for layer in layers:
        attn = getattr(layer, "self_attn", None)
        if not getattr(attn, "dsa", False):
            continue
        if hasattr(attn, "indexer"):
            last = attn.indexer
        else:
            object.__setattr__(attn, "source", last)
