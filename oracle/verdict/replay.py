"""Routing replay: the evidence of what a candidate's routers chose, instead of excuses.

A MoE's routing is a discrete decision inside a continuous computation: at a near tie a correct
implementation at another precision may pick other experts, and every number after that legitimately
differs. So the candidate's selections are recorded (per MoE layer and position: `Candidate.last_routes`)
and judged on their own:

1. each difference from the reference's selection is a **tie** only where the reference's gap between
   the experts exchanged is within the tie bound measured there (tie_factor x HF's own selection-score
   error at the candidate's precision at that layer and position; at fp32 against HF at fp64); beyond
   it, a **router divergence**, which fails, named by layer and position;
2. HF runs again with the candidate's selection forced at every layer and position (`forced`: hooks on
   HF's own routers, the weights of a forced selection computed from HF's own router logits by the
   family's routing), at fp32 for the reference and at the candidate's precision for the noise, and
   the candidate is judged against that routing-aligned reference by the usual rules, no step excused
   and no token left out. Where nothing differs, the noise is HF at the precision forced to the
   reference's selection, so that it is rounding and not HF's own flips.

This is Rollout Routing Replay (R3, arXiv 2510.11370) as MoE reinforcement-learning stacks use it
between their inference and training engines: here the candidate is the inference engine, HF replays.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass

import numpy as np


@contextlib.contextmanager
def forced(hf, plan: dict):
    """HF (an exporters.torch.hf HFCandidate) with its routers' selections forced: `plan` maps a layer to one
    entry per call of its router, in order: an int array [T, k] of experts, a Choice (experts, and the
    weights to take where a discrete decision sets them), or None (HF's own choice).
    A token whose forced experts are HF's own keeps HF's weights bit for bit (unless the Choice gives its
    weights); another gets the weights the family's routing gives those experts from HF's own router
    logits (models.layers.routing.topk_weights), in HF's weights dtype. A `decided` Choice (the reference's own
    selection, forced on HF at a reduced precision for its noise) takes, where a discrete decision sets the
    weights (sparsemixer's masks), that decision as the Choice's weights took it: HF's weights, or those
    with its nearest decision gone the other way (models.layers.routing.weight_alternative), whichever is nearer
    the Choice's, so that the noise is HF's rounding and not its own flip of a mask at a near tie.
    Yields the per-layer call counts."""
    import torch

    from models.layers import routing

    args, reader, writer, reweigh = hf.args, hf.read_router, hf.family.router_input, hf.family.router_reweigh
    counts: dict = {}

    def hook(layer):
        def fn(mod, a, kwargs, out):
            n = counts.get(layer, 0)
            counts[layer] = n + 1
            calls = plan.get(layer)
            if calls is None or n >= len(calls) or calls[n] is None:
                return None
            choice = calls[n] if isinstance(calls[n], Choice) else Choice(np.asarray(calls[n]))
            logits, weights, idx = reader(out) if reader else out[:3]
            k = idx.shape[-1]
            want = torch.as_tensor(np.asarray(choice.experts), dtype=torch.long).reshape(-1, k)
            have = idx.reshape(-1, k)
            if want.shape != have.shape:
                raise ValueError(f"layer {layer} call {n}: forcing {list(want.shape)} experts on a router call of "
                                 f"{list(have.shape)}")
            same = (torch.sort(want, dim=-1).values == torch.sort(have.long(), dim=-1).values).all(dim=-1)
            given = torch.zeros_like(same) if choice.weights_at is None else torch.as_tensor(choice.weights_at).reshape(-1)
            decide = choice.decided and choice.weights is not None and routing.weighs_discretely(args)
            if bool(same.all()) and not bool(given.any()) and not decide:
                return None
            scores = routing.scores(logits.reshape(-1, logits.shape[-1]).float(), args)
            w_new = routing.topk_weights(scores, want, args).to(weights.dtype)
            if bool(given.any()):  # a discrete decision of the weights taken as the candidate took it
                w_given = torch.as_tensor(np.asarray(choice.weights), dtype=weights.dtype).reshape(-1, k)
                w_new = torch.where(given[:, None], w_given, w_new)
            keep = same & ~given
            w = torch.where(keep[:, None], weights.reshape(-1, k), w_new).reshape(weights.shape)
            i = torch.where(same[:, None], have, want.to(idx.dtype)).reshape(idx.shape)
            if bool(given.any()):  # the given weights are in the candidate's expert order
                i = torch.where(given[:, None], want.to(idx.dtype), i.reshape(-1, k)).reshape(idx.shape)
            if decide:  # each token's discrete decision as the Choice's weights took it
                i2 = i.reshape(-1, k).long()
                target = torch.as_tensor(np.asarray(choice.weights), dtype=torch.float32).reshape(-1, k)
                target = ((i2[:, :, None] == want[:, None, :]) * target[:, None, :]).sum(-1)  # in i's order
                w2 = w.reshape(-1, k)
                alt = routing.weight_alternative(scores, i2, args)
                nearer = ((alt - target).abs().amax(-1) < (w2.float() - target).abs().amax(-1)) & ~given
                w = torch.where(nearer[:, None], alt.to(weights.dtype), w2).reshape(weights.shape)
            if reweigh is not None and not bool(given.any()) and not decide:  # the router's own weighing of i
                return reweigh(mod, a[0] if a else kwargs["hidden_states"], i, args)
            return writer(out, w, i, args) if writer else (out[0], w, i, *out[3:])
        return fn

    handles = [hf.modules[layer, "router"].register_forward_hook(hook(layer), with_kwargs=True)
               for layer in plan if (layer, "router") in hf.modules]
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


@dataclass
class Choice:
    """A router call's forced choice: its experts [T, k], and where a discrete decision sets the weights
    (sparsemixer's masks), the candidate's weights [T, k] and the tokens [T] to take them at."""

    experts: np.ndarray
    weights: np.ndarray | None = None
    weights_at: np.ndarray | None = None
    # the weights are not taken but the discrete decisions they show are (forced: the reference's own
    # selection on HF at a reduced precision)
    decided: bool = False


# the weights of the same experts differ discretely (a sparsemixer mask decided otherwise) beyond this share
# of the largest weight: several roundings of bf16 (2^-8), far below what a mask flip moves (10 % and more)
WEIGHT_STEP = {"fp32": 1e-4}
WEIGHT_STEP_REDUCED = 2.0 ** -6


def indices(v):
    """A route entry's experts: a candidate reports indices [T, k] or (indices, weights) (a plan: a Choice)."""
    if v is None:
        return None
    return np.asarray(v.experts if isinstance(v, Choice) else v[0] if isinstance(v, tuple) else v)


def weights(v):
    return np.asarray(v[1]) if isinstance(v, tuple) else None


def reference_routes(ref) -> dict:
    """layer -> [a decided Choice per call of its router]: the reference's own selection (the sequence's
    calls, then the expert probes), its experts and the discrete decisions its weights show, what the noise
    is forced to where the candidate chose the same."""
    return {layer: [Choice(np.asarray(i).reshape(-1, i.shape[-1]), np.asarray(w, np.float32).reshape(-1, i.shape[-1]),
                           decided=True) for w, i in outs]
            for (layer, kind), outs in ref.outputs.items() if kind == "router"}


def e2e_plan(routes_per_call: list[dict]) -> dict:
    """[{layer: [T, k]} per e2e call] -> layer -> [per call] (None where a call has no entry)."""
    layers = sorted({layer for r in routes_per_call for layer in r})
    return {layer: [r.get(layer) for r in routes_per_call] for layer in layers}


def digest(plan: dict) -> str:
    """A short identity of a routing plan (its arrays' bytes), for the cache keys of forced runs."""
    import hashlib

    h = hashlib.sha256()
    for layer in sorted(plan, key=lambda k: (isinstance(k, str), str(k) if isinstance(k, str) else k)):
        for a in plan[layer]:
            if isinstance(a, Choice):
                h.update(np.ascontiguousarray(a.experts, np.int64).tobytes() + b"w"
                         + (b"" if a.weights is None else np.ascontiguousarray(a.weights, np.float32).tobytes())
                         + (b"" if a.weights_at is None else np.ascontiguousarray(a.weights_at, bool).tobytes())
                         + (b"d" if a.decided else b""))
            h.update(b"-" if a is None else np.ascontiguousarray(indices(a), np.int64).tobytes() + b"|")
        h.update(str(layer).encode())
    return h.hexdigest()[:16]


@dataclass
class Difference:
    """One place where the candidate's routers chose other experts than the reference's."""

    call: int  # e2e step (0: the prefill) or block call
    layer: int
    position: int  # the sequence position (block rows: the token's index in its call)
    reference: list  # the reference's experts there
    candidate: list  # the candidate's
    gap: float  # the reference's selection-score gap between the experts exchanged
    bound: float  # the tie bound there at the candidate's precision
    # "tie" (gap within the bound), "divergence" (beyond it: fails), or "follows" (HF with the candidate's
    # earlier choices forced chooses so too: a consequence of those, not a choice of its own)
    verdict: str
    # what differs: "experts", or "weights" (the same experts, weighted by another discrete decision:
    # sparsemixer's masks; `gap` is then that decision's margin), or "keys" (a sparse-attention indexer's:
    # oracle/verdict/selection.py)
    what: str = "experts"

    def as_dict(self) -> dict:
        return asdict(self)

    def text(self) -> str:
        what = (f"the weights of experts {self.reference} decided otherwise" if self.what == "weights"
                else f"{self.what} {self.candidate} for the reference's {self.reference}")
        return f"layer {self.layer} position {self.position}: {what}, gap {self.gap:.3g} vs tie bound {self.bound:.3g}: {self.verdict}"


def exchange_gap(scores: np.ndarray, ref_experts, cand_experts) -> float:
    """The reference's selection-score gap between the experts the candidate exchanged: the best of the
    dropped minus the worst of the added (a single swap: exactly their gap). A non-finite gap (an expert
    of a group the reference left out) is infinite: no rounding reaches it."""
    dropped = sorted(set(int(e) for e in ref_experts) - set(int(e) for e in cand_experts))
    added = sorted(set(int(e) for e in cand_experts) - set(int(e) for e in ref_experts))
    if not dropped or not added:
        return float("inf")  # another count of experts: not a choice at a tie
    with np.errstate(invalid="ignore"):
        gap = float(np.max(scores[dropped]) - np.min(scores[added]))
    return gap if np.isfinite(gap) else float("inf")


def differences(ref_idx: list, cand_idx: list, scores: list, bounds: list, positions: list, layer: int,
                ref_w: list | None = None, weight_gaps: list | None = None, precision: str = "fp32",
                group_gaps: list | None = None) -> list:
    """Every token of every call where the candidate's experts (as sets) are not the reference's, with
    its gap and tie bound and the verdict. Lists per call: reference and candidate indices [T, k] (a
    candidate entry may be (indices, weights)), the reference's selection scores [T, E], the tie bound [T]
    (or a number), the positions [T]. Where a discrete decision sets the weights (`weight_gaps`, the
    reference's margin of that decision per call, and `ref_w` its weights): a token whose experts agree
    but whose weights differ by more than a few roundings is a difference of the weights, judged on that
    margin the same way. A group-limited router's candidate taking experts of a group the reference left
    out (`group_gaps`: the reference's margin of its group choice [T] per call) is judged on that margin."""
    out = []
    for call, (ri, cv, sc, bd, pos) in enumerate(zip(ref_idx, cand_idx, scores, bounds, positions)):
        ci = indices(cv)
        if ci is None:
            continue
        ri = np.asarray(ri).reshape(-1, np.asarray(ri).shape[-1])
        ci = ci.reshape(ri.shape[0], -1)
        cw = weights(cv)
        bd = np.broadcast_to(np.asarray(bd, np.float64).reshape(-1) if np.ndim(bd) else np.float64(bd), (ri.shape[0],))
        for t in range(ri.shape[0]):
            where = int(pos[t]) if pos is not None else t
            if set(ri[t].tolist()) != set(ci[t].tolist()):
                gap = exchange_gap(np.asarray(sc[t], np.float64), ri[t], ci[t])
                if not np.isfinite(gap) and group_gaps is not None and len(ri[t]) == len(ci[t]):
                    gap = float(np.asarray(group_gaps[call], np.float64).reshape(-1)[t])  # another group chosen
                out.append(Difference(call, layer, where, sorted(ri[t].tolist()), sorted(ci[t].tolist()), gap,
                                      float(bd[t]), "tie" if gap <= bd[t] else "divergence"))
            elif weight_gaps is not None and cw is not None and ref_w is not None:
                rw = np.asarray(ref_w[call], np.float64).reshape(ri.shape)
                mine = dict(zip(ci[t].tolist(), np.asarray(cw, np.float64).reshape(ri.shape)[t].tolist()))
                theirs = dict(zip(ri[t].tolist(), rw[t].tolist()))
                step = WEIGHT_STEP.get(precision, WEIGHT_STEP_REDUCED) * max(max(map(abs, theirs.values())), 1e-30)
                if max(abs(mine[e] - theirs[e]) for e in theirs) > step:
                    gap = float(np.asarray(weight_gaps[call]).reshape(-1)[t])
                    out.append(Difference(call, layer, where, sorted(ri[t].tolist()), sorted(ci[t].tolist()), gap,
                                          float(bd[t]), "tie" if gap <= bd[t] else "divergence", "weights"))
    return out


class RouteLog:
    """What a torch candidate's routers selected: forward hooks on its router modules ({layer: module})
    append (layer, (indices, weights)) on every call (`read`: the module's output -> (its indices, its
    weights); traced as a side effect by torch.compile too). `reset` at the start of each prefill, decode
    or run_block; `settle` after each call of a block run call by call. `entries`: what was settled (call
    and calls settle first).

    The hooks append to `live`, which every call starts empty: Dynamo guards a compiled function on the
    length of a list its graph appends to, so a block whose calls appended to one growing list was traced
    again for every call (olmoe's router and MoE blocks 11 times each per layer on `cuda`, 2026-11-29)."""

    def __init__(self, routers: dict, read):
        self.entries: list = []
        self.live: list = []
        self.handles = [m.register_forward_hook(self._hook(layer, read)) for layer, m in routers.items()]

    def _hook(self, layer, read):
        def fn(mod, args, out):
            self.live.append((layer, read(out)))
        return fn

    def reset(self) -> None:
        self.entries.clear()
        self.live.clear()

    def settle(self) -> None:
        """The call just run: its entries kept in `entries`, `live` empty for the next."""
        self.entries.extend(self.live)
        self.live.clear()

    @staticmethod
    def _array(idx) -> np.ndarray:
        a = idx.detach().cpu().numpy() if hasattr(idx, "detach") else np.asarray(idx)
        return a.reshape(-1, a.shape[-1]).astype(np.int64)

    def _entry(self, value):
        idx, w = value
        w = w.detach().float().cpu().numpy() if hasattr(w, "detach") else np.asarray(w, np.float32)
        i = self._array(idx)
        return i, w.reshape(i.shape)

    def call(self) -> dict:
        """{layer: (indices [T, k], weights [T, k])} of one model call (each router once)."""
        self.settle()
        return {layer: self._entry(v) for layer, v in self.entries}

    def calls(self) -> list:
        """[{layer: (indices, weights)}] per router call, in order (a block's calls, one each)."""
        self.settle()
        return [{layer: self._entry(v)} for layer, v in self.entries]


def plan_of(selection: list, diffs: list, layer: int, positions: list, discrete: bool = False) -> list:
    """A layer's forcing plan from a candidate's selection per call ((indices, weights) or indices): its
    experts, and its weights at the tokens `diffs` name as weight differences (what="weights";
    `positions`: per call, each token's position as the differences name it). `discrete` (a routing whose
    weights a discrete decision sets: sparsemixer's masks): at every token `diffs` name, experts too,
    the candidate's weights, its own decisions there (phimoe on executorch-mlx at bf16, seed 3: experts
    [0, 7] for [0, 4] weighted [1, 1], expert 4 left out of the second choice's mask, where HF's logits
    give 7 half)."""
    at = {(d.call, d.position) for d in diffs if d.layer == layer and (discrete or d.what == "weights")}
    plan = []
    for call, v in enumerate(selection):
        if v is None:
            plan.append(None)
            continue
        idx, w = indices(v), weights(v)
        mask = np.array([(call, int(p)) in at for p in np.asarray(positions[call]).reshape(-1)])
        # elsewhere the discrete decisions its weights show (the reference's, as no difference is listed
        # there): HF at a reduced precision does not flip a mask of its own at a near tie
        plan.append(Choice(idx, w, mask, decided=True) if w is not None else idx)
    return plan
