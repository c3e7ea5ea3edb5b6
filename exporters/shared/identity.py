"""What a lowered program is a function of besides its weight values (shared by the backends whose
programs take their weights from outside: iree-llvm-cpu's model.irpa, executorch's model.ptd): two
production models with one identity compile to one program whatever their weights (another seed, a
seeded fault that edits weights alone)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from models.layers.transformer import Transformer


def production_structure(src, dtype: torch.dtype = torch.float32) -> Transformer:
    """The production model (fp32, or `dtype`) as Family.build_from lays it out, without reading a weight: its
    parameters on the meta device (names, shapes, dtypes), its buffers real (computed from the
    config: RoPE inv_freq, cache_pos, the zero state). Enough for a program's identity, IREE's
    block programs and the blocks' non-parameter inputs."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = Transformer(src.args, dtype)
    return model.eval()


def fingerprint(module: nn.Module, where: str) -> str:
    """What determines a block's program besides its weight values: module types, plain
    attributes, tensor shapes. A method or tensor set on an instance (how a seeded fault
    patches one block) makes the block's program its own (`where` names the block)."""
    h = hashlib.sha256()
    for path, sub in module.named_modules():
        h.update(f"{path}:{type(sub).__module__}.{type(sub).__qualname__}\n".encode())
        for k, v in sorted(vars(sub).items()):
            if k.startswith("_"):
                continue
            patched = callable(v) or isinstance(v, torch.Tensor)
            h.update(f" {k}={'patched@' + where if patched else repr(v)}\n".encode())
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.hexdigest()[:16]


def program_identity(model: nn.Module) -> str:
    """What a program with external weights (model.vmfb, model.pte) is a function of: the fingerprint
    of the whole model and the values of its buffers (derived constants such as RoPE's inv_freq are in
    the program; the parameters are not). Two models with one identity compile to one program whatever
    their weight values."""
    h = hashlib.sha256(fingerprint(model, "model").encode())
    for name, t in model.named_buffers():
        h.update(name.encode() + b"\0" + t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
