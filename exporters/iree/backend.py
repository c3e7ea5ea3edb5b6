"""`iree-llvm-cpu`: the production torch model (models/layers/) exported with iree-turbine,
compiled by iree-compile for the host CPU (llvm-cpu) and run by iree.runtime on local-task.

One program per check, `model.vmfb`, and its weights, `model.irpa`, each built and cached by
content hash (oracle.cache.artifacts; the program's key names no checkpoint: its parameters are
external, so every seed of one family's args, and a seeded fault that changes weight values alone,
runs one compiled program), with:
- `prefill` (T = prompt length) and `decode` (T = 1): the whole model, exported from one
  `aot.FxProgramsBuilder`, so its state buffers (KV cache, conv and recurrent state) become
  module globals shared by both. Every prefill runs in a fresh runtime context (fresh
  globals), which is how a new sequence starts.
  The model's parameters are not in the program, as in a real IREE deployment: they are
  external (`#flow.parameter.named<"model"::name>`, the production model's parameter names)
  and live in an IREE parameter archive, `model.irpa` (its own cache entry; beside model.vmfb where
  `oracle export` writes them). The runtime maps it (`iree.runtime.ParameterIndex`) and serves it
  through an `io_parameters` module; a cached archive that is missing or changed is written again,
  a program never run without its weights.
- `block_<program>_t<T>` (T = prompt length and 1): one program per block kind (and per
  structurally different layer: full vs linear attention, or a layer a fault patched) with
  the block's weights and state as inputs and (output, *new state) as results, so one
  program runs every layer. The block programs share their dispatches with the model's
  (iree-compile deduplicates them): one module compiles in ~60% of the time of two.
  Their weight inputs are read from the same mapped archive (numpy views, no copy), so no
  torch model holds weights while a check runs: a cached program is run with the model's
  structure alone (parameters on the meta device). A cache miss holds no model either: it
  writes model.irpa a decoder layer at a time straight from the checkpoint
  (save_parameters_streamed) and traces the program from the structure, its parameters given
  memory that is never touched (their values are the archive's). Only a seeded fault, which
  may change weights, builds the whole fp32 model to archive and export it.

Shapes are static (prompt length and max_seq_len are in the cache key): a dynamic token
dimension exports and compiles, but computed wrong logits (~0.4 off) with iree 3.13.
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from exporters.iree.candidate import IreeCandidate, checked_parameters, parse_plan
from exporters.iree.program import FLAGS, OPS_FILE, PARAM_SCOPE, PARAMS_FILE, host_cpu
from oracle.backend import Backend, InputError
from oracle.cache.artifacts import Artifact, cached_artifact, cached_json, sha256_file, source_digest, versions
from oracle.cache.store import estimate

TOOLS = ("iree-base-compiler", "iree-base-runtime", "iree-turbine", "torch")


@functools.cache
def code_digest() -> str:
    """The code a program is traced from (read, not imported: a warm check imports no torch):
    the production layers, their routing and args, the torch candidate's points programs
    (exporters/torch/candidate.py), this backend's modules and the program identity. A fault's own code is in
    the key's transform_id (models/faults/fault.py: Fault.id)."""
    return source_digest("models/layers/", "models/args.py", "exporters/torch/candidate.py", "exporters/iree/",
                         "exporters/shared/identity.py", "exporters/shared/blocks.py")


@functools.cache
def points_digest() -> str:
    """The drill's recording code a points program is traced with."""
    return source_digest("oracle/drill/points.py")


def args_digest(src) -> str:
    """The production model's args (config resolved, max_seq_len set). Its weights are named by
    the checkpoint's sha256 and the transform's id, both in the key: reading them is not needed."""
    return hashlib.sha256(repr(src.args).encode()).hexdigest()[:16]


class IreeBackend(Backend):
    """`transform(model)` may modify the built production model in place (seeded faults);
    `transform_id` names it in every cache key (a transform without an id is not cached)."""

    runs_torch = False  # the candidate runs no torch (provenance records no torch thread count)
    precisions = ("fp32",)
    cache_namespaces = ("iree", "iree-params", "iree-points")

    def memory_estimate(self, src, spec) -> tuple[int, str]:
        """No torch model with weights is held, building or running (an untransformed build writes
        model.irpa a layer at a time and traces the program without weights; the runtime maps the
        archive: file pages, which the kernel can drop and read again). What is held: one decoder
        layer's fp32 weights twice, either as the build's converted layer beside its checkpoint
        slices or as the runtime's copies of a `layer` block call's weight inputs (copied in, and
        again inside the program), and each context's constants that iree-compile hoisted
        (lm_head, the attention projections: at most the weights outside the layers). A seeded
        fault (a transform) builds the whole fp32 model as before: 4 bytes per parameter more."""
        layer, outside = src.layer_parameter_counts()
        need = 8 * layer + 4 * outside
        how = f"2 x {layer / 1e9:.2f} B parameters of its largest layer + {outside / 1e9:.2f} B outside the layers, in fp32"
        if self.transform is not None:
            params = src.parameter_count()
            need += 4 * params
            how += f", + the whole fp32 model for the fault ({params / 1e9:.2f} B parameters)"
        return need, how

    artifact_suffix = ".vmfb"  # --vmfb: a program built elsewhere

    def shipped_tensors(self, original, path, progress):
        """The weight check of a --vmfb's weights: model.irpa beside it against the production model's
        parameters of the original (exporters/shared/weights.py)."""
        from exporters.shared.weights import irpa_tensors, production_tensor_sources

        irpa = Path(path).with_name(PARAMS_FILE)
        return production_tensor_sources(original, irpa_tensors(irpa)) if irpa.is_file() else iter(())

    def __init__(self, name: str = "iree-llvm-cpu", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        missing = [p for p, v in versions(*TOOLS[:3]).items() if v is None]
        if missing:
            return False, f"{', '.join(missing)} not installed (pip install 'moe-oracle[iree]')"
        try:  # iree.turbine (export) is imported on a cache miss only: its import takes seconds
            import iree.compiler  # noqa: F401
            import iree.runtime  # noqa: F401
        except Exception as e:  # a broken install: say why, never a traceback
            return False, f"iree cannot be imported: {type(e).__name__}: {e}"
        return True, ""

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults/) injected; None where the fault
        needs a precision this backend does not run."""
        if fault.precision not in self.precisions:
            return None
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.id)

    def key(self, src, spec, programs: dict) -> dict:  # programs: parse_plan's
        """model.vmfb's key: no checkpoint (the parameters are external, model.irpa: params_key)."""
        return {"backend": "iree-llvm-cpu", "family": spec.family,
                "precision": spec.precision, "prompt_len": spec.prompt_len, "max_seq_len": src.args.max_seq_len,
                "options": {k: v for k, v in spec.options.items() if k != "max_seq_len"},  # max_seq_len: above
                "transform_id": self.transform_id, "versions": versions(*TOOLS), "flags": FLAGS,
                "host_cpu": host_cpu(), "code": code_digest(),
                "args": args_digest(src), "parameters": f"{PARAMS_FILE} scope={PARAM_SCOPE}",
                "blocks": [(p.name, p.fingerprint) for p in programs.values()]}

    def params_key(self, src) -> dict:
        """model.irpa's key: the checkpoint, the args, the transform, the code that names and converts
        the tensors (the models package: a family's production_tensors; the export's) and the writer."""
        from models import code_digest as models_digest

        return {"backend": "iree-llvm-cpu", "checkpoint": src.checkpoint_sha256, "args": args_digest(src),
                "transform_id": self.transform_id, "code": code_digest(), "models": models_digest()[:16],
                "scope": PARAM_SCOPE, "versions": versions("iree-turbine", "iree-base-runtime", "torch")}

    def model(self, src):
        """The transformed production model the block programs are read from (torch): its
        structure alone (production_structure), unless the transform is unnamed (applied once, to
        the real model, as an uncached build always did) or fails without weight values (a fault
        that reads them: expert_weights_off_1e-3 picks its expert by the router's weights)."""
        import torch

        from exporters.shared.identity import production_structure

        if self.transform is None:
            return production_structure(src)
        if self.transform_id is not None:
            m = production_structure(src)
            try:
                self.transform(m)
                return m
            except Exception:  # e.g. `Tensor.item() cannot be called on meta tensors`; a real error raises again below
                pass
        m = src.build_production(torch.float32)
        self.transform(m)
        return m

    def plan(self, src) -> tuple[object, dict]:
        """(the torch model the plan was read from, or None, the block programs' plan:
        iree_export.plan_of). Untransformed, the plan comes from a cache keyed by the resolved
        args and the code (no torch on a warm check); a transformed model is read every time."""
        if self.transform is None:
            parts = {"args": args_digest(src), "code": code_digest(), **versions("torch")}

            def compute():
                from exporters.iree import export as iree_export

                return iree_export.plan_of(self.model(src))

            return None, cached_json("iree-plan", parts, compute)
        from exporters.iree import export as iree_export

        model = self.model(src)
        return model, iree_export.plan_of(model)

    def runs_as(self, src, model):
        """The backend whose programs (model.vmfb, the drill's points programs) this one runs: itself,
        or the untransformed backend where the transform changed weight values alone (its transformed
        model's identity, exporters.shared.identity.program_identity: every module's attributes, every tensor's name,
        shape and dtype, every buffer's values, is the clean structure's: expert_gate_up_swapped,
        expert_weights_off_1e-3). Its program is then the
        clean check's, cached under the same key (no compile), and its own archive carries the fault."""
        if self.transform is None or self.transform_id is None or model is None:
            return self
        from exporters.shared.identity import program_identity

        clean = type(self)(self.name)
        if program_identity(model) == program_identity(clean.model(src)):
            return clean
        return self

    def program(self, src, spec) -> Built:
        """The block programs, model.vmfb, and its weights, model.irpa: each its own cache entry, built
        (export + compile; the archive) on a miss, else read from the cache. The program's key names no
        checkpoint (its parameters are external: one compile serves every seed of a family's args, and
        a transform that changes weight values alone runs the clean program: runs_as); the archive's
        names the checkpoint and the transform. Only a miss reads the checkpoint's weights: a layer at
        a time into the archive (a transform's: the whole transformed model, dropped when written)."""
        if spec.precision not in self.precisions:
            raise ValueError(f"{self.name} runs {', '.join(self.precisions)} only, not {spec.precision}")
        model, plan = self.plan(src)
        prog = self.runs_as(src, model)
        if prog is not self:
            model, plan = prog.plan(src)
        programs, which = parse_plan(plan)

        def build(path: Path):
            from exporters.iree import export as iree_export

            iree_export.build_program(model if model is not None else prog.model(src), spec.prompt_len, path)

        def build_params(path: Path):
            from exporters.iree import export as iree_export

            iree_export.build_parameters(src, self.transform, path)

        if self.transform is not None and self.transform_id is None:  # an unnamed transform: never cached
            tmp = tempfile.TemporaryDirectory(prefix="moe-oracle-iree-")  # removed with the candidate
            path = Path(tmp.name) / "model.vmfb"
            build_params(path.with_name(PARAMS_FILE))
            t = time.perf_counter()
            build(path)
            art = Artifact("model.vmfb", "", sha256_file(path), False, time.perf_counter() - t)
            irpa = path.with_name(PARAMS_FILE)
            return Built(programs, which, art, path, checked_parameters(irpa), irpa, tmp)
        art = cached_artifact("iree", prog.key(src, spec, programs), "model.vmfb", build)
        key = self.params_key(src)
        archive = lambda: cached_artifact("iree-params", key, PARAMS_FILE, build_params,  # noqa: E731
                                          needed=lambda: estimate(src.parameter_count(), "fp32"))  # its weights
        params = archive()
        irpa = Path(params.path)
        info = checked_parameters(irpa)
        if info is None:  # the archive changed or its record is missing: written again
            shutil.rmtree(irpa.parent, ignore_errors=True)
            params = archive()
            irpa = Path(params.path)
            info = checked_parameters(irpa)
        if info is None:
            raise RuntimeError(f"{PARAMS_FILE} at {irpa} does not match the record written with it")
        info = {**info, "cached": params.cached}
        return Built(programs, which, art, Path(art.path), info, irpa)

    def points_program(self, src, spec, program: str, lengths: list[int]) -> tuple[bytes, dict]:
        """(points.vmfb, points.json) of block program `program` at `lengths` (iree_export.build_points),
        built from the transformed production structure on a miss and cached beside the check's
        program key (an unnamed transform: built every time, in a temporary directory)."""
        model, plan = self.plan(src)
        prog = self.runs_as(src, model)
        if prog is not self:  # the clean program's points programs (runs_as)
            return prog.points_program(src, spec, program, lengths)

        def build(path: Path):
            from exporters.iree import export as iree_export

            iree_export.build_points(model if model is not None else self.model(src), program, lengths, path)

        if self.transform is not None and self.transform_id is None:
            with tempfile.TemporaryDirectory(prefix="moe-oracle-iree-") as tmp:
                t, path = time.perf_counter(), Path(tmp) / "points.vmfb"
                build(path)
                meta = json.loads(path.with_name("points.json").read_text())
                return path.read_bytes(), {**meta, "build_s": time.perf_counter() - t}
        parts = {"program": self.key(src, spec, parse_plan(plan)[0]), "points": program, "lengths": lengths,
                 "code": code_digest(), "points_code": points_digest()}
        art = cached_artifact("iree-points", parts, "points.vmfb", build)
        path = Path(art.path)
        return path.read_bytes(), {**json.loads(path.with_name("points.json").read_text()), "build_s": art.build_s}

    def check_given(self, src, spec) -> None:
        self.given(src, spec)

    def given(self, src, spec) -> Built:
        """--vmfb FILE: a program built elsewhere (`oracle export` writes one), its weights in the
        model.irpa beside it, checked before any work (exporters/shared/given.py): an IREE module, compiled
        for a CPU this host is (its llvm-cpu target's features), that the runtime loads with its
        parameters (in a child process), with the production exporter's functions for this check
        (required_functions). InputError naming the file otherwise."""
        from exporters.shared import given

        vmfb = Path(spec.artifact)
        irpa = vmfb.with_name(PARAMS_FILE)
        problem = given.vmfb_problem(vmfb) or given.cpu_problem(vmfb)
        if problem:
            raise InputError(f"--vmfb {vmfb}: {problem}")
        if not irpa.is_file():
            raise InputError(f"--vmfb {vmfb}: no {PARAMS_FILE} beside it (the program's weights, as "
                             "`oracle export --backend iree-llvm-cpu` writes them)")
        found = given.probe("vmfb", "--vmfb", [vmfb, irpa], "the IREE runtime")
        if found["name"] != "module":  # what the candidate calls it by (iree-turbine's export names it so)
            raise InputError(f"--vmfb {vmfb}: its module is named {found['name']!r}, not 'module' (as "
                             "`oracle export --backend iree-llvm-cpu` compiles it)")
        plan = self.plan(src)[1]
        programs, which = parse_plan(plan)
        missing = sorted(required_functions(programs, spec.prompt_len) - set(found["functions"]))
        if missing:
            raise InputError(f"--vmfb {vmfb} does not have the production exporter's functions for this check "
                             f"(prefill compiled for {spec.prompt_len} tokens, decode, the block programs): missing "
                             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        st = irpa.stat()
        params = {"name": irpa.name, "sha256": "not hashed (brought with --vmfb)", "bytes": st.st_size,
                  "scope": PARAM_SCOPE, "tensors": plan["parameters"], "build_s": 0.0}
        art = Artifact(vmfb.name, str(vmfb), sha256_file(vmfb), True, 0.0)
        return Built(programs, which, art, vmfb, params, irpa)

    def load(self, src, spec):
        b = self.given(src, spec) if spec.artifact else self.program(src, spec)
        art = b.art  # model.vmfb's build seconds: export and compile (the archive's its own)
        params_cached = b.params.get("cached", art.cached)
        info = {"executor": f"iree.runtime {versions('iree-base-runtime')['iree-base-runtime']} local-task, "
                            "llvm-cpu (compiled for this host's CPU: provenance.host.iree_target_cpu)",
                "host": {"iree_target_cpu": host_cpu()},  # host facts: left out of every comparison
                "state": "model: module globals (prefill/decode); blocks: explicit inputs/results",
                "parameters": {**{k: b.params[k] for k in ("name", "sha256", "bytes", "tensors", "scope")},
                               "loaded": "iree.runtime.ParameterIndex (memory-mapped), io_parameters module; "
                                         "block weights: numpy views of the same mapping"},
                "block_programs": {p.name: sorted(f"{k[0]}.{k[1]}" if k[0] is not None else k[1]
                                                  for k, (q, *_) in b.which.items() if q is p)
                                   for p in b.programs.values()},
                # whether each came from the cache and its build seconds: run state (the report's
                # `cache`), not provenance (the same check reports the same bytes cold and warm)
                "artifacts": [art.as_dict(), Artifact(PARAMS_FILE, str(b.irpa), b.params["sha256"], params_cached,
                                                      0.0 if params_cached else b.params["build_s"]).as_dict()]}
        ops = b.vmfb.with_name(OPS_FILE)
        try:
            cand = IreeCandidate(b.vmfb.read_bytes(), b.which, spec.prompt_len, info,
                                 ops.read_text() if ops.is_file() and not spec.artifact else None,
                                 b.irpa, b.keep)
        except Exception as e:  # noqa: BLE001 (a given program is input: refused; a program built here: its error)
            if not spec.artifact:
                raise
            raise InputError(f"--vmfb {b.vmfb}: the IREE runtime cannot run it ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]})") from None
        from exporters.shared.blocks import not_isolated
        from models.args import SPARSE, mlp_type

        cand.sparse_layers = tuple(i for i in range(src.args.num_hidden_layers) if mlp_type(src.args, i) == SPARSE)
        cand.not_isolated = not_isolated(src.args, "program")
        if spec.artifact:
            cand.no_points = ("a program given with --vmfb: a points program would be this exporter's block, "
                              "not the given program's")
        else:
            cand.points_program = functools.partial(self.points_program, src, spec)
        missing = sorted(required_functions(b.programs, spec.prompt_len) - set(cand.blocks.vm_module.function_names))
        if missing:
            raise InputError(f"--vmfb {b.vmfb} does not have the production exporter's functions for this check "
                             f"(prefill compiled for {spec.prompt_len} tokens, decode, the block programs): missing "
                             f"{', '.join(missing[:6])}{' ...' if len(missing) > 6 else ''}")
        return cand

    def export(self, src, spec, output_dir: Path) -> list[Path]:
        """`oracle export`: model.vmfb and its weights, model.irpa: the very program and archive
        a check with these shapes runs."""
        b = self.program(src, spec)
        out = []
        for name, path in (("model.vmfb", b.vmfb), (PARAMS_FILE, b.irpa)):
            out.append(Path(output_dir) / name)
            shutil.copyfile(path, out[-1])
        return out


def required_functions(programs: dict, prompt_len: int) -> set[str]:
    """What a model.vmfb for a check of `prompt_len` tokens exports (export_program): prefill
    and decode, and each block program at the prompt's length and at one token."""
    return {"prefill", "decode"} | {f"block_{p.name}_t{t}" for p in programs.values() for t in (prompt_len, 1)}


@dataclass
class Built:
    """What IreeBackend.program gives: the block programs, (layer, kind) -> (program, its weight
    inputs, its state shapes) (parse_plan: parameters by their name in model.irpa), model.vmfb's
    Artifact and path, its archive's PARAMS_INFO and path (its own cache entry; beside a --vmfb), and
    what holds an uncached build's files on disk (None: they are in the cache)."""

    programs: dict
    which: dict
    art: Artifact
    vmfb: Path
    params: dict
    irpa: Path
    keep: object = None


BACKEND = IreeBackend()
