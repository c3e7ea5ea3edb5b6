"""`eager`: the production torch model itself, fp32 or bf16.

Also the home of the helpers every torch-based backend shares: running one block of a
production model on the reference's calls.
"""

from __future__ import annotations

import torch

from models.layers import Transformer, block_fn, reset_state  # noqa: F401  (block_fn: re-exported)
from models.sampling import Sampler, check_args
from oracle import points
from oracle.backend import Backend, Candidate

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class TorchCandidate(Candidate):
    """A production torch model as a candidate (eager execution)."""

    block_mode = "isolated"

    def __init__(self, model: Transformer, dtype: torch.dtype, info: dict | None = None):
        self.model, self.dtype = model, dtype
        self.info = info or {"executor": f"torch {torch.__version__} eager"}

    @torch.no_grad()
    def prefill(self, tokens):
        reset_state(self.model)
        return self.model(torch.tensor([tokens]), torch.arange(len(tokens)))[0]

    @torch.no_grad()
    def decode(self, token, pos):
        return self.model(torch.tensor([[token]]), torch.tensor([pos]))[0, -1]

    @torch.no_grad()
    def run_block(self, layer, kind, calls):
        module, fn = block_fn(self.model, layer, kind)
        reset_state(module)
        return [fn(c.x.to(self.dtype), c.pos) for c in calls]

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

    def forward(self, x, pos):
        rec = points.Recorder(keep=True)
        with points.hooks(self.m, rec, self.kind), points.production_taps(rec):
            out = self.fn(x, pos)
        self.fired, self.registered = list(rec.fired), list(rec.points.registered)
        return (*(out if isinstance(out, tuple) else (out,)), *rec.values)


class EagerBackend(Backend):
    """`transform(model)` may modify the built model in place: how faults are injected."""

    precisions = tuple(DTYPES)
    # the production model in its precision, plus one layer's tensors as read (fresh, 10% slack);
    # measured peaks: full-size OLMoE (6.92 B) bf16 15.2 GiB, OLMoE --layers 2 (1.05 B) bf16 3.8 GiB
    memory_per_param = {"fp32": 4.4, "bf16": 2.4}
    memory_note = "the production model in memory"

    def __init__(self, name: str = "eager", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        return True, ""

    def with_fault(self, fault):
        """This backend with a seeded fault (models/faults.py) injected into the production model."""
        return type(self)(f"{self.name}+{fault.name}", fault.inject, fault.name)

    def load(self, model, spec):
        m = model.build_production(DTYPES[spec.precision])
        if self.transform is not None:
            self.transform(m)
        return TorchCandidate(m, DTYPES[spec.precision])


BACKEND = EagerBackend()
