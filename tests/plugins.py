"""Backends for the tests: unavailable, crashing, producing NaN."""

import torch

from exporters.eager import EagerBackend


class Unavailable:
    name = "unavailable"

    def availability(self):
        return False, "needs a flux capacitor"

    def load(self, model, spec):
        raise AssertionError("never loaded")


class Crashing(EagerBackend):
    def load(self, model, spec):
        raise RuntimeError("kernel exploded")


def _nan_moe(model):
    moe = model.layers[0].mlp
    fwd = type(moe).forward
    moe.forward = lambda x: fwd(moe, x) * torch.where(torch.rand(()) < 2, float("nan"), 1.0)


UNAVAILABLE = Unavailable()
CRASHING = Crashing(name="crashing")
NAN_IN_MOE = EagerBackend(name="nan", transform=_nan_moe)


class FaultBlind(EagerBackend):
    """Claims to inject faults but does not: the selftest must notice."""

    def with_fault(self, fault):
        return EagerBackend(name=f"blind+{fault.name}")


FAULT_BLIND = FaultBlind(name="blind")


class Switchable(EagerBackend):
    """Correct, unless ORACLE_TEST_BREAK names a fault to inject (a regression to diff)."""

    def load(self, model, spec):
        import os

        from models import faults

        name = os.environ.get("ORACLE_TEST_BREAK")
        self.transform = faults.get(name).inject if name else None
        return super().load(model, spec)


class Dies(EagerBackend):
    def load(self, model, spec):
        import os

        os._exit(9)  # a hard crash: no exception, no report


class Hangs(EagerBackend):
    def load(self, model, spec):
        import time

        time.sleep(600)


SWITCHABLE = Switchable(name="switchable")
DIES = Dies(name="dies")
HANGS = Hangs(name="hangs")


class _EpsGreedyCandidate:
    """temperature 0 replaced by 1e-5 with Gumbel noise (the 'avoid dividing by zero' bug)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def sample_logits(self, logits, temperature, top_p, seed):
        return self.inner.sample_logits(logits, temperature or 1e-5, top_p, seed)

    def sample_prefill(self, tokens, temperature, top_p, seed):
        return self.sample_logits(self.inner.prefill(tokens)[-1], temperature, top_p, seed)

    def sample_decode(self, token, pos, temperature, top_p, seed):
        return self.sample_logits(self.inner.decode(token, pos), temperature, top_p, seed)


class _StuckSeedCandidate(_EpsGreedyCandidate):
    """The runner forgets to advance the seed: every decode step reuses the prefill's."""

    def sample_logits(self, logits, temperature, top_p, seed):
        return self.inner.sample_logits(logits, temperature, top_p, seed)

    def sample_prefill(self, tokens, temperature, top_p, seed):
        self.seed0 = seed
        return super().sample_prefill(tokens, temperature, top_p, seed)

    def sample_decode(self, token, pos, temperature, top_p, seed):
        return super().sample_decode(token, pos, temperature, top_p, self.seed0)


class Wrapping(EagerBackend):
    def __init__(self, name, wrapper):
        super().__init__(name)
        self.wrapper = wrapper

    def load(self, model, spec):
        return self.wrapper(super().load(model, spec))


EPS_GREEDY = Wrapping("eps-greedy", _EpsGreedyCandidate)
STUCK_SEED = Wrapping("stuck-seed", _StuckSeedCandidate)
