"""`cuda`: the production model compiled by torch.compile (Inductor: Triton kernels on the GPU),
fp32 and bf16: what a CUDA serving stack runs, and the control when `executorch-cuda`
disagrees.

Every function the check calls is compiled with `fullgraph=True`: a graph break is an error
(the row's), never a silent fall back to eager for part of the block. Blocks (one compiled
function per block of each layer, the reference's calls as inputs) and the whole model
(prefill: a new sequence, state reset outside the compiled graph; decode: one token on the
carried KV cache / recurrent state, updated in place inside the graph). Dynamo's recompile
limit is raised for the check (a model of 48 layers compiles each block kind per layer): a
function that would exceed it raises instead of running eagerly.

`CudaBackend(device="cpu")` (tests) compiles the same functions with Inductor's C++ backend on
the CPU: how the backend is tested where there is no GPU (the kernels are not the GPU's; the
report's executor says which ran). Outputs come back to the host.
"""

from __future__ import annotations

import torch

from exporters.torch.candidate import DTYPES, TorchCandidate, cuda_unavailable
from models.layers.transformer import block_fn
from oracle.backend import Backend

RECOMPILE_LIMIT = 4096  # per function: each (layer, block kind, length) is its own compiled graph


def compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False)


class CompiledCandidate(TorchCandidate):
    """The production model on `device`, every call a torch.compile'd (Inductor) function."""

    def __init__(self, model, dtype, device: str, info: dict):
        super().__init__(model, dtype, info, device)
        self.forward = compiled(model)
        self.fns = {}  # (layer, kind) -> compiled block function

    def block(self, layer, kind):
        module, fn = block_fn(self.model, layer, kind)
        if (layer, kind) not in self.fns:
            self.fns[layer, kind] = compiled(fn)
        return module, self.fns[layer, kind]


class CudaBackend(Backend):
    """`device` "cpu" (tests only, not a CLI option): the same compiled functions with Inductor's
    C++ kernels, how the backend is tested on a host without a GPU."""

    precisions = tuple(DTYPES)
    memory_per_param = {"fp32": 4.4, "bf16": 2.4}  # host side: the model is built there, then moved
    memory_note = "the production model, built on the host and moved to the device"

    def __init__(self, name: str = "cuda", transform=None, transform_id: str | None = None, device: str = "cuda"):
        self.name, self.transform, self.transform_id, self.device = name, transform, transform_id, device

    def availability(self):
        why = cuda_unavailable() if self.device == "cuda" else None
        return (False, why) if why else (True, "")

    def with_fault(self, fault):
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.id, self.device)

    def load(self, model, spec):
        import torch._dynamo

        device = self.device
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, RECOMPILE_LIMIT)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, RECOMPILE_LIMIT)
        m = model.build_production(DTYPES[spec.precision])
        if self.transform is not None:
            self.transform(m)
        m = m.to(device)
        gpu = torch.cuda.get_device_name() if device == "cuda" else "CPU (Inductor C++ kernels)"
        info = {"executor": f"torch {torch.__version__} torch.compile (Inductor, fullgraph) on {device}",
                "device": device, "host": {"device_name": gpu}}  # host facts: left out of every comparison
        return CompiledCandidate(m, DTYPES[spec.precision], device, info)


BACKEND = CudaBackend()
