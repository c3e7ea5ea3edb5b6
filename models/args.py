"""The production model's configuration, resolved from an HF config by the family's mapping:
plain data, no torch (a warm check of a backend that runs no torch reads it from the cache)."""

from __future__ import annotations

from dataclasses import dataclass, field

FULL, LINEAR = "full_attention", "linear_attention"
STATE_BUFFERS = ("k_cache", "v_cache", "conv_state", "recurrent_state")


@dataclass(frozen=True)
class ModelArgs:
    family: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    layer_types: tuple[str, ...]
    partial_rotary_factor: float = 1.0
    norm_offset: bool = False  # (1 + w) RMSNorm, zero-centred weights (Qwen3.5)
    qk_norm: str = "none"  # none | head (per head, Qwen3) | flat (whole projection, OLMoE)
    attn_output_gate: bool = False  # sigmoid gate on the attention output (Qwen3.5)
    qkv_bias: bool = False
    o_bias: bool = False
    sliding_window: int | None = None
    router_weights_in_model_dtype: bool = True  # Mixtral keeps top-k weights in fp32
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False
    max_seq_len: int = 256
    extra: dict = field(default_factory=dict, compare=False)
