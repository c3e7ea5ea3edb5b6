"""DeepSeek-V4's compressed KV (HF's DeepseekV4HCACompressor, DeepseekV4CSACompressor, DeepseekV4Indexer): every m
source positions of a layer become one compressed entry, the softmax-gated sum (per channel, over the window, softmax
of gate_proj(x) + position_bias in fp32) of their kv_proj(x), RMS-normed and rotated at the window's first position
with the compress rope (RoPE on the trailing qk_rope_head_dim dims, interleaved pairs).

HCA: windows of m positions, no overlap, every closed window's entry visible to a query. CSA: the projections are two
series, Ca (the first head_dim channels) and Cb; entry w sums window w-1's Ca and window w's Cb over 2m slots (window
0's Ca slots left out), and a lightning indexer (HF's name `indexer`, its own compressor at index_head_dim) keeps the
index_topk entries each query scores highest, sum over index heads of w[h] * relu(q[h] . K * index_head_dim^-1/2),
w = weights_proj(x) * index_n_heads^-1/2, its queries q_b_proj of the attention's q latent, rotated at the query's
position. Entry w is visible from position t once its window closed: w < (t + 1) // m.

Export-friendly: the projections of every position are kept in static buffers (compress_kv, compress_gate
[1, S, channels]) carried from the prefill into decode, and every window's entry is computed from them at each call
(those not closed yet masked): the same numbers as HF's running buffer, overlap state and emitted entries, with static
shapes. The indexer returns its choice, int64 [B, T, k] (k = min(index_topk, S // m)), best first, -1 where a pick
is a window not closed yet (as HF's does): a routing decision the oracle records (oracle/verdict/selection.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs, RopeArgs
from models.layers.norms import RMSNorm
from models.layers.rope import Rope
from models.layers.taps import tap


def rotate_pairs(x):  # (x0, x1), (x2, x3) ... -> (-x1, x0), (-x3, x2) ... (HF's GLM rotate_half)
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


class TailRope(nn.Module):
    """RoPE on the trailing `dim` channels of each head, interleaved pairs (HF's DeepSeek-V4 apply_rotary_pos_emb):
    cos/sin in x's dtype, the rotation in fp32, cast back once. `inverse`: rotated back (-sin: the attention output)."""

    def __init__(self, dim: int, r: RopeArgs):
        super().__init__()
        freq = Rope(dim, r, partial=1.0)  # the frequencies (default or YaRN) and YaRN's cos/sin factor
        self.register_buffer("inv_freq", freq.inv_freq, persistent=False)
        self.factor, self.dim = freq.factor, dim

    def forward(self, x, pos, inverse: bool = False):  # x [..., T, D], pos [T]
        freqs = pos.float()[:, None] * self.inv_freq[None, :]
        cos = (freqs.cos() * self.factor).to(x.dtype).repeat_interleave(2, dim=-1)
        sin = (freqs.sin() * self.factor).to(x.dtype).repeat_interleave(2, dim=-1)
        if inverse:
            sin = -sin
        nope, rope = x[..., : -self.dim], x[..., -self.dim :]
        rotated = (rope.float() * cos + rotate_pairs(rope).float() * sin).to(x.dtype)
        return torch.cat((nope, rotated), dim=-1)


class WindowCompressor(nn.Module):
    """One compressed series (HF's compressor body): (x [1, T, H], pos [T]) -> every window's entry [1, W, dim]
    (W = S // m; a window not closed yet holds what its positions have so far, masked by the caller)."""

    def __init__(self, a: ModelArgs, dtype, dim: int, ratio: int, overlap: bool):
        super().__init__()
        self.m, self.dim, self.overlap = ratio, dim, overlap
        width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(a.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(a.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))  # fp32 (models.args.kept_fp32)
        self.kv_norm = RMSNorm(dim, a.rms_norm_eps, gain_fp32=True)
        self.rope = TailRope(a.attention.compressed.qk_rope_head_dim, a.rope)  # the compress rope
        S = a.max_seq_len
        self.windows = S // ratio
        self.register_buffer("compress_kv", torch.zeros(1, S, width, dtype=dtype))
        self.register_buffer("compress_gate", torch.zeros(1, S, width, dtype=dtype))
        self.register_buffer("window_pos", torch.arange(self.windows), persistent=False)

    def update(self, x, pos):
        self.compress_kv[:, pos] = self.kv_proj(x)
        self.compress_gate[:, pos] = self.gate_proj(x)
        return self.compress_kv, self.compress_gate

    def entries(self, x, pos):
        kv_all, gate_all = self.update(x, pos)
        (B, W), m, d = (kv_all.shape[0], self.windows), self.m, self.dim
        kv = kv_all[:, : W * m].reshape(B, W, m, -1)
        gate = gate_all[:, : W * m].reshape(B, W, m, -1) + self.position_bias  # (fp32 where position_bias is)
        if self.overlap:  # entry w: window w-1's Ca, then window w's Cb (window 0's Ca slots: weight 0)
            prev_kv = torch.cat((torch.zeros_like(kv[:, :1, :, :d]), kv[:, :-1, :, :d]), dim=1)
            prev_gate = torch.cat((torch.full_like(gate[:, :1, :, :d], float("-inf")), gate[:, :-1, :, :d]), dim=1)
            kv = torch.cat((prev_kv, kv[..., d:]), dim=2)
            gate = torch.cat((prev_gate, gate[..., d:]), dim=2)
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        return self.rope(self.kv_norm(pooled), self.window_pos * m)  # rotated at each window's first position

    def closed(self, pos):
        """[T, W] True where window w has closed at position pos[t]: w < (pos + 1) // m."""
        return self.window_pos[None, :] < torch.div(pos + 1, self.m, rounding_mode="floor")[:, None]


class Indexer(WindowCompressor):
    """CSA's lightning indexer: (x [B, T, H], q latent [B, T, q_lora_rank], pos [T]) -> the entries each query keeps,
    int64 [B, T, k] (-1: a window not closed yet)."""

    def __init__(self, a: ModelArgs, dtype, ratio: int):
        c = a.attention.compressed
        super().__init__(a, dtype, c.index_head_dim, ratio, overlap=True)
        self.nh, self.hd = c.index_n_heads, c.index_head_dim
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.nh * self.hd, bias=False)
        self.scorer = Scorer(a)
        self.k = min(c.index_topk, self.windows)

    def forward(self, x, q_resid, pos):
        B, T, _ = x.shape
        keys = self.entries(x, pos)  # [B, W, hd]
        q = self.q_b_proj(q_resid).view(B, T, self.nh, self.hd).transpose(1, 2)
        q = tap("q_rope", self.rope(q, pos), lambda t: t[..., -self.rope.dim :].transpose(1, 2)).transpose(1, 2)
        closed = self.closed(pos)  # [T, W]
        scores = self.scorer(q, keys, x).masked_fill(~closed, float("-inf"))  # [B, T, W]
        return self.choose(scores, pos)

    def choose(self, scores, pos):
        idx = scores.topk(self.k, dim=-1).indices
        threshold = torch.div(pos + 1, self.m, rounding_mode="floor")[None, :, None]
        return torch.where(idx >= threshold, torch.full_like(idx, -1), idx)


class Scorer(nn.Module):
    """HF's DeepseekV4IndexerScorer: sum over heads of weights_proj(x)[h] * n^-1/2 * relu(q[h] . K) * d^-1/2, fp32."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        c = a.attention.compressed
        self.scale, self.weights_scale = c.index_head_dim**-0.5, c.index_n_heads**-0.5
        self.weights_proj = nn.Linear(a.hidden_size, c.index_n_heads, bias=False)

    def forward(self, q, keys, x):  # q [B, T, nh, d], keys [B, W, d], x [B, T, H] -> [B, T, W]
        scores = F.relu(q.float() @ keys.float().transpose(-1, -2)[:, None]) * self.scale  # [B, T, nh, W]
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.weights_scale  # [B, T, nh]
        return (scores * w[..., None]).sum(dim=2)


class Compressor(WindowCompressor):
    """A compressed layer's entries and which of them each query sees: (x, q latent, pos) -> (entries [1, W, hd],
    visible [B, T, W] bool). CSA (indexed): overlapping windows, the indexer's choice; HCA: every closed window."""

    def __init__(self, a: ModelArgs, dtype, layer: int):
        c = a.attention.compressed
        ratio, indexed = c.ratios[layer], c.indexed[layer]
        super().__init__(a, dtype, a.head_dim, ratio, overlap=indexed)
        if indexed:
            self.indexer = Indexer(a, dtype, ratio)

    def forward(self, x, q_resid, pos):
        entries = self.entries(x, pos)
        if not hasattr(self, "indexer"):
            return entries, self.closed(pos)[None].expand(x.shape[0], -1, -1)
        chosen = self.indexer(x, q_resid, pos)  # [B, T, k]
        return entries, chosen_entries(chosen, self.window_pos)


def chosen_entries(chosen, window_pos):
    """[B, T, W] bool: True at the entries chosen ([B, T, k], -1 none)."""
    # (a sum, not any(): the MLX delegate's AnyNode is not run by the MLX-graph interpreter here)
    return (chosen[..., None] == window_pos).sum(dim=-2) > 0
