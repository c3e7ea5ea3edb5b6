"""The `cuda` backend (torch.compile, Inductor) and `executorch-cuda`. Here (a CPU build of
torch, no GPU) both are `skipped` with the reason and --require exits 3; the compiled path is
exercised with Inductor's C++ kernels on the CPU (CudaBackend(device="cpu")). The GPU tests
are marked `gpu` and run only where torch sees a CUDA device."""

from dataclasses import replace

import pytest
import torch

from exporters.torch.cuda import CudaBackend
from models import FAMILY_NAMES
from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.source.sources import model_source

HAS_GPU = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_GPU, reason=f"no CUDA device (torch {torch.__version__})")
SPEC_BF16 = CheckSpec(family="qwen3_moe", backend="cuda", precision="bf16")  # the compiled path's tests on the CPU


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the backends run")
@pytest.mark.parametrize("backend", ["cuda", "executorch-cuda"])
def test_without_a_gpu_both_are_skipped_with_the_reason(cli, backend):
    p = cli("check", "--family", "olmoe", "--backend", backend)
    assert p.returncode == 0 and "Skipped: torch is a CPU build" in p.stdout
    p = cli("check", "--family", "olmoe", "--backend", backend, "--require")
    assert p.returncode == 3


@pytest.mark.skipif(HAS_GPU, reason="a GPU is present: the controls run")
@pytest.mark.parametrize("backend", ["eager", "hf"])
def test_without_a_gpu_the_controls_are_skipped_with_the_reason(cli, backend):
    """`--option device=cuda` (the GPU controls: the production model eagerly, HF transformers itself):
    skipped here with the reason, as the cuda backend is; --require exits 3; a device no torch has is bad input."""
    p = cli("check", "--family", "olmoe", "--backend", backend, "--option", "device=cuda")
    assert p.returncode == 0 and "Skipped: --option device=cuda: torch is a CPU build" in p.stdout
    p = cli("check", "--family", "olmoe", "--backend", backend, "--option", "device=cuda", "--require")
    assert p.returncode == 3
    p = cli("check", "--family", "olmoe", "--backend", backend, "--option", "device=gpu")
    assert p.returncode == 2 and "allowed values are cpu, cuda" in p.stderr


@pytest.mark.parametrize("backend", ["eager", "hf"])
def test_the_controls_device_path_on_the_cpu(backend):
    """The controls' code path with the device a parameter (device=cpu: the model moved there, every
    input moved per call, every output brought back to the host), at bf16 on qwen3_5_moe (attention,
    Gated DeltaNet, MoE): passes within bf16's own error with every block, the routes recorded."""
    spec = CheckSpec(family="qwen3_5_moe", backend=backend, precision="bf16", options={"device": "cpu"})
    r = run_check(spec)
    assert r.status == "pass", (r.worst, r.error)
    assert len(r.blocks) == 18 and all(b.status == "pass" for b in r.blocks)
    assert r.e2e.routing["recorded"] and r.e2e.routing["divergences"] == 0


def test_inductor_at_bf16_on_qwen3_moe_chose_another_expert_at_a_tie():
    """The H100's open question (2026-11-27: tokens exact, blocks within noise, e2e steps 3.3-5.4x HF
    bf16's error; 2.4-5.8x with Inductor's C++ kernels here). Its routers' choices, recorded: at layer 0,
    position 4 Inductor takes expert 5 for the reference's 2, a gap of 1.7e-4 against a tie bound of
    5.8e-3 there: a tie. Judged against HF with that choice forced, every step is within bf16's noise:
    a false alarm that propagated through the KV cache, not an Inductor defect (docs/noise.md).

    Also the compiled path itself: every block and the whole model through torch.compile(fullgraph=True),
    Inductor's C++ kernels, the backend's logic where no GPU is. Each block is traced for the prefill's length
    and the decode's, the model for both: the hooks recording the routers' choices (oracle/verdict/replay.py
    RouteLog) made every call of a router or MoE block trace again (64 graphs on olmoe). (An olmoe fp32 check
    of its own did this before: 52 s of a cold suite on 2 cores for a second compile; issue 76's budget.)"""
    from torch._dynamo.utils import counters

    counters.clear()
    r = run_check(SPEC_BF16, CudaBackend(device="cpu"))
    routing = r.e2e.routing
    assert r.status == "pass", (r.worst, r.e2e.status, routing)
    assert len(r.blocks) == 10 and all(b.status == "pass" for b in r.blocks)
    assert r.e2e.token_exact and "Inductor" in r.provenance["backend"]["executor"]
    assert counters["stats"]["unique_graphs"] <= 2 * len(r.blocks) + 2, dict(counters["stats"])
    assert routing["recorded"] and routing["aligned"] and routing["divergences"] == 0
    assert any(d["verdict"] == "tie" and d["gap"] <= d["bound"] for d in routing["differences"])
    # the plain comparison (no routing aligned) is what failed before: far beyond the aligned one
    assert max(p["max_abs"] for p in routing["plain"]) > 5 * max(s["max_abs"] for s in r.e2e.steps)


def test_a_fault_in_the_compiled_model_is_localised():
    from models.faults import catalogue as faults

    fault = faults.get("router_no_renorm")  # (qwen3_moe renormalises: a softmax after its top-k is the same)
    # the spec of the test above: the blocks the fault leaves alone are its compiled graphs again (Inductor's
    # cache; the KV cache's length is prompt + decode tokens, a shape of every graph)
    # (the verdict's row is what is tested, not the drill inside it: tests/test_drill.py)
    r = run_check(replace(SPEC_BF16, drill="off"), CudaBackend(device="cpu").with_fault(fault))
    assert r.status == "fail" and r.worst["kind"] == "router"
    assert r.worst["layer"] == fault.layer(model_source(SPEC_BF16).args)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("backend", ["cuda", "executorch-cuda"])
def test_on_the_gpu(family, backend, precision):
    r = run_check(CheckSpec(family=family, backend=backend, precision=precision))
    assert r.status == "pass", (r.worst, r.error, r.e2e and r.e2e.status)
    assert any(b.status == "pass" for b in r.blocks)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("backend", ["eager", "hf"])
def test_the_controls_on_the_gpu(family, backend):
    """The production model eagerly and HF transformers on the GPU at bf16: within bf16's own error
    (2026-11-27, by hand: 30/30 at 1.0-1.3x HF bf16's CPU error, docs/cuda.md)."""
    r = run_check(CheckSpec(family=family, backend=backend, precision="bf16", options={"device": "cuda"}))
    assert r.status == "pass", (r.worst, r.error, r.e2e and r.e2e.status)
    assert r.provenance["backend"]["device"] == "cuda"
