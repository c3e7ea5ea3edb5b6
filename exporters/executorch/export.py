"""The torch side of an ExecuTorch program: the production model's methods exported strictly with
their state buffers (prefill, decode; the fused sampler), the runtime taps of every block, the MoE
probe methods, torchao's quantization of the linears, and the options that shape them."""

from __future__ import annotations

import contextlib
import types
import warnings

import torch
from torch import nn

from models.args import SPARSE, STATE_BUFFERS, block_input_path, block_keys, block_path, mlp_type
from models.layers.experts import traced_experts
from models.layers.sampling import SampledModel, Sampler, example_args
from models.layers.transformer import Transformer
from oracle.backend import Option


def block_paths(args) -> list[tuple[tuple, str]]:
    """((layer, kind), module path) of every block the harness checks, in the harness's order."""
    return [(key, block_path(args, *key)) for key in block_keys(args)]


def export_methods(model: Transformer, sample: bool = False, dense_prefill: bool = False) -> dict:
    """torch.export (strict: the state buffers are updated in place) of prefill and decode.
    The prefill example has the largest length, as the CUDA/AOTI exports need. With `sample`
    the sampler is fused (SampledModel: the token instead of the logits). With `dense_prefill`
    prefill runs every expert on every token instead of gathering each token's experts'
    weights (models.layers.experts.Experts: the gather plans a weight copy per token of the longest
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
    from executorch.devtools.intermediate_output_tap import (FULL_TENSOR, select_by_module_path,
                                                             tap_intermediate_outputs_)

    hit = {}

    def rule(key, path):
        inside = select_by_module_path(path)  # the nodes whose value leaves the block

        def select(n):  # not in-place state writes or asserts (nothing uses their value: but a later layer may read
            # a state write's result, GLM-5's shared DSA layer the full layer's index_selection: in-place ops are skipped)
            target = str(n.target)
            in_place = target.startswith("aten.") and target.split(".")[1].endswith("_")
            if n.users and target != "aten._assert_tensor_metadata.default" and not in_place and inside(n):
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
    probes never share one name (a name collision would serve one layer another's experts).
    The router runs once, inside the block (its outputs recorded by a hook while exported: recording),
    not again beside it: two calls of ZAYA's router MLP read its out_proj weight twice, and XNNPACK's
    partitioner (ExecuTorch 1.5.1) put both linears in one partition around the portable topk between
    them ("Invalid partition, found dependency cycles"). A block that calls no router: the router on x."""

    def __init__(self, moe: nn.Module, layer: int):
        super().__init__()
        self.key = str(layer)
        self.layers = nn.ModuleDict({self.key: nn.ModuleDict({"mlp": moe})})
        self.routed = []  # the router's (weights, indices) of this call (while recording)

    def forward(self, x):
        moe = self.layers[self.key]["mlp"]
        self.routed.clear()
        y = moe(x[None])
        w, idx = self.routed[0] if self.routed else moe.gate(x)
        return y, w, idx

    @contextlib.contextmanager
    def recording(self):
        hook = self.layers[self.key]["mlp"].gate.register_forward_hook(lambda m, args, out: self.routed.append(out))
        try:
            yield self
        finally:
            hook.remove()
            self.routed.clear()


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
    out = {}
    with torch.no_grad(), parameters_not_cloned():
        for i in sparse_layers(a):
            with MoeProbe(model.layers[i].mlp, i).recording() as probe, warnings.catch_warnings():
                warnings.filterwarnings("ignore", "While compiling, we found certain side effects")  # (routed)
                out[f"probe_{i}"] = export(probe, (x,), dynamic_shapes=dynamic, strict=True)
    return out


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
