"""`executorch-cuda`: the production exporter for ExecuTorch's CUDA backend (AOTInductor +
Triton kernels), as examples/models/qwen3_5_moe/export.py does it for Qwen3.5-MoE:

- the same strict torch.export of the two methods as the CPU backend (prefill with the
  largest example length, which AOTI needs to size its kernels; decode T = 1);
- `--qlinear 4w` (torchao int4 weight-only, tile_packed_to_4d, quantized on the GPU) or
  `8w`, `--qlinear-group-size` (default 32); the nn.Linear layers only: the stacked expert
  weights stay bf16/fp32 (the seed's packed-INT4 fused-MoE Triton kernel is not used);
- one CudaPartitioner per method (low-memory mode, compile-time autotuning), state recorded
  as `get_mutable_buffer_metadata`, weights in aoti_cuda_blob.ptd beside model.pte.

A check runs the same program as the CPU backend's candidate does (taps, probe methods).
Needs a CUDA build of torch, a GPU and the CUDA backend (triton); elsewhere it is
unavailable with the reason. `--sample` fuses the on-device sampler into prefill and decode
(models/layers/sampling.py: they take temperature, top_p and seed and return the token; a
`use_sampling` constant method tells the runner), as the seed's CUDA export does.
Untested on a device: see docs/executorch.md.
"""

from __future__ import annotations

import json

import torch

from exporters.executorch.backend import ExecutorchBackend, missing_executorch
from exporters.executorch.export import (export_methods, export_options, metadata, qlinear_options, quantize_linears,
                                         sampling_options, state_buffer_names)


class ExecutorchCudaBackend(ExecutorchBackend):
    kind = "executorch-cuda"
    rebinds_weights = False  # its weights file is the lowering's own blob
    source = "exporters/executorch/cuda.py"
    precisions = ("bf16", "fp32")
    dense_prefill = False  # the traced MoE gathers each token's experts, as the seed exports do
    qlinear = ("4w", "8w")
    option_schema = export_options(qlinear, sample=True)

    def unavailable(self) -> str | None:
        if torch.version.cuda is None:
            return f"torch is a CPU build ({torch.__version__})"
        if not torch.cuda.is_available():
            return "no CUDA device"
        reason = missing_executorch()
        if reason:
            return reason
        try:
            import executorch.backends.cuda.cuda_backend  # noqa: F401
            import executorch.backends.cuda.cuda_partitioner  # noqa: F401
        except Exception as e:  # e.g. triton missing
            return f"the ExecuTorch CUDA backend does not load ({type(e).__name__}: {e})"
        return None

    def options(self, spec) -> dict:
        return {**qlinear_options(spec), **sampling_options(spec)}

    def executor(self, opts: dict) -> str:
        return "CUDA backend (AOTInductor)"

    def quantize(self, model, opts: dict) -> None:
        # int4 tile packing runs on the GPU; the packed model is exported from the CPU
        model.to("cuda")
        quantize_linears(model, opts, "tile_packed_to_4d" if opts["qlinear"] == "4w" else None)
        model.to("cpu")

    def exported_programs(self, model, spec) -> dict:
        """The programs this exporter lowers (torch.export, before lowering): no device needed
        unless quantizing."""
        opts = self.options(spec)
        return export_methods(self.production_model(model, spec, opts), sample=bool(opts.get("sample")))

    def lower(self, methods: dict, model, opts: dict):
        import torch._inductor.config as inductor_config
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner
        from executorch.devtools.intermediate_output_tap import strip_taps_
        from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
        from executorch.exir.backend.compile_spec_schema import CompileSpec
        from executorch.exir.passes import MemoryPlanningPass

        inductor_config.coordinate_descent_tuning = False  # minutes of compile, no runtime gain
        inductor_config.aot_inductor.compile_wrapper_opt_level = "O0"

        def partitioner(name):  # one per method: their .so blobs would collide
            return [CudaPartitioner([CudaBackend.generate_method_name_compile_spec(name),
                                     CompileSpec("low_memory_mode", b"ON"),
                                     CompileSpec("emulate_precision_casts", b"OFF"),
                                     CompileSpec("max_autotune", b"ON"),
                                     CompileSpec("autotune_at_compile_time", b"ON")])]

        sample = bool(opts.get("sample"))
        state = state_buffer_names(model, sample) + (state_buffer_names(model, True) if opts.get("sampling") else [])
        meta = {**metadata(model, sample), "get_mutable_buffer_metadata":
                json.dumps({"version": 1, "mutable_buffers": state})}
        edge = to_edge_transform_and_lower(
            methods, partitioner={n: partitioner(n) for n in methods}, constant_methods=meta,
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True))
        strip_taps_(edge)
        return edge.to_executorch(ExecutorchBackendConfig(
            extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False), emit_mutable_buffer_names=True))


BACKEND = ExecutorchCudaBackend()
