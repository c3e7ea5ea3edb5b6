"""The production model's mechanisms, a module each: norms, rope, attention (softmax with a KV cache;
multi-head latent attention; the Gated DeltaNet), the MoE (router and its routing, experts, the MoE
block with shared experts), the decoder stack (transformer.py), the taps the drill records, the
sampling head. A new mechanism is a new module here; a family is a file in models/."""

from models import moved

__getattr__ = moved.forward("models.layers")  # the names of the module this package was before 2026-12, for one release
