"""Reduced-precision verdicts from measured noise (oracle/noise.py, issue 37): HF transformers'
own bf16 run passes by construction, a candidate with three times its error on one block fails
that row, a decode-path defect fails e2e (no step is excused: a routing difference is judged on its
own, tests/test_replay.py). The sweep over fifteen families, seeds 0-4 and both weight profiles is in
docs/noise.md; here a few families keep the suite's time."""

import numpy as np
import pytest
import torch

from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.noise import rounding, score_error

PLUGINS = "tests.plugins"


def test_rounding_is_torch_bf16_round_to_nearest_even():
    rng = np.random.default_rng(0)
    x = (rng.normal(size=10_000) * 10 ** rng.uniform(-3, 3, 10_000)).astype(np.float32)
    want = torch.from_numpy(x).bfloat16().float().numpy()
    assert np.array_equal(rounding(x, "bf16"), want.astype(np.float64))
    assert np.array_equal(rounding(x, "fp32"), x.astype(np.float64))
    assert np.isnan(rounding(np.array([np.nan], np.float32), "bf16")).all()


def test_score_error_per_token_ignores_groups_left_out_by_both():
    r = [np.array([[0.5, 0.3, -np.inf], [0.9, 0.1, 0.0]], np.float32)]
    h = [np.array([[0.52, 0.29, -np.inf], [0.9, 0.1, 0.0]], np.float32)]
    assert np.allclose(score_error(r, h), [0.02, 0.0], atol=1e-6)
    flipped = [np.array([[0.5, -np.inf, 0.3], [0.9, 0.1, 0.0]], np.float32)]
    assert np.isinf(score_error(r, flipped)[0])  # another group chosen: no gap is safe


@pytest.mark.parametrize("family,weights", [("olmoe", "normal"), ("mixtral", "trained"), ("gpt_oss", "trained")])
def test_hf_and_eager_bf16_pass_and_rows_show_their_error_against_hf(family, weights):
    """The trained profile's outliers and massive activations failed the fixed bf16 tables
    (HF's own run: 6 of 15 families at seed 0); against bf16's own error they pass."""
    for backend in ("hf", "eager"):
        r = run_check(CheckSpec(family=family, backend=backend, precision="bf16", weights=weights))
        assert r.status == "pass", (backend, r.worst, r.e2e.status)
        rows = [b for b in r.blocks if b.status == "pass" and b.kind != "router"]
        assert rows and all("noise_max_abs" in b.metrics and "vs_noise" in b.metrics for b in rows)
        assert all(b.limits["noise_factor"] == 2.5 for b in rows)
        if backend == "hf":  # the same computation as the measurement: ratio 1/(2.5 + floor share)
            assert all(b.metrics["vs_noise"] == 1.0 and b.ratio <= 0.4 for b in rows)
        assert r.reference["noise"].startswith("HF transformers at bf16")


@pytest.mark.parametrize("family", ["olmoe", "deepseek_v3"])
def test_three_times_hf_bf16_error_on_one_block_fails_that_row(family, monkeypatch):
    monkeypatch.setenv("ORACLE_TEST_KIND", "moe")
    r = run_check(CheckSpec(family=family, backend=f"{PLUGINS}:THRICE_HF_ERROR", precision="bf16"))
    moe = [b for b in r.blocks if b.kind == "moe"]
    assert moe and all(b.status == "fail" and 2.5 < b.metrics["vs_noise"] < 3.5 for b in moe), \
        [(b.status, b.ratio, b.metrics.get("vs_noise")) for b in moe]
    assert all(b.status == "pass" for b in r.blocks if b.kind in ("attention", "router"))
    assert r.worst["kind"] == "moe" and r.status == "fail"


@pytest.mark.parametrize("family", ["olmoe", "mixtral", "gpt_oss", "qwen3_5_moe"])
def test_a_decode_path_defect_fails_e2e_at_bf16(family):
    """Positions shifted by 3 in decode only: the prefill and every block are correct; before,
    a routing near tie anywhere in the prompt excused every later step at bf16, and qwen3_5_moe's
    noise, inflated by HF bf16's own routing flips, let it pass at 0.99-1.53x (issue 51): its noise is
    now measured with HF's routing forced to the reference's (all 15 families: docs/noise.md)."""
    r = run_check(CheckSpec(family=family, backend=f"{PLUGINS}:SHIFTED_DECODE", precision="bf16"))
    assert r.e2e.status == "fail" and r.status == "fail"
    assert r.e2e.steps[0]["logits_status"] == "pass"
    failed = [s for s in r.e2e.steps if s["logits_status"] == "fail"]
    # several steps, each past e2e's noise_factor (3) x HF bf16's error there by max_abs or rel_l2
    assert len(failed) >= 3 and all(s["ratio"] > 1 for s in failed) and max(s["vs_noise"] for s in failed) > 3
    assert all(b.status == "pass" for b in r.blocks if b.status != "n/a")
