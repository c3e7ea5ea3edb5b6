"""Comparison metrics: pure functions of a reference and a candidate array.

Every comparison is done in float64. A non-finite candidate value is counted and fails
whatever limit it is checked against (NaN compares False, so it must be caught first).
"""

from __future__ import annotations

import math

import numpy as np


class OutputError(ValueError):
    """A candidate output that is not an array (None, a tuple, an object numpy cannot read)."""


def as_array(x, dtype=np.float64) -> np.ndarray:
    """Any array a candidate returns -> a host numpy array of `dtype`: torch tensors on any
    device (CUDA, MPS), of any dtype (bf16/fp16/fp8, which numpy cannot hold, go through
    fp32/fp64), requiring grad or not; mlx arrays (bf16 included); numpy arrays; sequences
    of numbers. Every conversion of a candidate's output goes through here."""
    if x is None:
        raise OutputError("None where an array is expected")
    if isinstance(x, (tuple, list)) and x and not isinstance(x[0], (int, float, np.number)):
        raise OutputError(f"a {type(x).__name__} of {len(x)} where one array is expected")
    if hasattr(x, "detach") and hasattr(x, "is_floating_point"):  # torch, any device
        x = x.detach().cpu()
        if x.is_floating_point():
            x = x.double()
        return np.asarray(x.numpy(), dtype=dtype)
    mod = type(x).__module__ or ""
    if mod.startswith("mlx"):  # mlx.core.array: numpy cannot read bfloat16
        import mlx.core as mx

        if mx.issubdtype(x.dtype, mx.floating):
            x = x.astype(mx.float32)
        return np.asarray(np.array(x), dtype=dtype)
    try:
        return np.asarray(x, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise OutputError(f"cannot read a {type(x).__name__} as an array ({e})") from None


def as_f64(x) -> np.ndarray:
    return as_array(x, np.float64)


def tensor_metrics(ref, cand, atol: float, rtol: float) -> dict:
    """max_abs, rel_l2 (RMS of diff / RMS of ref), cosine, nonfinite, and the first element
    outside |c - r| <= atol + rtol |r| (flat order; index as a tuple into the shape)."""
    r, c = as_f64(ref), as_f64(cand)
    if r.shape != c.shape:
        return {"shape_mismatch": f"reference {list(r.shape)} vs candidate {list(c.shape)}", "nonfinite": 0}
    nonfinite = int(np.size(c) - np.isfinite(c).sum())
    d = np.abs(c - r)
    finite = np.isfinite(d)
    rms_ref = math.sqrt(float(np.mean(r * r))) if r.size else 0.0
    out = {
        "max_abs": float(d[finite].max()) if finite.any() else 0.0,
        "rel_l2": float(math.sqrt(float(np.mean(np.where(finite, d, 0.0) ** 2))) / max(rms_ref, 1e-30)),
        "cosine": cosine(r, np.where(np.isfinite(c), c, 0.0)),
        "nonfinite": nonfinite,
        "ref_rms": rms_ref,
        "allclose_ratio": 0.0,
        "first_divergence": None,
    }
    tol = atol + rtol * np.abs(r)
    with np.errstate(divide="ignore", invalid="ignore"):  # a zero tolerance: exact match or no pass
        excess = np.where(finite, np.where(d == 0, 0.0, d / tol), np.inf)
    out["allclose_ratio"] = float(excess.max()) if excess.size else 0.0
    bad = np.flatnonzero(~(excess <= 1.0))
    if bad.size:
        i = int(bad[0])
        idx = np.unravel_index(i, r.shape)
        out["first_divergence"] = {
            "index": [int(v) for v in idx],
            "reference": float(r.flat[i]),
            "candidate": float(c.flat[i]) if np.isfinite(c.flat[i]) else str(c.flat[i]),
        }
    return out


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity, NaN where either side is not finite (a NaN never passes). Each side is scaled by
    its largest magnitude first, so values near the float64 range do not overflow the norms."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    sa, sb = (float(np.abs(x).max()) if x.size else 0.0 for x in (a, b))
    if sa == 0.0 and sb == 0.0:
        return 1.0
    if sa == 0.0 or sb == 0.0:
        return 0.0
    a, b = a / sa, b / sb
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def weight_diffs(ref_w, ref_idx, cand_w, cand_idx) -> np.ndarray:
    """Per token: the largest top-k weight difference, expert by expert, where both chose the
    same set of experts; inf where the sets differ (or a weight is not finite)."""
    rw, cw = as_f64(ref_w), as_f64(cand_w)
    ri, ci = np.asarray(ref_idx).astype(np.int64), np.asarray(cand_idx).astype(np.int64)
    out = np.full(ri.shape[0], np.inf)
    for t in range(ri.shape[0]):
        if set(ri[t]) == set(ci[t]):
            dw = np.abs(rw[t][np.argsort(ri[t])] - cw[t][np.argsort(ci[t])])
            out[t] = float(dw.max()) if np.isfinite(dw).all() else np.inf
    return out


def router_metrics(ref_w, ref_idx, cand_w, cand_idx, ref_gap, tie_gap, own=None, selection_tie=None) -> dict:
    """Top-k routing agreement per token (as sets of experts) and the weight difference
    on tokens that agree. `ref_gap` [N]: the margin of the reference's choice per token (its
    k-th minus (k+1)-th selection score, or of another decision of its routing, such as a group
    choice or sparsemixer's mask: oracle.verdict.compare.router_gaps); a token whose margin is below
    `tie_gap` (a number, or one per token) is a tie: a disagreement there, of the experts or of
    their weights, is counted apart, not hidden. `own` (weights, indices): the correct routing of
    the candidate's own input (an in-situ row fed its own input, oracle/verdict/insitu.py): a token the
    candidate routes as that does agrees (its input already differed), its weights judged there.
    `selection_tie` [N] (oracle/verdict/replay.py): which tokens' other experts are a tie by the gap between the
    experts exchanged; where given, it decides which disagreements are held against the candidate (the
    margin `ref_gap` still decides which tokens' weights are near ties)."""
    rw, cw, gap = as_f64(ref_w), as_f64(cand_w), as_f64(ref_gap).reshape(-1)
    ri, ci = np.asarray(ref_idx).astype(np.int64), np.asarray(cand_idx).astype(np.int64)
    if ri.shape != ci.shape or rw.shape != cw.shape:
        return {"shape_mismatch": f"reference {list(ri.shape)} vs candidate {list(ci.shape)}", "nonfinite": 0}
    n, k = ri.shape
    nonfinite = int(cw.size - np.isfinite(cw).sum())
    if gap.shape[0] != n:
        return {"shape_mismatch": f"{gap.shape[0]} reference margins for {n} tokens", "nonfinite": 0}
    dw = weight_diffs(rw, ri, cw, ci)
    agree = np.array([set(ri[t]) == set(ci[t]) for t in range(n)], dtype=bool)
    rerouted = np.zeros(n, dtype=bool)
    if own is not None:
        ow, oi = as_f64(own[0]).reshape(n, k), np.asarray(own[1]).astype(np.int64).reshape(n, k)
        rerouted = ~agree & np.array([set(oi[t]) == set(ci[t]) for t in range(n)], dtype=bool)
        dw = np.where(rerouted, weight_diffs(ow, oi, cw, ci), dw)
        agree = agree | rerouted
    tie = gap < tie_gap
    chosen_tie = tie if selection_tie is None else np.asarray(selection_tie, dtype=bool).reshape(-1)
    counted = ~chosen_tie | agree  # ties that disagree are not held against the candidate
    out = {
        "tokens": int(n),
        "topk_agreement": float(agree[counted].mean()) if counted.any() else 1.0,
        "disagree_tokens": [int(t) for t in np.flatnonzero(~agree & ~chosen_tie)],
        "tie_disagreements": int((~agree & chosen_tie).sum()),
        "weight_max_abs": float(dw[agree & ~tie].max()) if (agree & ~tie).any() else 0.0,
        "min_ref_gap": float(gap.min()) if n else math.inf,
        "nonfinite": nonfinite,
    }
    if (agree & tie).any():  # the weights of near-tie tokens (sparsemixer's mask decides them): apart
        out["tie_weight_max_abs"] = float(dw[agree & tie].max())
    if rerouted.any():  # routed as its own input routes, not as the reference's
        out["rerouted_by_input"] = [int(t) for t in np.flatnonzero(rerouted)]
    return out


def top2_margin(logits) -> float:
    v = np.sort(as_f64(logits).ravel())
    return float(v[-1] - v[-2])


def rounding(r: np.ndarray, precision: str) -> np.ndarray:
    """`r` rounded to the precision's storage (round to nearest even): what merely storing the
    exact result costs, the floor of any implementation's error."""
    r32 = np.ascontiguousarray(r, dtype=np.float32)
    if precision == "fp16":
        return r32.astype(np.float16).astype(np.float64)
    if precision != "bf16":
        return r32.astype(np.float64)
    u = r32.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    out = u.astype(np.uint32).view(np.float32).astype(np.float64)
    return np.where(np.isfinite(r32), out, r32)


SIGNIFICAND_BITS = {"fp32": 24, "bf16": 8, "fp16": 11}


def score_resolution(ref_scores, precision: str) -> np.ndarray:
    """Per token: one unit in the last place, at the precision's storage, of its largest finite selection
    score: two selection scores each stored at the precision (a router computing its softmax at bf16, as
    the MLX delegate's does) can swap places within it, whatever HF's own (fp32-softmax) error is. The
    floor of a tie bound, as the stored weights' rounding is the router weights' floor."""
    r = np.atleast_2d(np.asarray(ref_scores, np.float64))
    bits = SIGNIFICAND_BITS.get(precision)
    if bits is None:
        return np.zeros(r.shape[0])
    top = np.where(np.isfinite(r), np.abs(r), 0.0).max(axis=-1)
    with np.errstate(divide="ignore"):
        return np.where(top > 0, 2.0 ** (np.floor(np.log2(np.where(top > 0, top, 1.0))) - (bits - 1)), 0.0)


def row_error(ref, got) -> np.ndarray:
    """Per row (the last axis is the row's values): the largest absolute difference, over the values
    finite in both (a group left out is -inf in both); inf where the finite entries differ (another group
    chosen: no gap is safe)."""
    r = np.asarray(ref, np.float64).reshape(-1, np.shape(ref)[-1])
    h = np.asarray(got, np.float64).reshape(r.shape)
    both = np.isfinite(r) & np.isfinite(h)
    with np.errstate(invalid="ignore"):  # -inf - -inf where a group is left out: masked by `both`
        err = np.where(both, np.abs(h - r), 0.0).max(axis=-1, initial=0.0)
    return np.where((np.isfinite(r) != np.isfinite(h)).any(axis=-1), np.inf, err)
