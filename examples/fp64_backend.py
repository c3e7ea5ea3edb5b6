"""An example backend plugin: the family's production model run in float64.

    oracle check --family olmoe --backend examples.fp64_backend:BACKEND

A backend subclasses oracle.backend.Backend: `name`, `availability()` and `load(model, spec)`;
`load` returns an oracle.backend.Candidate with `prefill`, `decode` and `run_block`. Every other
member is optional, with its default on the base class (see oracle/backend.py).
"""

import torch

from models.layers.transformer import block_fn, reset_state
from oracle.backend import Backend, Candidate


class Fp64Candidate(Candidate):
    def __init__(self, model):
        self.model = model
        self.info = {"executor": "torch eager, float64"}

    @torch.no_grad()
    def prefill(self, tokens):  # -> logits [T, V]; a new sequence
        reset_state(self.model)
        return self.model(torch.tensor([tokens]), torch.arange(len(tokens)))[0].float()

    @torch.no_grad()
    def decode(self, token, pos):  # -> logits [V]; carries the state
        return self.model(torch.tensor([[token]]), torch.tensor([pos]))[0, -1].float()

    @torch.no_grad()
    def run_block(self, layer, kind, calls):  # one output per call, state fresh at the first
        module, fn = block_fn(self.model, layer, kind)
        reset_state(module)
        # computed in float64, returned in the checked precision's dtype (fp32): the harness
        # gates the output dtype, so a candidate reports what its model declares
        return [_float(fn(c.x.double(), c.pos)) for c in calls]


def _float(out):
    return tuple(t.float() if t.is_floating_point() else t for t in out) if isinstance(out, tuple) else out.float()


class Fp64Backend(Backend):
    name = "fp64"
    precisions = ("fp32",)  # judged against the fp32 thresholds

    def availability(self):
        return True, ""

    def load(self, model, spec):
        return Fp64Candidate(model.build_production(torch.float64))


BACKEND = Fp64Backend()
