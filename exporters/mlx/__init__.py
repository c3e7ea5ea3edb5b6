"""`mlx`: the family's mlx-lm model built from the same HF checkpoint as the reference, on mlx (the CPU
on Linux, the Metal GPU on Apple silicon) (docs/mlx.md)."""

from models import moved

__getattr__ = moved.forward("exporters.mlx")  # the names of the module this package was before 2026-12, for one release
