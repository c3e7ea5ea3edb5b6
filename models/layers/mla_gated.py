"""A.X-K2's latent attention (HF's AXK2Attention): DeepSeek-V3.2's MLA with DSA (models/layers/mla.py,
models/layers/dsa.py) whose query comes with an output gate out of one fused projection. q_gate_proj
[nh * (qk + dv), 2 * q_lora_rank] reads the normalised q latent beside the raw one, cat(q_resid, q_a_proj(x)) (no
q_b_proj); each head's row block holds its query (qk_nope + qk_rope) then its gate (v_head_dim). The heads' context
is gated element-wise by the sigmoid of the gate (in fp32, the product then in the model's dtype) before o_proj.
The indexer reads q_resid as DeepSeek-V3.2's does. AttentionArgs.output_gate on an "mla" attention."""

from __future__ import annotations

import torch
from torch import nn

from models.args import ModelArgs
from models.layers.mla import LatentAttention


class GatedLatentAttention(LatentAttention):
    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        if not hasattr(self, "q_b_proj"):
            raise ValueError("GatedLatentAttention: the fused q/gate projection reads a q_lora_rank latent")
        rank = self.q_b_proj.in_features
        del self.q_b_proj
        self.q_gate_proj = nn.Linear(2 * rank, self.nh * (self.dn + self.dr + self.dv), bias=False)

    def forward(self, x, pos):  # x [B, T, H], pos [T]
        q_compressed = self.q_a_proj(x)
        q_resid = self.q_a_layernorm(q_compressed)
        q, gate = self.query_and_gate(q_resid, q_compressed)
        q, latent, k_rot = self.project(x, pos, q)
        latents, rope_keys = self.update_cache(latent, k_rot, pos)
        selected = self.select(x, q_resid, pos) if self.dsa else None
        return self.attend(q, latents, rope_keys, pos, gate, selected)

    def query_and_gate(self, q_resid, q_compressed):
        """The query [B, T, nh, qk] and the gate [B, T, nh, dv]: each head's two parts of the fused projection."""
        B, T, _ = q_resid.shape
        qg = self.q_gate_proj(torch.cat((q_resid, q_compressed), dim=-1)).view(B, T, self.nh, -1)
        return torch.split(qg, [self.dn + self.dr, self.dv], dim=-1)

    def project(self, x, pos, q):
        """The query [B, T, nh, qk] as the heads' q [B, nh, T, qk], its rotary part rotated; the latent, the key."""
        B, T, _ = x.shape
        q_nope, q_rot = self.split_q(q.transpose(1, 2))
        latent, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.r, self.dr], dim=-1)
        k_rot, q_rot = self.rope(k_rot.view(B, 1, T, self.dr), pos)[:, 0], self.rope(q_rot, pos)
        return torch.cat((q_nope, q_rot), dim=-1), self.kv_a_layernorm(latent), k_rot

    def output(self, context, gate=None):  # context [B, T, nh, dv] times sigmoid(gate) element-wise, o_proj'd
        return self.o_proj((context * torch.sigmoid(gate.float())).to(context.dtype).flatten(2))
