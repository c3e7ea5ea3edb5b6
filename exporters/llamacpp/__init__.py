"""`llamacpp`: the checkpoint converted to GGUF by llama.cpp's own converter and run by llama.cpp
(llama-cpp-python's build of it) (docs/llamacpp.md)."""

from models import moved

__getattr__ = moved.forward("exporters.llamacpp")  # the names of the module this package was before 2026-12, for one release
