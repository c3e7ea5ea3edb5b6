"""Model families: one module per family, registered here.

A family module defines `FAMILY = Family(...)`: the HF classes of the reference, a tiny
config, the config mapping to `ModelArgs`, and `sanitize()` (HF checkpoint names and
layouts -> the production model's parameter names).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from models.args import ModelArgs
from models.checkpoint import CheckpointError

if TYPE_CHECKING:
    from models.layers import Transformer

FAMILY_NAMES = ("qwen3_5_moe", "qwen3_moe", "olmoe", "qwen2_moe", "mixtral")

# Families transformers has but the harness cannot yet reproduce, and the missing feature.
UNSUPPORTED = {
    "deepseek_v3": "multi-head latent attention (MLA) and grouped sigmoid routing with a score-correction bias",
    "deepseek_v2": "multi-head latent attention (MLA)",
    "gpt_oss": "attention sinks and the clamped gated-SwiGLU expert activation",
    "glm4_moe": "grouped sigmoid routing with a score-correction bias (e_score_correction_bias)",
    "dots1": "grouped sigmoid routing with a score-correction bias (e_score_correction_bias)",
    "ernie4_5_moe": "interleaved RoPE and the expert-bias router",
    "phimoe": "sparsemixer routing",
}


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # config.json model_type values this family reads
    hf_module: str  # transformers.models.<hf_module>
    hf_class_name: str  # the CausalLM class used as reference
    hf_config_name: str
    tiny_config: dict
    to_args: Callable  # HF config object -> ModelArgs
    sanitize: Callable  # (weights, ModelArgs) -> production state dict
    # where the reference's blocks live inside an HF decoder layer (first that exists)
    hf_attention: tuple[str, ...] = ("self_attn", "linear_attn")
    hf_moe: str = "mlp"
    hf_router: str = "mlp.gate"
    # (mlx-lm checkpoint tensors of one layer, config.json) -> the HF checkpoint's names and layouts
    # (how a shipped mlx-lm directory's dequantized weights become an HF reference)
    from_mlx: Callable = None
    # how mlx-lm's model of the family reads the checkpoint (models.mlx_lm.MlxLm; None: no mlx-lm model)
    mlx: object = None

    def __post_init__(self):
        if self.from_mlx is None:
            from models.quantized import unstack_experts

            object.__setattr__(self, "from_mlx", lambda weights, config: unstack_experts(weights))

    def hf_class(self):
        return getattr(importlib.import_module(f"transformers.models.{self.hf_module}"), self.hf_class_name)

    def hf_config(self, cfg: dict):
        cls = getattr(importlib.import_module(f"transformers.models.{self.hf_module}"), self.hf_config_name)
        cfg = {k: v for k, v in text_config(cfg).items() if k not in ("architectures", "transformers_version")}
        return cls(**cfg)

    def args(self, cfg: dict, max_seq_len: int = 256) -> ModelArgs:
        """ModelArgs from a config.json dict, resolved through HF's own config class so that
        defaults are exactly the reference's."""
        args = self.to_args(self.hf_config(cfg))
        return ModelArgs(**{**args.__dict__, "max_seq_len": max_seq_len})

    def validate(self, cfg: dict, weights: dict, max_seq_len: int = 256) -> ModelArgs:
        """Resolve the config and check the checkpoint's tensors against the production
        model's (names and shapes) without allocating it."""
        import torch

        from models.checkpoint import validate_state
        from models.layers import Transformer

        args = self.args(cfg, max_seq_len)
        with torch.device("meta"):
            model = Transformer(args)
        validate_state(model, self.sanitize(weights, args))
        return args

    def build(self, cfg: dict, weights: dict, dtype=None, max_seq_len: int = 256) -> Transformer:
        """The production model with the checkpoint's weights (strict name/shape check), in
        `dtype` (default fp32)."""
        import torch

        from models.checkpoint import load_state
        from models.layers import Transformer

        dtype = dtype or torch.float32
        args = self.args(cfg, max_seq_len)
        model = Transformer(args, dtype)
        load_state(model, self.sanitize(weights, args), dtype)
        return model.eval()

    def build_from(self, cfg: dict, model_dir, dtype=None, max_seq_len: int = 256,
                   args: ModelArgs | None = None, mapped: Path | None = None) -> Transformer:
        """The production model from a checkpoint directory, one decoder layer at a time: the
        parameters start on the meta device (accelerate's init_empty_weights; buffers are real),
        each layer's tensors are read from the safetensors files, sanitized, converted to
        `dtype` and assigned, then dropped. Peak memory: the model in `dtype` plus one layer.
        `mapped` (a directory): each layer's converted tensors are written there instead
        (safetensors, one file per layer) and the parameters are views of those files' memory
        maps (copy-on-write): the model's weights are file pages the kernel can drop and read
        again, not process memory: for a build that reads every weight once (an ExecuTorch
        lowering). The directory must outlive the model.
        The names, shapes and dtypes were checked from the headers by `validate` (how a
        ModelSource is made); a parameter left unfilled is still an error here."""
        import torch
        from accelerate import init_empty_weights
        from accelerate.utils import set_module_tensor_to_device

        from models.layers import Transformer

        dtype = dtype or torch.float32
        args = args or self.args(cfg, max_seq_len)  # the ModelSource's, already resolved
        with init_empty_weights(include_buffers=False):
            model = Transformer(args, dtype)
        for i, group in enumerate(self.production_tensors(model_dir, args, dtype)):
            if mapped is not None:
                group = map_group(group, Path(mapped) / f"layer-group-{i:05d}.safetensors")
            for name, value in group.items():
                set_module_tensor_to_device(model, name, "cpu", value=value, dtype=dtype)
        missing = [n for n, p in model.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(f"missing tensor(s): {', '.join(missing[:6])}")
        return model.eval()

    def production_tensors(self, model_dir, args: ModelArgs, dtype=None):
        """The production model's parameters (its state-dict names) in `dtype`, one decoder
        layer at a time (then the embedding, final norm and head): each group read from the
        shards' memory maps, sanitized and converted, in fresh memory. What build_from assigns,
        and what a backend that keeps its weights outside the model (an IREE parameter archive)
        writes group by group without ever holding the whole model."""
        import torch

        from models.checkpoint import layer_groups, read_tensors, tensor_index

        dtype = dtype or torch.float32
        index = tensor_index(model_dir)
        for names in layer_groups(index):
            # fresh memory either way (a tensor read from a shard can sit at an alignment
            # that makes BLAS round differently from run to run of the same weights)
            yield {name: t.to(dtype) if t.dtype != dtype else t.clone()
                   for name, t in self.sanitize(read_tensors(index, names), args).items()}


def map_group(tensors: dict, path: Path) -> dict:
    """`tensors` written to `path` (safetensors) and given back as views of its memory map
    (safetensors' own reader: no copy; written to, a page is copied, the file stays as it is)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))
    tensors.clear()
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of the models package's source: what a cached result derived from a family's
    code (resolved ModelArgs, a validation) is keyed by."""
    h = hashlib.sha256()
    for p in sorted(Path(__file__).parent.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def text_config(cfg: dict) -> dict:
    """The language model's config: a composite (multimodal) release's `text_config`, with the
    top-level keys it leaves out (e.g. tie_word_embeddings); any other config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    inherited = {k: cfg[k] for k in ("tie_word_embeddings",) if k in cfg and k not in text}
    return {**text, **inherited}


def get_family(name: str) -> Family:
    if name in FAMILY_NAMES:
        return importlib.import_module(f"models.{name}").FAMILY
    raise KeyError(name)


def family_for_model_type(model_type: str) -> str | None:
    for name in FAMILY_NAMES:
        if model_type in get_family(name).model_types:
            return name
    return None


def rope_theta(config) -> float:
    rp = getattr(config, "rope_parameters", None) or {}
    rope_type = rp.get("rope_type", "default")
    if rope_type != "default":
        raise CheckpointError(f"rope_type {rope_type!r} is not supported yet (only 'default' RoPE)")
    if "rope_theta" not in rp:
        raise CheckpointError("config has no rope_parameters.rope_theta")
    return float(rp["rope_theta"])


def hf_args(c, family: str, **specific) -> ModelArgs:
    """ModelArgs with the fields every family reads the same way from an HF config object;
    `specific` sets (or overrides) the rest."""
    common = dict(
        family=family, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        rms_norm_eps=c.rms_norm_eps, rope_theta=rope_theta(c), num_experts_per_tok=c.num_experts_per_tok,
        layer_types=("full_attention",) * c.num_hidden_layers, tie_word_embeddings=c.tie_word_embeddings,
    )
    return ModelArgs(**{**common, **specific})


def sanitize_hf(weights: dict, args: ModelArgs) -> dict:
    """The common checkpoint mapping: strip `model.`, stack per-expert tensors, tie embeddings."""
    from models.checkpoint import stack_hf_experts

    return tie_embeddings(stack_hf_experts(strip_prefix(weights)), args)


def strip_prefix(weights: dict, prefix: str = "model.") -> dict:
    """Checkpoint keys without the HF base-model prefix."""
    return {k[len(prefix):] if k.startswith(prefix) else k: t for k, t in weights.items()}


def tie_embeddings(weights: dict, args: ModelArgs) -> dict:
    if args.tie_word_embeddings and "lm_head.weight" not in weights and "embed_tokens.weight" in weights:
        weights = {**weights, "lm_head.weight": weights["embed_tokens.weight"]}
    return weights


def require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckpointError(message)


__all__ = ["Family", "FAMILY_NAMES", "UNSUPPORTED", "get_family", "family_for_model_type", "ModelArgs"]
