"""The comparators (property-based): a NaN never passes, identical arrays always pass,
limits are monotone, router agreement counts sets and ties."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from oracle import thresholds
from oracle.metrics import router_metrics, tensor_metrics, top2_margin

FP32 = {"atol": 1e-5, "rtol": 1e-4, "rel_l2": 1e-5}
finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)
shapes = st.tuples(st.integers(1, 6), st.integers(1, 9))


@given(arrays(np.float32, shapes, elements=finite))
def test_identical_passes(a):
    m = tensor_metrics(a, a.copy(), **{k: FP32[k] for k in ("atol", "rtol")})
    assert m["max_abs"] == 0.0 and m["first_divergence"] is None
    assert thresholds.judge_tensor(m, FP32) == ("pass", 0.0)


@given(arrays(np.float32, shapes, elements=finite), st.data())
def test_nonfinite_never_passes(a, data):
    c = a.copy()
    i = data.draw(st.integers(0, c.size - 1))
    c.flat[i] = data.draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    m = tensor_metrics(a, c, 1e9, 1e9)  # even with absurdly loose limits
    assert m["nonfinite"] == 1
    status, ratio = thresholds.judge_tensor(m, {"atol": 1e9, "rtol": 1e9, "rel_l2": 1e9})
    assert status == "fail" and math.isinf(ratio)


@given(arrays(np.float64, shapes, elements=finite), st.data())
def test_first_divergence_is_first_out_of_tolerance(a, data):
    c = a.copy()
    i = data.draw(st.integers(0, c.size - 1))
    c.flat[i] += 1.0 + abs(c.flat[i])
    m = tensor_metrics(a, c, 1e-5, 1e-4)
    fd = m["first_divergence"]
    assert np.ravel_multi_index(fd["index"], a.shape) == i
    assert fd["reference"] == a.flat[i] and fd["candidate"] == c.flat[i]
    assert thresholds.judge_tensor(m, FP32)[0] == "fail"


@given(arrays(np.float64, (4, 8), elements=st.floats(-10, 10)), st.floats(1e-7, 1e-1))
def test_larger_error_never_better(a, eps):
    small = tensor_metrics(a, a + eps, 1e-5, 1e-4)
    big = tensor_metrics(a, a + 10 * eps, 1e-5, 1e-4)
    assert big["max_abs"] >= small["max_abs"] and big["rel_l2"] >= small["rel_l2"]
    assert thresholds.judge_tensor(big, FP32)[1] >= thresholds.judge_tensor(small, FP32)[1]


def test_shape_mismatch_fails():
    m = tensor_metrics(np.zeros((2, 3)), np.zeros((3, 2)), 1, 1)
    assert thresholds.judge_tensor(m, FP32)[0] == "fail"


def test_cosine_and_rel_l2():
    r = np.array([1.0, 0.0])
    m = tensor_metrics(r, np.array([0.0, 1.0]), 1e-5, 1e-4)
    assert m["cosine"] == pytest.approx(0.0) and m["rel_l2"] == pytest.approx(math.sqrt(2))


ROUTER = {"weight_atol": 1e-5, "min_agreement": 1.0, "tie_gap": 1e-3}


@settings(max_examples=50)
@given(st.data())
def test_router_order_within_topk_does_not_matter(data):
    n, e, k = 6, 8, 2
    probs = np.random.default_rng(data.draw(st.integers(0, 99))).dirichlet(np.ones(e), size=n)
    idx = np.argsort(-probs, axis=1)[:, :k]
    w = np.take_along_axis(probs, idx, 1)
    m = router_metrics(w, idx, w[:, ::-1], idx[:, ::-1], probs, 1e-3)
    assert m["topk_agreement"] == 1.0 and m["weight_max_abs"] == 0.0
    assert thresholds.judge_router(m, ROUTER)[0] == "pass"


def test_router_disagreement_fails_but_tie_is_counted_apart():
    probs = np.array([[0.5, 0.3, 0.2, 0.0], [0.4, 0.3, 0.2995, 0.0005]])
    idx = np.array([[0, 1], [0, 1]])
    w = np.take_along_axis(probs, idx, 1)
    # token 1: experts 1 and 2 are a near tie (gap 5e-4 < tie_gap) and the candidate flips them
    cand_idx = np.array([[0, 1], [0, 2]])
    m = router_metrics(w, idx, w, cand_idx, probs, 1e-3)
    assert m["tie_disagreements"] == 1 and m["disagree_tokens"] == []
    assert thresholds.judge_router(m, ROUTER)[0] == "pass"
    # token 0 is not a tie: flipping it fails
    cand_idx = np.array([[0, 2], [0, 1]])
    m = router_metrics(w, idx, w, cand_idx, probs, 1e-3)
    assert m["disagree_tokens"] == [0] and thresholds.judge_router(m, ROUTER)[0] == "fail"


def test_router_nan_weights_fail():
    probs = np.array([[0.6, 0.4]])
    m = router_metrics(np.array([[0.6]]), np.array([[0]]), np.array([[np.nan]]), np.array([[0]]), probs, 1e-3)
    assert thresholds.judge_router(m, ROUTER)[0] == "fail"


def test_top2_margin():
    assert top2_margin(np.array([0.1, 3.0, 2.5])) == pytest.approx(0.5)


def test_every_backend_precision_has_thresholds():
    from oracle.backend import BUILTIN, resolve

    for name in BUILTIN:
        for p in getattr(resolve(name), "precisions", ()):
            for kind in ("attention", "router", "moe", "layer", "final_norm", "logits", "e2e"):
                assert thresholds.limits(p, kind), (name, p, kind)


def test_limits_at_real_width():
    """The dimension rules of thresholds.toml: an fp32 atol grows as sqrt(K / 64) with the
    longest dot product K (tiny models: K = 64, unchanged); bf16 tables have no such rule; the
    router near-tie gap scales as 8 / E."""
    from oracle import thresholds

    fp32 = thresholds.limits("fp32", "moe")
    assert thresholds.at_width(fp32, 64) == fp32 and thresholds.at_width(fp32, 32) == fp32
    assert thresholds.at_width(fp32, 64 * 16)["atol"] == pytest.approx(4 * fp32["atol"])
    assert thresholds.at_width(fp32, 64 * 16)["rtol"] == fp32["rtol"]
    bf16 = thresholds.limits("bf16", "moe")
    assert thresholds.at_width(bf16, 14336) == bf16
    router = thresholds.limits("bf16", "router")
    assert thresholds.tie_gap(router, 8) == router["tie_gap"]
    assert thresholds.tie_gap(router, 64) == pytest.approx(router["tie_gap"] / 8)
