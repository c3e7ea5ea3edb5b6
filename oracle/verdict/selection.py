"""Sparse attention's key selection, judged as a routing decision.

A sparse-attention layer (DeepSeek sparse attention's lightning indexer, and any module of that role)
scores every cached key for each query and keeps the top k: which keys a query attends to is a discrete
decision inside a continuous computation, like a router's experts. So it is recorded and judged the way
routing replay judges an expert flip (oracle/verdict/replay.py): each query position where the candidate
kept other keys than the reference is a **tie** where the reference's score gap between the keys exchanged
is within the tie bound at the candidate's precision, else an **indexer divergence**, which fails the e2e
row, named by step, layer and position.

What is recorded, on both sides, is found by role: a decoder layer's submodule named `indexer` whose
forward returns the selected key indices [B, S, k] (HF's DeepseekV32Indexer and its descendants, the
production model's models/layers/dsa.py). The scores it ranks are read off the input of the last `topk`
it calls (a TorchFunctionMode active during its forward): HF's own numbers, no second implementation.
An indexer whose output is not as wide as that top-k's choice chose groups of keys (GLM-5.3's pools,
models/layers/dsa_pool.py: the keys of the pools chosen, plus others always kept): what it chose is then
the top-k's own indices, the columns of the scores it ranked.

The tie bound: at least `tie_ulps` (thresholds.toml [<precision>.indexer]) units in the last place, at the
precision's storage, of the query's largest score (oracle.verdict.metrics.score_resolution); at a precision
judged against its own measured error (bf16), the router's tie_factor times HF's own score error at that
precision on the same call (tie_bounds).
"""

from __future__ import annotations

import contextlib

import numpy as np

from oracle.verdict import thresholds
from oracle.verdict.metrics import row_error, score_resolution
from oracle.verdict.replay import Difference

NAME = "indexer"  # the role's module name, in HF's models and the production model


def indexers(layers) -> dict:
    """{layer index: its indexer module} over a model's decoder layers (those with one)."""
    out = {}
    for i, layer in enumerate(layers):
        found = [m for name, m in layer.named_modules() if name.rpartition(".")[2] == NAME]
        if found:
            out[i] = found[0]
    return out


class SelectionLog:
    """What a torch model's indexers selected and the scores they ranked: (layer, indices [T, k] int64,
    scores [T, keys] fp32) per indexer call, the call's entries since the last `reset`."""

    def __init__(self, modules: dict):
        import torch
        from torch.overrides import TorchFunctionMode

        log = self

        class LastTopk(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if func in (torch.topk, torch.Tensor.topk) and args:
                    log.scores, log.top = args[0], out[1]
                return out

        self.entries: list = []
        self.scores = self.top = None
        self.mode = None
        self.handles = []
        for layer, m in modules.items():
            self.handles.append(m.register_forward_pre_hook(self._enter))
            self.handles.append(m.register_forward_hook(self._exit(layer)))
        self._mode_type = LastTopk

    def _enter(self, mod, args):
        self.scores = self.top = None
        self.mode = self._mode_type()
        self.mode.__enter__()

    def _exit(self, layer):
        def fn(mod, args, out):
            if self.mode is not None:
                self.mode.__exit__(None, None, None)
                self.mode = None
            idx = out[0] if isinstance(out, tuple) else out
            if self.top is not None and idx.dim() == 3 and idx.shape[-1] != self.top.shape[-1]:
                idx = self.top  # a grouped choice (GLM-5.3's pools): the groups its top-k chose, the scores' columns
            idx = idx.detach().cpu().numpy().astype(np.int64)
            scores = None if self.scores is None else self.scores.detach().float().cpu().numpy()
            if idx.ndim == 4:  # one choice per head [B, heads, T, k]: one row per query (per_query)
                idx, scores = per_query(idx, scores)
            # (rows counted, not -1: an indexer with nothing to choose yet returns k = 0, HF DeepSeek-V4's first token)
            idx = idx.reshape(int(np.prod(idx.shape[:-1])), idx.shape[-1])
            self.entries.append((layer, idx, None if scores is None else scores.reshape(idx.shape[0], -1)))
        return fn

    def reset(self) -> None:
        self.entries.clear()

    def call(self) -> dict:
        """{layer: (indices [T, k], scores [T, keys] or None)} of one model call."""
        return {layer: (i, s) for layer, i, s in self.entries}

    def take(self) -> dict:
        """call(), the entries then cleared for the next call."""
        out = self.call()
        self.reset()
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def per_query(idx: np.ndarray, scores: np.ndarray | None) -> tuple:
    """An indexer whose heads each choose ([B, heads, T, k], with its scores [B, heads, T, keys]: MiniMax-M3's block
    indexer, one choice of blocks per kv head) as one row per query: [B, T, heads · k] entries key · heads + head
    (-1, no key, kept) into the scores laid out [B, T, keys · heads]. The numbering does not depend on how many keys
    a side scores (a static cache's or HF's growing one), so both sides' rows compare as sets of (key, head)."""
    B, H, T, k = idx.shape
    rows = np.where(idx >= 0, idx * H + np.arange(H)[None, :, None, None], -1).transpose(0, 2, 1, 3)
    if scores is not None:
        scores = np.asarray(scores).reshape(B, H, T, -1).transpose(0, 2, 3, 1).reshape(B, T, -1)
    return rows.reshape(B, T, H * k), scores


def per_head(rows: np.ndarray, heads: int, k: int) -> np.ndarray:
    """per_query's rows [B, T, m] back as one choice per head [B, heads, T, k]: each head's keys (each once, by
    number), -1 filling (a head given fewer than k) or cut to k."""
    B, T, _ = rows.shape
    out = np.full((B, heads, T, k), -1, np.int64)
    for b in range(B):
        for t in range(T):
            for h in range(heads):
                mine = sorted({int(e) // heads for e in rows[b, t] if e >= 0 and e % heads == h})[:k]
                out[b, h, t, :len(mine)] = mine
    return out


def _limits(precision: str, kind: str, family: str, backend: str) -> dict:
    """The precision's table for `kind`, or fp32's where the precision has none (a quantized precision)."""
    try:
        return thresholds.limits(precision, kind, family, backend)
    except KeyError:
        return thresholds.limits("fp32", kind, family, backend)


PLAN = "keys."  # a routing plan's entries for indexers: "keys.<layer>" -> [the keys to keep [T, k] per call]


def key_plan(ref, selections: list) -> dict:
    """The candidate's key selection as a forcing plan (forced_keys): "keys.<layer>" -> per e2e call the keys it
    kept that the query can see (by the reference's scores), each row padded with its first, or None where the
    candidate did not report the call."""
    out = {}
    for layer, scores in ref.index_scores.items():
        calls = []
        for c, sc in enumerate(scores):
            sel = (selections[c] or {}).get(layer) if c < len(selections) else None
            if sel is None:
                calls.append(None)
                continue
            k = np.asarray(sel).shape[-1]
            rows = [sorted(r) or [int(p)] for r, p in zip(visible(sel, np.asarray(sc, np.float64)), ref.positions[c])]
            calls.append(np.array([r + [r[0]] * (k - len(r)) for r in rows], np.int64))
        out[f"{PLAN}{layer}"] = calls
    return out


@contextlib.contextmanager
def forced_keys(layers, plan: dict):
    """A model's indexers (over its decoder `layers`) made to keep the keys of `plan`'s "keys.<layer>" entries, one
    per call of the layer's indexer, in order (None: its own choice): its output replaced by them, cut or padded
    (with the row's first) to its own k. Where nothing else differs, HF then attends where the candidate did: the
    routing replay's aligned reference (oracle/verdict/e2e.py). The top-k an indexer calls on its [B, T, n] scores
    is given those entries too: a grouped choice (SelectionLog: the groups chosen, the keys of its output derived
    from them) keeps its output, made from the groups forced."""
    import torch
    from torch.overrides import TorchFunctionMode

    counts: dict = {}
    active: dict = {}  # layer -> the Forced mode of its call in progress

    def fit(want, k):  # rows cut or padded with their first to k
        return want[..., :k] if want.shape[-1] >= k else torch.cat(
            [want, want[..., :1].expand(*want.shape[:-1], k - want.shape[-1])], dim=-1)

    class Forced(TorchFunctionMode):
        def __init__(self, rows):
            super().__init__()
            self.rows, self.k = rows, None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.topk, torch.Tensor.topk) and args and args[0].dim() == 3:
                idx = fit(torch.as_tensor(self.rows).reshape(*args[0].shape[:-1], -1), out[1].shape[-1])
                idx = idx.to(device=out[1].device, dtype=out[1].dtype)
                self.k = idx.shape[-1]
                return type(out)((torch.gather(args[0], -1, idx), idx))
            return out

    def enter(layer, calls):
        def fn(mod, args):
            n = counts.get(layer, 0)
            active[layer] = None
            if n < len(calls) and calls[n] is not None:
                active[layer] = Forced(calls[n])
                active[layer].__enter__()
        return fn

    def hook(layer, calls):
        def fn(mod, args, out):
            n = counts.get(layer, 0)
            counts[layer] = n + 1
            forced = active.pop(layer, None)
            if forced is not None:
                forced.__exit__(None, None, None)
            if n >= len(calls) or calls[n] is None:
                return None
            k = out.shape[-1]
            if out.dim() == 4:  # a choice per head (per_query's rows): each head's own keys
                rows = np.asarray(calls[n]).reshape(out.shape[0], out.shape[2], -1)
                return torch.as_tensor(per_head(rows, out.shape[1], k)).to(device=out.device, dtype=out.dtype)
            if forced is not None and forced.k is not None and forced.k != k:  # a grouped choice: made from them
                return None
            return fit(torch.as_tensor(calls[n]).reshape(*out.shape[:-1], -1), k).to(device=out.device,
                                                                                     dtype=out.dtype)
        return fn

    mods = indexers(layers)
    chosen = [(mods[int(key[len(PLAN):])], key, calls) for key, calls in plan.items()
              if isinstance(key, str) and key.startswith(PLAN) and int(key[len(PLAN):]) in mods]
    handles = [h for m, key, calls in chosen for h in (m.register_forward_pre_hook(enter(key, calls)),
                                                        m.register_forward_hook(hook(key, calls)))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def tie_bounds(scores: np.ndarray, precision: str, family: str, backend: str, measured=None) -> np.ndarray:
    """[T]: the tie bound of each query's selection at the precision (module docstring): `tie_ulps` units in
    the last place of its largest score, or where HF's own scores at the precision were measured on the same
    call (`measured` [T, keys], the noise run's: oracle/verdict/noise.py), at least the router's tie_factor
    times HF's own error there (per query, at least the call's median query's), as a router's tie bound is:
    a bf16 score carries the rounding of every layer before it (measured on deepseek_v32's tiny checkpoint,
    seeds 0-4, a 16-token prefill: HF bf16's scores 0.6-380 bf16 ulps of the largest from HF fp32's, growing
    with depth)."""
    table = _limits(precision, NAME, family, backend)
    at = precision if precision in ("fp32", "bf16", "fp16") else "bf16"
    floor = table["tie_ulps"] * score_resolution(scores, at)
    if measured is None or np.shape(measured) != np.shape(scores):
        return floor
    err = row_error(scores, np.where(measured > MASKED, measured, -np.inf))
    finite = err[np.isfinite(err)]
    median = float(np.median(finite)) if finite.size else 0.0
    factor = _limits(precision, "router", family, backend).get("tie_factor") or (
        thresholds.exact(precision) or {}).get("tie_factor") or 1.0
    return np.maximum(floor, factor * np.maximum(err, median) + score_resolution(scores, at))


MASKED = -1e30  # a score at or below: a key the causal mask leaves out (HF adds finfo.min, or -inf)


def visible(idx, scores: np.ndarray) -> list[set]:
    """Per query: the keys of `idx` [T, k] it can see (not masked, within the reference's keys). With fewer
    visible keys than k, a top-k also returns masked ones, in any order: they select nothing."""
    idx = np.asarray(idx, np.int64).reshape(scores.shape[0], -1)
    inside = np.clip(idx, 0, scores.shape[-1] - 1)
    seen = (idx >= 0) & (idx < scores.shape[-1]) & (np.take_along_axis(scores, inside, axis=-1) > MASKED)
    return [set(row[ok].tolist()) for row, ok in zip(idx, seen)]


def differs(ref, selections: list) -> bool:
    """Whether the candidate kept other visible keys than the reference anywhere (every call reported)."""
    if not selections or any(x is None for x in selections):
        return False
    for layer, scores in ref.index_scores.items():
        for c, mine in enumerate(selections[:len(scores)]):
            sc = np.asarray(scores[c], np.float64)
            if layer in mine and visible(mine[layer], sc) != visible(ref.index_selected[layer][c], sc):
                return True
    return False


def index_differences(ref_selected: dict, ref_scores: dict, selections: list, positions: list, spec,
                      measured: dict | None = None, upstream: list = ()) -> list:
    """Every (step, layer, position) where the candidate's indexer kept other visible keys than the
    reference's, with the reference's score gap between the keys exchanged (the best it kept that the
    candidate dropped minus the worst the candidate kept instead; a key lost with none in its place: inf)
    against the tie bound there: tie or divergence. `selections`: per e2e call, the candidate's
    {layer: indices [T, k]} (or (indices, scores)); the reference's per layer, per call."""
    n = len(selections)
    out = []
    for layer in sorted(ref_selected):
        cand = [None if s is None or layer not in s else
                (s[layer][0] if isinstance(s[layer], tuple) else s[layer]) for s in selections]
        at = (measured or {}).get(layer) or []
        for call, (ri, ci, sc) in enumerate(zip(ref_selected[layer][:n], cand, ref_scores[layer][:n])):
            if ci is None:
                continue
            sc = np.asarray(sc, np.float64)
            shown = np.where(sc > MASKED, sc, -np.inf)
            bound = tie_bounds(shown, spec.precision, spec.family, spec.backend,
                               np.asarray(at[call], np.float64) if call < len(at) else None)
            for t, (r, c) in enumerate(zip(visible(ri, sc), visible(ci, sc))):
                if r == c:
                    continue
                dropped, added = sorted(r - c), sorted(c - r)
                gap = float(shown[t, dropped].max() - shown[t, added].min()) if dropped and added else float("inf")
                out.append(Difference(call, layer, int(positions[call][t]), sorted(r), sorted(c), gap, float(bound[t]),
                                      "tie" if gap <= bound[t] else "divergence", "keys"))
    if thresholds.quantized(spec.precision):  # quantized weights move the scores: judged by the logits
        for d in out:
            if d.verdict == "divergence":
                d.verdict = "quantization"
    return follows(sorted(out, key=lambda d: (d.call, d.position, d.layer)), upstream)


def follows(diffs: list, upstream: list = ()) -> list:
    """A divergence downstream of another difference is `follows`, a consequence and not a choice of its own (no
    replay forces HF's indexers to the candidate's keys): one at a later layer whose query saw what the other
    changed (the other at an earlier call, or at this call and a position at or before its own), the other any
    indexer difference here or any router difference (`upstream`: the e2e row's, ties included: an expert tie in
    layer 1 moves every index score after it; measured, deepseek_v32 bf16 seed 1). The first stays."""
    before = [*diffs, *upstream]
    for d in diffs:
        if d.verdict == "divergence" and any(
                e is not d and e.layer < d.layer and (e.call < d.call or (e.call == d.call and e.position <= d.position))
                for e in before):
            d.verdict = "follows"
    return diffs


def index_record(ref, selections: list, cand, spec, noise=None, upstream: list = ()) -> dict | None:
    """The e2e row's `indexer` section, or None for a model without indexers: whether the candidate's
    selections were recorded (and why not), each difference with its gap, bound and verdict."""
    if not getattr(ref, "index_selected", None):
        return None
    if not selections or any(s is None for s in selections):
        return {"recorded": False, "why": cand.no_selections, "differences": [], "ties": 0, "divergences": 0}
    diffs = index_differences(ref.index_selected, ref.index_scores, selections, ref.positions, spec,
                              getattr(noise, "e2e_index_scores", None), upstream)
    return {"recorded": True, "layers": sorted(ref.index_selected), "differences": [d.as_dict() for d in diffs],
            "ties": sum(d.verdict == "tie" for d in diffs),
            "divergences": sum(d.verdict == "divergence" for d in diffs),
            "follows": sum(d.verdict == "follows" for d in diffs),
            **({"quantization": q} if (q := sum(d.verdict == "quantization" for d in diffs)) else {})}
