"""The end-to-end row: the candidate's prefill and teacher-forced decode steps against the
reference's logits and greedy tokens (token ties and routing ties read off measured margins), and
the same over a set of prompts with the distribution metrics and perplexity."""

from __future__ import annotations

import numpy as np

from oracle import thresholds
from oracle.distribution import distribution_metrics, judge_distribution
from oracle.metrics import OutputError, as_array, as_f64, tensor_metrics, top2_margin
from oracle.noise import exact_for, noise_for
from oracle.result import E2E, GateRow, Status
from oracle.compare import shape_text, dtype_name, expected_dtype, reduction_length, router_near_ties
from oracle.references import reference_of


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


def routing_tie_positions(ref, spec, noise=None) -> list[int]:
    """Positions of the reference's sequence where some layer's router is a near tie at this
    precision (k-th vs (k+1)-th selection score closer than tie_gaps)."""
    n = len(ref.tokens) - 1  # the sequence's calls: the prompt, then each fed-back token
    tie = np.zeros(n, dtype=bool)
    for layer in ref.router_probs:
        near = router_near_ties(ref, layer, spec, n, noise, in_model=True)
        tie[: near.shape[0]] |= near
    return [int(i) for i in np.flatnonzero(tie)]


def candidate_steps(ref, cand) -> tuple[list, str | None]:
    """The candidate's raw answers: its prefill of the reference's prompt, then each decode step
    fed the reference's next token (teacher forcing). A raise ends the run: its state is unknown,
    the later steps are not run (the error names the step)."""
    P, answers = ref.prompt_len, []
    for k in range(len(ref.logits)):
        try:
            answers.append(cand.prefill(ref.tokens[:P]) if k == 0 else cand.decode(ref.tokens[P + k - 1], P + k - 1))
        except Exception as e:
            return answers, f"step {k} ({'prefill' if k == 0 else 'decode'}): {type(e).__name__}: {e}"
    return answers, None


def run_e2e(ref, cand, spec, reduction: int = 0, collect: list | None = None, noise=None, exact=None):
    """The candidate's prefill and decode steps, fed the reference's tokens, judged. `collect` (a
    list) receives (step, reference rows, candidate rows) for each step the candidate answered.
    `noise` (oracle/noise.py, reduced precisions): each step is judged against HF's own logits
    error at this precision on that step, and a token flip is a tie within that error. `exact`
    (fp32: a callable measuring HF fp32's own error against HF at fp64, oracle/noise.py exact_for):
    called only when a step fails the fixed table or a token differs; such steps are then judged
    against fp32's own measured error too (the table stays the floor), see thresholds.toml
    [fp32.exact]. Returns (E2E, the logits dtype gate or None)."""
    lim = thresholds.at_width(thresholds.limits(spec.precision, "e2e", spec.family, spec.backend), reduction)
    answers, error = candidate_steps(ref, cand)
    e2e, rows, dtypes = judge_steps(ref, answers, error, spec, lim, noise)
    rule = thresholds.exact(spec.precision)
    if noise is None and exact is not None and rule and beyond_table(e2e, rule["measure_below"]):
        try:
            measured = exact()
        except Exception as e:  # not measurable (e.g. HF cannot run at fp64): the table's verdict stands
            e2e.measured_noise = f"not measured ({type(e).__name__}: {e}): the fixed table judged"
        else:
            e2e, rows, dtypes = judge_steps(ref, answers, error, spec, thresholds.exact_limits(lim, rule), measured)
            beyond = [s["step"] for s in e2e.steps if s.get("beyond_table")]
            e2e.measured_noise = (f"HF {spec.precision}'s own error measured against HF at {measured.precision}: "
                                  + (f"step(s) {beyond} beyond the fixed table judged at most "
                                     f"{rule['factor']:g}x it" if beyond else "every step within it or the table"))
    if collect is not None:
        collect.extend(rows)
    want, got = expected_dtype(spec), sorted(d for d in dtypes if d)
    gate = None
    if want and got:
        gate = GateRow("logits_dtype", Status.PASS if got == [want] else Status.FAIL, ", ".join(got), want,
                       "the logits keep the model's declared dtype (no unconditional cast)")
    return e2e, gate


def beyond_table(e2e: E2E, measure_below: float) -> bool:
    """Whether fp32's own error is worth measuring: some finite, readable step fails the table or
    takes another token, and none is `measure_below` times beyond the table or more (a NaN, a
    crash, an unreadable output or a step that far off fails whatever fp32's error is)."""
    judged = [s for s in e2e.steps if s["logits_status"] in (Status.FAIL, Status.ROUTING_TIE) or s["token"] != "match"]
    return bool(judged) and all(not s["nonfinite"] and "invalid_output" not in s and s["ratio"] < measure_below
                                for s in judged)


def judge_steps(ref, answers: list, error: str | None, spec, lim: dict, noise=None) -> tuple[E2E, list, set]:
    """The E2E row of the candidate's answers (candidate_steps), the (step, reference rows,
    candidate rows) of each readable step, and the logits' dtypes."""
    P = ref.prompt_len
    noisy = noise is not None and "noise_factor" in lim and len(noise.logits) == len(ref.logits)
    # A step that attends to a position whose expert choice is a near tie (in any layer) may
    # see that token routed to other experts by the candidate's own rounding: its logits and
    # token are then judged `routing-tie` (reported, as token ties are), never for NaN/Inf.
    # Measured noise (reduced precisions, fp32 beyond its table): only a step judged at such a
    # position (a flipped choice shows at its own position), see excuse_routing_ties
    routing_ties = routing_tie_positions(ref, spec, noise)
    # fp32 (a precision with an exact rule) and measured noise: a step is excused only at its own
    # position; the fixed q8/q4 tables keep "any earlier near tie" (judged by the distribution)
    own_position = noisy or thresholds.exact(spec.precision) is not None
    first_routing_tie = routing_ties[0] if routing_ties and not own_position else None
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
        routed_tie = first_routing_tie is not None and first_routing_tie <= position and not m["nonfinite"]
        if status == Status.FAIL and routed_tie and "shape_mismatch" not in m:
            status = Status.ROUTING_TIE
        cand_tok = int(np.nanargmax(out[-1])) if np.isfinite(out[-1]).any() else -1
        cand_tokens.append(cand_tok)
        token_status = "match"
        if cand_tok != ref_tok:
            token_status = "tie" if margin < tie_margin else "routing-tie" if routed_tie else "mismatch"
            if token_status == "tie":
                ties.append(k)
            if first is None:
                first = {"step": k, "position": position, "reference_token": ref_tok,
                         "candidate_token": cand_tok, "reference_margin": margin, "tie": token_status == "tie",
                         "routing_tie": token_status == "routing-tie"}
        steps.append({"step": k, "max_abs": m.get("max_abs"), "rel_l2": m.get("rel_l2"),
                      "nonfinite": m["nonfinite"], "ratio": ratio, "logits_status": status,
                      "reference_margin": margin, "reference_token": ref_tok,
                      "candidate_token": cand_tok, "token": token_status,
                      "first_divergence": m.get("first_divergence"),
                      **({k2: m[k2] for k2 in ("noise_max_abs", "vs_noise") if k2 in m}), **extra})
    if own_position:
        excuse_routing_ties(steps, routing_ties, P, first)
    complete = error is None and len(steps) == len(ref.logits)
    exact = complete and all(s["token"] == "match" for s in steps)
    ok = complete and all(s["logits_status"] in (Status.PASS, Status.ROUTING_TIE) and s["token"] != "mismatch" for s in steps)
    distribution = None
    if "kl_mean" in lim and cand_rows:  # quantized precisions: judged by the logits' distribution, tokens reported
        distribution = distribution_metrics(np.concatenate(ref_rows), np.concatenate(cand_rows),
                                            lim.get("tie_margin", 0.0))
        distribution["status"], distribution["ratio"] = judge_distribution(distribution, lim)
        ok = distribution["status"] == Status.PASS and complete and not any("invalid_output" in s for s in steps)
    status = Status.ERROR if error else Status.PASS if ok else Status.FAIL
    e2e = E2E(status, ref.tokens[:P], ref.tokens[P:], cand_tokens, exact, steps, lim,
              first, ties, distribution, error=error, routing_ties=routing_ties)
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


def excuse_routing_ties(steps: list[dict], tie_positions: list[int], P: int, first: dict | None) -> None:
    """Measured noise: a failing step is `routing-tie` (reported, not failed) only when the
    position it is judged at is itself a near tie inside HF's own run at this precision (the
    prefill: any prompt position), never for NaN/Inf or an unreadable output. A flipped expert
    choice shows at its own position; no step is excused for an earlier one, so a decode-path
    defect fails at every decode step whose own routing is not a near tie. (What a flip at an
    earlier position does to later steps through attention would need the reference with that
    choice flipped: not measured, so not excused; nor is a weight decided by a near tie, such as
    sparsemixer's masks, which the block rows judge.)"""
    ties = set(tie_positions)
    for s in steps:
        if s["logits_status"] != Status.FAIL and s["token"] != "mismatch":
            continue
        if s["nonfinite"] or "invalid_output" in s:
            continue
        held = range(P) if s["step"] == 0 else [P + s["step"] - 1]
        if not ties.intersection(held):
            continue
        if s["logits_status"] == Status.FAIL:
            s["logits_status"] = Status.ROUTING_TIE
        if s["token"] == "mismatch":
            s["token"] = "routing-tie"
            if first is not None and first["step"] == s["step"]:
                first["routing_tie"] = True


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
                          exact=lambda: exact_for(ref, src, spec, tokens))[0]
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
        from oracle.distribution import perplexity

        ppl = {}
        for who, parts in nll.items():
            ppl[who], n = perplexity(np.concatenate([p for p, _ in parts]), np.concatenate([t for _, t in parts]))
        out["perplexity"] = {**ppl, "ratio": ppl["candidate"] / ppl["reference"], "positions": n}
    failed = any(p["status"] in (Status.FAIL, Status.ERROR) for p in per) or (out.get("distribution") or {}).get("status") == Status.FAIL
    out["status"] = Status.FAIL if failed else Status.PASS
    return out
