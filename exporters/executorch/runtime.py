"""ExecuTorch's runtime without its compiler: what runs a program (the executorch backends, and the
child process that validates a given .pte, exporters/shared/given.py) imports this alone."""

from __future__ import annotations

from pathlib import Path


def runtime():
    """executorch.runtime's Runtime, without importing the compiler.

    The pybindings import `executorch.exir._warnings` (two decorators) and with it the whole
    of `executorch.exir` (4 s here), which running a cached program never uses. That one file is
    loaded on its own under its own name while the runtime imports; a later `import
    executorch.exir` (lowering) loads the real package and finds the same `_warnings`."""
    import importlib.util
    import sys
    import types

    if "executorch.runtime" not in sys.modules and "executorch.exir" not in sys.modules:
        exir = Path(importlib.util.find_spec("executorch").submodule_search_locations[0]) / "exir"
        spec = importlib.util.spec_from_file_location("executorch.exir._warnings", exir / "_warnings.py")
        warn = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(warn)
        stub = types.ModuleType("executorch.exir")
        stub.__path__, stub._warnings = [str(exir)], warn
        sys.modules["executorch.exir._warnings"] = warn
        sys.modules["executorch.exir"] = stub
        try:
            import executorch.runtime  # noqa: F401
        finally:
            if sys.modules.get("executorch.exir") is stub:
                del sys.modules["executorch.exir"]
            import executorch

            if getattr(executorch, "exir", None) is stub:
                del executorch.exir
    from executorch.runtime import Runtime

    return Runtime.get()
