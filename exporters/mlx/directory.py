"""Shipped mlx-lm directories: written as mlx_lm.convert writes them (quantized, or by a mixed
recipe), the HF checkpoint a shipped one dequantizes to, and one loaded as the candidate."""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

from exporters.mlx.config import DEFAULT_GROUP_SIZE, mapping, mlx_args_class, mlx_config
from exporters.mlx.load import cast, load_model, quantization_table
from exporters.mlx.model import text_model
from models.mlx_lm import ConfigError

# ---------------------------------------------------------------- shipped directories
# the value mlx-lm's models use for a ModelArgs field left None (read off their __init__)
DERIVED = {"head_dim": lambda a: a.hidden_size // a.num_attention_heads}


RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")  # mlx_lm.convert --quant-predicate


def loadable_config(family: str, config: dict, fields: dict) -> dict:
    """config.json of an mlx-lm directory that mlx-lm's own loader (config.json straight into
    ModelArgs.from_dict) reads as the model `fields` describe: the HF config, plus every field
    mlx-lm would otherwise miss or take from its defaults (rope_theta inside rope_parameters,
    num_experts from num_local_experts, ...). Qwen3.5: the composite form mlx-lm reads.

    `rope_scaling` is read by both: transformers 5 takes a config's legacy `rope_scaling` for its
    whole `rope_parameters` (rope_theta and every key mlx-lm's form lacks would fall back to HF's
    defaults: PhiMoE's rope_theta 1e6 for the original's 1e4). So it is written as the original's
    rope_parameters with mlx-lm's keys over them (write_directory checks that HF still reads the
    original's architecture; mlx-lm reads no key beyond its own)."""
    cls = mlx_args_class(family)
    text = dict(config.get("text_config") or config)
    required = {f.name: fields[f.name] for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and f.name not in text}
    naive = dataclasses.asdict(cls.from_dict({**text, **required}))
    extra = {k: v for k, v in fields.items() if k != "model_type" and (k in required or naive.get(k) != v)}
    if isinstance(extra.get("rope_scaling"), dict):
        original = text.get("rope_parameters") or text.get("rope_scaling") or {}
        extra["rope_scaling"] = {**original, **extra["rope_scaling"]}
    m = mapping(family)
    if not m.composite:
        return {**config, **extra}
    top = {k: v for k, v in config.items() if k not in ("text_config", "model_type")}
    return {**top, "model_type": m.module, "text_config": {**text, **extra}}


def hf_reading_differs(src, config: dict) -> str | None:
    """Where transformers (through the family's args()) reads the directory's config.json as
    another architecture than the original's (None: the same). The fields mlx-lm needs share
    their names with HF's legacy ones (rope_scaling): the directory must mean the original to both."""
    from oracle.source.sources import first_difference

    return first_difference(src.args, src.family.args(config, src.args.max_seq_len))


def write_directory(src, out, bits: int | None, group_size: int, recipe: str | None = None) -> list:
    """An mlx-lm directory of the checkpoint as mlx_lm.convert writes one: mlx-lm's model,
    quantizer (`recipe`: one of mlx_lm.convert's mixed recipes) and writers (save_model,
    save_config), the weights at the checkpoint's own dtype; the config that mlx-lm's loader
    reads as this model (loadable_config). bits None: unquantized."""
    import mlx.core as mx
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model, save_config, save_model

    model, fields = load_model(src)
    config = loadable_config(src.family.name, src.config, fields)
    differs = hf_reading_differs(src, config)
    if differs:
        raise ConfigError(f"{src.family.name}: the config.json mlx-lm needs would mean another model to "
                          f"transformers ({differs}): not written")
    if bits is not None or recipe:
        pred = mixed_quant_predicate_builder(recipe, model, group_size) if recipe else None
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits or 4, mode="affine", quant_predicate=pred)
    mx.eval(model.parameters())
    out = Path(out)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    return sorted(p for p in out.iterdir() if p.suffix in (".json", ".safetensors"))


def reference_directory(original, progress) -> Path:
    """The original as mlx-lm writes it unquantized (write_directory: its sanitize() and writers, the
    weights at the original's own dtype), cached by the checkpoint's identity, this code and the tool
    versions: what a shipped directory's weight check compares it with (exporters/mlx/weights.py)."""
    import inspect

    from oracle.cache.artifacts import cached_artifact, sha256_file, versions

    parts = {"checkpoint": original.checkpoint_sha256, "code": sha256_file(Path(inspect.getsourcefile(load_model))),
             **versions("mlx", "mlx-lm")}
    progress("the original through mlx-lm's own conversion, unquantized (to compare the directory with)")
    art = cached_artifact("mlx-reference", parts, "config.json",
                          lambda path: write_directory(original, path.parent, None, DEFAULT_GROUP_SIZE),
                          name=f"{original.family.name}.reference")
    return Path(art.path).parent


def load_directory(path, family: str, dtype, reference_config: dict):
    """(mlx-lm model, info) of a shipped directory, loaded as mlx-lm loads it (mlx_lm.utils.load_model:
    its config.json, quantization and weights), floating arrays (scales and biases included: an
    exact upcast) at the activation dtype. info["config"]: the ModelArgs fields the HF reference's
    config means (mlx_config); info["config_mismatch"]: those mlx-lm read differently."""
    from mlx_lm.utils import load_model as mlx_load

    model, config = mlx_load(Path(path), lazy=True)
    cast(model, dtype)
    if (regroup := mapping(family).regroup) is not None:  # (MlxLm.regroup: Gemma 4's MoE block as one module)
        regroup(model)
    want = mlx_config(family, reference_config)
    got = text_model(model).args
    mismatch = {}
    for k, v in want.items():
        have = getattr(got, k, v)
        if have is None and k in DERIVED:  # mlx-lm derives it when absent
            have = DERIVED[k](got)
        if isinstance(v, dict) and isinstance(have, dict):  # rope_scaling: mlx-lm reads the mapping's keys
            have = {key: have.get(key) for key in v}  # (loadable_config writes HF's beside them)
        if k != "model_type" and have != v:
            mismatch[k] = {"mlx_lm": have, "reference": v}
    q = config.get("quantization") or {}
    table = quantization_table(model, q.get("group_size", 0)) if q else {}
    return model, {"quantization": {"bits": q.get("bits"), "group_size": q.get("group_size"),
                                    "mode": q.get("mode", "affine"), **table} if q else None,
                   "config": want, "config_mismatch": mismatch}
