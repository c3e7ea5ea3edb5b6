"""moe-oracle: numerical validation of MoE LLM backends against HF transformers fp32.

The harness by stage: source/ (the checkpoint and inputs), reference/ (HF's), verdict/ (how a
candidate is judged), drill/ (inside a failing block), selftest/ (the seeded faults), reports/ (results
and their renderings), cli/ (a module per command), cache/ (the artifact cache); check.py runs the
stages of one check, matrix.py many; backend.py is the contract and the one door to the backends."""

__version__ = "0.1.0"

from models import moved

moved.install()  # the import paths of before the 2026-12 reorganisation, for one release
