"""`iree-llvm-cpu`, the torch side: the production model's structure, its block programs,
model.irpa, and the program traced by iree-turbine and compiled by iree-compile. Imported on a
cache miss only (exporters/iree/ runs a cached program without torch)."""

from __future__ import annotations

import gc
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from exporters.iree.program import FLAGS, OPS_FILE, PARAM_SCOPE, PARAMS_INFO, mlir_ops
from exporters.shared.blocks import block_rows
from exporters.shared.identity import fingerprint
from models.args import STATE_BUFFERS, block_keys
from models.layers.moe import SparseMoE
from models.layers.transformer import Transformer, block_fn
from oracle.cache.artifacts import sha256_file
from oracle.verdict.goldens import histogram_text


# ------------------------------------------------------------------ the model, with or without weights
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

    def entry(self, call: nn.Module | None = None) -> Callable:
        """The exported function: (root, weights, state, x, pos) -> (*outputs, *new_state). `call`: a
        module with the block's tensor names run instead of the block (eager.PointsCall: the points
        are more outputs)."""

        def entry(_root, weights, state, x, pos):
            tensors = dict(zip(self.weights, weights))
            new_state = [s.clone() for s in state]
            tensors.update(zip(self.state, new_state))
            out = torch.func.functional_call(call or self.call, tensors, (x, pos))
            return (*(out if isinstance(out, tuple) else (out,)), *new_state)

        return entry


def block_tensors(call: _Call) -> dict[str, torch.Tensor]:
    return dict(list(call.named_parameters()) + list(call.named_buffers()))


def block_programs(model: Transformer) -> tuple[dict[str, BlockProgram], dict]:
    """The distinct block programs of `model`, and (layer, kind) -> (program, its _Call)."""
    keys = block_keys(model.args)
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


def plan_of(model: Transformer) -> dict:
    """What running `model`'s block programs needs, as plain data (cached as JSON: a warm check
    reads it without torch): "programs", each block program's name, kind, weight and state input
    names and fingerprint; "blocks", per (layer, kind) its program, its weight inputs in order
    and its state shapes. A weight input is a parameter's name in model.irpa (its
    `model.named_parameters()` name, as the archive has it; found by identity, so a block's
    relative name `m.q_proj.weight` maps to `layers.1.attn.q_proj.weight`), or, for a buffer that
    is not a parameter (RoPE inv_freq, cache_pos: small, derived from the config), its values."""
    programs, which = block_programs(model)
    names = {id(p): n for n, p in model.named_parameters()}
    blocks = []
    for (layer, kind), (p, call) in which.items():
        tensors = block_tensors(call)
        inputs = []
        for n in p.weights:
            t = tensors[n]
            if id(t) in names:
                inputs.append(names[id(t)])
            elif t.is_meta:
                raise RuntimeError(f"block {(layer, kind)}: {n} is neither a parameter of the model nor a real buffer")
            else:
                inputs.append({"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                               "values": t.detach().reshape(-1).tolist()})
        blocks.append({"layer": layer, "kind": kind, "program": p.name, "inputs": inputs,
                       "state": [list(tensors[n].shape) for n in p.state],
                       # (a state buffer not of floats: DSA's chosen keys, int64)
                       "state_dtypes": [str(tensors[n].dtype).removeprefix("torch.") for n in p.state]})
    return {"programs": [{"name": p.name, "kind": p.kind, "weights": p.weights, "state": p.state,
                          "fingerprint": p.fingerprint} for p in programs.values()],
            "blocks": blocks, "parameters": len(names)}


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


def check_globals(exported, model: Transformer) -> None:
    """The exported module's globals, as the archive needs them: every `#flow.parameter.named`
    global names a parameter of `model` (what the archive holds) and is not mutable (the state
    buffers stay module globals that prefill/decode store to), and every parameter is external
    (none inlined into the program).

    The state globals keep their inline zero initial values (`dense_resource`, as large as the
    state): `dense<0.0>` splats instead gave wrong logits (1.8 off, prefill included) with
    iree 3.13 (qwen2_moe; probably the bug behind the `zero_()` reset that aliased K and V)."""
    shapes = {n: f"__auto.constant_{'_'.join(map(str, p.shape))}_{p.dtype}" for n, p in model.named_parameters()}
    params = set(shapes)
    op = exported.mlir_module.operation if hasattr(exported.mlir_module, "operation") else exported.mlir_module
    named, others = set(), []
    for g in op.regions[0].blocks[0].operations:
        if g.operation.name != "util.global" or "initial_value" not in g.attributes:
            continue
        init = str(g.attributes["initial_value"])
        others.append(str(g.attributes["sym_name"]).strip('"'))
        m = re.match(r'#(?:flow|stream)\.parameter\.named<"([^"]*)"::"([^"]*)">', init)
        if m is None:
            continue
        if "is_mutable" in g.attributes:
            raise RuntimeError(f"export: a mutable global is an external parameter: {init}")
        if m.group(1) != PARAM_SCOPE or m.group(2) not in params:
            raise RuntimeError(f"export: a global refers to a parameter the archive does not hold: {init}")
        named.add(m.group(2))
    # a parameter the program never reads has no global (a seeded fault that skips a q/k norm or a
    # correction bias); an inlined one is a constant global of its shape and dtype (iree-turbine names
    # it `__auto.constant_<shape>_<dtype>`, a `$i` after the first)
    inlined = sorted(n for n in params - named if any(o.split("$")[0] == shapes[n] for o in others))
    if inlined:
        raise RuntimeError(f"export: parameters not external (inlined into the program): {inlined}")


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
    chosen = []  # routing replay (oracle/verdict/replay.py): each sparse layer's choice, returned after the logits
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[1]))
             for layer in model.layers if isinstance(getattr(layer, "mlp", None), SparseMoE)]

    def forward(m, tokens, pos):
        chosen.clear()
        logits = m(tokens, pos)
        return (logits, *chosen)

    try:
        for name, T in (("prefill", prompt_len), ("decode", 1)):
            fxb.export_program(forward, name=name, strict=False,
                               args=(torch.zeros(1, T, dtype=torch.long), torch.arange(T)))
    finally:
        for h in hooks:
            h.remove()
    blocks = aot.FxProgramsBuilder(nn.Module())  # weights are inputs: nothing to lift
    for p in programs.values():
        for T in sorted({prompt_len, 1}):
            export_block(blocks, p, f"block_{p.name}_t{T}", block_input(model, p.kind, T))
    both = aot.FxPrograms()
    both.programs.update(fxb.programs)
    both.programs.update(blocks.programs)
    return aot.export(both)


def block_input(model: Transformer, kind: str, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, pos) a block of `kind` is called with at T positions (exporters.shared.blocks.block_rows: a decoder layer
    on N residual streams takes N rows a position, or rows N times as wide)."""
    rows, width = block_rows(model.args, kind)
    return torch.zeros(1, T * rows, width, dtype=model.embed_tokens.weight.dtype), torch.arange(T)


def export_block(builder, p: BlockProgram, name: str, example: tuple, call: nn.Module | None = None) -> None:
    """Block program `p` on `example` (x, pos: block_input) into `builder` as entry point `name` (`call`: see
    BlockProgram.entry)."""
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
        builder.export_program(p.entry(call), name=name, strict=False, args=(weights, state, *example))
    finally:
        for m, params, buffers in saved:
            m._parameters.update(params)
            m._buffers.update(buffers)


def build_points(model: Transformer, program: str, lengths: list[int], path: Path) -> None:
    """The drill's program of block program `program` (oracle/drill/points.py): entry points
    `points_<program>_t<T>`, the block program's inputs, results (*outputs, *points, *new state),
    compiled to `path`; `points.json` beside it names the points (per T, in firing order) and the
    block's submodule paths."""
    from iree.turbine import aot

    from exporters.torch.candidate import PointsCall

    untouched_weights(model)  # the weights are inputs: only their shapes are traced
    p = block_programs(model)[0][program]
    call = PointsCall(p.call.m, p.call.fn, p.kind)
    builder = aot.FxProgramsBuilder(nn.Module())
    fired = {}
    for T in lengths:
        export_block(builder, p, f"points_{program}_t{T}", block_input(model, p.kind, T), call)
        fired[T] = call.fired
    compile_to(aot.export(builder), path)
    path.with_name("points.json").write_text(json.dumps({"fired": fired, "registered": call.registered}))


def compile_to(exported, path: Path) -> None:
    """iree-compile the exported module into `path` (a subprocess: a failure raises
    CompilerToolError carrying the compiler's stderr)."""
    import iree.compiler

    mlir = path.with_suffix(".mlirbc")
    with open(mlir, "wb") as f:
        exported.mlir_module.write_bytecode(f)
    path.with_name(OPS_FILE).write_text(histogram_text(mlir_ops(str(exported.mlir_module)),
                                                       "ops of the input MLIR (torch dialect), all entry points"))
    try:
        iree.compiler.compile_file(str(mlir), output_file=str(path), extra_args=list(FLAGS))
    except iree.compiler.CompilerToolError as e:
        refuse_unlowered(str(e), mlir_ops(str(exported.mlir_module)))
        raise
    mlir.unlink()


# torch ops the installed iree-compile has no lowering for (measured: iree-base-compiler 3.13.0), which it reports
# only as a failure to legalize their operands' constants: a program holding one is refused with its name
UNLOWERED = {"torch.aten.logsumexp": "torch.logsumexp"}


def refuse_unlowered(error: str, ops: dict) -> None:
    """InputError naming the op iree-compile cannot lower, where its `error` is a failure to legalize and the
    program holds one of UNLOWERED (`ops`: mlir_ops of the torch-dialect module); else nothing."""
    import importlib.metadata

    from oracle.backend import InputError

    found = [op for op in UNLOWERED if op in ops]
    if found and "failed to legalize operation" in error:
        raise InputError(f"iree-compile (iree-base-compiler {importlib.metadata.version('iree-base-compiler')}) cannot "
                         f"lower {', '.join(f'{op} ({UNLOWERED[op]})' for op in found)}: it has no conversion of "
                         "it to linalg (the compile fails to legalize its operands); refused, not compiled without it")




def build_program(model: Transformer, prompt_len: int, path: Path) -> None:
    """model.vmfb at `path`, traced from `model`: the (transformed) structure, its parameters given
    memory that is never touched, or a transformed model with weights (a fault that reads weight
    values to pick what it changes). The parameters are external: the program is the same for any
    weight values (the archive, build_parameters, is its own cache entry)."""
    if not has_weights(model):
        untouched_weights(model)
    compile_to(export_program(model, block_programs(model)[0], prompt_len), path)
    drop_weights(model)  # the blocks' weights are read from model.irpa
    gc.collect()  # what the export left in reference cycles


def build_parameters(src, transform, path: Path) -> dict:
    """model.irpa at `path` (and PARAMS_INFO beside it). Untransformed (`transform` None): a
    decoder layer at a time from the checkpoint (save_parameters_streamed). A transform (a seeded
    fault, which may change weights): the checkpoint's fp32 production model, transformed, archived
    whole and dropped."""
    if transform is None:
        return save_parameters_streamed(src, path)
    m = src.build_production(torch.float32)
    transform(m)
    info = save_parameters(m, path)
    del m
    gc.collect()
    return info
