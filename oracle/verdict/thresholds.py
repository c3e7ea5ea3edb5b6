"""Thresholds are data: `thresholds.toml`, keyed by precision and block kind, with
`[[override]]` entries per family / backend (`*` matches any)."""

from __future__ import annotations

import functools
import math
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from oracle.reports.result import Status

DEFAULT_PATH = Path(__file__).with_name("thresholds.toml")


@functools.cache
def load(path: Path = DEFAULT_PATH) -> dict:
    """The thresholds file; a precision table `[P] same_as = "Q"` is Q's tables (what it sets beside
    `same_as` overrides them)."""
    with open(path, "rb") as f:
        data = tomllib.load(f)
    for p, t in list(data.items()):
        if isinstance(t, dict) and "same_as" in t:
            base = data[t["same_as"]]
            data[p] = {**base, **{k: v for k, v in t.items() if k != "same_as"}}
    return data


def precisions(path: Path = DEFAULT_PATH) -> list[str]:
    return [k for k in load(path) if k != "override"]


def limits(precision: str, kind: str, family: str = "*", backend: str = "*", path: Path = DEFAULT_PATH) -> dict:
    """The limits for one block kind (or 'e2e'), with matching overrides applied in file order."""
    data = load(path)
    if precision not in data:
        raise KeyError(f"no thresholds for precision {precision!r} (known: {', '.join(precisions(path))})")
    table = data[precision]
    out = dict(table.get(kind, {}))
    for ov in data.get("override", []):
        if (
            fnmatch(family, ov.get("family", "*"))
            and fnmatch(backend, ov.get("backend", "*"))
            and fnmatch(precision, ov.get("precision", "*"))
            and fnmatch(kind, ov.get("kind", "*"))
        ):
            out.update({k: v for k, v in ov.items() if k not in ("family", "backend", "precision", "kind", "why")})
    if not out:
        raise KeyError(f"no thresholds for {precision}.{kind}")
    return out


def at_width(lim: dict, reduction: int) -> dict:
    """The limits for a model whose longest dot product (the reduction: max of hidden size and
    expert / shared-expert intermediate sizes) has `reduction` terms: an `atol` written for
    `atol_reduction` terms grows as sqrt(reduction / atol_reduction), as fp32 summation error
    does (never shrinks). Tables without `atol_reduction` are unchanged: see thresholds.toml."""
    base = lim.get("atol_reduction")
    if not base or reduction <= base:
        return lim
    return {**lim, "atol": lim["atol"] * (reduction / base) ** 0.5}


def at_scale(lim: dict, ref_rms: float) -> dict:
    """The limits for a reference tensor of RMS `ref_rms`: an `atol` written for activations of
    RMS up to `atol_rms` grows in proportion above it, as rounding error does at a precision
    whose error is relative (bf16, quantized weights). Tables without `atol_rms` are unchanged:
    see thresholds.toml."""
    base = lim.get("atol_rms")
    if not base or not ref_rms > base:  # NaN-safe: a non-finite reference keeps the written atol
        return lim
    return {**lim, "atol": lim["atol"] * ref_rms / base}


def tie_gap(router_lim: dict, num_experts: int) -> float:
    """The router near-tie gap for a model with `num_experts` experts: `tie_gap` is written for
    `tie_gap_experts` experts and scales as 1/E, as the router's probabilities do (the same gap
    in logit terms whatever the expert count): see thresholds.toml."""
    return router_lim["tie_gap"] * router_lim.get("tie_gap_experts", num_experts) / num_experts


def judge_tensor(m: dict, lim: dict) -> tuple[str, float]:
    """(status, ratio): ratio is the worst metric / limit; > 1 fails. NaN/Inf always fails."""
    if "shape_mismatch" in m or "dtype_mismatch" in m:
        return Status.FAIL, float("inf")
    if m["nonfinite"]:
        return Status.FAIL, float("inf")
    ratio = max(m["allclose_ratio"], m["rel_l2"] / lim["rel_l2"])
    return (Status.PASS if ratio <= 1.0 else Status.FAIL), ratio


def _over(x: float, limit: float) -> float:
    """x in units of its limit (a limit of 0 allows exactly 0)."""
    return x / limit if limit > 0 else (0.0 if x == 0 else float("inf"))


def quantized(precision: str, path: Path = DEFAULT_PATH) -> bool:
    """Whether the precision quantizes weights: its end-to-end row is judged by the logits'
    distribution (its e2e table carries `kl_mean`)."""
    return "kl_mean" in load(path).get(precision, {}).get("e2e", {})


def noise_relative(precision: str, path: Path = DEFAULT_PATH) -> bool:
    """Whether the precision's limits are relative to its own measured error (oracle/verdict/noise.py):
    its tables carry `noise_factor`."""
    return any(isinstance(t, dict) and "noise_factor" in t for t in load(path).get(precision, {}).values())


def noise_limits(lim: dict, noise: dict, stored: dict) -> dict:
    """The limits of one row judged against the precision's own error: at most `noise_factor`
    times HF-at-this-precision's error on the same inputs (`noise`: max_abs, rel_l2) plus
    `noise_floor` times the error of merely storing the reference at this precision (`stored`),
    the floor of any implementation's error. See thresholds.toml (bf16)."""
    f, g = lim["noise_factor"], lim["noise_floor"]
    out = {**lim, "max_abs": f * noise["max_abs"] + g * stored["max_abs"],
           "rel_l2": f * noise["rel_l2"] + g * stored["rel_l2"]}
    if lim.get("table_floor"):  # an arithmetic without storage rounding (a8): the fixed table is the floor
        out["max_abs"], out["rel_l2"] = max(out["max_abs"], lim["atol"]), max(out["rel_l2"], lim["rel_l2"])
    return out


def exact(precision: str, path: Path = DEFAULT_PATH) -> dict | None:
    """The precision's rule for e2e steps beyond its fixed table, judged against its own error
    measured against HF at fp64 (`[<precision>.exact]`: fp32), or None."""
    return load(path).get(precision, {}).get("exact")


def exact_limits(lim: dict, rule: dict) -> dict:
    """An e2e step's limits against the precision's own measured error (HF fp32 against HF at fp64,
    oracle/verdict/noise.py exact_for): the noise rule with the rule's `factor` and no storage floor (fp32 is
    the reference's own storage), ties at its `tie_factor` times that error; `exact_factor` marks
    that the fixed table stays the floor (oracle/verdict/e2e.py). See thresholds.toml [fp32.exact]."""
    return {**lim, "exact_factor": rule["factor"], "noise_factor": rule["factor"], "noise_floor": 0.0,
            "tie_factor": rule["tie_factor"]}


def judge_noise(m: dict, lim: dict) -> tuple[str, float]:
    """(status, ratio) of a tensor row against noise_limits: ratio is the worse of max_abs and
    rel_l2 over their limits; > 1 fails. NaN/Inf always fails."""
    if "shape_mismatch" in m or "dtype_mismatch" in m or m["nonfinite"]:
        return Status.FAIL, float("inf")

    ratio = max(_over(m["max_abs"], lim["max_abs"]), _over(m["rel_l2"], lim["rel_l2"]))
    return (Status.PASS if ratio <= 1.0 else Status.FAIL), ratio


def in_situ(precision: str, path: Path = DEFAULT_PATH) -> dict | None:
    """The precision's rule for in-situ rows (oracle/verdict/insitu.py), its `[<precision>.in_situ]`
    table, or None: in-situ rows are then judged by the isolated tables."""
    return load(path).get(precision, {}).get("in_situ")


def upstream_limits(lim: dict, rule: dict, upstream: dict) -> dict:
    """The limits of an in-situ row: the isolated table plus `upstream_factor` times what HF fp32
    makes of the candidate's own upstream (`upstream`: its max_abs and rel_l2 against the
    reference). rel_l2 here; the elementwise bound, atol + rtol |ref| + factor |upstream - ref| per
    element, is applied where the arrays are (oracle.verdict.compare.upstream_metrics). See thresholds.toml."""
    f = rule["upstream_factor"]
    return {**lim, "upstream_factor": f, "table_rel_l2": lim["rel_l2"], "rel_l2": lim["rel_l2"] + f * upstream["rel_l2"]}


def judge_upstream(m: dict, lim: dict) -> tuple[str, float]:
    """(status, ratio) of an in-situ row against upstream_limits: the worse of the elementwise
    bound (`upstream_allclose_ratio`) and rel_l2 over its limit; > 1 fails. NaN/Inf always fails."""
    if "shape_mismatch" in m or "dtype_mismatch" in m or m["nonfinite"]:
        return Status.FAIL, float("inf")
    ratio = max(m["upstream_allclose_ratio"], _over(m["rel_l2"], lim["rel_l2"]))
    return (Status.PASS if ratio <= 1.0 else Status.FAIL), ratio


def judge_router(m: dict, lim: dict) -> tuple[str, float]:
    if "shape_mismatch" in m or m["nonfinite"]:
        return Status.FAIL, float("inf")
    allowed = max(1.0 - lim["min_agreement"], 1e-3)
    ratio = max(_over(m["weight_max_abs"], lim["weight_atol"]), (1.0 - m["topk_agreement"]) / allowed)
    ok = m["weight_max_abs"] <= lim["weight_atol"] and m["topk_agreement"] >= lim["min_agreement"]
    return (Status.PASS if ok else Status.FAIL), ratio


def noise_row_limits(lim: dict, r, h, precision: str, m: dict) -> dict:
    """The limits of a row (or an e2e step) whose reference is `r`, from HF's own output `h` at
    this precision on the same inputs; records HF's error and the candidate's ratio to it in `m`."""
    if h.shape != r.shape:
        return lim
    from oracle.verdict.metrics import rounding, tensor_metrics

    nm = tensor_metrics(r, h, lim["atol"], lim["rtol"])
    stored = tensor_metrics(r, rounding(r, precision), lim["atol"], lim["rtol"])
    m["noise_max_abs"], m["noise_rel_l2"] = nm["max_abs"], nm["rel_l2"]
    if "max_abs" in m:  # the candidate's error as a multiple of the precision's own
        m["vs_noise"] = m["max_abs"] / nm["max_abs"] if nm["max_abs"] > 0 else (0.0 if m["max_abs"] == 0 else math.inf)
    return noise_limits(lim, nm, stored)
