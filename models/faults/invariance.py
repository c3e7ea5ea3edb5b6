"""Port bugs a serving engine's other paths expose, and the single-sequence path does not: each is caught by its
invariance row (oracle/verdict/invariance.py), not by a block: a chunk of the prompt after the first that forgets
the cache before it (the chunked row), experts with a capacity that a batch's other sequences use up (the batched
row), a perturbation that differs from run to run (the repeat row). The fault's kind names the row:
`invariance.<row>`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from models.faults.fault import Fault, patch


def chunk_forgets_cache(layer, a):
    """The attention of a prefill chunk after the first sees its own chunk's keys only: the cache before
    the chunk forgotten (a one-token decode, and a prefill from position 0, are untouched)."""
    attn = layer.attn

    def mask(pos):
        visible = type(attn).mask(attn, pos)
        if pos.shape[0] == 1:
            return visible
        return torch.where(attn.cache_pos[None, :] >= pos[:1, None], visible, False)

    patch(attn, "mask", mask)


def capacity_across_batch(layer, a):
    """A capacity of ceil(k x tokens / experts) per expert (capacity factor 1) on a batch of several
    sequences, filled in the batch's flat order: a token past it loses that expert (its weight 0); one
    sequence runs dropless. Which of a prompt's tokens lose an expert then depends on its batch mates."""
    moe = layer.mlp
    gate = moe.gate
    E = a.num_experts

    def moe_forward(x, *pos):  # (pos: ZAYA's MoE block and router take the call's positions)
        gate.batch = x.shape[0]
        return type(moe).forward(moe, x, *pos)

    def gate_forward(x, *pos):
        w, idx = type(gate).forward(gate, x, *pos)
        if getattr(gate, "batch", 1) == 1:
            return w, idx
        hits = F.one_hot(idx, E + 1)[..., :E]  # [N, k, E] (index E: ZAYA's skip expert, no capacity)
        seen = hits.flatten(0, 1).cumsum(0).view_as(hits)  # each (token, slot)'s place in its expert's queue
        cap = math.ceil(idx.numel() / E)
        kept = (seen * hits).sum(-1) <= cap
        return torch.where(kept, w, torch.zeros_like(w)), idx

    patch(moe, "forward", moe_forward)
    patch(gate, "forward", gate_forward)


def per_run_perturbation(layer, a):
    """The layer's output moved by a draw that differs from call to call (a generator seeded by the
    number of calls the model made): two runs of the same input differ."""
    calls = [0]

    def forward(x, pos):
        y = type(layer).forward(layer, x, pos)
        calls[0] += 1
        g = torch.Generator().manual_seed(calls[0])
        noise = torch.randn(y.shape, generator=g).to(y.device, y.dtype)
        return y + 0.03 * y.float().pow(2).mean().sqrt().to(y.dtype) * noise

    patch(layer, "forward", forward)


def _has_mask(a) -> bool:
    return a.attention.kind == "gqa"


INVARIANCE = (
    Fault("chunk_forgets_cache", "invariance.chunked", "full",
          "a prefill chunk after the first attends to its own chunk only (the cache before it forgotten)",
          chunk_forgets_cache, _has_mask),
    Fault("capacity_across_batch", "invariance.batched", "sparse",
          "experts with a capacity (factor 1) on batched calls, filled in the batch's order: a token past it "
          "loses the expert", capacity_across_batch),
    Fault("per_run_perturbation", "invariance.repeat", "last",
          "the last layer's output perturbed by a draw that differs from run to run (3% of its RMS)",
          per_run_perturbation),
)

POINTS = {"chunk_forgets_cache": None, "capacity_across_batch": None, "per_run_perturbation": None}
