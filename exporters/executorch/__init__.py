"""The ExecuTorch backends: `executorch` (XNNPACK and portable kernels on the CPU), `executorch-cuda`,
`executorch-metal` (AOTInductor lowerings of the same export) and `executorch-mlx` (the MLX delegate,
exporters/executorch/mlx/) (docs/executorch.md, docs/executorch_mlx.md)."""

from models import moved

__getattr__ = moved.forward("exporters.executorch")  # the names of the module this package was before 2026-12, for one release
