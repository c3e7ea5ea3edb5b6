"""HF's model loaded for the reference: whole, or streamed (its decoder layers read from the
checkpoint's shards for each use, one layer in memory at a time) above a size, with the bytes each
streamed model read counted."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from pathlib import Path

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
        from models.checkpoint import read_config
        from models.release_formats import release_format

        if release_format(read_config(Path(model_dir))) is not None:
            # a quantized release, read by the format's definition (models/release_formats.py) as the streamed
            # model reads it, every layer kept: not transformers' own loader of it (from_pretrained with
            # FineGrainedFP8Config(dequantize=True)), whose FP8 dequantizer takes the block size from the scale
            # grid, wrong where the last blocks are partial (tests/test_release_checkpoints.py)
            model = load_streamed(family, Path(model_dir), dtype)
            for stream in model.__dict__.pop("_oracle_streams"):
                stream.acquire()  # in use for good: never dropped
            return model
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
        routed = routed_experts(layer) if top_k else None
        # the routed experts module's name in the layer (read_experts' stand-in takes its path)
        self.routed = next((n for n, m in layer.named_modules() if m is routed), None)
        # a release's experts stored stacked under the module's own parameter names (gpt-oss's MXFP4
        # experts.gate_up_proj [E, ...]): name -> parameter, where every one of the module's parameters is one (the
        # rows a step chose are read and dequantized). Only a release's: its whole model holds them as fresh
        # dequantized tensors too, while a plain checkpoint's are its mapped shard's, whose alignment rounds a
        # matrix-vector product otherwise than a copy's (5e-7 on mistral4): streamed would not be whole bit for bit
        self.fused, self.count = {}, len(self.experts)
        if routed is not None and not self.experts and getattr(index, "parts", None):
            own = dict(routed.named_parameters(recurse=False))
            stacked = {f"{prefix}{self.routed}.{k}": k for k in own}
            if own and all(n in index and tuple(index[n][2]) == tuple(own[k].shape) for n, k in stacked.items()):
                self.fused, self.count = stacked, next(iter(own.values())).shape[0]
        if not (self.experts or self.fused):
            routed = None
        for m in layer.modules():
            m._oracle_stream = self
        layer.register_forward_pre_hook(self._start, with_kwargs=True)
        layer.register_forward_hook(lambda m, a, out: self.release())
        if routed is not None:
            routed.register_forward_pre_hook(self._experts, with_kwargs=True)

    def _start(self, module, args, kwargs):
        x = first_tensor(args, kwargs)
        tokens = x.numel() // x.shape[-1]
        self.acquire(sparse=self.count > 0 and tokens * self.top_k < self.count)

    def _experts(self, module, args, kwargs):
        if self.sparse:  # the experts its tokens chose, now that the router has chosen
            idx = args[1] if len(args) > 1 else next(v for k, v in kwargs.items() if "ind" in k)
            chosen = sorted({int(e) for e in idx.reshape(-1).tolist() if 0 <= int(e) < self.count})
            if self.fused:
                self.read_rows(module, chosen)
            elif not self.read_experts(module, chosen):
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

    def read_rows(self, module, chosen: list[int]) -> None:
        """The chosen experts' rows of the stacked expert tensors (a release's dequantized as read) into the
        experts module `module`, each in a tensor whose other rows are never written (memory the kernel maps
        on first touch) and never read (HF's per-expert loop visits the experts hit). The checkpoint names
        them as the module's own parameters: HF's loading step would copy them unchanged."""
        import torch
        from accelerate.utils import set_module_tensor_to_device

        from models.checkpoint import read_tensors, stored_bytes

        got = read_tensors(self.index, list(self.fused), rows=chosen)
        rows = torch.tensor(chosen)
        for n, name in self.fused.items():
            want = self.targets.get(f"{self.routed}.{name}", got[n].dtype)
            whole = torch.empty(tuple(self.index[n][2]), dtype=want)
            whole[rows] = got[n].to(want)
            set_module_tensor_to_device(module, name, "cpu", value=whole, dtype=want)
        read = sum(stored_bytes(self.index, n) for n in self.fused) * len(chosen) // self.count
        READ["bytes"] += read
        self.bytes += read

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
            self.read([n for n in self.names if not EXPERT.search(n) and n not in self.fused] if sparse else None)
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


def _top_k(config, layer: int) -> int:
    """The experts each token of decoder layer `layer` chooses: num_experts_per_tok, one per layer where the
    config gives a list (HunYuan's moe_topk); 0: not known."""
    k = getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0
    return int(k[layer] if isinstance(k, (list, tuple)) else k)


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
    from models.checkpoint import LAYER, read_tensors, stored_bytes

    m = LAYER.search(names[0]) if names else None
    layer = None if m is None else (str(index[names[0]][0].parent), int(m.group(1)))
    if layer is not None and layer != RECENT["layer"]:
        RECENT["layer"], RECENT["tensors"] = layer, {}
    kept = RECENT["tensors"] if layer is not None else {}
    missing = [n for n in names if n not in kept]
    out = {n: kept[n] for n in names if n in kept}
    out.update(read_tensors(index, missing))  # (a released tensor's parts, dequantized)
    if layer is not None:
        kept.update({n: out[n] for n in missing})
    if counter is not None:  # a decoder layer's (the resident tensors are read once, at load)
        got = sum(stored_bytes(index, n) for n in missing)
        READ["bytes"] += got
        counter.bytes += got
    return out


def forget_reads() -> None:
    """Drop the layer RECENT keeps (the end of a check)."""
    RECENT["layer"], RECENT["tensors"] = None, {}


def tensor_bytes(entry) -> int:
    """Bytes of a checkpoint tensor (a tensor_index entry: shard, safetensors dtype, shape)."""
    from models.checkpoint import entry_bytes

    return entry_bytes(entry)


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

    from models.checkpoint import LAYER, CheckpointError, layer_groups, read_config, tensor_index, torch_dtype

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
                                 _top_k(config, int(m.group(1))))
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
    the CausalLM itself (transformers 5.23's Llama4ForCausalLM); a decoder that names them otherwise
    (DBRX's `blocks`, `norm_f`; LFM2's `embedding_norm`; Jamba's `final_layernorm`) seen under those names (RenamedDecoder)."""
    decoder = model.get_decoder()
    if hasattr(decoder, "layers") and hasattr(decoder, "norm"):
        return decoder
    if hasattr(decoder, "layers") and hasattr(decoder, "embedding_norm"):  # LFM2's final norm (after the layers)
        return RenamedDecoder(decoder, decoder.layers, decoder.embedding_norm)
    if hasattr(decoder, "layers") and hasattr(decoder, "norm_f"):  # Nemotron-H's
        return RenamedDecoder(decoder, decoder.layers, decoder.norm_f)
    if hasattr(decoder, "layers") and hasattr(decoder, "final_layernorm"):  # Jamba's
        return RenamedDecoder(decoder, decoder.layers, decoder.final_layernorm)
    if hasattr(decoder, "blocks") and hasattr(decoder, "norm_f"):
        return RenamedDecoder(decoder, decoder.blocks, decoder.norm_f)
    return decoder if hasattr(decoder, "layers") else model.model


class RenamedDecoder:
    """A decoder whose layer list and final norm HF names otherwise, under `layers` and `norm` (the
    modules themselves: the list can be edited in place); everything else is the decoder's."""

    def __init__(self, decoder, layers, norm):
        self.decoder, self.layers, self.norm = decoder, layers, norm

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def first_tensor(args, kwargs):
    import torch

    if args and torch.is_tensor(args[0]):
        return args[0]
    return kwargs["hidden_states"]


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
