"""The production torch model as a candidate, and what every torch-based backend shares: its
device (cpu or cuda: the GPU control), one block of the model run on the reference's calls, the
routes its routers chose, the drill's points."""

from __future__ import annotations

import contextlib

import torch

from models.args import STATE_BUFFERS, layer_kinds
from models.layers.hash_router import feed_tokens
from models.layers.moe import SparseMoE
from models.layers.sampling import Sampler, check_args
from models.layers.transformer import Transformer, alone, block_fn, reset_state
from oracle.backend import Candidate, Option
from oracle.drill import points
from oracle.verdict.replay import RouteLog
from oracle.verdict.selection import SelectionLog, indexers

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
    for name in ("routes", "selections"):
        log = cand.__dict__.get(name)
        if log is not None:
            log.reset()


def settle_routes(cand) -> None:
    """The experts the call just run chose, kept (oracle.verdict.replay.RouteLog.settle)."""
    log = cand.__dict__.get("routes")
    if log is not None:
        log.settle()


@contextlib.contextmanager
def batched_state(model: torch.nn.Module, batch: int):
    """Every state buffer of `model` ([1, ...]) replaced by zeros of `batch` sequences while inside; put back after."""
    swapped = []
    try:
        for mod in model.modules():
            for name, buf in list(mod._buffers.items()):
                if buf is not None and name in STATE_BUFFERS:
                    if buf.shape[0] != 1:
                        raise ValueError(f"state buffer {name} {list(buf.shape)} has no batch dimension of 1")
                    swapped.append((mod, name, buf))
                    mod._buffers[name] = torch.zeros((batch, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
        yield
    finally:
        for mod, name, buf in swapped:
            mod._buffers[name] = buf


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
        # the experts each router selects (oracle/verdict/replay.py): hooks on the production routers
        # (a layer whose routing is a block the harness checks: not DeepSeek-V4's hash layers, tid2eid[token])
        self.routes = RouteLog({i: layer.mlp.gate for i, layer in enumerate(model.layers)
                                if isinstance(getattr(layer, "mlp", None), SparseMoE)
                                and "router" in layer_kinds(model.args, i)}, lambda out: (out[1], out[0]))
        # the keys each sparse-attention indexer selects (oracle/verdict/selection.py)
        self.selections = SelectionLog(indexers(model.layers))

    def last_routes(self):
        return self.routes.call()

    def last_selections(self):
        return {layer: i for layer, (i, _) in self.selections.call().items()}

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

    no_chunks = None  # extend: a chunk after the first

    @torch.no_grad()
    def extend(self, tokens, pos):
        reset_routes(self)
        dev = _device(self)
        return _forward(self)(torch.tensor([tokens], device=dev), torch.arange(pos, pos + len(tokens), device=dev))[0].cpu()

    no_batch = "the production model's state (KV cache, conv and recurrent state) holds one sequence"

    @torch.no_grad()
    def batch(self, prompts):
        """The prompts right-padded to the longest, in one forward with every state buffer widened to the batch
        (causal: a prompt's rows never see the padding after it); the state is reset by the next prefill."""
        if not isinstance(self, TorchCandidate) or self.forward is not self.model:
            return None  # a compiled forward (cuda) traced for one sequence
        reset_routes(self)
        dev, T = _device(self), max(map(len, prompts))
        ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts], device=dev)
        with batched_state(self.model, len(prompts)):
            logits = self.model(ids, torch.arange(T, device=dev)).cpu()
        routes = {layer: (i.reshape(len(prompts), T, -1), w.reshape(len(prompts), T, -1))
                  for layer, (i, w) in self.routes.call().items()}
        return ([logits[b, :len(p)] for b, p in enumerate(prompts)],
                [{layer: (i[b, :len(p)], w[b, :len(p)]) for layer, (i, w) in routes.items()}
                 for b, p in enumerate(prompts)])

    @torch.no_grad()
    def run_block(self, layer, kind, calls):
        module, fn = self.block(layer, kind) if isinstance(self, TorchCandidate) else block_fn(self.model, layer, kind)
        reset_state(module, keep_routers=kind == "layer")  # (ZAYA: a layer's router state is its router row's)
        reset_routes(self)
        dev = _device(self)
        outs = []
        for c in calls:
            if c.tokens:  # a block that reads the call's token ids (DeepSeek-V4's hash routers) gets them
                feed_tokens(module, torch.tensor([list(c.tokens)], device=dev))
            # (a probe: no other layer's state; a layer: its router's state left as its router row wrote it)
            with alone(module, c.probe) if c.probe or kind == "layer" else contextlib.nullcontext():
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

    # the on-device sampler (models/layers/sampling.py), run eagerly
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
        "state" ([shape, dtype] per state input), "state_names" (their buffer names))."""
        methods, fired = {}, {}
        state = self.state_examples()
        with torch.no_grad():
            for T in lengths:
                args = (torch.zeros(1, T, hidden, dtype=dtype), torch.arange(T), *state)
                self(*args)  # eagerly (the state is functional: nothing changes), for the names: the
                fired[T] = list(self.call.fired)  # export runs the forward on a copy of the module
                methods[f"points_t{T}"] = torch.export.export(self, args, strict=False)
        return methods, {"fired": fired, "registered": self.call.registered,
                         "state": [[list(t.shape), str(t.dtype).removeprefix("torch.")] for t in state], "state_names": self.state}
