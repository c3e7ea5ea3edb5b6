import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tiny checkpoints and compiled artifacts: a cache inside the checkout unless one is given
os.environ.setdefault("MOE_ORACLE_CACHE", str(ROOT / ".cache" / "moe-oracle"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def run_cli(*args, cwd=ROOT, env=None):
    """`oracle ...` in a subprocess (exit codes and stdout/stderr as a user sees them)."""
    e = {**os.environ, **(env or {})}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "oracle.cli", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="session")
def cli():
    return run_cli

import logging  # noqa: E402

import torch  # noqa: E402,F401

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)
