"""What a report says about the machine it ran on, and the one rule every comparison of reports
uses to leave it out (tests/baselines via oracle.baseline, `report diff`, the host-independence
test).

The rule, in two halves:
1. Keys. Host facts live under a key named `host` (the report's provenance.host: node name,
   CPU count, torch's threads, IREE's target-CPU hash, a GPU's name); run state under `timings`
   and `cache`; the environment under `python`, `versions` and `thresholds_sha256`; where files
   happen to be under `dir` and `path`. Each is dropped wherever it occurs, at any depth.
2. Numbers. Kernels pick their instructions by the CPU they run on (IREE compiles llvm-cpu for
   the host's features, XNNPACK and oneDNN dispatch on AVX2 / AVX-512), so the same correct
   program rounds differently on another machine. A measured error is therefore compared with
   a tolerance of a tenth of the limit it is judged by (`LIMIT_SHARE`): enough for rounding
   at the level of the precision, far too little to hide a change of verdict or of what is
   computed. The same holds for what is measured on the host beside the candidate: HF's own
   error at a reduced precision (`noise_*`) and HF fp32 on an in-situ candidate's upstream
   (`upstream_*`), each against the limit of its row; a limit derived from them (a row's
   `limits` at bf16 or in-situ) moves with them, so limits are compared to a relative tenth; a
   ratio of two such errors (`vs_noise`, `vs_upstream`, present only where the divisor is not 0)
   is a reading of them, not compared. A margin (a difference of two reference logits, e.g.
   `reference_margin`) rounds as the logits do: within `MARGIN_ABS`. Every other number
   (reference-side values such as norms) is compared to a relative 1e-4. Statuses, tokens,
   counts, names and shapes are compared exactly; a field absent on one side and null on the
   other (added to the schema later) is the same.
"""

from __future__ import annotations

import math

# keys whose values depend on the machine, the environment or the run, not on the check
HOST_KEYS = frozenset({"host", "python", "versions", "thresholds_sha256", "timings", "cache", "dir", "path"})
# a compiled program carries the source locations (file:line) of the code it was traced from, so its
# bytes change with any edit of that code: artifacts are compared by name (what they compute is in
# every row); a checkpoint's sha256 is kept (the tiny checkpoints are the same bytes everywhere)
ARTIFACT_LISTS = frozenset({"artifacts"})

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
REL_TOL = 1e-4  # any other number: reference-side values (norms, margins, cosine, KL of a reference)
ABS_TOL = 1e-9


def comparable(doc):
    """`doc` without its host facts, run state and file locations (half 1 of the rule)."""
    if isinstance(doc, dict):
        out = {}
        for k, v in doc.items():
            if k in HOST_KEYS:
                continue
            if k in ARTIFACT_LISTS and isinstance(v, list):
                v = [{ak: av for ak, av in a.items() if ak != "sha256"} if isinstance(a, dict) else a for a in v]
            out[k] = comparable(v)
        return out
    if isinstance(doc, list):
        return [comparable(v) for v in doc]
    return doc


def _close(key: str, a: float, b: float, limits: dict, in_limits: bool = False) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    if in_limits:  # a limit: the table's (equal) or one derived from a host measurement (half 2)
        return math.isclose(a, b, rel_tol=LIMIT_SHARE, abs_tol=ABS_TOL)
    if "margin" in key:
        return abs(a - b) <= MARGIN_ABS
    if key in RATIOS:
        return abs(a - b) <= LIMIT_SHARE
    limit = limits.get(ERROR_LIMITS.get(key, ""))
    if isinstance(limit, (int, float)) and limit > 0:
        return abs(a - b) <= LIMIT_SHARE * limit
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def differences(saved, got, path: str = "", limits: dict | None = None) -> list[str]:
    """Where two reports differ once host facts are left out (half 2 of the rule for numbers).
    Empty: the same check result. Each entry names the JSON path and both values."""
    saved, got = (comparable(saved), comparable(got)) if path == "" else (saved, got)
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
            out += differences(saved[k], got[k], where, limits)
        return out
    if isinstance(saved, list) and isinstance(got, list):
        if len(saved) != len(got):
            return [f"{path}: {len(saved)} items, now {len(got)}"]
        out = []
        for i, (a, b) in enumerate(zip(saved, got)):
            out += differences(a, b, f"{path}[{i}]", limits)
        return out
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (saved, got))
    if numbers and (isinstance(saved, float) or isinstance(got, float)):
        key = path.rsplit(".", 1)[-1].split("[", 1)[0]
        in_limits = ".limits." in f".{path}" or path.startswith("limits.")
        return [] if _close(key, float(saved), float(got), limits, in_limits) else [f"{path}: {saved!r}, now {got!r}"]
    return [] if saved == got else [f"{path}: {saved!r:.120}, now {got!r:.120}"]
