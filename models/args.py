"""The production model's configuration, resolved from an HF config by the family's mapping:
plain data, no torch (a warm check of a backend that runs no torch reads it from the cache)."""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Literal

from models.kinds import check_kinds  # noqa: F401  (models.args.check_kinds, as before)
from models.mixer_args import KDAArgs, LinearAttentionArgs, Mamba2Args, MambaArgs, ShortConvArgs  # noqa: F401
from models.block_sparse_args import BlockSparse  # noqa: F401
from models.hyper_args import HyperArgs  # noqa: F401
from models.compressed_args import CompressedArgs  # noqa: F401
from models.muse_args import MuseArgs  # noqa: F401
from models.zaya_args import ZayaArgs  # noqa: F401
from models.inkling_args import InklingArgs  # noqa: F401
from models.qwen4_args import GatedResidualArgs, PLEArgs, QSAArgs  # noqa: F401

FULL, LINEAR = "full_attention", "linear_attention"
CONV = "conv"  # LFM2's gated short-convolution mixer (models/layers/short_conv.py) in the attention's place
MAMBA = "mamba"  # a Mamba mixer (models/layers/mamba.py: Jamba) in the attention's place
LIGHTNING = "lightning"  # MiniMax-Text-01's lightning attention (models/layers/lightning.py), its module self_attn
MAMBA2 = "mamba2"  # a Mamba2 mixer (models/layers/mamba2.py: Granite 4.0-H, Nemotron-H) in the attention's place
KDA = "kda"  # Kimi delta attention (models/layers/kda.py: Kimi-Linear), its module self_attn
# attention over a window of the last `sliding_window` positions (gpt-oss, Mixtral), or within
# fixed chunks of `chunk_size` positions (Llama 4's rope layers; AttentionArgs)
SLIDING, CHUNKED = "sliding_attention", "chunked_attention"
SPARSE, DENSE = "sparse", "dense"  # a layer's MLP: router + experts, or one plain MLP
NONE = "none"  # a layer without a mixer, or without an MLP: Nemotron-H's blocks each hold one (a mixer or an MLP)
LAYER_TYPES = (FULL, LINEAR, SLIDING, CHUNKED, CONV, MAMBA, MAMBA2, LIGHTNING, KDA, NONE)
MLP_TYPES = (SPARSE, DENSE, NONE)
# the layer types whose mixer is recurrent (no softmax attention)
RECURRENT = (LINEAR, CONV, MAMBA, MAMBA2, LIGHTNING, KDA)
# the KV cache (MLA: the compressed latent and the shared rotary key), the Gated DeltaNet state (a short
# convolution's and a Mamba2's conv_state and recurrent_state too)
# DeepSeek sparse attention's indexer: its key cache and (a layer whose selection later layers share) its selection
STATE_BUFFERS = ("k_cache", "v_cache", "latent_cache", "rope_key_cache", "conv_state", "recurrent_state",
                 "index_key_cache", "index_selection", "ngram_context", "compress_kv", "compress_gate",
                 "call_tokens", "router_state", "index_gate_cache")


def from_json(cls, d: dict):
    """A dataclass of this module from its JSON form (dataclasses.asdict read back: the tuples came
    back as lists, the groups as dicts)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v, t = d[f.name], hints[f.name]
        group = next((g for g in (t, *typing.get_args(t)) if is_dataclass(g)), None)
        if isinstance(v, dict) and group is not None:  # (a group with variants reads its own: from_dict)
            v = group.from_dict(v) if hasattr(group, "from_dict") else from_json(group, v)
        elif isinstance(v, list):
            v = tuple(v)
        out[f.name] = v
    unknown = set(d) - set(out)
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(unknown))}")
    return cls(**out)


# ------------------------------------------------------------------ rotary position embedding
@dataclass(frozen=True)
class YaRN:
    """YaRN's scaling (rope_type "yarn") as HF 5.23's _compute_yarn_parameters reads it (models.yarn).
    mscale / mscale_all_dim: the attention factor's (mscale 0: unused); attention_factor: HF's own
    override of that factor (None: derived from factor and the mscales)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    attention_factor: float | None = None


@dataclass(frozen=True)
class LongRoPE:
    """LongRoPE as HF 5.23's PhiMoE applies it: the short factors divide the frequencies at every
    length; cos/sin times short_mscale, or long_mscale once a call reaches past
    original_max_position_embeddings."""

    original_max_position_embeddings: int
    short_mscale: float
    long_mscale: float
    short_factor: tuple[float, ...]


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3's rope scaling (HF _compute_llama3_parameters)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


# "proportional" (Gemma 4): rotate-half over the whole head, its first partial_rotary_factor of frequency slots rotating
SCALINGS = {"default": type(None), "yarn": YaRN, "longrope": LongRoPE, "llama3": Llama3Scaling, "proportional": type(None)}


@dataclass(frozen=True)
class RopeArgs:
    """The rotary position embedding: base `theta`, the scaling variant `kind` with its parameters
    (`scaling`: None for default RoPE), the rotated fraction of each head, and how it rotates."""

    theta: float
    kind: Literal["default", "yarn", "longrope", "llama3", "proportional"] = "default"
    scaling: YaRN | LongRoPE | Llama3Scaling | None = None
    partial_rotary_factor: float = 1.0
    interleave: bool = False  # rotary pairs (x0, x1), (x2, x3) ... instead of rotate-half
    # q and k rotated in fp32 (cos/sin kept in fp32) and cast back to the activation dtype, as HF's
    # ERNIE 4.5 ("full precision"), DeepSeek-V2 and Llama 4 (complex products of x.float()) do;
    # else cos/sin in the activation dtype and the rotation in it (Llama's apply_rotary_pos_emb)
    fp32: bool = False
    # per layer: () = every attention layer rotates; else 1 (rope) / 0 (no rope) per layer (Llama 4)
    per_layer: tuple[int, ...] = ()
    # per layer type: the rope of the SLIDING layers where it is not the others' (rope_parameters keyed by
    # layer type: Mellum, Laguna, MiMo-V2-Flash); None: every layer's is this one
    sliding: RopeArgs | None = None
    # per layer: its own base in place of `theta`, 0 for no rope on it (GraniteMoE-SWA's layer_rope_theta); ()
    layer_theta: tuple[float, ...] = ()

    def __post_init__(self):
        check_kinds(self)
        if not isinstance(self.scaling, SCALINGS[self.kind]):
            raise ValueError(f"RopeArgs.scaling: {type(self.scaling).__name__} for kind {self.kind!r} "
                             f"(wants {SCALINGS[self.kind].__name__})")

    @classmethod
    def scaled(cls, theta: float, scaling: YaRN | LongRoPE | Llama3Scaling | None, **how) -> RopeArgs:
        """RopeArgs whose kind is its scaling's (None: default RoPE); `how` sets the rest."""
        return cls(theta, next(k for k, t in SCALINGS.items() if isinstance(scaling, t)), scaling, **how)

    @classmethod
    def from_dict(cls, d: dict) -> RopeArgs:
        """From its JSON form: the scaling's parameters are those of its kind."""
        scaling = d.get("scaling")
        if isinstance(scaling, dict):
            d = {**d, "scaling": from_json(SCALINGS[d.get("kind", "default")], scaling)}
        return from_json(cls, d)

    def rotates(self, layer: int) -> bool:
        return (not self.per_layer or bool(self.per_layer[layer])) and (not self.layer_theta
                                                                        or bool(self.layer_theta[layer]))

    def of_layer(self, layer: int, layer_type: str) -> RopeArgs:
        """The rope of one layer: its type's (`sliding`), at its own base (`layer_theta`)."""
        r = self.sliding if self.sliding is not None and layer_type == SLIDING else self
        if self.layer_theta and self.layer_theta[layer]:
            r = replace(r, theta=float(self.layer_theta[layer]))
        return r

    def own(self, layer: int, layer_type: str) -> bool:
        """Does the layer rotate with frequencies other than the model's `theta` (per type or per layer)?"""
        r = self.of_layer(layer, layer_type)
        return self.rotates(layer) and (r.theta, r.partial_rotary_factor) != (self.theta, self.partial_rotary_factor)


# ------------------------------------------------------------------ attention
@dataclass(frozen=True)
class MLA:
    """DeepSeek's multi-head latent attention: q (optionally through a q_lora_rank bottleneck), a
    kv_lora_rank latent plus one shared rotary key cached per position, heads of qk_nope + qk_rope
    dims for q.k and v_head_dim for the values."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q_proj directly
    norm_eps: float = 1e-6  # the q and kv latents' RMSNorm eps (DeepSeek's 1e-6; GLM-5.3's rms_norm_eps)


@dataclass(frozen=True)
class DSA:
    """DeepSeek sparse attention (models/layers/dsa.py): a lightning indexer (index_n_heads heads of
    index_head_dim, its rotary part the MLA's qk_rope_head_dim) picks the index_topk keys each query attends to.
    rope_interleave: the indexer's rotation on interleaved pairs (GLM-5) or half-split (DeepSeek-V3.2, where the
    MLA's own is interleaved). shared, per layer: True where the layer has no indexer and attends to the keys the
    previous full layer chose (GLM-5's indexer_types "shared"); () none."""

    index_topk: int
    index_head_dim: int
    index_n_heads: int
    rope_interleave: bool = False
    shared: tuple[bool, ...] = ()
    weights_fp32: bool = True  # weights_proj kept in fp32 (HF's _keep_in_fp32_modules; dots3 keeps none)
    rope_last: bool = False  # the rotation on the last qk_rope_head_dim dims of q and k (HY-V4), not the first
    k_norm_eps: float = 1e-6  # the keys' LayerNorm eps (HY-V4: rms_norm_eps)
    k_norm_fp32: bool = False  # the keys' LayerNorm in fp32, its weights kept fp32 (HY-V4's _keep_in_fp32_modules)
    # GLM-5.3's k-pool indexer (models/layers/dsa_pool.py): pools of `kpool` keys scored and chosen (index_topk / kpool
    # of them), each pool's key a learned softmax mix of its keys; kpool_tail: the incomplete last pool always kept
    kpool: int = 0
    kpool_tail: bool = True


@dataclass(frozen=True)
class AttentionArgs:
    """The softmax attention layers: "gqa" (q/k/v projections, num_key_value_heads shared heads),
    "mla" (its dimensions in `mla`) or "moa" (JetMoE's mixture of attention heads: routed query and
    output projections over shared kv heads, num_experts / num_experts_per_tok of the model's), and their
    options."""

    kind: Literal["gqa", "mla", "moa", "compressed", "relative"] = "gqa"  # relative: Inkling's (relative_logits.py)
    mla: MLA | None = None
    # q/k RMSNorm: per head (Qwen3), over the whole projection (OLMoE), or weightless after the
    # rotation (Llama 4's "l2", rope layers only)
    qk_norm: Literal["none", "head", "flat", "l2"] = "none"
    qk_norm_after_rope: bool = False  # the per-head q/k norm applied to the rotated q/k (HunYuan), not before
    output_gate: bool = False  # sigmoid gate on the attention output (Qwen3.5)
    # a gate on the attention output (before o_proj) from its own projection of the attention's input
    # (g_proj): its activation ("none": no such gate; Laguna's softplus, computed in fp32) and its width
    # ("head": one value per head over its head_dim; "element": one per channel)
    gate_act: Literal["none", "softplus", "sigmoid"] = "none"
    gate_width: Literal["head", "element"] = "head"
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None  # SLIDING layers
    chunk_size: int = 0  # CHUNKED layers
    sinks: bool = False  # a learned logit per head that takes part in the softmax (gpt-oss)
    clip_qkv: float | None = None  # q, k and v clamped to [-clip_qkv, clip_qkv] after their projections (DBRX)
    sinks_on: Literal["all", "sliding"] = "all"  # the layers that have them (MiMo-V2-Flash: the SLIDING ones)
    v_head_dim: int = 0  # the value heads' width where it is not head_dim (MiMo-V2-Flash); 0: head_dim
    value_scale: float = 1.0  # v times this before the attention (MiMo-V2-Flash's attention_value_scale)
    # Llama 4's no-rope layers: q scaled by log(floor((pos + 1) / floor_scale) + 1) * attn_scale + 1
    temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    # Mistral 4's position-dependent query scale (rope_parameters' llama_4_scaling_beta): every query, after its
    # rotation, times 1 + q_position_beta * log(1 + floor(pos / q_position_period)); 0: none (MLA layers only)
    q_position_beta: float = 0.0
    q_position_period: float = 1.0
    dsa: DSA | None = None  # DeepSeek sparse attention on the MLA layers (kind "mla" only; not on SLIDING layers)
    mla_sliding: MLA | None = None  # the SLIDING layers' MLA dimensions where not mla's (dots3)
    mla_scaled: bool = False  # dots3's MLA: latents scaled, rotary key normed, sliding layers (models/layers/mla_scaled.py)
    block_sparse: BlockSparse | None = None  # MiniMax-M3's block-sparse attention on its layers (kind "gqa")
    compressed: CompressedArgs | None = None  # DeepSeek-V4's attention (kind "compressed": models/layers/compressed_attention.py)
    k_eq_v: bool = False  # FULL layers: v is k's projection, no v_proj (Gemma 4's attention_k_eq_v)
    v_norm: bool = False  # v RMS-normed per head, no gain (Gemma 4)
    keep_window: int = 0  # Doge's dynamic mask attention (models/layers/dynamic_mask.py): keys kept per query; 0: none

    def __post_init__(self):
        check_kinds(self)
        if (self.kind == "mla") != (self.mla is not None):
            raise ValueError(f"AttentionArgs.mla: {self.mla!r} for kind {self.kind!r} (its dimensions go with 'mla' only)")
        if self.q_position_beta and (self.kind != "mla" or not self.q_position_period > 0):
            raise ValueError(f"AttentionArgs.q_position_beta {self.q_position_beta} needs kind 'mla' (not "
                             f"{self.kind!r}) and a positive q_position_period (got {self.q_position_period})")
        if self.dsa is not None and (self.kind != "mla" or not self.mla.q_lora_rank):
            raise ValueError("AttentionArgs.dsa needs kind 'mla' with a q_lora_rank "
                             "(the indexer's queries are its q_resid)")


# ------------------------------------------------------------------ routing and experts
@dataclass(frozen=True)
class RouterArgs:
    """scores = `scoring` of the logits (fp32: softmax over the experts, a sigmoid each, or
    sparsemixer's logits); the experts are *selected* on scores + e_score_correction_bias
    (`correction_bias`), among the topk_group of n_group groups ranked by group_score ("top2": sum
    of the group's best two, DeepSeek-V3; "max": V2); the weights are the selected experts' scores
    (renormalised if norm_topk_prob, then times routed_scaling_factor)."""

    scoring: Literal["softmax", "sigmoid", "sparsemixer", "sqrtsoftplus"] = "softmax"  # sqrtsoftplus: DeepSeek-V4's
    norm_topk_prob: bool = False
    norm_topk_min: float = 0.0  # renormalise top-k weights by max(sum, norm_topk_min) (ERNIE 4.5)
    # what norm_topk_prob renormalises by: 1, the weights' sum; else their p-norm (DBRX's moe_normalize_expert_weights)
    norm_p: float = 1.0
    norm_eps: float = 1e-20  # added to the weights' sum it renormalises by (LFM2: 1e-6)
    correction_bias: bool = False  # e_score_correction_bias: decides the choice, never the weights
    logit_bias: bool = False  # a bias on the router's logits (gpt-oss), not a selection bias
    n_group: int = 1
    topk_group: int = 1
    group_score: Literal["top2", "max"] = "top2"
    group_mask_zero: bool = False  # the groups left out scored 0 for the choice, not -inf (A.X-K2's router)
    routed_scaling_factor: float = 1.0
    fp32: bool = False  # the logits in fp32 whatever the model's dtype
    # the router's parameters kept in fp32 at a reduced precision ("weight",
    # "e_score_correction_bias"), as HF's _keep_in_fp32_modules_strict keeps them (ERNIE 4.5: both;
    # DeepSeek-V3, GLM-4.5, dots.llm1: the correction bias); else stored in the model's dtype
    fp32_params: tuple[str, ...] = ()
    weights_in_model_dtype: bool = True  # Mixtral keeps top-k weights in fp32
    weights_on_input: bool = False  # expert(x * w) instead of w * expert(x) (Llama 4)
    jitter_eps: float = 0.0  # sparsemixer's threshold (PhiMoE's router_jitter_noise)
    logit_softcap: float = 0.0  # the logits (fp32) capped as tanh(logits / c) * c before scoring (Laguna); 0: none
    # what the choice ranks (the correction bias added to it): the scores (DeepSeek-V3), or the fp32 logits
    # themselves (Kolibri-1: top-k of logits + bias, the weights the sigmoid of the chosen logits)
    choice_on: Literal["scores", "logits"] = "scores"
    input_norm: bool = False  # the input RMS-normed, times a learned `scale` [H] and H^-0.5 (Gemma 4)
    hash_layers: tuple[bool, ...] = ()  # per layer: experts chosen by a frozen tid2eid[token] table (DeepSeek-V4's hash_moe)
    per_expert_scale: bool = False  # Gemma 4: the top-k weights times a learned scale per expert, in its MoE block

    def __post_init__(self):
        check_kinds(self)


@dataclass(frozen=True)
class ExpertArgs:
    """The routed experts' MLP: "swiglu" silu(gate) * up; "clamped_swiglu" (gpt-oss) gate clamped
    to <= swiglu_limit, up to [-swiglu_limit, swiglu_limit], gate * sigmoid(swiglu_alpha * gate) * (up + 1);
    "relu2" relu(up)^2, no gate (Nemotron-H: its gate_up_proj holds the up rows alone); "geglu" gelu_tanh(gate) * up;
    "cswiglu" silu(gate clamped to <= swiglu_limit) * up clamped to [-swiglu_limit, swiglu_limit] (HY-V4, GLM-5.3)."""

    activation: Literal["swiglu", "clamped_swiglu", "relu2", "geglu", "cswiglu"] = "swiglu"  # relu2: relu(up)^2, no gate (Nemotron-H)
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    bias: bool = False  # biases on the experts' projections (gpt-oss)

    def __post_init__(self):
        check_kinds(self)


# ------------------------------------------------------------------ norms and multipliers
@dataclass(frozen=True)
class NormArgs:
    """The norms of the hidden state (and of q/k): RMSNorm (eps: rms_norm_eps) or LayerNorm with
    bias (PhiMoE)."""

    kind: Literal["rms", "layer"] = "rms"
    offset: bool = False  # (1 + w) RMSNorm, zero-centred weights (Qwen3.5)
    # RMSNorm's gain applied in fp32 and the product rounded once: (w * x_normed).to(dtype), as HF's
    # GptOssRMSNorm does; else w * x_normed.to(dtype) (Llama's: two roundings)
    gain_fp32: bool = False
    bias: bool = True  # LayerNorm's bias (DBRX's and Cohere's LayerNorms have none)
    # where a decoder layer's norms sit: "pre" before each block (input_layernorm, post_attention_layernorm
    # before the MLP: Llama's); "post" on each block's output before its residual add and none before
    # (post_attention_layernorm, post_feedforward_layernorm: OLMo 2, FlexOlmo); "sandwich" both
    # (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm)
    placement: Literal["pre", "post", "sandwich"] = "pre"
    gate_rank: int = 0  # A.X-K2: input (and sparse layers' post-attention) norms gated (models/layers/gated_norm.py)

    def __post_init__(self):
        check_kinds(self)


@dataclass(frozen=True)
class Multipliers:
    """Granite's: the embeddings times `embedding`, each block's output times `residual` before
    its residual add, `attention` as the softmax scale (0: head_dim^-0.5), the logits divided by
    `logits_scaling`."""

    embedding: float = 1.0
    residual: float = 1.0
    attention: float = 0.0
    logits_scaling: float = 1.0
    logit_softcap: float = 0.0  # the logits capped, tanh(logits / c) * c (Gemma 4's final_logit_softcapping); 0: none


@dataclass(frozen=True)
class ResidualFactors:
    """MiniMax-Text-01's residuals, taken from the normed input: h = alpha * norm(x) + beta * block(norm(x)), with
    (alpha, beta) for the attention (the full and the lightning layers' own) and for the MLP."""

    full: tuple[float, float] = (1.0, 1.0)
    linear: tuple[float, float] = (1.0, 1.0)
    mlp: tuple[float, float] = (1.0, 1.0)


# ------------------------------------------------------------------ the model
@dataclass(frozen=True)
class ModelArgs:
    """The model's dimensions, its layer pattern, and one group per mechanism (a family sets the
    groups it uses; the others keep their defaults)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    layer_types: tuple[str, ...]  # per layer: one of LAYER_TYPES
    rope: RopeArgs
    tie_word_embeddings: bool = False
    max_seq_len: int = 256
    # the MLP of each layer (SPARSE / DENSE); () = every layer SPARSE. A DENSE layer's MLP has
    # `intermediate_size` (DeepSeek's first_k_dense_replace, Qwen2's mlp_only_layers)
    mlp_types: tuple[str, ...] = ()
    intermediate_size: int = 0
    # the shared expert (0: none): sigmoid-gated (Qwen: shared_expert + shared_expert_gate) or
    # always on (DeepSeek: shared_experts, n_shared_experts x moe_intermediate_size wide)
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True
    # the always-on shared expert sits beside the MoE block, on the decoder layer (Granite's shared_mlp:
    # layers.{i}.shared_mlp, its output added to the routed experts' before the residual): the MoE block
    # checked is then the routed experts alone, as HF's block_sparse_moe is
    shared_expert_beside: bool = False
    # the routed and shared experts' outputs averaged, (routed + shared) / 2 (Cohere2-MoE's
    # shared_expert_combination_strategy "average"); else summed
    shared_expert_average: bool = False
    # the attention and the MLP in parallel on one input norm, both added to the residual:
    # x + attn(norm(x)) + mlp(norm(x)) (Cohere's; the layer has no post-attention norm)
    parallel_block: bool = False
    moe_bias: bool = False  # a bias added to the MoE block's output (JetMoE)
    mlp_bias: bool = False  # biases on the dense and shared-expert MLPs (ERNIE 4.5's use_bias)
    # the dense and shared-expert MLPs' activation: "swiglu" down(silu(gate) * up), "relu2" down(relu(up)^2) (no gate)
    mlp_activation: Literal["swiglu", "relu2", "geglu", "clamped_swiglu", "cswiglu"] = "swiglu"  # clamped: the experts' (MiniMax-M3; cswiglu DeepSeek-V4)
    # an RMSNorm on the MoE block's output (routed + shared experts), before the residual add: the sparse
    # layers' mlp.post_mlp_layernorm (A.X-K1)
    moe_output_norm: bool = False
    lm_head_bias: bool = False
    attention: AttentionArgs = AttentionArgs()
    linear_attention: LinearAttentionArgs | None = None  # the LINEAR layers'
    short_conv: ShortConvArgs | None = None  # the CONV layers'
    mamba: MambaArgs | None = None  # the MAMBA layers'
    mamba2: Mamba2Args | None = None  # the MAMBA2 layers'
    kda: KDAArgs | None = None  # the KDA layers'
    router: RouterArgs = RouterArgs()
    experts: ExpertArgs = ExpertArgs()
    norm: NormArgs = NormArgs()
    multipliers: Multipliers = Multipliers()
    residual_factors: ResidualFactors | None = None  # MiniMax-Text-01's (None: x + block(norm(x)))
    # per layer: its q heads / kv heads where a layer's are not num_attention_heads / num_key_value_heads
    # (Laguna's num_attention_heads_per_layer, MiMo-V2-Flash's doubled kv heads on its SLIDING layers); ()
    layer_heads: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_head_dim: tuple[int, ...] = ()  # per layer: its heads' width where not head_dim (Gemma 4's full layers); ()
    moe_beside_mlp: bool = False  # Gemma 4: a sparse layer's MoE (models/layers/moe_beside.py) beside a dense_mlp
    layer_scalar: bool = False  # Gemma 4: each layer's output times a learned scalar
    product_key_moe: bool = False  # Doge's MoE: product-key embedding experts beside a dense MLP (product_key_moe.py)
    residual_scales: bool = False  # Doge: each residual times a learned per-channel scale (input_residual, ...)
    hyper: HyperArgs | None = None  # hyper-connections: the residual as N streams (models/layers/hyper.py)
    muse: MuseArgs | None = None  # Muse Spark's residual gates, norms, attention and projected experts (models/layers/muse.py)
    zaya: ZayaArgs | None = None  # ZAYA's CCA attention and MLP router with cross-layer state (models/layers/cca.py)
    inkling: InklingArgs | None = None  # Inkling's blocks (models/layers/inkling.py); None: none
    qsa: QSAArgs | None = None  # Qwen4-Exp's QSA sparse attention on the FULL layers (models/layers/qsa.py)
    gated_residual: GatedResidualArgs | None = None  # Qwen4-Exp's gated residual streams (models/layers/gated_residual.py)
    ple: PLEArgs | None = None  # Qwen4-Exp's per-layer n-gram embeddings (models/layers/ple.py)

    def __post_init__(self):
        check_kinds(self)
        for name, values, allowed in (("layer_types", self.layer_types, LAYER_TYPES),
                                      ("mlp_types", self.mlp_types, MLP_TYPES)):
            unknown = [v for v in values if v not in allowed]
            if unknown:
                raise ValueError(f"ModelArgs.{name}: {unknown[0]!r} is not one of {', '.join(map(repr, allowed))}")
        for kind, group in ((LINEAR, "linear_attention"), (CONV, "short_conv"), (MAMBA, "mamba"), (MAMBA2, "mamba2"),
                            (KDA, "kda")):  # a mixer's layers need its group
            if kind in self.layer_types and getattr(self, group) is None:
                raise ValueError(f"ModelArgs.{group}: None, but layer_types has {kind} layers")

    @classmethod
    def from_dict(cls, d: dict) -> ModelArgs:
        """From its JSON form (dataclasses.asdict: the groups are nested dicts)."""
        return from_json(cls, d)


def kept_fp32(a: ModelArgs, name: str) -> bool:
    """Is the production model's parameter `name` (state-dict name) stored in fp32 whatever the
    model's dtype (a.router.fp32_params of a router: layers.{i}.mlp.gate.<param>)?"""
    module, _, leaf = name.rpartition(".")
    if a.attention.dsa is not None and a.attention.dsa.weights_fp32 and module.endswith(".indexer.weights_proj"):
        return True
    if a.attention.dsa is not None and a.attention.dsa.k_norm_fp32 and module.endswith(".indexer.k_norm"):
        return True
    if a.hyper is not None and leaf in a.hyper.fp32_params and module.endswith(("_hc", "hc_head")):
        return True
    if a.muse is not None and module.endswith("_residual_gate"):  # Muse Spark's gates (_keep_in_fp32_modules_strict)
        return True
    if a.inkling is not None and module.endswith("_sconv.conv1d"):  # Inkling's short convs: HF keeps them in fp32
        return True
    if a.attention.compressed is not None and (leaf in ("sinks", "position_bias", "tid2eid") or module.rpartition(".")[2] in (
            "q_a_norm", "kv_norm", "input_layernorm", "post_attention_layernorm", "norm")):  # DeepSeek-V4 (HF's strict list)
        return True
    return leaf in a.router.fp32_params and module.endswith(".mlp.gate")


def stored_dtype(a: ModelArgs, name: str, dtype):
    """The dtype the production model stores its parameter `name` in when built in `dtype`:
    `dtype`, or fp32 below fp32 where HF keeps the tensor in fp32 (kept_fp32)."""
    import torch

    return torch.float32 if dtype.itemsize < 4 and kept_fp32(a, name) else dtype


def heads(a: ModelArgs, layer: int) -> tuple[int, int]:
    """(q heads, kv heads) of one attention layer (ModelArgs.layer_heads / layer_kv_heads)."""
    return (a.layer_heads[layer] if a.layer_heads else a.num_attention_heads,
            a.layer_kv_heads[layer] if a.layer_kv_heads else a.num_key_value_heads)


def has_sinks(a: ModelArgs, layer: int) -> bool:
    return a.attention.sinks and (a.attention.sinks_on == "all" or a.layer_types[layer] == SLIDING)


def mlp_type(a: ModelArgs, layer: int) -> str:
    return a.mlp_types[layer] if a.mlp_types else SPARSE


def token_blocks(a: ModelArgs) -> dict[tuple[int, str], str]:
    """The blocks (layer, kind) that read the call's token ids (a `call_tokens` buffer: DeepSeek-V4's hash routers,
    Qwen4-Exp's per-layer n-gram embeddings; models/layers/hash_router.py feed_tokens), and why: a compiled block
    program that takes only the block's input cannot run them alone (the whole model's prefill and decode carry the
    ids)."""
    out = {(i, kind): "a hash-routed layer chooses its experts by the call's token ids"
           for i, hashed in enumerate(a.router.hash_layers) if hashed for kind in ("moe", "layer")}
    for i in a.ple.layers if a.ple is not None else ():
        out[(i, "layer")] = "a layer with per-layer n-gram embeddings hashes the call's token ids"
    return out


def layer_kinds(a: ModelArgs, layer: int) -> tuple[str, ...]:
    """The blocks checked in one decoder layer, in program order: the attention (a layer with a mixer), then the
    router and the experts of a sparse layer or the plain MLP of a dense one (a layer with an MLP), then the whole
    layer."""
    kind = mlp_type(a, layer)
    mlp = (("mlp",) if a.moe_beside_mlp else ()) + ("router", "moe") if kind == SPARSE else ("mlp",) if kind == DENSE else ()
    if a.router.hash_layers and a.router.hash_layers[layer]:  # DeepSeek-V4: no learned choice (tid2eid[token]) to judge
        mlp = ("moe",)
    return (("attention",) if a.layer_types[layer] != NONE else ()) + mlp + ("layer",)


def block_keys(a: ModelArgs) -> list[tuple[int | None, str]]:
    """(layer | None, kind) of every block the harness checks, in program order."""
    keys = [(i, k) for i in range(a.num_hidden_layers) for k in layer_kinds(a, i)]
    return keys + [(None, "final_norm"), (None, "logits")]


def block_path(a: ModelArgs, layer: int | None, kind: str) -> str:
    """The production model's module (models/layers/) computing a block: its path in the model."""
    if layer is None:
        return {"final_norm": "norm", "logits": "lm_head"}[kind]
    if kind not in layer_kinds(a, layer):
        raise KeyError(f"layer {layer} has no {kind} block (its blocks: {', '.join(layer_kinds(a, layer))})")
    attn, dense = mixer_name(a.layer_types[layer]), ".dense_mlp" if a.moe_beside_mlp and mlp_type(a, layer) == SPARSE else ".mlp"
    return f"layers.{layer}" + {"attention": f".{attn}", "router": ".mlp.gate", "moe": ".mlp", "mlp": dense,
                                "layer": ""}[kind]


def mixer_name(layer_type: str) -> str:
    """The production decoder layer's module in the attention's place for a layer of this type (HF's name)."""
    return {LINEAR: "linear_attn", CONV: "conv", MAMBA: "mamba", MAMBA2: "mamba"}.get(layer_type, "self_attn")


def block_input_path(a: ModelArgs, layer: int | None, kind: str) -> str | None:
    """The production model's module whose output is a decoder layer's block's own input (the norm
    before it: the attention's, or the router's and the experts'; a parallel block's one input norm);
    None for a block fed the stream itself (the layer, the final norm, the head)."""
    if layer is None or kind == "layer":
        return None
    block_path(a, layer, kind)  # a block the layer has
    placement = a.norm.placement
    if placement == "post" or (a.moe_beside_mlp and kind in ("router", "moe")):  # fed the stream (Gemma 4's MoE too)
        return None
    if kind == "attention" or a.parallel_block:  # (a parallel block: one input norm for both)
        return f"layers.{layer}.input_layernorm"
    return f"layers.{layer}." + ("pre_feedforward_layernorm" if placement == "sandwich" else "post_attention_layernorm")
