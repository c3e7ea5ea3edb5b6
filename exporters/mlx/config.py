"""The config conversion for mlx-lm: the family's mapping (models/mlx_lm.py) applied to an HF
config.json, mlx-lm's model module and args class, and the model built from the converted fields."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

from models import get_family
from models.mlx_lm import ConfigError

# bf16 only where a GPU can be: mlx's CPU gather_mm (the experts) is float32-only (0.32.4)
PRECISIONS = ("fp32", "bf16", "q8", "q4") if sys.platform == "darwin" else ("fp32", "q8", "q4")


QUANT_BITS = {"q8": 8, "q4": 4}


GROUP_SIZES = (32, 64)


DEFAULT_GROUP_SIZE = 64  # mlx_lm.convert's default; real MoE dims are multiples of 64


def mapping(family: str):
    """The family's mlx-lm mapping (models.mlx_lm.MlxLm, declared in its models/ file)."""
    m = get_family(family).mlx
    if m is None:
        raise ConfigError(f"{family}: no mlx-lm model is mapped for this family")
    return m


def check_args(temperature: float, top_p: float) -> None:
    """The sampling head's argument check (models.layers.sampling, which imports torch: only with --sampling)."""
    from models.layers import sampling

    sampling.check_args(temperature, top_p)


def mlx_lm_models() -> None:
    """Make `mlx_lm.models.*` importable without running `mlx_lm/__init__.py`, which imports
    mlx_lm's generate/convert/utils and through them transformers (0.6 s, most of a warm mlx
    check; the model files need only mlx). The package module is registered bare, and runs its
    real `__init__` the first time anything else is asked of it (`mlx_lm.load`, ...); submodules
    (`mlx_lm.utils`, `mlx_lm.convert`) import as usual."""
    if "mlx_lm" in sys.modules:
        return
    spec = importlib.util.find_spec("mlx_lm")
    if spec is None or spec.submodule_search_locations is None:
        return  # not installed: the import that follows says so
    pkg = importlib.util.module_from_spec(spec)

    def complete(name):  # the rest of the package: its __init__, run once in this module
        del pkg.__getattr__
        spec.loader.exec_module(pkg)
        return getattr(pkg, name)

    pkg.__getattr__ = complete
    sys.modules["mlx_lm"] = pkg


def mlx_args_class(family: str):
    """The dataclass whose fields the family's mlx mapping must cover."""
    m = mapping(family)
    module, cls = m.args_class or (m.module, "ModelArgs")
    return getattr(mlx_module(module), cls)


def mlx_module(name: str):
    """mlx_lm.models.<name> (without mlx_lm's package imports: mlx_lm_models)."""
    mlx_lm_models()
    return importlib.import_module(f"mlx_lm.models.{name}")


def mlx_config(family: str, config: dict) -> dict:
    """config.json -> the explicit field values of the family's mlx-lm ModelArgs."""
    c = get_family(family).hf_config(config)
    m = mapping(family)
    for ok, what in m.require:
        if not ok(c):
            raise ConfigError(f"{family}: the checkpoint's config has {what}")
    table = m.config
    fields = {f.name for f in dataclasses.fields(mlx_args_class(family))}
    if set(table) != fields:  # a new mlx-lm field would otherwise take its default silently
        raise ConfigError(f"{family}: mlx-lm's ModelArgs fields differ from the conversion table: "
                          f"unmapped {sorted(fields - set(table))}, unknown {sorted(set(table) - fields)}")
    return {k: getattr(c, src) if isinstance(src, str) else src(c) for k, src in table.items()}


def cached_mlx_config(family: str, config: dict) -> dict:
    """mlx_config from the cache when this config.json was converted by this code before (a warm
    check then imports no transformers config class)."""
    from models import code_digest
    from oracle.cache.artifacts import cached_json, versions

    parts = {"family": family, "config": config, "code": code_digest(), "exporter": _source_digest(),
             **versions("mlx-lm", "transformers")}
    return cached_json("mlx-config", parts, lambda: mlx_config(family, config))


@functools.cache
def _source_digest() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def naive_mlx_config(family: str, config: dict) -> dict:
    """What mlx_lm.utils.load_model does: config.json straight into ModelArgs.from_dict, so
    every key it does not find takes mlx-lm's default. Only for showing the traps."""
    module = mapping(family).module
    cls = mlx_module(module).ModelArgs
    return dataclasses.asdict(cls.from_dict({**config, "model_type": module}))


def build_model(family: str, fields: dict):
    """The mlx-lm Model for the converted fields; checks mlx-lm kept every value."""
    m = mapping(family)
    mod = mlx_module(m.module)
    if m.composite:
        args = fields if "text_config" in fields else {"model_type": m.module, "text_config": fields}
        model = mod.Model(mod.ModelArgs(**args))
        got, want = model.language_model.args, args["text_config"]
    else:
        model = mod.Model(mod.ModelArgs(**fields))
        got, want = model.args, fields
    changed = {k: (v, getattr(got, k)) for k, v in want.items() if getattr(got, k) != v}
    if changed:
        raise ConfigError(f"{family}: mlx-lm changed config values while building the model: {changed}")
    return model
