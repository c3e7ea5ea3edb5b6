"""Import paths that moved in the reorganisation of 2026-12 (one package per backend, the harness by
stage, models by mechanism), kept importable for one release with a DeprecationWarning naming the new
path; removed in the next.

- a module that moved whole (`exporters.mlx_faults` -> `exporters.mlx.faults`) is the same module
  object under its old name (what is patched on one is patched on the other);
- a module whose content went to several (`oracle.reference`, `exporters.executorch`) is a package
  now, or a stand-in module: an attribute is looked up in the modules it went to (`forward`);
- the packages call `install()` from their `__init__`, so `import exporters.mlx_faults` works without
  importing anything else first.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings

RELEASE = "the reorganisation of 2026-12 (removed in the next release)"

# old module -> the modules its content went to (the first: where a module imported as a whole is)
MOVED = {
    "exporters.eager": ("exporters.torch.eager", "exporters.torch.candidate", "exporters.torch.streamed"),
    "exporters.hf": ("exporters.torch.hf",),
    "exporters.hf_faults": ("exporters.torch.hf_faults",),
    "exporters.cuda": ("exporters.torch.cuda",),
    "exporters.identity": ("exporters.shared.identity",),
    "exporters.production_weights": ("exporters.shared.weights",),
    "exporters.given": ("exporters.shared.given", "oracle.source.given"),
    "exporters.torch_lowering": ("exporters.executorch.torch_lowering",),
    "exporters.executorch": ("exporters.executorch.backend", "exporters.executorch.candidate",
                             "exporters.executorch.program", "exporters.executorch.lower",
                             "exporters.executorch.export", "exporters.executorch.runtime"),
    "exporters.executorch_runtime": ("exporters.executorch.runtime",),
    "exporters.executorch_weights": ("exporters.executorch.rebind",),
    "exporters.executorch_cuda": ("exporters.executorch.cuda",),
    "exporters.executorch_metal": ("exporters.executorch.metal",),
    "exporters.executorch_mlx": ("exporters.executorch.mlx.backend",),
    "exporters.executorch_mlx_export": ("exporters.executorch.mlx.export",),
    "exporters.executorch_mlx_interp": ("exporters.executorch.mlx.interpreter",),
    "exporters.executorch_mlx_setup": ("exporters.executorch.mlx.setup",),
    "exporters.iree": ("exporters.iree.backend", "exporters.iree.candidate", "exporters.iree.program"),
    "exporters.iree_export": ("exporters.iree.export",),
    "exporters.iree_program": ("exporters.iree.program",),
    "exporters.mlx": ("exporters.mlx.backend", "exporters.mlx.candidate", "exporters.mlx.config",
                      "exporters.mlx.load", "exporters.mlx.directory", "exporters.mlx.model", "models.mlx_lm"),
    "exporters.mlx_model": ("exporters.mlx.model",),
    "exporters.mlx_weights": ("exporters.mlx.weights",),
    "exporters.mlx_faults": ("exporters.mlx.faults", "exporters.mlx.fault_moe", "exporters.mlx.fault_attention",
                             "exporters.mlx.model"),
    "exporters.llamacpp": ("exporters.llamacpp.backend", "exporters.llamacpp.candidate",
                           "exporters.llamacpp.converter", "exporters.llamacpp.runtime", "exporters.llamacpp.setup"),
    "exporters.llamacpp_faults": ("exporters.llamacpp.faults",),
    "exporters.llamacpp_gguf": ("exporters.llamacpp.gguf",),
    "exporters.llamacpp_setup": ("exporters.llamacpp.setup",),
    "exporters.llamacpp_weights": ("exporters.llamacpp.weights",),
    "models": ("models.family", "models.mapping", "models.rules"),
    "models.layers": ("models.layers.transformer", "models.layers.taps", "models.layers.norms", "models.layers.rope",
                      "models.layers.attention", "models.layers.mla", "models.layers.gated_deltanet",
                      "models.layers.router", "models.layers.experts", "models.layers.moe", "models.args"),
    "models.routing": ("models.layers.routing",),
    "models.sampling": ("models.layers.sampling",),
    "models.faults": ("models.faults.catalogue", "models.faults.fault", "models.faults.router",
                      "models.faults.experts", "models.faults.attention", "models.faults.mla",
                      "models.faults.gated_deltanet", "models.faults.layer"),
    "models.conversion_faults": ("oracle.selftest.conversion_faults",),
    "models.cache": ("oracle.cache.store",),
    "models.trained": ("oracle.source.trained",),
    "models.quantized": ("oracle.source.quantized", "models.checkpoint"),
    "models.checkpoint": ("models.checkpoint", "oracle.source.published", "oracle.source.seeded", "oracle.source.identity",
                          "oracle.cache.files", "oracle.cache.store"),
    "oracle.artifacts": ("oracle.cache.artifacts",),
    "oracle.sources": ("oracle.source.sources",),
    "oracle.validation": ("oracle.source.validation",),
    "oracle.reference": ("oracle.reference.run", "oracle.reference.streaming", "oracle.reference.saved"),
    "oracle.references": ("oracle.reference.cached",),
    "oracle.metrics": ("oracle.verdict.metrics",),
    "oracle.compare": ("oracle.verdict.compare",),
    "oracle.e2e": ("oracle.verdict.e2e",),
    "oracle.thresholds": ("oracle.verdict.thresholds",),
    "oracle.noise": ("oracle.verdict.noise",),
    "oracle.replay": ("oracle.verdict.replay",),
    "oracle.portable": ("oracle.verdict.portable",),
    "oracle.distribution": ("oracle.verdict.distribution",),
    "oracle.insitu": ("oracle.verdict.insitu",),
    "oracle.quantization": ("oracle.verdict.quantization",),
    "oracle.arithmetic": ("oracle.verdict.arithmetic",),
    "oracle.expected": ("oracle.verdict.expected",),
    "oracle.goldens": ("oracle.verdict.goldens",),
    "oracle.sampling": ("oracle.verdict.sampling",),
    "oracle.conversion": ("oracle.verdict.conversion",),
    "oracle.points": ("oracle.drill.points",),
    "oracle.selftest": ("oracle.selftest.run", "oracle.selftest.result", "oracle.selftest.judge"),
    "oracle.conversion_selftest": ("oracle.selftest.conversion",),
    "oracle.result": ("oracle.reports.result",),
    "oracle.report": ("oracle.reports.markdown",),
    "oracle.html": ("oracle.reports.html",),
    "oracle.summary": ("oracle.reports.summary",),
    "oracle.baseline": ("oracle.reports.baseline",),
    "oracle.provenance": ("oracle.reports.provenance",),
    "oracle.cli": ("oracle.cli.common", "oracle.cli.check", "oracle.cli.export", "oracle.cli.selftest",
                   "oracle.cli.matrix", "oracle.cli.report", "oracle.cli.goldens", "oracle.cli.reference",
                   "oracle.cli.cache", "oracle.cli.info"),
}


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"{old} moved to {new} in {RELEASE}", DeprecationWarning, stacklevel=stacklevel)


def lookup(old: str, name: str):
    """`old.name` where it is now: the first of the modules `old`'s content went to that has it."""
    for new in MOVED[old]:
        module = importlib.import_module(new)
        if name in vars(module):
            value = vars(module)[name]
            home = value.__module__ if isinstance(value, (type, types.FunctionType)) else new
            _warn(f"{old}.{name}", f"{home}.{name}", stacklevel=4)  # the frame that asked for it
            return value
    raise AttributeError(f"module {old!r} has no attribute {name!r} (its content moved: {', '.join(MOVED[old])})")


def forward(old: str):
    """A module `__getattr__` for a package that is an old module's path (`exporters.mlx`): an attribute
    the package does not have is looked up where the old module's content went."""
    def __getattr__(name: str):
        # a submodule (`from exporters.mlx import backend`: the import system asks for the attribute first)
        # is imported by the import system, not looked up here
        if name.startswith("__") or _submodule(f"{old}.{name}"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        return lookup(old, name)

    return __getattr__


def _submodule(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # its parent is no package (a stand-in of a module that was split)
        return False


class _Alias(importlib.abc.Loader):
    def __init__(self, old: str):
        self.old = old

    def create_module(self, spec):
        targets = MOVED[self.old]
        if len(targets) == 1:  # moved whole: the module itself under its old name
            _warn(self.old, targets[0])
            return importlib.import_module(targets[0])
        module = types.ModuleType(self.old, f"{self.old}: moved to {', '.join(targets)} ({RELEASE})")
        module.__getattr__ = forward(self.old)
        return module

    def exec_module(self, module):
        pass

    def get_code(self, fullname):  # `python -m old.path` runs the new module
        new = MOVED[self.old][0]
        _warn(self.old, new)
        return importlib.util.find_spec(new).loader.get_code(new)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED or fullname in ("models",):
            return None
        here = importlib.machinery.PathFinder.find_spec(fullname, path)
        if here is not None:  # still a module or package of its own (exporters.mlx): not an alias
            return None
        new = MOVED[fullname]
        origin = importlib.util.find_spec(new[0]).origin if len(new) == 1 else None  # `python -m` reads __file__
        return importlib.util.spec_from_loader(fullname, _Alias(fullname), origin=origin)


def install() -> None:
    """Put the finder of the old paths first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
