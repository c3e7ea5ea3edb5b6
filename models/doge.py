"""Doge (SmallDoge; transformers 5.23 doge) in its MoE configuration (`is_moe`): dynamic mask attention
(models/layers/dynamic_mask.py: per-head q/k RMSNorm, rotate-half RoPE, a learned bias per key exp(A * softplus(
dt_proj(v))) added to the scores, each query keeping the keep_window_size keys of largest bias), the cross-domain
MoE (models/layers/product_key_moe.py: a dense SwiGLU MLP plus num_experts one-neuron embedding experts retrieved
by product keys, softmax over the top-k), and each residual times a learned per-channel scale (input_residual,
post_attention_residual).

The tiny config makes both choices bite: keep_window_size 4 below the default prompt (8 tokens), one kv head (the
harness judges one key set per query: the kv head's); 16 = 4 x 4 experts, top-4. Seeded A (std 0.5) and dt_proj
(std 0.5) spread the bias over ~0.2-5 (an unseeded A = 0 makes every key's bias 1: a tie everywhere); the residual
scales drawn around their identity 1.

HF's model keeps both choices inline (the MoE block computes its routing from router_gate; the attention ranks its
keys in prepare_dynamic_mask): the reference (`reference()`) is HF's DogeForCausalLM with the routing moved into a
module (`mlp.router`: the product-key logits in expert order, the top-k weights and experts, then HF's block on
them) and the key ranking into a parameterless submodule `indexer` of the attention (its top-k, whose indices HF's
mask then keeps), the same computation in the same order; tests/test_doge.py: its logits equal HF's own class's.

Refused, each named: Doge without its MoE (is_moe false: a dense model), a sliding window, an activation other than
silu, a num_experts that is not a square (HF's keys address floor(sqrt(E))^2 experts)."""

from __future__ import annotations

import functools
import math

from models.args import SPARSE, AttentionArgs, RouterArgs
from models.family import Family
from models.mapping import hf_args, require, strip_prefix, tie_embeddings

TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    keep_window_size=4,  # below the prompt: from the fifth query on, 4 of its keys
    is_moe=True, num_experts=16, num_experts_per_tok=4,  # 4 x 4 product keys
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def to_args(c):
    require(c.is_moe, "doge: is_moe false (a dense Doge: no MoE block to check)")
    require(c.hidden_act == "silu", f"doge: hidden_act {c.hidden_act!r} (the MLP and the embedding experts are silu)")
    require(c.sliding_window is None, f"doge: sliding_window {c.sliding_window} (a windowed dynamic mask is not "
                                      "implemented)")
    K = math.floor(math.sqrt(c.num_experts))
    require(K * K == c.num_experts, f"doge: num_experts {c.num_experts} is not a square (HF's product keys address "
                                    f"{K}^2 of them)")
    L = c.num_hidden_layers
    return hf_args(
        c, "doge", num_experts=c.num_experts, moe_intermediate_size=1, intermediate_size=c.intermediate_size,
        mlp_types=(SPARSE,) * L, shared_expert_intermediate_size=c.intermediate_size, shared_expert_gated=False,
        mlp_bias=c.mlp_bias, product_key_moe=True, residual_scales=True,
        attention=AttentionArgs(qk_norm="head", qkv_bias=c.attention_bias, o_bias=c.attention_bias,
                                keep_window=c.keep_window_size),
        # HF: softmax over the top-k logits, the renormalised softmax's weights
        router=RouterArgs(norm_topk_prob=True),
    )


# HF's names in a decoder layer's MoE block -> the production model's
_MOE = {"router_gate.weight": "gate.weight", "down_embed.weight": "experts.down_embed",
        "up_embed.weight": "experts.up_embed", "gate_proj.": "shared_experts.gate_proj.",
        "up_proj.": "shared_experts.up_proj.", "down_proj.": "shared_experts.down_proj."}


def _renamed(name: str) -> str:
    head, sep, inner = name.partition(".mlp.")
    if not sep or not head.startswith("layers."):
        return name
    old = next((o for o in _MOE if inner.startswith(o)), None)
    return name if old is None else f"{head}.mlp.{_MOE[old]}{inner[len(old):]}"


def sanitize(weights: dict, args) -> dict:
    return tie_embeddings({_renamed(k): t for k, t in strip_prefix(weights).items()}, args)


@functools.cache
def reference():
    """HF's DogeForCausalLM with its two inline choices as modules (module docstring): each MoE block's routing as
    `mlp.router` (not registered: the state dict is HF's), each attention's key ranking as `self_attn.indexer` (no
    parameters)."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from transformers.models.doge import modeling_doge as d

    class Router(nn.Module):
        """HF's DogeCDMoE routing: (logits [N, E] in expert order, top-k weights [N, k], experts [N, k])."""

        def __init__(self, moe):
            super().__init__()
            self.router_gate, self.num_keys, self.top_k = moe.router_gate, moe.num_keys, moe.top_k
            self.norm_topk_prob = moe.norm_topk_prob

        @property
        def weight(self):  # a one-token probe's logits are linear: expert i * K + j's row is key i's plus key K + j's
            w, K = self.router_gate.weight, self.num_keys
            return (w[:K, None, :] + w[None, K:, :]).reshape(K * K, -1)

        def forward(self, hidden_states):
            n = hidden_states.reshape(-1, hidden_states.shape[-1]).shape[0]
            # HF 5.23's DogeCDMoE.forward, its routing
            router_logits = self.router_gate(hidden_states).view(2, n, -1)
            (scores_x, scores_y), (indices_x, indices_y) = router_logits.topk(self.num_keys, dim=-1)
            all_scores = scores_x.unsqueeze(-1) + scores_y.unsqueeze(-2)
            all_indices = indices_x.unsqueeze(-1) * self.num_keys + indices_y.unsqueeze(-2)
            all_scores = all_scores.view(*all_scores.shape[:-2], -1)
            all_indices = all_indices.view(*all_indices.shape[:-2], -1)
            scores, position_indices = all_scores.topk(self.top_k, dim=-1)
            indices = all_indices.gather(-1, position_indices)
            routing_weights = F.softmax(scores, dim=-1)
            if self.norm_topk_prob:
                routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
            logits = torch.empty_like(all_scores).scatter(-1, all_indices, all_scores)  # (the same values)
            return logits, routing_weights, indices

    def moe_forward(self, hidden_states, **kwargs):
        # HF 5.23's DogeCDMoE.forward, the routing by self.router
        bsz, seq_len, _ = hidden_states.shape
        router_logits, routing_weights, indices = self.router(hidden_states)
        down_embed = self.down_embed(indices)
        up_embed = self.up_embed(indices)
        experts_weights = torch.matmul(down_embed, hidden_states.view(bsz * seq_len, -1, 1)).view(bsz * seq_len, -1)
        experts_weights = self.act_fn(experts_weights) * routing_weights
        experts_states = torch.matmul(experts_weights.view(bsz * seq_len, 1, -1), up_embed).view(bsz, seq_len, -1)
        hidden_states = self.down_proj(self.act_fn(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))
        hidden_states = hidden_states + experts_states
        return hidden_states, router_logits

    class Indexer(nn.Module):
        """HF's key ranking: the top-k of the dynamic mask [B, kvh, T, L], ranked per (query, kv head):
        [B, T, kvh * k]."""

        def forward(self, attn_mask, k):
            B, _, T, _ = attn_mask.shape
            return torch.topk(attn_mask.transpose(1, 2), k, dim=-1, largest=True, sorted=False).indices.reshape(B, T, -1)

    def prepare_dynamic_mask(self, hidden_states, dt_states, keep_window_size=2048, attention_mask=None):
        # HF 5.23's DogeAttention.prepare_dynamic_mask, the top-k by self.indexer (taken at every call: with at most
        # keep_window_size keys it keeps them all, as HF's skipping it does)
        min_dtype = torch.finfo(hidden_states.dtype).min
        dtype = hidden_states.dtype
        attn_mask = dt_states[:, :, None, :].expand(-1, -1, hidden_states.shape[1], -1)
        if attention_mask is not None:
            if attention_mask.dtype == torch.bool:
                attention_mask = torch.where(
                    attention_mask, torch.full((), 0.0, device=attention_mask.device, dtype=dtype), min_dtype)
            attn_mask = attn_mask.masked_fill(attention_mask[:, :, :, : attn_mask.shape[-1]] != 0, min_dtype)
        B, kvh, T, L = attn_mask.shape
        active_mask = torch.zeros_like(attn_mask, dtype=dtype, device=attn_mask.device)
        topk_indices = self.indexer(attn_mask, min(keep_window_size, L)).view(B, T, kvh, -1).transpose(1, 2)
        active_mask = active_mask.scatter(-1, topk_indices, 1.0)
        return attn_mask.masked_fill(active_mask == 0.0, min_dtype)

    class DogeForCausalLM(d.DogeForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.self_attn.indexer = Indexer()
                layer.self_attn.prepare_dynamic_mask = prepare_dynamic_mask.__get__(layer.self_attn)
                if isinstance(layer.mlp, d.DogeCDMoE):
                    layer.mlp.__dict__["router"] = Router(layer.mlp)
                    layer.mlp.forward = moe_forward.__get__(layer.mlp)

    DogeForCausalLM.__module__ = d.__name__  # (its architectures entry and class are HF's)
    DogeForCausalLM.__qualname__ = "DogeForCausalLM"
    return DogeForCausalLM


FAMILY = Family(
    name="doge", model_types=("doge",), hf_module="doge", hf_class_name="DogeForCausalLM",
    hf_config_name="DogeConfig", tiny_config=TINY, to_args=to_args, sanitize=sanitize, hf_router="mlp.router",
    hf_reference=reference,
    tokens_mixed="its MoE router's logits are viewed as [2, tokens, keys] over the call's tokens (HF's DogeCDMoE; its "
                 "comment: 'routing is not causal in a full forward pass'): a prefill's routing depends on how the "
                 "prompt is split into calls and on the batch",
    # the dynamic mask's A and dt_proj spread the keys' bias (A = 0: a tie everywhere); residual scales around 1
    tiny_std={"self_attn.A": 1.0, "self_attn.dt_proj.weight": 0.5, "input_residual": (1.0, 0.2),
              "post_attention_residual": (1.0, 0.2)},
)
