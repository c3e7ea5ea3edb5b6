"""`executorch-metal`: the production exporter for ExecuTorch's Metal backend (AOTInductor
for Apple GPUs), as examples/models/qwen3_5_moe/export.py does it:

- the same strict torch.export of the two methods as the CPU backend (prefill with the
  largest example length: AOTI sizes its buffers from it; decode T = 1), logits only (the
  sampler stays on the host, as in the seed's Metal export);
- `--qlinear 4w`: torchao's `fpa4w` (fp activations, int4 weights: Metal's 4-bit recipe),
  `--qlinear-group-size` (default 32), nn.Linear layers only;
- one MetalPartitioner per method.

A check runs the same program as the CPU backend's candidate does (taps, probe methods).
Needs macOS with a Metal (MPS) device and the Metal backend; elsewhere it is unavailable
with the reason. Untested on a device: see docs/executorch.md.
"""

from __future__ import annotations

import platform

import torch

from exporters.executorch.backend import ExecutorchBackend, missing_executorch
from exporters.executorch.export import export_methods, export_options, metadata, qlinear_options, quantize_linears


class ExecutorchMetalBackend(ExecutorchBackend):
    kind = "executorch-metal"
    rebinds_weights = False  # its weights file is the lowering's own blob
    source = "exporters/executorch/metal.py"
    precisions = ("bf16", "fp32")
    dense_prefill = False  # the traced MoE gathers each token's experts, as the seed exports do
    qlinear = ("4w",)
    # no `sample`: the Metal export keeps the sampler on the host, as the seed's Metal export
    # does (--sample fuses it for executorch and executorch-cuda)
    option_schema = export_options(qlinear, sample=False)

    def unavailable(self) -> str | None:
        if platform.system() != "Darwin":
            return f"not macOS ({platform.system()})"
        if not torch.backends.mps.is_available():
            return "no Metal (MPS) device"
        reason = missing_executorch()
        if reason:
            return reason
        try:
            import executorch.backends.apple.metal.metal_backend  # noqa: F401
            import executorch.backends.apple.metal.metal_partitioner  # noqa: F401
        except Exception as e:
            return f"the ExecuTorch Metal backend does not load ({type(e).__name__}: {e})"
        return None

    def options(self, spec) -> dict:
        """No sampler in the program (`--sampling` rows are skipped; `sample` is not an option)."""
        return qlinear_options(spec)

    def executor(self, opts: dict) -> str:
        return "Metal backend (AOTInductor)"

    def quantize(self, model, opts: dict) -> None:
        quantize_linears(model, {**opts, "qlinear": "fpa4w"})  # Metal's int4 weight-only recipe

    def exported_programs(self, model, spec) -> dict:
        """The programs this exporter lowers (torch.export, before lowering)."""
        return export_methods(self.production_model(model, spec, self.options(spec)))

    def lower(self, methods: dict, model, opts: dict):
        import torch._inductor.config as inductor_config
        from executorch.backends.apple.metal.metal_backend import MetalBackend
        from executorch.backends.apple.metal.metal_partitioner import MetalPartitioner
        from executorch.devtools.intermediate_output_tap import strip_taps_
        from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
        from executorch.exir.passes import MemoryPlanningPass

        inductor_config.coordinate_descent_tuning = False
        inductor_config.aot_inductor.compile_wrapper_opt_level = "O0"
        edge = to_edge_transform_and_lower(
            methods, constant_methods=metadata(model),
            partitioner={n: [MetalPartitioner([MetalBackend.generate_method_name_compile_spec(n)])] for n in methods},
            compile_config=EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True))
        strip_taps_(edge)
        return edge.to_executorch(ExecutorchBackendConfig(
            extract_delegate_segments=True, do_quant_fusion_and_const_prop=True,
            memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False)))


BACKEND = ExecutorchMetalBackend()
