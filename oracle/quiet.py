"""Third-party chatter (progress bars, fallback warnings) kept out of the report: what every
entry point (the CLI, the matrix's warm workers, the benchmarks) sets before the libraries load
(transformers reads its verbosity at import)."""

from __future__ import annotations

import logging
import os
import warnings


def quiet() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    # without importing torch (a warm check of a backend that runs no torch never does): torch
    # sets the levels of its own registered loggers on import, not of these
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
