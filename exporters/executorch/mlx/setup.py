"""Make ExecuTorch's MLX delegate importable from the pip wheel, without touching site-packages.

The executorch 1.5.1 wheel ships the delegate's Python side (`executorch.backends.mlx`) but
not the files its code generator writes from `serialization/schema.fbs`, so
`import executorch.backends.mlx` fails with "MLX delegate generated files not found". This
module regenerates them with the wheel's own `flatc` (`executorch/data/bin/flatc`) and the
wheel's own generator (`serialization/generate.py`), leaving out the C++ loader (its
templates are not in the wheel and nothing in Python needs it), into

    <cache_root>/executorch-mlx-delegate/<executorch version>/mlx/
        serialization/            the wheel's package files, copied, plus what generate.py writes:
            mlx_graph_schema.py, _generated_serializers.py, _generated/mlx_delegate/*.py
        _generated_inspector.py   (pte_inspector's field table)

and puts that `mlx/` directory first on `executorch.backends.mlx.__path__` before the
package's `__init__` runs, so `executorch.backends.mlx.serialization` (and the inspector
table) come from the cache and everything else from the wheel.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

PACKAGE = "executorch.backends.mlx"
SERIALIZATION_FILES = ("__init__.py", "generate.py", "mlx_graph_serialize.py", "schema.fbs")


def wheel_dirs() -> tuple[Path, Path]:
    """(site-packages/executorch/backends/mlx, the wheel's flatc)."""
    spec = importlib.util.find_spec("executorch")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("executorch is not installed")
    root = Path(next(iter(spec.submodule_search_locations)))
    return root / "backends" / "mlx", root / "data" / "bin" / "flatc"


def delegate_dir() -> Path:
    from oracle.cache.store import cache_root

    return cache_root() / "executorch-mlx-delegate" / importlib.metadata.version("executorch") / "mlx"


def generate(site_mlx: Path, flatc: Path, out: Path) -> None:
    """Run the wheel's generator (minus the C++ loader) with `out` as its package directory."""
    ser = out / "serialization"
    ser.mkdir(parents=True)
    for f in SERIALIZATION_FILES:
        shutil.copyfile(site_mlx / "serialization" / f, ser / f)
    spec = importlib.util.spec_from_file_location("_mlx_delegate_generate", ser / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # its dataclasses look their module up
    try:
        spec.loader.exec_module(gen)  # its paths (SCRIPT_DIR, GENERATED_DIR, ...) are now under `out`
    finally:
        del sys.modules[spec.name]
    r = subprocess.run([str(flatc), "--python", "-o", str(gen.GENERATED_DIR), str(gen.SCHEMA_FBS)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"flatc failed: {r.stderr.strip()}")
    with contextlib.redirect_stdout(sys.stderr):  # its progress line is not part of any command's output
        gen._fixup_flatc_imports()
    schema = gen.parse_fbs(gen.SCHEMA_FBS)
    for fn, path in ((gen.generate_python_schema, gen.GENERATED_SCHEMA_PY),
                     (gen.generate_python_serializers, gen.GENERATED_SERIALIZERS),
                     (gen.generate_inspector, gen.GENERATED_INSPECTOR)):
        Path(path).write_text(fn(schema))
    # the _generated package's __init__, as generate.py's main() writes it
    names = sorted([t.name for t in schema.tables] + [e.name for e in schema.enums]
                   + [s.name for s in schema.structs] + [u.name for u in schema.unions])
    prefix = f"{PACKAGE}.serialization._generated.mlx_delegate"
    (gen.GENERATED_DIR / "__init__.py").write_text(
        "".join(f"from {prefix}.{n} import {n}\n" for n in names) + f"\n__all__ = {names!r}\n")


def ensure_generated() -> Path:
    """The cached generated files (built once per executorch version)."""
    target = delegate_dir()
    if (target / "serialization" / "mlx_graph_schema.py").is_file():
        return target
    site_mlx, flatc = wheel_dirs()
    if not flatc.is_file():
        raise FileNotFoundError(f"the executorch wheel has no flatc at {flatc}")
    target.parent.mkdir(parents=True, exist_ok=True)
    from oracle.cache.files import temp_dir

    tmp = temp_dir(target.parent) / "mlx"
    try:
        generate(site_mlx, flatc, tmp)
        if not target.exists():
            os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
    return target


def import_delegate():
    """`executorch.backends.mlx`, importable (the generated files first on its search path)."""
    mod = sys.modules.get(PACKAGE)
    if mod is not None:
        return mod
    generated = ensure_generated()
    import executorch.backends as parent

    site_mlx, _ = wheel_dirs()
    spec = importlib.util.spec_from_file_location(
        PACKAGE, site_mlx / "__init__.py", submodule_search_locations=[str(generated), str(site_mlx)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        del sys.modules[PACKAGE]
        raise
    parent.mlx = mod
    return mod


def delegate_problem() -> str | None:
    """Why the MLX delegate cannot be set up here, or None: its generated files are made (or found in
    the cache) and the wheel's package is there; not imported (its `__init__` imports ExecuTorch's
    compiler: seconds under `oracle backends` or a warm check that a cached program does not need). A
    broken install fails where the delegate is imported, as that check's error with the import's message."""
    try:
        ensure_generated()
        site_mlx, _ = wheel_dirs()
        if not (site_mlx / "__init__.py").is_file():
            raise FileNotFoundError(f"the executorch wheel has no {PACKAGE} ({site_mlx})")
    except Exception as e:
        return f"the ExecuTorch MLX delegate cannot be set up ({type(e).__name__}: {e})"
    return None

if __name__ == "__main__":  # the wheel's pte_inspector with the delegate set up, e.g. as ExecuTorch's CI counts:
    # python -m exporters.executorch.mlx.setup model.pte --mlx-instructions | grep -c AsTypeNode
    import_delegate()
    from executorch.backends.mlx import pte_inspector

    pte_inspector.main()
