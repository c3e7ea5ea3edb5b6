"""`executorch`: the production model through ExecuTorch on the CPU: torch.export (strict,
with the state buffers) -> to_edge_transform_and_lower(XNNPACK) -> .pte -> executorch.runtime.

One program, two methods sharing the model's state (KV cache, conv and recurrent state in
mutable buffers planned once for the whole program, as production ExecuTorch LLM exports do):

    prefill(tokens [1, T], pos [T]) -> logits [1, T, V]    T dynamic in [2, S - 1]
    decode(tokens [1, 1], pos [1])  -> logits [1, 1, V]

The weights are not in the .pte: every constant is tagged for one external file, model.ptd,
written beside it and shared by name by all methods (the way ExecuTorch's LLM exports keep
large models' weights outside the program); the runtime maps it (`data_path`).

A call at position 0 starts a new sequence: the model itself zeroes the Gated DeltaNet state
(a multiply when pos[0] == 0) and the causal mask hides the stale KV cache.

The check's program is the production program plus what the block rows need:
- prefill and decode also return every block's output (intermediate_output_tap, one rule per
  block path): the rows of the reference's token sequence are the runtime's own
  intermediates, fed by its own previous blocks (`in-situ`);
- one `probe_<layer>` method per layer, that layer's MoE block alone, x [N, H] ->
  (moe [1, N, H], router weights [N, k], indices [N, k]): the expert-coverage probes are
  fed the reference's inputs (`isolated`).
`oracle export` writes the production program alone (no taps, no probe methods).

The on-device sampler (models/layers/sampling.py, Gumbel-max with temperature and top-p from an
explicit seed): `oracle export --sample` fuses it into the production methods, which then
take (tokens, pos, temperature [], top_p [], seed []) and return the token [1] (int64), with
a `use_sampling` constant method for the runner, as the seed exporters do. `oracle check
--sampling` adds that fused program's methods to the check's program as `sample_prefill` /
`sample_decode` (their own state: the buffers of the wrapped model), and the head alone as
`sample_logits(logits [1, V], temperature, top_p, seed)`; the harness is the runner.

Also home of what the CUDA and Metal exporters share with this one: the strict export of
the two methods, the taps, the probe methods, the cache key and the runtime candidate.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path

from exporters.executorch import rebind as ew
from exporters.executorch.candidate import ExecutorchCandidate, ExecutorchSamplingCandidate
from exporters.executorch.export import (export_options, probe_rows, qlinear_options, quantize_linears,
                                         sampling_options, sparse_layers)
from exporters.executorch.lower import PARTITIONS, WEIGHTS_FILE, lower_cpu, spill_directory
from exporters.executorch.program import OPS_FILE, build_program, cache_parts, save, weights_file
from exporters.executorch.torch_lowering import collect, lowering
from exporters.shared.identity import production_structure, program_identity
from exporters.torch.candidate import DTYPES
from models.layers.transformer import Transformer
from oracle.backend import Backend, Option
from oracle.cache.artifacts import source_digest


def missing_executorch() -> str | None:
    """Why ExecuTorch cannot be used here, or None. Found, not imported (importing the
    compiler costs seconds that a cached program does not need); a broken install fails
    where it is imported, as that check's error with the import's message."""
    import importlib.util

    for name in ("executorch.exir", "executorch.runtime"):
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError) as e:
            return f"executorch is not installed ({type(e).__name__}: {e}); pip install 'moe-oracle[executorch]'"
        if not found:
            return f"executorch is not installed (no module {name}); pip install 'moe-oracle[executorch]'"
    return None


class ExecutorchBackend(Backend):
    """`transform(model)` modifies the built production model before export (how faults are
    injected); `transform_id` names it in the artifact cache key.

    The CUDA and Metal backends are this class with another lowering, dtype and quantization."""

    kind = "executorch"  # cache namespace and name of the backend without a fault suffix
    source = "exporters/executorch/backend.py"

    @property
    def cache_namespaces(self) -> tuple:
        # XNNPACK's remembered partitions (remembered_partitions) with the CPU lowering's programs
        return (self.kind, f"{self.kind}-points") + ((PARTITIONS,) if self.kind == "executorch" else ())
    precisions = ("fp32",)
    # The weights are in model.ptd, shared by the methods and mapped by the runtime, and prefill
    # runs the experts densely (no per-token copy of their weights: that planned 4.8 GB at
    # OLMoE's width). The build holds each weight about once at a time (build_program: the
    # model's fp32 weights are mapped from files, not process memory; the export keeps no
    # clone, the model lets go of its parameters after export, XNNPACK's serialized weights go
    # to files, the delegates' consumed weights are dropped); what stays is the emitter's bytes
    # copy of the weights portable ops read (embedding, the experts of decode's gather and the
    # probes); the runtime mlocks the mapped model.ptd. 6 bytes/parameter covers the build (5.2
    # measured at Mixtral's width) and the runtime (5.6 with the mlocked file): docs/executorch.md,
    # "Memory of the build".
    memory_per_param = {"fp32": 6.0}
    memory_note = ("the emitter's copy of the portable ops' weights while lowering (the model's own are mapped "
                   "from files), then the runtime's mlocked weights file, XNNPACK's packed weights and the "
                   "planned memory")
    qlinear = ("8da4w",)  # XNNPACK's recipe: int8 dynamic activations, int4 grouped weights
    # prefill runs every expert on every token (no per-token copy of the experts' weights);
    # decode gathers its token's experts (export_methods)
    dense_prefill = True
    # the programs take other weights of their identity without lowering again (the CPU lowering's
    # model.ptd: exporters/executorch/rebind.py); not the CUDA and Metal lowerings' weights files
    rebinds_weights = True
    option_schema = (
        Option("partitioner", str, ("xnnpack", "portable"), "xnnpack",
               "portable kernels only (no XNNPACK): about 4x faster to lower; tells a delegate's fault "
               "from the model's"),
        *export_options(qlinear, sample=True),
    )

    def __init__(self, name: str | None = None, transform=None, transform_id: str | None = None):
        if transform is not None and not transform_id:
            raise ValueError("a transform needs a transform_id (it is part of the artifact cache key)")
        self.name, self.transform, self.transform_id = name or self.kind, transform, transform_id

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults/) injected before export."""
        if fault.precision not in self.precisions:
            return None
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.id)

    def unavailable(self) -> str | None:
        return missing_executorch()

    def availability(self):
        reason = self.unavailable()
        return (False, reason) if reason else (True, "")

    def options(self, spec) -> dict:
        """The options that shape the artifact, validated (part of the cache key).
        `--option partitioner=portable`: portable kernels only (no XNNPACK), about 4x faster
        to lower; tells a delegate's fault from the model's."""
        opts = {**qlinear_options(spec), **sampling_options(spec)}
        return {**opts, "partitioner": spec.options.get("partitioner", "xnnpack")}

    def executor(self, opts: dict) -> str:
        return "XNNPACK + portable kernels" if opts["partitioner"] == "xnnpack" else "portable kernels"

    def lower(self, methods: dict, model: Transformer, opts: dict):
        names = list(methods)
        try:
            return lower_cpu(methods, model, xnnpack=opts["partitioner"] == "xnnpack", sample=bool(opts.get("sample")))
        except AssertionError as e:  # XNNPACK's partitioner: a partition its fuser refuses (a program it cannot build)
            if "dependency cycles" not in str(e):
                raise
            from oracle.backend import InputError

            raise InputError(f"ExecuTorch {importlib.metadata.version('executorch')}'s XnnpackPartitioner cannot "
                             f"partition this program (torch.fx fuse_as_graphmodule: {e}; methods "
                             f"{', '.join(names)}): refused, not lowered without it") from None

    def quantize(self, model: Transformer, opts: dict) -> None:
        quantize_linears(model, opts)

    def production_model(self, model, spec, opts: dict, mapped: Path | None = None) -> Transformer:
        """The production model to export (`mapped`: its weights mapped from files written
        there, ModelSource.build_production)."""
        m = model.build_production(DTYPES[spec.precision], mapped)
        if self.transform is not None:
            self.transform(m)
        if opts.get("qlinear"):
            self.quantize(m, opts)
        return m

    def artifact(self, model, spec, check: bool):
        """The check's program or the production program, from the cache or built."""
        from oracle.cache.artifacts import cached_artifact
        from oracle.cache.store import estimate

        program = "check" if check else "production"
        # the check program never fuses the sampler into prefill/decode (it needs the logits);
        # the production program never carries the check's sampler methods
        opts = {k: v for k, v in self.options(spec).items() if k != ("sample" if check else "sampling")}

        parts = cache_parts(self.kind, model, spec, program, self.transform_id, opts, self.source)
        # another checkpoint of a program's identity takes its program with other weights (exporters/
        # executorch_weights.py); not a quantized one's (its weights are packed)
        once = ew.OneLowering(self.kind, parts, WEIGHTS_FILE, (OPS_FILE, "taps.json"),
                              enabled=self.rebinds_weights and not opts.get("qlinear"))

        def build(path):
            # the fp32 weights mapped from files beside the build (not process memory): the
            # lowering reads each once, and what it keeps it copies (XNNPACK's blobs, spilled to
            # files too; the emitter's bytes of the portable ops' weights)
            with (lowering(4 * model.parameter_count()),
                  tempfile.TemporaryDirectory(prefix=".weights-", dir=path.parent) as mapped):
                m = self.production_model(model, spec, opts, Path(mapped))

                def lower():
                    build_program(m, lambda methods, mm: self.lower(methods, mm, opts), path, check, opts,
                                  self.dense_prefill)

                once.build(m, path, lower, lambda: (program_identity(m), program_identity(production_structure(model))))
                del m
                collect()

        with once:
            return cached_artifact(self.kind, parts, "model.pte", build, name=f"{spec.family}.{program}.pte",
                                   needed=lambda: estimate(model.parameter_count(), spec.precision))

    def points_program(self, model, spec, layer, kind: str, lengths: list[int]) -> tuple[Path, dict]:
        """The drill's program of block (layer, kind): the block of the production model (the fault
        and the options applied) with its points as extra outputs and its state as inputs
        (eager.PointsProgram), one method per length, lowered by this backend's own lowering;
        cached. (points.pte, points.json)."""
        from exporters.torch.candidate import PointsCall, PointsProgram
        from models.layers.transformer import block_fn
        from oracle.cache.artifacts import cached_artifact

        opts = {k: v for k, v in self.options(spec).items() if k not in ("sample", "sampling")}

        def build(path):
            with (lowering(4 * model.parameter_count()),
                  tempfile.TemporaryDirectory(prefix=".weights-", dir=path.parent) as mapped):
                m = self.production_model(model, spec, opts, Path(mapped))
                prog = PointsProgram(PointsCall(*block_fn(m, layer, kind), kind))
                methods, meta = prog.export(lengths, m.args.hidden_size, m.embed_tokens.weight.dtype)
                with spill_directory(path.parent):
                    save(self.lower(methods, m, opts), path)
                del m, prog, methods
                collect()
            path.with_name("points.json").write_text(json.dumps(meta))

        parts = {**cache_parts(self.kind, model, spec, "points", self.transform_id, opts, self.source),
                 "block": [layer, kind], "lengths": lengths,
                 "points_code": source_digest("exporters/torch/candidate.py", "oracle/drill/points.py")}
        art = cached_artifact(f"{self.kind}-points", parts, "points.pte", build)
        path = Path(art.path)
        return path, {**json.loads(path.with_name("points.json").read_text()), "build_s": art.build_s}

    artifact_suffix = ".pte"  # --pte: a program built elsewhere

    def shipped_tensors(self, original, path, progress):
        """The weight check of a --pte's weights: its .ptd against the production model's parameters of the
        original (exporters/shared/weights.py); nothing where the program keeps its weights inside."""
        from exporters.shared.weights import production_tensor_sources, ptd_tensors

        ptd = weights_file(path)
        if ptd is None:
            return iter(())
        stored = ptd_tensors(ptd)
        return production_tensor_sources(original, stored, stored.pop("__content__", {}))

    def check_given(self, model, spec) -> None:
        """--pte FILE, before any work: an ExecuTorch program (and weights file) whole, that its
        runtime loads (in a child process: exporters/shared/given.py), with the production methods
        prefill and decode, and built for this check's model (its constant methods: vocabulary,
        depth, positions). InputError naming the file otherwise."""
        from exporters.shared import given
        from oracle.backend import InputError

        pte, ptd = Path(spec.artifact), weights_file(spec.artifact)
        for path, problem in ((pte, given.pte_problem(pte)), (ptd, ptd and given.ptd_problem(ptd))):
            if problem:
                raise InputError(f"--pte {pte}: {'its weights ' + str(path) + ': ' if path != pte else ''}{problem}")
        found = given.probe("pte", "--pte", [pte, *([ptd] if ptd else [])], "the ExecuTorch runtime")
        missing = sorted({"prefill", "decode"} - set(found["methods"]))
        if missing:
            raise InputError(f"--pte {pte} does not have the production exporter's methods: missing "
                             f"{', '.join(missing)} (it has {', '.join(found['methods'])})")
        const, need = found["constants"], spec.prompt_len + spec.decode_tokens
        for name, want, what in (("get_vocab_size", model.args.vocab_size, "tokens in its vocabulary"),
                                 ("get_n_layers", model.args.num_hidden_layers, "decoder layers")):
            if const.get(name, want) != want:
                raise InputError(f"--pte {pte} was built for a model of {const[name]} {what} (its {name}); this "
                                 f"check's {spec.family} model has {want}: a program of another model")
        if const.get("get_max_seq_len", need) < need:
            raise InputError(f"--pte {pte} holds {const['get_max_seq_len']} positions (its get_max_seq_len); this "
                             f"check needs {need} (--prompt-len {spec.prompt_len} + --decode-tokens {spec.decode_tokens})")

    def given(self, model, spec):
        """--pte FILE: a program built elsewhere (`oracle export` writes one), its weights in the .ptd
        beside it, checked first (check_given). It must have the production methods, prefill and
        decode (tokens [1, T], pos [T]) -> logits; with the check program's taps (taps.json beside
        it) and probe methods its blocks are compared too, else they are n/a."""
        from importlib.metadata import version

        from oracle.backend import InputError
        from oracle.cache.artifacts import sha256_file

        pte = Path(spec.artifact)
        self.check_given(model, spec)
        try:
            cand = ExecutorchCandidate(pte, {}, DTYPES[spec.precision], probe_rows(model.args))
        except Exception as e:
            raise InputError(f"--pte {pte}: the ExecuTorch runtime cannot load it ({type(e).__name__}: {e})") from None
        cand.no_points = "a program given with --pte: a points program would be this exporter's block, not the given program's"
        cand.info = {"executor": f"executorch {version('executorch')} runtime (a program brought with --pte)",
                     "methods": sorted(cand.methods), "block_modes": ExecutorchCandidate.block_modes,
                     "blocks": "tapped (taps.json beside it)" if cand.taps else
                     "not isolated: a production program has no taps or probe methods",
                     "artifacts": [{"name": pte.name, "path": str(pte), "sha256": sha256_file(pte), "cached": True,
                                    "build_s": 0.0}]}
        return cand

    def load(self, model, spec):
        if spec.artifact:
            return self.given(model, spec)
        if spec.options.get("qlinear"):
            raise ValueError("a quantized program cannot be judged by the fp32/bf16 thresholds: check it "
                             "unquantized, or write it with `oracle export --qlinear`")
        art = self.artifact(model, spec, True)
        from importlib.metadata import version

        pte = Path(art.path)
        opts = self.options(spec)
        sampling = bool(opts.get("sampling"))  # a backend whose options leave it out has no sampler methods
        info = {"executor": f"executorch {version('executorch')} runtime ({self.executor(opts)})",
                "methods": ["prefill", "decode"] + [f"probe_{i}" for i in sparse_layers(model.args)]
                + (["sample_decode", "sample_logits", "sample_prefill"] if sampling else []),
                "block_modes": ExecutorchCandidate.block_modes, "artifacts": [art.as_dict()]}
        cls = ExecutorchSamplingCandidate if sampling else ExecutorchCandidate
        cand = cls(pte, info, DTYPES[spec.precision], probe_rows(model.args))
        cand.points_program = functools.partial(self.points_program, model, spec)
        return cand

    def export(self, model, spec, output_dir) -> list[Path]:
        """model.pte (and the .ptd a delegate writes beside it) in output_dir."""
        pte = Path(self.artifact(model, spec, False).path)
        out = []
        for f in [pte, *sorted(pte.parent.glob("*.ptd"))]:
            out.append(Path(output_dir) / f.name)
            shutil.copyfile(f, out[-1])
        return out


BACKEND = ExecutorchBackend()
