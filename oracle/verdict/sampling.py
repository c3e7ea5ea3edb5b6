"""`oracle check --sampling`: gate rows for an on-device sampler.

A candidate with a fused sampler offers (all optional; without them the rows are skipped):

    sample_prefill(tokens, temperature, top_p, seed) -> int     a new sequence, last token
    sample_decode(token, pos, temperature, top_p, seed) -> int  one step, carrying state
    sample_logits(logits [V], temperature, top_p, seed) -> int  the sampling head alone
    host_sampler(logits [V], temperature, top_p, seed) -> (token, margin | None)
        the host's implementation of the backend's sampler, for the seed-schedule row
        (default: `reference_sample` below, for models/layers/sampling.py's sampler); margin None:
        unknown, so a difference is never excused as a near tie

and must raise ValueError for top_p outside (0, 1] or a negative temperature. The harness
is the runner: the prefill uses seed s, decode step k uses s + k. The reference sampler
below is an independent numpy implementation of models/layers/sampling.py's specification.
"""

from __future__ import annotations

import numpy as np

from oracle.reports.result import GateRow, Status

ALPHA = 1e-3  # chi-square significance: a correct sampler fails 1 time in 1000 seeds-lists
N_DRAWS = 2000  # draws of the distribution test (expected count >= 5 per pooled bin)
REPRO_STEPS = 8


def _hash32(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64) & 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def reference_noise(seed: int, n: int) -> np.ndarray:
    bits = _hash32(_hash32(np.array(seed & 0xFFFFFFFF)) ^ np.arange(n, dtype=np.uint64)) >> 8
    u = (bits.astype(np.float64) + 0.5) / (1 << 24)
    return -np.log(-np.log(u))


def _softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = logits.astype(np.float64) / max(temperature, 1e-6)
    p = np.exp(z - z.max())
    return p / p.sum()


def nucleus(logits: np.ndarray, temperature: float, top_p: float,
            top_p_after_temperature: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(probabilities of softmax(logits / T), boolean mask of the top-p nucleus: the most
    probable tokens whose mass before them is below top_p, and any tied with the least
    probable of those). The nucleus is taken of
    softmax(logits / T) (temperature first, as models/layers/sampling.py, HF and vLLM do) or, with
    `top_p_after_temperature=False`, of softmax(logits) (top-p first, as mlx-lm does)."""
    p = _softmax(logits, temperature)
    q = p if top_p_after_temperature else _softmax(logits, 1.0)
    sq = np.sort(q)[::-1]
    kept = sq[np.cumsum(sq) - sq < top_p]
    return p, q >= kept[-1]  # ties with the least probable kept token are kept too


def reference_sample(logits, temperature: float, top_p: float, seed: int) -> tuple[int, float]:
    """(token, margin between the best and second-best perturbed score: how close to a tie)."""
    logits = np.asarray(logits, dtype=np.float64).ravel()
    if temperature == 0:
        s = np.sort(logits)
        return int(logits.argmax()), float(s[-1] - s[-2])
    _, keep = nucleus(logits, temperature, top_p)
    score = np.where(keep, logits / max(temperature, 1e-6) + reference_noise(seed, logits.size), -np.inf)
    s = np.sort(score[np.isfinite(score)])
    return int(score.argmax()), float(s[-1] - s[-2]) if s.size > 1 else float("inf")


def _skip(name, why):
    return GateRow(name, Status.SKIPPED, None, None, why)


def sampling_gates(ref, cand, temperature: float, top_p: float, seed: int, tie_margin: float) -> list[GateRow]:
    names = ("sampling_greedy", "sampling_reproducible", "sampling_seed_schedule", "sampling_arguments",
             "sampling_distribution")
    if cand.sample_prefill is None or cand.sample_decode is None:
        return [_skip(n, "the backend has no on-device sampler") for n in names]
    P = ref.prompt_len
    steps = len(ref.logits)

    def run(t, p, s, schedule=True):
        toks = [int(cand.sample_prefill(ref.tokens[:P], t, p, s))]
        for k in range(1, steps):
            toks.append(int(cand.sample_decode(ref.tokens[P + k - 1], P + k - 1, t, p, s + k if schedule else s)))
        return toks

    rows = []
    # 1. temperature 0 is exactly greedy: every step, and the head alone on a near tie
    greedy = run(0.0, 1.0, seed)
    want = [int(lg[-1].argmax()) for lg in ref.logits]
    bad = [k for k, (a, b) in enumerate(zip(greedy, want))
           if a != b and reference_sample(ref.logits[k][-1], 0.0, 1.0, 0)[1] >= tie_margin]
    msg = "argmax of the reference logits at every step"
    if not bad and cand.sample_logits is not None:
        tie = np.asarray(ref.logits[0][-1], dtype=np.float32).copy()
        top = int(tie.argmax())
        tie[(top + 1) % tie.size] = np.nextafter(tie[top], np.float32(-np.inf))  # a near tie, one ulp apart
        picks = {int(cand.sample_logits(tie, 0.0, 1.0, s)) for s in range(64)}
        if picks != {top}:
            bad.append("near-tie")
            msg = f"on a one-ulp near tie, 64 seeds picked {sorted(picks)} instead of always {top}"
    rows.append(GateRow("sampling_greedy", Status.FAIL if bad else Status.PASS, f"{len(bad)} steps differ" if bad else "exact",
                        "exact", msg if not bad else f"temperature 0 differs from argmax at {bad}: {msg}"))

    # 2. the same seed reproduces; a different seed differs somewhere
    t_r = temperature if temperature > 0 else 1.0
    a, b = run(t_r, top_p, seed), run(t_r, top_p, seed)
    c = run(t_r, top_p, seed + 1000)
    ok = a == b and a != c
    rows.append(GateRow("sampling_reproducible", Status.PASS if ok else Status.FAIL, f"same seed {'equal' if a == b else 'DIFFER'}"
                        f", seed+1000 {'differs' if a != c else 'EQUAL'}", "equal / differs",
                        f"seed {seed}: {a}; again: {b}; seed {seed + 1000}: {c}"))

    # 3. the seed schedule (prefill s, decode step k: s + k) matches the host reference sampler
    host = [cand.host_sampler(ref.logits[k][-1], t_r, top_p, seed + k) for k in range(steps)]
    diff = [k for k in range(steps) if a[k] != host[k][0] and (host[k][1] is None or host[k][1] >= tie_margin)]
    rows.append(GateRow("sampling_seed_schedule", Status.FAIL if diff else Status.PASS,
                        f"{len(diff)} steps differ" if diff else "match", "match",
                        f"candidate {a} vs host reference sampler {[h[0] for h in host]}"
                        + (f"; first difference at step {diff[0]} (seed {seed + diff[0]})" if diff else "")))

    # 4. invalid arguments are refused
    accepted = []
    for t, p in ((1.0, 0.0), (1.0, 1.5), (1.0, -0.1), (-0.5, 0.9)):
        try:
            cand.sample_prefill(ref.tokens[:P], t, p, seed)
            accepted.append((t, p))
        except ValueError:
            pass
    rows.append(GateRow("sampling_arguments", Status.FAIL if accepted else Status.PASS,
                        f"accepted {accepted}" if accepted else "all refused", "refused",
                        "top_p outside (0, 1] and negative temperature must be refused"))

    # 5. the distribution at the prefill step over many seeds matches softmax(logits / T) on the
    # nucleus. With the head exported on its own, it is fed the candidate's prefill logits (fast);
    # otherwise every draw is a fused prefill.
    if cand.sample_logits is not None:
        logits = np.asarray(cand.prefill(ref.tokens[:P]), dtype=np.float32).reshape(-1, ref.logits[0].shape[-1])[-1]
        draws = np.array([int(cand.sample_logits(logits, t_r, top_p, 10_000 + i)) for i in range(N_DRAWS)])
    else:
        draws = np.array([int(cand.sample_prefill(ref.tokens[:P], t_r, top_p, 10_000 + i)) for i in range(N_DRAWS)])
    rows.append(distribution_gate(np.asarray(ref.logits[0][-1]), draws, t_r, top_p,
                                  cand.top_p_after_temperature))
    return rows


def distribution_gate(logits: np.ndarray, draws: np.ndarray, temperature: float, top_p: float,
                      top_p_after_temperature: bool = True) -> GateRow:
    """Chi-square goodness of fit of the drawn tokens against softmax(logits / T) restricted
    to the top-p nucleus (renormalised; the nucleus as the sampler declares it, see
    `nucleus`); bins with expected count < 5 are pooled; any draw outside the nucleus fails
    outright."""
    p, keep = nucleus(logits, temperature, top_p, top_p_after_temperature)
    order = "temperature, then top-p" if top_p_after_temperature else "top-p, then temperature"
    outside = int((~keep[draws]).sum())
    if outside:
        return GateRow("sampling_distribution", Status.FAIL, f"{outside} draws outside the top-p nucleus", 0,
                       f"temperature {temperature}, top_p {top_p} ({order})")
    q = np.where(keep, p, 0.0)
    q /= q.sum()
    idx = np.flatnonzero(keep)
    expected = q[idx] * draws.size
    observed = np.bincount(draws, minlength=p.size)[idx].astype(float)
    big = expected >= 5
    e = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
    o = list(observed[big]) + ([observed[~big].sum()] if (~big).any() else [])
    if len(e) < 2:  # the nucleus is one token (or one pooled bin): every draw must be it
        pval = 1.0
    else:
        from scipy import stats  # imported only when a sampling check runs (0.8 s)

        pval = float(stats.chisquare(o, e).pvalue)
    return GateRow("sampling_distribution", Status.PASS if pval >= ALPHA else Status.FAIL, round(pval, 6), ALPHA,
                   f"chi-square p-value over {draws.size} seeds, {len(e)} bins, temperature {temperature}, "
                   f"top_p {top_p} ({order}; a correct sampler fails with probability {ALPHA})")
