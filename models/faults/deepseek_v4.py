"""Port bugs of DeepSeek-V4's attention and hash routing (models/layers/compressed_attention.py, compressed_kv.py,
hash_router.py): a compressor's projections not carried into decode (CSA's and HCA's), the indexer one entry short,
the CSA overlap (the previous window's first series) left out, the entries rotated at their window's last position
(the windows misaligned by m - 1), the sinks dropped, the output's rope slice not rotated back, the sliding-only layer
with the compress rope, and the hash table read with the previous token's id. The tiny config holds HCA (hash-routed) in
its first layer and CSA in its last: each fault reaches its layer by position."""

from __future__ import annotations

import torch

from models.args import ModelArgs
from models.faults.fault import Fault, patch
from models.layers.compressed_kv import WindowCompressor


def _kept_this_call(c: WindowCompressor):
    """`c.update` keeping only this call's positions (the earlier calls' projections zeroed: not carried)."""
    def update(x, pos):
        kv, gate = WindowCompressor.update(c, x, pos)
        pos_all = torch.arange(kv.shape[1], device=kv.device)
        written = torch.where(pos_all >= pos[0], pos_all <= pos[-1], False)[None, :, None]
        return kv * written.to(kv.dtype), gate * written.to(gate.dtype)

    patch(c, "update", update)


def dsv4_compressed_cache_not_carried(attn, a):
    """The compressor's running state (its projections of earlier calls) not carried into decode."""
    _kept_this_call(attn.compressor)


def dsv4_index_topk_off_by_one(attn, a):
    """The indexer keeps one entry fewer than index_topk (k - 1; the best one given twice keeps the shape)."""
    ix = attn.compressor.indexer

    def choose(scores, pos):
        idx = scores.topk(ix.k - 1, dim=-1).indices
        idx = torch.cat((idx, idx[..., :1]), dim=-1)
        threshold = torch.div(pos + 1, ix.m, rounding_mode="floor")[None, :, None]
        return torch.where(idx >= threshold, torch.full_like(idx, -1), idx)

    patch(ix, "choose", choose)


def dsv4_overlap_dropped(attn, a):
    """CSA's entries without the previous window's first series (each entry its own window's second series alone)."""
    c = attn.compressor
    d = c.dim

    def update(x, pos):
        kv, gate = WindowCompressor.update(c, x, pos)
        return kv, torch.cat((torch.full_like(gate[..., :d], -1e30), gate[..., d:]), dim=-1)

    patch(c, "update", update)


def dsv4_entries_rotated_late(attn, a):
    """The compressed entries rotated at their window's last position, not its first (windows misaligned by m - 1)."""
    c = attn.compressor
    rope = c.rope

    class Late(torch.nn.Module):
        dim = rope.dim

        def forward(self, x, pos, inverse=False):
            return rope(x, pos + c.m - 1, inverse)

    object.__setattr__(c, "rope", Late())


def dsv4_sinks_dropped(attn, a):
    """The attention's sinks left out of the softmax (their logits -inf: weight 0)."""
    with torch.no_grad():
        attn.sinks.fill_(float("-inf"))


def dsv4_output_rope_kept(attn, a):
    """The output's rope slice left rotated (the values carry the keys' rotation: HF rotates it back at the query)."""
    rope = attn.rope

    class Forward(torch.nn.Module):
        dim = rope.dim

        def forward(self, x, pos, inverse=False):
            return x if inverse else rope(x, pos)

    object.__setattr__(attn, "rope", Forward())


def dsv4_sliding_rope_compress(attn, a):
    """The sliding-only layer rotated with the compressed layers' rope (compress_rope_theta, YaRN), not its own."""
    from models.layers.compressed_kv import TailRope

    object.__setattr__(attn, "rope", TailRope(attn.rope.dim, a.rope))


def dsv4_hash_token_shifted(layer, a):
    """The hash layer's table read with the previous token's id (the call's ids shifted by one)."""
    router = layer.mlp.gate
    forward = type(router).forward

    def shifted(x, tokens=None):
        t = router.call_tokens[:, : x.shape[0] // router.call_tokens.shape[0]]
        return forward(router, x, torch.cat((t[:, :1], t[:, :-1]), dim=-1))

    patch(router, "forward", shifted)


def _compressed(a: ModelArgs, layer: int, indexed: bool) -> bool:
    c = a.attention.compressed
    return c is not None and bool(c.ratios[layer]) and c.indexed[layer] == indexed


def _first_hash(a: ModelArgs) -> bool:
    return bool(a.router.hash_layers) and a.router.hash_layers[0]


def _dsv4(a: ModelArgs) -> bool:
    return a.attention.kind == "compressed"


_CSA_LAST = lambda a: _compressed(a, a.num_hidden_layers - 1, True)  # noqa: E731
_HCA_FIRST = lambda a: _compressed(a, 0, False)  # noqa: E731

DEEPSEEK_V4: tuple[Fault, ...] = (
    Fault("dsv4_csa_cache_not_carried", "attention", "last", "DeepSeek-V4: the CSA compressor's state (the earlier "
          "calls' projections) not carried into decode", dsv4_compressed_cache_not_carried, _CSA_LAST),
    Fault("dsv4_hca_cache_not_carried", "attention", "first", "DeepSeek-V4: the HCA compressor's state (the earlier "
          "calls' projections) not carried into decode", dsv4_compressed_cache_not_carried, _HCA_FIRST),
    Fault("dsv4_index_topk_off_by_one", "attention", "last", "DeepSeek-V4: the indexer keeps one compressed entry "
          "fewer than index_topk", dsv4_index_topk_off_by_one, _CSA_LAST),
    Fault("dsv4_csa_overlap_dropped", "attention", "last", "DeepSeek-V4: CSA's entries without the previous window's "
          "series (no overlap)", dsv4_overlap_dropped, _CSA_LAST),
    Fault("dsv4_entries_rotated_late", "attention", "first", "DeepSeek-V4: the compressed entries rotated at their "
          "window's last position (the windows misaligned)", dsv4_entries_rotated_late, _HCA_FIRST),
    Fault("dsv4_sinks_dropped", "attention", "last", "DeepSeek-V4: the attention sinks left out of the softmax",
          dsv4_sinks_dropped, _dsv4),
    Fault("dsv4_output_rope_kept", "attention", "last", "DeepSeek-V4: the attention output's rope slice not rotated "
          "back at the query's position", dsv4_output_rope_kept, _dsv4),
    Fault("dsv4_sliding_rope_compress", "attention", "sliding", "DeepSeek-V4: the sliding-only layer rotated with the "
          "compressed layers' rope (compress_rope_theta, YaRN)", dsv4_sliding_rope_compress,
          lambda a: _dsv4(a) and a.rope.sliding is not None),
    Fault("dsv4_hash_token_shifted", "moe", "first", "DeepSeek-V4: the hash layer's experts looked up with the "
          "previous token's id", dsv4_hash_token_shifted, _first_hash),
)

# the drill's first diverging point (oracle/drill/points.py). The attention's core has no point both sides record
# (HF's q/k rope taps are laid out otherwise: point_view drops them; the context feeds the grouped output projection,
# no o_proj), so a fault there first shows at o_a_proj, that projection's first stage; the CSA layers' indexer is the
# compressor's (compressor.indexer)
POINTS = {"dsv4_csa_cache_not_carried": ("compressor.indexer", "o_a_proj"), "dsv4_hca_cache_not_carried": "o_a_proj",
          "dsv4_index_topk_off_by_one": ("compressor.indexer", "o_a_proj"),
          "dsv4_csa_overlap_dropped": ("compressor.indexer", "o_a_proj"), "dsv4_entries_rotated_late": "o_a_proj",
          "dsv4_sinks_dropped": "o_a_proj", "dsv4_output_rope_kept": "o_a_proj", "dsv4_sliding_rope_compress": "o_a_proj",
          "dsv4_hash_token_shifted": ("topk", "experts", "output")}
