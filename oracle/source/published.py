"""The published configs shipped in models/configs/ (by lower-cased repository name; where each
came from: SOURCES.md there), read with the depth cut to a number of layers."""

from __future__ import annotations

from pathlib import Path

from models import family_for_model_type, get_family
from models.checkpoint import CheckpointError, read_config_file
from models.family import text_section

CONFIGS_DIR = Path(__file__).resolve().parents[2] / "models" / "configs"  # data of models/, shipped with it


def config_names() -> list[str]:
    """The published configs shipped in models/configs/ (by lower-cased repository name)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))


def known_configs() -> str:
    """The published configs for a message; where none are found, where they were looked for
    (an empty list would hide an install that lacks its package data)."""
    return ", ".join(config_names()) or f"none (no *.json in {CONFIGS_DIR})"


def published_config(name: str, layers: int | None = None) -> dict:
    """models/configs/<name>.json (or a config.json path of your own), with the depth cut to
    `layers` when given. A cut keeps the pattern's last `layers` entries of `layer_types` (a
    hybrid model keeps both kinds); a dense prefix (`first_k_dense_replace`: DeepSeek-V3's first 3 layers are
    dense) is cut with the model, so a cut within it is its first `layers` dense layers (no MoE layer: a cut
    past it has one); a family whose depth lives in fields of its own cuts them too (Family.cut_layers)."""
    path = Path(name) if name.endswith(".json") else CONFIGS_DIR / f"{name}.json"
    if not path.is_file():
        raise CheckpointError(f"--config {name}: no such published config (or .json file); "
                              f"known: {known_configs()}")
    cfg = read_config_file(path)
    if layers is not None:
        text = text_section(cfg)
        if layers > text["num_hidden_layers"]:
            raise CheckpointError(f"--layers {layers}: {name} has {text['num_hidden_layers']} layers")
        text["num_hidden_layers"] = layers
        if isinstance(text.get("layer_types"), list):
            text["layer_types"] = text["layer_types"][-layers:]
        if isinstance(text.get("first_k_dense_replace"), int) and text["first_k_dense_replace"] > layers:
            text["first_k_dense_replace"] = layers
        family = family_for_model_type(text.get("model_type") or cfg.get("model_type", ""))
        cut = get_family(family).cut_layers if family is not None else None
        if cut is not None:  # the depth kept in fields of the family's own
            cut(text, layers)
    return cfg
