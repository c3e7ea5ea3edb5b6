"""Qwen4-Exp's mechanisms' configuration (models/layers/qsa.py, gated_residual.py, ple.py): plain data, re-exported by
models.args (ModelArgs.qsa, gated_residual, ple)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QSAArgs:
    """Qwen4-Exp's QSA sparse attention on the FULL layers: an indexer of `n_heads` query heads and one key head of
    `head_dim` scores, for each query, the complete blocks of `compress_ratio` consecutive keys (their mean, normed and
    rotated at the block's first position) and keeps the best budget / compress_ratio blocks, plus the keys after the
    last complete block."""

    n_heads: int
    head_dim: int
    budget: int
    compress_ratio: int

    @property
    def blocks(self) -> int:  # the blocks each query keeps
        return self.budget // self.compress_ratio


@dataclass(frozen=True)
class GatedResidualArgs:
    """Qwen4-Exp's gated residual (hyper-connections of `streams` copies of the stream, flat [B, T, streams * H]):
    each block's input the mean over the streams of sigmoid(up(silu(down(normed) / streams))) * normed, its output added
    to stream s times 2 sigmoid(inject_s(normed) / streams); a last mix without the injection is the final norm."""

    streams: int
    lowrank: int


@dataclass(frozen=True)
class PLEArgs:
    """Qwen4-Exp's per-layer embeddings on some LINEAR layers (`layers`, 0-based): hashed n-grams (2..ngram_size tokens,
    `heads_per_ngram` hashed tables each, embed_dim wide in all) gate a value into each stream, plus a dilated depthwise
    conv (kernel conv_kernel, dilation ngram_size) of it, added to the streams before the layer's blocks. The hash
    restarts after `eos`. vocab_base, divisible_by, seed: the tables' sizes and hash multipliers (as HF derives them)."""

    layers: tuple[int, ...]
    embed_dim: int
    conv_kernel: int
    ngram_size: int
    heads_per_ngram: int
    vocab_base: int
    divisible_by: int
    seed: int
    eos: int
