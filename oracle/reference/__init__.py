"""The HF transformers reference: captured with hooks on every block (run.py), whole or streamed from the
checkpoint layer by layer (streaming.py), saved and portable (saved.py), and a check's own, cached
(cached.py)."""

from models import moved

__getattr__ = moved.forward("oracle.reference")  # the names of the module this package was before 2026-12, for one release
