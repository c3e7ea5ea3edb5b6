"""How mlx-lm's model of a family reads a checkpoint: the data each family file declares as its
`mlx` entry (exporters/mlx.py applies it; nothing here imports mlx, mlx-lm or torch).

`config` lists every field of the family's mlx-lm ModelArgs and where its value comes from,
given the HF config object as HF's own config class resolves it (the reference's values): a
string copies HF's attribute, a callable computes it. Every field is passed explicitly; a field
mlx-lm has that the table does not list is an error, never mlx-lm's default (its rope_theta
default 1e6 silently breaks qwen2_moe, where HF's is 1e4). `require`: what mlx-lm hard-codes
(reads from no field): the HF config must agree, else the backend refuses the checkpoint with
the reason.
"""

from __future__ import annotations

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
    expert_names: dict = field(default_factory=lambda: dict(GATE_UP_DOWN))
    moe: str = "mlp"  # the MoE block's attribute in mlx-lm's decoder layer (and its checkpoint names)
    # a check of the tensors as they go into sanitize(): (name, shape) -> what is wrong, or None
    check_tensor: Callable | None = None

    @property
    def composite(self) -> bool:
        return self.args_class is not None


# what every family's mlx-lm MoE model hard-codes
COMMON_REQUIRE = ((lambda c: c.hidden_act == "silu", "hidden_act other than silu (mlx-lm's experts are SwiGLU)"),)


def const(value):
    return lambda c: value


def head_dim(c):
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads


def rope(rope_theta) -> dict:
    """The RoPE fields of the classic families' mlx-lm ModelArgs (`rope_theta`: models.rope_theta)."""
    return dict(rope_theta=rope_theta, rope_traditional=const(False), rope_scaling=const(None))
