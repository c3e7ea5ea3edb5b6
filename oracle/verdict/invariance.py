"""Invariance rows: what a serving engine runs other than the path the e2e row checks (one sequence prefilled at
once, then decoded token by token), each judged against what the same backend computed on that path, and so
against HF through it:

- `repeat`: the e2e run again in the same process. Bit-identical logits and routing, or the largest difference;
  beyond the precision's limit it fails, and with --require-deterministic any difference fails.
- `chunked`: the prompt prefilled in chunks (about a third, then the rest, through Candidate.extend) and token by
  token (a one-token prefill, then decode alone), then the same decode steps: the same logits at every position
  the backend returns, within the precision's limit, and no router divergence the ordinary path did not have.
- `batched`: the prompt prefilled in one batch with another prompt, longer by two tokens (Candidate.batch, padded
  as the backend pads): the same logits and routing for the prompt's positions. The prefill alone: a batch's
  decode is the next row's work.

The limit of a step is the e2e row's (the fixed table at fp32; at bf16, its multiple of HF bf16's own error on
that step): two paths of one backend differ by no more than a correct implementation may differ from HF. Routing:
the first (call, layer, position) where the two paths' experts differ is named; the other path's choices are
judged against the reference's like the e2e row's (oracle/verdict/replay.py), and a divergence there the
ordinary path does not have fails the row, named by layer and position. A backend that cannot run a path gives
`n/a` with its reason (Candidate.no_chunks, no_batch), never a silent skip."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from oracle.reports.result import Status
from oracle.verdict import thresholds
from oracle.verdict.metrics import as_array, as_f64, tensor_metrics
from oracle.verdict.replay import indices

ROWS = ("repeat", "chunked", "batched")


@dataclass
class InvarianceRow:
    name: str  # repeat | chunked | batched
    status: str  # pass | fail | n/a | error
    detail: str = ""  # what ran (the chunks), or why n/a / the error
    max_abs: float | None = None  # the largest logits difference from the ordinary path
    rel_l2: float | None = None
    ratio: float | None = None  # the worst step's difference over its limit
    where: dict | None = None  # the step and position of the worst step's largest difference
    identical: bool | None = None  # bit-identical logits and routing
    routing: dict = field(default_factory=dict)  # first_difference, differences, divergences (new ones), first_divergence
    runs: list = field(default_factory=list)  # per path run: its name, max_abs, ratio, status

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Path:
    """One run of the sequence: logits rows by input position (those the backend returned), routes per e2e call
    (the prompt's, then each decode step's: {layer: indices [T, k]}, None where not reported)."""

    rows: dict
    routes: list


def ordinary(ref, answers: list, routes: list) -> Path:
    """The e2e row's answers (candidate_steps) as a Path."""
    P, rows = ref.prompt_len, {}
    for k, raw in enumerate(answers):
        out = as_array(raw).reshape(-1, ref.logits[k].shape[-1])
        for p, r in zip(range(P - out.shape[0], P) if k == 0 else [P + k - 1], out):
            rows[p] = r
    return Path(rows, list(routes))


def _joined(calls: list):
    """The routes of a prompt prefilled over several calls as one call's ({layer: indices [P, k]}), or None."""
    if not calls or any(c is None for c in calls):
        return None
    layers = set(calls[0])
    if any(set(c) != layers for c in calls):
        return None
    return {layer: np.concatenate([indices(c[layer]).reshape(-1, indices(c[layer]).shape[-1]) for c in calls])
            for layer in layers}


def _routes(cand):
    try:
        return cand.last_routes()
    except Exception:  # noqa: BLE001 - not reported: routing is then not compared
        return None


def chunked_run(cand, ref, chunks: list[int]) -> Path | None:
    """The prompt prefilled in `chunks` (their sizes; all 1: a one-token prefill, then decode), then the e2e
    row's decode steps, fed the reference's tokens; None where the backend cannot extend a sequence."""
    P, tokens, rows, prompt_routes = ref.prompt_len, ref.tokens, {}, []
    start = 0
    for i, n in enumerate(chunks):
        part = tokens[start:start + n]
        out = cand.prefill(part) if i == 0 else cand.decode(part[0], start) if n == 1 else cand.extend(part, start)
        if out is None:  # the backend prefills from a sequence's start only (Candidate.extend's default)
            return None
        out = as_array(out).reshape(-1, ref.logits[0].shape[-1])
        for p, r in zip(range(start + n - out.shape[0], start + n), out):
            rows[p] = r
        prompt_routes.append(_routes(cand))
        start += n
    routes = [_joined(prompt_routes)]
    for k in range(1, len(ref.logits)):
        out = as_array(cand.decode(tokens[P + k - 1], P + k - 1)).reshape(-1, ref.logits[k].shape[-1])
        rows[P + k - 1] = out[-1]
        routes.append(_routes(cand))
    return Path(rows, routes)


def other_prompt(ref, vocab: int, seed: int) -> list[int]:
    """The batch mate: a prompt two tokens longer than the checked one (so that the checked one is the padded
    one), drawn from `seed`, within the positions the e2e row used."""
    n = min(ref.prompt_len + 2, len(ref.tokens))
    return np.random.default_rng(seed + 7919).integers(0, vocab, size=n).tolist()


def batched_run(cand, ref, mate: list[int]) -> Path | None:
    """The prompt prefilled in one batch after `mate`; None where the backend does not batch."""
    out = cand.batch([mate, list(ref.tokens[:ref.prompt_len])])
    if out is None:
        return None
    logits, routes = out
    P, mine = ref.prompt_len, as_array(logits[1]).reshape(-1, ref.logits[0].shape[-1])
    rows = dict(zip(range(P - mine.shape[0], P), mine))
    return Path(rows, [routes[1] if routes is not None else None])


def _step_rows(ref, path: Path, k: int) -> tuple[list[int], np.ndarray | None]:
    P = ref.prompt_len
    want = list(range(P - ref.logits[0].shape[0], P)) if k == 0 else [P + k - 1]
    have = [p for p in want if p in path.rows]
    return have, (np.stack([path.rows[p] for p in have]) if have else None)


def compare_logits(ref, base: Path, other: Path, lim: dict, noise=None, precision: str = "fp32") -> dict:
    """Every e2e step both paths answered, judged: {max_abs, rel_l2, ratio, status, where, identical}."""
    worst, identical, max_abs, rel = None, True, 0.0, 0.0
    for k in range(len(ref.logits)):
        pos_b, b = _step_rows(ref, base, k)
        pos_o, o = _step_rows(ref, other, k)
        common = sorted(set(pos_b) & set(pos_o))
        if not common:
            continue
        b = np.stack([base.rows[p] for p in common])
        o = np.stack([other.rows[p] for p in common])
        identical = identical and np.array_equal(as_f64(b), as_f64(o), equal_nan=False)
        m = tensor_metrics(b, o, lim["atol"], lim["rtol"])
        step_lim = lim
        if noise is not None and "noise_factor" in lim:  # the step's limit against HF's own error at the precision
            P = ref.prompt_len
            first = P - ref.logits[0].shape[0] if k == 0 else P + k - 1
            pick = [p - first for p in common]
            r = ref.logits[k].reshape(-1, ref.logits[k].shape[-1])[pick]
            h = noise.logits[k].reshape(-1, noise.logits[k].shape[-1])[pick]
            step_lim = thresholds.noise_row_limits(lim, as_f64(r), as_f64(h), precision, m)
            status, ratio = thresholds.judge_noise(m, step_lim)
        else:
            status, ratio = thresholds.judge_tensor(m, lim)
        max_abs, rel = max(max_abs, m.get("max_abs") or 0.0), max(rel, m.get("rel_l2") or 0.0)
        if m["nonfinite"]:
            ratio = float("inf")
        if worst is None or ratio > worst["ratio"]:
            d = np.abs(as_f64(o) - as_f64(b))
            at = int(np.nanargmax(np.where(np.isfinite(d), d, np.inf)).item() // d.shape[-1]) if d.size else 0
            worst = {"ratio": ratio, "status": status, "where": {"step": k, "position": common[at]}}
    if worst is None:
        return {"status": Status.NA, "why": "no position answered on both paths"}
    return {"max_abs": max_abs, "rel_l2": rel, "ratio": worst["ratio"], "status": worst["status"],
            "where": worst["where"], "identical": bool(identical)}


def first_route_difference(base: Path, other: Path, positions: list) -> tuple[dict | None, int]:
    """The first (call, layer, position) where the two paths' experts differ as sets, and how many differ."""
    first, n = None, 0
    for call, (rb, ro) in enumerate(zip(base.routes, other.routes)):
        if rb is None or ro is None:
            continue
        for layer in sorted(set(rb) & set(ro)):
            ib, io = indices(rb[layer]), indices(ro[layer])
            ib, io = ib.reshape(-1, ib.shape[-1]), io.reshape(-1, io.shape[-1])
            for t in range(min(len(ib), len(io))):
                if set(ib[t].tolist()) != set(io[t].tolist()):
                    n += 1
                    if first is None:
                        first = {"call": call, "layer": int(layer), "position": int(positions[call][t])
                                 if call < len(positions) and t < len(positions[call]) else t,
                                 "ordinary": sorted(ib[t].tolist()), "this": sorted(io[t].tolist())}
    return first, n


def routes_compared(path: Path) -> bool:
    return any(r is not None for r in path.routes)


def route_verdict(ref, base_judged: dict, other: Path, spec, noise=None) -> dict:
    """The other path's router choices judged against the reference's (ties within the measured bound,
    else divergences, as the e2e row judges them): the divergences that are this path's own. A place where it
    chose what the ordinary path chose (`base_judged`: {(call, layer, position): the experts}, every difference
    the e2e row judged, by its own rule: after routing replay, against the measured noise) is that row's verdict,
    not judged twice."""
    from oracle.verdict.e2e import routing_differences, what_chose

    if not routes_compared(other) or not ref.router_probs:
        return {}
    n = len(other.routes)
    diffs = routing_differences(what_chose(ref), noise, [r or {} for r in other.routes], ref.positions[:n], spec)
    new = [d for d in diffs if d.verdict == "divergence"
           and base_judged.get((d.call, d.layer, d.position)) != sorted(d.candidate)]
    out = {"divergences": len(new)}
    if new:
        d = new[0]
        out["first_divergence"] = {"call": d.call, "layer": d.layer, "position": d.position,
                                   "reference": d.reference, "this": d.candidate, "gap": d.gap, "bound": d.bound}
    return out


def judge_path(name: str, ref, base: Path, runs: list, lim: dict, spec, noise=None, base_judged=None,
               require_identical: bool = False, detail: str = "") -> InvarianceRow:
    """A row over one or more runs of another path ([(run name, Path)]): the worst of them."""
    row = InvarianceRow(name, Status.PASS, detail, identical=True)
    worst = -1.0
    for run_name, path in runs:
        c = compare_logits(ref, base, path, lim, noise, spec.precision)
        if c["status"] == Status.NA:
            row.runs.append({"run": run_name, "status": Status.NA, "why": c["why"]})
            continue
        first, n = first_route_difference(base, path, ref.positions)
        verdict = route_verdict(ref, base_judged or {}, path, spec, noise)
        same = c["identical"] and n == 0
        status = c["status"]
        if verdict.get("divergences") or (require_identical and not same):
            status = Status.FAIL
        row.runs.append({"run": run_name, "status": status, "max_abs": c["max_abs"], "ratio": c["ratio"],
                         "where": c["where"], "identical": same, "route_differences": n})
        row.identical = row.identical and same
        row.max_abs = max(row.max_abs or 0.0, c["max_abs"])
        row.rel_l2 = max(row.rel_l2 or 0.0, c["rel_l2"])
        if c["ratio"] > worst:
            worst, row.ratio, row.where = c["ratio"], c["ratio"], {**c["where"], "run": run_name}
        if n and "first_difference" not in row.routing:
            row.routing["first_difference"] = {**first, "run": run_name}
        row.routing["differences"] = row.routing.get("differences", 0) + n
        if verdict.get("divergences"):
            row.routing["divergences"] = row.routing.get("divergences", 0) + verdict["divergences"]
            row.routing.setdefault("first_divergence", {**verdict["first_divergence"], "run": run_name})
        if status == Status.FAIL:
            row.status = Status.FAIL
    if not any(r["status"] != Status.NA for r in row.runs):
        row.status, row.identical = Status.NA, None
        row.detail = "; ".join(f"{r['run']}: {r['why']}" for r in row.runs)
    if require_identical and row.status == Status.FAIL and not row.identical:
        row.detail = (row.detail + "; " if row.detail else "") + "--require-deterministic: any difference fails"
    return row


def _attempt(fn):
    """(Path, None), or (None, the error) where the backend raised on this path."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - that row's error, the check goes on
        return None, f"{type(e).__name__}: {e}"


def chunk_sizes(P: int) -> list[int]:
    """About a third of the prompt, then the rest (3 + 5 of 8)."""
    first = max(1, round(P / 3))
    return [first, P - first] if P > 1 else [P]


def tokens_mixed(family: str) -> str | None:
    """The family's reason its reference is not invariant under chunking and batching (Family.tokens_mixed)."""
    from models import get_family

    try:
        return get_family(family).tokens_mixed
    except (KeyError, ValueError):  # a family this package does not know (a plugin's): none declared
        return None


def invariance_rows(ref, cand, spec, base: Path, base_judged: dict, noise=None, lim: dict | None = None,
                    require_deterministic: bool = False) -> list[InvarianceRow]:
    """The three rows of a check whose e2e row answered every step (`base`: that path)."""
    from oracle.verdict.e2e import candidate_steps

    lim = lim or thresholds.limits(spec.precision, "e2e", spec.family, spec.backend)
    P, judge = ref.prompt_len, dict(ref=ref, base=base, lim=lim, spec=spec, noise=noise,
                                    base_judged=base_judged)
    rows = []

    def repeat():
        answers, routes, error = candidate_steps(ref, cand)
        if error:
            raise RuntimeError(error)
        return ordinary(ref, answers, routes)

    path, err = _attempt(repeat)
    rows.append(InvarianceRow("repeat", Status.ERROR, err) if err else
                judge_path("repeat", runs=[("again", path)], require_identical=require_deterministic,
                           detail="the e2e run again in the same process", **judge))

    mixed = tokens_mixed(spec.family)
    if mixed:  # the reference itself is not invariant: nothing to hold a backend to
        return rows + [InvarianceRow(name, Status.NA, f"the reference mixes a call's tokens: {mixed}")
                       for name in ("chunked", "batched")]

    runs, notes = [], []
    sizes = chunk_sizes(P)
    if len(sizes) > 1 and cand.no_chunks is not None:
        notes.append(f"chunks {'+'.join(map(str, sizes))}: n/a ({cand.no_chunks})")
    elif len(sizes) > 1:
        path, err = _attempt(lambda: chunked_run(cand, ref, sizes))
        if path is None and err is None:
            notes.append(f"chunks {'+'.join(map(str, sizes))}: n/a (the backend's extend gave no logits)")
        elif err is not None:
            notes.append(f"chunks {'+'.join(map(str, sizes))}: error ({err})")
        else:
            runs.append(("+".join(map(str, sizes)), path))
    path, err = _attempt(lambda: chunked_run(cand, ref, [1] * P))
    if err is not None:
        notes.append(f"token by token: error ({err})")
    else:
        runs.append((f"1 x {P}", path))
    row = judge_path("chunked", runs=runs, detail="prompt prefilled as " + ", ".join(r for r, _ in runs), **judge)
    if notes:
        row.detail += "; " + "; ".join(notes)
        if any("error (" in n for n in notes):
            row.status = Status.ERROR
    rows.append(row)

    mate = other_prompt(ref, ref.logits[0].shape[-1], spec.seed)
    path, err = _attempt(lambda: batched_run(cand, ref, mate))
    if err is not None:
        rows.append(InvarianceRow("batched", Status.ERROR, err))
    elif path is None:
        rows.append(InvarianceRow("batched", Status.NA, cand.no_batch))
    else:
        rows.append(judge_path("batched", runs=[(f"beside a prompt of {len(mate)}", path)],
                               detail=f"the prompt's prefill in one batch after a prompt of {len(mate)} tokens",
                               **judge))
    return rows
