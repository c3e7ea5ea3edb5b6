"""An interpreter for ExecuTorch programs lowered to the MLX delegate, on the `mlx` Python
package (the CPU on Linux): what runs an `executorch-mlx` .pte where no ExecuTorch runtime
with the MLX delegate exists (the pip wheel's runtime has none).

It follows the delegate's C++ runtime (backends/mlx/runtime/MLXBackend.cpp, MLXExecutor.h,
MLXInterpreter.h): the graph is read with the delegate's own readers (`pte_inspector`, the
flatc bindings the setup regenerates); constants come from the program's named data,
mutable buffers (KV cache, conv and recurrent state) start at zero and persist across calls
of a method, tensors and values live per call; chains run in order, `IfNode` picks a chain
by an int value, `ScanNode` runs its body chain per step of the scan axis. Each node type
maps to the same mlx op the C++ runtime calls (`OPS`, one line each where possible).

CPU deviation: mlx 0.32.4's CPU `gather_mm` is float32-only, so a bf16 `GatherMmNode` runs on
float32 copies of its operands and rounds the result to bf16 (what fp32 accumulation of
bf16 inputs gives). `MetalKernelNode` needs Metal: it raises (lower with the scan fallback).
"""

from __future__ import annotations

import numpy as np

from exporters.executorch.mlx.setup import import_delegate

TENSOR_SLOT = 0
# ExecuTorch ScalarType -> mlx dtype name
DTYPES = {0: "uint8", 1: "int8", 2: "int16", 3: "int32", 4: "int64", 5: "float16", 6: "float32",
          11: "bool_", 15: "bfloat16", 28: "uint32"}


def mx():
    import mlx.core

    return mlx.core


def dtype_of(scalar_type: int):
    if scalar_type not in DTYPES:
        raise NotImplementedError(f"ExecuTorch ScalarType {scalar_type} has no mlx dtype here")
    return getattr(mx(), DTYPES[scalar_type])


# ---------------------------------------------------------------- conversions
def from_torch(t):
    """torch tensor -> mlx array (bf16 through its bits: numpy has no bf16)."""
    import torch

    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        return mx().array(t.view(torch.int16).numpy()).view(mx().bfloat16)
    return mx().array(t.numpy())


def to_torch(a):
    """mlx array -> torch tensor (bf16 stays bf16)."""
    import torch

    if a.dtype == mx().bfloat16:
        return torch.from_numpy(np.array(a.view(mx().int16))).view(torch.bfloat16)
    return torch.from_numpy(np.array(a))


# ---------------------------------------------------------------- the graph
class Graph:
    """One MLX delegate payload: its instruction chains (as pte_inspector parses them) and slots."""

    def __init__(self, payload: bytes):
        import_delegate()
        from executorch.backends.mlx import pte_inspector as pi

        header = pi.MLXHeader.from_bytes(payload)
        if not header.is_valid():
            raise ValueError(f"not an MLX delegate payload (magic {header.magic!r})")
        fb = pi._get_fb_graph(payload[pi.MLX_HEADER_LENGTH: header.data_segment_offset])
        self.chains = [[dict(i) for i in c["instructions"]] for c in pi._parse_instructions(fb)]
        for chain in self.chains:
            for ins in chain:
                if "error" in ins or "parse_error" in ins:
                    raise ValueError(f"cannot parse MLX instruction {ins}")
        self.main, self.init = fb.MainChainIdx(), fb.InitChainIdx()
        self.num_constants = fb.NumConstantTensors()
        self.inputs = [(s.Idx(), s.SlotType()) for s in map(fb.InputMap, range(fb.InputMapLength()))]
        self.outputs = [(s.Idx(), s.SlotType()) for s in map(fb.OutputMap, range(fb.OutputMapLength()))]
        self.mutable = [s.Idx() for s in map(fb.MutableBufferMap, range(fb.MutableBufferMapLength()))]
        self.names = {}  # constant tid -> named-data key
        for ns in map(fb.NamedSlots, range(fb.NamedSlotsLength())):
            if ns.Slot().SlotType() == TENSOR_SLOT:
                self.names[ns.Slot().Idx()] = ns.Name().decode()
        self.meta = {}  # tid -> (static shape or None, ScalarType)
        for tid in range(fb.TensorMetaLength()):
            tm = fb.TensorMeta(tid)
            if tm is not None:
                dims = [tm.Shape(j).Value() for j in range(tm.ShapeLength())]
                self.meta[tid] = (None if -1 in dims else dims, tm.ScalarType())

    def histogram(self) -> dict[str, int]:
        """Instruction count per node type over every chain (as `pte_inspector --mlx-instructions`)."""
        out = {}
        for chain in self.chains:
            for ins in chain:
                out[ins["op_name"]] = out.get(ins["op_name"], 0) + 1
        return out


# ---------------------------------------------------------------- execution state
class State:
    def __init__(self, tensors: dict):
        self.tensors, self.values = tensors, {}

    @staticmethod
    def _tid(ref) -> int:
        return int(ref.split()[1]) if isinstance(ref, str) else ref["tid"]

    def t(self, ref):
        return self.tensors[self._tid(ref)]

    def set(self, ref, arr) -> None:
        self.tensors[self._tid(ref)] = arr

    def i(self, ref) -> int:
        """IntOrVid (a literal clamped to int32 as the runtime does) or Vid."""
        if "vid" in ref:
            return self.values[ref["vid"]]
        return int(max(min(ref["literal"], 2**31 - 1), -(2**31)))

    def ints(self, refs) -> list[int]:
        return [self.i(r) for r in refs]

    def f(self, ref) -> float:
        return float(self.values[ref["vid"]] if "vid" in ref else ref["literal"])


def _binary(fn):
    return lambda n, s: s.set(n["out"], fn(mx())(s.t(n["a"]), s.t(n["b"])))


def _unary(fn):
    return lambda n, s: s.set(n["out"], fn(mx())(s.t(n["x"])))


def _gelu(n, s):
    """aten.gelu as the delegate emits it (`approximate` "none" or "tanh"): mlx's own gelu and gelu_approx (the
    runtime's source is not in the wheel; its node names torch's two forms, which these compute)."""
    import mlx.nn as nn

    s.set(n["out"], (nn.gelu_approx if n["approximate"] == "tanh" else nn.gelu)(s.t(n["x"])))


def _int_op(fn):
    return lambda n, s: s.values.__setitem__(n["out"]["vid"], fn(s.i(n["a"]), s.i(n["b"])))


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _slice(n, s):
    x = s.t(n["x"])
    idx = [slice(None)] * x.ndim
    idx[_norm_axis(s.i(n["axis"]), x.ndim)] = slice(s.i(n["start"]), s.i(n["stop"]), n["step"])
    s.set(n["out"], x[tuple(idx)])


def _slice_update(n, s):
    dst, upd = s.t(n["dst"]), s.t(n["update"])
    axis = _norm_axis(s.i(n["axis"]), dst.ndim)
    size = dst.shape[axis]
    start, stop = (max(0, min(v + size if v < 0 else v, size)) for v in (s.i(n["start"]), s.i(n["stop"])))
    if start == stop:
        s.set(n["out"], dst)
        return
    idx = [slice(None)] * dst.ndim
    idx[axis] = slice(start, stop, n["step"])
    out = mx().array(dst)
    out[tuple(idx)] = upd
    s.set(n["out"], out)


def _take(n, s):
    x, ref = s.t(n["x"]), n["index"]
    axis = _norm_axis(n["axis"], x.ndim)
    if "tid" in ref:
        s.set(n["out"], mx().take(x, s.t(ref), axis=axis))
    else:
        i = s.i(ref)
        s.set(n["out"], mx().take(x, i + x.shape[axis] if i < 0 else i, axis=axis))


def _split(n, s):
    x, sizes = s.t(n["x"]), s.ints(n["sizes"])
    axis = _norm_axis(n["axis"], x.ndim)
    if len(sizes) == 1:  # a chunk size
        cuts = list(range(sizes[0], x.shape[axis], sizes[0]))
    else:
        cuts = list(np.cumsum(sizes[:-1]))
    outs = mx().split(x, [int(c) for c in cuts], axis=axis)
    for ref, o in zip(n["outs"], outs, strict=True):
        s.set(ref, o)


def _squeeze(n, s):
    x = s.t(n["x"])
    dims = [d for d in n.get("dims", []) if x.shape[_norm_axis(d, x.ndim)] == 1]
    s.set(n["out"], mx().squeeze(x, dims) if dims else (x if n.get("dims") else mx().squeeze(x)))


def _reduce(fn):
    def op(n, s):
        x, axes = s.t(n["x"]), n.get("axes") or None
        s.set(n["out"], getattr(mx(), fn)(x, axis=axes, keepdims=bool(n.get("keepdims", False))))

    return op


def _addmm(n, s):
    a, b = s.t(n["mat1"]), s.t(n["mat2"])
    if "bias" in n:  # beta * bias + alpha * (a @ b)
        s.set(n["out"], mx().addmm(s.t(n["bias"]), a, b, alpha=n["alpha"], beta=n["beta"]))
    else:
        s.set(n["out"], a @ b)


def _rope(n, s):
    ref = n["offset"]
    offset = s.values[ref["vid"]] if "vid" in ref else s.t(ref)
    freqs = s.t(n["freqs"]) if "freqs" in n else None
    s.set(n["out"], mx().fast.rope(s.t(n["x"]), n["dims"], traditional=n["traditional"],
                                   base=None if freqs is not None else n["base"], scale=n["scale"],
                                   offset=offset, freqs=freqs))


def _sdpa(n, s):
    m, q = mx(), s.t(n["q"])
    mask = s.t(n["mask"]) if "mask" in n else None
    if mask is not None and mask.dtype != m.bool_ and mask.dtype != q.dtype:
        mask = mask.astype(q.dtype)
    mask = "causal" if n["causal"] else mask
    s.set(n["out"], m.fast.scaled_dot_product_attention(q, s.t(n["k"]), s.t(n["v"]), scale=n["scale"], mask=mask))


def _gather_mm(n, s):
    m = mx()
    a, b = s.t(n["a"]), s.t(n["b"])
    lhs = s.t(n["lhs_indices"]) if "lhs_indices" in n else None
    rhs = s.t(n["rhs_indices"]) if "rhs_indices" in n else None
    flag = n.get("sorted_indices_flag")
    srt = bool(n.get("sorted_indices")) or bool(flag is not None and s.i(flag))
    dtype = a.dtype if a.dtype == b.dtype else m.float32
    if dtype != m.float32:  # mlx's CPU gather_mm is float32-only (see the module docstring)
        a, b = a.astype(m.float32), b.astype(m.float32)
    y = m.gather_mm(a, b, lhs_indices=lhs, rhs_indices=rhs, sorted_indices=srt)
    s.set(n["out"], y.astype(dtype))


def _full(n, s):  # (the value as an array of the dtype, as the runtime's C++ full(shape, array(v, dtype)): mlx's
    # Python full(shape, 255.0, int64) gives float32, which fed an int64 n-gram hash (Qwen4-Exp's PLE) to bitwise_xor)
    dt = dtype_of(n["scalar_type"])
    s.set(n["out"], mx().full(s.ints(n["shape"]), mx().array(s.f(n["v"]), dtype=dt)))


def _full_like(n, s):
    x = s.t(n["x"])
    dt = dtype_of(n["scalar_type"]) if "scalar_type" in n else x.dtype
    s.set(n["out"], mx().full(x.shape, mx().array(s.f(n["v"]), dtype=dt)))


def _arange(n, s):
    dt = dtype_of(n["scalar_type"]) if "scalar_type" in n else mx().int32
    s.set(n["out"], mx().arange(s.i(n["start"]), s.i(n["stop"]), s.i(n["step"]), dtype=dt))


def _floor_divide(n, s):
    m, a, b = mx(), s.t(n["a"]), s.t(n["b"])
    if m.issubdtype(a.dtype, m.inexact):
        s.set(n["out"], m.floor_divide(a, b))
    else:  # torch's floor (towards -inf) on integers, as the runtime adjusts mlx's truncation
        s.set(n["out"], m.array(np.floor_divide(np.array(a), np.array(b))).astype(a.dtype))


def _pad(n, s):  # pad_width: (before, after) per axis, first axis first; "constant" or "edge"
    w = s.ints(n["pad_width"])
    pairs = [(w[i], w[i + 1]) for i in range(0, len(w), 2)]
    s.set(n["out"], mx().pad(s.t(n["x"]), pairs, mode=n.get("mode", "constant"),
                             constant_values=n.get("constant_value", 0.0)))


def _metal_kernel(n, s):
    raise NotImplementedError(f"MetalKernelNode {n.get('name')!r} needs Metal ([metal_kernel] No Metal back-end "
                              "on this host): lower the program with the scan fallback (use_custom_kernel=False)")


OPS = {
    "NoopNode": lambda n, s: None,
    "IdCopyNode": lambda n, s: s.set(n["out"], s.t(n["x"])),
    "ContiguousNode": lambda n, s: s.set(n["out"], mx().contiguous(s.t(n["x"]))),
    "AddmmNode": _addmm,
    "ItemIntNode": lambda n, s: s.values.__setitem__(n["out"]["vid"], int(s.t(n["x"]).item())),
    "SymSizeNode": lambda n, s: s.values.__setitem__(n["out"]["vid"], s.t(n["a"]).shape[n["dim"]]),
    "AddIntNode": _int_op(lambda a, b: a + b),
    "SubtractIntNode": _int_op(lambda a, b: a - b),
    "MultiplyIntNode": _int_op(lambda a, b: a * b),
    "FloorDivideIntNode": _int_op(lambda a, b: a // b),  # floors, as the runtime adjusts C++ division
    "ModIntNode": _int_op(lambda a, b: a % b),
    "ExpandDimsNode": lambda n, s: s.set(n["out"], mx().expand_dims(s.t(n["x"]), n["axis"])),
    "TakeAlongAxisNode": lambda n, s: s.set(n["out"], mx().take_along_axis(s.t(n["x"]), s.t(n["indices"]),
                                                                          axis=n["axis"])),
    "TakeNode": _take,
    "RMSNormNode": lambda n, s: s.set(n["out"], mx().fast.rms_norm(
        s.t(n["x"]), s.t(n["weight"]) if "weight" in n else None, n["eps"])),
    "LayerNormNode": lambda n, s: s.set(n["out"], mx().fast.layer_norm(
        s.t(n["x"]), s.t(n["weight"]) if "weight" in n else None, s.t(n["bias"]) if "bias" in n else None, n["eps"])),
    "RopeNode": _rope,
    "SdpaNode": _sdpa,
    "AddNode": _binary(lambda m: m.add),
    "SubtractNode": _binary(lambda m: m.subtract),
    "MultiplyNode": _binary(lambda m: m.multiply),
    "DivideNode": _binary(lambda m: m.divide),
    "MaximumNode": _binary(lambda m: m.maximum),
    "MinimumNode": _binary(lambda m: m.minimum),
    "LogAddExpNode": _binary(lambda m: m.logaddexp),
    "PowerNode": _binary(lambda m: m.power),
    "RemainderNode": _binary(lambda m: m.remainder),
    "FloorDivideNode": _floor_divide,
    "EqualNode": _binary(lambda m: m.equal),
    "NotEqualNode": _binary(lambda m: m.not_equal),
    "LessNode": _binary(lambda m: m.less),
    "LessEqualNode": _binary(lambda m: m.less_equal),
    "GreaterNode": _binary(lambda m: m.greater),
    "GreaterEqualNode": _binary(lambda m: m.greater_equal),
    "BitwiseAndNode": _binary(lambda m: m.bitwise_and),
    "BitwiseXorNode": _binary(lambda m: m.bitwise_xor),
    "LogicalAndNode": _binary(lambda m: m.logical_and),
    "LogicalOrNode": _binary(lambda m: m.logical_or),
    "LogicalNotNode": _unary(lambda m: m.logical_not),
    "WhereNode": lambda n, s: s.set(n["out"], mx().where(s.t(n["condition"]), s.t(n["x"]), s.t(n["y"]))),
    "SiluNode": lambda n, s: s.set(n["out"], (lambda x: x * mx().sigmoid(x))(s.t(n["x"]))),
    "GeluNode": _gelu,
    "SigmoidNode": _unary(lambda m: m.sigmoid),
    "TanhNode": _unary(lambda m: m.tanh),
    "ExpNode": _unary(lambda m: m.exp),
    "LogNode": _unary(lambda m: m.log),
    "Log1pNode": _unary(lambda m: m.log1p),
    "FloorNode": _unary(lambda m: m.floor),
    "CeilNode": _unary(lambda m: m.ceil),
    "NegNode": _unary(lambda m: m.negative),
    "RsqrtNode": _unary(lambda m: m.rsqrt),
    "SqrtNode": _unary(lambda m: m.sqrt),
    "SquareNode": _unary(lambda m: m.square),
    "AbsNode": _unary(lambda m: m.abs),
    "SinNode": _unary(lambda m: m.sin),
    "CosNode": _unary(lambda m: m.cos),
    "SoftmaxNode": lambda n, s: s.set(n["out"], mx().softmax(s.t(n["x"]), axis=n["axis"], precise=n["precise"])),
    "SumNode": _reduce("sum"),
    "MeanNode": _reduce("mean"),
    "MaxNode": _reduce("max"),
    "MinNode": _reduce("min"),
    "LogSumExpNode": _reduce("logsumexp"),
    "AnyNode": _reduce("any"),
    "AllNode": _reduce("all"),
    "SignNode": _unary(lambda m: m.sign),
    "ReciprocalNode": _unary(lambda m: m.reciprocal),
    "BitwiseOrNode": _binary(lambda m: m.bitwise_or),
    "ClipNode": lambda n, s: s.set(n["out"], mx().clip(s.t(n["x"]), s.t(n["a_min"]) if n.get("a_min") else None,
                                                       s.t(n["a_max"]) if n.get("a_max") else None)),
    "ReshapeNode": lambda n, s: s.set(n["out"], mx().reshape(s.t(n["x"]), s.ints(n["shape"]))),
    "TransposeNode": lambda n, s: s.set(n["out"], mx().transpose(s.t(n["x"]), n["perm"])),
    "SqueezeNode": _squeeze,
    "SplitNode": _split,
    "SliceNode": _slice,
    "SliceUpdateNode": _slice_update,
    "ConcatenateNode": lambda n, s: s.set(n["out"], mx().concatenate([s.t(r) for r in n["tensors"]], axis=n["axis"])),
    "StackNode": lambda n, s: s.set(n["out"], mx().stack([s.t(r) for r in n["tensors"]], axis=n["axis"])),
    "RepeatNode": lambda n, s: s.set(n["out"], mx().repeat(s.t(n["x"]), s.i(n["repeats"]), axis=n["axis"])),
    "TileNode": lambda n, s: s.set(n["out"], mx().tile(s.t(n["x"]), s.ints(n["reps"]))),
    "BroadcastToNode": lambda n, s: s.set(n["out"], mx().broadcast_to(s.t(n["x"]), [
        d if d != -1 else s.t(n["x"]).shape[i - (len(n["shape"]) - s.t(n["x"]).ndim)]
        for i, d in enumerate(s.ints(n["shape"]))])),
    "AsTypeNode": lambda n, s: s.set(n["out"], s.t(n["x"]).astype(dtype_of(n["scalar_type"]))),
    "FullNode": _full,
    "FullLikeNode": _full_like,
    "ARangeNode": _arange,
    "Conv1DNode": lambda n, s: s.set(n["out"], mx().conv1d(s.t(n["x"]), s.t(n["w"]), stride=n["stride"],
                                                           padding=n["padding"], dilation=n["dilation"],
                                                           groups=n["groups"])),
    "GatherMmNode": _gather_mm,
    "PadNode": _pad,
    "TrilNode": lambda n, s: s.set(n["out"], mx().tril(s.t(n["x"]), k=n.get("k", 0))),
    "TriuNode": lambda n, s: s.set(n["out"], mx().triu(s.t(n["x"]), k=n.get("k", 0))),
    "SortNode": lambda n, s: s.set(n["out"], mx().sort(s.t(n["x"]), axis=n["axis"])),
    "ArgsortNode": lambda n, s: s.set(n["out"], mx().argsort(s.t(n["x"]), axis=n["axis"])),
    "PartitionNode": lambda n, s: s.set(n["out"], mx().partition(s.t(n["x"]), s.i(n["kth"]), axis=n["axis"])),
    "ArgPartitionNode": lambda n, s: s.set(n["out"], mx().argpartition(s.t(n["x"]), s.i(n["kth"]), axis=n["axis"])),
    "ArgmaxNode": lambda n, s: s.set(n["out"], mx().argmax(s.t(n["x"]), axis=n["axis"],
                                                           keepdims=bool(n.get("keepdims", False)))),
    "CumsumNode": lambda n, s: s.set(n["out"], mx().cumsum(s.t(n["x"]), axis=n["axis"], reverse=n["reverse"],
                                                           inclusive=n["inclusive"])),
    "MetalKernelNode": _metal_kernel,
}


# ---------------------------------------------------------------- a delegate handle
class Delegate:
    """One MLX delegate instance: constants, and mutable buffers that persist across calls."""

    def __init__(self, graph: Graph, named_data: dict[str, bytes]):
        m = mx()
        self.graph = graph
        self.constants = {}
        for tid in range(graph.num_constants):
            shape, st = graph.meta[tid]
            if tid not in graph.names:
                raise ValueError(f"no name for constant tensor {tid}")
            raw = named_data[graph.names[tid]]
            if st == 15:  # bf16: through its bits
                arr = m.array(np.frombuffer(raw, dtype=np.int16).reshape(shape)).view(m.bfloat16)
            else:
                arr = m.array(np.frombuffer(raw, dtype=np.dtype(DTYPES[st].rstrip("_"))).reshape(shape))
            self.constants[tid] = arr
        self.reset()
        if graph.init >= 0:
            state = State({**self.constants, **self.buffers})
            self.run_chain(graph.init, state)
            self.constants = {t: state.tensors[t] for t in self.constants}

    def reset(self) -> None:
        """Mutable buffers back to zero (as the runtime initialises them at load)."""
        m = mx()
        self.buffers = {tid: m.zeros(self.graph.meta[tid][0], dtype_of(self.graph.meta[tid][1]))
                        for tid in self.graph.mutable}

    def execute(self, inputs: list) -> list:
        g = self.graph
        if len(inputs) != len(g.inputs):
            raise ValueError(f"the MLX graph takes {len(g.inputs)} inputs, got {len(inputs)}")
        state = State({**self.constants, **self.buffers})
        for (tid, kind), x in zip(g.inputs, inputs):
            if kind == TENSOR_SLOT:
                state.tensors[tid] = x
            else:
                state.values[tid] = int(x)
        self.run_chain(g.main, state)
        self.buffers = {tid: state.tensors[tid] for tid in g.mutable}
        outs = [state.tensors[tid] if kind == TENSOR_SLOT else state.values[tid] for tid, kind in g.outputs]
        mx().eval([o for o in outs if not isinstance(o, int)] + list(self.buffers.values()))
        return outs

    def run_chain(self, idx: int, state: State) -> None:
        for ins in self.graph.chains[idx]:
            name = ins["op_name"]
            if name == "IfNode":
                self.run_chain(ins["then_chain_idx"] if state.i(ins["cond"]) else ins["else_chain_idx"], state)
            elif name == "ScanNode":
                self.scan(ins, state)
            elif name in OPS:
                OPS[name](ins, state)
            else:
                raise NotImplementedError(f"MLX node {name} is not supported by the interpreter")

    def scan(self, n, state: State) -> None:
        m, axis = mx(), n["scan_axis"]
        T = state.t(n["originals"][0]).shape[axis]
        collected = [[] for _ in n["outputs"]]
        for t in range(T):
            for orig, sliced in zip(n["originals"], n["sliced"]):
                state.set(sliced, m.take(state.t(orig), t, axis=axis))
            self.run_chain(n["body_chain_idx"], state)
            for c, ref in zip(collected, n["outputs"]):
                c.append(state.t(ref))
        for c, ref in zip(collected, n["outputs"]):
            state.set(ref, m.stack(c, axis=axis))


# ---------------------------------------------------------------- a .pte
class NotDelegated(NotImplementedError):
    """A method has ops the MLX delegate did not take: the interpreter cannot run it."""


class Method:
    """One method of the program: its ExecuTorch instructions must be MLX delegate calls."""

    def __init__(self, plan, delegates: list[Delegate]):
        self.plan, self.delegates = plan, delegates
        self.name = plan.name
        outside = []
        for chain in plan.chains:
            for ins in chain.instructions:
                kind = type(ins.instr_args).__name__
                if kind == "KernelCall":  # an op the delegate did not take: name it
                    op = plan.operators[ins.instr_args.op_index]
                    outside.append(f"{op.name}{'.' + op.overload if op.overload else ''}")
                elif kind != "DelegateCall":
                    outside.append(kind)
        if outside:
            raise NotDelegated(
                f"method {plan.name}: the MLX delegate did not take {', '.join(sorted(set(outside)))} (left to "
                "ExecuTorch's portable kernels); the interpreter runs only fully delegated programs")

    def execute(self, inputs: list) -> list:
        """torch tensors in -> torch tensors out (the method's outputs, in order)."""
        values = dict(zip(self.plan.inputs, [from_torch(x) for x in inputs]))
        for chain in self.plan.chains:
            for ins in chain.instructions:
                call = ins.instr_args
                d = self.delegates[call.delegate_index]
                n_in = len(d.graph.inputs)
                outs = d.execute([values[a] for a in call.args[:n_in]])
                values.update(zip(call.args[n_in:], outs))
        return [self.output(values, o) for o in self.plan.outputs]

    def output(self, values: dict, o: int):
        val = self.plan.values[o].val
        if o not in values:  # a constant (the constant methods: get_max_seq_len, ...)
            return next(getattr(val, f) for f in ("int_val", "bool_val", "double_val") if hasattr(val, f))
        # in the dtype the program declares (the runtime casts its arrays likewise)
        return to_torch(values[o].astype(dtype_of(int(val.scalar_type))))

    def reset(self) -> None:
        for d in self.delegates:
            d.reset()


class Program:
    """A .pte whose methods are MLX delegate calls, run by this interpreter."""

    def __init__(self, pte: bytes):
        from executorch.exir._serialize._program import deserialize_pte_binary

        f = deserialize_pte_binary(pte)
        named = {}
        if f.named_data is not None:
            named = {k: bytes(f.named_data.buffers[e.buffer_index]) for k, e in f.named_data.pte_data.items()}
        data = f.program.backend_delegate_data
        self.methods = {}
        for plan in f.program.execution_plan:
            delegates = []
            for d in plan.delegates:
                if d.id != "MLXBackend":
                    raise NotImplementedError(f"method {plan.name}: delegate {d.id}, not MLXBackend")
                delegates.append(Delegate(Graph(bytes(data[d.processed.index].data)), named))
            self.methods[plan.name] = Method(plan, delegates)
        self.method_names = set(self.methods)

    @classmethod
    def load(cls, path) -> "Program":
        with open(path, "rb") as f:
            return cls(f.read())

    def load_method(self, name: str) -> Method:
        return self.methods[name]


def graphs(pte: bytes, method: str = "forward") -> list[Graph]:
    """The MLX graphs of one method of a .pte (no constants loaded: for counting nodes)."""
    from executorch.exir._serialize._program import deserialize_pte_binary

    f = deserialize_pte_binary(pte)
    data = f.program.backend_delegate_data
    plan = next(p for p in f.program.execution_plan if p.name == method)
    return [Graph(bytes(data[d.processed.index].data)) for d in plan.delegates if d.id == "MLXBackend"]
