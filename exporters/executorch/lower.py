"""The lowering to ExecuTorch on the CPU (XNNPACK and portable kernels), with what makes it affordable:
the weights tagged for one external file, lowered methods and XNNPACK partitions remembered in a
process by what their lowering reads, parameters released as they are consumed, delegate blobs
spilled to files."""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import hashlib
import itertools
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from exporters.executorch.export import metadata
from exporters.executorch.torch_lowering import collect
from models.args import STATE_BUFFERS
from models.layers.transformer import Transformer

WEIGHTS_TAG = "model"  # the weights file: model.ptd beside model.pte


WEIGHTS_FILE = f"{WEIGHTS_TAG}.ptd"


def tag_weights_external(ep) -> None:
    """Mark every constant input of `ep` (parameters, constants, buffers that are not per-sequence
    state) for the external weights file, delegated ones included: the methods then share one
    copy of each weight by name in model.ptd instead of carrying their own (as ExecuTorch's LLM
    exports do for large models with delegate_external_constants_pass_unlifted)."""
    from torch._export.utils import is_buffer, is_lifted_tensor_constant, is_param

    sig = ep.graph_signature
    state = set(sig.buffers_to_mutate.values())
    for n in ep.graph.nodes:
        if n.op != "placeholder":
            continue
        if is_param(ep, n) or is_lifted_tensor_constant(ep, n) or (
                is_buffer(ep, n) and sig.inputs_to_buffers[n.name] not in state):
            n.meta.setdefault("custom", {})["delegate_constant_tag"] = WEIGHTS_TAG


def lower_cpu(methods: dict, model: Transformer, xnnpack: bool = True, sample: bool = False):
    """XNNPACK where it can, portable kernels elsewhere (everywhere without `xnnpack`); the
    state buffers are planned once and shared by the methods; the weights are in model.ptd,
    shared by the methods (the program itself is small)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.devtools.intermediate_output_tap import strip_taps_
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.passes.init_mutable_pass import InitializedMutableBufferPass

    for ep in methods.values():
        tag_weights_external(ep)
    with spilled_named_data(_spill_dir.get()), remembered_partitions():  # the delegates' serialized weights: to files
        programs = lowered_methods(methods, "xnnpack" if xnnpack else "portable", lambda todo: to_edge_transform_and_lower(
            todo, partitioner=[XnnpackPartitioner()] if xnnpack else [],
            # ExecuTorch 1.5.1's IR arg validator specialises the dynamic length to the example's
            compile_config=EdgeCompileConfig(_check_ir_validity=False)))
    methods.clear()  # the exported programs (the caller's dict): their weights are the edge programs' now
    edge = edge_manager(programs, metadata(model, sample))
    release_delegated_constants(edge)  # what the delegates took: in the named data store (files) only
    strip_taps_(edge)  # after partitioning (no-op without taps)
    prog = edge.to_executorch(ExecutorchBackendConfig(
        # state starts at zero (not the arena's garbage: 0 * NaN would survive the reset)
        passes=[InitializedMutableBufferPass(list(STATE_BUFFERS))],
        memory_planning_pass=MemoryPlanningPass(alloc_graph_input=False, share_mutable_buffers=True),
        emit_mutable_buffer_names=True, external_constants=lambda node: WEIGHTS_TAG))
    return prog


# --- one lowering per method in a process ---------------------------------------------------

# this process's lowered methods: lowering_key -> (the lowered edge program, its bytes), least recently used first
LOWERED: collections.OrderedDict = collections.OrderedDict()


LOWERED_BYTES = 256 << 20  # kept at most (a tiny family's methods are 0.4-5 MB; a real width's are not kept)


# an fx node of a lowered method, its metadata (fake tensors, provenance) and code, as a deep copy holds it:
# 2.6-4.3 KB measured (tracemalloc around the copy, olmoe's and qwen3_5_moe's XNNPACK check methods, 94 to
# 1937 nodes: 0.4-5.0 MB each); the bound counts it with the weights
NODE_BYTES = 5 << 10


# node metadata that names objects by id() (provenance, traces): not part of the key
_ID_META = ("from_node", "stack_trace", "torch_fn", "seq_nr")


def lowered_methods(methods: dict, how: str, lower) -> dict:
    """Each method of `methods` (exported programs) lowered by `lower(some of them) -> EdgeProgramManager`, as
    {name: lowered edge program} in their order. ExecuTorch lowers each method on its own (decompositions,
    passes, partitions), so a method this process lowered before the same way (`how`: the partitioner and
    its settings) with the same graph, metadata and weights (lowering_key) is taken from LOWERED: a seeded
    fault changes a few methods of its program, and `oracle selftest` runs a family's checks one after
    another in a worker process. The program edge_manager makes of them is byte for byte the one lowered
    whole (tests/test_executorch_mlx.py, tests/test_executorch.py)."""
    keys = {name: lowering_key(ep, how) for name, ep in methods.items()}  # before lowering: it edits them
    todo = {name: ep for name, ep in methods.items() if keys[name] is None or keys[name][0] not in LOWERED}
    new = lower(todo) if todo else None
    programs = {}
    for name in methods:  # the caller's order: the program's named data follow it
        if name in todo:
            programs[name] = new.exported_program(name)
        else:
            LOWERED.move_to_end(keys[name][0])
            programs[name] = copy.deepcopy(LOWERED[keys[name][0]][0])  # to_executorch edits the programs
    for name in todo:  # after every remembered method is taken: remembering may evict them
        remember(keys[name], programs[name])
    return programs


def edge_manager(programs: dict, constant_methods: dict | None):
    """The EdgeProgramManager of lowered methods, as to_edge_transform_and_lower's last step (to_backend) makes it."""
    from executorch.exir import EdgeCompileConfig, EdgeProgramManager

    return EdgeProgramManager(programs, copy.deepcopy(constant_methods), EdgeCompileConfig(_check_ir_validity=False))


def lowering_key(ep, how: str) -> tuple[str, int] | None:
    """(What lowering a method the way `how` reads, hashed: partition_key's graph, signature, shape
    constraints and weight bytes, with the module paths and source functions of each node, which a
    partitioner may read; the weights' bytes) or None where its weights exceed PARTITION_BYTES. Not the
    method's name: ExecuTorch lowers each method's program on its own and names it after (edge_manager), so
    a program lowered under one name serves another (the check's `sample_prefill` is the `--sample`
    export's `prefill`; tests/test_executorch.py)."""
    key = partition_key(ep, ())
    if key is None:
        return None
    h = hashlib.sha256(f"{how} {key}".encode())
    for n in ep.graph.nodes:
        stack = n.meta.get("nn_module_stack") or {}
        fns = n.meta.get("source_fn_stack") or []
        h.update(repr(([(v[0], getattr(v[1], "__qualname__", str(v[1]))) for v in stack.values()],  # keys: id()s
                       [(f, getattr(t, "__qualname__", str(t))) for f, t in fns],
                       sorted(k for k in n.meta if k not in _ID_META))).encode())
    size = sum(t.numel() * t.element_size() for table in (ep.state_dict, ep.constants) for t in table.values()
               if isinstance(t, torch.Tensor))
    return h.hexdigest(), size


def remember(key: tuple[str, int] | None, program) -> None:
    """Keep a copy of a lowered method in LOWERED, counted as lowered_bytes, unless a delegate's data went to a
    spill file (spilled_named_data: the file goes with its build)."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    if key is None:
        return
    for _, lbm, _ in get_lowered_submodules(program.graph_module):
        out = lbm._named_data_store_output
        if out is not None and not all(isinstance(b, bytes) for b in out.buffers):
            return
    LOWERED[key[0]] = (copy.deepcopy(program), lowered_bytes(program, key[1]))
    while sum(size for _, size in LOWERED.values()) > LOWERED_BYTES:
        LOWERED.popitem(last=False)


def lowered_bytes(program, weights: int) -> int:
    """What a copy of a lowered method holds: its weights and the delegates' copies of them (twice `weights`),
    and its graphs' nodes, the method's own and each delegate's original partition (NODE_BYTES each)."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    nodes = len(program.graph.nodes) + sum(len(lbm._original_exported_program.graph.nodes)
                                           for _, lbm, _ in get_lowered_submodules(program.graph_module))
    return 2 * weights + nodes * NODE_BYTES


# --- XNNPACK's partitions, remembered -------------------------------------------------------

PARTITIONS = "executorch-xnnpack"  # the artifact cache's namespace of preprocessed XNNPACK partitions


PARTITION_BYTES = 16 << 20  # a partition whose constants are larger is not remembered (tiny models are)


def partition_key(ep, compile_specs) -> str | None:
    """What XNNPACK's preprocess of one partition reads, hashed: every node (op, name, target, arguments and
    its metadata: shapes, dtypes, debug handle, delegate tags; not its provenance or stack trace), the
    signature, the shape constraints, the constants' names, shapes and bytes, the compile specs and the
    versions of torch and executorch. None where the constants exceed PARTITION_BYTES."""
    from oracle.cache.artifacts import versions

    h = hashlib.sha256(repr((versions("torch", "executorch"), [(c.key, bytes(c.value)) for c in compile_specs],
                             str(ep.graph_signature), str(ep.range_constraints))).encode())
    total = 0
    for table in (ep.state_dict, ep.constants):
        for name in sorted(table):
            t = table[name]
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
                if total > PARTITION_BYTES:
                    return None
                h.update(f"{name} {tuple(t.shape)} {tuple(t.stride())} {t.dtype}".encode())
                h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr((name, t)).encode())
    for n in ep.graph.nodes:
        meta = sorted((k, repr(v)) for k, v in n.meta.items() if k not in UNREAD_META)
        h.update(repr((n.op, n.name, str(n.target), n.args, n.kwargs, meta)).encode())
    return h.hexdigest()[:24]


# node metadata no backend reads to build its blob (provenance names graphs by id(): never the same twice)
UNREAD_META = ("from_node", "stack_trace", "nn_module_stack", "source_fn_stack", "torch_fn", "seq_nr")


@contextlib.contextmanager
def remembered_partitions():
    """XNNPACK's preprocess of a partition (the delegate's blob and its named weights) kept in the artifact
    cache by partition_key, and taken from there when the same partition comes again: a seeded fault
    changes one block, and its program's other partitions are those of the clean program and of every
    other fault's (a third of a tiny program's lowering time is this preprocess: docs/benchmarks.md).
    What is kept holds only bytes (a partition whose weights went to spill files is not kept)."""
    import pickle

    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    from oracle.cache import store as cache
    from oracle.cache.files import temp_dir

    preprocess = XnnpackBackend.__dict__["preprocess"]
    root = cache.cache_root() / "artifacts" / PARTITIONS

    def remembered(edge_program, compile_specs):
        key = partition_key(edge_program, compile_specs)
        d = root / key if key else None
        if d is not None:
            try:
                result = pickle.loads((d / "result.pkl").read_bytes())
                cache.mark_used(d)
                return result
            except (OSError, pickle.UnpicklingError, EOFError, AttributeError):
                pass
        result = preprocess.__func__(edge_program, compile_specs)
        out = result.data_store_output
        if d is not None and (out is None or all(isinstance(b, bytes) for b in out.buffers)):
            tmp = None
            try:
                root.mkdir(parents=True, exist_ok=True)
                tmp = temp_dir(root)
                (tmp / "result.pkl").write_bytes(pickle.dumps(result))
                (tmp / cache.USED).touch()
                os.rename(tmp, d)
            except OSError:  # a read-only cache, or another build wrote it first
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
        return result

    XnnpackBackend.preprocess = staticmethod(remembered)
    try:
        yield
    finally:
        XnnpackBackend.preprocess = preprocess


def release_parameters(model: nn.Module) -> None:
    """Drop the model's own references to its parameters (after export: the exported programs
    hold them), so that a weight is freed as soon as the lowering no longer needs it. The
    module keeps its args and buffers (what the lowering reads: metadata, state buffer names)."""
    for mod in model.modules():
        for name in mod._parameters:
            mod._parameters[name] = None


SPILL_MIN_BYTES = 1 << 20


_spill_dir: contextvars.ContextVar = contextvars.ContextVar("executorch_spill_dir", default=None)


@contextlib.contextmanager
def spill_directory(parent: Path):
    """A temporary directory (under `parent`, beside the artifact: not the system's temp, which
    may be in memory) for the serialized weights of one build; see spilled_named_data."""
    with tempfile.TemporaryDirectory(prefix=".spill-", dir=parent) as d:
        token = _spill_dir.set(Path(d))
        try:
            yield Path(d)
        finally:
            _spill_dir.reset(token)


@contextlib.contextmanager
def spilled_named_data(directory: Path | None, min_bytes: int = SPILL_MIN_BYTES):
    """While lowering, a delegate's serialized weights go to files instead of memory: XNNPACK's
    preprocess puts a `bytes` copy of every constant it takes into the named data store (a
    second full copy of the weights beside the model's, kept until the .ptd is written); here
    each blob of at least `min_bytes` is written to `directory` and stored as ExecuTorch's own
    FileBackedData (what the store and the .ptd writer take besides bytes: the writer streams
    it into model.ptd). Same keys, alignment and content: the same .ptd. No directory: as is."""
    if directory is None:
        yield
        return
    from executorch.exir._serialize._cord import FileBackedData
    from executorch.exir._serialize._named_data_store import NamedDataStore

    add = NamedDataStore.add_named_data
    n = itertools.count()

    def add_named_data(self, key, data, *args, **kwargs):
        if isinstance(data, bytes) and len(data) >= min_bytes:
            f = directory / f"{next(n)}.bin"
            f.write_bytes(data)
            data = FileBackedData(str(f), sha256=hashlib.sha256(data).digest())
        return add(self, key, data, *args, **kwargs)

    NamedDataStore.add_named_data = add_named_data
    try:
        yield
    finally:
        NamedDataStore.add_named_data = add


def placeholder_like(t):
    """A tensor with `t`'s shape, strides and dtype whose memory is never touched (no resident
    pages: the allocator maps it and nothing writes it): what a fake-tensor pass reads."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or t.untyped_storage().nbytes() < SPILL_MIN_BYTES:
        return t
    e = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
    return nn.Parameter(e, requires_grad=False) if isinstance(t, nn.Parameter) else e


def release_delegated_constants(edge) -> None:
    """After partitioning: each delegate (LoweredBackendModule) keeps the subgraph it was made
    from, with the fp32 weights it consumed (its state_dict), and its own copy of its
    serialized data (merged, deduplicated, into the program's named data store). The data is
    not read again; to_executorch's passes only run the subgraph on fake tensors (their shapes
    and dtypes): the weights become placeholders of the same shapes and the duplicates go."""
    from executorch.exir.lowered_backend_module import get_lowered_submodules

    def visit(gm):
        for _, lbm, _ in get_lowered_submodules(gm):
            ep = lbm._original_exported_program
            for table in (ep._state_dict, ep._constants):
                for k, v in table.items():
                    table[k] = placeholder_like(v)
            lbm._named_data_store_output = None
        for child in gm.children():
            if isinstance(child, torch.fx.GraphModule):
                visit(child)

    for name in edge.methods:
        visit(edge.exported_program(name).graph_module)
    collect()
