"""How a faulted check is judged against its clean twin: whether it failed by a measurement, the
rows that are new, the one that localises the fault, its error over the precision's noise, whether
the drill's points include the one the fault breaks."""

from __future__ import annotations

from dataclasses import asdict

from oracle.reports.result import Status, worst_row

CLEAN = (Status.PASS, Status.XFAIL)  # a clean run that fails as its known divergence says is no false alarm


def same_numbers(a, b) -> bool:
    """Whether two checks of the same spec measured exactly the same: every block row's metrics
    and every e2e step and token (a fault that changed nothing in the candidate)."""
    if a.status == Status.ERROR or b.status == Status.ERROR:
        return False
    rows = lambda r: {(x.layer, x.kind): (x.status, x.metrics) for x in r.blocks}  # noqa: E731
    e2e = lambda r: None if r.e2e is None else (r.e2e.candidate_tokens, [s.get("max_abs") for s in r.e2e.steps])  # noqa: E731
    inv = lambda r: [(x["name"], x["status"], x.get("max_abs")) for x in r.invariance or []]  # noqa: E731
    return rows(a) == rows(b) and e2e(a) == e2e(b) and inv(a) == inv(b)


def measured_failure(r) -> bool:
    """Whether a check failed by a measurement (a block, e2e or invariance row that failed), not only by rows
    whose candidate raised (status error: a crash, not a detection). Gates are not counted: a candidate that
    raised has no tokens, and its golden-tokens gate fails for that alone."""
    return (any(x.status == Status.FAIL for x in [*r.blocks, *([r.e2e] if r.e2e is not None else [])])
            or any(x["status"] == Status.FAIL for x in r.invariance or []))


INVARIANCE = "invariance."  # a fault's kind that names an invariance row (models/faults/invariance.py)


def invariance_row(r, kind: str) -> dict | None:
    """The invariance row a fault of kind `invariance.<row>` names, in check r."""
    name = kind.removeprefix(INVARIANCE)
    return next((x for x in r.invariance or [] if x["name"] == name), None)


def invariance_localised(faulted, clean, kind: str) -> dict | None:
    """The worst_summary-like record of the invariance row an invariance fault names, where that row fails in
    the faulted check and not in the clean one; else None."""
    row, base = invariance_row(faulted, kind), invariance_row(clean, kind)
    if row is None or row["status"] != Status.FAIL or (base is not None and base["status"] == Status.FAIL):
        return None
    return {"layer": None, "kind": kind, "metric": "ratio", "value": row.get("ratio"), "limit": 1.0,
            "ratio": row.get("ratio")}


def invariance_unjudgeable(clean, fault) -> str | None:
    """Why an invariance fault cannot be caught on this backend (its row, or the run it needs, is n/a in
    the clean check), or None."""
    row = invariance_row(clean, fault.kind)
    if row is None:
        return "the check ran no invariance rows"
    if row["status"] == Status.NA:
        return f"its row is n/a: {row.get('detail')}"
    if fault.name == "chunk_forgets_cache" and not any("+" in x.get("run", "") and x["status"] != Status.NA
                                                       for x in row.get("runs", [])):
        return f"the chunked row has no chunk after a first longer than a token: {row.get('detail')}"
    return None


def new_rows(faulted, clean) -> list:
    """The faulted check's block rows that did not already fail without the fault (a family with a
    known divergence fails some rows clean: those say nothing about the fault)."""
    failed_clean = {(b.layer, b.kind) for b in clean.blocks if b.status in (Status.FAIL, Status.ERROR)}
    return [b for b in faulted.blocks if (b.layer, b.kind) not in failed_clean]


def raised(faulted, clean) -> bool:
    """Whether the faulted candidate raised: the whole check, or a block or e2e row that does not
    raise without the fault (a known divergence may raise clean)."""
    e2e = [faulted.e2e] if faulted.e2e is not None and (clean.e2e is None or clean.e2e.status != Status.ERROR) else []
    return faulted.status == Status.ERROR or any(x.status == Status.ERROR for x in [*new_rows(faulted, clean), *e2e])


def error_of(r) -> str | None:
    """What a check's candidate raised, first line: the check's error, else a row's, else e2e's."""
    msgs = [r.error, *(b.metrics.get("exception") for b in r.blocks), r.e2e.error if r.e2e is not None else None]
    m = next((x for x in msgs if x), None)
    return str(m).strip().splitlines()[0][:300] if m else None


def new_worst(faulted, clean) -> dict | None:
    """The row that localises a fault: the faulted check's worst row among new_rows. asdict of
    the row, or None."""
    if not any(b.status in (Status.FAIL, Status.ERROR) for b in clean.blocks):
        return faulted.worst
    w = worst_row(new_rows(faulted, clean))
    return asdict(w) if w else None


def worst_summary(doc_worst: dict | None) -> dict | None:
    if not doc_worst:
        return None
    m, lim = doc_worst["metrics"], doc_worst["limits"]
    if m.get("shape_mismatch") or m.get("invalid_output"):  # a measured finding (e.g. k-1 experts per token
        # where k were expected), not a malformed row
        metric, value, limit = "shape", m.get("shape_mismatch") or m["invalid_output"], "the reference's shape"
    elif doc_worst["kind"] == "router":
        metric, value, limit = "weight_max_abs", m.get("weight_max_abs"), lim.get("weight_atol")
        if m.get("topk_agreement", 1.0) < lim.get("min_agreement", 1.0):
            metric, value, limit = "topk_agreement", m.get("topk_agreement"), lim.get("min_agreement")
    else:
        metric, value, limit = "rel_l2", m.get("rel_l2"), lim.get("rel_l2")
        if m.get("nonfinite"):
            metric, value, limit = "nonfinite", m["nonfinite"], 0
        if m.get("dtype_mismatch"):
            metric, value, limit = "dtype", m["dtype_mismatch"], "model dtype"
    return {"layer": doc_worst["layer"], "kind": doc_worst["kind"], "metric": metric, "value": value,
            "limit": limit, "ratio": doc_worst["ratio"]}


def noise_ratio(fp32_result, bf_result, expected: dict, clean=None) -> float | None:
    """The fault's fp32 error on the block it targets, less the clean candidate's own error there at the
    noise-relative precision (`clean`, the unfaulted check at that precision; None: not subtracted), over
    that block's limit at the precision (the row of `bf_result` has the limits HF's own error there sets).

    > 1 is where detection is guaranteed: the faulted candidate's error is the fault's plus its own
    rounding, and by the triangle inequality (max |f + n| >= max |f| - max |n|; ||f + n|| >= ||f|| - ||n||)
    it then exceeds the limit whatever the rounding's signs. Between the fault's error alone and that, a
    correct oracle catches it or not by the rounding's draw (measured: nemotron_h's expert_weights_off_1e-3
    at 1.04x the bf16 limit of its MoE row alone, 0.39x the candidate's own error there, gave 0.87x: missed);
    such a fault is stated, not required. inf where the fp32 run has no comparable row (it crashed, or the
    block is not isolated): such a fault stays required."""
    def row(result):
        return next((b for b in result.blocks if (b.layer, b.kind) == (expected["layer"], expected["kind"])
                     and b.status != Status.NA), None) if result is not None else None

    a, b, c = row(fp32_result), row(bf_result), row(clean)
    if a is None or b is None or fp32_result.status == Status.ERROR:
        return float("inf")
    m, lim = a.metrics, b.limits
    own = c.metrics if c is not None else {}
    if expected["kind"] == "router":
        if m.get("topk_agreement", 1.0) < lim.get("min_agreement", 1.0):
            return float("inf")  # the fault routes tokens elsewhere at fp32
        return _over(m.get("weight_max_abs"), lim.get("weight_atol"), own.get("weight_max_abs"))
    return max(_over(m.get("max_abs"), lim.get("max_abs"), own.get("max_abs")),
               _over(m.get("rel_l2"), lim.get("rel_l2"), own.get("rel_l2")))


def _over(x, limit, own=None) -> float:
    """(x - own) / limit: the fault's error less the candidate's own (0 where not measured), in limits."""
    if not isinstance(x, (int, float)) or not isinstance(limit, (int, float)):
        return float("inf")  # nothing to compare: required
    own = own if isinstance(own, (int, float)) and own == own else 0.0
    return max(x - own, 0.0) / limit if limit > 0 else float("inf")


def point_exposed(point, drilled_points: list[dict]) -> tuple[bool, str]:
    """Whether a drill's points include the fault's point (one of them, for a tuple) with a value on
    the candidate's side; else why not (its n/a reason, or "not a point of this backend's block")."""
    if point is None or not drilled_points:
        return True, ""
    names = point if isinstance(point, (tuple, list)) else (point,)
    found = [p for p in drilled_points if p["name"] in names]
    if any(p["status"] != Status.NA for p in found):
        return True, ""
    return False, (found[0]["reason"] if found else "not a point of this backend's block")
