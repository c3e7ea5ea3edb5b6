"""What an ExecuTorch program of this project is: the code and options its cache key names, the
files beside model.pte (model.ptd, the op census, the check program's tap table), and the build of the
production or check program."""

from __future__ import annotations

import json
from pathlib import Path

from exporters.executorch.export import (add_taps, export_methods, export_probes, export_sampling, input_taps,
                                          op_histogram)
from exporters.executorch.lower import release_parameters, spill_directory
from exporters.executorch.torch_lowering import collect
from models.layers.transformer import Transformer
from oracle.cache.artifacts import source_digest
from oracle.verdict.goldens import histogram_text

ROOT = Path(__file__).resolve().parents[2]


# the code of a CPU-lowered program beside the production model's (models/layers/) and its exporter's
LOWERING_CODE = ("exporters/executorch/export.py", "exporters/executorch/lower.py", "exporters/executorch/program.py",
                 "exporters/executorch/rebind.py")

def cache_parts(backend: str, model, spec, program: str, transform_id, options: dict, exporter: str) -> dict:
    """Everything that determines a .pte: checkpoint, resolved args, options, fault, code, tools."""
    from oracle.cache.artifacts import versions

    return {"backend": backend, "program": program, "family": spec.family, "precision": spec.precision,
            "checkpoint": model.checkpoint_sha256, "args": repr(model.args), "max_seq_len": model.args.max_seq_len,
            "options": options, "transform_id": transform_id,
            # the production model's code (its routing too: models/layers/routing.py); a fault's own code is in its
            # transform_id (models/faults.Fault.id: a change to one fault rebuilds that fault's programs only)
            # (a program rebound from another checkpoint's is written by exporters/executorch/rebind.py)
            "source": source_digest("models/layers/", *LOWERING_CODE, exporter),
            "versions": versions("torch", "executorch", "torchao")}


OPS_FILE = "ops.txt"


def read_taps(pte: Path) -> dict:
    """The check program's tap table; none for a production program."""
    f = Path(pte).with_name("taps.json")
    return json.loads(f.read_text()) if f.is_file() else {}


def weights_file(pte: Path) -> Path | None:
    """The tensor data a program keeps outside it (model.ptd, a delegate's blob) beside it, if any."""
    return next(iter(sorted(Path(pte).parent.glob("*.ptd"))), None)


def save(prog, path: Path) -> None:
    """model.pte, and the tensor data a delegate keeps outside it (.ptd) beside it."""
    path.write_bytes(prog.buffer)
    if prog._tensor_data:
        prog.write_tensor_data_to_file(str(path.parent))


def build_program(model: Transformer, lower, path: Path, check: bool, opts: dict, dense_prefill: bool = False) -> None:
    """The production program (prefill, decode; the sampler fused with opts["sample"]) at
    `path`, by `lower(methods, model)`; the check's program also has the taps and the probe
    methods, its tap table beside it, and with opts["sampling"] the sampler's methods."""
    methods = export_methods(model, bool(opts.get("sample")), dense_prefill)
    if check:
        taps = {name: add_taps(ep, model.args) for name, ep in methods.items()}
        taps["inputs"] = input_taps(model.args)
        methods.update(export_probes(model))
        if opts.get("sampling"):
            methods.update(export_sampling(model, dense_prefill))
        path.with_name("taps.json").write_text(json.dumps(taps))
    # from here the exported programs hold the weights: each is freed once lowered (lower_cpu)
    release_parameters(model)
    collect()
    with spill_directory(path.parent):
        prog = lower(methods, model)
        methods.clear()
        save(prog, path)
        # the structural golden: ops of the lowered prefill and decode (delegate calls included)
        counts = {}
        for name in ("prefill", "decode"):
            for op, n in op_histogram(prog.exported_program(name)).items():
                counts[f"{name} {op}"] = n
        del prog
        collect()
    path.with_name(OPS_FILE).write_text(histogram_text(counts, "ops of the lowered prefill and decode methods"))
