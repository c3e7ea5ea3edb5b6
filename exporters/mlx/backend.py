"""`mlx`: the family's mlx-lm model, built from the same HF checkpoint as the reference.

mlx-lm's own modules, `sanitize()`, caches and quantizer; nothing re-implemented but the
config conversion (below) and the checkpoint's expert layout. mlx runs on the CPU on
Linux (`mlx[cpu]`) and on the Metal GPU on Apple silicon (`--device cpu|gpu`, default gpu
where there is one). mlx and mlx-lm are imported lazily: without them the backend is
`unavailable` with the import error as the reason.

Precisions: fp32, bf16, and q8 / q4: mlx-lm's affine quantizer (`mlx_lm.utils.quantize_model`
with the model's own quant_predicate, as `mlx_lm.convert -q` does it) applied to the fp32
model, `--group-size 32|64` (default 64, mlx-lm's default). mlx-lm leaves a layer whose input
dim is not divisible by the group size unquantized without a word: `info["quantization"]`
lists every weight-carrying module as quantized (bits, group size) or not (and why).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import platform
from pathlib import Path

from exporters.mlx.candidate import MLXCandidate
from exporters.mlx.config import (DEFAULT_GROUP_SIZE, GROUP_SIZES, PRECISIONS, QUANT_BITS, mapping, mlx_config,
                                  mlx_module)
from exporters.mlx.directory import RECIPES, load_directory, reference_directory, write_directory
from exporters.mlx.load import cast, load_model, quantization_table, quantize, release_quantization
from exporters.mlx.model import text_model
from models.args import CHUNKED, SLIDING
from models.mlx_lm import ConfigError
from models.release_formats import release_format
from oracle.backend import Backend, Option


class MLXBackend(Backend):
    """`transform(model, args)` modifies the loaded mlx-lm model in place (how exporters/mlx/faults.py
    injects faults; args: the checkpoint's ModelArgs), before any quantization. `config_fn(family, config.json dict)` gives the
    ModelArgs fields (naive_mlx_config shows what mlx-lm's own loader would do)."""

    precisions = PRECISIONS
    cache_namespaces = ("mlx-reference", "quantized")  # the reference directories, the q8/q4 ones it writes
    # the model at its precision (q8/q4: packed weights + a scale and a bias per group of 32),
    # plus one layer's arrays while it is evaluated
    # measured peaks: OLMoE --layers 2 (1.05 B parameters) fp32 4.9, q8 3.4, q4 3.2 GiB; full-size
    # OLMoE (6.92 B) q4 7.9 GiB (docs/benchmarks.md)
    memory_per_param = {"fp32": 4.4, "bf16": 2.4, "q8": 1.4, "q4": 1.2}
    memory_note = "the mlx model at its precision, evaluated a layer at a time"
    runs_torch = False  # the candidate runs no torch (provenance records no torch thread count)
    loads_directory = True  # --candidate-dir: a shipped mlx-lm directory (mlx_lm.convert's output)
    option_schema = (
        Option("device", str, ("cpu", "gpu"), "gpu where mlx has one, else cpu",
               "where mlx runs (gpu: Metal on Apple silicon)", "--device"),
        Option("group_size", int, GROUP_SIZES, DEFAULT_GROUP_SIZE, "quantization group size (q8/q4 only)",
               "--group-size", quantizes=True),
        Option("recipe", str, RECIPES, None, "mlx-lm's mixed quantization recipe (with --precision q4)",
               commands=("export",), quantizes=True),
    )

    def __init__(self, name: str = "mlx", transform=None, transform_id: str | None = None, config_fn=mlx_config):
        self.name, self.transform, self.transform_id, self.config_fn = name, transform, transform_id, config_fn

    def availability(self):
        try:
            import mlx.core  # noqa: F401

            mlx_module("cache")
        except Exception as e:  # ImportError, or a native library that fails to load
            return False, (f"mlx / mlx-lm cannot be imported ({type(e).__name__}: {e}); "
                           "install the extra: pip install 'moe-oracle[mlx]'")
        return True, ""

    def with_quantized_fault(self, name: str, layer: int):
        """This backend with a quantized runtime fault (exporters/mlx/faults.py QUANTIZED_FAULTS)
        in decoder layer `layer`'s experts: the weights in the file right, their dequantization wrong."""
        from exporters.mlx import faults as mlx_faults

        fn = mlx_faults.QUANTIZED_FAULTS[name]
        return type(self)(f"{self.name}+{name}", lambda m, a: fn(text_model(m).layers[layer]), f"{name}@{layer}",
                          self.config_fn)

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults/ name) on mlx-lm's model; None
        where the fault has no natural form there (exporters/mlx/faults.py)."""
        from exporters.mlx import faults as mlx_faults

        if mlx_faults.not_applicable(fault, "") is not None:
            return None
        return type(self)(f"{self.name}+{fault.name}", lambda m, a: mlx_faults.inject(fault, m, a), fault.name,
                          self.config_fn)

    def fault_not_applicable(self, fault) -> str | None:
        """Why with_fault(fault) is None (the selftest lists the fault as not applicable with this)."""
        from exporters.mlx import faults as mlx_faults

        return mlx_faults.not_applicable(fault, "")

    def fault_point(self, fault) -> str | tuple | None:
        """Where a fault's mlx form breaks another point than its torch form (exporters/mlx_faults.POINTS)."""
        from exporters.mlx import faults as mlx_faults

        return mlx_faults.POINTS.get(fault.name)

    def check_options(self, spec) -> str | None:
        """What is wrong with spec.options for this backend on this host (None: nothing).
        For the harness to refuse before any work (bad input); load() raises it as well."""
        opts = spec.options or {}
        group_size = opts.get("group_size")
        if spec.candidate_dir and (group_size is not None or opts.get("recipe")):
            return "--group-size / recipe: a shipped directory's quantization is its own (its config.json)"
        if group_size is not None and spec.precision not in QUANT_BITS:
            return f"--group-size applies to q8/q4, not {spec.precision}"
        if self.availability()[0]:
            import mlx.core as mx

            has_gpu = mx.is_available(mx.gpu)
            if opts.get("device") == "gpu" and not has_gpu:
                return (f"--device gpu: mlx has no GPU backend on this host ({platform.system()} "
                        f"{platform.machine()}; mlx[cpu] runs on the CPU only): use --device cpu")
            if spec.precision == "bf16" and (opts.get("device") == "cpu" or not has_gpu):
                return "bf16 needs --device gpu: mlx's CPU gather_mm (the MoE experts) is float32-only"
        return None

    def load(self, model, spec):
        import mlx.core as mx

        problem = self.check_options(spec)
        if problem:
            raise ValueError(problem)
        opts = spec.options or {}
        device = device_of(opts.get("device"))
        group_size = int(opts.get("group_size") or DEFAULT_GROUP_SIZE)
        dtype = mx.bfloat16 if spec.precision == "bf16" else mx.float32
        shipped = {}
        with mx.stream(device):
            if spec.candidate_dir:  # the shipped directory, as mlx-lm loads it
                m, shipped = load_directory(spec.candidate_dir, model.family.name, dtype, model.config)
                fields, quant = shipped["config"], shipped["quantization"]
                if self.transform is not None:
                    self.transform(m, model.args)
            else:
                try:
                    m, fields = load_model(model, self.config_fn)
                except ConfigError as e:  # what mlx-lm's model of the family cannot do: refused, with the reason
                    from oracle.backend import InputError

                    raise InputError(f"mlx-lm cannot check this checkpoint: {e}") from None
                cast(m, dtype)
                if self.transform is not None:
                    self.transform(m, model.args)
                quant = quantize(m, QUANT_BITS[spec.precision], group_size) if spec.precision in QUANT_BITS else None
            # evaluated a decoder layer at a time: the lazily loaded checkpoint arrays of one layer
            # (and their fp32/quantization intermediates) are live at once, not the model's
            for layer in m.layers:
                mx.eval(layer.parameters())
            mx.eval(m.parameters())
        versions = {p: importlib.metadata.version(p) for p in ("mlx", "mlx-lm")}
        dev = "gpu" if device == mx.gpu else "cpu"
        info = {"executor": f"mlx-lm {versions['mlx-lm']} on mlx {versions['mlx']} ({dev})", "device": dev, "mlx_model": f"mlx_lm.models.{mapping(model.family.name).module}",
                "config": fields, "dtype": str(dtype).split(".")[-1]}
        if quant:
            info["quantization"] = quant
        if not spec.candidate_dir and (kept := release_quantization(release_format(model.config))):  # kept packed
            info["release_quantization"] = {**kept, **quantization_table(m, kept["group_size"], "not packed in the release")}
        if spec.candidate_dir:
            info["loaded_from"] = f"{spec.candidate_dir} (mlx_lm.utils.load_model)"
            info["config_mismatch"] = shipped["config_mismatch"]
        if self.transform_id:
            info["transform"] = self.transform_id
        a = model.args
        windows = {i: a.attention.sliding_window for i, t in enumerate(a.layer_types) if t == SLIDING}
        chunks = {i: a.attention.chunk_size for i, t in enumerate(a.layer_types) if t == CHUNKED}
        mlx_lm = mapping(model.family.name)
        view = model.family.hf_point_view
        return MLXCandidate(m, dtype, device, info, mlx_lm.array_mask, windows, chunks, mlx_lm.block_args,
                            model.family.hf_point_names, view and (lambda pts, layer=None: view(pts, a, layer)))

    # `oracle selftest --conversion`: mlx-lm directories at two widths and two group sizes
    shipped_formats = tuple((f"{p} g{g}", p, {"group_size": g}) for p in ("q8", "q4") for g in GROUP_SIZES)
    file_faults = {"scales_other_group": "one module's scales and biases computed for another group size, over "
                                         "the q of its own (last MoE layer)"}

    def shipped_tensors(self, original, shipped, progress):
        """The weight check of a shipped mlx-lm directory (exporters/mlx/weights.py), each tensor labelled
        with the checkpoint tensors the family's from_mlx puts there."""
        from exporters.mlx.weights import directory_tensor_sources, hf_labels
        from models.checkpoint import tensor_index

        ref = reference_directory(original, progress)
        shapes = {n: tuple(v[2]) for n, v in tensor_index(ref).items()}
        labels = hf_labels(original.family, original.config, shapes)
        return directory_tensor_sources(Path(shipped), ref, labels)

    def apply_file_fault(self, name, path, original, args, progress):
        from exporters.mlx.weights import scales_other_group
        from oracle.selftest.conversion_faults import last_sparse

        if name != "scales_other_group":
            return None
        return scales_other_group(Path(path), reference_directory(original, progress), last_sparse(args))

    def export(self, model, spec, output_dir) -> list:
        """An mlx-lm directory (what mlx_lm.convert writes: config.json, model*.safetensors):
        unquantized at fp32, or q8/q4 with --group-size, or --option recipe=mixed_4_6 (mlx-lm's
        mixed recipes: 6-bit v_proj/down_proj in some layers and lm_head, 4-bit elsewhere)."""
        opts = spec.options or {}
        recipe = opts.get("recipe")
        bits = QUANT_BITS.get(spec.precision)
        if recipe and bits is None:
            raise ValueError(f"--option recipe={recipe} is a quantization recipe: use --precision q4 (its low bits)")
        return write_directory(model, output_dir, None if recipe else bits,
                               int(opts.get("group_size") or DEFAULT_GROUP_SIZE), recipe)


def device_of(name: str | None):
    """--device (checked by check_options): gpu (Metal, Apple silicon; the default there) or
    cpu (the default elsewhere)."""
    import mlx.core as mx

    name = name or ("gpu" if mx.is_available(mx.gpu) else "cpu")
    return mx.gpu if name == "gpu" else mx.cpu


BACKEND = MLXBackend()
