"""DeepSeek's multi-head latent attention: the compressed latent and the shared rotary key
cached, queries through an optional low-rank projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs, has_sinks
from models.layers.dsa import Indexer, chosen_mask, has_indexer, shared_selection
from models.layers.dsa_pool import PooledIndexer
from models.layers.norms import RMSNorm
from models.layers.rope import Rope, yarn_mscale


class LatentAttention(nn.Module):
    """DeepSeek's multi-head latent attention (MLA). Per position the cache holds the
    normalised kv latent [kv_lora_rank] and one rotary key shared by every head [qk_rope]
    (latent_cache [B, S, r], rope_key_cache [B, S, dr]); keys and values are expanded from the
    latent by kv_b_proj at every call. q.k runs over qk_nope + qk_rope dims per head; the
    values have v_head_dim. The low-rank norms use eps MLA.norm_eps (HF's 1e-6; GLM-5.3's rms_norm_eps). A layer
    that does not rotate (RopeArgs.per_layer: Kimi-Linear's NoPE MLA; GLM-5.3's has no qk_rope dims) keeps the qk_rope dims of q and of the shared key unrotated. A head
    gate (AttentionArgs.gate_act, gate_width "head": Bailing-hybrid's g_proj) scales each head's output by the
    activation (fp32, then the model's dtype) of its own projection of the attention's input, before o_proj.
    DeepSeek sparse attention (AttentionArgs.dsa, models/layers/dsa.py): each query attends only to the keys its
    layer's `indexer` chooses (or, a shared layer, the previous full layer's: `source`, linked by the model); GLM-5.3's
    indexer chooses pools of keys (DSA.kpool: models/layers/dsa_pool.py)."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__()
        m, bias = a.attention.mla, a.attention.qkv_bias
        self.nh, self.r = a.num_attention_heads, m.kv_lora_rank
        self.dn, self.dr, self.dv = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        qk = self.dn + self.dr
        if m.q_lora_rank:
            self.q_a_proj = nn.Linear(a.hidden_size, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.norm_eps)
            self.q_b_proj = nn.Linear(m.q_lora_rank, self.nh * qk, bias=False)
        else:
            self.q_proj = nn.Linear(a.hidden_size, self.nh * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(a.hidden_size, self.r + self.dr, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.r, m.norm_eps)
        self.kv_b_proj = nn.Linear(self.r, self.nh * (self.dn + self.dv), bias=False)
        self.o_proj = nn.Linear(self.nh * self.dv, a.hidden_size, bias=a.attention.o_bias)
        if a.attention.gate_act != "none":  # one gate per head (or per value channel: HY-V4) from the attention's input
            self.gate_act = a.attention.gate_act
            self.g_proj = nn.Linear(a.hidden_size, self.nh * (self.dv if a.attention.gate_width == "element" else 1),
                                    bias=False)
        if has_sinks(a, layer):  # a learned logit per head in the softmax, its probability dropped (HY-V4)
            self.sinks = nn.Parameter(torch.zeros(self.nh))
        self.rope = Rope(self.dr, a.rope, partial=1.0)
        self.use_rope = a.rope.rotates(layer)
        self.scale = qk**-0.5
        at = a.attention  # Mistral 4's query scale by position (beta, period); None: none
        self.q_position = (at.q_position_beta, at.q_position_period) if at.q_position_beta else None
        y = a.rope.scaling
        if a.rope.kind == "yarn" and y.mscale_all_dim:  # the softmax scale times mscale^2 (HF yarn_apply_mscale)
            self.scale = self.scale * yarn_mscale(y.factor, y.mscale_all_dim) ** 2
        S = a.max_seq_len
        self.register_buffer("latent_cache", torch.zeros(1, S, self.r, dtype=dtype))
        self.register_buffer("rope_key_cache", torch.zeros(1, S, self.dr, dtype=dtype))
        self.register_buffer("cache_pos", torch.arange(S), persistent=False)
        self.dsa = a.attention.dsa is not None
        if has_indexer(a, layer):
            self.indexer = (PooledIndexer if a.attention.dsa.kpool else Indexer)(a, dtype, layer)
        self.source = None  # a shared DSA layer's: the indexer whose choice it reads (set by link_sources)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q_resid = self.q_a_layernorm(self.q_a_proj(x)) if hasattr(self, "q_b_proj") else None
        q, latent, k_rot = self.project(x, pos, q_resid)
        latents, rope_keys = self.update_cache(latent, k_rot, pos)
        selected = self.select(x, q_resid, pos) if self.dsa else None
        return self.attend(q, latents, rope_keys, pos, self.head_gate(x) if hasattr(self, "g_proj") else None, selected)

    def select(self, x, q_resid, pos):  # [B, T, S] bool: the keys DSA's indexer chose for each query
        chosen = self.indexer(x, q_resid, pos) if hasattr(self, "indexer") else shared_selection(self.source, pos)
        return chosen_mask(chosen, self.cache_pos)

    def head_gate(self, x):  # [B, T, nh]: the activation of g_proj(x) in fp32, in x's dtype (HF's)
        g = self.g_proj(x).float()
        return (F.softplus(g) if self.gate_act == "softplus" else torch.sigmoid(g)).to(x.dtype)  # (or [B, T, nh*dv])

    def project(self, x, pos, q_resid=None):
        """q [B, nh, T, dn + dr] (its rotary part rotated), the normalised latent [B, T, r] and
        the rotated shared key [B, T, dr]. q_resid: q_a_layernorm(q_a_proj(x)) where the caller has it."""
        B, T, _ = x.shape
        if hasattr(self, "q_b_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)) if q_resid is None else q_resid)
        else:
            q = self.q_proj(x)
        q_nope, q_rot = self.split_q(q.view(B, T, self.nh, self.dn + self.dr).transpose(1, 2))
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.r, self.dr], dim=-1)
        if self.use_rope:
            k_rot, q_rot = self.rope(k_rot.view(B, 1, T, self.dr), pos)[:, 0], self.rope(q_rot, pos)
        q = torch.cat((q_nope, q_rot), dim=-1)
        if self.q_position is not None:  # 1 + beta * log(1 + floor(pos / period)) [T], every head and dim
            beta, period = self.q_position
            q = q * (1.0 + beta * torch.log1p(torch.floor(pos.float() / period)))[:, None].to(q.dtype)
        return q, self.kv_a_layernorm(latent), k_rot

    def split_q(self, q):  # [..., dn + dr] -> the no-rope part, the rotary part
        return torch.split(q, [self.dn, self.dr], dim=-1)

    def update_cache(self, latent, k_rot, pos):
        self.latent_cache[:, pos] = latent
        if self.dr:  # (GLM-5.3's NoPE latent attention has no rotary dims: IREE refuses a zero-width scatter)
            self.rope_key_cache[:, pos] = k_rot
        return self.latent_cache, self.rope_key_cache

    def attend(self, q, latents, rope_keys, pos, gate=None, selected=None):  # keys, values from every cached latent
        """The context of every head, times its gate [B, T, nh] where there is one, through o_proj; `selected`
        [B, T, S] (DSA): the keys each query may attend to, the others masked."""
        B, S = q.shape[0], latents.shape[1]
        kv = self.kv_b_proj(latents).view(B, S, self.nh, self.dn + self.dv).transpose(1, 2)
        k_nope, v = torch.split(kv, [self.dn, self.dv], dim=-1)  # [B, nh, S, dn], [B, nh, S, dv]
        k = torch.cat((k_nope, rope_keys[:, None].expand(B, self.nh, S, self.dr)), dim=-1)
        scores = (q @ k.transpose(2, 3)) * self.scale  # [B, nh, T, S]
        visible = self.visible(pos)  # [T, S]
        if selected is not None:  # (torch.where: IREE 3.13 does not legalize aten.__and__ on i1)
            visible = torch.where(selected, visible, False)[:, None]  # [B, 1, T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
        if hasattr(self, "sinks"):  # one more logit per head, whose probability is dropped
            sink = self.sinks.to(scores.dtype)[None, :, None, None].expand(B, -1, scores.shape[2], 1)
            probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        else:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.output((probs @ v).transpose(1, 2), gate)  # [B, T, nh, dv]

    def visible(self, pos):  # [T, S] bool: the cached keys each query may see (causal; a sliding layer: mla_scaled.py)
        return self.cache_pos[None, :] <= pos[:, None]

    def output(self, context, gate=None):  # the heads' context [B, T, nh, dv] times their gate [B, T, nh], o_proj'd
        if gate is not None:
            context = context * gate.reshape(*context.shape[:3], -1)  # per head, or per channel (HY-V4)
        return self.o_proj(context.flatten(2))
