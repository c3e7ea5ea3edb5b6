"""Backends for the tests: unavailable, crashing, producing NaN."""

import torch

from exporters.torch.eager import EagerBackend


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

        from models.faults import catalogue as faults

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


# ------------------------------------------------------------- malformed candidate outputs
# Each is the eager candidate with one output broken the way a real runtime breaks it; the
# check must fail (or error) that row only and still measure the others, the e2e and gates.
class _Broken:
    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _RouterKMinus1(_Broken):
    """The router returns k-1 experts per token (a top-k off by one)."""

    def run_block(self, layer, kind, calls):
        outs = self.inner.run_block(layer, kind, calls)
        if kind == "router" and layer == 0:
            outs = [(w[:, :-1], i[:, :-1]) for w, i in outs]
        return outs


class _ForeignArrays(_Broken):
    """Outputs as a device runtime hands them back: torch tensors that still require grad
    (np.asarray refuses them, as it refuses CUDA tensors), mlx arrays, numpy arrays."""

    def run_block(self, layer, kind, calls):
        outs = self.inner.run_block(layer, kind, calls)
        if kind == "router":
            return [(w.clone().requires_grad_(True), i) for w, i in outs]
        if kind == "moe":
            try:
                import mlx.core as mx
            except ImportError:
                return [o.numpy() for o in outs]
            return [mx.array(o.numpy()) for o in outs]
        return [o.clone().requires_grad_(True) for o in outs]

    def prefill(self, tokens):
        return self.inner.prefill(tokens).clone().requires_grad_(True)


class _RaisesInOneBlock(_Broken):
    def run_block(self, layer, kind, calls):
        if (layer, kind) == (1, "attention"):
            raise RuntimeError("kernel launch failed: invalid configuration argument")
        return self.inner.run_block(layer, kind, calls)


class _NoneForOneCall(_Broken):
    def run_block(self, layer, kind, calls):
        outs = self.inner.run_block(layer, kind, calls)
        if (layer, kind) == (0, "moe"):
            outs[2] = None
        return outs


class _TupleForTensor(_Broken):
    def run_block(self, layer, kind, calls):
        outs = self.inner.run_block(layer, kind, calls)
        if (layer, kind) == (0, "attention"):
            outs = [(o, o) for o in outs]
        return outs


class _OneCallShort(_Broken):
    def run_block(self, layer, kind, calls):
        outs = self.inner.run_block(layer, kind, calls)
        return outs[:-1] if (layer, kind) == (1, "layer") else outs


class _DecodeDropsLastLogit(_Broken):
    def decode(self, token, pos):
        return self.inner.decode(token, pos)[:-1]


class _DecodeRaisesAtStep3(_Broken):
    def prefill(self, tokens):
        self.steps = 0
        return self.inner.prefill(tokens)

    def decode(self, token, pos):
        self.steps += 1
        if self.steps == 3:
            raise RuntimeError("device lost")
        return self.inner.decode(token, pos)


class _EveryBlockRaises(_Broken):
    def run_block(self, layer, kind, calls):
        raise RuntimeError("no kernels for this device")


ROUTER_K_MINUS_1 = Wrapping("router-k-1", _RouterKMinus1)
FOREIGN_ARRAYS = Wrapping("foreign-arrays", _ForeignArrays)
RAISES_IN_ONE_BLOCK = Wrapping("raises-in-one-block", _RaisesInOneBlock)
NONE_FOR_ONE_CALL = Wrapping("none-for-one-call", _NoneForOneCall)
TUPLE_FOR_TENSOR = Wrapping("tuple-for-tensor", _TupleForTensor)
ONE_CALL_SHORT = Wrapping("one-call-short", _OneCallShort)
DECODE_DROPS_LAST_LOGIT = Wrapping("decode-drops-last-logit", _DecodeDropsLastLogit)
DECODE_RAISES = Wrapping("decode-raises", _DecodeRaisesAtStep3)
EVERY_BLOCK_RAISES = Wrapping("every-block-raises", _EveryBlockRaises)


class NoLoad:
    """A plugin missing a protocol member (`load`)."""

    name = "no-load"

    def availability(self):
        return True, ""


NO_LOAD = NoLoad()


class HangsWithChild(EagerBackend):
    """Starts a long-lived child (as a compiler would) and hangs: a timeout must kill both.
    The child's pid goes to $ORACLE_TEST_CHILD_PID."""

    def load(self, model, spec):
        import os
        import subprocess
        import time

        child = subprocess.Popen(["sleep", "600"])
        with open(os.environ["ORACLE_TEST_CHILD_PID"], "w") as f:
            f.write(str(child.pid))
        time.sleep(600)


HANGS_WITH_CHILD = HangsWithChild(name="hangs-with-child")


class ShiftedDecode(EagerBackend):
    """A decode-path defect only e2e can see: every decode step is given a rotary (and cache)
    position three ahead of its true one, as a runtime port's cache bookkeeping bug would; the
    prefill and every isolated block are correct."""

    def load(self, model, spec):
        from dataclasses import replace

        # a cache three positions longer, so that the shifted steps stay inside it
        cand = super().load(replace(model, args=replace(model.args, max_seq_len=model.args.max_seq_len + 3)), spec)
        decode = cand.decode
        cand.decode = lambda token, pos: decode(token, pos + 3)
        return cand


class ThriceHFError:
    """HF transformers at the check's precision whose `kind` blocks (ORACLE_TEST_KIND, default moe)
    carry three times HF's own error against the fp32 reference: out = ref + 3 (hf - ref). The
    reference's outputs are found by the inputs the block is given (a test-only candidate)."""

    name = "thrice"
    precisions = ("bf16",)

    def availability(self):
        return True, ""

    def load(self, model, spec):
        import os

        import numpy as np

        from oracle.backend import resolve
        from oracle.reference.cached import reference_for
        from oracle.source.sources import prompt_tokens

        cand = resolve("hf").load(model, spec)
        ref = reference_for(spec.family, str(model.model_dir), model.checkpoint_sha256,
                            tuple(prompt_tokens(spec, model.args.vocab_size)), spec.decode_tokens)
        kind = os.environ.get("ORACLE_TEST_KIND", "moe")
        run_block = cand.run_block

        def thrice(layer, k, calls):
            outs = run_block(layer, k, calls)
            if k != kind:
                return outs
            refs = ref.outputs[layer, k]
            return [(torch.from_numpy(r.astype(np.float32)) + 3 * (o.float() - torch.from_numpy(r.astype(np.float32))))
                    .to(o.dtype) for o, r in zip(outs, refs)]

        cand.run_block = thrice
        return cand


SHIFTED_DECODE = ShiftedDecode(name="shifted-decode")
THRICE_HF_ERROR = ThriceHFError()


class _InSituCandidate(_Broken):
    """The eager candidate read the way ExecuTorch's runtime taps read a program: every block row
    of the reference's token sequence is the model's own intermediate from one whole run over the
    sequence (`in-situ`: each block's input carries the candidate's own upstream error); the expert
    probes stay isolated (the reference's inputs)."""

    block_mode = "in-situ"
    block_modes = {k: "in-situ (sequence) + isolated (expert probes)" for k in ("router", "moe")}

    def __init__(self, inner):
        super().__init__(inner)
        self._seq = (None, None)

    def _sequence(self, calls) -> dict:
        from models.args import block_input_path, block_keys, block_path
        from models.layers.transformer import reset_state

        key = tuple((tuple(c.tokens), tuple(c.pos.tolist())) for c in calls)
        if self._seq[0] == key:
            return self._seq[1]
        model, outs, handles = self.inner.model, {}, []

        def record(k):
            def hook(mod, args, out):
                outs.setdefault(k, []).append(tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone())
            return hook

        for k in block_keys(model.args):
            if k[1] != "logits":  # the model's logits, below
                handles.append(model.get_submodule(block_path(model.args, *k)).register_forward_hook(record(k)))
            if self.own_inputs and (path := block_input_path(model.args, *k)):  # the block's own input
                handles.append(model.get_submodule(path).register_forward_hook(record((k[0], "input:" + k[1]))))
        try:
            reset_state(model)
            with torch.no_grad():
                for c in calls:
                    outs.setdefault((None, "logits"), []).append(model(torch.tensor([c.tokens]), c.pos))
        finally:
            for h in handles:
                h.remove()
        self._seq = (key, outs)
        return outs

    def run_block(self, layer, kind, calls):
        seq = [c for c in calls if not c.probe]
        probes = [c for c in calls if c.probe]
        return self._sequence(seq)[layer, kind] + (self.inner.run_block(layer, kind, probes) if probes else [])

    own_inputs = True  # gives each block's own input inside the layer (its norm's output), as ExecuTorch's taps do

    def block_input(self, layer, kind, calls):
        return self._sequence([c for c in calls if not c.probe]).get((layer, "input:" + kind)) if self.own_inputs else None


class _ClaimsIsolated(_InSituCandidate):
    """The same outputs as _InSituCandidate, said to be isolated (fed the reference's exact inputs):
    the harness judges them by the isolated table."""

    block_mode = "isolated"
    block_modes = {}


class InSitu(EagerBackend):
    """The eager production model with in-situ block rows (_InSituCandidate); a fault
    (`with_fault`, models/faults/) is injected into the model as for `eager`."""

    wrapper = _InSituCandidate

    def load(self, model, spec):
        return self.wrapper(super().load(model, spec))


class ClaimsIsolated(InSitu):
    wrapper = _ClaimsIsolated


class _InSituLayerInputsOnly(_InSituCandidate):
    own_inputs = False  # the blocks' inputs not given: HF's blocks see the candidate's stream through HF's norms


class InSituLayerInputsOnly(InSitu):
    wrapper = _InSituLayerInputsOnly


IN_SITU = InSitu(name="in-situ")
IN_SITU_LAYER_INPUTS = InSituLayerInputsOnly(name="in-situ-layer-inputs")
CLAIMS_ISOLATED = ClaimsIsolated(name="claims-isolated")


def qwen35_four_faults(model):
    """Four faults in four blocks of qwen3_5_moe, one IREE compile for the tests that need them
    (tests/test_iree.py, tests/test_drill.py; transform_id QWEN35_FOUR_FAULTS): the catalogue's
    layer-2 Gated DeltaNet state not carried and layer-3 RoPE theta wrong, layer 0's expert 3 and
    layer 1's shared expert with their down projections 1% off."""
    from models.faults import catalogue as faults

    faults.get("gdn_state_not_carried").inject(model)
    faults.get("rope_theta_wrong").inject(model)
    with torch.no_grad():
        model.layers[0].mlp.experts.down_proj[3] *= 1.01
        model.layers[1].mlp.shared_expert.down_proj.weight *= 1.01


QWEN35_FOUR_FAULTS = "gdn_state_not_carried+rope_theta_wrong+expert_0.3+shared_expert_1"


class FlipRouter(EagerBackend):
    """The eager candidate whose router of `layer` takes expert `expert` in place of its last choice at
    sequence position `position`: in the e2e steps, and with `blocks` in the block rows' sequence calls
    too, as a bug would (a rounding flip inside the model only needs the first: an isolated router is
    fed the reference's exact input)."""

    def __init__(self, layer: int, position: int, expert: int, blocks: bool = True, **kw):
        super().__init__(name="flip-router", **kw)
        self.layer, self.position, self.expert, self.blocks = layer, position, expert, blocks

    def load(self, model, spec):
        cand = super().load(model, spec)
        router = cand.model.layers[self.layer].mlp.gate
        current = {"pos": None}
        route = router.route

        def flipped(logits):
            w, idx = route(logits)
            pos = current["pos"]
            if pos is None or pos.numel() != idx.shape[0]:
                return w, idx
            rows = torch.nonzero(pos == self.position).flatten()
            if len(rows) and self.expert not in idx[rows[0]].tolist():
                idx = idx.clone()
                idx[rows, -1] = self.expert
                from models.layers import routing

                w = routing.topk_weights(routing.scores(logits, router.args), idx, router.args).to(w.dtype)
            return w, idx

        router.route = flipped
        prefill, decode = cand.prefill, cand.decode

        def at(fn, pos):
            current["pos"] = pos
            try:
                return fn()
            finally:
                current["pos"] = None

        cand.prefill = lambda tokens: at(lambda: prefill(tokens), torch.arange(len(tokens)))
        cand.decode = lambda token, p: at(lambda: decode(token, p), torch.tensor([p]))
        run_block = cand.run_block

        class At:
            """A block call that says its positions when the block reads its input (a probe: none)."""

            def __init__(self, c):
                self.c, self.probe, self.tokens = c, c.probe, c.tokens

            @property
            def x(self):
                current["pos"] = None if self.c.probe else self.c.pos
                return self.c.x

            @property
            def pos(self):
                return self.c.pos

        def blocks(layer, kind, calls):
            if not self.blocks or layer != self.layer or kind not in ("router", "moe", "layer"):
                return run_block(layer, kind, calls)
            try:
                return run_block(layer, kind, [At(c) for c in calls])
            finally:
                current["pos"] = None

        cand.run_block = blocks
        return cand


class FlipMaskInLayer(EagerBackend):
    """The eager candidate as a compiled block program is to the oracle (its layer block's own choice is
    not reported), whose router of `layer`, run inside that layer's block on the sequence's first call,
    weighs the token at row `row` with the nearest sparsemixer mask decision taken the other way
    (routing.mask_flipped): what the MLX delegate did at a near tie (phimoe, bf16, seed 1). `scale`: those
    weights times it (other than 1: weights no decision gives, a bug)."""

    def __init__(self, layer: int, row: int, scale: float = 1.0, **kw):
        super().__init__(name="flip-mask-in-layer", **kw)
        self.layer, self.row, self.scale = layer, row, scale

    def load(self, model, spec):
        from models.layers import routing

        cand = super().load(model, spec)
        cand.block_routes = lambda: None  # not reported, as a compiled block program's
        router = cand.model.layers[self.layer].mlp.gate
        route, state = router.route, {"on": False}

        def flipped(logits):
            w, idx = route(logits)
            if state["on"] and idx.shape[0] > self.row:
                state["on"] = False  # the first call only
                alt = routing.mask_flipped(logits.float(), idx, router.args.router.jitter_eps).to(w.dtype)
                w = w.clone()
                w[self.row] = alt[self.row] * self.scale
            return w, idx

        router.route = flipped
        run_block = cand.run_block

        def blocks(layer, kind, calls):
            state["on"] = layer == self.layer and kind == "layer"
            try:
                return run_block(layer, kind, calls)
            finally:
                state["on"] = False

        cand.run_block = blocks
        return cand
