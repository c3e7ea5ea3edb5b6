"""`iree-llvm-cpu`: the production model exported with iree-turbine, compiled by iree-compile for the host
CPU and run by iree.runtime (docs/iree.md)."""

from models import moved

__getattr__ = moved.forward("exporters.iree")  # the names of the module this package was before 2026-12, for one release
