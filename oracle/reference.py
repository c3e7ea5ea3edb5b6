"""The HF transformers fp32 reference: prompt prefill + greedy decode with HF's own cache,
with hooks recording every block's input and output on every call."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np



@dataclass
class BlockCall:
    """One call of a block: input x [1, T, H] (fp32) at positions pos [T]. The first call of
    a sequence starts at position 0 (fresh state); later calls continue that state.
    The reference holds numpy arrays (x_array, pos_array: readable without torch); `x` and
    `pos` are the same values as torch tensors, each a fresh copy (what torch candidates take)."""

    x_array: np.ndarray  # [1, T, H] float32
    pos_array: np.ndarray  # [T] int64
    tokens: list[int]  # the token ids the reference model consumed in this call
    probe: bool = False  # an expert-coverage probe (stateless blocks only), not from the sequence

    @property
    def x(self):
        import torch

        # a copy in torch's own (aligned) memory: BLAS can round differently on other alignments
        return torch.from_numpy(self.x_array).clone()

    @property
    def pos(self):
        import torch

        return torch.from_numpy(self.pos_array).clone()


@dataclass
class Reference:
    tokens: list[int]  # prompt + greedy continuation
    prompt_len: int
    positions: list[np.ndarray]  # per call: prefill [P], then one per decode step (int64)
    logits: list[np.ndarray]  # per call: [T, V] fp32
    inputs: dict = field(default_factory=dict)  # (layer|None, kind) -> [BlockCall per call]
    outputs: dict = field(default_factory=dict)  # (layer|None, kind) -> [array | (weights, idx)]
    # layer -> [selection scores [T, E] per call]: what the family's own top-k ranks (models.routing:
    # softmax probabilities, or sigmoid scores + correction bias; -inf outside the chosen groups)
    router_probs: dict = field(default_factory=dict)
    # layer -> [[T] per call]: the margin of the group choice (group-limited routers only)
    group_gaps: dict = field(default_factory=dict)
    # layer -> [N, k] per router call: the experts had the group choice gone the other way at its margin
    group_alternatives: dict = field(default_factory=dict)
    # layer -> [[T] per call]: the margin of the decisions that set the top-k weights (sparsemixer's
    # masks, routing.weight_gap): a near tie there changes the weights, not the experts
    weight_gaps: dict = field(default_factory=dict)
    coverage: dict = field(default_factory=dict)  # layer -> experts routed to by the sequence

    def block_keys(self) -> list[tuple[int | None, str]]:
        return list(self.inputs)


STREAM_ABOVE = 1 << 30  # fp32 bytes of the model above which the reference is streamed (whole: ~2.5x that at peak)


def reference_mode(model_dir: Path) -> str:
    """How the HF reference holds the model: "whole" (from_pretrained into memory, fastest for
    small models) or "streamed" (each decoder layer read from the checkpoint for its forward:
    memory about one layer plus the embedding and the head, whatever the depth; load_streamed). Auto by the
    model's fp32 size; $MOE_ORACLE_REFERENCE=whole|streamed forces one. Both give the same bytes."""
    from models.checkpoint import parameter_count

    return mode_for(parameter_count(model_dir))


def mode_for(parameters: int) -> str:
    """reference_mode of a checkpoint of this many parameters."""
    return forced_mode() or ("streamed" if 4 * parameters > STREAM_ABOVE else "whole")


def forced_mode() -> str | None:
    """"whole" or "streamed" where $MOE_ORACLE_REFERENCE forces how models hold a checkpoint; None: auto."""
    mode = os.environ.get("MOE_ORACLE_REFERENCE", "auto")
    return mode if mode in ("whole", "streamed") else None


def streamed_memory(src) -> tuple[int, str]:
    """(bytes, how they are made up) a check of a streamed checkpoint needs (the streamed reference, and
    the streamed models beside it): the embedding and head, and at most two decoder layers at a time (one in
    use, one being read), in fp32 (the reference's; the others' at bf16 are smaller), + 1 GiB: the bound
    tests/test_reference.py measures (1.04 GiB for 2.04 GiB of fp32 weights)."""
    layer, outside = src.layer_parameter_counts()
    return (4 * (2 * layer + outside) + (1 << 30),
            f"streamed: 2 x {layer / 1e9:.2f} B parameters of its largest decoder layer + {outside / 1e9:.2f} B "
            "outside the layers, in fp32, + 1 GiB; the layers are read from the checkpoint for each use")


def load_hf_model(family, model_dir: Path, dtype=None, streamed: bool = False):
    """HF's own model class (in `dtype`, default fp32), eager attention and eager (per-expert
    loop) experts; streamed (`load_streamed`: each decoder layer's weights read from the
    checkpoint for its forward) with `streamed`."""
    import torch
    from transformers.utils import logging as hf_logging

    from models.checkpoint import CheckpointError

    dtype = dtype or torch.float32
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        if streamed:
            return load_streamed(family, Path(model_dir), dtype)
        model, info = family.hf_class().from_pretrained(
            model_dir,
            dtype=dtype,
            attn_implementation="eager",
            experts_implementation="eager",
            use_safetensors=True,
            output_loading_info=True,
        )
    except CheckpointError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, AssertionError,
            RuntimeError) as e:  # a config.json HF's config class takes and its model cannot be built from
        raise CheckpointError(f"transformers cannot build {family.hf_class_name} from {Path(model_dir) / 'config.json'} "
                              f"({type(e).__name__}: {' '.join(str(e).split())[:300]})") from None
    bad = list(info.get("missing_keys", [])) + [str(k) for k in info.get("mismatched_keys", [])]
    if bad:
        raise CheckpointError(f"transformers could not load {len(bad)} tensor(s), e.g. {sorted(bad)[0]}")
    return model.eval()


READ = {"bytes": 0}  # bytes every streamed model of this process read from its checkpoint's decoder layers
EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a per-expert checkpoint tensor: ...experts.E....


class LayerStream:
    """One decoder layer's weights, read from the checkpoint's own shards (memory-mapped) through HF's
    own loading step (`convert_and_load_state_dict_in_model`: renames, per-expert -> fused) whenever the
    layer is in use, and dropped (back to the meta device) when it is not: no copy of the checkpoint is
    written anywhere. In use: during the layer's forward, and inside `materialized` (code that reads a
    module's weights outside a forward, or calls it many times). Counted, so a `materialized` inside the
    forward (a router hook reading its bias) neither reloads nor drops them.

    A forward of fewer tokens than the experts (a decode step) reads only the experts it routes to, where
    the checkpoint stores them per expert and HF's experts module is given the routing (top_k_index): the
    rest of the layer for the forward, then, as the experts module starts, the experts its tokens chose
    (read_experts); the others' rows are never written, and HF's per-expert loop never reads them (it visits
    the experts hit). The same numbers,
    a fraction of the bytes (a MoE decode step of 8 of 128 experts reads about a tenth of the layer)."""

    def __init__(self, model, layer, prefix: str, names: list, index: dict, load, targets: dict, top_k: int = 0):
        self.model, self.layer, self.prefix, self.names, self.index = model, layer, prefix, names, index
        self.load_config, self.targets = load, targets  # targets: the layer's parameter -> HF's dtype for it
        self.users, self.bytes = 0, 0  # bytes: read from the checkpoint so far
        self.keys = None  # what the checkpoint gives (set by the first read): what is dropped
        self.experts: dict = {}  # expert -> its tensor names, where stored per expert
        for n in names:
            if (m := EXPERT.search(n)) is not None:
                self.experts.setdefault(int(m.group(1)), []).append(n)
        self.top_k, self.sparse = top_k, False
        routed = routed_experts(layer) if self.experts and top_k else None
        # the routed experts module's name in the layer (read_experts' stand-in takes its path)
        self.routed = next((n for n, m in layer.named_modules() if m is routed), None)
        for m in layer.modules():
            m._oracle_stream = self
        layer.register_forward_pre_hook(self._start, with_kwargs=True)
        layer.register_forward_hook(lambda m, a, out: self.release())
        if routed is not None:
            routed.register_forward_pre_hook(self._experts, with_kwargs=True)

    def _start(self, module, args, kwargs):
        x = _first_tensor(args, kwargs)
        tokens = x.numel() // x.shape[-1]
        self.acquire(sparse=bool(self.experts) and tokens * self.top_k < len(self.experts))

    def _experts(self, module, args, kwargs):
        if self.sparse:  # the experts its tokens chose, now that the router has chosen
            idx = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            chosen = sorted({int(e) for e in idx.reshape(-1).tolist() if 0 <= int(e) < len(self.experts)})
            if not self.read_experts(module, chosen):
                self.read([n for e, ns in self.experts.items() for n in ns],
                          absent={n for e, ns in self.experts.items() if e not in chosen for n in ns})
            self.sparse = False

    def read_experts(self, module, chosen: list[int]) -> bool:
        """The chosen experts' tensors into the fused experts module `module`, by HF's own loading step run on
        a stand-in of that module holding len(chosen) experts (the chosen ones renumbered 0..k-1: HF's merge
        stacks them in that order), each stacked row then copied into its expert's row of a fused tensor whose
        other rows are never written (memory the kernel maps on first touch: the experts not chosen cost no
        memory and no time; HF's per-expert loop never reads them). The same bytes in the chosen rows as the
        whole conversion gives (the same ops on the same tensors, then the same cast), without converting 128
        experts of which 120 are zeros (measured at Qwen3-30B-A3B's width: most of a decode step's time).
        False (nothing changed) where HF's step does not fill that module from these tensors alone: the
        caller converts the whole layer's experts instead."""
        import torch
        from accelerate.utils import set_module_tensor_to_device
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        path = self.prefix + self.routed
        stub = torch.nn.Module()  # the model's path down to `module`, with k experts (meta: nothing allocated)
        stub.base_model_prefix, stub.config = self.model.base_model_prefix, self.model.config
        parent = stub
        for part in path.split("."):
            parent.add_module(part, torch.nn.Module())
            parent = getattr(parent, part)
        fused = dict(module.named_parameters(recurse=False))
        for name, p in fused.items():
            if p.shape[0] != len(self.experts):
                return False
            parent.register_parameter(name, torch.nn.Parameter(
                torch.empty((len(chosen), *p.shape[1:]), dtype=p.dtype, device="meta"), requires_grad=False))
        names = [n for e in chosen for n in self.experts[e]]
        renumber = {e: j for j, e in enumerate(chosen)}
        tensors = layer_tensors(self.index, names, counter=self)
        tensors = {EXPERT.sub(lambda m: f".experts.{renumber[int(m.group(1))]}.", n, count=1): t
                   for n, t in tensors.items()}
        info, _ = convert_and_load_state_dict_in_model(stub, tensors, self.load_config, None)
        if info.missing_keys or info.unexpected_keys or info.mismatched_keys or info.conversion_errors:
            return False
        rows = torch.tensor(chosen)
        for name, p in fused.items():
            got = parent.get_parameter(name)
            want = self.targets.get(f"{self.routed}.{name}", got.dtype)
            whole = torch.empty(p.shape, dtype=want)  # rows of experts not chosen: never written, never read
            whole[rows] = got.detach().to(want)
            set_module_tensor_to_device(module, name, "cpu", value=whole, dtype=want)
        return True

    def read(self, names: list | None = None, absent: set = frozenset()):
        """These of the layer's tensors (default all) from the checkpoint into the model (HF's loading
        step), each in the dtype HF's model holds it in; `absent` ones given as zeros, not read."""
        names = self.names if names is None else names
        present = [n for n in names if n not in absent]
        part = load_into(self.model, self.index, present, self.load_config, absent, counter=self)
        if self.keys is None:
            self.keys = [k for k in self.layer.state_dict() if self.prefix + k not in part.missing_keys]
        cast_to(self.layer, self.targets)
        trim_heap()
        return part

    def check(self):
        """HF's loading step over the layer's tensors as the checkpoint's header describes them (meta
        tensors: shapes and dtypes, nothing read): its key and shape checks, and the keys the layer takes."""
        part = load_into(self.model, self.index, self.names, self.load_config, meta=True)
        self.keys = [k for k in self.layer.state_dict() if self.prefix + k not in part.missing_keys]
        return part

    def drop(self):
        from accelerate.utils import set_module_tensor_to_device

        for name in self.keys:
            set_module_tensor_to_device(self.layer, name, "meta")
        trim_heap()

    def acquire(self, sparse: bool = False):
        if self.users == 0:
            self.sparse = sparse
            self.read([n for n in self.names if not EXPERT.search(n)] if sparse else None)
        self.users += 1

    def release(self):
        self.users -= 1
        if self.users == 0:
            self.sparse = False
            self.drop()


HELD: list = []  # the one decoder layer a streamed model keeps loaded between its uses (hold), process-wide


def hold(stream: LayerStream) -> None:
    """Keep this layer loaded after its use, until another layer is held or `release_held`: the block
    rows of one layer (attention, router, moe, layer) and a layer-by-layer run read it once between
    them, not once each. One layer in the whole process (the memory bound counts two layers: one held,
    one in use)."""
    if HELD and HELD[0] is stream:
        return
    release_held()
    stream.acquire()
    HELD.append(stream)


def release_held() -> None:
    """Drop the layer `hold` kept, if any."""
    while HELD:
        HELD.pop().release()


def routed_experts(layer):
    """The layer's HF experts module that is given the routing (forward(hidden_states, top_k_index, ...)),
    or None (an experts module that routes by itself, or none)."""
    import inspect

    for name, m in layer.named_modules():
        if name.endswith("experts") and any(p.ndim == 3 for p in m.parameters(recurse=False)):
            params = list(inspect.signature(m.forward).parameters)
            if len(params) >= 2 and "ind" in params[1]:
                return m
    return None


def load_into(model, index: dict, names: list, load, absent=(), meta: bool = False, counter=None):
    """These checkpoint tensors into `model` by HF's own loading step (`convert_and_load_state_dict_in_model`:
    renames, per-expert -> fused), read by layer_tensors; `absent` ones given as zeros, not read. The bytes
    read from disk for a decoder layer (`counter`: its LayerStream) are added to READ and to counter.bytes.
    Returns HF's loading info."""
    import torch
    from transformers.core_model_loading import convert_and_load_state_dict_in_model

    from models.checkpoint import torch_dtype

    if meta:  # shapes and dtypes from the header alone: HF's key and shape checks, nothing read
        tensors = {n: torch.empty(index[n][2], dtype=torch_dtype(index[n][1]), device="meta") for n in names}
        load = dataclasses.replace(load, device_map={"": "meta"})
    else:
        tensors = layer_tensors(index, names, counter)
    tensors.update({n: torch.zeros(index[n][2], dtype=torch_dtype(index[n][1])) for n in absent})
    part, _ = convert_and_load_state_dict_in_model(model, tensors, load, None)
    return part


# The checkpoint tensors of the decoder layer read last, as read (one layer, process-wide): the models of a
# layer-by-layer schedule that run one layer in turn (HF at fp32 and at the candidate's precision, with each
# attention, the candidate) take it from here, and the checkpoint's bytes are read from disk once.
RECENT: dict = {"layer": None, "tensors": {}}


def layer_tensors(index: dict, names: list, counter=None) -> dict:
    """These checkpoint tensors (name -> tensor in its stored dtype, read from its memory-mapped shard): those
    of the layer read last (RECENT) not read again, and kept for the next model that reads them (tensors
    outside the decoder layers are not kept). The bytes read from disk for a decoder layer (`counter`: its
    LayerStream or LayerWeights) are added to READ and to counter.bytes."""
    from models.checkpoint import LAYER, open_shard

    m = LAYER.search(names[0]) if names else None
    layer = None if m is None else (str(index[names[0]][0].parent), int(m.group(1)))
    if layer is not None and layer != RECENT["layer"]:
        RECENT["layer"], RECENT["tensors"] = layer, {}
    kept = RECENT["tensors"] if layer is not None else {}
    missing = [n for n in names if n not in kept]
    out = {n: kept[n] for n in names if n in kept}
    with contextlib.ExitStack() as stack:
        files = {s: stack.enter_context(open_shard(s)) for s in sorted({index[n][0] for n in missing})}
        for n in missing:
            out[n] = files[index[n][0]].get_tensor(n)
    if layer is not None:
        kept.update({n: out[n] for n in missing})
    if counter is not None:  # a decoder layer's (the resident tensors are read once, at load)
        got = sum(tensor_bytes(index[n]) for n in missing)
        READ["bytes"] += got
        counter.bytes += got
    return out


def forget_reads() -> None:
    """Drop the layer RECENT keeps (the end of a check)."""
    RECENT["layer"], RECENT["tensors"] = None, {}


def tensor_bytes(entry) -> int:
    """Bytes of a checkpoint tensor (a tensor_index entry: shard, safetensors dtype, shape)."""
    import math

    from models.checkpoint import torch_dtype

    return math.prod(entry[2]) * torch_dtype(entry[1]).itemsize


def streamed_bytes(model) -> int | None:
    """Bytes a streamed model (load_streamed) has read from its checkpoint's decoder layers so far; None
    for a model in memory."""
    streams = getattr(model, "_oracle_streams", None)
    return None if streams is None else sum(s.bytes for s in streams)


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's malloc_trim; a no-op elsewhere): HF's loading
    step reads a layer's tensors in worker threads, whose malloc arenas otherwise keep a dropped
    layer's pages resident (measured: a peak of 1.37 GiB without it, 1.04 GiB with it, tests/test_reference.py's checkpoint)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def cast_to(module, targets: dict) -> None:
    """Each loaded floating parameter of `module` cast to its dtype in `targets` (name -> dtype), one
    at a time (the stored copy freed as it goes)."""
    from accelerate.utils import set_module_tensor_to_device

    for name, t in list(module.named_parameters()):
        want = targets.get(name)
        if want is not None and t.is_floating_point() and not t.is_meta and t.dtype != want:
            set_module_tensor_to_device(module, name, "cpu", value=t.to(want), dtype=want)


def load_streamed(family, model_dir: Path, dtype=None):
    """The same HF model (in `dtype`, same modules, same numbers) whose decoder layers hold their
    weights only while in use (LayerStream): each is read from the checkpoint's own memory-mapped
    shards and converted by HF's own loading step for its forward, then dropped. Resident: the
    embedding, the final norm, the head. No copy of the checkpoint is written (the offload HF's
    from_pretrained(device_map=...) would write doubles the disk a large model needs, and maps every
    shard for the whole load). Tensors are read in the checkpoint's own dtype (fp32 if it mixes dtypes)
    and cast to `dtype`: exact for fp32."""
    import torch
    from accelerate.utils import set_module_tensor_to_device
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig

    from models.checkpoint import CheckpointError, LAYER, layer_groups, read_config, tensor_index, torch_dtype

    index = tensor_index(model_dir)
    floats = {torch_dtype(d) for _, d, _ in index.values() if torch_dtype(d).is_floating_point}
    store = floats.pop() if len(floats) == 1 else torch.float32
    dtype = dtype or torch.float32
    cls = family.hf_class()
    config = family.hf_config(read_config(model_dir))
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    with contextlib.ExitStack() as stack:  # HF's own from_pretrained skeleton: meta, no init
        for ctx in cls.get_init_context(dtype, False, False, None):
            stack.enter_context(ctx)
        model = cls(config)
    # the dtype each parameter is cast to after its read: `dtype`, or fp32 where HF keeps it (the skeleton's own,
    # or the class's keep-in-fp32 names, which HF's loading step also gives its buffers: DeepSeek-V3's
    # e_score_correction_bias, a bf16 buffer here before)
    plan = model._get_dtype_plan(dtype)
    targets = {name: p.dtype for name, p in model.named_parameters()}
    if plan:
        from transformers.core_model_loading import build_glob_alternation

        pattern, groups, _ = build_glob_alternation(list(plan))
        targets.update({n: plan[groups[m.lastgroup]] for n in targets if (m := pattern.search(n)) is not None})
    for name, p in list(model.named_parameters()):  # loaded in the stored dtype, cast after
        if p.is_floating_point():
            set_module_tensor_to_device(model, name, "meta", dtype=store)
    names_of = {id(m): n for n, m in model.named_modules()}
    mapping = get_model_conversion_mapping(model)
    load = LoadStateDictConfig(pretrained_model_name_or_path=str(model_dir), device_map={"": "cpu"}, dtype=store,
                               weight_mapping=mapping, use_safetensors=True, dtype_plan=plan)
    layers = decoder_of(model).layers
    expected, loaded, info, streams = set(model.state_dict()), set(), None, []
    for names in layer_groups(index):  # a layer's keys checked from the header, the rest read and kept
        m = LAYER.search(names[0])
        if m is not None and int(m.group(1)) < len(layers):
            layer = layers[int(m.group(1))]
            prefix = names_of[id(layer)] + "."
            stream = LayerStream(model, layer, prefix, names, index, load,
                                 {n[len(prefix):]: d for n, d in targets.items() if n.startswith(prefix)},
                                 getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0)
            part = stream.check()
            streams.append(stream)
        else:  # the embedding, final norm, head: resident
            part = load_into(model, index, names, load)
        loaded |= expected - part.missing_keys
        if info is None:
            info = part
        else:
            info.unexpected_keys |= part.unexpected_keys
            info.mismatched_keys |= part.mismatched_keys
            info.conversion_errors.update(part.conversion_errors)
            info.error_msgs += part.error_msgs
    info.missing_keys = expected - loaded
    model._weight_conversions = [m for m in mapping if m.was_used()]
    cls._finalize_model_loading(model, load, info)  # non-persistent buffers, ties (the layers stay on meta)
    bad = sorted(info.missing_keys) + sorted(str(k) for k in info.mismatched_keys)
    if bad:
        raise CheckpointError(f"transformers could not load {len(bad)} tensor(s), e.g. {bad[0]}")
    cast_to(model, targets)  # the resident tensors
    model.tie_weights()  # a tied head shares the embedding it was cast with (cast_to replaced the embedding's)
    model._oracle_streams = streams
    return model.eval()


def decoder_of(model):
    """The HF model's decoder (its `layers`, `norm`): get_decoder(), or `model` where that answers
    the CausalLM itself (transformers 5.23's Llama4ForCausalLM)."""
    decoder = model.get_decoder()
    return decoder if hasattr(decoder, "layers") else model.model


def _first_tensor(args, kwargs):
    import torch

    if args and torch.is_tensor(args[0]):
        return args[0]
    return kwargs["hidden_states"]


def _submodule(root, path: str):
    for part in path.split("."):
        root = getattr(root, part, None)
        if root is None:
            return None
    return root


def model_args(model, family):
    """The production ModelArgs of the HF model's config (which blocks each layer has, how it routes)."""
    return family.to_args(model.config.get_text_config())


def block_modules(model, family) -> dict:
    """(layer|None, kind) -> the HF module computing that block: the family's HF paths
    (Family.hf_path) for the blocks models.args.layer_kinds gives each layer."""
    from models.args import layer_kinds

    args = model_args(model, family)
    decoder = decoder_of(model)
    out = {}
    for i, layer in enumerate(decoder.layers):
        for kind in layer_kinds(args, i):
            module = layer if kind == "layer" else next(
                (m for p in family.hf_path(kind) if (m := _submodule(layer, p)) is not None), None)
            if module is None:
                raise RuntimeError(f"{family.name}: layer {i} of HF's model has no {kind} block at "
                                   f"{' or '.join(family.hf_path(kind))}")
            out[i, kind] = module
    out[None, "final_norm"] = decoder.norm
    out[None, "logits"] = model.get_output_embeddings()
    return out


def normalize_output(kind: str, out, keep_dtype: bool = False, router_output=None):
    """HF module output -> tensor (router: weights, indices, logits); fp32 unless keep_dtype.
    router_output: the family's reading of its router's output (Family.router_output)."""
    cast = (lambda t: t.detach()) if keep_dtype else (lambda t: t.detach().float())
    if kind == "router":  # HF routers return (logits, top-k weights, top-k indices)
        logits, weights, idx = router_output(out) if router_output else out
        return cast(weights), idx.detach(), logits.detach().float()
    if isinstance(out, tuple):
        out = out[0]
    return cast(out)


def correction_bias(router):
    """The router's correction bias wherever under it the family keeps it (ERNIE 4.5: moe_statics), or None."""
    with materialized(router):  # a streamed model's router holds its weights only in its forward
        bias = next((t for n, t in [*router.named_parameters(), *router.named_buffers()]
                     if n.rsplit(".", 1)[-1] == "e_score_correction_bias"), None)
        return bias.detach().float().reshape(-1).clone() if bias is not None else None


def selection_scores(router, logits, args):
    """(selection scores [N, E], group gaps [N] or None) of an HF router's logits: the family's
    routing (models.routing) with the router's own correction bias."""
    from models import routing

    bias = correction_bias(router)
    probs = routing.scores(logits, args)
    return routing.selection(probs, bias, args), (routing.group_gap(probs, bias, args) if routing.grouped(args) else None)


def router_record(router, logits, args):
    """What the reference records of one HF router call: (selection scores [N, E], the group choice's
    margin [N], the weights' decisions' margin [N], the experts had the group choice gone the other way
    [N, k]; each None where the routing has no such decision), its scores and bias read once."""
    from models import routing

    bias, probs = correction_bias(router), routing.scores(logits, args)
    grouped = routing.grouped(args)
    return (routing.selection(probs, bias, args), routing.group_gap(probs, bias, args) if grouped else None,
            weight_gap(logits, args),
            routing.group_alternative(probs, bias, args, args.num_experts_per_tok) if grouped else None)


def weight_gap(logits, args):
    """routing.weight_gap of an HF router's logits, or None where no decision sets the weights."""
    from models import routing

    return routing.weight_gap(routing.scores(logits, args), args) if routing.weighs_discretely(args) else None


def check_selection(layer: int, choice: np.ndarray, idx: np.ndarray, k: int) -> None:
    """The reference router's choice is a top-k of the selection scores (any one, at exact ties):
    else the family declares a routing its HF model does not have."""
    if np.isnan(choice).any():
        return  # NaN in the reference: first_nonfinite reports where it starts
    kth = -np.sort(-choice, axis=-1)[:, k - 1]  # a top-k: no chosen expert scores below the k-th score
    for t in np.flatnonzero(np.take_along_axis(choice, idx, axis=-1).min(axis=-1) < kth):
        raise RuntimeError(f"layer {layer}: HF's router chose experts {sorted(idx[t].tolist())} where the "
                           "family's selection scores rank others first: its routing fields (ModelArgs.router: "
                           "scoring, correction_bias, n_group, topk_group, group_score) do not describe "
                           "this model")


def greedy_run(model, prompt: list[int], n_decode: int, on_call=None):
    """Prefill the prompt, then n_decode single-token steps feeding back the argmax.
    Returns (tokens, positions per call, logits per call)."""
    import torch

    tokens = list(prompt)
    positions, logits = [], []
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model(input_ids=ids, use_cache=True)
        positions.append(torch.arange(len(prompt)))
        logits.append(out.logits[0].float())
        for step in range(n_decode):
            tokens.append(int(logits[-1][-1].argmax()))
            pos = len(tokens) - 1
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
            positions.append(torch.tensor([pos]))
            logits.append(out.logits[0].float())
            if on_call:
                on_call(step)
        tokens.append(int(logits[-1][-1].argmax()))
    return tokens, positions, logits


def capture(model, family, prompt: list[int], n_decode: int, on_call=None) -> Reference:
    """Run the reference and record every block's input and output on every call."""
    modules = block_modules(model, family)
    args = model_args(model, family)
    recs = defaultdict(lambda: ([], []))
    reader = router_reader(family, args)

    quiet = [False]  # an expert probe running inside the prefill (probing_in_prefill): not a sequence call

    def hook(key):
        def fn(mod, a, kwargs, out):
            if quiet[0]:
                return
            x = _first_tensor(a, kwargs).detach().float()
            recs[key][0].append(x.reshape(1, -1, x.shape[-1]).clone())
            out = normalize_output(key[1], out, router_output=reader)
            if key[1] == "router":
                out = (*out[:2], *router_record(mod, out[2], args))
            recs[key][1].append(out)

        return fn

    handles = [m.register_forward_hook(hook(k), with_kwargs=True) for k, m in modules.items()]
    try:
        with probing_in_prefill(model, modules, args, reader, quiet) as probes:
            tokens, positions, logits = greedy_run(model, prompt, n_decode, on_call)
    finally:
        for h in handles:
            h.remove()
    positions = [p.numpy() for p in positions]
    ref = Reference(tokens=tokens, prompt_len=len(prompt), positions=positions, logits=[lg.numpy() for lg in logits])
    for key in modules:
        xs, outs = recs[key]
        if len(xs) != len(positions):
            raise RuntimeError(f"reference hook {key} fired {len(xs)} times for {len(positions)} calls")
        ref.inputs[key] = [BlockCall(x.numpy(), p, tokens[int(p[0]) : int(p[-1]) + 1]) for x, p in zip(xs, positions)]
        if key[1] == "router":
            ref.outputs[key] = [(o[0].numpy(), o[1].numpy()) for o in outs]
            ref.router_probs[key[0]] = [o[2].numpy() for o in outs]
            if outs[0][3] is not None:
                ref.group_gaps[key[0]] = [o[3].numpy() for o in outs]
            if outs[0][4] is not None:
                ref.weight_gaps[key[0]] = [o[4].numpy() for o in outs]
            if outs[0][5] is not None:
                ref.group_alternatives[key[0]] = [o[5].numpy() for o in outs]
            for (_, i), p in zip(ref.outputs[key], ref.router_probs[key[0]]):
                check_selection(key[0], p, i, args.num_experts_per_tok)
        elif key == (None, "logits"):
            # the model's logits, not the output embedding's: what the CausalLM makes of it after
            # the projection (Granite's logits_scaling) is part of the block
            ref.outputs[key] = [lg[None] for lg in ref.logits]
        else:
            ref.outputs[key] = [o.numpy() for o in outs]
    for (layer, kind), router in modules.items():
        if kind == "router":
            add_probes(ref, layer, int(router.weight.shape[0]), *probes[layer])
    return ref


def router_reader(family, args):
    """The family's reading of its HF router's output (None: the (logits, weights, indices) triple)."""
    return None if family.router_output is None else (lambda out: family.router_output(out, args))


@contextlib.contextmanager
def materialized(module):
    """A module's weights (and its submodules') loaded for the duration: for code that reads
    them outside a forward, or calls the module many times (a streamed model's decoder layers hold
    their weights only while in use: LayerStream)."""
    streams = list({id(s): s for m in module.modules() if (s := getattr(m, "_oracle_stream", None)) is not None}.values())
    for s in streams:
        s.acquire()
    try:
        yield module
    finally:
        for s in streams:
            s.release()


def expert_probes(router, moe, args, reader=None) -> tuple[list, list]:
    """A prompt rarely routes to every expert, and a bug in an expert nobody routes to is
    invisible. So the stateless router and moe blocks also get one single-token probe per
    expert e: a token the family's own selection routes to e, checked by running the reference
    router on it. First x = router row e scaled to RMS 1 (a softmax router then ranks e first);
    where the selection is decided otherwise too (a correction bias, a group limit) the probe is
    solved for: the least-norm x whose router logits are +8 for e and -8 for every other expert.
    The reference computes the probe outputs with its own modules. Returns (per probe: (BlockCall, router
    weights, indices, selection scores, group gap, weight gap, group alternative (each None where the
    routing has none), moe output), the experts neither reaches: unprobed)."""
    import torch

    probes, unprobed = [], []
    with torch.no_grad(), materialized(moe), materialized(router):
        w = router.weight.detach().float().clone()
        pinv = None
        for e in range(w.shape[0]):
            x = (w[e] / w[e].pow(2).mean().sqrt()).reshape(1, 1, -1)
            out = router(x.reshape(1, -1).to(router.weight.dtype))
            if e not in normalize_output("router", out, router_output=reader)[1].reshape(-1).tolist():
                if pinv is None:
                    pinv = torch.linalg.pinv(w.double())  # [H, E]
                z = torch.full((w.shape[0],), -8.0, dtype=torch.float64)
                z[e] = 8.0
                x = (pinv @ z).float().reshape(1, 1, -1)
                out = router(x.reshape(1, -1).to(router.weight.dtype))
                if e not in normalize_output("router", out, router_output=reader)[1].reshape(-1).tolist():
                    unprobed.append(e)
                    continue
            weights, idx, logits = normalize_output("router", out, router_output=reader)
            choice, gap, wgap, alt = router_record(router, logits, args)
            probes.append((BlockCall(x.numpy(), np.array([0]), [], probe=True), weights.numpy(), idx.numpy(),
                           choice.numpy(), *(None if t is None else t.numpy() for t in (gap, wgap, alt)),
                           normalize_output("moe", moe(x)).numpy()))
    return probes, unprobed


def add_probes(ref: Reference, layer: int, experts: int, probes: list, unprobed: list) -> None:
    """A MoE layer's expert probes (expert_probes) after its sequence's calls in the reference, and its
    coverage: the experts the sequence routed to, those no probe reaches."""
    used = np.unique(np.concatenate([i.reshape(-1) for _, i in ref.outputs[layer, "router"]]))
    ref.coverage[layer] = {"experts": experts, "routed_by_sequence": int(used.size)}
    for call, weights, idx, choice, gap, wgap, alt, out in probes:
        ref.inputs[layer, "router"].append(call)
        ref.outputs[layer, "router"].append((weights, idx))
        ref.router_probs[layer].append(choice)
        for table, value in ((ref.group_gaps, gap), (ref.group_alternatives, alt), (ref.weight_gaps, wgap)):
            if value is not None:
                table[layer].append(value)
        ref.inputs[layer, "moe"].append(call)
        ref.outputs[layer, "moe"].append(out)
    if unprobed:
        ref.coverage[layer]["unprobed"] = unprobed


@contextlib.contextmanager
def probing_in_prefill(model, modules: dict, args, reader, quiet: list):
    """Each MoE layer's expert probes (expert_probes) run inside the prefill's forward of its decoder
    layer, the layer loaded whole for both: a streamed layer is read once for the prefill and the probes
    (after the model's prefill they would read every expert again). `quiet[0]` is True while a probe runs
    (the capture's hooks record the sequence's calls, not the probes). Yields {layer: (probes, unprobed)}."""
    found, handles = {}, []
    layers = decoder_of(model).layers
    for (layer, kind), router in modules.items():
        if kind != "router":
            continue
        stream = getattr(layers[layer], "_oracle_stream", None)

        def before(mod, a, kw, layer=layer, stream=stream):
            if layer not in found and stream is not None:
                stream.acquire()  # whole (not only the experts its tokens route to), until the probes ran

        def after(mod, a, kw, out, layer=layer, stream=stream, router=router):
            if layer in found:
                return
            quiet[0] = True
            try:
                found[layer] = expert_probes(router, modules[layer, "moe"], args, reader)
            finally:
                quiet[0] = False
                if stream is not None:
                    stream.release()

        handles += [layers[layer].register_forward_pre_hook(before, with_kwargs=True, prepend=True),
                    layers[layer].register_forward_hook(after, with_kwargs=True)]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def first_nonfinite(ref: Reference) -> str | None:
    """Where the reference itself first produces NaN/Inf (program order: layer by layer, then
    the final norm and the logits), or None."""
    from oracle.result import PROGRAM_ORDER, place

    order = {**PROGRAM_ORDER, "final_norm": 4, "logits": 5}
    for key in sorted(ref.outputs, key=lambda k: (k[0] is None, k[0] or 0, order.get(k[1], 9))):
        for i, out in enumerate(ref.outputs[key]):
            t = out[0] if isinstance(out, tuple) else out
            if not np.isfinite(t).all():
                return f"{place(key[0])} {key[1]} (call {i}{', an expert probe' if ref.inputs[key][i].probe else ''})"
    for i, lg in enumerate(ref.logits):
        if not np.isfinite(lg).all():
            return f"the logits (call {i})"
    return None


def save(ref: Reference, path: Path) -> None:
    """The reference as <path>.safetensors (every tensor) + <path>.json (the structure),
    each written atomically."""
    tensors, blocks = {}, []
    for i, (p, lg) in enumerate(zip(ref.positions, ref.logits)):
        tensors[f"pos.{i}"], tensors[f"logits.{i}"] = p, lg
    for key, calls in ref.inputs.items():
        name = f"{key[0]}.{key[1]}"
        for i, (c, o) in enumerate(zip(calls, ref.outputs[key])):
            tensors[f"in.{name}.{i}"] = c.x_array
            tensors[f"inpos.{name}.{i}"] = c.pos_array
            if key[1] == "router":
                tensors[f"out.{name}.{i}"], tensors[f"idx.{name}.{i}"] = o
            else:
                tensors[f"out.{name}.{i}"] = o
        blocks.append({"layer": key[0], "kind": key[1], "tokens": [c.tokens for c in calls],
                       "probe": [c.probe for c in calls]})
    for layer, probs in ref.router_probs.items():
        for i, p in enumerate(probs):
            tensors[f"probs.{layer}.{i}"] = p
    for layer, gaps in ref.group_gaps.items():
        for i, g in enumerate(gaps):
            tensors[f"ggap.{layer}.{i}"] = g
    for layer, gaps in ref.weight_gaps.items():
        for i, g in enumerate(gaps):
            tensors[f"wgap.{layer}.{i}"] = g
    for layer, alts in ref.group_alternatives.items():
        for i, g in enumerate(alts):
            tensors[f"galt.{layer}.{i}"] = g
    meta = {"tokens": ref.tokens, "prompt_len": ref.prompt_len, "calls": len(ref.positions), "blocks": blocks,
            "router_layers": {str(k): len(v) for k, v in ref.router_probs.items()},
            "group_gap_layers": {str(k): len(v) for k, v in ref.group_gaps.items()},
            "weight_gap_layers": {str(k): len(v) for k, v in ref.weight_gaps.items()},
            "group_alternative_layers": {str(k): len(v) for k, v in ref.group_alternatives.items()},
            "coverage": {str(k): v for k, v in ref.coverage.items()}}
    save_arrays(tensors, meta, path)


def save_arrays(tensors: dict, meta: dict, path: Path) -> None:
    """<path>.safetensors (the arrays) and <path>.json (`meta`), each written atomically."""
    import json

    from safetensors.numpy import save_file

    from models.checkpoint import temp_file
    from oracle.result import write_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = temp_file(path.parent, f".{path.name}.", ".tmp.safetensors")
    os.close(fd)  # a name of its own: two processes capturing one reference never share a temp file
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp)
        os.replace(tmp, path.with_suffix(".safetensors"))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    write_atomic(path.with_suffix(".json"), json.dumps(meta))


def load(path: Path) -> Reference | None:
    """A saved reference, or None if it is not there (or unreadable: then it is rebuilt)."""
    import json

    from safetensors.numpy import load_file

    try:
        meta = json.loads(path.with_suffix(".json").read_text())
        t = load_file(str(path.with_suffix(".safetensors")))
        return _reference_of(meta, t)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):  # not what save() writes
        return None


def _reference_of(meta: dict, t: dict) -> Reference:
    n = meta["calls"]
    ref = Reference(meta["tokens"], meta["prompt_len"], [t[f"pos.{i}"] for i in range(n)],
                    [t[f"logits.{i}"] for i in range(n)])
    for b in meta["blocks"]:
        key, name = (b["layer"], b["kind"]), f"{b['layer']}.{b['kind']}"
        ref.inputs[key] = [BlockCall(t[f"in.{name}.{i}"], t[f"inpos.{name}.{i}"], toks, probe)
                           for i, (toks, probe) in enumerate(zip(b["tokens"], b["probe"]))]
        ref.outputs[key] = [(t[f"out.{name}.{i}"], t[f"idx.{name}.{i}"]) if b["kind"] == "router"
                            else t[f"out.{name}.{i}"] for i in range(len(b["tokens"]))]
    ref.router_probs = {int(k): [t[f"probs.{k}.{i}"] for i in range(m)] for k, m in meta["router_layers"].items()}
    ref.group_gaps = {int(k): [t[f"ggap.{k}.{i}"] for i in range(m)]
                      for k, m in meta.get("group_gap_layers", {}).items()}
    ref.weight_gaps = {int(k): [t[f"wgap.{k}.{i}"] for i in range(m)]
                       for k, m in meta.get("weight_gap_layers", {}).items()}
    ref.group_alternatives = {int(k): [t[f"galt.{k}.{i}"] for i in range(m)]
                              for k, m in meta.get("group_alternative_layers", {}).items()}
    ref.coverage = {int(k): v for k, v in meta["coverage"].items()}
    return ref


# ---------------------------------------------------------------- portable references
PORTABLE_FORMAT = 2  # 2: provenance.json records the sha256 of the reference's files
SAVED_FILES = ("reference.json", "reference.safetensors")  # what provenance.json's "files" hashes
PORTABLE_FILES = ("reference.json", "reference.safetensors", "provenance.json")


def save_portable(ref: Reference, out: Path, provenance: dict) -> list[Path]:
    """A captured reference as a directory that can be moved to another machine: every tensor
    (reference.safetensors), the structure (reference.json) and what it was captured from
    (provenance.json: family, checkpoint sha256, config, prompt, steps, seed, versions).
    Written into a temporary directory beside `out`, then renamed: never half there."""
    import json
    import shutil

    from models.checkpoint import temp_dir

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_dir(out.parent, f".{out.name}.")
    try:
        from oracle.artifacts import sha256_file

        save(ref, tmp / "reference")
        files = {f: sha256_file(tmp / f) for f in SAVED_FILES}
        (tmp / "provenance.json").write_text(json.dumps({**provenance, "format": PORTABLE_FORMAT, "files": files},
                                                        indent=1, sort_keys=True) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return [out / f for f in PORTABLE_FILES]


def read_portable(path: Path) -> dict:
    """provenance.json of a saved reference directory; ValueError saying what is wrong."""
    import json

    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"--reference {path}: not a directory")
    missing = [f for f in PORTABLE_FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"--reference {path}: not a saved reference (missing {', '.join(missing)}; "
                         "write one with `oracle reference save`)")
    try:
        meta = json.loads((path / "provenance.json").read_text())
    except ValueError as e:
        raise ValueError(f"--reference {path}/provenance.json: not valid JSON ({e})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"--reference {path}/provenance.json: not a JSON object")
    if meta.get("format") != PORTABLE_FORMAT:
        raise ValueError(f"--reference {path}: format {meta.get('format')!r:.40}, this version reads {PORTABLE_FORMAT} "
                         "(save it again with `oracle reference save`)")
    for key, kind in (("family", str), ("checkpoint_sha256", str), ("files", dict)):
        if not isinstance(meta.get(key), kind):
            raise ValueError(f"--reference {path}/provenance.json: {key} is not a {kind.__name__}")
    if not re.fullmatch(r"[0-9a-f]{64}", meta["checkpoint_sha256"]):
        raise ValueError(f"--reference {path}/provenance.json: checkpoint_sha256 is not a sha256")
    return meta


def load_portable(path: Path) -> Reference:
    """The saved reference, its files verified first against the sha256 provenance.json records
    (a reference is what `oracle reference save` wrote, byte for byte, or nothing)."""
    from oracle.artifacts import sha256_file

    path = Path(path)
    files = read_portable(path)["files"]
    for name in SAVED_FILES:
        if files.get(name) != sha256_file(path / name):
            raise ValueError(f"--reference {path}/{name}: changed or damaged since it was saved (not the sha256 "
                             "provenance.json records)")
    ref = load(path / "reference")
    if ref is None:
        raise ValueError(f"--reference {path}: reference.safetensors / reference.json are unreadable")
    return ref
