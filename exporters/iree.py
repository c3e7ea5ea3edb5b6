"""`iree-llvm-cpu`: the production torch model (models/layers.py) exported with iree-turbine,
compiled by iree-compile for the host CPU (llvm-cpu) and run by iree.runtime on local-task.

Two programs per check, each a .vmfb cached by content hash (oracle.artifacts):

- `model.vmfb`, the whole model: entry points `prefill` (T = prompt length) and `decode`
  (T = 1) exported by one `aot.FxProgramsBuilder`, so the state buffers (KV cache, conv and
  recurrent state) become module globals shared by both. Every prefill runs in a fresh
  runtime context (fresh globals), which is also how a new sequence starts.
- `blocks.vmfb`, every block kind: one program per kind (and per structurally different
  layer: full vs linear attention, or a layer a fault patched), taking the block's weights
  and state as inputs and returning (output, new state), so one program runs every layer.
  Entry points `<program>_t<T>` for T = prompt length and T = 1.

Shapes are static (prompt length and max_seq_len are in the cache key): a dynamic token
dimension exports and compiles, but computed wrong logits (~0.4 off) with iree 3.13.
"""

from __future__ import annotations

import hashlib
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from exporters.eager import block_fn
from models.layers import STATE_BUFFERS, Transformer
from oracle.artifacts import Artifact, cached_artifact, sha256_file, versions

FLAGS = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
         "--iree-llvmcpu-target-cpu=host")
TOOLS = ("iree-base-compiler", "iree-base-runtime", "iree-turbine", "torch")
LAYER_KINDS = ("attention", "router", "moe", "layer")
ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("models/layers.py", "exporters/eager.py", "exporters/iree.py")  # code that shapes a program


def host_cpu() -> str:
    """What `--iree-llvmcpu-target-cpu=host` compiles for: CPU model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        desc = "\n".join(dict.fromkeys(lines))
    except OSError:
        desc = platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(desc.encode()).hexdigest()[:16]}"


def code_digest() -> str:
    h = hashlib.sha256()
    for rel in SOURCES:
        h.update((ROOT / rel).read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ block programs
class _Call(nn.Module):
    """A block as a module: `m` holds the block's weights and state, `fn(x, pos)` runs it."""

    def __init__(self, module: nn.Module, fn: Callable):
        super().__init__()
        self.m, self.fn = module, fn

    def forward(self, x, pos):
        return self.fn(x, pos)


@dataclass
class BlockProgram:
    name: str  # entry points f"{name}_t{T}"
    kind: str
    call: _Call  # the block of the first layer using this program (what gets traced)
    weights: list[str]  # input names, in order: every parameter and non-state buffer
    state: list[str]  # state buffers: inputs and (after the output) results, in order
    fingerprint: str

    def tensors(self, call: _Call) -> dict[str, torch.Tensor]:
        return dict(list(call.named_parameters()) + list(call.named_buffers()))

    def entry(self) -> Callable:
        """The exported function: (root, weights, state, x, pos) -> (*outputs, *new_state)."""

        def entry(_root, weights, state, x, pos):
            tensors = dict(zip(self.weights, weights))
            new_state = [s.clone() for s in state]
            tensors.update(zip(self.state, new_state))
            out = torch.func.functional_call(self.call, tensors, (x, pos))
            return (*(out if isinstance(out, tuple) else (out,)), *new_state)

        return entry


def fingerprint(module: nn.Module, where: str) -> str:
    """What determines a block's program besides its weight values: module types, plain
    attributes, tensor shapes. A method or tensor set on an instance (how a seeded fault
    patches one block) makes the block's program its own (`where` names the block)."""
    h = hashlib.sha256()
    for path, sub in module.named_modules():
        h.update(f"{path}:{type(sub).__module__}.{type(sub).__qualname__}\n".encode())
        for k, v in sorted(vars(sub).items()):
            if k.startswith("_"):
                continue
            patched = callable(v) or isinstance(v, torch.Tensor)
            h.update(f" {k}={'patched@' + where if patched else repr(v)}\n".encode())
    for name, t in list(module.named_parameters()) + list(module.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}\n".encode())
    return h.hexdigest()[:16]


def block_programs(model: Transformer) -> tuple[dict[str, BlockProgram], dict]:
    """The distinct block programs of `model`, and (layer, kind) -> (program, its _Call)."""
    keys = [(i, k) for i in range(len(model.layers)) for k in LAYER_KINDS] + [(None, "final_norm"), (None, "logits")]
    programs, by_fp, which = {}, {}, {}
    for layer, kind in keys:
        call = _Call(*block_fn(model, layer, kind))
        fp = fingerprint(call.m, f"{layer}.{kind}")
        if (kind, fp) not in by_fp:
            name = f"{kind}{sum(p.kind == kind for p in programs.values())}"
            tensors = dict(list(call.named_parameters()) + list(call.named_buffers()))
            state = [n for n in tensors if n.rsplit(".", 1)[-1] in STATE_BUFFERS]
            weights = [n for n in tensors if n not in state]
            programs[name] = by_fp[kind, fp] = BlockProgram(name, kind, call, weights, state, fp)
        which[layer, kind] = (by_fp[kind, fp], call)
    return programs, which


# ------------------------------------------------------------------ export and compile
def export_model(model: Transformer, prompt_len: int):
    """prefill + decode entry points over one module: mutated buffers become shared globals."""
    from iree.turbine import aot

    fxb = aot.FxProgramsBuilder(model)
    for name, T in (("prefill", prompt_len), ("decode", 1)):
        fxb.export_program(lambda m, tokens, pos: m(tokens, pos), name=name, strict=False,
                           args=(torch.zeros(1, T, dtype=torch.long), torch.arange(T)))
    return aot.export(fxb)


def export_blocks(programs: dict[str, BlockProgram], prompt_len: int, hidden: int, dtype):
    from iree.turbine import aot

    fxb = aot.FxProgramsBuilder(nn.Module())
    for p in programs.values():
        tensors = p.tensors(p.call)
        weights = [tensors[n].detach().clone() for n in p.weights]
        state = [torch.zeros_like(tensors[n]) for n in p.state]
        # non-strict torch.export of a functional_call that mutates a state input leaves fake
        # tensors in the block's modules (torch 2.13): put the real ones back afterwards
        saved = [(m, dict(m._parameters), dict(m._buffers)) for m in p.call.modules()]
        try:
            for T in sorted({prompt_len, 1}):
                fxb.export_program(p.entry(), name=f"{p.name}_t{T}", strict=False,
                                   args=(weights, state, torch.zeros(1, T, hidden, dtype=dtype), torch.arange(T)))
        finally:
            for m, params, buffers in saved:
                m._parameters.update(params)
                m._buffers.update(buffers)
    return aot.export(fxb)


def compile_to(exported, path: Path) -> None:
    """iree-compile (a subprocess: a failure raises CompilerToolError carrying its stderr)."""
    import iree.compiler

    mlir = path.with_suffix(".mlirbc")
    with open(mlir, "wb") as f:
        exported.mlir_module.write_bytecode(f)
    iree.compiler.compile_file(str(mlir), output_file=str(path), extra_args=list(FLAGS))
    mlir.unlink()


# ------------------------------------------------------------------ runtime
def _host(result) -> list[np.ndarray]:
    """Results of one call as numpy copies (a `to_host()` view can be overwritten by a later call)."""
    results = result if isinstance(result, (list, tuple)) else [result]
    return [r.to_host().copy() for r in results]


class IreeCandidate:
    block_mode = "isolated"

    def __init__(self, model_vmfb: bytes, blocks_vmfb: bytes, which: dict, prompt_len: int, info: dict):
        import iree.runtime as rt

        self.rt, self.config = rt, rt.Config("local-task")
        self.model_vmfb, self.prompt_len, self.info = model_vmfb, prompt_len, info
        self.model = None
        self.blocks = self.module(blocks_vmfb)
        # (layer, kind) -> (program, its weights as numpy, in the program's input order)
        self.which = {}
        for key, (p, call) in which.items():
            tensors = p.tensors(call)
            self.which[key] = (p, [tensors[n].detach().numpy() for n in p.weights],
                               [np.zeros(tuple(tensors[n].shape), np.float32) for n in p.state])

    def module(self, vmfb: bytes):
        ctx = self.rt.SystemContext(config=self.config)
        ctx.add_vm_module(self.rt.VmModule.copy_buffer(ctx.instance, vmfb))
        return ctx.modules.module

    def prefill(self, tokens):
        if len(tokens) != self.prompt_len:
            raise ValueError(f"model.vmfb's prefill is compiled for {self.prompt_len} tokens, got {len(tokens)}")
        self.model = self.module(self.model_vmfb)  # fresh globals: a new sequence
        return _host(self.model.prefill(np.array([tokens], np.int64), np.arange(len(tokens), dtype=np.int64)))[0][0]

    def decode(self, token, pos):
        return _host(self.model.decode(np.array([[token]], np.int64), np.array([pos], np.int64)))[0][0, -1]

    def run_block(self, layer, kind, calls):
        p, weights, state = self.which[layer, kind]
        outs = []
        for c in calls:
            T = c.x.shape[1]
            if f"{p.name}_t{T}" not in self.blocks.vm_module.function_names:
                raise ValueError(f"blocks.vmfb has no {p.name} program for {T} tokens")
            res = self.blocks[f"{p.name}_t{T}"](*weights, *state, np.ascontiguousarray(c.x.numpy()),
                                                c.pos.numpy().astype(np.int64))
            res = res if isinstance(res, (list, tuple)) else [res]
            n_out = len(res) - len(p.state)
            state = res[n_out:]  # device arrays, passed straight back
            out = _host(res[:n_out])
            outs.append(tuple(out) if kind == "router" else out[0])
        return outs


class IreeBackend:
    """`transform(model)` may modify the built production model in place (seeded faults);
    `transform_id` names it in every cache key (a transform without an id is not cached)."""

    precisions = ("fp32",)

    def __init__(self, name: str = "iree-llvm-cpu", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        missing = [p for p, v in versions(*TOOLS[:3]).items() if v is None]
        if missing:
            return False, f"{', '.join(missing)} not installed (pip install 'moe-oracle[iree]')"
        try:
            import iree.compiler  # noqa: F401
            import iree.runtime  # noqa: F401
            import iree.turbine.aot  # noqa: F401
        except Exception as e:  # a broken install: say why, never a traceback
            return False, f"iree cannot be imported: {type(e).__name__}: {e}"
        return True, ""

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults.py) injected; None where the fault
        needs a precision this backend does not run."""
        if fault.precision not in self.precisions:
            return None
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.name)

    def key(self, src, spec) -> dict:
        return {"backend": "iree-llvm-cpu", "family": spec.family, "checkpoint": src.checkpoint_sha256,
                "precision": spec.precision, "prompt_len": spec.prompt_len, "max_seq_len": src.args.max_seq_len,
                "options": spec.options, "transform_id": self.transform_id, "versions": versions(*TOOLS),
                "flags": FLAGS, "host_cpu": host_cpu(), "code": code_digest()}

    def artifact(self, parts: dict, filename: str, build: Callable[[Path], None]) -> tuple[Artifact, bytes]:
        if self.transform is not None and self.transform_id is None:  # unnamed transform: build, don't cache
            tmp = Path(tempfile.mkdtemp(prefix="moe-oracle-iree-"))
            try:
                t = time.perf_counter()
                build(tmp / filename)
                data = (tmp / filename).read_bytes()
                return Artifact(filename, "", sha256_file(tmp / filename), False, time.perf_counter() - t), data
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        a = cached_artifact("iree", parts, filename, build)
        return a, Path(a.path).read_bytes()

    def build(self, src, spec) -> Transformer:
        m = src.build_production(torch.float32)
        if self.transform is not None:
            self.transform(m)
        return m

    def model_artifact(self, m: Transformer, src, spec):
        return self.artifact({**self.key(src, spec), "program": "model"}, "model.vmfb",
                             lambda path: compile_to(export_model(m, spec.prompt_len), path))

    def load(self, src, spec):
        m = self.build(src, spec)
        model_art, model_vmfb = self.model_artifact(m, src, spec)
        programs, which = block_programs(m)
        blocks = [(p.name, p.fingerprint) for p in programs.values()]
        blocks_art, blocks_vmfb = self.artifact(
            {**self.key(src, spec), "program": "blocks", "blocks": blocks}, "blocks.vmfb",
            lambda path: compile_to(export_blocks(programs, spec.prompt_len, src.args.hidden_size, torch.float32), path))
        info = {"executor": f"iree.runtime {versions('iree-base-runtime')['iree-base-runtime']} local-task, "
                            f"llvm-cpu ({host_cpu()})",
                "state": "model: module globals (prefill/decode); blocks: explicit inputs/results",
                "block_programs": {p.name: sorted(f"{k[0]}.{k[1]}" if k[0] is not None else k[1]
                                                  for k, (q, _) in which.items() if q is p)
                                   for p in programs.values()},
                "artifacts": [model_art.as_dict(), blocks_art.as_dict()]}
        return IreeCandidate(model_vmfb, blocks_vmfb, which, spec.prompt_len, info)

    def export(self, src, spec, output_dir: Path) -> list[Path]:
        """`oracle export`: model.vmfb (prefill + decode over module globals) into output_dir."""
        _, vmfb = self.model_artifact(self.build(src, spec), src, spec)
        out = Path(output_dir) / "model.vmfb"
        out.write_bytes(vmfb)
        return [out]


BACKEND = IreeBackend()
