"""`eager`: the production torch model itself, fp32 or bf16; streamed from its checkpoint and run layer
by layer where it does not fit in memory whole.

Also the home of the helpers every torch-based backend shares: running one block of a
production model on the reference's calls.
"""

from __future__ import annotations

import contextlib

import torch

from models.layers import STATE_BUFFERS, SparseMoE, Transformer, block_fn, reset_state  # noqa: F401  (block_fn: re-exported)
from models.sampling import Sampler, check_args
from oracle import points
from oracle.backend import Backend, Candidate, Option
from oracle.reference import forced_mode, hold, layer_tensors, release_held, trim_heap
from oracle.replay import RouteLog
from oracle.schedule import LAYER_BY_LAYER, Ahead

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
DEVICES = ("cpu", "cuda")


def device_option(what: str) -> Option:
    """`--option device=cpu|cuda` of a torch candidate: cuda runs it on the GPU, the control that tells a
    compiler's error from the GPU's (docs/cuda.md)."""
    return Option("device", str, DEVICES, "cpu",
                  f"where {what} runs: cuda moves it to the GPU (inputs moved per call, outputs back to the "
                  "host; the reference stays HF fp32 on the host): the GPU control for `cuda` (docs/cuda.md)",
                  None, ("check",))


def cuda_unavailable() -> str | None:
    """Why torch cannot run on a CUDA GPU here, or None."""
    if torch.version.cuda is None:
        return f"torch is a CPU build ({torch.__version__})"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def device_of(spec) -> str:
    return (spec.options or {}).get("device") or "cpu"


def device_availability(backend, spec) -> tuple[bool, str]:
    """The backend's availability for a check with --option device=...: cuda without a GPU here is
    skipped with the reason (exit 3 with --require), not bad input: the same command runs on a GPU host."""
    why = cuda_unavailable() if device_of(spec) == "cuda" else None
    return (False, f"--option device=cuda: {why}") if why else backend.availability()


def device_info(info: dict, device: str) -> dict:
    """The report's executor facts with the device (the GPU's name among the host facts, which no
    comparison reads)."""
    if device == "cpu":
        return info
    return {**info, "executor": f"{info['executor']} on {device}", "device": device,
            "host": {"device_name": torch.cuda.get_device_name()}}


def host(out):
    """A block's output(s) back on the host (a tensor, or a tuple / list of them)."""
    if torch.is_tensor(out):
        return out.cpu()
    if isinstance(out, (tuple, list)):
        return type(out)(host(o) for o in out)
    return out


def reset_routes(cand) -> None:
    """Start a call's record of the experts chosen (a plugin borrowing these methods may have none)."""
    log = cand.__dict__.get("routes")
    if log is not None:
        log.reset()


def settle_routes(cand) -> None:
    """The experts the call just run chose, kept (oracle.replay.RouteLog.settle)."""
    log = cand.__dict__.get("routes")
    if log is not None:
        log.settle()


def _device(cand) -> torch.device:
    return cand.__dict__.get("device", torch.device("cpu"))


def _forward(cand):
    return cand.__dict__.get("forward", cand.model)


class TorchCandidate(Candidate):
    """A production torch model as a candidate (eager execution)."""

    block_mode = "isolated"

    def __init__(self, model: Transformer, dtype: torch.dtype, info: dict | None = None, device: str = "cpu"):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)  # the model is on `device`
        self.info = info or {"executor": f"torch {torch.__version__} eager"}
        self.forward = model  # what prefill / decode call (a compiled candidate: the compiled model)
        # the experts each router selects (oracle/replay.py): hooks on the production routers
        self.routes = RouteLog({i: layer.mlp.gate for i, layer in enumerate(model.layers)
                                if isinstance(layer.mlp, SparseMoE)}, lambda out: (out[1], out[0]))

    def last_routes(self):
        return self.routes.call()

    def block_routes(self):
        return self.routes.calls()

    def block(self, layer, kind):
        """(the block's module, the function run_block calls)."""
        return block_fn(self.model, layer, kind)

    # prefill, decode and run_block may be borrowed by a plugin's candidate with only `model` and
    # `dtype` (tests/test_contract.py): on the CPU, the model called as it is, its blocks as block_fn's
    @torch.no_grad()
    def prefill(self, tokens):
        reset_state(self.model)
        reset_routes(self)
        dev = _device(self)
        return _forward(self)(torch.tensor([tokens], device=dev), torch.arange(len(tokens), device=dev))[0].cpu()

    @torch.no_grad()
    def decode(self, token, pos):
        reset_routes(self)
        dev = _device(self)
        return _forward(self)(torch.tensor([[token]], device=dev), torch.tensor([pos], device=dev))[0, -1].cpu()

    @torch.no_grad()
    def run_block(self, layer, kind, calls):
        module, fn = self.block(layer, kind) if isinstance(self, TorchCandidate) else block_fn(self.model, layer, kind)
        reset_state(module)
        reset_routes(self)
        dev = _device(self)
        outs = []
        for c in calls:
            outs.append(host(fn(c.x.to(dev, self.dtype), c.pos.to(dev))))
            settle_routes(self)
        return outs

    @torch.no_grad()
    def run_block_points(self, layer, kind, calls):
        module, _ = block_fn(self.model, layer, kind)
        rec = points.Recorder()
        with points.hooks(module, rec, kind), points.production_taps(rec):
            self.run_block(layer, kind, calls)
        return rec.points

    # the on-device sampler (models/sampling.py), run eagerly
    sampler = Sampler()

    @torch.no_grad()
    def sample_logits(self, logits, temperature, top_p, seed):
        check_args(temperature, top_p)
        lg = torch.as_tensor(logits).reshape(1, -1)
        return int(self.sampler(lg, torch.tensor(float(temperature)), torch.tensor(float(top_p)),
                                torch.tensor(int(seed)))[0])

    def sample_prefill(self, tokens, temperature, top_p, seed):
        check_args(temperature, top_p)
        return self.sample_logits(self.prefill(tokens)[-1], temperature, top_p, seed)

    def sample_decode(self, token, pos, temperature, top_p, seed):
        check_args(temperature, top_p)
        return self.sample_logits(self.decode(token, pos), temperature, top_p, seed)


class PointsCall(torch.nn.Module):
    """A block with its drill points as extra outputs, for a backend that compiles programs (the
    points cannot be read from inside them): forward(x, pos) -> (*the block's outputs, *its points
    as fp32, in firing order). After a trace, `fired` names each point output and `registered` lists
    the block's submodule paths. `m` is the block's module, under the name _Call gives it: a block
    program's weight and state names are this module's too."""

    def __init__(self, module: torch.nn.Module, fn, kind: str):
        super().__init__()
        self.m, self.fn, self.kind = module, fn, kind
        self.fired, self.registered = [], []
        self.rec = None  # the recorder while recording() is on

    def forward(self, x, pos):
        if self.rec is not None:  # recording() is on (a strict export: dynamo traces hooks, not their set-up)
            self.rec.fired.clear()
            self.rec.values.clear()
            rec, out = self.rec, self.fn(x, pos)
        else:
            rec = points.Recorder(keep=True)
            with points.hooks(self.m, rec, self.kind), points.production_taps(rec):
                out = self.fn(x, pos)
            # in place: torch.export puts back attributes a traced module assigns
            self.fired[:], self.registered[:] = rec.fired, rec.points.registered
        return (*(out if isinstance(out, tuple) else (out,)), *rec.values)

    @contextlib.contextmanager
    def recording(self):
        """The recorder set up outside forward, for a strict (dynamo) export."""
        self.rec = points.Recorder(keep=True)
        try:
            with points.hooks(self.m, self.rec, self.kind), points.production_taps(self.rec):
                yield
        finally:
            self.rec = None


class PointsProgram(torch.nn.Module):
    """A PointsCall with the block's state as inputs and results, its weights the module's own (a
    backend that lowers one program for the drilled block, its weights constants as in its
    production program): forward(x, pos, *state) -> (*outputs, *points, *new state)."""

    def __init__(self, call: PointsCall):
        super().__init__()
        self.call = call
        self.state = [n for n, _ in call.named_buffers() if n.rsplit(".", 1)[-1] in STATE_BUFFERS]

    def state_examples(self) -> list[torch.Tensor]:
        """Fresh state (zeros), one distinct tensor per input."""
        buffers = dict(self.call.named_buffers())
        return [torch.zeros_like(buffers[n]) for n in self.state]

    def forward(self, x, pos, *state):
        new = [s.clone() for s in state]
        out = torch.func.functional_call(self.call, dict(zip(self.state, new)), (x, pos), strict=False)
        return (*out, *new)

    def export(self, lengths: list[int], hidden: int, dtype: torch.dtype) -> tuple[dict, dict]:
        """({f"points_t{T}": the non-strict torch.export at each length}, what running them needs:
        "fired" (per T, the points in output order), "registered" (the block's submodule paths),
        "state" ([shape, dtype] per state input))."""
        methods, fired = {}, {}
        state = self.state_examples()
        with torch.no_grad():
            for T in lengths:
                args = (torch.zeros(1, T, hidden, dtype=dtype), torch.arange(T), *state)
                self(*args)  # eagerly (the state is functional: nothing changes), for the names: the
                fired[T] = list(self.call.fired)  # export runs the forward on a copy of the module
                methods[f"points_t{T}"] = torch.export.export(self, args, strict=False)
        return methods, {"fired": fired, "registered": self.call.registered,
                         "state": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in state]}


class EagerBackend(Backend):
    """`transform(model)` may modify the built model in place: how faults are injected."""

    precisions = tuple(DTYPES)
    option_schema = (device_option("the production model"),)
    # the production model in its precision, plus one layer's tensors as read (fresh, 10% slack);
    # measured peaks: full-size OLMoE (6.92 B) bf16 15.2 GiB, OLMoE --layers 2 (1.05 B) bf16 3.8 GiB
    # (device=cuda: built on the host, then moved)
    memory_per_param = {"fp32": 4.4, "bf16": 2.4}
    memory_note = "the production model in memory"

    def __init__(self, name: str = "eager", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        return True, ""

    def availability_for(self, spec):
        return device_availability(self, spec)

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults.py) injected into the production model."""
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.id)

    def streams(self, src, spec) -> bool:
        """The production model is streamed from the checkpoint (build_streamed) where it would
        not fit in memory whole (its memory_per_param estimate over what is available);
        $MOE_ORACLE_REFERENCE=whole|streamed forces one (as it does for HF's)."""
        from oracle.backend import BASE_MEMORY, available_memory

        if forced_mode() is not None:
            return forced_mode() == "streamed"
        avail = available_memory()
        return avail is not None and super().memory_estimate(src, spec)[0] + BASE_MEMORY > avail

    def memory_estimate(self, src, spec):
        """Whole: memory_per_param. Streamed (where the whole would not fit): as the streamed reference, whose
        bound covers the production model's layers beside it (oracle.reference.streamed_memory)."""
        from oracle.reference import streamed_memory

        if spec.precision not in self.memory_per_param or not self.streams(src, spec):
            return super().memory_estimate(src, spec)
        return streamed_memory(src)

    def load(self, model, spec):
        device = device_of(spec)
        if self.streams(model, spec):
            return self._load_streamed(model, spec, device)
        m = model.build_production(DTYPES[spec.precision])
        if self.transform is not None:
            self.transform(m)
        info = device_info({"executor": f"torch {torch.__version__} eager"}, device)
        return TorchCandidate(m.to(device), DTYPES[spec.precision], info, device)

    def _load_streamed(self, src, spec, device):
        from oracle.backend import InputError

        if device != "cpu":
            raise InputError(f"--option device={device}: this checkpoint is streamed from disk (the production model "
                             "would not fit in memory whole); the model on the GPU needs it in memory")
        if self.transform is not None:
            raise InputError(f"{self.name}: a seeded fault needs the production model in memory (this checkpoint is "
                             "streamed from disk)")
        info = {"executor": f"torch {torch.__version__} eager (decoder layers read from the checkpoint's shards for "
                            "each use)",
                "schedule": LAYER_BY_LAYER}
        return StreamedTorchCandidate(build_streamed(src, DTYPES[spec.precision]), DTYPES[spec.precision], info)


# ---------------------------------------------------------------- streamed from the checkpoint
# For a model that does not fit in memory: the decoder layers hold their weights only while in use
# (`LayerWeights`: read from the checkpoint's shards, sanitized and converted by the family's own rules, dropped
# after), and the check runs it layer by layer (`Steps`, oracle/schedule.py): each layer loaded once for its
# block rows and its stage of the e2e steps, in turn with HF's noise measurement, so that the checkpoint's bytes
# are read from disk once for all.


class LayerWeights:
    """One decoder layer of a production model whose parameters are read from the checkpoint when the layer
    is in use and put back on the meta device after (the acquire / release protocol of
    oracle.reference.LayerStream, so that `hold` and `materialized` apply): in use during its forward, or while
    held. Its state buffers (KV cache, recurrent state) stay."""

    def __init__(self, family, model, layer: int, names: list, index: dict, args, dtype):
        self.family, self.model, self.index, self.names, self.args, self.dtype = family, model, index, names, args, dtype
        self.layer = model.layers[layer]
        self.prefix = f"layers.{layer}."
        self.users, self.bytes = 0, 0
        for m in self.layer.modules():
            m._oracle_stream = self
        self.layer.register_forward_pre_hook(lambda m, a: self.acquire())
        self.layer.register_forward_hook(lambda m, a, out: self.release())

    def acquire(self):
        if self.users == 0:
            self.read()
        self.users += 1

    def release(self):
        self.users -= 1
        if self.users == 0:
            self.drop()

    def read(self):
        from accelerate.utils import set_module_tensor_to_device

        from models.checkpoint import CheckpointError

        raw = layer_tensors(self.index, self.names, self)
        group = self.family.production_group(raw, self.args, self.dtype)
        own = dict(self.layer.named_parameters())
        for name, value in group.items():
            if not name.startswith(self.prefix) or name[len(self.prefix):] not in own:
                raise CheckpointError(f"{name}: not a parameter of the production model's layer {self.prefix[:-1]}")
            set_module_tensor_to_device(self.layer, name[len(self.prefix):], "cpu", value=value, dtype=value.dtype)
        missing = [n for n, p in self.layer.named_parameters() if p.is_meta]
        if missing:
            raise CheckpointError(f"missing tensor(s) of {self.prefix[:-1]}: {', '.join(missing[:6])}")

    def drop(self):
        from accelerate.utils import set_module_tensor_to_device

        for name, _ in list(self.layer.named_parameters()):
            set_module_tensor_to_device(self.layer, name, "meta")
        trim_heap()


def build_streamed(src, dtype):
    """The production model of `src` (an oracle.backend.ModelSource) with the tensors outside the decoder
    layers resident and each layer's read when in use (LayerWeights); `_oracle_streams` lists those."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device

    from models.checkpoint import LAYER, CheckpointError, layer_groups, read_tensors, tensor_index
    from models.layers import Transformer

    index = tensor_index(src.model_dir)
    with init_empty_weights(include_buffers=False):
        model = Transformer(src.args, dtype)
    streams = []
    for names in layer_groups(index):
        m = LAYER.search(names[0])
        if m is not None and int(m.group(1)) < len(model.layers):
            streams.append(LayerWeights(src.family, model, int(m.group(1)), names, index, src.args, dtype))
            continue
        for name, value in src.family.production_group(read_tensors(index, names), src.args, dtype).items():
            set_module_tensor_to_device(model, name, "cpu", value=value, dtype=value.dtype)
    missing = [n for n, p in model.named_parameters() if p.is_meta and not n.startswith("layers.")]
    if missing:
        raise CheckpointError(f"missing tensor(s): {', '.join(missing[:6])}")
    model._oracle_streams = streams
    return model.eval()


class Steps:
    """The production model's e2e steps layer by layer (the prefill of tokens[:prompt_len], then `calls` - 1
    decode steps fed the next tokens): the embedding, then `through(layer)` for each layer in order (its
    state reset, then every call in order, its outputs the next layer's inputs), then `finish` (the final
    norm and the head). The production model's own modules and state; the same operations as its forward
    call by call."""

    def __init__(self, cand, tokens, prompt_len: int, calls: int):
        self.cand, self.done = cand, 0
        ids = [list(tokens[:prompt_len])] + [[tokens[prompt_len + k - 1]] for k in range(1, calls)]
        self.pos = [torch.arange(len(ids[0]))] + [torch.tensor([prompt_len + k - 1]) for k in range(1, calls)]
        model = cand.model
        with torch.no_grad():
            self.hidden = []
            for t in ids:  # Transformer.forward's embedding
                x = model.embed_tokens(torch.tensor([t]))
                self.hidden.append(x * model.args.multipliers.embedding if model.args.multipliers.embedding != 1.0 else x)
        self.routes = [{} for _ in ids]
        self.layers = len(model.layers)

    @torch.no_grad()
    def through(self, layer: int) -> None:
        if layer != self.done:
            raise ValueError(f"layer {layer} run before layer {self.done}")
        module = self.cand.model.layers[layer]
        hold(module._oracle_stream)
        reset_state(module)
        for c, (x, pos) in enumerate(zip(self.hidden, self.pos)):
            self.cand.routes.reset()
            self.hidden[c] = module(x, pos)
            self.routes[c].update(self.cand.routes.call())
        self.done += 1

    @torch.no_grad()
    def finish(self) -> tuple[list, list]:
        if self.done != self.layers:
            raise ValueError(f"{self.done} of {self.layers} layers run")
        release_held()
        model = self.cand.model
        logits = [model.lm_head(model.norm(x)) for x in self.hidden]
        return [lg[0] if k == 0 else lg[0, -1] for k, lg in enumerate(logits)], self.routes


class StreamedTorchCandidate(TorchCandidate):
    """The production model streamed (build_streamed): its block rows and e2e steps computed ahead, layer by
    layer (`ahead`), a block's layer held while its blocks run; prefill and decode (other prompts, the
    sampler) read each layer for each forward."""

    def __init__(self, model, dtype, info=None):
        super().__init__(model, dtype, info)
        self.kept = Ahead()

    def ahead(self, ref, on_block=None, on_layer=None):
        self.kept = Ahead()
        return self.kept.run(self, ref, len(self.model.layers), Steps(self, ref.tokens, ref.prompt_len, len(ref.logits)),
                             self.routes, on_block, on_layer)

    def teacher_forced(self, tokens, prompt_len, calls):
        return self.kept.steps(tokens, prompt_len, calls, lambda: Steps(self, tokens, prompt_len, calls))

    def prefill(self, tokens):
        release_held()  # a layer its block rows kept: this run loads each layer itself
        return super().prefill(tokens)

    def run_block(self, layer, kind, calls):
        if (kept := self.kept.block((layer, kind), calls, self.routes)) is not None:  # computed ahead (the first ask)
            return kept
        if layer is not None:  # loaded once for this block and the next ones of the layer
            hold(self.model.layers[layer]._oracle_stream)
        return super().run_block(layer, kind, calls)


BACKEND = EagerBackend()
