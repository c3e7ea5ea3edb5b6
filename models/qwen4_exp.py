"""Qwen4-Exp (text): Gated DeltaNet layers 3:1 with gated full-attention layers whose keys QSA sparse attention chooses
(models/layers/qsa.py), Qwen3-Next's MoE in every layer (softmax top-k renormalised, a sigmoid-gated shared expert),
gated residual streams in place of the norms (models/layers/gated_residual.py: the embedding repeated into hc_count
streams, each block between a mix and an injection, a last mix as the final norm) and per-layer n-gram embeddings on
some Gated DeltaNet layers (models/layers/ple.py).

HF's reference is regrouped (`reference`): its QSA indexer returns the blocks it chose (HF's returns the attention's
mask; the attention builds that mask from the choice). A layer's per-layer embeddings are added inside the layer on
both sides (the production layer reads the call's token ids from `call_tokens`, which the model or the block row's
caller writes: models/layers/hash_router.py feed_tokens), so its layer row covers them. The text model's final mix
is its `norm`. The same computation in the same order (tests/test_qwen4_exp.py: HF's own logits)."""

from __future__ import annotations

import functools

from models.args import FULL, LINEAR, AttentionArgs, GatedResidualArgs, ModelArgs, NormArgs, PLEArgs, QSAArgs, \
    RopeArgs, RouterArgs
from models.family import Family
from models.mapping import points_without, hf_args, require, rope_theta, sanitize_hf
from models.qwen3_5_moe import gated_deltanet
from models.rules import GATED_DELTANET

INDEXED = "indexed_attention"  # HF's name of the QSA layers' type (the release's config says full_attention)

TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32,
    layer_types=[LINEAR, LINEAR, LINEAR, FULL], max_position_embeddings=256,
    # the release states its interleaved M-RoPE sections ([11, 11, 10] of head_dim 256 x 0.25 = 64 rotated dims); here
    # [1, 1, 0] of 16 x 0.25 = 4 (on text every axis has the token's position: HF's rotation is the 1-D one whatever
    # the sections; llama.cpp's converter writes the release's default [11, 11, 10] where none is stated, which its
    # rope kernel refuses for a rotary width under 64)
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_interleaved": True, "mrope_section": [1, 1, 0]},
    tie_word_embeddings=False, eos_token_id=255, bos_token_id=None, pad_token_id=None,
    # two streams; per-layer embeddings on one layer, the first (1-based ids; the release has them on one layer too, its
    # second: ple_layer_ids [2], and llama.cpp's GGUF holds one n-gram table per model), bigrams and trigrams, two
    # hashed tables each of ~1000 rows (the release: 8 of ~2e7), saved in two shards (the release: 128)
    hc_count=2, hc_lowrank=16, ple_layer_ids=[1], ngram_size=3, heads_per_ngram=2, ngram_vocab_size_base=1000,
    ple_conv_kernel_size=4, split_ngram_parts=2,
    # QSA: blocks of 2 keys, 2 of them kept (budget 4): from the sixth query of the 8-token prompt on, complete blocks
    # are left out
    indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=4, indexer_compress_ratio=2,
)


def to_args(c) -> ModelArgs:
    rp = c.rope_parameters or {}
    types = [FULL if t == INDEXED else t for t in c.layer_types]
    require(set(types) <= {FULL, LINEAR}, f"qwen4_exp: unknown layer_types {sorted(set(c.layer_types))}")
    require((c.output_gate_type or c.hidden_act) == "silu",
            f"qwen4_exp: output_gate_type {c.output_gate_type or c.hidden_act!r} (the Gated DeltaNet's gated norm is silu)")
    require(c.indexer_n_heads is not None, "qwen4_exp: no QSA indexer (indexer_n_heads unset)")
    eos = c.eos_token_id[0] if isinstance(c.eos_token_id, list) else c.eos_token_id
    ple = PLEArgs(tuple(i - 1 for i in c.ple_layer_ids), c.ple_embed_dim, c.ple_conv_kernel_size, c.ngram_size,
                  c.heads_per_ngram, c.ngram_vocab_size_base, c.make_ngram_vocab_size_divisible_by, c.seed,
                  eos) if c.ple_layer_ids else None
    return hf_args(
        c, "qwen4_exp", rope=RopeArgs(rope_theta(c), partial_rotary_factor=rp.get("partial_rotary_factor", 1.0)),
        norm=NormArgs(offset=True),
        attention=AttentionArgs(qk_norm="head", output_gate=True, qkv_bias=c.attention_bias, o_bias=c.attention_bias),
        num_experts=c.num_experts, moe_intermediate_size=c.moe_intermediate_size,
        router=RouterArgs(norm_topk_prob=bool(c.norm_topk_prob)),
        shared_expert_intermediate_size=c.shared_expert_intermediate_size, layer_types=tuple(types),
        linear_attention=gated_deltanet(c),
        qsa=QSAArgs(c.indexer_n_heads, c.indexer_head_dim, c.indexer_budget, c.indexer_compress_ratio),
        gated_residual=GatedResidualArgs(c.hc_count, c.hc_lowrank), ple=ple,
    )


DERIVED = ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets")  # the hash's, from the config


def sanitize(weights: dict, args: ModelArgs) -> dict:
    import re

    import torch

    out, shards = {}, {}
    for k, t in weights.items():
        if k.startswith(("mtp.", "model.visual.")) or k.endswith(DERIVED):
            continue
        k = k.replace("model.language_model.", "model.", 1).replace("model.hyper_connection_mixer.", "model.norm.", 1)
        if m := re.fullmatch(r"(.*\.ngram_embedding)\.shard_(\d+)\.weight", k):  # the release's shards, in order
            shards.setdefault(m[1], {})[int(m[2])] = t
        else:
            out[k] = t
    for name, parts in shards.items():
        out[name + ".weight"] = torch.cat([parts[i] for i in sorted(parts)])
    return sanitize_hf(out, args)


@functools.cache
def reference():
    """HF's Qwen4ExpForCausalLM regrouped (the module docstring): each QSA indexer returns its choice of blocks
    [B, T, k] (one top-k over the complete blocks' scores, [B, T, blocks], the masked ones -inf), the attention builds
    HF's mask from it; a PLE layer's embeddings added by a forward pre-hook; the text model's final mix as `norm`."""
    import math

    import torch
    from transformers.models.qwen4_exp import modeling_qwen4_exp as q

    def indexer_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values):
        # HF 5.23's Qwen4ExpTextQSAIndexer.forward up to the scores, every query's at once; HF's per-query top-k of
        # min(block_topk, complete blocks) as one top-k with the incomplete blocks at -inf
        B, T, _ = hidden_states.shape
        full_cos, full_sin = position_embeddings
        q_, k_ = torch.split(self.index_qk_proj(hidden_states), [self.index_n_heads * self.index_head_dim,
                                                                  self.index_kv_heads * self.index_head_dim], dim=-1)
        qs = self.q_layernorm(q_.reshape(B, T, -1, self.index_head_dim))
        qs = q.apply_rotary_pos_emb(qs, cos=full_cos[:, -T:], sin=full_sin[:, -T:], unsqueeze_dim=2)
        raw_keys = k_.reshape(B, T, -1, self.index_head_dim).squeeze(2)
        if past_key_values is not None:
            raw_keys = past_key_values.update_indexer(raw_keys, self.layer_idx)
        r, nb = self.compress_ratio, raw_keys.shape[1] // self.compress_ratio
        pooled = raw_keys[:, : nb * r].unflatten(1, (nb, r)).float().mean(dim=2).to(raw_keys.dtype)
        starts = torch.arange(nb, device=hidden_states.device) * r
        keys = q.apply_rotary_pos_emb(self.k_layernorm(pooled).unsqueeze(2), cos=full_cos.index_select(1, starts),
                                      sin=full_sin.index_select(1, starts), unsqueeze_dim=2).squeeze(2)
        scores = torch.relu(qs.float() @ keys.float().transpose(-1, -2)[:, None]).sum(dim=2)
        scores = scores / math.sqrt(self.index_head_dim)  # [B, T, nb]
        complete = (starts + r) <= seen_keys(attention_mask)[..., None]
        return scores.masked_fill(~complete, float("-inf")).topk(min(self.block_topk, nb), dim=-1).indices

    def attention_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        # HF 5.23's Qwen4ExpTextAttention.forward, its mask from the indexer's choice: the chosen complete blocks'
        # keys and those after the query's last complete block
        chosen = self.indexer(hidden_states, position_embeddings, attention_mask, past_key_values)
        r = self.indexer.compress_ratio
        block = torch.arange(attention_mask.shape[-1], device=hidden_states.device) // r
        complete = block < (seen_keys(attention_mask) // r)[..., None]  # [B, T, kv]
        selected = torch.where(complete, (chosen[..., None] == block).any(dim=-2), True)[:, None]
        if attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & selected
        else:
            attention_mask = attention_mask.masked_fill(~selected, torch.finfo(attention_mask.dtype).min)
        cos, sin = (x[:, -hidden_states.shape[1]:, :] for x in position_embeddings)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1, self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        query_states, key_states = q.apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if past_key_values is not None:
            key_states, value_states = past_key_values.update(key_states, value_states, self.layer_idx)
        attention = q.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, q.eager_attention_forward)
        attn_output, attn_weights = attention(self, query_states, key_states, value_states, attention_mask, dropout=0.0,
                                              scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous() * torch.sigmoid(gate)
        return self.o_proj(attn_output), attn_weights

    class Qwen4ExpForCausalLM(q.Qwen4ExpForCausalLM):
        def __init__(self, config):
            super().__init__(config)
            text = self.model
            text.__dict__["norm"] = text.hyper_connection_mixer  # (not registered: the state dict is HF's)
            for layer in text.layers:
                if layer.layer_type != "linear_attention":
                    layer.self_attn.forward = attention_forward.__get__(layer.self_attn)
                    layer.self_attn.indexer.forward = indexer_forward.__get__(layer.self_attn.indexer)

    Qwen4ExpForCausalLM.__module__ = q.__name__  # (its architectures entry and class are HF's)
    Qwen4ExpForCausalLM.__qualname__ = "Qwen4ExpForCausalLM"
    return Qwen4ExpForCausalLM


def seen_keys(attention_mask):
    """[B, T]: the keys each query sees under HF's 4-D mask (bool, or additive 0 / min)."""
    visible = attention_mask if attention_mask.dtype.is_floating_point is False else attention_mask == 0
    return visible[:, 0].sum(dim=-1)


def point_view(points, args: ModelArgs, layer=None):
    """HF's points less its per-layer embeddings' conv1d: HF calls the module on the channels-first [B, C, L + T]
    inputs with the carried ones (rows the drill cannot line up by token); the production conv is inline."""
    return points_without(points, lambda n: n == "ple.conv1d")


FAMILY = Family(
    # the text-only config, or the multimodal release's composite one (its text_config is read)
    name="qwen4_exp", model_types=("qwen4_exp_text", "qwen4_exp"), hf_module="qwen4_exp",
    hf_class_name="Qwen4ExpForCausalLM", hf_config_name="Qwen4ExpTextConfig", tiny_config=TINY, to_args=to_args,
    sanitize=sanitize, hf_reference=reference, hf_point_view=point_view,
    rules=(("positive", "moe_intermediate_size", "hc_count", "hc_lowrank"), *GATED_DELTANET),
)
