"""`iree-llvm-cpu`: the production torch model (models/layers.py) exported with iree-turbine,
compiled by iree-compile for the host CPU (llvm-cpu) and run by iree.runtime on local-task.

One program per check, `model.vmfb`, and its weights, `model.irpa`, built and cached
together by content hash (oracle.artifacts), with:
- `prefill` (T = prompt length) and `decode` (T = 1): the whole model, exported from one
  `aot.FxProgramsBuilder`, so its state buffers (KV cache, conv and recurrent state) become
  module globals shared by both. Every prefill runs in a fresh runtime context (fresh
  globals), which is how a new sequence starts.
  The model's parameters are not in the program, as in a real IREE deployment: they are
  external (`#flow.parameter.named<"model"::name>`, the production model's parameter names)
  and live in an IREE parameter archive, `model.irpa`, beside model.vmfb. The runtime maps it
  (`iree.runtime.ParameterIndex`) and serves it through an `io_parameters` module; a cached
  vmfb whose archive is missing or changed is built again, never run without its weights.
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
import gc
import hashlib
import inspect
import json
import platform
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import nn

from exporters.eager import block_fn
from models import faults, layers
from models.layers import STATE_BUFFERS, Transformer
from oracle.artifacts import Artifact, cached_artifact, sha256_file, versions
from oracle.backend import InputError
from oracle.goldens import histogram_text

FLAGS = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
         "--iree-llvmcpu-target-cpu=host")
TOOLS = ("iree-base-compiler", "iree-base-runtime", "iree-turbine", "torch")
LAYER_KINDS = ("attention", "router", "moe", "layer")
PARAMS_FILE = "model.irpa"  # the model's parameters, beside model.vmfb
PARAMS_INFO = "model.irpa.json"  # its sha256, size and mtime, written with it
PARAM_SCOPE = "model"  # the scope of every `#flow.parameter.named<scope::name>`


def host_cpu() -> str:
    """What `--iree-llvmcpu-target-cpu=host` compiles for: CPU model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))]
        desc = "\n".join(dict.fromkeys(lines))
    except OSError:
        desc = platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(desc.encode()).hexdigest()[:16]}"


@functools.cache
def code_digest(faulted: bool) -> str:
    """The code a program is traced from, as imported: the production layers, block_fn, this
    file, and faults.py for a faulted build (its transform_id names the fault, not its code)."""
    h = hashlib.sha256(inspect.getsource(block_fn).encode())
    for f in (layers.__file__, __file__, *([faults.__file__] if faulted else [])):
        h.update(Path(f).read_bytes())
    return h.hexdigest()[:16]


def args_digest(src) -> str:
    """The production model's args (config resolved, max_seq_len set). Its weights are named by
    the checkpoint's sha256 and the transform's id, both in the key: reading them is not needed."""
    return hashlib.sha256(repr(src.args).encode()).hexdigest()[:16]


# ------------------------------------------------------------------ the model, with or without weights
def production_structure(src) -> Transformer:
    """The fp32 production model as Family.build_from lays it out, without reading a weight: its
    parameters on the meta device (names, shapes, dtypes), its buffers real (computed from the
    config: RoPE inv_freq, cache_pos, the zero state). Enough for block_programs and the
    blocks' non-parameter inputs; the parameters' values are in model.irpa."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model = Transformer(src.args, torch.float32)
    return model.eval()


def has_weights(model: nn.Module) -> bool:
    return not any(p.is_meta for p in model.parameters())


def drop_weights(model: nn.Module) -> None:
    """Every parameter of `model` moved to the meta device: the values freed, names, shapes and
    dtypes kept (a parameter that modules share stays shared)."""
    metas = {}  # id -> (the parameter, kept alive while its id is a key; its meta twin)
    for module in model.modules():
        for k, p in module._parameters.items():
            if p is not None and not p.is_meta:
                if id(p) not in metas:
                    metas[id(p)] = (p, nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad))
                module._parameters[k] = metas[id(p)][1]


def same_programs(built: Transformer, bp: dict, structure: Transformer, sp: dict) -> None:
    """Raise unless the model a cache miss built and exported has the block programs (names,
    fingerprints, inputs) and non-parameter buffers of the structure the cache key and the
    candidate were made from: a transform that behaved differently without weights."""
    def desc(programs):
        return [(p.name, p.fingerprint, p.weights, p.state) for p in programs.values()]

    if desc(bp) != desc(sp):
        raise RuntimeError("block programs of the built model differ from those of its structure "
                           f"(a transform that depends on weight values?): {desc(bp)} vs {desc(sp)}")
    buffers = dict(structure.named_buffers())
    for name, t in built.named_buffers():
        if name.rsplit(".", 1)[-1] in STATE_BUFFERS:
            continue
        if name not in buffers or not torch.equal(t, buffers[name]):
            raise RuntimeError(f"buffer {name} of the built model differs from its structure's")


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
    name: str  # entry points f"block_{name}_t{T}"
    kind: str
    call: _Call  # the block of the first layer using this program (what gets traced)
    weights: list[str]  # input names, in order: every parameter and non-state buffer
    state: list[str]  # state buffers: inputs and (after the output) results, in order
    fingerprint: str

    def entry(self) -> Callable:
        """The exported function: (root, weights, state, x, pos) -> (*outputs, *new_state)."""

        def entry(_root, weights, state, x, pos):
            tensors = dict(zip(self.weights, weights))
            new_state = [s.clone() for s in state]
            tensors.update(zip(self.state, new_state))
            out = torch.func.functional_call(self.call, tensors, (x, pos))
            return (*(out if isinstance(out, tuple) else (out,)), *new_state)

        return entry


def block_tensors(call: _Call) -> dict[str, torch.Tensor]:
    return dict(list(call.named_parameters()) + list(call.named_buffers()))


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
            tensors = block_tensors(call)
            state = [n for n in tensors if n.rsplit(".", 1)[-1] in STATE_BUFFERS]
            weights = [n for n in tensors if n not in state]
            programs[name] = by_fp[kind, fp] = BlockProgram(name, kind, call, weights, state, fp)
        which[layer, kind] = (by_fp[kind, fp], call)
    return programs, which


def block_inputs(model: Transformer, which: dict) -> dict:
    """(layer, kind) -> (program, its weight inputs in order, its state shapes). A weight input
    is a parameter's name in model.irpa (its `model.named_parameters()` name, as save_parameters
    wrote it; found by identity, so a block's relative name `m.q_proj.weight` maps to
    `layers.1.attn.q_proj.weight`), or, for a buffer that is not a parameter (RoPE inv_freq,
    cache_pos: small, derived from the config), its values as numpy."""
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for key, (p, call) in which.items():
        tensors = block_tensors(call)
        inputs = []
        for n in p.weights:
            t = tensors[n]
            if id(t) in names:
                inputs.append(names[id(t)])
            elif t.is_meta:
                raise RuntimeError(f"block {key}: {n} is neither a parameter of the model nor a real buffer")
            else:
                inputs.append(t.detach().numpy())
        out[key] = (p, inputs, [tuple(tensors[n].shape) for n in p.state])
    return out


# ------------------------------------------------------------------ export and compile
def save_parameters(model: Transformer, path: Path) -> dict:
    """The IREE parameter archive of every parameter of `model` (its `named_parameters()`
    names, scope PARAM_SCOPE), and PARAMS_INFO beside it. Buffers are not parameters: the
    state buffers are module globals that prefill/decode mutate, and the derived constants
    (RoPE `inv_freq`, `cache_pos`) stay small constants of the program."""
    from iree.turbine import aot

    t = time.perf_counter()
    builder = aot.ParameterArchiveBuilder()
    n = 0
    for name, p in model.named_parameters():
        builder.add_tensor(name, p.detach())
        n += 1
    builder.save(path)
    return _archive_info(path, n, t)


def save_parameters_streamed(src, path: Path) -> dict:
    """save_parameters of the production model built from `src`, without building it: the
    checkpoint's tensors a decoder layer at a time (Family.production_tensors, fp32), each group
    written to an archive of its own and dropped, then the groups joined into `path` by the
    runtime's own writer (ParameterIndex.create_archive_file, copying from their mappings) and
    removed. Peak memory: one layer in fp32 (and its checkpoint slices), whatever the depth; the
    same names and values as save_parameters (tests/test_iree_params.py)."""
    import iree.runtime as rt
    from iree.turbine import aot

    t = time.perf_counter()
    parts, n = [], 0
    try:
        for group in src.family.production_tensors(src.model_dir, src.args, torch.float32):
            builder = aot.ParameterArchiveBuilder()
            for name, tensor in group.items():
                builder.add_tensor(name, tensor)
            parts.append(path.with_name(f".{path.stem}-part{len(parts)}.irpa"))
            builder.save(parts[-1])
            n += len(group)
            del builder, group
        index = rt.ParameterIndex()
        for part in parts:
            index.load(str(part), mmap=True)
        index.create_archive_file(str(path))
        del index
    finally:
        for part in parts:
            part.unlink(missing_ok=True)
    return _archive_info(path, n, t)


def _archive_info(path: Path, tensors: int, t0: float) -> dict:
    """PARAMS_INFO of the archive just written at `path` (written beside it)."""
    st = path.stat()
    info = {"name": path.name, "sha256": sha256_file(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "scope": PARAM_SCOPE, "tensors": tensors, "build_s": time.perf_counter() - t0}
    path.with_name(PARAMS_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    return info


def untouched_weights(model: nn.Module) -> None:
    """Every meta parameter of `model` given CPU memory that is never written or read: what a
    traced export needs (fake tensors are made from real ones: meta beside the CPU buffers fails)
    when the parameters are external (their values are in model.irpa, not in the program).
    The allocation is address space only: pages nobody touches take no memory."""
    for module in model.modules():
        for k, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[k] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad)


def checked_parameters(vmfb: Path) -> dict | None:
    """PARAMS_INFO of the archive beside `vmfb` if the archive is there and is the one that was
    written with it (same size, and same sha256 unless its mtime is unchanged), else None."""
    irpa, meta = vmfb.with_name(PARAMS_FILE), vmfb.with_name(PARAMS_INFO)
    try:
        info = json.loads(meta.read_text())
        st = irpa.stat()
    except (OSError, ValueError):
        return None
    if st.st_size != info.get("bytes"):
        return None
    if st.st_mtime_ns != info.get("mtime_ns") and sha256_file(irpa) != info.get("sha256"):
        return None
    return info


def check_globals(exported, model: Transformer) -> None:
    """The exported module's globals, as the archive needs them: every `#flow.parameter.named`
    global names a parameter of `model` (what the archive holds) and is not mutable (the state
    buffers stay module globals that prefill/decode store to), and every parameter is external
    (none inlined into the program).

    The state globals keep their inline zero initial values (`dense_resource`, as large as the
    state): `dense<0.0>` splats instead gave wrong logits (1.8 off, prefill included) with
    iree 3.13 (qwen2_moe; probably the bug behind the `zero_()` reset that aliased K and V)."""
    params = {n for n, _ in model.named_parameters()}
    op = exported.mlir_module.operation if hasattr(exported.mlir_module, "operation") else exported.mlir_module
    named = set()
    for g in op.regions[0].blocks[0].operations:
        if g.operation.name != "util.global" or "initial_value" not in g.attributes:
            continue
        init = str(g.attributes["initial_value"])
        m = re.match(r'#(?:flow|stream)\.parameter\.named<"([^"]*)"::"([^"]*)">', init)
        if m is None:
            continue
        if "is_mutable" in g.attributes:
            raise RuntimeError(f"export: a mutable global is an external parameter: {init}")
        if m.group(1) != PARAM_SCOPE or m.group(2) not in params:
            raise RuntimeError(f"export: a global refers to a parameter the archive does not hold: {init}")
        named.add(m.group(2))
    if named != params:
        raise RuntimeError(f"export: parameters not external (inlined into the program): {sorted(params - named)}")


def export_program(model: Transformer, programs: dict[str, BlockProgram], prompt_len: int,
                   external: bool = True):
    """One module: the model's prefill + decode over shared globals, its parameters external
    (see save_parameters), and every block program (weights as inputs). external=False: the
    parameters inlined into the program instead (how it was built before the archive; tests
    compare the two)."""
    from iree.turbine import aot

    if not external:
        return _export(model, programs, prompt_len)
    # what `aot.externalize_module_parameters` does, for the parameters only: it also tags the
    # persistent buffers, which makes each state buffer a mutable global initialised from the
    # archive (`util.global private mutable @__auto.k_cache = #flow.parameter.named<"model"::
    # "k_cache">`), an archive that would then hold zero-filled caches. The trait is read when
    # aot.export imports the programs, and is an attribute on the model's own tensors: taken
    # off again afterwards.
    params = [p for _, p in model.named_parameters()]
    for name, p in model.named_parameters():
        aot.ExternalTensorTrait(external_scope=PARAM_SCOPE, external_name=name).set(p)
    try:
        exported = _export(model, programs, prompt_len)
    finally:
        for p in params:
            if hasattr(p, "_turbine_external_tensor_trait"):
                del p._turbine_external_tensor_trait
    check_globals(exported, model)
    return exported


def _export(model: Transformer, programs: dict[str, BlockProgram], prompt_len: int):
    from iree.turbine import aot

    fxb = aot.FxProgramsBuilder(model)
    for name, T in (("prefill", prompt_len), ("decode", 1)):
        fxb.export_program(lambda m, tokens, pos: m(tokens, pos), name=name, strict=False,
                           args=(torch.zeros(1, T, dtype=torch.long), torch.arange(T)))
    blocks = aot.FxProgramsBuilder(nn.Module())  # weights are inputs: nothing to lift
    dtype, hidden = model.embed_tokens.weight.dtype, model.args.hidden_size
    for p in programs.values():
        tensors = block_tensors(p.call)
        # example inputs: only their shapes and dtypes are traced (fake tensors), so uninitialised
        # memory the export never touches (no copy of the block's weights: at a cache miss the
        # clones of every program's weights were most of the peak above the model itself);
        # distinct tensors, never one object for two inputs (FINDINGS: k and v get tied)
        weights = [torch.empty_like(tensors[n]) for n in p.weights]
        state = [torch.zeros_like(tensors[n]) for n in p.state]
        # non-strict torch.export of a functional_call that mutates a state input leaves fake
        # tensors in the block's modules (torch 2.13): put the real ones back afterwards
        saved = [(m, dict(m._parameters), dict(m._buffers)) for m in p.call.modules()]
        try:
            for T in sorted({prompt_len, 1}):
                blocks.export_program(p.entry(), name=f"block_{p.name}_t{T}", strict=False,
                                      args=(weights, state, torch.zeros(1, T, hidden, dtype=dtype), torch.arange(T)))
        finally:
            for m, params, buffers in saved:
                m._parameters.update(params)
                m._buffers.update(buffers)
    both = aot.FxPrograms()
    both.programs.update(fxb.programs)
    both.programs.update(blocks.programs)
    return aot.export(both)


def compile_to(exported, path: Path) -> None:
    """iree-compile the exported module into `path` (a subprocess: a failure raises
    CompilerToolError carrying the compiler's stderr)."""
    import iree.compiler

    mlir = path.with_suffix(".mlirbc")
    with open(mlir, "wb") as f:
        exported.mlir_module.write_bytecode(f)
    path.with_name(OPS_FILE).write_text(histogram_text(mlir_ops(str(exported.mlir_module)),
                                                       "ops of the input MLIR (torch dialect), all entry points"))
    iree.compiler.compile_file(str(mlir), output_file=str(path), extra_args=list(FLAGS))
    mlir.unlink()


OPS_FILE = "mlir_ops.txt"
_OP = re.compile(r"^\s*(?:%[^=]*=\s*)?\"?([a-z_][\w]*\.[\w.]+)\"?[\s(<{:]")


def mlir_ops(text: str) -> dict:
    """Op name -> count over the module's text (one op per line), up to the `{-# dialect_resources`
    trailer: its blob names encode shapes (the cache length), not ops."""
    counts = {}
    for line in text.split("\n{-#")[0].splitlines():
        m = _OP.match(line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


# ------------------------------------------------------------------ runtime
def _host(result) -> list[np.ndarray]:
    """Results of one call as numpy copies (a `to_host()` view can be overwritten by a later call)."""
    results = result if isinstance(result, (list, tuple)) else [result]
    return [r.to_host().copy() for r in results]


class IreeCandidate:
    block_mode = "isolated"

    def __init__(self, vmfb: bytes, blocks: dict, prompt_len: int, info: dict, ops: str | None = None,
                 params: Path | None = None, keep=None):
        import iree.runtime as rt

        self.ops, self.keep = ops, keep  # keep: what holds `params` on disk (a temporary directory)
        self.rt, self.config = rt, rt.Config("local-task")
        self.vmfb, self.prompt_len, self.info = vmfb, prompt_len, info
        # the modules every context is made of, shared by all of them (a context holds its own
        # module state: the globals): the weights (`params`, memory-mapped, served by an
        # io_parameters module), then the program, which imports them
        instance = self.config.vm_instance
        self.modules = []
        if params is not None:
            self.index = rt.ParameterIndex()
            self.index.load(str(params), mmap=True)
            self.modules.append(rt.create_io_parameters_module(instance, self.index.create_provider(scope=PARAM_SCOPE)))
        self.modules.append(rt.VmModule.copy_buffer(instance, vmfb))
        # at most one context at a time: each holds, besides the state, its own copy of what
        # iree-compile hoisted into initializers (measured: 229 MiB per context for the 0.79 GiB
        # OLMoE-shaped model of docs/iree.md, the size of lm_head + the attention projections,
        # apparently transposed), so the blocks run in the current one
        self.seq = None  # the context of the current sequence (prefill, then decode)
        self._blocks = self.context()  # the blocks' context while there is no sequence
        # (layer, kind) -> (program, its weights as numpy in input order, its fresh state). Blocks
        # (block_inputs) name their parameters: read-only numpy views of the archive mapped above,
        # the pages prefill/decode use too (no copy; the runtime copies an input per call)
        entries = dict(self.index.items()) if params is not None else {}
        self.which = {}
        for key, (p, inputs, state) in blocks.items():
            weights = [rt.parameter_index_entry_as_numpy_ndarray(entries[x]) if isinstance(x, str) else x
                       for x in inputs]
            self.which[key] = (p, weights, [np.zeros(s, np.float32) for s in state])

    def context(self):
        """A fresh runtime context for the program: its globals (the model's state) initialised."""
        return self.rt.SystemContext(vm_modules=self.modules, config=self.config).modules.module

    @property
    def blocks(self):
        """The context block programs run in: any will do (they use no globals, their weights and
        state are inputs), so the current sequence's when there is one."""
        if self.seq is not None:
            return self.seq
        if self._blocks is None:
            self._blocks = self.context()
        return self._blocks

    def prefill(self, tokens):
        if len(tokens) != self.prompt_len:
            raise ValueError(f"model.vmfb's prefill is compiled for {self.prompt_len} tokens, got {len(tokens)}")
        self.seq = self._blocks = None  # released before the next is made (the peak: one context);
        gc.collect()  # a SystemContext and its BoundModules refer to each other: freed by the collector
        self.seq = self.context()  # a new sequence: fresh state
        return _host(self.seq.prefill(np.array([tokens], np.int64), np.arange(len(tokens), dtype=np.int64)))[0][0]

    def decode(self, token, pos):
        if self.seq is None:
            raise RuntimeError("decode() before prefill(): no sequence")
        return _host(self.seq.decode(np.array([[token]], np.int64), np.array([pos], np.int64)))[0][0, -1]

    def structures(self) -> dict:
        """The structural golden: the op histogram of the MLIR that went into iree-compile."""
        return {"mlir_ops": self.ops} if self.ops else {}

    def run_block(self, layer, kind, calls):
        p, weights, state = self.which[layer, kind]
        outs = []
        for c in calls:
            entry = f"block_{p.name}_t{c.x.shape[1]}"
            if entry not in self.blocks.vm_module.function_names:
                raise ValueError(f"model.vmfb has no {entry} (compiled for T = {self.prompt_len} and 1)")
            x, pos = np.ascontiguousarray(c.x.numpy()), c.pos.numpy().astype(np.int64)
            res = self.blocks[entry](*weights, *state, x, pos)
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

    def memory_estimate(self, src, spec) -> tuple[int, str]:
        """No torch model with weights is held, building or running (an untransformed build writes
        model.irpa a layer at a time and traces the program without weights; the runtime maps the
        archive: file pages, which the kernel can drop and read again). What is held: one decoder
        layer's fp32 weights twice, either as the build's converted layer beside its checkpoint
        slices or as the runtime's copies of a `layer` block call's weight inputs (copied in, and
        again inside the program), and each context's constants that iree-compile hoisted
        (lm_head, the attention projections: at most the weights outside the layers). A seeded
        fault (a transform) builds the whole fp32 model as before: 4 bytes per parameter more."""
        from models.checkpoint import layer_parameter_counts

        layer, outside = layer_parameter_counts(src.model_dir)
        need = 8 * layer + 4 * outside
        how = f"2 x {layer / 1e9:.2f} B parameters of its largest layer + {outside / 1e9:.2f} B outside the layers, in fp32"
        if self.transform is not None:
            params = src.parameter_count()
            need += 4 * params
            how += f", + the whole fp32 model for the fault ({params / 1e9:.2f} B parameters)"
        return need, how

    artifact_suffix = ".vmfb"  # --vmfb: a program built elsewhere

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
        """This backend with a seeded fault (models/faults.py) injected; None where the fault
        needs a precision this backend does not run."""
        if fault.precision not in self.precisions:
            return None
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.name)

    def key(self, src, spec, programs: dict) -> dict:
        return {"backend": "iree-llvm-cpu", "family": spec.family, "checkpoint": src.checkpoint_sha256,
                "precision": spec.precision, "prompt_len": spec.prompt_len, "max_seq_len": src.args.max_seq_len,
                "options": {k: v for k, v in spec.options.items() if k != "max_seq_len"},  # max_seq_len: above
                "transform_id": self.transform_id, "versions": versions(*TOOLS), "flags": FLAGS,
                "host_cpu": host_cpu(), "code": code_digest(self.transform is not None),
                "args": args_digest(src), "parameters": f"{PARAMS_FILE} scope={PARAM_SCOPE}",
                "blocks": [(p.name, p.fingerprint) for p in programs.values()]}

    def model(self, src) -> Transformer:
        """The transformed production model the block programs are read from: its structure
        alone (production_structure), unless the transform is unnamed (applied once, to the real
        model, as an uncached build always did) or fails without weight values (a fault that
        reads them: expert_weights_off_1e-3 picks its expert by the router's weights)."""
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

    def program(self, src, spec) -> Built:
        """The block programs, model.vmfb and model.irpa: built (export + archive + compile) on a
        cache miss, else read from the cache (a cached vmfb without its archive: built again).
        Only a miss reads the checkpoint's weights: a layer at a time into the archive (a
        transform's build: the whole transformed model, dropped when built)."""
        if spec.precision not in self.precisions:
            raise ValueError(f"{self.name} runs {', '.join(self.precisions)} only, not {spec.precision}")
        model = self.model(src)
        programs, which = block_programs(model)

        def build(path: Path):
            if self.transform is None:  # the archive a layer at a time; the program traced without weights
                save_parameters_streamed(src, path.with_name(PARAMS_FILE))
                untouched_weights(model)
                compile_to(export_program(model, programs, spec.prompt_len), path)
                return
            m, progs = model, programs
            if not has_weights(model):  # the transformed model's weights, for the archive and the export
                m = src.build_production(torch.float32)
                self.transform(m)
                progs = block_programs(m)[0]
                same_programs(m, progs, model, programs)
            save_parameters(m, path.with_name(PARAMS_FILE))
            compile_to(export_program(m, progs, spec.prompt_len), path)

        def built(art, path, params, keep=None):
            drop_weights(model)  # the blocks' weights are read from model.irpa
            if not art.cached:
                gc.collect()  # what the export left in reference cycles
            return Built(programs, block_inputs(model, which), art, path, params, keep)

        if self.transform is not None and self.transform_id is None:  # an unnamed transform: never cached
            tmp = tempfile.TemporaryDirectory(prefix="moe-oracle-iree-")  # removed with the candidate
            t, path = time.perf_counter(), Path(tmp.name) / "model.vmfb"
            build(path)
            art = Artifact("model.vmfb", "", sha256_file(path), False, time.perf_counter() - t)
            return built(art, path, checked_parameters(path), tmp)
        key = self.key(src, spec, programs)
        art = cached_artifact("iree", key, "model.vmfb", build)
        params = checked_parameters(Path(art.path))
        if params is None and art.cached:  # its archive is missing or changed: build both again
            shutil.rmtree(Path(art.path).parent, ignore_errors=True)
            art = cached_artifact("iree", key, "model.vmfb", build)
            params = checked_parameters(Path(art.path))
        if params is None:
            raise RuntimeError(f"{PARAMS_FILE} is missing beside {art.path}")
        return built(art, Path(art.path), params)

    def given(self, src, spec) -> Built:
        """--vmfb FILE: a program built elsewhere (`oracle export` writes one), its weights in the
        model.irpa beside it. Its functions are checked against the production exporter's when
        the candidate loads (required_functions)."""
        vmfb = Path(spec.artifact)
        irpa = vmfb.with_name(PARAMS_FILE)
        if not irpa.is_file():
            raise InputError(f"--vmfb {vmfb}: no {PARAMS_FILE} beside it (the program's weights, as "
                             "`oracle export --backend iree-llvm-cpu` writes them)")
        model = production_structure(src)
        programs, which = block_programs(model)
        st = irpa.stat()
        params = {"name": irpa.name, "sha256": "not hashed (brought with --vmfb)", "bytes": st.st_size,
                  "scope": PARAM_SCOPE, "tensors": sum(1 for _ in model.named_parameters()), "build_s": 0.0}
        art = Artifact(vmfb.name, str(vmfb), sha256_file(vmfb), True, 0.0)
        return Built(programs, block_inputs(model, which), art, vmfb, params)

    def load(self, src, spec):
        b = self.given(src, spec) if spec.artifact else self.program(src, spec)
        art = b.art
        if not art.cached:  # model.vmfb's build seconds: export and compile, the archive's apart
            art = replace(art, build_s=max(art.build_s - b.params["build_s"], 0.0))
        info = {"executor": f"iree.runtime {versions('iree-base-runtime')['iree-base-runtime']} local-task, "
                            f"llvm-cpu ({host_cpu()})",
                "state": "model: module globals (prefill/decode); blocks: explicit inputs/results",
                "parameters": {**{k: b.params[k] for k in ("name", "sha256", "bytes", "tensors", "scope")},
                               "cached": art.cached, "build_s": 0.0 if art.cached else b.params["build_s"],
                               "loaded": "iree.runtime.ParameterIndex (memory-mapped), io_parameters module; "
                                         "block weights: numpy views of the same mapping"},
                "block_programs": {p.name: sorted(f"{k[0]}.{k[1]}" if k[0] is not None else k[1]
                                                  for k, (q, *_) in b.which.items() if q is p)
                                   for p in b.programs.values()},
                "artifacts": [art.as_dict()]}
        ops = b.vmfb.with_name(OPS_FILE)
        cand = IreeCandidate(b.vmfb.read_bytes(), b.which, spec.prompt_len, info,
                             ops.read_text() if ops.is_file() and not spec.artifact else None,
                             b.vmfb.with_name(PARAMS_FILE), b.keep)
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
        for name in ("model.vmfb", PARAMS_FILE):
            out.append(Path(output_dir) / name)
            shutil.copyfile(b.vmfb.with_name(name), out[-1])
        return out


def required_functions(programs: dict, prompt_len: int) -> set[str]:
    """What a model.vmfb for a check of `prompt_len` tokens exports (export_program): prefill
    and decode, and each block program at the prompt's length and at one token."""
    return {"prefill", "decode"} | {f"block_{p.name}_t{t}" for p in programs.values() for t in (prompt_len, 1)}


@dataclass
class Built:
    """What IreeBackend.program gives: the block programs, (layer, kind) -> (program, its weight
    inputs, its state shapes) (block_inputs: parameters by their name in model.irpa), model.vmfb's
    Artifact and path, its archive's PARAMS_INFO (model.irpa beside it), and what
    holds an uncached build's files on disk (None: they are in the cache)."""

    programs: dict
    which: dict
    art: Artifact
    vmfb: Path
    params: dict
    keep: object = None


BACKEND = IreeBackend()
