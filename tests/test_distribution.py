"""The distribution metrics of quantized precisions (oracle/verdict/distribution.py): properties
that must hold for any logits, and the verdict against limits."""

import math

import numpy as np
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from oracle.verdict.distribution import distribution_metrics, judge_distribution, kl_per_position, log_softmax

LIMITS = {"kl_mean": 0.01, "kl_p99": 0.1, "kl_max": 0.1, "delta_p_max_abs": 0.02, "min_same_top1": 0.75}

logits = st.integers(1, 6).flatmap(lambda n: st.integers(2, 12).flatmap(
    lambda v: arrays(np.float64, (n, v), elements=st.floats(-30, 30, allow_nan=False, width=32))))


def _pair(draw_logits, noise):
    rng = np.random.default_rng(0)
    return draw_logits, draw_logits + noise * rng.standard_normal(draw_logits.shape)


@given(logits)
def test_identical_logits_are_perfect(x):
    m = distribution_metrics(x, x)
    assert m["kl_max"] <= 1e-12 and m["same_top1"] == 1.0 and m["delta_p_max_abs"] <= 1e-12
    assert m["positions"] == x.shape[0] and m["nonfinite"] == 0
    assert judge_distribution(m, LIMITS) == ("pass", 0.0)


@given(logits, st.floats(0.0, 5.0))
def test_kl_is_nonnegative_and_ordered(x, noise):
    r, c = _pair(x, noise)
    m = distribution_metrics(r, c)
    assert 0.0 <= m["kl_mean"] <= m["kl_max"] + 1e-12
    assert m["kl_mean"] - 1e-12 <= m["kl_max"] and m["kl_p99"] <= m["kl_max"] + 1e-12
    assert 0.0 <= m["same_top1"] <= 1.0
    assert abs(m["delta_p_mean"]) <= m["delta_p_rms"] + 1e-12 <= m["delta_p_max_abs"] + 2e-12 <= 1.0 + 2e-12


@given(logits, st.floats(-100, 100), st.floats(-100, 100))
def test_invariant_to_a_constant_shift_per_row(x, a, b):
    """softmax ignores a constant added to a row: so must the KL (top-1 may move in a tie)."""
    c = x[:, ::-1] + 0.5
    m1 = distribution_metrics(x, c)
    m2 = distribution_metrics(x + a, c + b)
    for k in ("kl_mean", "kl_p99", "kl_max"):
        assert math.isclose(m1[k], m2[k], rel_tol=1e-6, abs_tol=1e-9)


@given(logits)
@settings(max_examples=30)
def test_positions_order_does_not_matter(x):
    c = x[:, ::-1].copy()
    perm = np.arange(x.shape[0])[::-1]
    m1, m2 = distribution_metrics(x, c), distribution_metrics(x[perm], c[perm])
    for k in ("kl_mean", "kl_p99", "kl_max", "same_top1", "delta_p_max_abs"):
        assert math.isclose(m1[k], m2[k], rel_tol=1e-9, abs_tol=1e-12)


def test_known_values():
    # P = (1/2, 1/2), Q = (1/4, 3/4): KL = 1/2 ln 2 + 1/2 ln(2/3); top-1 of P is index 0 (first max)
    r = np.log(np.array([[0.5, 0.5]]))
    c = np.log(np.array([[0.25, 0.75]]))
    m = distribution_metrics(r, c)
    assert math.isclose(m["kl_mean"], 0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel_tol=1e-12)
    assert m["same_top1"] == 0.0 and math.isclose(m["delta_p_mean"], -0.25, rel_tol=1e-12)
    assert np.allclose(np.exp(log_softmax(c)), [[0.25, 0.75]])
    assert kl_per_position(r, r)[0] == 0.0


def test_verdict():
    x = np.random.default_rng(1).standard_normal((16, 256))
    small = distribution_metrics(x, x + 1e-3 * np.random.default_rng(2).standard_normal(x.shape))
    assert judge_distribution(small, LIMITS)[0] == "pass"
    big = distribution_metrics(x, x[::-1])  # unrelated logits
    status, ratio = judge_distribution(big, LIMITS)
    assert status == "fail" and ratio > 1
    flipped = dict(small, same_top1=0.5)  # top-1 changes alone fail
    assert judge_distribution(flipped, LIMITS)[0] == "fail"


@given(st.sampled_from([np.nan, np.inf, -np.inf]))
def test_nonfinite_candidate_fails(bad):
    x = np.zeros((3, 5))
    c = x.copy()
    c[1, 2] = bad
    m = distribution_metrics(x, c)
    assert m["nonfinite"] == 1
    assert judge_distribution(m, LIMITS) == ("fail", math.inf)


def test_shape_mismatch_fails():
    m = distribution_metrics(np.zeros((2, 5)), np.zeros((2, 6)))
    assert "shape_mismatch" in m and judge_distribution(m, LIMITS)[0] == "fail"


def test_same_top1_leaves_out_near_ties():
    """A top-1 flip where the reference's top-2 margin is below tie_margin is the precision's
    doing (as for greedy tokens): not counted; with every position a near tie the criterion
    does not apply, while KL and delta-p still judge."""
    from oracle.verdict.distribution import distribution_metrics, judge_distribution

    ref = np.array([[2.0, 1.99, 0.0], [3.0, 0.0, 0.0], [0.0, 1.0, 1.005]])
    cand = np.array([[1.99, 2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 1.005, 1.0]])  # rows 0 and 2 flip a near tie
    m = distribution_metrics(ref, cand, tie_margin=0.1)
    assert m["same_top1"] == 1.0 and m["top1_ties"] == 2
    assert distribution_metrics(ref, cand)["same_top1"] == 1 / 3  # without a margin, every flip counts
    m = distribution_metrics(ref[[0, 2]], cand[[0, 2]], tie_margin=0.1)
    assert m["same_top1"] is None and m["top1_ties"] == 2
    lim = {"kl_mean": 0.1, "kl_p99": 0.25, "kl_max": 0.25, "delta_p_max_abs": 0.06, "min_same_top1": 0.4}
    assert judge_distribution(m, lim)[0] == "pass"
    assert judge_distribution({**m, "kl_mean": 0.2}, lim)[0] == "fail"
