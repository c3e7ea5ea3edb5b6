"""Port bugs of what A.X-K2 (models/axk2.py) and dots3 (models/dots3_note.py) bring to DeepSeek sparse attention:
A.X-K2's fused q/gate projection read the wrong way (the gate from the query's half, the two q latents swapped) and
its gated norms without their gate; dots3's latent scales left out, its rotary key's norm left out, its sliding
layers' window and dimensions read as the indexed layers'."""

from __future__ import annotations

import torch

from models.faults.fault import Fault, patch
from models.layers.mla_gated import GatedLatentAttention


def axk2_gate_from_query_half(attn, a):
    """Each head's fused row block split gate first (its first v_head_dim rows taken for the gate, the rest for the
    query) where the release holds the query first."""
    def query_and_gate(q_resid, q_compressed):
        B, T, _ = q_resid.shape
        qg = attn.q_gate_proj(torch.cat((q_resid, q_compressed), dim=-1)).view(B, T, attn.nh, -1)
        gate, q = torch.split(qg, [attn.dv, attn.dn + attn.dr], dim=-1)
        return q, gate

    patch(attn, "query_and_gate", query_and_gate)


def axk2_q_latents_swapped(attn, a):
    """The fused projection fed cat(q_a_proj(x), q_a_layernorm(...)) where HF feeds the normalised latent first."""
    patch(attn, "query_and_gate", lambda q_resid, q_compressed:
          GatedLatentAttention.query_and_gate(attn, q_compressed, q_resid))


def axk2_norm_gate_dropped(layer, a):
    """The layer's gated input norm computed as a plain RMSNorm (its low-rank sigmoid gate left out)."""
    norm = layer.input_layernorm
    patch(norm, "gate", lambda y: torch.ones_like(y, dtype=torch.float32))


def dots3_q_lora_scale_missing(attn, a):
    """The normalised q latent not scaled by (hidden_size / q_lora_rank)^1/2 (the query and the indexer's)."""
    attn.q_lora_scale = 1.0


def dots3_kv_lora_scale_missing(attn, a):
    """The normalised kv latent not scaled by (hidden_size / kv_lora_rank)^1/2."""
    attn.kv_lora_scale = 1.0


def dots3_k_rope_norm_missing(attn, a):
    """The shared rotary key rotated without its RMSNorm (k_rope_only_layernorm)."""
    patch(attn.k_rope_only_layernorm, "forward", lambda x: x)


def dots3_sliding_scales_of_the_model(attn, a):
    """A sliding layer's latent scales computed from the indexed layers' ranks (the model's q/kv lora ranks)."""
    H, m = a.hidden_size, a.attention.mla
    attn.q_lora_scale, attn.kv_lora_scale = (H / m.q_lora_rank) ** 0.5, (H / m.kv_lora_rank) ** 0.5


def _scaled(a) -> bool:
    return a.attention.kind == "mla" and a.attention.mla_scaled


def _sliding_ranks_differ(a) -> bool:
    m, s = a.attention.mla, a.attention.mla_sliding
    return _scaled(a) and s is not None and (s.q_lora_rank, s.kv_lora_rank) != (m.q_lora_rank, m.kv_lora_rank)


def _gated(a) -> bool:
    return a.norm.gate_rank > 0


def _fused(a) -> bool:
    return a.attention.kind == "mla" and a.attention.output_gate


DSA2: tuple[Fault, ...] = (
    Fault("axk2_gate_from_query_half", "attention", "full", "A.X-K2: the attention's output gate read from the query's "
          "half of each head's fused q/gate rows", axk2_gate_from_query_half, _fused, attention=("mla",)),
    Fault("axk2_q_latents_swapped", "attention", "full", "A.X-K2: the fused q/gate projection fed the raw q latent "
          "first and the normalised one second", axk2_q_latents_swapped, _fused, attention=("mla",)),
    Fault("axk2_norm_gate_dropped", "layer", "last", "A.X-K2: the gated input norm without its low-rank sigmoid gate",
          axk2_norm_gate_dropped, _gated),
    Fault("dots3_q_lora_scale_missing", "attention", "full", "dots3: the normalised q latent not scaled by "
          "(hidden_size / q_lora_rank)^1/2", dots3_q_lora_scale_missing, _scaled, attention=("mla",)),
    Fault("dots3_kv_lora_scale_missing", "attention", "full", "dots3: the normalised kv latent not scaled by "
          "(hidden_size / kv_lora_rank)^1/2", dots3_kv_lora_scale_missing, _scaled, attention=("mla",)),
    Fault("dots3_k_rope_norm_missing", "attention", "full", "dots3: the shared rotary key's RMSNorm left out",
          dots3_k_rope_norm_missing, _scaled, attention=("mla",)),
    Fault("dots3_sliding_scales_of_the_model", "attention", "sliding", "dots3: a sliding layer's latent scales "
          "from the indexed layers' lora ranks", dots3_sliding_scales_of_the_model, _sliding_ranks_differ),
)

POINTS = {"axk2_gate_from_query_half": "context", "axk2_q_latents_swapped": "q_gate_proj",
          "axk2_norm_gate_dropped": "input_layernorm", "dots3_q_lora_scale_missing": "q_b_proj",
          "dots3_kv_lora_scale_missing": "kv_b_proj", "dots3_k_rope_norm_missing": "k_rope_only_layernorm",
          "dots3_sliding_scales_of_the_model": ("q_b_proj", "kv_b_proj")}
