"""DeepSeek-V4's hash routing (HF's DeepseekV4HashRouter, the hash_moe layers: RouterArgs.hash_layers): the experts
of a token are a frozen table's row, tid2eid[token id] [k], not a top-k; the learned router still scores every
expert (the family's scoring of weight @ x) and the chosen experts' scores, renormalised and times
routed_scaling_factor, weigh them. The token ids of the call: `tokens` [N], or those the model (or a block's caller)
wrote into `call_tokens` (feed_tokens) before the call: the MoE block's own inputs stay HF's (x alone)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.args import ModelArgs
from models.layers import routing
from models.layers.taps import tap


class HashRouter(nn.Module):
    """(x [N, H], tokens [N] int64 or None: call_tokens[:N]) -> weights [N, k], indices [N, k]."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.args = a
        self.weight = nn.Parameter(torch.zeros(a.num_experts, a.hidden_size))
        # the table as a (frozen) floating parameter, as every checkpoint tensor is loaded: expert ids are exact integers
        # in fp32, where it is kept (models.args.kept_fp32); the checkpoint's int64 converted by the family's sanitize
        self.tid2eid = nn.Parameter(torch.zeros(a.vocab_size, a.num_experts_per_tok), requires_grad=False)
        # the call's token ids [B, T] at [:, :T] (a state buffer: widened with the batch, reset with the rest)
        self.register_buffer("call_tokens", torch.zeros(1, a.max_seq_len, dtype=torch.int64), persistent=False)

    def forward(self, x, tokens=None):
        if tokens is None:
            tokens = self.call_tokens[:, : x.shape[0] // self.call_tokens.shape[0]]
        logits = tap("logits", F.linear(x, self.weight))
        probs = tap("scores", routing.scores(logits, self.args))
        idx = tap("topk", self.tid2eid[tokens.reshape(-1)].long())
        w = routing.topk_weights(probs, idx, self.args)
        return tap("weights", w.to(logits.dtype)), idx.clone()


def feed_tokens(module: nn.Module, tokens) -> None:
    """The call's token ids [B, T] written into every `call_tokens` buffer under `module` ([:, :T]): DeepSeek-V4's
    hash routers, Qwen4-Exp's n-gram embeddings (models/layers/ple.py)."""
    for name, buf in module.named_buffers():
        if name.rsplit(".", 1)[-1] == "call_tokens":
            buf[:, : tokens.shape[-1]] = tokens
