"""The end-to-end row: the candidate's prefill and teacher-forced decode steps against the
reference's logits and greedy tokens (token ties and routing ties read off measured margins), and
the same over a set of prompts with the distribution metrics and perplexity."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from oracle.verdict import thresholds
from oracle.verdict.distribution import distribution_metrics, judge_distribution
from oracle.verdict.metrics import OutputError, as_array, as_f64, score_resolution, tensor_metrics, top2_margin
from oracle.verdict.noise import aligner, attentions, exact_for, keep, measuring, noise_for, replay_jobs, score_error
from oracle.reports.result import E2E, GateRow, Status
from oracle.verdict.compare import shape_text, dtype_name, expected_dtype, reduction_length
from oracle.verdict.replay import differences, plan_of
from oracle.verdict.selection import differs, index_record, key_plan
from oracle.reference.cached import reference_of


def _step_logits(raw, k: int, ref_rows: int, vocab: int) -> np.ndarray:
    """A candidate's logits for e2e step k as [rows, V]: prefill [T or 1, V], decode [V]."""
    out = as_array(raw)
    if out.ndim == 0 or out.shape[-1] != vocab:
        raise OutputError(f"logits shape {shape_text(out)}: the last dimension must be the vocabulary ({vocab})")
    out = out.reshape(-1, vocab)
    allowed = (ref_rows, 1) if k == 0 else (1,)
    if out.shape[0] not in allowed:
        what = f"{ref_rows} (every prompt token) or 1 (the last)" if k == 0 else "1"
        raise OutputError(f"logits shape {shape_text(out)}: {out.shape[0]} row(s), expected {what}")
    return out


def candidate_steps(ref, cand, selections: list | None = None) -> tuple[list, list, str | None]:
    """The candidate's raw answers: its prefill of the reference's prompt, then each decode step
    fed the reference's next token (teacher forcing), and at each step the experts its routers
    selected (Candidate.last_routes; None where it does not report them). A raise ends the run: its
    state is unknown, the later steps are not run (the error names the step). A candidate that runs
    every step at once (Candidate.teacher_forced: a streamed model, layer by layer) answers them so.
    `selections` (a list, for a model with sparse attention) receives each step's Candidate.last_selections."""
    P, answers, routes = ref.prompt_len, [], []
    try:
        at_once = cand.teacher_forced(ref.tokens, P, len(ref.logits))
    except Exception as e:
        return [], [], f"the steps run layer by layer: {type(e).__name__}: {e}"
    if at_once is not None:
        return list(at_once[0]), list(at_once[1]), None
    for k in range(len(ref.logits)):
        try:
            answers.append(cand.prefill(ref.tokens[:P]) if k == 0 else cand.decode(ref.tokens[P + k - 1], P + k - 1))
        except Exception as e:
            return answers, routes, f"step {k} ({'prefill' if k == 0 else 'decode'}): {type(e).__name__}: {e}"
        try:
            routes.append(cand.last_routes())
        except Exception:  # noqa: BLE001 - not reported this step: the routing is then not known
            routes.append(None)
        if selections is not None:
            try:
                selections.append(cand.last_selections())
            except Exception:  # noqa: BLE001 - not reported this step: the selection is then not known
                selections.append(None)
    return answers, routes, None


@dataclass
class Aligned:
    """What the candidate's e2e steps are judged against: the reference's tokens, and the logits of HF
    fp32 with the candidate's routing forced (the reference's own where nothing differs)."""

    tokens: list
    prompt_len: int
    logits: list


def tie_bounds(scores: list, measured: list | None, spec, num_experts: int) -> list:
    """Per e2e call, per token: the tie bound of a layer's selection at the candidate's precision:
    tie_factor x the precision's own selection-score error inside HF's run at it (`measured`: the
    scores of HF at the precision (at fp32: at fp64), `scores` the reference's, per call); the router
    table's fixed gap where not measured."""
    router_lim = thresholds.limits(spec.precision, "router", spec.family, spec.backend)
    factor = router_lim.get("tie_factor") or (thresholds.exact(spec.precision) or {}).get("tie_factor")
    if measured is not None and factor and len(measured) >= len(scores):
        errs = [score_error([s], [m]) for s, m in zip(scores, measured)]
        # one token's error is one sample of the precision's rounding: at least the layer's median token's
        # (as an e2e step's noise is at least the median step's), so a token where HF happened to round
        # well does not hold another correct implementation to a tighter bound
        flat = np.concatenate(errs)
        median = float(np.median(flat[np.isfinite(flat)])) if np.isfinite(flat).any() else 0.0
        # plus the scores' own storage resolution at the precision (noise.score_resolution)
        return [factor * np.maximum(e, median) + score_resolution(np.asarray(s).reshape(-1, s.shape[-1]), spec.precision)
                for e, s in zip(errs, scores)]
    return [thresholds.tie_gap(router_lim, num_experts)] * len(scores)


def routing_differences(run: dict, measured, routes: list, positions: list, spec) -> list:
    """Every (step, layer, position) where the candidate's choice (`routes`: per step {layer: indices or
    (indices, weights)}) is not what the reference chose there (`run`: what_chose(...) of the plain
    reference or of the routing-aligned run, HF's own choice before forcing), judged (oracle/verdict/replay.py):
    a tie within the bound measured there (`measured`: a Noise at the precision, or None), else a router
    divergence. Where a discrete decision sets the weights, a difference of the weights counts too."""
    n = len(routes)
    out = []
    for layer in sorted(run["selected"]):
        cand = [r.get(layer) if r else None for r in routes]
        if all(c is None for c in cand):
            continue
        scores = run["scores"][layer][:n]
        at = None if measured is None else measured.e2e_scores.get(layer)
        bounds = tie_bounds(scores, None if at is None else at[:n], spec, scores[0].shape[-1])
        gaps = run["weight_gaps"].get(layer)
        groups = run["group_gaps"].get(layer)
        out += differences(run["selected"][layer][:n], cand, scores, bounds, positions[:n], layer,
                           run["weights"][layer][:n] if gaps else None, gaps[:n] if gaps else None, spec.precision,
                           groups[:n] if groups else None)
    return sorted(out, key=lambda d: (d.call, d.position, d.layer))


def what_chose(ref=None, noise=None) -> dict:
    """What HF chose at every e2e call, per layer: its experts, selection scores, weights and (where a
    discrete decision sets the weights) that decision's margins; of the plain reference or of a forced
    run (a Noise), HF's own choice there before forcing."""
    if noise is not None:
        return {"selected": noise.e2e_selected, "scores": noise.e2e_scores, "weights": noise.e2e_weights,
                "weight_gaps": noise.e2e_weight_gaps, "group_gaps": noise.e2e_group_gaps}
    return {"selected": {layer: [i for _, i in ref.outputs[layer, "router"]] for layer in ref.router_probs},
            "scores": dict(ref.router_probs),
            "weights": {layer: [w for w, _ in ref.outputs[layer, "router"]] for layer in ref.router_probs},
            "weight_gaps": dict(ref.weight_gaps), "group_gaps": dict(ref.group_gaps)}


def replay_plan(ref, routes: list, diffs: list, layer: int) -> list:
    """The e2e routing replay's forcing plan of one MoE layer: the candidate's selection there at every step,
    with its weights where `diffs` name weight differences (oracle/verdict/replay.py plan_of)."""
    return plan_of([r.get(layer) for r in routes], diffs, layer, ref.positions, layer in ref.weight_gaps)


class ReplayAhead:
    """The e2e routing replay (`replayed`, what run_e2e's `align` asks for) run ahead, in the candidate's
    layer-by-layer pass (Candidate.ahead's on_layer): once the candidate has run a MoE layer over every step,
    its forcing plan there is known (its selection against the reference's: oracle/verdict/e2e.py replay_plan), and HF
    at fp32 and at the check's precision with each attention run that layer with it, while its tensors are at
    hand. When the pass ends with a difference somewhere, each run is kept (cache and memory) under the plan's
    key, where run_e2e's replay finds it; where nothing differed they are dropped (no replay is asked). Its
    `passes()` go after the candidate's in the lockstep; `finish()` after it."""

    def __init__(self, ref, src, spec, prompt):
        self.ref, self.src, self.spec, self.prompt = ref, src, spec, prompt
        self.plan, self.differs, self.complete = {}, False, True
        at = [(spec.precision, a) for a in attentions(src.family)] if thresholds.noise_relative(spec.precision) else []
        self.runs = [("fp32", "eager"), *at]
        self.results = [None] * len(self.runs)

    def passes(self) -> list:
        """The generators of its runs, for the lockstep (asked only where a candidate runs ahead: a warm check
        of another backend imports no torch)."""
        return [self._pass(i, measuring(self.ref, self.src, s, **kw))
                for i, (_, s, kw) in enumerate(replay_jobs(self.src, self.spec, self.prompt, self.plan, self.runs))]

    def _pass(self, i, gen):
        try:
            self.results[i] = yield from gen
        except Exception:  # noqa: BLE001 - an optimisation: run_e2e replays (and reports) it itself
            self.complete = False

    def on_layer(self, layer: int, routes: list) -> None:
        if layer not in self.ref.router_probs:
            return
        if any(r is None or layer not in r for r in routes):
            self.complete = False
            return
        own = [{layer: r[layer]} for r in routes]
        diffs = routing_differences(what_chose(self.ref), None, own, self.ref.positions, self.spec)
        self.differs |= bool(diffs)
        self.plan[layer] = replay_plan(self.ref, own, diffs, layer)

    def finish(self) -> None:
        if not (self.complete and self.differs and set(self.plan) == set(self.ref.router_probs)):
            return
        for (key, _, _), noise in zip(replay_jobs(self.src, self.spec, self.prompt, self.plan, self.runs), self.results):
            keep(key, noise)  # under the whole plan's key, where run_e2e's replay asks


def run_e2e(ref, cand, spec, reduction: int = 0, collect: list | None = None, noise=None, exact=None, align=None,
            keep: dict | None = None):
    """The candidate's prefill and decode steps, fed the reference's tokens, judged. `collect` (a
    list) receives (step, reference rows, candidate rows) for each step the candidate answered.
    `noise` (oracle/verdict/noise.py, reduced precisions): each step is judged against HF's own logits
    error at this precision on that step (its routing forced to the reference's), and a token flip is
    a tie within that error. `exact` (fp32: a callable measuring HF fp32's own error against HF at
    fp64, oracle/verdict/noise.py exact_for): called only when a step fails the fixed table, a token differs or
    a routing does; such steps are then judged against fp32's own measured error too (the table stays the
    floor), see thresholds.toml [fp32.exact].
    Routing replay (oracle/verdict/replay.py): the candidate's selection at every step (Candidate.last_routes) is
    compared with the reference's; each difference is a tie or a router divergence (which fails), and
    where any differs, `align(plan)` (plan: layer -> [indices per step]) gives (HF fp32, HF at the
    precision, fp64's callable) with the candidate's selection forced, against which the steps are
    judged; the plain comparison is kept beside (`routing.plain`). No step is excused. `keep` (a dict) receives
    the candidate's raw answers, routes and error. Returns (E2E, the logits dtype gate or None)."""
    lim = thresholds.at_width(thresholds.limits(spec.precision, "e2e", spec.family, spec.backend), reduction)
    selections = [] if getattr(ref, "index_selected", None) else None
    answers, routes, error = candidate_steps(ref, cand, selections)
    if keep is not None:  # the path's raw answers, for the invariance rows (oracle/verdict/invariance.py)
        keep.update(answers=answers, routes=routes, error=error)
    reported = bool(routes) and all(r is not None for r in routes)
    rule = thresholds.exact(spec.precision)
    exact_once = _once(exact) if exact is not None else None
    plain = what_chose(ref) if reported else None
    diffs = routing_differences(plain, None, routes, ref.positions, spec) if reported else []
    target, target_noise, target_exact = Aligned(ref.tokens, ref.prompt_len, ref.logits), noise, exact_once
    # sparse attention: where the candidate kept other keys anywhere, its keys are forced on HF too (selection.py)
    keys = key_plan(ref, selections) if differs(ref, selections) else {}
    aligned, why_not = bool(diffs or keys) and align is not None, None
    if aligned and any(len(d.candidate) != len(d.reference) for d in diffs):
        aligned, why_not = False, "the candidate chose another number of experts: HF cannot be forced to it"
    if aligned:  # HF with the candidate's choice forced: what it then chooses, layer by layer, is what the
        # candidate's choice is judged against (a choice downstream of an earlier flip follows from it)
        plan = {layer: replay_plan(ref, routes, diffs, layer) for layer in sorted(ref.router_probs)} if reported else {}
        plan.update(keys)
        try:
            fp32, at, fp64 = align(plan)
        except Exception as e:  # noqa: BLE001 - judged against the plain reference, and said
            aligned, why_not = False, f"routing replay failed ({type(e).__name__}: {e})"
    if aligned:
        target = Aligned(ref.tokens, ref.prompt_len, fp32.logits)
        target_noise, target_exact = (at, None) if noise is not None else (None, _once(fp64))
        measured = at if noise is not None else _try(target_exact) if rule else None
        judged = routing_differences(what_chose(noise=fp32), measured, routes, ref.positions, spec)
        seen = {(d.call, d.layer, d.position) for d in judged}
        for d in diffs:  # a difference from the plain reference that HF makes too, given the earlier ones
            if (d.call, d.layer, d.position) not in seen:
                d.verdict = "follows"
                judged.append(d)
        diffs = sorted(judged, key=lambda d: (d.call, d.position, d.layer))
    elif diffs:  # no replay: the differences judged on the plain reference's gaps
        measured = noise if noise is not None else _try(exact_once) if rule else None
        diffs = routing_differences(plain, measured, routes, ref.positions, spec)
    if thresholds.quantized(spec.precision):  # quantized weights move the routing: their loss, judged by
        for d in diffs:  # the logits' distribution (KL), not a router's defect
            if d.verdict == "divergence":
                d.verdict = "quantization"
    e2e, rows, dtypes = judge_steps(target, answers, error, spec, lim, target_noise)
    if target_noise is None and target_exact is not None and rule and beyond_table(e2e, rule["measure_below"]):
        try:
            measured = target_exact()
        except Exception as e:  # not measurable (e.g. HF cannot run at fp64): the table's verdict stands
            e2e.measured_noise = f"not measured ({type(e).__name__}: {e}): the fixed table judged"
        else:
            e2e, rows, dtypes = judge_steps(target, answers, error, spec, thresholds.exact_limits(lim, rule), measured)
            beyond = [s["step"] for s in e2e.steps if s.get("beyond_table")]
            e2e.measured_noise = (f"HF {spec.precision}'s own error measured against HF at {measured.precision}: "
                                  + (f"step(s) {beyond} beyond the fixed table judged at most "
                                     f"{rule['factor']:g}x it" if beyond else "every step within it or the table"))
    e2e.routing = routing_record(ref, routes, reported, cand, diffs, aligned, answers)
    if why_not:
        e2e.routing["not_aligned"] = f"{why_not}: the steps judged against the plain reference"
    if (indexer := index_record(ref, selections, cand, spec, noise, diffs)) is not None:  # sparse attention's key selection
        e2e.routing["indexer"] = {**indexer, "forced": bool(aligned and keys)}
    if (e2e.routing.get("divergences") or (indexer or {}).get("divergences")) and e2e.status == Status.PASS:
        e2e.status = Status.FAIL
    if collect is not None:
        collect.extend(rows)
    want, got = expected_dtype(spec), sorted(d for d in dtypes if d)
    gate = None
    if want and got:
        gate = GateRow("logits_dtype", Status.PASS if got == [want] else Status.FAIL, ", ".join(got), want,
                       "the logits keep the model's declared dtype (no unconditional cast)")
    return e2e, gate


def _once(fn):
    """fn, called at most once (its result, or its exception, kept)."""
    box = []

    def call():
        if not box:
            try:
                box.append((fn(), None))
            except Exception as e:  # noqa: BLE001 - raised again to each caller
                box.append((None, e))
        value, err = box[0]
        if err is not None:
            raise err
        return value
    return call


def _try(fn):
    try:
        return fn()
    except Exception:  # noqa: BLE001 - not measurable: the fixed table or gap judges
        return None


def routing_record(ref, routes: list, reported: bool, cand, diffs: list, aligned: bool, answers: list) -> dict:
    """The e2e row's routing section: whether the candidate's selection was recorded (and why not),
    every difference with its gap, bound and verdict, and, where the steps were judged against the
    routing-aligned reference, the plain comparison with the reference beside it."""
    if not reported:
        return {"recorded": False, "why": cand.no_routes, "differences": [], "ties": 0, "divergences": 0,
                "aligned": False}
    out = {"recorded": True, "layers": sorted({layer for r in routes for layer in r}),
           "differences": [d.as_dict() for d in diffs], "ties": sum(d.verdict == "tie" for d in diffs),
           "follows": sum(d.verdict == "follows" for d in diffs),
           "divergences": sum(d.verdict == "divergence" for d in diffs), "aligned": aligned,
           **({"quantization": n} if (n := sum(d.verdict == "quantization" for d in diffs)) else {})}
    if aligned:  # the candidate against the plain reference too: what the replay explained
        plain = []
        for k, raw in enumerate(answers):
            try:
                out_k = _step_logits(raw, k, ref.logits[k].shape[0], ref.logits[k].shape[-1])
            except OutputError:
                continue
            m = tensor_metrics(ref.logits[k][-out_k.shape[0]:], out_k, 1.0, 0.0)
            plain.append({"step": k, "max_abs": m["max_abs"], "rel_l2": m["rel_l2"]})
        out["plain"] = plain
    return out


def beyond_table(e2e: E2E, measure_below: float) -> bool:
    """Whether fp32's own error is worth measuring: some finite, readable step fails the table or
    takes another token, and none is `measure_below` times beyond the table or more (a NaN, a
    crash, an unreadable output or a step that far off fails whatever fp32's error is)."""
    judged = [s for s in e2e.steps if s["logits_status"] == Status.FAIL or s["token"] != "match"]
    return bool(judged) and all(not s["nonfinite"] and "invalid_output" not in s and s["ratio"] < measure_below
                                for s in judged)


def judge_steps(ref, answers: list, error: str | None, spec, lim: dict, noise=None) -> tuple[E2E, list, set]:
    """The E2E row of the candidate's answers (candidate_steps), the (step, reference rows,
    candidate rows) of each readable step, and the logits' dtypes."""
    P = ref.prompt_len
    noisy = noise is not None and "noise_factor" in lim and len(noise.logits) == len(ref.logits)
    step_noise, noise_median = last_row_noise(ref, noise) if noisy else (None, None)
    steps, cand_tokens, ties, first, dtypes = [], [], [], None, set()
    rows, ref_rows, cand_rows = [], [], []  # every position's logits, for the distribution metrics
    for k, raw in enumerate(answers):
        r_all = ref.logits[k]
        vocab = r_all.shape[-1]
        ref_tok, margin = int(r_all[-1].argmax()), top2_margin(r_all[-1])
        try:
            out = _step_logits(raw, k, r_all.shape[0], vocab)
        except OutputError as e:
            cand_tokens.append(-1)
            steps.append({"step": k, "max_abs": None, "rel_l2": None, "nonfinite": 0, "ratio": float("inf"),
                          "logits_status": Status.FAIL, "invalid_output": str(e), "reference_margin": margin,
                          "reference_token": ref_tok, "candidate_token": -1, "token": "mismatch",
                          "first_divergence": None})
            if first is None:
                first = {"step": k, "position": P + k - 1 if k else P - 1, "reference_token": ref_tok,
                         "candidate_token": -1, "reference_margin": margin, "tie": False}
            continue
        r = r_all[-out.shape[0]:]
        dtypes.add(dtype_name(raw))
        ref_rows.append(as_f64(r).reshape(-1, vocab))
        cand_rows.append(out)
        rows.append((k, ref_rows[-1], out))
        m = tensor_metrics(r, out, lim["atol"], lim["rtol"])
        tie_margin = lim["tie_margin"]
        extra = {}
        if noisy:
            h = noise.logits[k].reshape(-1, vocab)[-out.shape[0]:].astype(np.float64)
            step_lim = thresholds.noise_row_limits(lim, as_f64(r).reshape(h.shape), h, spec.precision, m)
            status, ratio = thresholds.judge_noise(m, noise_step_floor(step_lim, noise_median))
            tie_margin = lim["tie_factor"] * step_noise[k]["max_abs"]
            if "exact_factor" in lim:  # fp32: the fixed table is the floor of the measured rule
                table_status, table_ratio = thresholds.judge_tensor(m, lim)
                extra["beyond_table"] = table_status == Status.FAIL
                status, ratio = (table_status, table_ratio) if table_ratio <= ratio else (status, ratio)
                tie_margin = max(tie_margin, lim["tie_margin"])
        else:
            status, ratio = thresholds.judge_tensor(m, lim)
        position = P + k - 1 if k else P - 1
        cand_tok = int(np.nanargmax(out[-1])) if np.isfinite(out[-1]).any() else -1
        cand_tokens.append(cand_tok)
        token_status = "match"
        if cand_tok != ref_tok:
            token_status = "tie" if margin < tie_margin else "mismatch"
            if token_status == "tie":
                ties.append(k)
            if first is None:
                first = {"step": k, "position": position, "reference_token": ref_tok,
                         "candidate_token": cand_tok, "reference_margin": margin, "tie": token_status == "tie"}
        steps.append({"step": k, "max_abs": m.get("max_abs"), "rel_l2": m.get("rel_l2"),
                      "nonfinite": m["nonfinite"], "ratio": ratio, "logits_status": status,
                      "reference_margin": margin, "reference_token": ref_tok,
                      "candidate_token": cand_tok, "token": token_status,
                      "first_divergence": m.get("first_divergence"),
                      **({k2: m[k2] for k2 in ("noise_max_abs", "vs_noise") if k2 in m}), **extra})
    complete = error is None and len(steps) == len(ref.logits)
    exact = complete and all(s["token"] == "match" for s in steps)
    ok = complete and all(s["logits_status"] == Status.PASS and s["token"] != "mismatch" for s in steps)
    distribution = None
    if "kl_mean" in lim and cand_rows:  # quantized precisions: judged by the logits' distribution, tokens reported
        distribution = distribution_metrics(np.concatenate(ref_rows), np.concatenate(cand_rows),
                                            lim.get("tie_margin", 0.0))
        distribution["status"], distribution["ratio"] = judge_distribution(distribution, lim)
        ok = distribution["status"] == Status.PASS and complete and not any("invalid_output" in s for s in steps)
    status = Status.ERROR if error else Status.PASS if ok else Status.FAIL
    e2e = E2E(status, ref.tokens[:P], ref.tokens[P:], cand_tokens, exact, steps, lim,
              first, ties, distribution, error=error)
    return e2e, rows, dtypes


def last_row_noise(ref, noise) -> tuple[list[dict], dict]:
    """HF's error at this precision on each e2e step's last row (the row that decides the token:
    its max_abs sets the step's tie margin), and the median over the steps (one step's error is
    one sample, and a step where HF happened to round well would otherwise hold another correct
    implementation to a tighter limit than the rest)."""
    errs = [tensor_metrics(r.reshape(-1, r.shape[-1])[-1:], h.reshape(-1, h.shape[-1])[-1:], 1.0, 0.0)
            for r, h in zip(ref.logits, noise.logits)]
    return errs, {"max_abs": float(np.median([e["max_abs"] for e in errs])),
                  "rel_l2": float(np.median([e["rel_l2"] for e in errs]))}


def noise_step_floor(lim: dict, median: dict) -> dict:
    """An e2e step's noise limits, at least noise_factor x HF's median step error."""
    f = lim["noise_factor"]
    return {**lim, "max_abs": max(lim["max_abs"], f * median["max_abs"]),
            "rel_l2": max(lim["rel_l2"], f * median["rel_l2"])}


def prompt_set(ref0, e2e0, rows0, spec, src, cand, prompts: list[list[int]], progress) -> dict:
    """Every prompt's e2e against its own reference (at a reduced precision, judged against HF's
    own error on that prompt), and the distribution metrics over all of
    them (llama.cpp's --kl-divergence figures): KL percentiles, same top-1, and the perplexity
    of each prompt's own next tokens under the candidate and the reference (prefill rows)."""
    lim = thresholds.at_width(thresholds.limits(spec.precision, "e2e", spec.family, spec.backend),
                              reduction_length(src.args))
    per, ref_all, cand_all, nll = [], [], [], {"reference": [], "candidate": []}
    for i, tokens in enumerate(prompts):
        progress("prompts", i, len(prompts))
        if i == 0:
            ref, e2e, rows = ref0, e2e0, rows0
        else:
            ref, rows = reference_of(spec, src, tokens), []
            try:  # reduced precisions: each prompt's steps judged against HF's own error on that prompt
                noise = noise_for(ref, src, spec, tokens)
            except Exception:  # not measurable: the fixed table, as for the first prompt (run_check)
                noise = None
            e2e = run_e2e(ref, cand, spec, reduction_length(src.args), rows, noise,
                          exact=lambda: exact_for(ref, src, spec, tokens), align=aligner(ref, src, spec, tokens))[0]
        per.append({"prompt_tokens": len(tokens), "status": e2e.status, "token_exact": e2e.token_exact,
                    "max_abs": max((s["max_abs"] for s in e2e.steps if s.get("max_abs") is not None), default=None)})
        if any("vs_noise" in s for s in e2e.steps):  # judged against HF's own error on this prompt
            per[-1]["max_vs_noise"] = max(s["vs_noise"] for s in e2e.steps if "vs_noise" in s)
        for k, r, c in rows:
            ref_all.append(r)
            cand_all.append(c)
            if k == 0 and c.shape[0] == len(tokens) and len(tokens) > 1:  # every prompt row: its next tokens
                nll["reference"].append((r[:-1], tokens[1:]))
                nll["candidate"].append((c[:-1], tokens[1:]))
    out = {"count": len(prompts), "per_prompt": per}
    if ref_all:
        d = distribution_metrics(np.concatenate(ref_all), np.concatenate(cand_all), lim.get("tie_margin", 0.0))
        if "kl_mean" in lim:
            d["status"], d["ratio"] = judge_distribution(d, lim)
        out["distribution"] = d
    if nll["reference"]:
        from oracle.verdict.distribution import perplexity

        ppl = {}
        for who, parts in nll.items():
            ppl[who], n = perplexity(np.concatenate([p for p, _ in parts]), np.concatenate([t for _, t in parts]))
        out["perplexity"] = {**ppl, "ratio": ppl["candidate"] / ppl["reference"], "positions": n}
    failed = any(p["status"] in (Status.FAIL, Status.ERROR) for p in per) or (out.get("distribution") or {}).get("status") == Status.FAIL
    out["status"] = Status.FAIL if failed else Status.PASS
    return out
