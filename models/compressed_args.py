"""DeepSeek-V4's attention configuration (models/layers/compressed_attention.py, models/layers/compressed_kv.py):
plain data, re-exported by models.args (AttentionArgs.compressed, with AttentionArgs.kind "compressed")."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CompressedArgs:
    """Shared-KV multi-query attention (one key head of head_dim, read as the values too) over a sliding window of
    the last AttentionArgs.sliding_window positions plus, on a layer with a compress ratio m, compressed entries (one
    per m positions, a softmax-gated sum of their projections). CSA (`indexed`): the windows overlap (each entry also
    sums the previous window's second series) and a lightning indexer keeps the index_topk entries of each query; HCA:
    every emitted entry visible. q through a q_lora_rank bottleneck; the output through o_groups grouped projections
    to o_lora_rank each, then o_b_proj. RoPE on the trailing qk_rope_head_dim dims of each head (interleaved pairs),
    the output's rope slice rotated back at the query's position.

    ratios, per layer: 0 (the sliding window alone) or m; indexed, per layer: CSA (True) or HCA."""

    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    qk_rope_head_dim: int
    ratios: tuple[int, ...]
    indexed: tuple[bool, ...]
    index_topk: int
    index_n_heads: int
    index_head_dim: int

    def __post_init__(self):
        if len(self.ratios) != len(self.indexed):
            raise ValueError(f"CompressedArgs: {len(self.ratios)} ratios for {len(self.indexed)} layers")
        if any(i and not r for r, i in zip(self.ratios, self.indexed)):
            raise ValueError("CompressedArgs.indexed: an indexer on a layer without compression")
