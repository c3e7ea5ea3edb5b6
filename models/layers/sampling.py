"""The on-device sampling head: Gumbel-max with temperature and top-p, seeded by an
explicit integer seed, export-friendly (no RNG state, no data-dependent control flow).

The noise is counter-based: u_i = (hash32(hash32(seed) ^ i) >> 8 + 0.5) / 2^24 for token
i, so the same seed gives the same noise on every backend and the host can reproduce a
sample exactly. The runner's schedule: the prefill uses seed s, decode step k uses s + k.

temperature == 0 is exactly greedy (argmax, selected with torch.where: no epsilon
temperature); top_p keeps the smallest set of most probable tokens whose mass reaches
top_p (the most probable is always kept; tokens tied with the least probable kept one
too). Arguments are validated on the host (`check_args`): an exported program cannot
refuse its inputs.
"""

from __future__ import annotations

import torch
from torch import nn

MASK32 = 0xFFFFFFFF


def check_args(temperature: float, top_p: float) -> None:
    if not temperature >= 0.0:  # also refuses NaN
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k for 0 <= x < 2^32, as a floor division: ExecuTorch's portable kernels have no
    `__rshift__` (the bits are the same)."""
    return torch.div(x, 1 << k, rounding_mode="floor")


def example_args() -> tuple:
    """Example (temperature, top_p, seed) for torch.export: 0-d float32, float32, int64."""
    return torch.tensor(0.8), torch.tensor(0.9), torch.tensor(0)


def runtime_args(temperature: float, top_p: float, seed: int) -> list:
    """(temperature, top_p, seed) as an exported sampler takes them, validated first (the
    runner's job: a program cannot refuse its inputs)."""
    check_args(temperature, top_p)
    return [torch.tensor(float(temperature)), torch.tensor(float(top_p)), torch.tensor(int(seed))]


def hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (C. Wellons) on int64 tensors holding 32-bit values."""
    x = x ^ _shr(x, 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ _shr(x, 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ _shr(x, 16)


def gumbel_noise(seed: torch.Tensor, n: int) -> torch.Tensor:
    """[n] float32 Gumbel(0, 1) noise for `seed` (0-d int64)."""
    i = torch.arange(n, dtype=torch.int64)
    bits = _shr(hash32(hash32(seed.to(torch.int64) & MASK32) ^ i), 8)  # 24 random bits
    u = (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1), exactly representable
    return -torch.log(-torch.log(u))


class Sampler(nn.Module):
    """logits [B, V] -> token ids [B] (int64)."""

    def forward(self, logits, temperature, top_p, seed):
        logits = logits.float()
        greedy = logits.argmax(dim=-1)
        scaled = logits / temperature.clamp(min=1e-6)
        probs = torch.softmax(scaled, dim=-1)
        sp = torch.topk(probs, probs.shape[-1], dim=-1).values  # sorted, descending (no portable sort kernel)
        keep_sorted = (sp.cumsum(dim=-1) - sp) < top_p  # mass before this token < top_p: a prefix
        # the nucleus as a threshold (the least probable kept probability), not a scatter of the
        # sorted mask: the MLX delegate has no scatter; a tie at the threshold keeps both tokens
        threshold = torch.where(keep_sorted, sp, 2.0).amin(dim=-1, keepdim=True)
        keep = probs >= threshold
        noisy = torch.where(keep, scaled + gumbel_noise(seed, logits.shape[-1]), float("-inf"))
        return torch.where(temperature > 0, noisy.argmax(dim=-1), greedy)


class SampledModel(nn.Module):
    """The production model with the sampler fused: (tokens, pos, temperature, top_p, seed)
    -> the sampled next token [B] instead of logits."""

    def __init__(self, model):
        super().__init__()
        self.model, self.sampler = model, Sampler()

    def forward(self, tokens, pos, temperature, top_p, seed):
        return self.sampler(self.model(tokens, pos)[:, -1], temperature, top_p, seed)
