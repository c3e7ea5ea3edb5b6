"""Distribution metrics of a candidate's logits against the reference's: how quantized
precisions are judged (token exactness is reported for them, not required).

Over all positions (the prompt's rows, then one per decode step), with P = softmax of the
reference's logits and Q = softmax of the candidate's:
- KL(P || Q) per position, nats: mean, 99th percentile (linear interpolation), max;
- same-top-1 rate: share of positions where argmax Q == argmax P, over the positions whose
  reference top-2 margin is at least `tie_margin` (a flip inside a near tie is the
  precision's doing, counted as `top1_ties`, as the token check does); None when every
  position is a near tie (then the criterion does not apply: KL and delta-p still do);
- delta-p: Q(t) - P(t) for the reference's top-1 token t (llama.cpp's "Δp" with the
  reference's greedy token as the correct one): mean, RMS, max |delta-p|.
Everything in float64; a non-finite candidate logit fails whatever the limits.
"""

from __future__ import annotations

import math

import numpy as np

from oracle.verdict.metrics import as_f64
from oracle.reports.result import Status


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log softmax of [N, V] logits, stable (max subtracted first)."""
    x = as_f64(x)
    z = x - x.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def kl_per_position(ref_logits, cand_logits) -> np.ndarray:
    """KL(P_ref || P_cand) per row, >= 0 (rounding clipped)."""
    lp, lq = log_softmax(ref_logits), log_softmax(cand_logits)
    return np.maximum((np.exp(lp) * (lp - lq)).sum(axis=-1), 0.0)


def distribution_metrics(ref_logits, cand_logits, tie_margin: float = 0.0) -> dict:
    """ref and cand logits [N, V] (or [V]) -> the metrics above plus `positions`, `top1_ties`
    and `nonfinite`."""
    r, c = as_f64(ref_logits), as_f64(cand_logits)
    r, c = r.reshape(-1, r.shape[-1]), c.reshape(-1, c.shape[-1])
    if r.shape != c.shape:
        return {"shape_mismatch": f"reference {list(r.shape)} vs candidate {list(c.shape)}", "nonfinite": 0}
    nonfinite = int(c.size - np.isfinite(c).sum())
    if nonfinite or not r.size:
        return {"positions": int(r.shape[0]), "nonfinite": nonfinite, "kl_mean": math.inf, "kl_p99": math.inf,
                "kl_max": math.inf, "same_top1": 0.0, "delta_p_mean": math.nan, "delta_p_rms": math.nan,
                "delta_p_max_abs": math.inf}
    kl = kl_per_position(r, c)
    top = r.argmax(axis=-1)
    rows = np.arange(r.shape[0])
    dp = np.exp(log_softmax(c)[rows, top]) - np.exp(log_softmax(r)[rows, top])
    srt = np.sort(r, axis=-1)
    counted = (srt[:, -1] - srt[:, -2] >= tie_margin) if r.shape[-1] > 1 else np.ones(r.shape[0], bool)
    same = c.argmax(axis=-1) == top
    return {
        "positions": int(r.shape[0]),
        "nonfinite": 0,
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.percentile(kl, 99)),
        "kl_max": float(kl.max()),
        "same_top1": float(same[counted].mean()) if counted.any() else None,
        "top1_ties": int((~counted).sum()),
        "delta_p_mean": float(dp.mean()),
        "delta_p_rms": float(np.sqrt((dp * dp).mean())),
        "delta_p_max_abs": float(np.abs(dp).max()),
    }


def judge_distribution(m: dict, lim: dict) -> tuple[str, float]:
    """(status, ratio) against kl_mean, kl_p99, kl_max, min_same_top1, delta_p_max_abs;
    ratio is the worst metric / its limit (> 1 fails); NaN/Inf or a shape mismatch fails."""
    if "shape_mismatch" in m or m["nonfinite"]:
        return Status.FAIL, math.inf
    allowed = max(1.0 - lim["min_same_top1"], 1e-3)
    same = 1.0 if m["same_top1"] is None else m["same_top1"]  # None: every position a near tie
    ratios = [m["kl_mean"] / lim["kl_mean"], m["kl_p99"] / lim["kl_p99"], m["kl_max"] / lim["kl_max"],
              m["delta_p_max_abs"] / lim["delta_p_max_abs"], (1.0 - same) / allowed]
    ok = (m["kl_mean"] <= lim["kl_mean"] and m["kl_p99"] <= lim["kl_p99"] and m["kl_max"] <= lim["kl_max"]
          and m["delta_p_max_abs"] <= lim["delta_p_max_abs"] and same >= lim["min_same_top1"])
    return (Status.PASS if ok else Status.FAIL), max(ratios)


def perplexity(logits, targets) -> tuple[float, int]:
    """(perplexity, positions) of `targets` [N] under `logits` [N, V]: exp of the mean negative
    log-likelihood of each position's next token."""
    lg = log_softmax(as_f64(logits).reshape(-1, np.shape(logits)[-1]))
    t = np.asarray(targets, dtype=np.int64)
    nll = -lg[np.arange(len(t)), t]
    return float(np.exp(nll.mean())), int(len(t))
