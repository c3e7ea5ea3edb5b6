"""An `iree-llvm-cpu` program as a candidate: model.vmfb's prefill and decode in one runtime context
(a fresh one per sequence), its block programs run for every layer with the weights mapped from
model.irpa, the experts its routers chose."""

from __future__ import annotations

import gc
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exporters.iree.program import PARAM_SCOPE, PARAMS_INFO
from oracle.backend import Candidate
from oracle.cache.artifacts import sha256_file


# ------------------------------------------------------------------ the archive
def checked_parameters(irpa: Path) -> dict | None:
    """PARAMS_INFO of the archive `irpa` (the record beside it) if the archive is there and is the one
    that was written with it (same size, and same sha256 unless its mtime is unchanged), else None."""
    meta = irpa.with_name(PARAMS_INFO)
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


# ------------------------------------------------------------------ runtime
def _host(result) -> list[np.ndarray]:
    """Results of one call as numpy copies (a `to_host()` view can be overwritten by a later call)."""
    results = result if isinstance(result, (list, tuple)) else [result]
    return [r.to_host().copy() for r in results]


class IreeCandidate(Candidate):
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
        # (parse_plan) name their parameters: read-only numpy views of the archive mapped above,
        # the pages prefill/decode use too (no copy; the runtime copies an input per call)
        entries = dict(self.index.items()) if params is not None else {}
        self.which = {}
        for key, (p, inputs, state) in blocks.items():
            weights = [rt.parameter_index_entry_as_numpy_ndarray(entries[x]) if isinstance(x, str) else x
                       for x in inputs]
            self.which[key] = (p, weights, [np.zeros(s, d) for s, d in state])

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

    no_batch = "model.vmfb is compiled for one sequence (batch 1)"
    no_chunks = "model.vmfb's prefill is compiled for the prompt's length: a chunk after the first token runs through decode"

    def prefill(self, tokens):
        if len(tokens) not in (self.prompt_len, 1):
            raise ValueError(f"model.vmfb's prefill is compiled for {self.prompt_len} tokens, got {len(tokens)}")
        self.seq = self._blocks = None  # released before the next is made (the peak: one context);
        gc.collect()  # a SystemContext and its BoundModules refer to each other: freed by the collector
        self.seq = self.context()  # a new sequence: fresh state
        if len(tokens) == 1 and self.prompt_len != 1:  # a one-token sequence: the decode program on fresh state
            return self.decode(tokens[0], 0)[None]
        out = _host(self.seq.prefill(np.array([tokens], np.int64), np.arange(len(tokens), dtype=np.int64)))
        self.routes = self._routes(out[1:])
        return out[0][0]

    def decode(self, token, pos):
        if self.seq is None:
            raise RuntimeError("decode() before prefill(): no sequence")
        out = _host(self.seq.decode(np.array([[token]], np.int64), np.array([pos], np.int64)))
        self.routes = self._routes(out[1:])
        return out[0][0, -1]

    routes = None
    sparse_layers: tuple = ()  # the layers whose choices prefill/decode return after the logits, in order
    no_routes = "a program whose prefill/decode return only the logits (built before routing replay) does not report its routers' choices"

    def _routes(self, outs: list) -> dict | None:
        """{layer: indices [T, k]}: what the program's routers chose, the outputs after the logits."""
        if not self.sparse_layers or len(outs) != len(self.sparse_layers):
            return None
        return {layer: o.reshape(-1, o.shape[-1]).astype(np.int64) for layer, o in zip(self.sparse_layers, outs)}

    def last_routes(self):
        return self.routes

    def structures(self) -> dict:
        """The structural golden: the op histogram of the MLIR that went into iree-compile."""
        return {"mlir_ops": self.ops} if self.ops else {}

    # (layer, kind) -> why its block program cannot be run isolated (its row n/a with that reason)
    not_isolated: dict = {}

    def run_block(self, layer, kind, calls):
        if (layer, kind) in self.not_isolated:
            return None
        p, weights, state = self.which[layer, kind]
        outs = []
        for c in calls:
            entry = f"block_{p.name}_t{len(c.pos_array)}"  # (a layer on N streams: x holds T*N rows)
            if entry not in self.blocks.vm_module.function_names:
                raise ValueError(f"model.vmfb has no {entry} (compiled for T = {self.prompt_len} and 1)")
            x, pos = np.ascontiguousarray(c.x_array, np.float32), c.pos_array.astype(np.int64)
            res = self.blocks[entry](*weights, *state, x, pos)
            res = res if isinstance(res, (list, tuple)) else [res]
            n_out = len(res) - len(p.state)
            state = res[n_out:]  # device arrays, passed straight back
            out = _host(res[:n_out])
            outs.append(tuple(out) if kind == "router" else out[0])
        return outs


    points_program = None  # (program name, lengths) -> (points.vmfb, its points.json): IreeBackend.points_program

    def run_block_points(self, layer, kind, calls):
        """The block's points program (compiled for the drill, cached), on the same inputs as run_block."""
        if self.points_program is None:
            return None
        from oracle.drill.points import from_outputs

        p, weights, state = self.which[layer, kind]
        vmfb, meta = self.points_program(p.name, sorted({len(c.pos_array) for c in calls}))
        module = self.rt.SystemContext(vm_modules=[self.rt.VmModule.copy_buffer(self.config.vm_instance, vmfb)],
                                       config=self.config).modules.module
        fired, values = [], []
        for c in calls:
            T = len(c.pos_array)
            x, pos = np.ascontiguousarray(c.x_array, np.float32), c.pos_array.astype(np.int64)
            res = module[f"points_{p.name}_t{T}"](*weights, *state, x, pos)
            res = res if isinstance(res, (list, tuple)) else [res]
            names = meta["fired"][str(T)]
            end = len(res) - len(p.state)
            state = res[end:]
            fired += names
            values += _host(res[end - len(names):end])
        return from_outputs(fired, meta["registered"], values, meta.get("build_s"))


@dataclass(frozen=True)
class ProgramInfo:
    """One block program as running it needs it (iree_export.BlockProgram without its traced
    module): entry points f"block_{name}_t{T}", inputs (*weights, *state, x, pos), results
    (*outputs, *new state)."""

    name: str
    kind: str
    weights: tuple[str, ...]
    state: tuple[str, ...]
    fingerprint: str


def parse_plan(plan: dict) -> tuple[dict, dict]:
    """(program name -> ProgramInfo, (layer, kind) -> (ProgramInfo, weight inputs: a parameter's
    name in model.irpa or a buffer's values as numpy, state shapes)) of iree_export.plan_of's data."""
    programs = {p["name"]: ProgramInfo(p["name"], p["kind"], tuple(p["weights"]), tuple(p["state"]), p["fingerprint"])
                for p in plan["programs"]}
    which = {}
    for b in plan["blocks"]:
        inputs = [x if isinstance(x, str) else np.array(x["values"], dtype=x["dtype"]).reshape(x["shape"])
                  for x in b["inputs"]]
        dtypes = b.get("state_dtypes") or ["float32"] * len(b["state"])  # (float state: a plan of before)
        which[b["layer"], b["kind"]] = (programs[b["program"]], inputs,
                                        [(tuple(s), "float32" if d in ("float32", "bfloat16") else d)
                                         for s, d in zip(b["state"], dtypes)])
    return programs, which
