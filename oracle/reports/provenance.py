"""What a result records about where it was made: the versions of the tools that matter, the
Python, the host (left out of every comparison: oracle/verdict/portable.py), the seed and the limits' hash."""

from __future__ import annotations

import hashlib
import os
import platform

from oracle.verdict import thresholds
from oracle.backend import CheckSpec

PACKAGES = ("torch", "transformers", "safetensors", "numpy", "executorch", "iree-base-compiler",
            "iree-base-runtime", "iree-turbine", "mlx", "mlx-lm", "llama-cpp-python", "moe-oracle")


def provenance(spec: CheckSpec, backend=None) -> dict:
    """Versions, host, seed, thresholds. torch's intra-op thread count only where the candidate
    runs torch (a backend without `runs_torch = False`: a warm check of one that runs no torch
    never imports it)."""
    from oracle.cache.artifacts import versions

    host = {"name": platform.node(), "machine": platform.machine(), "system": platform.system(),
            "cpus": os.cpu_count()}
    if backend is None or backend.runs_torch:  # None: a saved reference (HF, torch)
        import torch

        host["torch_threads"] = torch.get_num_threads()
    return {
        "versions": {p: v for p, v in versions(*PACKAGES).items() if v is not None},
        "python": platform.python_version(),
        "host": host,
        "seed": spec.seed,
        "thresholds_sha256": hashlib.sha256(thresholds.DEFAULT_PATH.read_bytes()).hexdigest(),
    }
