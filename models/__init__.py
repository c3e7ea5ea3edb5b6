"""Model families: one module per family, registered here.

A family module defines `FAMILY = Family(...)`: the HF classes of the reference, a tiny
config, the config mapping to `ModelArgs`, and `sanitize()` (HF checkpoint names and
layouts -> the production model's parameter names).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from pathlib import Path

from models import moved
from models.args import ModelArgs
from models.family import Family

moved.install()  # the import paths of before the 2026-12 reorganisation, for one release


# the families: every module of this package that defines `FAMILY = Family(...)` (a new family is
# its own file and nothing else): the core five first (Qwen3.5-MoE, the production target, then
# the families every backend and test path covers in depth), then the others by name
CORE = ("qwen3_5_moe", "qwen3_moe", "olmoe", "qwen2_moe", "mixtral")
_FILES = sorted(p.stem for p in Path(__file__).parent.glob("*.py") if "\nFAMILY = Family(" in p.read_text())
FAMILY_NAMES = tuple(n for n in CORE if n in _FILES) + tuple(n for n in _FILES if n not in CORE)


# Families transformers has but the harness cannot yet reproduce, and the missing feature.
UNSUPPORTED = {
    # issue 78's families not built yet (the mechanism is missing, not a tool)
    "longcat_flash": "zero-computation experts and shortcut-connected MoE",
    # issue 79's families not built yet (each entry leaves when its family's file lands)
    "mistral_large4": "Mistral-Large-4's text model: DSA with KV sharing and NoPE layers, the log-position q scale",
    "inkling2": "Inkling2's L2 clips, dynamic short convolution, block attention residuals and softcapped SwiGLU",
    # issue 76's families not built yet (each can be built here: the mechanism is missing, not a tool)
    "beam": "the position-dependent query scale (1 + p/2048)^0.1 of its NoPE layers, the head gate with a bias, "
            "depth-scaled residuals",
    "step3p7": "Step-3.7's text model: a per-head gate on the attention output, per-layer head counts and ropes, "
               "the SwiGLU clamp after silu",
}


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
    """sha256 of the models package's source (its subpackages too: the mechanisms a validation builds
    on the meta device): what a cached result derived from a family's code (resolved ModelArgs, a
    validation) is keyed by."""
    root = Path(__file__).parent
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def family_source(name: str) -> bytes:
    """The source a family's derived results (its HF reference, a dequantized directory read back by its from_mlx)
    depend on beyond the harness's: its module, the models.* modules it imports from (another family's, a mechanism's
    mapping), the Family dataclass and the text tower."""
    import re

    root = Path(__file__).parent
    files = [root / f"{name}.py"]
    for dep in re.findall(r"^from models\.(\w+) import", files[0].read_text(), flags=re.M):
        if (root / f"{dep}.py").is_file() and root / f"{dep}.py" not in files:
            files.append(root / f"{dep}.py")
    files += [root / "family.py", root / "text_tower.py"]
    return b"".join(p.read_bytes() for p in files)


def get_family(name: str) -> Family:
    if name in FAMILY_NAMES:
        return importlib.import_module(f"models.{name}").FAMILY
    raise KeyError(name)


def family_for_model_type(model_type: str) -> str | None:
    for name in FAMILY_NAMES:
        if model_type in get_family(name).model_types:
            return name
    return None


__all__ = ["Family", "FAMILY_NAMES", "UNSUPPORTED", "get_family", "family_for_model_type", "ModelArgs"]
__getattr__ = moved.forward("models")  # the helpers family files import from models.mapping now, for one release
