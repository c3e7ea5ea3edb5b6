"""What a compiled IREE program of this project is: the compiler flags (llvm-cpu for this host's
CPU), the parameter archive beside it and its scope, and the op census of its MLIR. Shared by the
backend (exporters/iree/), its export (exporters/iree/export.py) and the validation of a given
.vmfb (exporters/shared/given.py); imports nothing heavy."""

from __future__ import annotations

import hashlib
import platform
import re
from pathlib import Path

FLAGS = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
         "--iree-llvmcpu-target-cpu=host")
PARAMS_FILE = "model.irpa"  # the model's parameters, beside model.vmfb
PARAMS_INFO = "model.irpa.json"  # its sha256, size and mtime, written with it
PARAM_SCOPE = "model"  # the scope of every `#flow.parameter.named<scope::name>`


def host_cpu() -> str:
    """What `--iree-llvmcpu-target-cpu=host` compiles for: CPU model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        desc = "\n".join(dict.fromkeys(lines))
    except OSError:
        desc = platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(desc.encode()).hexdigest()[:16]}"


OPS_FILE = "mlir_ops.txt"
_OP = re.compile(r"^\s*(?:%[^=]*=\s*)?\"?([a-z_][\w]*\.[\w.]+)\"?[\s(<{:]")


def mlir_ops(text: str) -> dict:
    """Op name -> count over the module's text (one op per line), up to the `{-# dialect_resources`
    trailer: its blob names encode shapes (the cache length), not ops."""
    counts = {}
    for line in text.split("\n{-#")[0].splitlines():
        m = _OP.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts
