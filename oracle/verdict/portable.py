"""What a report says about the machine it ran on, and the one rule every comparison of reports
uses to leave it out (tests/baselines via oracle.reports.baseline, the host-independence tests).

The rule, in three parts:
1. Keys. Host facts live under a key named `host` (the report's provenance.host: node name,
   CPU count, torch's threads, IREE's target-CPU hash, a GPU's name); run state under `timings`
   and `cache`; the environment under `python`, `versions` and `thresholds_sha256`; where files
   happen to be under `dir` and `path`. Each is dropped wherever it occurs, at any depth.
2. Values, by what they are. Exact: what is declared exact, i.e. every value that is not a float
   (statuses, tokens, ids, counts, names, shapes, booleans) and the check's declared inputs
   (`spec`, a backend's `config`). **Every float is a measurement on some host** and is compared
   within a tolerance: kernels pick their instructions by the CPU they run on (IREE compiles
   llvm-cpu for the host's features, XNNPACK and oneDNN dispatch on AVX2 / AVX-512), so the same
   correct program rounds differently on another machine. A float no rule names gets the
   tolerant default of its report's precision (`DEFAULT`: relative 1e-3 at fp32, 2e-2 at bf16
   and below, a few roundings of the precision, with an absolute floor for values near zero),
   never a near-exact one; the named kinds widen it by what they are:
   - a measured error (`max_abs`, `rel_l2`, `weight_max_abs`, and HF's own `noise_*` and the
     in-situ `upstream_*`) may move by a tenth of the limit it is judged by (`LIMIT_SHARE`): enough
     for rounding at the level of the precision, far too little to hide a change of verdict;
   - a ratio to a limit (`ratio`, `allclose_ratio`) by LIMIT_SHARE; a limit (under `limits`) by a
     relative LIMIT_SHARE (a limit at bf16 or in-situ is derived from a host measurement);
   - a margin or gap (a difference of two reference logits) by `MARGIN_ABS`, as the logits round;
   - a reading of two host-measured errors' ratio (`vs_noise`, `vs_upstream`) is not compared.
3. Near ties of routing (oracle/verdict/replay.py). A tie is, by its definition, a choice of experts within the
   host's rounding (the reference's gap under a bound measured from HF's own error on this host), so
   which ties a host meets, and everything that follows from them, is a host fact: the `tie` and
   `follows` entries of a routing record (`e2e.routing`, a block row's `routing_differences`), its
   counts of them, whether it was aligned for them, the plain comparison beside it, a row's tie counts
   and near-tie note, and a tie bound itself (one point of HF's measured rounding; measured 0.00744 here
   and 0.00681 with ATen's AVX2 kernels, qwen3_moe eager bf16, 2026-11-28). A **divergence** (beyond
   the bound) is compared like any result, with its count, layer, position and experts.
   A field absent on one side and null on the other (added to the schema later) is the same.
tests/test_portable.py perturbs every float of every saved baseline by host-like rounding and
adds fields no rule names: the reports must still compare equal, and a changed status, token,
localised block or an error past its limit must not.
"""

from __future__ import annotations

import math

# keys whose values depend on the machine, the environment or the run, not on the check
# (`plan`: the memory and cache a check planned before it started, by this version's estimates)
HOST_KEYS = frozenset({"host", "python", "versions", "thresholds_sha256", "timings", "cache", "dir", "path", "plan"})
# a compiled program carries the source locations (file:line) of the code it was traced from, so its
# bytes change with any edit of that code: artifacts are compared by name (what they compute is in
# every row); a checkpoint's sha256 is kept (the tiny checkpoints are the same bytes everywhere)
ARTIFACT_LISTS = frozenset({"artifacts"})
# the check's declared inputs: given, not measured, so compared exactly (floats included)
EXACT_KEYS = frozenset({"spec", "config"})

# the default for a float no rule names: (relative, absolute floor) by the report's precision. fp32:
# a kernel's other summation order moves a value by ~1e-6 relative (more for a difference of two
# values, which the floor covers); bf16 rounds to 2^-8 relative, and a value computed through a
# bf16 model moves by a few of those. Precisions not listed (bf16, fp16, q8, q4, unknown) take
# REDUCED. Never tighter than these: a field added later is portable before anyone names it.
DEFAULT = {"fp32": (1e-3, 1e-6), "fp64": (1e-3, 1e-6)}
REDUCED = (2e-2, 1e-4)

# a measured error may move by this share of its limit between machines (see the docstring)
LIMIT_SHARE = 0.1
# measured error -> the limit key it is judged by (ratios are already in units of the limit)
ERROR_LIMITS = {"max_abs": "atol", "rel_l2": "rel_l2", "weight_max_abs": "weight_atol",
                "noise_max_abs": "atol", "noise_rel_l2": "rel_l2", "noise_weight_max_abs": "weight_atol",
                "upstream_max_abs": "atol", "upstream_rel_l2": "rel_l2", "upstream_weight_max_abs": "weight_atol"}
RATIOS = frozenset({"ratio", "allclose_ratio", "upstream_allclose_ratio"})
# readings of two host-measured errors' ratio (absent where the divisor is 0): not compared
DERIVED = frozenset({"vs_noise", "vs_upstream"})
# a difference of two reference logits rounds as they do on the host: a tenth of the fp32 e2e atol (1e-4)
MARGIN_ABS = 1e-5
# part 3: the routing records' verdicts within the host's rounding, and what a record or row says of them
TIE_VERDICTS = frozenset({"tie", "follows"})
TIE_RECORD_KEYS = frozenset({"ties", "follows", "aligned", "plain"})  # of a routing record (e2e.routing)
TIE_ROW_KEYS = frozenset({"tie_tokens", "tie_disagreements", "aligned_tokens", "plain_max_abs"})  # a row's metrics


def beyond_ties(differences: list) -> list:
    """A routing record's differences without those within the host's rounding, each without its bound."""
    return [{k: v for k, v in d.items() if k != "bound"} for d in differences
            if not (isinstance(d, dict) and d.get("verdict") in TIE_VERDICTS)]


def comparable(doc):
    """`doc` without its host facts, run state and file locations (part 1 of the rule), and without
    its routing's near ties (part 3)."""
    if isinstance(doc, dict):
        out = {}
        for k, v in doc.items():
            if k in HOST_KEYS or k in TIE_ROW_KEYS or (k == "routing" and isinstance(v, str)):
                continue  # (a block row's `routing`: its note of the near ties it swapped)
            if k == "routing" and isinstance(v, dict):
                v = {rk: beyond_ties(rv) if rk == "differences" and isinstance(rv, list) else rv
                     for rk, rv in v.items() if rk not in TIE_RECORD_KEYS}
            if k == "routing_differences" and isinstance(v, list):
                v = beyond_ties(v)
                if not v:
                    continue  # a row lists its differences only where it has some
            if k in ARTIFACT_LISTS and isinstance(v, list):
                v = [{ak: av for ak, av in a.items() if ak != "sha256"} if isinstance(a, dict) else a for a in v]
            out[k] = comparable(v)
        return out
    if isinstance(doc, list):
        return [comparable(v) for v in doc]
    return doc


def tolerance(key: str, precision: str | None, limits: dict, in_limits: bool = False) -> tuple[float, float]:
    """(relative, absolute) within which two floats at `key` are the same measurement: the
    precision's default, widened by what the key is (part 2 of the rule). Never narrower than the
    default: a key no rule names is compared tolerantly."""
    rel, floor = DEFAULT.get(precision or "", REDUCED)
    if in_limits:  # a limit: the table's (equal) or one derived from a host measurement
        return max(rel, LIMIT_SHARE), floor
    if key in RATIOS:
        return rel, max(floor, LIMIT_SHARE)
    if "margin" in key or "gap" in key:
        return rel, max(floor, MARGIN_ABS)
    limit = limits.get(ERROR_LIMITS.get(key, ""))
    if isinstance(limit, (int, float)) and not isinstance(limit, bool) and limit > 0:
        return rel, max(floor, LIMIT_SHARE * limit)
    return rel, floor


def same_float(a: float, b: float, rel: float, floor: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)  # a NaN is only ever the same as a NaN
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= max(floor, rel * max(abs(a), abs(b)))


def differences(saved, got, path: str = "", limits: dict | None = None, precision: str | None = None,
                exact: bool = False) -> list[str]:
    """Where two reports differ once host facts are left out (part 2 of the rule for values).
    Empty: the same check result. Each entry names the JSON path and both values."""
    if path == "":
        saved, got = comparable(saved), comparable(got)
        spec = saved.get("spec") if isinstance(saved, dict) else None
        precision = spec.get("precision") if isinstance(spec, dict) else None
    limits = limits or {}
    if isinstance(saved, dict) and isinstance(got, dict):
        if isinstance(saved.get("limits"), dict):
            limits = saved["limits"]
        out = []
        for k in sorted(set(saved) | set(got)):
            where = f"{path}.{k}" if path else k
            if k in DERIVED:
                continue
            if saved.get(k) is None and got.get(k) is None:
                continue  # a field added to the schema later, null where it does not apply
            if k not in saved or k not in got:
                out.append(f"{where}: {'missing' if k not in got else 'new'}"
                           f" ({saved.get(k, got.get(k))!r:.80})")
                continue
            out += differences(saved[k], got[k], where, limits, precision, exact or k in EXACT_KEYS)
        return out
    if isinstance(saved, list) and isinstance(got, list):
        if len(saved) != len(got):
            return [f"{path}: {len(saved)} items, now {len(got)}"]
        out = []
        for i, (a, b) in enumerate(zip(saved, got)):
            out += differences(a, b, f"{path}[{i}]", limits, precision, exact)
        return out
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (saved, got))
    if numbers and not exact and (isinstance(saved, float) or isinstance(got, float)):
        key = path.rsplit(".", 1)[-1].split("[", 1)[0]
        in_limits = ".limits." in f".{path}" or path.startswith("limits.")
        rel, floor = tolerance(key, precision, limits, in_limits)
        return [] if same_float(float(saved), float(got), rel, floor) else [f"{path}: {saved!r}, now {got!r}"]
    if numbers and exact and isinstance(saved, float) and isinstance(got, float):
        return [] if same_float(saved, got, 0.0, 0.0) else [f"{path}: {saved!r}, now {got!r}"]
    return [] if saved == got else [f"{path}: {saved!r:.120}, now {got!r:.120}"]
