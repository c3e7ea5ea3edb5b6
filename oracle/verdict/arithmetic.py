"""Arithmetic a runtime uses that is not a storage dtype: HF transformers run with it, so that its own
error there is measured (oracle/verdict/noise.py) and a candidate is judged against it.

`a8`: the activations of every product with a weight rounded to 8 bits in blocks of 32 values along
the reduction dimension (scale = the block's largest magnitude / 127, stored as fp16; round to
nearest): what llama.cpp computes for quantized weights, whose CPU and CUDA kernels quantize the
activations to Q8_0 / Q8_1 blocks (Q8_K, 256 values, for the k-quants) before each dot product
(ggml-cpu `type_traits_cpu[...].vec_dot_type`). Weights and everything else stay fp32; products of
two activations (attention's q.k and p.v) are not rounded, as llama.cpp's are not at an f32 KV cache.
A product "with a weight" is one whose operand is a parameter of the model or a view of one.

`abf16`, `af16`: the same products with their activations rounded to bf16 / fp16 (llama.cpp's BF16 and
F16 weights: their dot products take the activations in the weight's type), everything else fp32.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode

# precision -> how a weight product's activation is rounded: (bits, block) to integers with a scale per
# block, or a float dtype (llama.cpp's BF16 / F16 weights: their vec_dot rounds the activations so)
PRECISIONS = {"a8": (8, 32), "abf16": torch.bfloat16, "af16": torch.float16}
F = torch.nn.functional


def round_to(x: torch.Tensor, how, dim: int = -1) -> torch.Tensor:
    """x rounded as `how` says (a PRECISIONS value)."""
    if isinstance(how, torch.dtype):
        return x.to(how).to(x.dtype) if x.is_floating_point() else x
    return round_blocks(x, *how, dim=dim)


def round_blocks(x: torch.Tensor, bits: int, block: int, dim: int = -1) -> torch.Tensor:
    """x with its values rounded to `bits`-bit integers times one fp16 scale per `block` values along `dim`."""
    if not x.is_floating_point() or x.shape[dim] % block:
        return x  # llama.cpp quantizes only rows that are whole blocks
    xt = x.movedim(dim, -1)
    shape = xt.shape
    b = xt.reshape(*shape[:-1], shape[-1] // block, block).float()
    top = (1 << (bits - 1)) - 1
    d = (b.abs().amax(-1, keepdim=True) / top).to(torch.float16).float()
    q = torch.where(d > 0, torch.clamp(torch.round(b / torch.where(d > 0, d, 1.0)), -top - 1, top), 0.0)
    return (q * d).to(x.dtype).reshape(shape).movedim(-1, dim)


def _is_weight(t) -> bool:
    while isinstance(t, torch.Tensor):
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base
    return False


class RoundedActivations(TorchFunctionMode):
    """Inside it, the activation operand of F.linear, matmul, mm, bmm, addmm, baddbmm and grouped
    matmuls whose other operand is a weight is rounded (round_blocks)."""

    def __init__(self, how):
        super().__init__()
        self.how = how  # (bits, block) or a dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        r = lambda x, dim=-1: round_to(x, self.how, dim)  # noqa: E731
        if func is F.linear and len(args) >= 2 and _is_weight(args[1]):
            args = (r(args[0]), *args[1:])
        elif func in (torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm, torch.bmm, torch.Tensor.bmm,
                      getattr(torch, "_grouped_mm", None)) and len(args) >= 2:
            a, b = args[0], args[1]
            if _is_weight(b) and not _is_weight(a):
                args = (r(a), b, *args[2:])
            elif _is_weight(a) and not _is_weight(b):
                args = (a, r(b, -2), *args[2:])
        elif func in (torch.addmm, torch.baddbmm) and len(args) >= 3:
            a, b = args[1], args[2]
            if _is_weight(b) and not _is_weight(a):
                args = (args[0], r(a), b, *args[3:])
        return func(*args, **kwargs)


@contextmanager
def arithmetic(precision: str):
    """The precision's arithmetic around HF's forward (nothing for a storage precision)."""
    if precision not in PRECISIONS:
        yield
        return
    with RoundedActivations(PRECISIONS[precision]):
        yield
