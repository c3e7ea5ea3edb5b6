"""GLM-5.3's k-pool indexer (HF's Glm5NextTextIndexer): DeepSeek sparse attention (models/layers/dsa.py) choosing
pools of keys, not keys.

The keys are cut into pools of kpool consecutive positions from position 0 (pool j: positions j·kpool ..
(j+1)·kpool - 1); a pool's key is a learned mix of its keys, softmax over the pool of (x @ index_kpool_compress_gate^T
+ index_kpool_compress_ape[slot]) (fp32) times each key LayerNorm(wk(x)) (no rotation: GLM-5.3's MLA is NoPE). A
query scores the pools as DSA scores keys (sum_h w[h] · relu(q[h] · pool_key · index_head_dim^-1/2), fp32), a pool
selectable when its last key is visible (complete and causal: others finfo.min, HF's), and keeps the best
min(index_topk / kpool, pools) pools, then every key of the incomplete pool it is in (kpool_tail, HF's
index_kpool_always_select_tail). The choice is returned as HF's: the keys [B, T, index_topk + kpool - 1] (int64;
-1: none), the pools' keys first, best pool first; its last top-k is over the pools (a grouped choice: the oracle
records the pools chosen, oracle/verdict/selection.py).

Export-friendly: the keys and the gate logits are cached per position in static buffers (index_key_cache,
index_gate_cache [1, S, index_head_dim]); the pools are those of the whole cache, the ones not yet complete masked."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers.dsa import Indexer, shared_by_later


class PooledIndexer(Indexer):
    """(x [B, T, H], q_resid [B, T, q_lora_rank], pos [T]) -> the chosen keys, int64 [B, T, width]."""

    def __init__(self, a: ModelArgs, dtype=torch.float32, layer: int = 0):
        super().__init__(a, dtype, layer)
        d, S = a.attention.dsa, a.max_seq_len
        self.kpool, self.tail = d.kpool, d.kpool_tail
        self.pools = S // self.kpool  # the complete pools a static cache of S positions holds
        self.k = min(d.index_topk // self.kpool, self.pools)
        self.width = d.index_topk + (self.kpool - 1 if self.tail else 0)
        self.index_kpool_compress_ape = nn.Parameter(torch.zeros(self.kpool, self.hd))
        self.index_kpool_compress_gate = nn.Parameter(torch.zeros(self.hd, a.hidden_size))
        self.register_buffer("index_gate_cache", torch.zeros(1, S, self.hd, dtype=dtype))
        self.register_buffer("pool_end", (torch.arange(self.pools) + 1) * self.kpool - 1, persistent=False)
        if shared_by_later(a, layer):  # (the base's, as wide as this choice)
            self.register_buffer("index_selection", torch.zeros(1, S, self.width, dtype=torch.int64))

    def forward(self, x, q_resid, pos):
        B, T, _ = x.shape
        q = self.wq_b(q_resid).view(B, T, self.nh, self.hd).transpose(1, 2)  # [B, nh, T, hd]
        keys = self.update_cache(self.key(x), pos)  # [1, S, hd]
        gates = self.update_gate_cache(F.linear(x, self.index_kpool_compress_gate), pos)  # [1, S, hd]
        scores = self.index_scores(x, q, self.pool_keys(keys, gates))  # [B, T, P]
        visible = self.pool_end[None, :] <= pos[:, None]  # [T, P]: the pool complete before the query
        pools = self.choose(scores.masked_fill(~visible, torch.finfo(scores.dtype).min))  # [B, T, k]
        valid = self.pick_visible(visible, pools)
        slots = torch.arange(self.kpool, device=x.device)
        chosen = torch.where(valid[..., None], pools[..., None] * self.kpool + slots, -1).flatten(-2)  # [B, T, k kp]
        if self.tail:  # the keys of the query's own incomplete pool
            count = (pos + 1) % self.kpool  # [T]
            tail = torch.where(slots[None, :-1] < count[:, None], (pos + 1 - count)[:, None] + slots[None, :-1], -1)
            chosen = torch.cat((chosen, tail[None].expand(B, -1, -1)), dim=-1)
        chosen = F.pad(chosen, (0, self.width - chosen.shape[-1]), value=-1)
        if hasattr(self, "index_selection"):
            self.keep_selection(chosen, pos)
        return chosen

    def update_gate_cache(self, g, pos):  # g [B, T, hd] -> the cache [1, S, hd] (an exporter's own op overrides these)
        self.index_gate_cache[:, pos] = g
        return self.index_gate_cache

    def pick_visible(self, visible, pools):  # visible [T, P] at pools [B, T, k] -> [B, T, k] bool
        return torch.gather(visible[None].expand(pools.shape[0], -1, -1), -1, pools)

    def pool_keys(self, keys, gates):  # [1, S, hd] each -> [1, P, hd]: each pool's softmax mix of its keys
        n = self.pools * self.kpool
        k = keys[:, :n].unflatten(1, (self.pools, self.kpool))  # [1, P, kpool, hd]
        logits = gates[:, :n].unflatten(1, (self.pools, self.kpool)).float() + self.index_kpool_compress_ape.float()
        return (torch.softmax(logits, dim=2).to(k.dtype) * k).sum(dim=2)
