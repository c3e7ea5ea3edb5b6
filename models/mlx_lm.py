"""How mlx-lm's model of a family reads a checkpoint: the data each family file declares as its
`mlx` entry (exporters/mlx/ applies it; nothing here imports mlx, mlx-lm or torch).

`config` lists every field of the family's mlx-lm ModelArgs and where its value comes from,
given the HF config object as HF's own config class resolves it (the reference's values): a
string copies HF's attribute, a callable computes it. Every field is passed explicitly; a field
mlx-lm has that the table does not list is an error, never mlx-lm's default (its rope_theta
default 1e6 silently breaks qwen2_moe, where HF's is 1e4). `require`: what mlx-lm hard-codes
(reads from no field): the HF config must agree, else the backend refuses the checkpoint with
the reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from models.checkpoint import CheckpointError


class ConfigError(CheckpointError):
    """The HF config asks for something the family's mlx-lm model does not do."""


GATE_UP_DOWN = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


@dataclass(frozen=True)
class MlxLm:
    module: str  # mlx_lm.models.<module>
    config: dict  # mlx-lm ModelArgs field -> HF attribute name, or callable(HF config)
    require: tuple = ()  # (predicate(HF config), what the checkpoint has that mlx-lm cannot do)
    # the dataclass `config` fills: (module, class); a composite model (Qwen3.5) nests it as the
    # `text_config` of its ModelArgs and keeps its text model at `language_model`
    args_class: tuple[str, str] | None = None
    # the layout mlx-lm's sanitize() takes the experts in: per-expert tensors named
    # `<moe>.experts.{e}.<expert_names[role]>.weight`, or "fused" (experts.gate_up_proj + down_proj)
    experts: str = "per-expert"
    fused_names: tuple[str, str] = ("experts.gate_up_proj", "experts.down_proj")  # "fused": under `moe`
    expert_names: dict = field(default_factory=lambda: dict(GATE_UP_DOWN))
    moe: str = "mlp"  # the MoE block's attribute in mlx-lm's decoder layer (and its checkpoint names)
    # a check of the tensors as they go into sanitize(): (name, shape) -> what is wrong, or None
    check_tensor: Callable | None = None
    # a check of the values: (name, mx array) -> what is wrong, or None
    check_value: Callable | None = None
    # the HF checkpoint's arrays -> what mlx-lm's sanitize() takes, where that is not one of the
    # layouts above (gpt-oss: its sanitize takes only the MXFP4 release or mlx-lm's own names)
    convert: Callable | None = None
    # the model builds its causal mask as an array (create_attention_mask(..., return_array=True):
    # DeepSeek-V3's MLA adds it to its rope scores), not mlx's "causal" shorthand
    array_mask: bool = False
    # checkpoint tensors (name endings) the mlx-lm model has no parameter for (its sanitize() drops
    # them): a shipped directory cannot carry them; HF's reference on one takes them from the original
    # checkpoint (oracle.source.quantized.from_original)
    dropped: tuple = ()
    # (mlx-lm's model, x [B, T, H], the block's cache) -> the arguments its attention and decoder layer take
    # between x and the mask, which its model computes once for every layer (Mistral 4's attn_scale); None: none
    block_args: Callable | None = None
    # (mlx-lm's model) -> None: its decoder layers' modules regrouped where mlx-lm has no one module for a block the
    # harness checks (Gemma 4's MoE block beside its MLP: models.gemma4.mlx_regroup); None: as mlx-lm builds them
    regroup: Callable | None = None

    @property
    def composite(self) -> bool:
        return self.args_class is not None


# what every family's mlx-lm MoE model hard-codes
# the fields every DeepSeek-style (MLA) mlx-lm ModelArgs reads under HF's own names (deepseek_v2, deepseek_v3,
# glm4_moe_lite, mistral4): each family's MlxLm.config adds its own
MLA_NAMES = {name: name for name in (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor",
    "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group",
    "num_experts_per_tok", "max_position_embeddings", "rms_norm_eps", "attention_bias")}

COMMON_REQUIRE = ((lambda c: c.hidden_act == "silu", "hidden_act other than silu (mlx-lm's experts are SwiGLU)"),)


def const(value):
    return lambda c: value


def head_dim(c):
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def rope(rope_theta) -> dict:
    """The RoPE fields of the classic families' mlx-lm ModelArgs (`rope_theta`: models.rope_theta)."""
    return dict(rope_theta=rope_theta, rope_traditional=const(False), rope_scaling=const(None))


# ---------------------------------------------------------------- DeepSeek-style families
def rope_parameters(c) -> dict:
    return getattr(c, "rope_parameters", None) or {}


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_scaling(c) -> dict | None:
    """mlx-lm's `rope_scaling` for HF 5.23's yarn rope_parameters (None for default RoPE). mlx-lm
    multiplies q/k by g(f, mscale) / g(f, mscale_all_dim) where HF multiplies cos/sin by its
    attention_factor (explicit, else that ratio when both are set, else g(f)): the mscale given
    to mlx-lm is the one that makes its factor HF's: HF's own where HF computes mlx-lm's ratio
    (both mscales set, no attention_factor), 1 where HF's factor is g(f) and mscale_all_dim is 0
    (mlx-lm's g(f, 1) / g(f, 0)), else solved for (a float formed differently from any HF field)."""
    r = rope_parameters(c)
    if r.get("rope_type", "default") == "default":
        return None
    omp = r["original_max_position_embeddings"]
    f = float(r.get("factor") or c.max_position_embeddings / omp)
    ms, mad = r.get("mscale"), r.get("mscale_all_dim") or 0
    af = r.get("attention_factor")
    if af is None and ms and mad:
        mscale = ms
    elif (af is None and not mad) or f <= 1:
        mscale = 1.0
    else:
        af = af if af is not None else yarn_mscale(f)
        mscale = (af * yarn_mscale(f, mad) - 1) / (0.1 * math.log(f))
    return {"rope_type": "yarn", "factor": f, "original_max_position_embeddings": omp,
            "beta_fast": r.get("beta_fast") or 32, "beta_slow": r.get("beta_slow") or 1,
            "mscale": mscale, "mscale_all_dim": mad}


YARN_REQUIRE = (
    (lambda c: rope_parameters(c).get("rope_type", "default") in ("default", "yarn"), "rope_type other than default/yarn"),
    (lambda c: rope_parameters(c).get("truncate", True),
     "yarn truncate=False (mlx-lm always floors/ceils the correction range)"),
    (lambda c: rope_parameters(c).get("partial_rotary_factor", 1.0) == 1.0,
     "partial_rotary_factor (mlx-lm rotates all qk_rope_head_dim dims)"),
    (lambda c: yarn_scaling(c) is None or yarn_scaling(c)["factor"] > 1
     or rope_parameters(c).get("attention_factor") in (None, 1.0), "yarn attention_factor with factor <= 1"),
)
DEFAULT_ROPE = ((lambda c: rope_parameters(c).get("rope_type", "default") == "default",
                 "rope scaling (this mlx-lm model reads no rope_scaling)"),)
# the sigmoid + correction-bias routers (mlx-lm's noaux_tc)
NOAUX = (
    (lambda c: not (c.norm_topk_prob and c.num_experts_per_tok == 1),
     "norm_topk_prob with num_experts_per_tok=1 (mlx-lm skips renormalisation at top_k 1)"),
    (lambda c: c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts // c.n_group),
     "num_experts_per_tok > the experts of the kept groups (mlx-lm masks groups with 0, HF with -inf)"),
)
UNTIED = ((lambda c: not c.tie_word_embeddings, "tie_word_embeddings (this mlx-lm model always has its own lm_head)"),)
