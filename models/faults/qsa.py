"""Port bugs of Qwen4-Exp's mechanisms: the QSA indexer (models/layers/qsa.py: its key read from the queries' slot,
one block short, its key cache not carried into decode, the block keys rotated at the block's last position, the
scores without their relu), the gated residual (models/layers/gated_residual.py: the block's output injected without
its gate, the streams mixed before their norm) and the n-gram hash (models/layers/ple.py: every token one position
further back)."""

from __future__ import annotations

import torch

from models.args import ModelArgs
from models.faults.fault import Fault, patch
from models.layers.qsa import QSAIndexer


def _qsa(a: ModelArgs) -> bool:
    return a.qsa is not None


def _gated(a: ModelArgs) -> bool:
    return a.gated_residual is not None


def _ple_first(a: ModelArgs) -> bool:  # per-layer embeddings on the first layer (the fault's target "first")
    return a.ple is not None and 0 in a.ple.layers


# ------------------------------------------------------------------ the QSA indexer (the full layer's attention)
def qsa_key_from_query_slot(attn, a):
    """The indexer's key head read from the front of index_qk_proj's output (HF: the last head_dim features; the
    front ones are the first query head's): every score on the wrong head's projection."""
    ix = attn.indexer

    def project(x):
        y = ix.index_qk_proj(x)
        return torch.cat((y[..., ix.hd:], y[..., : ix.hd]), dim=-1).split([ix.nh * ix.hd, ix.hd], dim=-1)

    patch(ix, "project", project)


def qsa_topk_off_by_one(attn, a):
    """One block fewer chosen than budget / compress_ratio (the best given twice keeps the choice's shape)."""
    ix = attn.indexer

    def choose(scores):
        idx = scores.topk(ix.k - 1, dim=-1).indices
        return torch.cat((idx, idx[..., :1]), dim=-1)

    patch(ix, "choose", choose)


def qsa_index_cache_not_carried(attn, a):
    """The indexer's key cache starts empty at every call: a decode step's blocks are pooled from zeros."""
    ix = attn.indexer

    def update_cache(key, pos):
        keys = QSAIndexer.update_cache(ix, key, pos)
        written = torch.where(torch.arange(keys.shape[1]) >= pos[0], torch.arange(keys.shape[1]) <= pos[-1], False)
        return keys * written[None, :, None].to(keys.dtype)

    patch(ix, "update_cache", update_cache)


def qsa_block_rope_at_last(attn, a):
    """A block's key rotated at the block's last position (HF: its first)."""
    ix = attn.indexer

    def block_keys(cache):
        blocks = cache[:, : ix.nb * ix.r].unflatten(1, (ix.nb, ix.r)).float().mean(dim=2).to(cache.dtype)
        return ix.rope(ix.k_layernorm(blocks), ix.block_pos + ix.r - 1)

    patch(ix, "block_keys", block_keys)


def qsa_scores_without_relu(attn, a):
    """The indexer's per-head scores summed without their relu."""
    ix = attn.indexer
    patch(ix, "scores", lambda q, keys: (q.float() @ keys.float().transpose(-1, -2)[:, None]).sum(dim=1) / ix.hd**0.5)


# ------------------------------------------------------------------ the gated residual (the last layer)
def gated_residual_gate_missing(layer, a):
    """Each block's output added to every stream as it is, without its injection gate (2 sigmoid(inject / N))."""
    for hc in (layer.attn_hyper_connection, layer.mlp_hyper_connection):
        patch(hc, "inject", lambda normed, hc=hc: torch.ones(*normed.shape[:-1], hc.n, dtype=normed.dtype))


def gated_residual_mix_before_norm(layer, a):
    """The blocks' inputs mixed from the streams before their norm (HF: the mix weights times the normed streams)."""
    for hc in (layer.attn_hyper_connection, layer.mlp_hyper_connection):
        def forward(streams, hc=hc):
            normed = hc.hc_norm(streams)
            w = torch.sigmoid(hc.input_mix_weight_up(torch.nn.functional.silu(hc.input_mix_weight_down(normed) / hc.n)))
            return hc.mix(w.unflatten(-1, (hc.n, hc.h)), streams.unflatten(-1, (hc.n, hc.h))), streams, hc.inject(normed)

        patch(hc, "forward", forward)


# ------------------------------------------------------------------ the n-gram hash (the first layer's PLE)
def ngram_hash_off_by_one(layer, a):
    """The n-gram hash of the tokens one position further back (the current token left out, one more taken)."""
    ngram = layer.ple.ple_embedding
    shifted = ngram.shifted
    patch(ngram, "shifted", lambda hist, s: shifted(hist, s + 1))


QWEN4: tuple[Fault, ...] = (
    Fault("qsa_key_from_query_slot", "attention", "full", "QSA: the indexer's key head read from the queries' slot of "
          "index_qk_proj (scores on the wrong heads)", qsa_key_from_query_slot, _qsa),
    Fault("qsa_topk_off_by_one", "attention", "full", "QSA: the indexer keeps budget / compress_ratio - 1 blocks",
          qsa_topk_off_by_one, _qsa),
    Fault("qsa_index_cache_not_carried", "attention", "full", "QSA: the indexer's key cache not carried into decode",
          qsa_index_cache_not_carried, _qsa),
    Fault("qsa_block_rope_at_last", "attention", "full", "QSA: a block's pooled key rotated at its last position "
          "(HF: its first)", qsa_block_rope_at_last, _qsa),
    Fault("qsa_scores_without_relu", "attention", "full", "QSA: the indexer's per-head scores summed without the relu",
          qsa_scores_without_relu, _qsa),
    Fault("gated_residual_gate_missing", "layer", "last", "gated residual: each block's output injected into the "
          "streams without its gate", gated_residual_gate_missing, _gated),
    Fault("gated_residual_mix_before_norm", "layer", "last", "gated residual: the block's input mixed from the "
          "streams before their norm", gated_residual_mix_before_norm, _gated),
    Fault("ngram_hash_off_by_one", "layer", "first", "PLE: the n-gram hash of the tokens one position further back",
          ngram_hash_off_by_one, _ple_first),
)

# the point inside its block each breaks (models.faults.catalogue.POINTS)
POINTS = {
    "qsa_key_from_query_slot": "indexer", "qsa_topk_off_by_one": "indexer", "qsa_index_cache_not_carried": "indexer",
    "qsa_block_rope_at_last": "indexer", "qsa_scores_without_relu": "indexer",
    "gated_residual_gate_missing": "mlp_hyper_connection", "gated_residual_mix_before_norm": "attn_hyper_connection",
    "ngram_hash_off_by_one": "ple.ple_embedding.ngram_embedding",  # (the lookup the wrong ids index)
}
