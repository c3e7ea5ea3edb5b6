"""Backends: one package per backend (iree/, mlx/, executorch/, llamacpp/, and torch/ for eager, hf and
cuda), each reached by the harness through the registry (oracle/backend.py: BUILTIN)."""

from models import moved

moved.install()  # the import paths of before the 2026-12 reorganisation, for one release
