"""The `cuda` backend (torch.compile, Inductor) and `executorch-cuda`. Here (a CPU build of
torch, no GPU) both are `skipped` with the reason and --require exits 3; the compiled path is
exercised with Inductor's C++ kernels on the CPU (CudaBackend(device="cpu")). The GPU tests
are marked `gpu` and run only where torch sees a CUDA device."""

import pytest
import torch

from exporters.cuda import CudaBackend
from models import FAMILY_NAMES
from oracle.backend import CheckSpec
from oracle.check import run_check

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason=f"no CUDA device (torch {torch.__version__})")


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the backends run")
@pytest.mark.parametrize("backend", ["cuda", "executorch-cuda"])
def test_without_a_gpu_both_are_skipped_with_the_reason(cli, backend):
    p = cli("check", "--family", "olmoe", "--backend", backend)
    assert p.returncode == 0 and "Skipped: torch is a CPU build" in p.stdout
    p = cli("check", "--family", "olmoe", "--backend", backend, "--require")
    assert p.returncode == 3


def test_compiled_functions_pass_on_the_cpu():
    """Every block and the whole model through torch.compile(fullgraph=True), Inductor's C++
    kernels: the backend's logic where no GPU is; fp32 limits, tokens exact."""
    r = run_check(CheckSpec(family="olmoe", backend="cuda", decode_tokens=3), CudaBackend(device="cpu"))
    assert r.status == "pass", (r.worst, r.error)
    assert len(r.blocks) == 10 and all(b.status == "pass" for b in r.blocks)
    assert r.e2e.token_exact and "Inductor" in r.provenance["backend"]["executor"]


def test_a_fault_in_the_compiled_model_is_localised():
    from models import faults

    fault = faults.get("router_softmax_after_topk")
    r = run_check(CheckSpec(family="olmoe", backend="cuda", decode_tokens=2), CudaBackend(device="cpu").with_fault(fault))
    assert r.status == "fail" and r.worst["kind"] == "router"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("backend", ["cuda", "executorch-cuda"])
def test_on_the_gpu(family, backend, precision):
    r = run_check(CheckSpec(family=family, backend=backend, precision=precision))
    assert r.status == "pass", (r.worst, r.error, r.e2e and r.e2e.status)
    assert any(b.status == "pass" for b in r.blocks)
