"""`executorch-mlx`: the production model through ExecuTorch's MLX delegate.

    production model (models/layers/, a seeded fault applied first)
      -> MLX source transformations, torch.export, MLX partitioner   (executorch_mlx_export.py)
      -> .pte, cached by content hash
      -> the ExecuTorch runtime with the MLX delegate (macOS builds that have it), or this
         project's interpreter of the MLX instruction graph on `mlx`  (executorch_mlx_interp.py)

The delegate is made importable from the pip wheel by executorch_mlx_setup.py.

The check's program is the production program's `forward` plus one method per block, each
lowered the same way and fed the reference's inputs (`isolated` rows): `attention_<i>` and
`layer_<i>` (x, pos; their own state, fresh at a block's first call), `moe_<i>` (x -> moe,
router weights, indices: the router and moe rows and the expert-coverage probes), `final_norm`,
`logits`. e2e runs `forward`: prefill at position 0 (fresh state), then one call per token.

Gated DeltaNet: the production graph uses the delegate's Metal kernel (MetalKernelNode) where
the delegate emits it (a key head dim that is a multiple of 32; otherwise it refuses the kernel
and the production graph has its ScanNode fallback, as for the tiny checkpoint, key head dim
16). A MetalKernelNode runs only on Metal, so the check's program uses the scan fallback unless
the executor is the real runtime on a Mac, and the production program is then lowered apart:
the gates and the structural golden always count the production graph (the check program's own
`forward` when both agree on the kernel: the block methods are lowered apart and leave it as is).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import platform
import shutil
import tomllib
from pathlib import Path

import numpy as np
import torch

from exporters.torch.candidate import DTYPES
from exporters.executorch.torch_lowering import lowering
from exporters.executorch.rebind import OneLowering
from exporters.shared.blocks import not_isolated
from exporters.shared.identity import production_structure, program_identity
from models.args import LINEAR
from models.layers.transformer import Transformer
from models.layers.sampling import runtime_args
from oracle.verdict import goldens
from oracle.backend import Backend, Candidate, Option

KIND = "executorch-mlx"
# what determines a .pte: the production model (its routing lives in models/layers/routing.py: a cached program
# built before a change there was reused, and a golden frozen from it: measured), this exporter
# (production_model) and the export; a fault's own code is in the key's transform_id (Fault.id)
SOURCES = ("models/layers/", "exporters/executorch/mlx/backend.py", "exporters/executorch/mlx/export.py",
           "exporters/executorch/rebind.py", "exporters/shared/blocks.py")
EXECUTORS = ("auto", "interpreter", "runtime")


# ---------------------------------------------------------------- availability
def missing() -> str | None:
    """Why this backend cannot lower (or run) here, or None."""
    from exporters.executorch.backend import missing_executorch

    problem = missing_executorch()
    if problem:
        return problem
    try:
        import mlx.core  # noqa: F401
    except Exception as e:
        return f"mlx is not installed ({type(e).__name__}: {e}); pip install 'moe-oracle[mlx]'"
    from exporters.executorch.mlx.setup import delegate_problem

    return delegate_problem()


def runtime_has_mlx() -> bool:
    """An ExecuTorch runtime with the MLX delegate registered (macOS builds with it)."""
    try:
        from exporters.executorch.runtime import runtime

        return runtime().backend_registry.is_available("MLXBackend")
    except Exception:
        return False


def executor_problem(spec) -> str | None:
    want = spec.options.get("executor", "auto")
    if want not in EXECUTORS:
        return f"executor {want!r} is not one of {', '.join(EXECUTORS)}"
    if want == "runtime" and not runtime_has_mlx():
        return f"executor=runtime: this ExecuTorch runtime has no MLX delegate (registered: {registered_backends()})"
    return None


def executor_of(spec) -> str:
    """interpreter or runtime, from --option executor=auto|interpreter|runtime (auto: the runtime
    where it has the MLX delegate)."""
    problem = executor_problem(spec)
    if problem:
        raise ValueError(problem)
    want = spec.options.get("executor", "auto")
    if want == "auto":
        return "runtime" if runtime_has_mlx() else "interpreter"
    return want


def registered_backends() -> str:
    try:
        from exporters.executorch.runtime import runtime

        return ", ".join(runtime().backend_registry.registered_backend_names)
    except Exception as e:
        return f"unknown ({type(e).__name__})"


def uses_kernel(args) -> bool:
    """Whether the production graph has the Gated DeltaNet Metal kernel (the delegate emits it
    for a key head dim that is a multiple of 32, its SIMD width)."""
    return LINEAR in args.layer_types and args.linear_attention.key_head_dim % 32 == 0


def metal_here() -> bool:
    try:
        import mlx.core as mx

        return platform.system() == "Darwin" and mx.metal.is_available()
    except Exception:
        return False


def source_digest() -> str:
    """sha256 of SOURCES. A fault's own code is in the key's transform_id (models/faults.Fault.id:
    a change to one fault builds that fault's programs again, not every faulted program)."""
    from oracle.cache.artifacts import source_digest as digest

    return digest(*SOURCES)


def delegate_code_constant(key: str) -> bool:
    """A named data entry the MLX delegate made from the code (a scalar, a constant the export lifted), not
    from a weight: `<prefix>/_scalar_2`, `<prefix>/_lifted_tensor_constant3`, and a tensor the forward
    creates (`torch.tensor(dk ** -0.5)` in the Gated DeltaNet), which torch.export lifts as
    `<prefix>/layers.0.linear_attn.lifted_tensor_0` (a module attribute keeps its own name instead). Its
    value comes from the code and the modules' plain attributes, both in the program's identity
    (exporters/shared/identity.py), so every checkpoint of one identity has the same bytes there."""
    name = key.split("/", 1)[-1]
    return name.startswith(("_scalar_", "_lifted_tensor_constant")) or name.rsplit(".", 1)[-1].startswith("lifted_tensor_")


# ---------------------------------------------------------------- gates and structure
def node_histogram(pte: Path, method: str = "forward") -> dict[str, int]:
    """Instructions per MLX node type over every chain of every MLX delegate of `method`."""
    from exporters.executorch.mlx.interpreter import graphs

    out = {}
    for g in graphs(Path(pte).read_bytes(), method):
        for name, n in g.histogram().items():
            out[name] = out.get(name, 0) + n
    return dict(sorted(out.items()))


def histogram_text(hist: dict[str, int]) -> str:
    """The structural golden: one `<node type> <count>` line per node type, sorted, and the total."""
    header = "MLX delegate instructions of the production program's `forward`, every chain (node type, count)"
    return goldens.histogram_text(hist, header) + f"total {sum(hist.values())}\n"


def node_gates(family: str, hist: dict[str, int], where: str) -> list:
    """goldens/<family>/executorch-mlx/gates.toml: [max] and [min] node counts ("A+B" sums)."""
    from oracle.verdict.goldens import golden_dir
    from oracle.reports.result import GateRow

    path = golden_dir(family, KIND) / "gates.toml"
    if not path.is_file():
        return []
    doc = tomllib.loads(path.read_text())
    rows = []
    for bound, sign in (("max", "<="), ("min", ">=")):
        for name, limit in doc.get(bound, {}).items():
            count = sum(hist.get(n, 0) for n in name.split("+"))
            ok = count <= limit if bound == "max" else count >= limit
            rows.append(GateRow(f"mlx_nodes:{name} {sign} {limit}", "pass" if ok else "fail", count, limit,
                                f"{name}: {count} in the lowered MLX graph ({where}); limit {sign} {limit} "
                                f"(goldens/{family}/{KIND}/gates.toml)"))
    return rows


# ---------------------------------------------------------------- running it
class MlxCandidate(Candidate):
    """forward (prefill / decode) and the block methods of the check's program."""

    block_mode = "isolated"
    no_batch = "the delegate's program is exported for one sequence (batch 1)"

    def __init__(self, program, info: dict, dtype, production_hist: dict, family: str, tiny: bool,
                 sparse_layers: tuple = ()):
        self.program, self.info, self.dtype = program, info, dtype
        self.hist, self.family, self.tiny = production_hist, family, tiny
        self.loaded = {}
        self.sparse_layers = sparse_layers  # the layers whose choices `routes` returns, in order

    def fresh(self, name: str):
        """The method with its state fresh (zeroed buffers), as at load."""
        m = self.loaded.get(name)
        if m is not None and hasattr(m, "reset"):
            m.reset()
        else:  # the runtime: a method loaded anew starts from zeroed buffers
            m = self.loaded[name] = self.program.load_method(name)
        return m

    def call(self, name: str, *args):
        # the runtime's outputs may alias the method's memory (the next call overwrites them)
        return [o.clone() if torch.is_tensor(o) else o for o in self.loaded[name].execute(list(args))]

    @torch.no_grad()
    def prefill(self, tokens):
        self.fresh("forward")
        args = (torch.tensor([tokens]), torch.arange(len(tokens)))
        self.routes = self._routes(args, fresh=True)
        return self.call("forward", *args)[0][0]

    @torch.no_grad()
    def decode(self, token, pos):
        args = (torch.tensor([[token]]), torch.tensor([pos]))
        self.routes = self._routes(args, fresh=False)
        return self.call("forward", *args)[0][0, -1]

    routes = None
    no_routes = "the program has no `routes` method (a production program, or one built before routing replay)"

    def _routes(self, args, fresh: bool) -> dict | None:
        """{layer: (indices [T, k], weights [T, k])} the program's routers choose on these tokens: its `routes`
        method (the forward with each sparse layer's choice as more outputs, its own state, run beside
        `forward`)."""
        if "routes" not in self.program.method_names:
            return None
        if fresh:
            self.fresh("routes")
        outs = self.call("routes", *args)[1:]
        if len(outs) != 2 * len(self.sparse_layers):  # a program built before the weights were returned
            return {layer: np.asarray(o).reshape(-1, np.asarray(o).shape[-1]).astype(np.int64)
                    for layer, o in zip(self.sparse_layers, outs)}
        out = {}
        for layer, idx, w in zip(self.sparse_layers, outs[::2], outs[1::2]):
            i = np.asarray(idx).reshape(-1, np.asarray(idx).shape[-1]).astype(np.int64)
            out[layer] = (i, w.float().numpy().reshape(i.shape) if torch.is_tensor(w) else np.asarray(w, np.float32))
        return out

    def last_routes(self):
        return self.routes

    not_isolated: dict = {}  # (layer, kind) -> why its block method cannot run it alone (the row's n/a)

    @torch.no_grad()
    def run_block(self, layer, kind, calls):
        if (layer, kind) in self.not_isolated:
            return None
        name = {"router": f"moe_{layer}", "moe": f"moe_{layer}", "mlp": f"mlp_{layer}",
                "attention": f"attention_{layer}", "layer": f"layer_{layer}"}.get(kind, kind)
        if name not in self.program.method_names:
            return None
        self.fresh(name)
        out = []
        for c in calls:
            x = c.x.reshape(1, -1, c.x.shape[-1]).to(self.dtype)
            if kind in ("attention", "layer"):
                out.append(self.call(name, x, c.pos)[0])
            elif kind in ("router", "moe"):
                moe, w, idx = self.call(name, x)
                out.append((w, idx) if kind == "router" else moe)
            else:
                out.append(self.call(name, x)[0])
        return out

    points_program = None  # (layer, kind) -> (the points program, its points.json): ExecutorchMlxBackend.points_program

    @torch.no_grad()
    def run_block_points(self, layer, kind, calls):
        """The drill: the block alone in a method lowered like the check's block methods, its
        points as more outputs, fed the reference's inputs."""
        if self.points_program is None:
            return None
        from oracle.drill.points import from_outputs

        program, meta = self.points_program(layer, kind)
        method = program.load_method("points")
        if hasattr(method, "reset"):
            method.reset()
        fired, values = [], []
        for c in calls:
            x = c.x.reshape(1, -1, c.x.shape[-1]).to(self.dtype)
            pos = c.pos if c.pos.numel() == x.shape[1] else torch.arange(x.shape[1])
            outs = [o.clone() if torch.is_tensor(o) else o for o in method.execute([x, pos])]
            names = meta["fired"]
            fired += names
            values += [o.float().numpy() for o in outs[len(outs) - len(names):]]
        return from_outputs(fired, meta["registered"], values, meta.get("build_s"))

    def gates(self):
        if not self.tiny:  # the limits are the tiny model's
            return []
        return node_gates(self.family, self.hist, "production program, forward, all chains")

    def structures(self):
        return {"mlx_nodes": histogram_text(self.hist)}


class MlxSamplingCandidate(MlxCandidate):
    """A check program lowered with --sampling: the sampler's methods, run like the others.
    The harness is the runner; runtime_args validates its arguments."""

    def _loaded(self, name: str):
        if name not in self.loaded:
            self.fresh(name)
        return name

    def sample_prefill(self, tokens, temperature, top_p, seed) -> int:
        args = runtime_args(temperature, top_p, seed)
        self.fresh("sample_forward")
        return int(self.call("sample_forward", torch.tensor([tokens]), torch.arange(len(tokens)), *args)[0][0])

    def sample_decode(self, token, pos, temperature, top_p, seed) -> int:
        args = runtime_args(temperature, top_p, seed)
        return int(self.call("sample_forward", torch.tensor([[token]]), torch.tensor([pos]), *args)[0][0])

    def sample_logits(self, logits, temperature, top_p, seed) -> int:
        lg = torch.as_tensor(np.asarray(logits, np.float32)).reshape(1, -1).to(self.dtype)
        return int(self.call(self._loaded("sample_logits"), lg, *runtime_args(temperature, top_p, seed))[0][0])


class ExecutorchMlxBackend(Backend):
    """`transform(model)` modifies the built production model before the MLX source
    transformations (how faults are injected); `transform_id` names it in the cache key."""

    name = KIND
    precisions = ("fp32", "bf16")
    # the programs take other weights of their identity without lowering again (exporters/executorch/rebind.py)
    rebinds_weights = True
    option_schema = (Option("executor", str, EXECUTORS, "auto",
                            "what runs the lowered program: the ExecuTorch runtime with the MLX delegate "
                            "(macOS builds) or moe-oracle's interpreter of the MLX graph; auto: the runtime "
                            "where it has the delegate", commands=("check",)),)

    def __init__(self, name: str | None = None, transform=None, transform_id: str | None = None):
        if transform is not None and not transform_id:
            raise ValueError("a transform needs a transform_id (it is part of the artifact cache key)")
        self.name, self.transform, self.transform_id = name or KIND, transform, transform_id

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults/) injected before the MLX transformations;
        None for a fault the delegate cannot express (executorch_mlx_export.NOT_EXPRESSIBLE)."""
        from exporters.executorch.mlx.export import MLX_FAULTS, NOT_EXPRESSIBLE

        if fault.precision not in self.precisions or fault.name in NOT_EXPRESSIBLE:
            return None
        if fault.name in MLX_FAULTS:  # the same bug in the program's own op (the torch form does not lower)
            fault = dataclasses.replace(fault, apply=MLX_FAULTS[fault.name])
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.id)

    def availability(self):
        reason = missing()
        return (False, reason) if reason else (True, "")

    def check_options(self, spec) -> str | None:
        return executor_problem(spec)

    def faulted_model(self, model, spec) -> Transformer:
        """The production model with the fault, before the delegate's transformations."""
        m = model.build_production(DTYPES[spec.precision])
        if self.transform is not None:
            self.transform(m)
        return m

    @staticmethod
    def for_delegate(m: Transformer, use_custom_kernel: bool) -> Transformer:
        """`m` transformed for the delegate (in place: the MLX source transformations)."""
        from exporters.executorch.mlx.export import mlx_source_transformations
        from exporters.executorch.mlx.setup import import_delegate

        import_delegate()
        return mlx_source_transformations(m, use_custom_kernel=use_custom_kernel)

    def production_model(self, model, spec, use_custom_kernel: bool) -> Transformer:
        return self.for_delegate(self.faulted_model(model, spec), use_custom_kernel)

    def artifact(self, model, spec, check: bool, kernel: bool):
        """The check's program (forward + blocks) or the production program (forward), cached."""
        from oracle.cache.artifacts import cached_artifact, versions
        from oracle.cache.store import estimate

        program = "check" if check else "production"
        sampling = check and bool(spec.options.get("sampling"))  # the check program's sampler methods
        parts = {"backend": KIND, "program": program, "family": spec.family, "precision": spec.precision,
                 "checkpoint": model.checkpoint_sha256, "args": repr(model.args), "kernel": kernel, "sampling": sampling,
                 "transform_id": self.transform_id, "source": source_digest(),
                 "versions": versions("torch", "executorch", "mlx", "torchao")}

        # another checkpoint of a program's identity takes its program with other weights, in the .pte's
        # named data (exporters/executorch/rebind.py): the delegate's scalars are the code's
        once = OneLowering(KIND, parts, "model.pte", (), code_constant=delegate_code_constant,
                           enabled=self.rebinds_weights)

        def build(path: Path):
            from exporters.executorch.mlx.export import export_methods, lower, metadata

            m = self.faulted_model(model, spec)
            identity = program_identity(m)  # before the delegate's transformations (theirs follows from the code)
            m = self.for_delegate(m, kernel)

            def lowered():
                with lowering(4 * model.parameter_count()):
                    prog = lower(export_methods(m, check, sampling), metadata(m.args))
                path.write_bytes(prog.buffer)
                if prog._tensor_data:
                    prog.write_tensor_data_to_file(str(path.parent))

            once.build(m, path, lowered,
                       lambda: (identity, program_identity(production_structure(model, DTYPES[spec.precision]))))

        name = f"{spec.family}.{spec.precision}.{program}{'.sampling' if sampling else ''}.pte"
        with once:
            return cached_artifact(KIND, parts, "model.pte", build, name=name,
                                   needed=lambda: estimate(model.parameter_count(), spec.precision))

    def points_program(self, model, spec, executor: str, kernel: bool, layer, kind: str):
        """The drill's program of block (layer, kind) (executorch_mlx_export.export_points), lowered
        as the check's program is and cached; (the loaded program, its points.json)."""
        import json

        from oracle.cache.artifacts import cached_artifact, versions
        from oracle.cache.artifacts import source_digest as exporters_source_digest

        parts = {"backend": KIND, "program": "points", "block": [layer, kind], "family": spec.family,
                 "precision": spec.precision, "checkpoint": model.checkpoint_sha256, "args": repr(model.args),
                 "kernel": kernel, "transform_id": self.transform_id, "source": source_digest(),
                 "points_code": exporters_source_digest("exporters/torch/candidate.py", "oracle/drill/points.py"),
                 "versions": versions("torch", "executorch", "mlx", "torchao")}

        def build(path: Path):
            from exporters.executorch.mlx.export import export_points, lower

            with lowering(4 * model.parameter_count()):
                methods, meta = export_points(self.production_model(model, spec, kernel), layer, kind)
                prog = lower(methods)
            path.write_bytes(prog.buffer)
            if prog._tensor_data:
                prog.write_tensor_data_to_file(str(path.parent))
            path.with_name("points.json").write_text(json.dumps(meta))

        art = cached_artifact(KIND, parts, "points.pte", build)
        path = Path(art.path)
        if executor == "runtime":
            from exporters.executorch.runtime import runtime

            program = runtime().load_program(str(path))
        else:
            from exporters.executorch.mlx.interpreter import Program

            program = Program.load(path)
        return program, {**json.loads(path.with_name("points.json").read_text()), "build_s": art.build_s}

    def load(self, model, spec):
        executor = executor_of(spec)
        kernel = uses_kernel(model.args)
        run_kernel = kernel and executor == "runtime" and metal_here()
        from exporters.executorch.mlx.interpreter import NotDelegated
        from oracle.backend import InputError

        try:
            check = self.artifact(model, spec, True, run_kernel)
        except NotDelegated as e:  # the lowering fails where a method is delegated in part (export.lower): refused
            raise InputError(f"executorch-mlx cannot lower {spec.family}: {e}") from None
        arts = [check]
        prod = check
        if run_kernel != kernel:  # the production graph differs from the executed one (Metal kernel)
            prod = self.artifact(model, spec, False, kernel)
            arts.append(prod)
        hist = node_histogram(Path(prod.path))
        if executor == "runtime":
            from exporters.executorch.runtime import runtime

            program = runtime().load_program(check.path)
            how = f"executorch {importlib.metadata.version('executorch')} runtime (MLX delegate)"
        else:
            from exporters.executorch.mlx.interpreter import Program

            try:
                program = Program.load(check.path)
            except NotDelegated as e:  # refused, naming the ops: not a wrong result
                raise InputError(f"executorch-mlx cannot run {spec.family} on this host: {e}") from None
            how = (f"moe-oracle MLX-graph interpreter on mlx {importlib.metadata.version('mlx')} (cpu), "
                   f"ExecuTorch {importlib.metadata.version('executorch')} MLX delegate graph")
        from exporters.executorch.mlx.export import metadata

        info = {"executor": how, "methods": sorted(set(program.method_names) - set(metadata(model.args))),
                "artifacts": [a.as_dict() for a in arts]}
        if LINEAR in model.args.layer_types:
            info["gated_delta_rule"] = {"executed": "Metal kernel" if run_kernel else "scan fallback",
                                        "production": "Metal kernel" if kernel else "scan fallback"}
        cls = MlxSamplingCandidate if "sample_forward" in program.method_names else MlxCandidate
        from models.args import SPARSE, mlp_type

        sparse = tuple(i for i in range(model.args.num_hidden_layers) if mlp_type(model.args, i) == SPARSE)
        cand = cls(program, info, DTYPES[spec.precision], hist, spec.family, spec.model_dir is None, sparse)
        cand.points_program = functools.partial(self.points_program, model, spec, executor, run_kernel)
        cand.not_isolated = not_isolated(model.args, "method")
        return cand

    def export(self, model, spec, output_dir) -> list[Path]:
        """The production program (forward only, the Metal kernel where the delegate emits it)."""
        pte = Path(self.artifact(model, spec, False, uses_kernel(model.args)).path)
        out = []
        for f in [pte, *sorted(pte.parent.glob("*.ptd"))]:
            out.append(Path(output_dir) / f.name)
            shutil.copyfile(f, out[-1])
        return out


BACKEND = ExecutorchMlxBackend()
