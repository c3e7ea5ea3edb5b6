"""`hf`: HF transformers itself as the candidate: a sanity check of the harness that must
always pass (fp32: identical computation; bf16: HF in bf16 against HF in fp32).

Blocks are isolated without knowing HF's call signatures: the whole model is re-run on
the reference token sequence while hooks substitute the reference's captured input for
every block of one kind and record what that block returns. A streamed model (read from the
checkpoint layer by layer) runs only the block's own decoder layer, loaded once for every call,
the others skipped (`Skipped`): the same bytes, one layer read instead of the model per call.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from exporters.torch.candidate import device_availability, device_info, device_of, device_option, host
from oracle.backend import Backend, Candidate, InputError
from models.mapping import renamed
from oracle.drill import points
from oracle.reference.run import block_modules, call_router, model_args, normalize_output, hf_positions, router_reader
from oracle.reference.streaming import decoder_of, hold, load_hf_model, materialized, reference_mode, release_held
from oracle.schedule import LAYER_BY_LAYER, Ahead
from oracle.verdict.arithmetic import PRECISIONS as arithmetic_precisions, arithmetic
from oracle.verdict.replay import RouteLog
from oracle.verdict.selection import SelectionLog, indexers

# fp64: HF's exact answer for fp32's own measured error (oracle/verdict/noise.py exact_for), not a user precision;
# a8, abf16, af16: fp32 with the activations of every weight product rounded (oracle/verdict/arithmetic.py:
# llama.cpp's arithmetic on a GGUF's weights), the noise reference of a GGUF, not user precisions either
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp64": torch.float64,
          **{p: torch.float32 for p in arithmetic_precisions}}


def in_arithmetic(method):
    """The candidate's method run in its precision's arithmetic (oracle/verdict/arithmetic.py; none for fp32/bf16)."""
    @functools.wraps(method)
    def run(self, *args):
        with arithmetic(self.precision):
            return method(self, *args)
    return run


# the recurrent layers whose HF cache takes no chunk of several tokens after a first (transformers 5.23, measured on the
# tiny checkpoints: the invariance rows' 3 + 5 prefill), so the hf backend's chunked row runs token by token only
CHUNK_FROM_START = {
    "mamba": "HF's Mamba mixer (Jamba) computes a multi-token chunk after the first as a fresh prefill, its conv and "
             "scan state not read (jamba 3+5: logits 2.37 off)",
    "lightning": "HF's lightning attention (MiniMax) raises on a multi-token chunk after the first (a size mismatch "
                 "of its decay over the chunk and the cache)",
}


class HFCandidate(Candidate):
    block_mode = "isolated"

    def __init__(self, model, family, dtype, precision: str = "", device: str = "cpu"):
        self.model, self.family, self.dtype = model, family, dtype
        self.device = torch.device(device)  # where the model is: inputs moved there per call, outputs back
        self.precision = precision  # an arithmetic beyond the dtype (oracle/verdict/arithmetic.py), e.g. a8
        self.modules = block_modules(model, family)
        self.args = model_args(model, family)
        self.read_router = router_reader(family, self.args)
        self.cache = None
        self.kept = Ahead()  # what `ahead` computed, answered once each
        self.info = {"executor": "transformers eager"}
        # routers: (weights, indices), and their logits too where asked (oracle/verdict/noise.py reads the
        # precision's own selection scores from them)
        self.keep_router_logits = False
        # the experts each router selects (oracle/verdict/replay.py)
        self.routes = RouteLog({layer: m for (layer, kind), m in self.modules.items() if kind == "router"},
                               lambda out: normalize_output("router", out, router_output=self.read_router)[1::-1])

        # the keys each sparse-attention indexer selects (oracle/verdict/selection.py)
        self.selections = SelectionLog(indexers(decoder_of(model).layers))

    @property
    def streamed(self) -> bool:
        """Its decoder layers are read from the checkpoint for each forward (oracle/reference.load_streamed)."""
        return hasattr(self.model, "_oracle_streams")

    def last_routes(self):
        return self.routes.call()

    def block_routes(self):
        return self.routes.calls()

    def last_selections(self):
        return {layer: i for layer, (i, _) in self.selections.call().items()}

    @property
    def _router_items(self) -> int:
        return 3 if self.keep_router_logits else 2

    @torch.no_grad()
    @in_arithmetic
    def prefill(self, tokens):
        release_held()  # a layer its block rows kept: this run loads each layer itself
        self.routes.reset()
        self.selections.reset()
        out = self.model(input_ids=self._ids([tokens]), use_cache=True)
        self.cache = out.past_key_values
        return out.logits[0].cpu()

    def _ids(self, ids):
        return torch.tensor(ids, device=self.device)

    def ahead(self, ref, on_block=None, on_layer=None):
        """A streamed model's block rows and e2e steps, one layer at a time (oracle.schedule.Ahead: a generator
        the harness runs in turn with HF's noise measurement, so that a layer is read once for all); None for a
        model in memory."""
        if not self.streamed:
            return None
        self.kept = Ahead()
        return self.kept.run(self, ref, len(decoder_of(self.model).layers),
                             LayerByLayer(self, ref.tokens, ref.prompt_len, len(ref.logits)), self.routes, on_block, on_layer)

    def layer_by_layer(self, tokens, prompt_len: int, calls: int):
        """A streamed model's e2e steps of `calls` calls over `tokens`, one decoder layer at a time
        (LayerByLayer): how HF's own error at a precision is measured in turn with the other models of a
        check (oracle/verdict/noise.py)."""
        return LayerByLayer(self, tokens, prompt_len, calls)

    def teacher_forced(self, tokens, prompt_len, calls):
        """A streamed model's e2e steps layer by layer (LayerByLayer, every layer then the head; or as `ahead`
        ran them); None for a model in memory (call by call)."""
        if not self.streamed:
            return None
        return self.kept.steps(tokens, prompt_len, calls, lambda: LayerByLayer(self, tokens, prompt_len, calls))

    @torch.no_grad()
    @in_arithmetic
    def _through(self, layer, module, ids, hidden, routes):
        """One layer-by-layer stage (teacher_forced): `module` (decoder layer `layer`, or the final norm with
        `layer` None) run on every call with its input `hidden[c]` (None: the model's own, the embedding);
        returns its outputs per call (the logits for the final norm), `routes[c]` given its routers' choice."""
        outs, n = [], [0]

        def pre(mod, args, kwargs):
            x = hidden[n[0]]
            if x is None:
                return None
            if args and torch.is_tensor(args[0]):
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        def post(mod, args, kwargs, out):
            outs.append((out[0] if isinstance(out, tuple) else out).detach())

        h1 = module.register_forward_pre_hook(pre, with_kwargs=True)
        h2 = module.register_forward_hook(post, with_kwargs=True)
        try:
            with self._only_layer(layer):
                cache, start = None, 0
                for c, t in enumerate(ids):
                    self.routes.reset()
                    out = self.model(input_ids=self._ids([t]), past_key_values=cache, use_cache=True,
                                     **hf_positions(self.model, start, len(t)))
                    start += len(t)
                    cache = out.past_key_values
                    if routes is not None:
                        routes[c].update(self.routes.call())
                    else:
                        outs[-1] = out.logits.detach()
                    n[0] += 1
        finally:
            h1.remove()
            h2.remove()
        return outs

    @torch.no_grad()
    @in_arithmetic
    def extend(self, tokens, pos):
        if self.streamed:
            return None
        self.routes.reset()
        self.selections.reset()
        out = self.model(input_ids=self._ids([tokens]), past_key_values=self.cache, use_cache=True,
                         **hf_positions(self.model, pos, len(tokens)))
        self.cache = out.past_key_values
        return out.logits[0].cpu()

    @property
    def no_chunks(self):
        if self.streamed:
            return "a streamed model's prefill reads its layers for the whole prompt at once"
        kinds = set(self.args.layer_types) & set(CHUNK_FROM_START)
        if kinds:  # measured on the tiny checkpoints: HF's cache continues these layers one token at a time only
            return "; ".join(CHUNK_FROM_START[k] for k in sorted(kinds))
        return None
    no_batch = "a streamed model runs one sequence"

    @torch.no_grad()
    @in_arithmetic
    def batch(self, prompts):
        """The prompts right-padded to the longest with an attention mask (HF's padding), no cache."""
        if self.streamed:
            return None
        self.routes.reset()
        self.selections.reset()
        T = max(map(len, prompts))
        ids = self._ids([p + [0] * (T - len(p)) for p in prompts])
        mask = self._ids([[1] * len(p) + [0] * (T - len(p)) for p in prompts])
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits.cpu()
        routes = {layer: (i.reshape(len(prompts), T, -1), w.reshape(len(prompts), T, -1))
                  for layer, (i, w) in self.routes.call().items()}
        return ([logits[b, :len(p)] for b, p in enumerate(prompts)],
                [{layer: (i[b, :len(p)], w[b, :len(p)]) for layer, (i, w) in routes.items()}
                 for b, p in enumerate(prompts)])

    @torch.no_grad()
    @in_arithmetic
    def decode(self, token, pos):
        self.routes.reset()
        self.selections.reset()
        out = self.model(input_ids=self._ids([[token]]), past_key_values=self.cache, use_cache=True,
                         **hf_positions(self.model, pos, 1))
        self.cache = out.past_key_values
        return out.logits[0, -1].cpu()

    @torch.no_grad()
    @in_arithmetic
    def run_block(self, layer, kind, calls):
        if (kept := self.kept.block((layer, kind), calls, self.routes)) is not None:  # computed ahead (the first ask)
            return kept
        self.routes.reset()
        self.selections.reset()
        probes = [c for c in calls if c.probe]  # stateless single-token probes: call the module
        calls = [c for c in calls if not c.probe]
        with self._only_layer(layer), materialized(self.modules[layer, kind]):  # a streamed model: one load
            outs = self._replay(layer, kind, calls)
            for c in probes:
                x = c.x.to(self.device, self.dtype)
                block = self.modules[layer, kind]
                o = call_router(block, x.reshape(-1, x.shape[-1])) if kind == "router" else block(x)
                o = host(normalize_output(kind, o, keep_dtype=True, router_output=self.read_router))
                outs.append(o[: self._router_items] if kind == "router" else o)
        return outs

    @torch.no_grad()
    def run_block_points(self, layer, kind, calls):
        block, rec = self.modules[layer, kind], points.Recorder()
        with points.hooks(block, rec, kind), points.hf_taps(block, self.modules.get((layer, "router")), rec, self.args,
                                                      self.read_router):
            outs = self.run_block(layer, kind, calls)
        if kind != "router":  # the block's output as its row has it (Granite's logits: lm_head's, then scaled)
            rec.points["output"] = []
            for o in outs:
                rec.add("output", o)
        names = self.family.hf_point_names  # HF's submodule names -> the production model's (the drill's names)
        pts = rec.points.renamed(lambda n: renamed(n, names)) if names else rec.points
        return self.family.hf_point_view(pts, self.args, layer) if self.family.hf_point_view else pts

    def _replay(self, layer, kind, calls):
        target = self.modules[layer, kind]
        outputs, n = [], [0]

        def pre(mod, args, kwargs):
            x = calls[n[0]].x.to(self.device, self.dtype)
            if args and torch.is_tensor(args[0]):
                return (x.reshape(args[0].shape), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x.reshape(kwargs["hidden_states"].shape)}

        def post(mod, args, kwargs, out):
            o = host(normalize_output(kind, out, keep_dtype=True, router_output=self.read_router))
            outputs.append(o[: self._router_items] if kind == "router" else o)
            n[0] += 1

        h1 = target.register_forward_pre_hook(pre, with_kwargs=True)
        h2 = target.register_forward_hook(post, with_kwargs=True)
        try:
            cache = None
            for c in calls:
                out = self.model(input_ids=self._ids([c.tokens]), past_key_values=cache, use_cache=True,
                                 **hf_positions(self.model, int(c.pos_array[0]), len(c.tokens)))
                cache = out.past_key_values
                if kind == "logits":  # the model's logits (the reference's logits block), not the head's
                    outputs[-1] = out.logits.detach().cpu()
        finally:
            h1.remove()
            h2.remove()
        return outputs

    @contextlib.contextmanager
    def _only_layer(self, layer):
        """A streamed model's block replay reads one decoder layer, once: the block's input is the
        reference's, so no other layer's output reaches it, and every other layer is skipped
        (`Skipped`: its input passed through, its KV cache grown by as many positions as the layer's
        own would be, which is all HF reads of another layer's cache: the positions, the mask sizes);
        `layer` itself is loaded once for every call, and kept loaded (oracle.reference.streaming.hold) for the
        layer's other blocks (None: the final blocks, no layer). A model in memory runs whole."""
        if not self.streamed:
            yield
            return
        layers = decoder_of(self.model).layers
        kept = list(layers)
        try:
            for j, m in enumerate(kept):
                if j != layer:
                    layers[j] = Skipped(m, j)
            if layer is not None:  # loaded once for this block and the next ones of the layer
                hold(kept[layer]._oracle_stream)
            yield
        finally:
            for j, m in enumerate(kept):
                layers[j] = m


class LayerByLayer:
    """A streamed HF model's e2e steps (the prefill of tokens[:prompt_len], then `calls` - 1 decode steps fed
    the next tokens) run layer by layer: the tokens are known, and a decoder layer's output at a step depends
    only on the layer before's outputs up to that step; so each layer is loaded once and run over every call
    in order with its own cache (`through(layer)`, layers in order), its outputs ([1, T, H] per call) kept as
    the next layer's inputs, the other layers skipped (HFCandidate._only_layer); then the final norm and the
    head (`finish`). The same numbers as the calls one by one, each layer read once instead of once per
    step; a caller may run other work on a layer between its `through`s (the noise's block rows)."""

    def __init__(self, cand, tokens, prompt_len: int, calls: int):
        self.cand, self.done = cand, 0
        self.ids = [list(tokens[:prompt_len])] + [[tokens[prompt_len + k - 1]] for k in range(1, calls)]
        self.decoder = decoder_of(cand.model)
        self.layers = len(self.decoder.layers)
        self.hidden, self.routes = [None] * calls, [{} for _ in self.ids]

    def through(self, layer: int) -> None:
        if layer != self.done:
            raise ValueError(f"layer {layer} run before layer {self.done}")
        self.hidden = self.cand._through(layer, self.decoder.layers[layer], self.ids, self.hidden, self.routes)
        self.done += 1

    def finish(self) -> tuple[list, list]:
        """(each call's logits as prefill / decode return them, each call's routes as last_routes)."""
        if self.done != self.layers:
            raise ValueError(f"{self.done} of {self.layers} layers run")
        try:
            logits = self.cand._through(None, self.decoder.norm, self.ids, self.hidden, None)
        finally:
            release_held()
        return [lg[0].cpu() if k == 0 else lg[0, -1].cpu() for k, lg in enumerate(logits)], self.routes


class Skipped(torch.nn.Module):
    """A decoder layer left out of a streamed block replay (HFCandidate._only_layer): returns its input
    hidden states, and grows its KV cache (where it has one: not a linear-attention layer's) by the
    call's positions, with placeholders no other layer reads. Its attributes (attention_type,
    layer_type: what HF's decoder reads to pick the layer's mask) are the layer's."""

    def __init__(self, layer, index: int):
        super().__init__()
        object.__setattr__(self, "layer", layer)  # not a submodule: its weights stay where they are
        self.index = index

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "layer"), name)

    def forward(self, hidden_states, *args, **kwargs):
        from transformers.cache_utils import DynamicLayer

        cache = kwargs.get("past_key_values")
        if cache is not None and hasattr(cache, "layers"):
            own = cache.layers[self.index] if self.index < len(cache.layers) else None
            if own is None or isinstance(own, DynamicLayer):
                B, T = hidden_states.shape[0], hidden_states.shape[-2]
                d = hidden_states.new_zeros(B, 1, T, 1)
                cache.update(d, d, self.index)
        return hidden_states


class HFBackend(Backend):
    precisions = ("fp32", "bf16")
    option_schema = (device_option("HF transformers' model"),)

    def __init__(self, name: str = "hf", fault=None):
        self.name, self.fault = name, fault  # fault: a seeded fault's HF form (exporters/torch/hf_faults.py)

    def availability(self):
        return True, ""

    def availability_for(self, spec):
        return device_availability(self, spec)

    def with_fault(self, fault):
        """This backend with a seeded fault on HF's own modules; None where it has no form there."""
        from exporters.torch import hf_faults

        return None if hf_faults.not_applicable(fault) else type(self)(f"{self.name}+{fault.name}", fault)

    def fault_not_applicable(self, fault) -> str | None:
        from exporters.torch import hf_faults

        return hf_faults.not_applicable(fault)

    # whole (up to 1 GiB of fp32 weights): from_pretrained holds the mapped bf16 checkpoint and the model
    # (measured ~10 bytes per parameter at fp32); streamed: memory_estimate below
    memory_per_param = {"fp32": 1.2, "bf16": 1.0}

    def memory_estimate(self, src, spec):
        """In memory (whole): memory_per_param. Streamed (over 1 GiB of fp32 weights): what stays is the
        embedding and head, and at most two decoder layers at a time (one in use, one being read), in fp32
        (the reference's, captured in the same process; the candidate's at bf16 are smaller): the bound
        tests/test_reference.py measures (1.04 GiB for 2.04 GiB of fp32 weights)."""
        from oracle.reference.streaming import mode_for, streamed_memory

        if spec.precision not in self.memory_per_param:
            return None, ""
        if mode_for(src.parameter_count()) != "streamed":
            return super().memory_estimate(src, spec)
        return streamed_memory(src)

    def load(self, model, spec):
        cand = self._load(model, spec)
        if self.fault is not None:
            from exporters.torch import hf_faults
            from oracle.backend import InputError

            if cand.streamed:
                raise InputError(f"{self.fault.name}: a seeded fault needs HF's model in memory (this checkpoint "
                                 "is streamed from disk)")
            hf_faults.inject(self.fault, cand)
        return cand

    def _load(self, model, spec):
        dtype, device = DTYPES[spec.precision], device_of(spec)
        if reference_mode(model.model_dir) == "streamed":  # as the reference: layers read from the checkpoint
            if device != "cpu":
                raise InputError(f"--option device={device}: this checkpoint is streamed from disk (its decoder layers "
                                 "read for each forward, over the in-memory size); HF on the GPU needs the whole "
                                 "model in memory")
            cand = HFCandidate(load_hf_model(model.family, model.model_dir, dtype, streamed=True),
                               model.family, dtype, spec.precision)
            cand.info["executor"] += " (decoder layers read from the checkpoint's shards for each forward)"
            cand.info["schedule"] = LAYER_BY_LAYER
            return cand
        m = load_hf_model(model.family, model.model_dir, dtype).to(device)  # cpu: where it already is
        cand = HFCandidate(m, model.family, dtype, spec.precision, device)
        cand.info = device_info(cand.info, device)
        return cand


BACKEND = HFBackend()
