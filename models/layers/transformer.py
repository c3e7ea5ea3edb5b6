"""The production model: decoder layers (an attention, linear-attention, short-conv, Mamba, Mamba2, lightning or Kimi
delta attention mixer, an MoE or dense MLP, their norms and residuals), the embedding and head, and the one
(layer, kind) -> block map.

Export-friendly: static-shape state buffers (KV cache, conv state, recurrent state),
no data-dependent Python control flow, positions passed explicitly. One forward
serves prefill (T tokens) and decode (T == 1); state is carried in registered
buffers and reset by a call at position 0.

Module names mirror the HF checkpoints (self_attn / linear_attn / mlp.gate /
mlp.experts / mlp.shared_expert ...) so that a family's `sanitize()` is mostly a
prefix strip plus the expert stacking.

Shapes: B batch (1), T tokens in this call, S max_seq_len, H hidden, E experts,
k experts per token, I expert intermediate, nh/kvh heads, hd head dim."""

from __future__ import annotations

import torch
from torch import nn

from models.args import (CONV, FULL, KDA, LIGHTNING, LINEAR, MAMBA, MAMBA2, NONE, SPARSE, STATE_BUFFERS, ModelArgs, block_path,
                         mixer_name, mlp_type)
from models.layers.attention import Attention
from models.layers.block_sparse import BlockSparseAttention, is_block_sparse
from models.layers.compressed_attention import CompressedAttention
from models.layers.dsa import link_sources
from models.layers.dynamic_mask import DynamicMaskAttention
from models.layers.gated_norm import add_gated_norms
from models.layers.gated_residual import GatedResidual, gated_forward, gated_layer, gated_stream
from models.layers.gated_deltanet import GatedDeltaNet
from models.layers.hash_router import HashRouter, feed_tokens
from models.layers.hyper import HyperHead, add_hyper, expand, hyper_stream
from models.layers.inkling import NormedEmbedding, inkling_blocks
from models.layers.relative_logits import RelativeAttention
from models.layers.kda import KimiDeltaAttention
from models.layers.lightning import Lightning
from models.layers.mamba import Mamba
from models.layers.mamba2 import Mamba2
from models.layers.mla import LatentAttention
from models.layers.mla_gated import GatedLatentAttention
from models.layers.mla_scaled import ScaledLatentAttention
from models.layers.moa import MixtureOfAttention
from models.layers.moe import MLP, SparseMoE, clamp_of
from models.layers.moe_beside import MoEBeside, add_dense_beside, feed_forward
from models.layers.muse import WeightlessNorm, muse_layer
from models.layers.norms import norm
from models.layers.ple import PLE
from models.layers.qsa import QSAAttention
from models.layers.product_key_moe import ProductKeyMoE
from models.layers.short_conv import ShortConv
from models.layers.zaya_router import alone, link_routers, zaya_layer, zaya_stream  # noqa: F401  (alone: a probe)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs, i: int, dtype=torch.float32):
        super().__init__()
        self.layer_type = a.layer_types[i]
        if self.layer_type == LINEAR:
            self.linear_attn = GatedDeltaNet(a, dtype)
        elif self.layer_type == CONV:
            self.conv = ShortConv(a, dtype)
        elif self.layer_type == MAMBA:
            self.mamba = Mamba(a, dtype)
        elif self.layer_type == MAMBA2:
            self.mamba = Mamba2(a, dtype)
        elif self.layer_type == NONE:  # (Nemotron-H: a block with an MLP alone)
            pass
        elif self.layer_type == LIGHTNING:
            self.self_attn = Lightning(a, i, dtype)
        elif self.layer_type == KDA:
            self.self_attn = KimiDeltaAttention(a, dtype)
        elif a.attention.kind == "mla":  # (A.X-K2's fused q/gate projection: mla_gated.py; dots3's: mla_scaled.py)
            self.self_attn = (GatedLatentAttention if a.attention.output_gate else ScaledLatentAttention
                              if a.attention.mla_scaled else LatentAttention)(a, dtype, i)
        elif a.attention.kind == "moa":
            self.self_attn = MixtureOfAttention(a, dtype, i)
        elif a.attention.kind == "compressed":  # DeepSeek-V4
            self.self_attn = CompressedAttention(a, dtype, i)
        elif a.attention.kind == "relative":  # Inkling: relative logits, no rope
            self.self_attn = RelativeAttention(a, dtype, i)
        else:
            self.self_attn = (BlockSparseAttention if is_block_sparse(a, i) else
                              DynamicMaskAttention if a.attention.keep_window else Attention)(a, dtype, i)
        kind = mlp_type(a, i)
        self.beside = a.moe_beside_mlp and kind == SPARSE  # Gemma 4: a dense MLP beside the MoE block
        if kind != NONE:  # (Nemotron-H: a block with a mixer alone has none)
            sparse = MoEBeside if self.beside else ProductKeyMoE if a.product_key_moe else SparseMoE  # (Doge's)
            self.mlp = sparse(a) if kind == SPARSE else MLP(
                a.hidden_size, a.intermediate_size, a.mlp_bias, a.mlp_activation, clamp_of(a))
        if self.beside:
            add_dense_beside(self, a)
        if a.router.hash_layers and a.router.hash_layers[i]:  # DeepSeek-V4's hash_moe: experts by token id
            self.mlp.gate = HashRouter(a)
        if a.residual_scales:  # Doge: each residual times a learned per-channel scale
            self.input_residual = nn.Parameter(torch.ones(a.hidden_size))
            self.post_attention_residual = nn.Parameter(torch.ones(a.hidden_size))
        if a.layer_scalar:  # Gemma 4: the layer's output times a learned scalar
            self.layer_scalar = nn.Parameter(torch.ones(1))
        self.placement = a.norm.placement  # (models.args.NormArgs)
        self.parallel = a.parallel_block  # Cohere: one input norm, no post-attention norm
        self.has_mixer, self.has_mlp = self.layer_type != NONE, kind != NONE
        if self.placement != "post" and self.has_mixer:
            self.input_layernorm = norm(a, a.hidden_size)
        if not self.parallel and self.has_mlp:
            self.post_attention_layernorm = norm(a, a.hidden_size)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = norm(a, a.hidden_size)
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm(a, a.hidden_size)
        if a.norm.gate_rank:  # A.X-K2: gated input and post-attention norms
            add_gated_norms(self, a, i)
        self.residual_multiplier = a.multipliers.residual
        rf = a.residual_factors  # MiniMax-Text-01: (alpha, beta) of the attention's and of the MLP's residual
        self.factors = None if rf is None else (rf.linear if self.layer_type == LIGHTNING else rf.full) + rf.mlp
        self.shared_mlp = None  # Granite's shared MLP beside the MoE block (ModelArgs.shared_expert_beside)
        self.hyper = a.hyper is not None  # hyper-connections: the stream is N streams [B, T, N, H]
        if self.hyper:
            add_hyper(self, a.hyper, a.hidden_size)
        if a.shared_expert_beside and a.shared_expert_intermediate_size and mlp_type(a, i) == SPARSE:
            self.shared_mlp = MLP(a.hidden_size, a.shared_expert_intermediate_size, a.mlp_bias)
        if a.inkling is not None:  # Inkling: its attention and MoE, a short conv on each block's output
            inkling_blocks(self, a, i, dtype)
        if a.muse is not None:  # Muse Spark: its attention, MoE, norms and residual gates (models/layers/muse.py)
            muse_layer(self, a, i, dtype)
        if a.qsa is not None and self.layer_type == FULL:  # Qwen4-Exp: QSA sparse attention (models/layers/qsa.py)
            self.self_attn = QSAAttention(a, dtype, i)
        if a.gated_residual is not None:  # Qwen4-Exp: gated residual streams, per-layer embeddings on some layers
            gated_layer(self, a)
            if a.ple is not None and i in a.ple.layers:
                self.ple = PLE(a, a.ple.layers.index(i), dtype)
        if a.zaya is not None:  # ZAYA: CCA attention, its router's cross-layer state, scaled residuals
            zaya_layer(self, a, i, dtype)

    @property
    def attn(self) -> nn.Module:
        return getattr(self, mixer_name(self.layer_type))

    def forward(self, x, pos):
        y = self.stream(x, pos)
        return y * self.layer_scalar if hasattr(self, "layer_scalar") else y

    def stream(self, x, pos):  # the stream after the layer's blocks
        if hasattr(self, "attn_hyper_connection"):  # Qwen4-Exp (models/layers/gated_residual.py)
            return gated_stream(self, x, pos)
        if hasattr(self, "post_mlp_residual_scale"):  # ZAYA (models/layers/zaya_router.py)
            return zaya_stream(self, x, pos)
        if self.hyper:  # DeepSeek-V4, HY-V4, GLM-5.3: each block between a collapse and an expansion of the streams
            return hyper_stream(self, x, pos)
        if self.parallel:  # Cohere: attention and MLP on the same normed input, both onto the residual
            h = self.input_layernorm(x)
            return x + self.attn(h, pos) + self.ffn(h)
        if hasattr(self, "post_attention_residual_gate"):  # Muse Spark: gated residual adds (models/layers/muse.py)
            h = self.post_attention_residual_gate(x, self.attention_branch(x, pos))
            return self.post_feedforward_residual_gate(h, self.mlp_branch(h))
        if self.placement != "pre":  # the blocks' outputs normed before their residual adds
            h = x + self.attention_branch(x, pos)
            return h + self.mlp_branch(h)
        if self.factors is not None:  # MiniMax-Text-01: each residual the normed input, both scaled
            a_attn, b_attn, a_mlp, b_mlp = self.factors
            h = self.input_layernorm(x)
            h = self.post_attention_layernorm(h * a_attn + self.attn(h, pos) * b_attn)
            return h * a_mlp + self.ffn(h) * b_mlp
        if not (self.has_mixer and self.has_mlp):  # Nemotron-H: one norm, one block, one residual
            return x + (self.attn(self.input_layernorm(x), pos) if self.has_mixer
                        else self.ffn(self.post_attention_layernorm(x)))
        if self.residual_multiplier != 1.0:  # Granite
            h = x + self.attn(self.input_layernorm(x), pos) * self.residual_multiplier
            return h + self.ffn(self.post_attention_layernorm(h)) * self.residual_multiplier
        if hasattr(self, "attn_sconv"):  # Inkling: each block's output through its short conv before its residual
            h = x + self.attn_sconv(self.attn(self.input_layernorm(x), pos), pos)
            return h + self.mlp_sconv(self.ffn(self.post_attention_layernorm(h)), pos)
        if hasattr(self, "input_residual"):  # Doge: the residuals scaled per channel
            h = self.input_residual * x + self.attn(self.input_layernorm(x), pos)
            return self.post_attention_residual * h + self.ffn(self.post_attention_layernorm(h))
        h = x + self.attn(self.input_layernorm(x), pos)
        return h + self.ffn(self.post_attention_layernorm(h))

    def ffn(self, x):  # the MLP block, plus a shared MLP beside it (Granite's: on the same normed input)
        y = self.mlp(x)
        return y if self.shared_mlp is None else y + self.shared_mlp(x)

    def attention_branch(self, x, pos):
        """What a "post" or "sandwich" layer adds to the stream x for its attention: the attention's
        output normed (of x normed first, sandwich), times the residual multiplier."""
        y = self.post_attention_layernorm(self.attn(x if self.placement == "post" else self.input_layernorm(x), pos))
        return y * self.residual_multiplier if self.residual_multiplier != 1.0 else y

    def mlp_branch(self, h):
        """Likewise for its MLP (or MoE) on the stream h (Gemma 4's: the dense MLP's and the MoE block's, normed)."""
        if self.beside:
            return feed_forward(self, h)
        y = self.post_feedforward_layernorm(self.mlp(h if self.placement == "post" else self.pre_feedforward_layernorm(h)))
        return y * self.residual_multiplier if self.residual_multiplier != 1.0 else y


class Transformer(nn.Module):
    """tokens [B, T] + positions [T] -> logits [B, T, V]; state carried in buffers."""

    def __init__(self, a: ModelArgs, dtype=torch.float32):
        super().__init__()
        self.args = a
        # weights come from the checkpoint: no init (normal_ on meta imports torch._dynamo, 2 s)
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size, _weight=torch.empty(a.vocab_size, a.hidden_size))
        if a.inkling is not None:  # Inkling: the embeddings RMS-normed
            self.embed_tokens = NormedEmbedding(a)
        self.layers = nn.ModuleList(DecoderLayer(a, i, dtype) for i in range(a.num_hidden_layers))
        if a.attention.dsa is not None and a.attention.dsa.shared:  # GLM-5: shared layers read a full layer's choice
            link_sources(self.layers)
        if a.zaya is not None:  # ZAYA: the embeddings scaled with a bias; each router reads the previous one's state
            self.input_hidden_states_scale = nn.Parameter(torch.ones(a.hidden_size))
            self.input_hidden_states_bias = nn.Parameter(torch.zeros(a.hidden_size))
            link_routers(self.layers)
        if a.hyper is not None:  # the streams collapsed before the final norm
            self.hc_head = HyperHead(a.hyper, a.hidden_size)
        if a.muse is not None:  # Muse Spark: the embeddings weightless-normed
            self.embed_norm = WeightlessNorm(a.rms_norm_eps)
        self.norm = norm(a, a.hidden_size) if a.gated_residual is None else GatedResidual(a, combine=False)
        self.lm_head = LMHead(a)

    def forward(self, tokens, pos):
        if self.args.router.hash_layers or self.args.ple is not None:  # the call's token ids, read inside layers
            feed_tokens(self, tokens)  # (DeepSeek-V4's hash routers, Qwen4-Exp's per-layer n-gram embeddings)
        if self.args.gated_residual is not None:  # Qwen4-Exp: N streams, per-layer embeddings before some layers
            return gated_forward(self, tokens, pos)
        x = self.embed_tokens(tokens)
        if hasattr(self, "embed_norm"):
            x = self.embed_norm(x)
        if self.args.zaya is not None:
            x = (x + self.input_hidden_states_bias) * self.input_hidden_states_scale
        if self.args.multipliers.embedding != 1.0:  # Granite
            x = x * self.args.multipliers.embedding
        if self.args.hyper is not None:
            x = expand(self.args.hyper, x)
        for layer in self.layers:
            x = layer(x, pos)
        if self.args.hyper is not None:
            x = self.hc_head(x)
        if self.args.inkling is not None:  # Inkling: the final norm's output divided by its muP width multiplier
            return self.lm_head(self.norm(x) / self.args.inkling.head_divisor)
        return self.lm_head(self.norm(x))


class LMHead(nn.Linear):
    """The output projection (with PhiMoE's bias; Granite divides the logits by logits_scaling; Gemma 4 caps them)."""

    def __init__(self, a: ModelArgs):
        super().__init__(a.hidden_size, a.vocab_size, bias=a.lm_head_bias)
        self.logits_scaling = a.multipliers.logits_scaling
        self.softcap = a.multipliers.logit_softcap  # Gemma 4's final_logit_softcapping (0: none)

    def forward(self, x):
        y = super().forward(x)
        y = y / self.logits_scaling if self.logits_scaling != 1.0 else y
        return torch.tanh(y / self.softcap) * self.softcap if self.softcap else y


def reset_state(module: nn.Module, keep_routers: bool = False) -> None:
    """Zero every state buffer under `module` (KV cache, conv and recurrent state); `keep_routers`: not the routers'
    cross-layer state (ZAYA's router_state: a decoder layer run alone leaves its router row's, `alone`)."""
    for name, buf in module.named_buffers():
        last = name.rsplit(".", 1)[-1]
        if last in STATE_BUFFERS and not (keep_routers and last == "router_state"):
            buf.zero_()


def block_fn(model: Transformer, layer: int | None, kind: str):
    """(module to reset, fn(x [1, T, H], pos [T]) -> output) for one block of the production model:
    the module at models.args.block_path (the one (layer, kind) -> module map every backend uses)."""
    module = model.get_submodule(block_path(model.args, layer, kind))
    if kind in ("attention", "layer"):
        return module, module
    at = (lambda pos: (pos,)) if getattr(module, "takes_pos", False) else (lambda pos: ())  # (ZAYA's: its state)
    if kind == "router":
        return module, lambda x, pos: module(x.reshape(-1, x.shape[-1]), *at(pos))
    return module, lambda x, pos: module(x, *at(pos))
