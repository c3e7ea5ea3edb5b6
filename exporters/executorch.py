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

The on-device sampler (models/sampling.py, Gumbel-max with temperature and top-p from an
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

import collections
import contextlib
import contextvars
import copy
import functools
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import types
from pathlib import Path

import numpy as np
import torch
from torch import nn

from exporters import executorch_weights as ew
from exporters.eager import DTYPES
from exporters.identity import production_structure, program_identity
from exporters.torch_lowering import collect, lowering
from exporters.executorch_runtime import runtime  # noqa: F401 (the runtime the backends here load programs with)
from models.args import SPARSE, block_input_path, block_keys, block_path, mlp_type
from models.layers import STATE_BUFFERS, Transformer, traced_experts
from models.sampling import Sampler, SampledModel, example_args, runtime_args
from oracle.backend import Backend, Candidate, Option
from oracle.goldens import histogram_text

ROOT = Path(__file__).resolve().parents[1]
SEQUENCE_MODE, PROBE_MODE = "in-situ", "isolated"


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


def block_paths(args) -> list[tuple[tuple, str]]:
    """((layer, kind), module path) of every block the harness checks, in the harness's order."""
    return [(key, block_path(args, *key)) for key in block_keys(args)]


def export_methods(model: Transformer, sample: bool = False, dense_prefill: bool = False) -> dict:
    """torch.export (strict: the state buffers are updated in place) of prefill and decode.
    The prefill example has the largest length, as the CUDA/AOTI exports need. With `sample`
    the sampler is fused (SampledModel: the token instead of the logits). With `dense_prefill`
    prefill runs every expert on every token instead of gathering each token's experts'
    weights (models.layers.Experts: the gather plans a weight copy per token of the longest
    prefill, 4.8 GB at OLMoE's width for 24 tokens); decode keeps the gather (one token)."""
    from torch.export import Dim, export

    S = model.args.max_seq_len
    long = dict(dtype=torch.long)
    module, extra = (SampledModel(model), example_args()) if sample else (model, ())
    with torch.no_grad(), parameters_not_cloned():
        out = {"decode": export(module, (torch.zeros(1, 1, **long), torch.zeros(1, **long), *extra), strict=True)}
        if S >= 3:  # a prefill of 2..S-1 tokens (S - 1 leaves room for one decode step)
            T = Dim("T", min=2, max=S - 1)
            with traced_experts(model, "dense" if dense_prefill else "gather"):
                out["prefill"] = export(module, (torch.zeros(1, S - 1, **long), torch.arange(S - 1), *extra),
                                        dynamic_shapes=({1: T}, {0: T}, *(None,) * len(extra)), strict=True)
    return out


def export_sampling(model: Transformer, dense_prefill: bool = False) -> dict:
    """The check program's sampler methods: the fused program's prefill and decode, and the head alone."""
    from torch.export import export

    out = {f"sample_{name}": ep for name, ep in export_methods(model, True, dense_prefill).items()}
    logits = torch.zeros(1, model.args.vocab_size, dtype=model.lm_head.weight.dtype)
    with torch.no_grad(), parameters_not_cloned():
        out["sample_logits"] = export(Sampler(), (logits, *example_args()), strict=True)
    return out


def input_taps(args) -> list[list]:
    """[layer, kind, tap kind] of every block fed its own input inside the layer (the norm before
    it, models.args.block_input_path): the tap kind names that input in the tap table, one per
    module (the router and the experts share theirs)."""
    return [[k[0], k[1], "input:" + path.rsplit(".", 1)[1]] for k in block_keys(args)
            if (path := block_input_path(args, *k))]


def add_taps(ep, args) -> list[list]:
    """Make every block's output an extra output of `ep` (in place), and each block's own input
    inside its layer (input_taps). Returns [layer, kind, output index] per tap; routers have two
    taps (weights and indices, told apart by dtype)."""
    from executorch.devtools.intermediate_output_tap import FULL_TENSOR, select_by_module_path, tap_intermediate_outputs_

    hit = {}

    def rule(key, path):
        inside = select_by_module_path(path)  # the nodes whose value leaves the block

        def select(n):  # not in-place state writes or asserts (nothing uses their value)
            if n.users and str(n.target) != "aten._assert_tensor_metadata.default" and inside(n):
                hit[n.name] = key
                return True
            return False

        return select, FULL_TENSOR

    inputs = {(layer, tap): block_input_path(args, layer, kind) for layer, kind, tap in input_taps(args)}
    # one rule per block: with several patterns in one rule a parent would hide its children
    _, specs = tap_intermediate_outputs_(ep, [rule(k, p) for k, p in [*block_paths(args), *inputs.items()]])
    return [[*hit[s.node_name], s.output_index] for s in specs]


class MoeProbe(nn.Module):
    """One layer's MoE block alone: x [N, H] -> (moe [1, N, H], router weights [N, k], indices [N, k]).
    Its weights keep the model's own names (`layers.{i}.mlp.*`): the external weights file
    holds a weight once per name, so the probe methods share prefill's copy, and two layers'
    probes never share one name (a name collision would serve one layer another's experts)."""

    def __init__(self, moe: nn.Module, layer: int):
        super().__init__()
        self.key = str(layer)
        self.layers = nn.ModuleDict({self.key: nn.ModuleDict({"mlp": moe})})

    def forward(self, x):
        moe = self.layers[self.key]["mlp"]
        w, idx = moe.gate(x)
        return moe(x[None]), w, idx


PROBE_GATHER_BYTES = 256 * 2**20


def probe_rows(args) -> int:
    """Most probe inputs per call of a probe method: one per expert, as long as the traced MoE's
    per-row copy of its k experts' weights (the gather) stays under PROBE_GATHER_BYTES in fp32:
    a probe method's planned memory is that copy for its largest input (OLMoE's width: 64 rows
    would plan 13 GiB; one row plans 200 MB). Tiny models: one row per expert."""
    per_row = args.num_experts_per_tok * 3 * args.moe_intermediate_size * args.hidden_size * 4
    return max(min(max(args.num_experts, 2), PROBE_GATHER_BYTES // max(per_row, 1)), 1)


def export_probes(model: Transformer) -> dict:
    """One probe method per layer (traced from that layer's own module: a seeded fault stays)."""
    from torch.export import Dim, export

    a = model.args
    rows = probe_rows(a)
    dynamic = ({0: Dim("N", min=1, max=rows)},) if rows > 1 else None  # one row: a static shape
    x = torch.zeros(rows, a.hidden_size, dtype=model.embed_tokens.weight.dtype)
    with torch.no_grad(), parameters_not_cloned():
        return {f"probe_{i}": export(MoeProbe(model.layers[i].mlp, i), (x,), dynamic_shapes=dynamic, strict=True)
                for i in sparse_layers(a)}


def sparse_layers(args) -> list[int]:
    """The layers with a router and experts (the others' MLP is dense: no probes)."""
    return [i for i in range(args.num_hidden_layers) if mlp_type(args, i) == SPARSE]


def metadata(model: Transformer, sample: bool = False) -> dict:
    """Constant methods, as the production LLM exports carry them for their runners."""
    a = model.args
    return {"get_max_seq_len": a.max_seq_len, "get_vocab_size": a.vocab_size, "get_n_layers": a.num_hidden_layers,
            "use_kv_cache": True, "enable_dynamic_shape": True, "use_sampling": sample}


def state_buffer_names(model: Transformer, sample: bool = False) -> list[str]:
    """The per-sequence state (mutable buffers) of the exported methods, as the CUDA export
    records it (the fused sampler's methods hold the model as `model`)."""
    prefix = "model." if sample else ""
    return sorted(prefix + n for n, _ in model.named_buffers() if n.rsplit(".", 1)[-1] in STATE_BUFFERS)


def target_name(t) -> str:
    """A call_function target's stable name: `aten.mm.default`, `executorch_prim.mul.Scalar`,
    `executorch.exir.memory.alloc`, `operator.getitem` (never a repr with a memory address)."""
    if isinstance(t, torch._ops.OpOverload):
        return str(t)  # with its overload, `.default` included
    if isinstance(t, (types.FunctionType, types.BuiltinFunctionType)):
        return f"{t.__module__.lstrip('_')}.{t.__qualname__}"
    name = getattr(t, "name", None)
    return name().replace("::", ".") if callable(name) else str(t)  # EdgeOpOverload, HigherOrderOperator


def op_histogram(ep) -> dict:
    """call_function targets of an exported program and their counts."""
    counts = {}
    for n in ep.graph.nodes:
        if n.op == "call_function":
            counts[target_name(n.target)] = counts.get(target_name(n.target), 0) + 1
    return dict(sorted(counts.items()))


def source_digest(*files: str) -> str:
    """sha256 of the code that determines an artifact (the production model and the exporter)."""
    h = hashlib.sha256()
    for f in files:
        h.update((ROOT / f).read_bytes())
    return h.hexdigest()[:16]


def cache_parts(backend: str, model, spec, program: str, transform_id, options: dict, exporter: str) -> dict:
    """Everything that determines a .pte: checkpoint, resolved args, options, fault, code, tools."""
    from oracle.artifacts import versions

    return {"backend": backend, "program": program, "family": spec.family, "precision": spec.precision,
            "checkpoint": model.checkpoint_sha256, "args": repr(model.args), "max_seq_len": model.args.max_seq_len,
            "options": options, "transform_id": transform_id,
            # the production model's code (its routing too: models/routing.py); a fault's own code is in its
            # transform_id (models/faults.Fault.id: a change to one fault rebuilds that fault's programs only)
            # (a program rebound from another checkpoint's is written by exporters/executorch_weights.py)
            "source": source_digest("models/layers.py", "models/routing.py", "models/sampling.py", "exporters/executorch.py",
                                    "exporters/executorch_weights.py", exporter),
            "versions": versions("torch", "executorch", "torchao")}


def qlinear_options(spec) -> dict:
    """`--qlinear` / `--qlinear-group-size` from the spec (their values were checked against the
    backend's option schema before any work)."""
    q = spec.options.get("qlinear")
    if not q:
        return {}
    return {"qlinear": q, "qlinear_group_size": int(spec.options.get("qlinear_group_size") or 32)}


def export_options(qlinear: tuple, sample: bool) -> tuple:
    """The options of an ExecuTorch exporter that apply to `oracle export` only."""
    opts = (Option("qlinear", str, qlinear, None, "weight quantization of the nn.Linear layers",
                   "--qlinear", ("export",)),
            Option("qlinear_group_size", int, (), 32, "quantization group size", "--qlinear-group-size",
                   ("export",)))
    if sample:
        opts += (Option("sample", bool, (), False, "fuse the on-device sampler into prefill/decode",
                        "--sample", ("export",)),)
    return opts


def sampling_options(spec) -> dict:
    """What of the on-device sampler shapes a program (part of the cache key): `sample` (oracle
    export --sample: the production methods return a sampled token) and `sampling` (oracle
    check --sampling: the check program gets the sample_* methods). Temperature, top_p and
    the seed are runtime inputs."""
    return {k: True for k in ("sample", "sampling") if spec.options.get(k)}


def quantize_linears(model: nn.Module, q: dict, packing_format=None) -> None:
    """torchao source-transform quantization of the nn.Linear layers, as the ExecuTorch LLM
    exports do. The stacked expert weights are not nn.Linear: they stay unquantized."""
    from executorch.extension.llm.export.quantize import quantize_model_

    quantize_model_(model, qlinear_config=q["qlinear"], qlinear_group_size=q["qlinear_group_size"],
                    qlinear_packing_format=packing_format, skip_incompatible_shapes=True)


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
    from oracle.artifacts import versions

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
    from models import cache
    from models.checkpoint import temp_dir

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


# --- memory of the build: who holds the weights, and for how long ---------------------------

@contextlib.contextmanager
def parameters_not_cloned():
    """Strict torch.export (dynamo) keeps a "real value" of every tensor it traces through, a
    clone (torch._dynamo.variables.builder._clone_input, for export's real_value_cache): a
    transient full copy of the weights, 1.5x of them at its peak with the clone's own temporary.
    A parameter is never written by the model (the state is in buffers, which stay cloned), so
    here dynamo keeps the parameter itself. The exported program is the same."""
    from torch._dynamo.variables import builder

    clone = builder._clone_input

    def clone_input(value, fake_mode):
        return value if isinstance(value, nn.Parameter) else clone(value, fake_mode)

    builder._clone_input = clone_input
    try:
        yield
    finally:
        builder._clone_input = clone


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


class ExecutorchCandidate(Candidate):
    """A .pte with prefill/decode (+ taps) and probe methods, run by executorch.runtime.
    Rows of the reference's sequence are in-situ; router/moe expert probes are isolated."""

    block_mode = SEQUENCE_MODE  # the default; per kind (read by the harness) below
    block_modes = {"attention": SEQUENCE_MODE, "layer": SEQUENCE_MODE, "final_norm": SEQUENCE_MODE,
                   "logits": SEQUENCE_MODE, "router": f"{SEQUENCE_MODE} (sequence) + {PROBE_MODE} (expert probes)",
                   "moe": f"{SEQUENCE_MODE} (sequence) + {PROBE_MODE} (expert probes)"}

    def __init__(self, pte: Path, info: dict, dtype=torch.float32, probe_rows: int = 2, data_path: Path | None = None):
        data_path = data_path or weights_file(pte)
        self.program = runtime().load_program(str(pte), data_path=str(data_path) if data_path else None)
        self.taps, self.info = read_taps(pte), info
        # (layer, kind) -> the tap of the block's own input (a program tapped before the inputs were: none)
        self.inputs = {(layer, kind): tap for layer, kind, tap in self.taps.pop("inputs", [])}
        self.ops = Path(pte).with_name(OPS_FILE)
        self.dtype, self.probe_rows = dtype, probe_rows  # probe inputs: the model's dtype, at most rows per call
        # every method up front: loading a method initialises the shared state buffers, so a
        # method loaded after a prefill would wipe that prefill's KV cache and recurrent state
        self.methods = {n: self.program.load_method(n) for n in sorted(self.program.method_names)
                        if n in ("prefill", "decode") or n.startswith(("probe_", "sample_"))}
        self._seq = (None, None)

    def structures(self) -> dict:
        """The structural golden: the op histogram of the lowered prefill and decode."""
        return {"ops": self.ops.read_text()} if self.ops.is_file() else {}

    def method(self, name: str):
        return self.methods[name]

    def run(self, tokens, pos) -> tuple[str, list]:
        name = "prefill" if len(tokens) > 1 else "decode"
        outs = self.method(name).execute([torch.tensor([list(tokens)]), torch.as_tensor(pos, dtype=torch.long)])
        return name, [o.clone() for o in outs]  # outputs may alias the method's memory: the next call overwrites them

    def prefill(self, tokens):
        name, outs = self.run(tokens, torch.arange(len(tokens)))
        self.routes = self._routes(name, outs)
        return outs[0][0]

    def decode(self, token, pos):
        name, outs = self.run([token], [pos])
        self.routes = self._routes(name, outs)
        return outs[0][0, -1]

    routes = None
    no_routes = "a program without the routers' taps (a production .pte) does not report its routers' choices"

    def _routes(self, name: str, outs: list) -> dict | None:
        """{layer: indices [T, k] (or (indices, weights))} from the routers' runtime taps of this call: the
        experts the program chose (routing replay); None for a program without them."""
        found = {}
        for layer, kind, i in (self.taps or {}).get(name, []):
            if kind == "router":
                found.setdefault(layer, []).append(outs[i])
        if not found:
            return None
        routes = {}
        for layer, ts in found.items():
            idx = next((t for t in ts if not t.is_floating_point()), None)
            if idx is None:
                return None
            w = next((t for t in ts if t.is_floating_point()), None)
            idx = idx.reshape(-1, idx.shape[-1]).numpy().astype(np.int64)
            routes[layer] = (idx, w.float().reshape(idx.shape).numpy()) if w is not None and w.numel() == idx.size else idx
        return routes

    def last_routes(self):
        return self.routes

    def sequence_taps(self, calls) -> list[dict]:
        """Per call of the sequence: (layer, kind) -> tapped outputs, from one run of the program."""
        key = tuple((tuple(c.tokens), tuple(c.pos.tolist())) for c in calls)
        if self._seq[0] != key:
            if calls and int(calls[0].pos[0]) != 0:
                raise ValueError("the block calls must start a sequence at position 0")
            rows = []
            for c in calls:
                name, outs = self.run(c.tokens, c.pos)
                row = {}
                for layer, kind, i in self.taps[name]:
                    row.setdefault((layer, kind), []).append(outs[i])
                rows.append(row)
            self._seq = (key, rows)
        return self._seq[1]

    def probe(self, layer: int, xs: list) -> list[tuple]:
        """(moe, weights, indices) per input ([..., H] each), from the layer's probe method."""
        xs = [torch.as_tensor(x).reshape(-1, x.shape[-1]) for x in xs]
        x = torch.cat(xs).to(self.dtype)
        runs = [[o.clone() for o in self.method(f"probe_{layer}").execute([x[i:i + self.probe_rows]])]
                for i in range(0, x.shape[0], self.probe_rows)]  # clone: the next call reuses the memory
        moe, w, idx = (torch.cat([r[j] for r in runs], dim=d) for j, d in ((0, 1), (1, 0), (2, 0)))
        out, n = [], 0
        for t in (x.shape[0] for x in xs):
            out.append((moe[:, n:n + t], w[n:n + t], idx[n:n + t]))
            n += t
        return out

    def block_input(self, layer, kind, calls):
        """The block's own input inside the layer on the sequence's calls (its norm's output, tapped)."""
        tap = self.inputs.get((layer, kind))
        seq = [c for c in calls if not c.probe]
        taps = self.sequence_taps(seq) if tap and seq else []
        if not taps or any((layer, tap) not in t for t in taps):
            return None
        return [t[layer, tap][0] for t in taps]

    points_program = None  # (layer, kind, lengths) -> (points.pte, its points.json): ExecutorchBackend.points_program

    def run_block_points(self, layer, kind, calls):
        """The drill: the block alone, isolated on the reference's inputs, in a program lowered like
        the production one (ExecutorchBackend.points_program) with its points as extra outputs."""
        if self.points_program is None:
            return None
        from oracle.points import from_outputs

        xs = [c.x.reshape(1, -1, c.x.shape[-1]).to(self.dtype) for c in calls]
        pte, meta = self.points_program(layer, kind, sorted({x.shape[1] for x in xs}))
        program = runtime().load_program(str(pte), data_path=str(weights_file(pte) or "") or None)
        state = [torch.zeros(shape, dtype=getattr(torch, dtype)) for shape, dtype in meta["state"]]
        methods, fired, values = {}, [], []
        for x, c in zip(xs, calls):
            T = x.shape[1]
            if T not in methods:
                methods[T] = program.load_method(f"points_t{T}")
            pos = c.pos if c.pos.numel() == T else torch.arange(T)
            outs = [o.clone() for o in methods[T].execute([x, pos, *state])]
            names, end = meta["fired"][str(T)], len(outs) - len(state)
            state = outs[end:]
            fired += names
            values += [o.float().numpy() for o in outs[end - len(names):end]]
        return from_outputs(fired, meta["registered"], values, meta.get("build_s"))

    def run_block(self, layer, kind, calls):
        if not self.taps:
            return None  # a production program (no taps, no probes): its blocks are not isolated
        seq = [c for c in calls if not c.probe]
        taps = self.sequence_taps(seq)
        if any((layer, kind) not in t for t in taps):
            return None  # no node of the program is this block's output (not tapped)
        if kind == "router" and not all(any(o.is_floating_point() for o in t[layer, kind]) for t in taps):
            # no node computes the routing weights (nothing downstream uses them): the router of the
            # layer's probe method on the program's own input to it, its weights as outputs
            xs = self.block_input(layer, kind, seq)
            if xs is None:
                raise ValueError("the program computes no routing weights (nothing uses them) and its "
                                 "router's input is not tapped: no router output to compare")
            seq_outs = iter([(w, idx) for _, w, idx in self.probe(layer, xs)])
        else:
            seq_outs = iter([block_output(kind, t[layer, kind]) for t in taps])
        probes = [c for c in calls if c.probe]
        if probes and kind not in ("router", "moe"):
            return None
        probe_outs = iter(self.probe(layer, [c.x for c in probes]) if probes else [])
        out = []
        for c in calls:
            if not c.probe:
                out.append(next(seq_outs))
            else:
                moe, w, idx = next(probe_outs)
                out.append((w, idx) if kind == "router" else moe)
        return out


class ExecutorchSamplingCandidate(ExecutorchCandidate):
    """A check program with the sampler's methods (oracle check --sampling). The harness is
    the runner: arguments are validated here, on the host (a program cannot refuse its inputs)."""

    def sample_prefill(self, tokens, temperature, top_p, seed) -> int:
        args = [torch.tensor([list(tokens)]), torch.arange(len(tokens)), *runtime_args(temperature, top_p, seed)]
        return int(self.method("sample_prefill").execute(args)[0][0])

    def sample_decode(self, token, pos, temperature, top_p, seed) -> int:
        args = [torch.tensor([[token]]), torch.tensor([pos]), *runtime_args(temperature, top_p, seed)]
        return int(self.method("sample_decode").execute(args)[0][0])

    def sample_logits(self, logits, temperature, top_p, seed) -> int:
        lg = torch.as_tensor(logits).reshape(1, -1).to(self.dtype)
        return int(self.method("sample_logits").execute([lg, *runtime_args(temperature, top_p, seed)])[0][0])


def block_output(kind: str, tensors: list):
    if kind == "router":
        w = next(t for t in tensors if t.is_floating_point())
        idx = next(t for t in tensors if not t.is_floating_point())
        return w, idx
    return tensors[0]


class ExecutorchBackend(Backend):
    """`transform(model)` modifies the built production model before export (how faults are
    injected); `transform_id` names it in the artifact cache key.

    The CUDA and Metal backends are this class with another lowering, dtype and quantization."""

    kind = "executorch"  # cache namespace and name of the backend without a fault suffix
    source = "exporters/executorch.py"

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
    # model.ptd: exporters/executorch_weights.py); not the CUDA and Metal lowerings' weights files
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
        """This backend with a seeded fault (models/faults.py) injected before export."""
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
        return lower_cpu(methods, model, xnnpack=opts["partitioner"] == "xnnpack", sample=bool(opts.get("sample")))

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
        from oracle.artifacts import cached_artifact
        from models.cache import estimate

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
        from exporters.eager import PointsCall, PointsProgram
        from models.layers import block_fn
        from oracle.artifacts import cached_artifact

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
                 "points_code": source_digest("exporters/eager.py", "oracle/points.py")}
        art = cached_artifact(f"{self.kind}-points", parts, "points.pte", build)
        path = Path(art.path)
        return path, {**json.loads(path.with_name("points.json").read_text()), "build_s": art.build_s}

    artifact_suffix = ".pte"  # --pte: a program built elsewhere

    def shipped_tensors(self, original, path, progress):
        """The weight check of a --pte's weights: its .ptd against the production model's parameters of the
        original (exporters/production_weights.py); nothing where the program keeps its weights inside."""
        from exporters.production_weights import production_tensor_sources, ptd_tensors

        ptd = weights_file(path)
        if ptd is None:
            return iter(())
        stored = ptd_tensors(ptd)
        return production_tensor_sources(original, stored, stored.pop("__content__", {}))

    def check_given(self, model, spec) -> None:
        """--pte FILE, before any work: an ExecuTorch program (and weights file) whole, that its
        runtime loads (in a child process: exporters/given.py), with the production methods
        prefill and decode, and built for this check's model (its constant methods: vocabulary,
        depth, positions). InputError naming the file otherwise."""
        from exporters import given
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

        from oracle.artifacts import sha256_file
        from oracle.backend import InputError

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
