"""What every family's config mapping (HF config object -> ModelArgs) and `sanitize()` (checkpoint
names -> the production model's) are made of: the common fields, RoPE and YaRN, DeepSeek-style layer
stacks and routing, MLA, the common checkpoint mapping, and refusals with their reason."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

from models.args import DENSE, FULL, MLA, SLIDING, SPARSE, AttentionArgs, ModelArgs, RopeArgs, RouterArgs, YaRN
from models.checkpoint import CheckpointError

if TYPE_CHECKING:
    pass



def rope_theta(config) -> float:
    """rope_theta of a config with default RoPE (a family that implements YaRN: rope_theta_any)."""
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"rope_type {rope_type!r} is not supported yet (only 'default' RoPE)")
    return rope_theta_any(config)


def rope_theta_any(config) -> float:
    """rope_theta of a config with default or YaRN RoPE (`yarn` reads the rest)."""
    rp = getattr(config, "rope_parameters", None) or {}
    yarn(config)  # refuses other rope types
    if "rope_theta" not in rp:
        raise CheckpointError("config has no rope_parameters.rope_theta")
    return float(rp["rope_theta"])


def yarn(config) -> YaRN | None:
    """The YaRN scaling of a config whose rope_parameters have rope_type "yarn", as HF 5.23's
    _compute_yarn_parameters reads them (factor defaults to max_position_embeddings /
    original_max_position_embeddings, beta_fast 32, beta_slow 1, truncate True); None for default RoPE.
    mscale is recorded as HF uses it: only with mscale_all_dim and no attention_factor (else 0: a
    config's mscale that HF never reads, e.g. mlx-lm's own 1 beside mscale_all_dim 0, is no difference)."""
    rp = getattr(config, "rope_parameters", None) or {}
    kind = rp.get("rope_type", "default")
    if kind == "default":
        return None
    if kind != "yarn":
        raise CheckpointError(f"rope_type {kind!r} is not supported yet (only 'default' and 'yarn' RoPE)")
    if "original_max_position_embeddings" not in rp:
        raise CheckpointError("yarn rope_parameters without original_max_position_embeddings")
    omp = int(rp["original_max_position_embeddings"])
    factor = float(rp.get("factor") or config.max_position_embeddings / omp)
    af = rp.get("attention_factor")
    mscale, mscale_all_dim = float(rp.get("mscale") or 0), float(rp.get("mscale_all_dim") or 0)
    return YaRN(factor, omp, beta_fast=float(rp.get("beta_fast") or 32), beta_slow=float(rp.get("beta_slow") or 1),
                mscale=mscale if af is None and mscale_all_dim else 0.0, mscale_all_dim=mscale_all_dim,
                truncate=bool(rp.get("truncate", True)), attention_factor=None if af is None else float(af))


def rope_of(config, **how) -> RopeArgs:
    """The RopeArgs of a config with default or YaRN RoPE; `how` sets the rest (interleave, ...)."""
    return RopeArgs.scaled(rope_theta_any(config), yarn(config), **how)


def rope_per_type(c, partial: float = 1.0, **how) -> RopeArgs:
    """The RopeArgs of a config whose rope_parameters are keyed by layer type ({"full_attention": {...},
    "sliding_attention": {...}}: Mellum, Laguna, MiMo-V2-Flash): the full layers' rope as the model's, the
    sliding layers' as its `sliding` where it differs; each default or YaRN with its own
    partial_rotary_factor (`partial` where it states none: the family's default). A config not keyed so: one
    rope for every layer."""
    rp = getattr(c, "rope_parameters", None) or {}
    if FULL not in rp and SLIDING not in rp:
        return rope_of(c, partial_rotary_factor=float(rp.get("partial_rotary_factor", partial)), **how)

    def of_type(kind: str) -> RopeArgs:
        p = rp.get(kind)
        if not isinstance(p, dict):
            raise CheckpointError(f"rope_parameters has no {kind!r} entry, and layer_types has {kind} layers")
        one = SimpleNamespace(rope_parameters=p, max_position_embeddings=c.max_position_embeddings)
        return rope_of(one, partial_rotary_factor=float(p.get("partial_rotary_factor", partial)), **how)

    kinds = set(c.layer_types)
    full = of_type(FULL) if FULL in kinds else None
    sliding = of_type(SLIDING) if SLIDING in kinds else None
    if full is None:
        return sliding
    return full if sliding is None or sliding == full else replace(full, sliding=sliding)


def hf_args(c, family: str, **specific) -> ModelArgs:
    """ModelArgs with the fields every family reads the same way from an HF config object;
    `specific` sets (or overrides) the rest."""
    common = dict(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=specific["rms_norm_eps"] if "rms_norm_eps" in specific else c.rms_norm_eps,  # (LFM2's norm_eps)
        num_experts_per_tok=c.num_experts_per_tok,
        layer_types=("full_attention",) * c.num_hidden_layers, tie_word_embeddings=c.tie_word_embeddings,
    )
    if "rope" not in specific:  # (a family with scaled RoPE passes its own: rope_of)
        common["rope"] = RopeArgs(rope_theta(c))
    return ModelArgs(**{**common, **specific})


def sanitize_hf(weights: dict, args: ModelArgs) -> dict:
    """The common checkpoint mapping: strip `model.`, stack per-expert tensors, tie embeddings."""
    from models.checkpoint import stack_hf_experts

    return tie_embeddings(stack_hf_experts(strip_prefix(weights)), args)


def strip_prefix(weights: dict, prefix: str = "model.") -> dict:
    """Checkpoint keys without the HF base-model prefix."""
    return {k[len(prefix):] if k.startswith(prefix) else k: t for k, t in weights.items()}


def renamed(name: str, names: dict) -> str:
    """`name` with each of its dotted parts renamed by `names` (one pass: no chain of renames)."""
    return ".".join(names.get(part, part) for part in name.split("."))


def tie_embeddings(weights: dict, args: ModelArgs) -> dict:
    if args.tie_word_embeddings and "lm_head.weight" not in weights and "embed_tokens.weight" in weights:
        weights = {**weights, "lm_head.weight": weights["embed_tokens.weight"]}
    return weights


def first_k_dense(c) -> dict:
    """The ModelArgs of a DeepSeek-style layer stack: the first `first_k_dense_replace` layers
    have a dense MLP (intermediate_size), the rest experts plus `n_shared_experts` always-on
    shared experts (no gate). Its router: deepseek_router."""
    first = c.first_k_dense_replace or 0
    return dict(mlp_types=tuple(DENSE if i < first else SPARSE for i in range(c.num_hidden_layers)),
                intermediate_size=c.intermediate_size, num_experts=c.n_routed_experts,
                moe_intermediate_size=c.moe_intermediate_size,
                shared_expert_intermediate_size=c.moe_intermediate_size * (c.n_shared_experts or 0),
                shared_expert_gated=False)


def deepseek_router(c, **how) -> RouterArgs:
    """The router of a DeepSeek-style layer stack: fp32 logits and weights, routed_scaling_factor;
    `how` sets the rest (sigmoid_routing)."""
    return RouterArgs(routed_scaling_factor=float(c.routed_scaling_factor), fp32=True, weights_in_model_dtype=False,
                      **how)


def sigmoid_routing(c) -> dict:
    """DeepSeek-V3's routing (also GLM-4.5's and dots.llm1's): sigmoid scores, the correction
    bias for the choice, the topk_group best of n_group groups (by the sum of their best two)."""
    return dict(scoring="sigmoid", correction_bias=True, n_group=c.n_group or 1, topk_group=c.topk_group or 1,
                group_score="top2", norm_topk_prob=bool(c.norm_topk_prob),
                fp32_params=("e_score_correction_bias",))  # HF: _keep_in_fp32_modules_strict


def mla(c) -> AttentionArgs:
    """DeepSeek's multi-head latent attention (its RoPE: rope_of)."""
    return AttentionArgs("mla", MLA(kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
                                    qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim,
                                    q_lora_rank=c.q_lora_rank or 0),
                         qkv_bias=c.attention_bias, o_bias=c.attention_bias)


def drop_layers_from(weights: dict, n: int) -> dict:
    """Without the tensors of layers n and beyond (DeepSeek-V3 / GLM-4.5 checkpoints carry their
    multi-token-prediction layers as model.layers.{num_hidden_layers}...: not the model checked)."""
    from models.checkpoint import LAYER

    return {k: t for k, t in weights.items() if not ((m := LAYER.search(k)) and int(m.group(1)) >= n)}


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckpointError(message)


def points_without(points, drop) -> object:
    """The drill's points of HF's model (Family.hf_point_view) less those `drop(name)` names: points HF computes in
    a layout or a place the production model does not (another tap, another length), which the drill would report
    as a divergence of the candidate's; the block's other points, and its row, still compare."""
    import copy

    out = copy.copy(points)  # (a Points keeps its registered paths and taps)
    for name in [n for n in points if drop(n)]:
        out.pop(name, None)
    return out
