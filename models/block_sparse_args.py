"""The arguments of MiniMax-M3's block-sparse attention (models/layers/block_sparse.py), imported by models.args."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockSparse:
    """Block-sparse attention (MiniMax-M3's `minimax_m3_sparse` layers): a block indexer of index_n_heads heads of
    index_head_dim (one head per kv head: its choice serves that head's group of q heads) max-pools its per-key
    scores into blocks of block_size keys and keeps, per query and head, the topk_blocks best blocks, the
    local_blocks blocks ending at the query's own always among them. layers, per layer: True where the layer's
    attention is block-sparse (the others attend to every earlier key)."""

    index_n_heads: int
    index_head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int
    layers: tuple[bool, ...] = ()
