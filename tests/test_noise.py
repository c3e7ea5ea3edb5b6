"""Reduced-precision verdicts from measured noise (oracle/verdict/noise.py, issue 37): HF transformers'
own bf16 run passes by construction, a candidate with three times its error on one block fails
that row, a decode-path defect fails e2e (no step is excused: a routing difference is judged on its
own, tests/test_replay.py). The sweep over fifteen families, seeds 0-4 and both weight profiles is in
docs/noise.md; here a few families keep the suite's time."""

import numpy as np
import pytest
import torch

from models import get_family
from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.verdict.noise import ATTENDING, attentions, row_error, score_error, worse
from oracle.verdict.metrics import rounding

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
        if backend == "hf":  # the same computation as the measurement: ratio 1/(2.5 + floor share); where
            # the attention implementation changes a block, the noise is the worse of HF eager's and sdpa's, row
            # by row, so HF eager is at most that
            assert all(b.metrics["vs_noise"] == 1.0 and b.ratio <= 0.4 for b in rows if b.kind not in ATTENDING)
            assert all(b.metrics["vs_noise"] <= 1.0 and b.ratio <= 0.4 for b in rows if b.kind in ATTENDING)
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


def rows(calls: list) -> np.ndarray:
    """A block's outputs per call -> [rows, width]."""
    return np.concatenate([np.reshape(o, (-1, np.shape(o)[-1])) for o in calls])


def test_worse_takes_each_row_from_the_measurement_farther_from_the_reference():
    ref = np.zeros((3, 4))
    a = np.array([[0.1, 0, 0, 0], [0, 0.01, 0, 0], [0, 0, 0, 0.5]], np.float32)
    b = np.array([[0.0, 0.2, 0, 0], [0, 0, 0.001, 0], [0, 0, 0, 0.4]], np.float32)
    got = worse(ref, a, b)
    assert np.array_equal(got, np.stack([b[0], a[1], a[2]])) and got.dtype == np.float32
    g = np.array([[0.5, -np.inf], [1.0, 2.0]])  # a group left out by one only: infinitely far
    assert np.isinf(row_error(g, [[0.5, 0.1], [1.0, 2.0]])[0]) and row_error(g, g).tolist() == [0.0, 0.0]


def test_the_noise_is_the_worse_of_hf_eager_and_sdpa_row_by_row():
    """HF at bf16 with each attention implementation it offers (gpt_oss's sinks: eager only): the judged
    noise is at least each one's error, step by step and row by row, and is one of them."""
    from oracle.verdict.noise import _cached, _key, noise_for
    from oracle.backend import hf_spec
    from oracle.reference.cached import reference_of
    from oracle.source.sources import model_source, prompt_tokens

    assert attentions(get_family("gpt_oss")) == ("eager",) and attentions(get_family("olmoe")) == ("eager", "sdpa")
    spec = CheckSpec(family="olmoe", backend="eager", precision="bf16", seed=1)
    src = model_source(spec)
    prompt = prompt_tokens(spec, src.args.vocab_size)
    ref = reference_of(spec, src, prompt)
    h = hf_spec(spec)
    each = [_cached(_key(h, src, prompt, attention=a), ref, src, h, attention=a) for a in ("eager", "sdpa")]
    noise = noise_for(ref, src, spec, prompt)
    moved = 0
    for k, r in enumerate(ref.logits):
        errs = [row_error(r, n.logits[k]) for n in each]
        assert np.array_equal(row_error(r, noise.logits[k]), np.maximum(*errs))
        moved += int((errs[1] > errs[0]).sum())
    assert moved > 0  # sdpa rounds otherwise, and is farther at some rows
    for key in ref.block_keys():
        if key[1] in ATTENDING:
            errs = [row_error(rows(ref.outputs[key]), rows(n.outputs[key])) for n in each]
            assert np.array_equal(row_error(rows(ref.outputs[key]), rows(noise.outputs[key])), np.maximum(*errs))
        elif key[1] != "router":
            assert key not in each[1].outputs  # the blocks the attention does not change: measured once


def test_a_kept_hf_model_measures_what_a_fresh_load_does(monkeypatch):
    """oracle.verdict.noise.KEPT: HF's small model in memory, kept across checks, is handed out again (not loaded),
    and a measurement on it after another user forced and recorded routes on it is bit for bit a freshly
    loaded model's (blocks, selection scores, logits); at most KEEP are kept."""
    from oracle.verdict import noise as N
    from oracle.backend import hf_spec
    from oracle.reference.cached import reference_of
    from oracle.source.sources import model_source, prompt_tokens

    spec = CheckSpec(family="qwen3_moe", backend="eager", precision="bf16")
    src = model_source(spec)
    prompt = prompt_tokens(spec, src.args.vocab_size)
    ref = reference_of(spec, src, prompt)
    h = hf_spec(spec)
    monkeypatch.setattr(N, "KEPT", {})
    # another selection forced: each prompt token given its predecessor's experts
    plan = {layer: [np.roll(np.asarray(c.experts), 1, axis=0) for c in calls] for layer, calls in N.reference_plan(ref).items()}
    first = N.measure(ref, src, h)
    (key, hf), = N.KEPT.items()
    forced = N.measure(ref, src, h, plan=plan)  # the same model, forced elsewhere and recorded
    assert not np.array_equal(forced.logits[0], first.logits[0])
    again = N.measure(ref, src, h)
    assert N.KEPT == {key: hf} and N.hf_at(src, h) is hf
    monkeypatch.setattr(N, "KEEP_PARAMETERS", 0)
    monkeypatch.setattr(N, "KEPT", {})
    fresh = N.measure(ref, src, h)  # loaded again, not kept
    assert N.KEPT == {}
    for m in (again, fresh):
        assert all(np.array_equal(a, b) for a, b in zip(first.logits, m.logits))
        assert first.outputs.keys() == m.outputs.keys()
        for k, outs in first.outputs.items():
            for a, b in zip(outs, m.outputs[k]):
                assert all(np.array_equal(x, y) for x, y in zip(a, b)) if k[1] == "router" else np.array_equal(a, b)
        assert all(np.array_equal(a, b) for k in first.e2e_scores for a, b in zip(first.e2e_scores[k], m.e2e_scores[k]))
    monkeypatch.setattr(N, "KEEP_PARAMETERS", 10**9)
    monkeypatch.setattr(N, "KEEP", 1)
    N.hf_at(src, h)
    N.hf_at(src, hf_spec(spec, "fp32"))
    assert len(N.KEPT) == 1 and next(iter(N.KEPT))[2] == "fp32"  # the least recently used went


def test_the_noise_takes_the_references_mask_decisions_not_hfs_own_flip(monkeypatch):
    """phimoe (sparsemixer: a discrete mask decision sets the weights), bf16, normal weights, seed 1: HF with
    sdpa at bf16 flipped a mask of its own at a near tie in layer 0 (forced to the reference's experts only),
    and its layer row's error was 12x eager's (0.18 vs 0.016): a flip, not rounding. Forced to the
    reference's decisions too, it is rounding."""
    from oracle.verdict import replay
    from oracle.backend import hf_spec
    from oracle.verdict.noise import measure
    from oracle.reference.cached import reference_of
    from oracle.source.sources import model_source, prompt_tokens

    spec = hf_spec(CheckSpec(family="phimoe", backend="eager", precision="bf16", weights="normal", seed=1))
    src = model_source(spec)
    ref = reference_of(spec, src, prompt_tokens(spec, src.args.vocab_size))
    r = rows(ref.outputs[0, "layer"])

    def layer_error(attention):
        return float(row_error(r, rows(measure(ref, src, spec, plan={}, attention=attention).outputs[0, "layer"])).max())
    eager, sdpa = layer_error("eager"), layer_error("sdpa")
    decided = replay.reference_routes
    monkeypatch.setattr(replay, "reference_routes",  # the reference's experts only, HF's own weights (as before)
                        lambda ref: {k: [replay.indices(c) for c in v] for k, v in decided(ref).items()})
    flipped = layer_error("sdpa")
    assert flipped > 5 * eager  # HF's own flip
    assert sdpa < 3 * eager  # the two implementations' rounding, alike


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_moe", "phimoe"])
def test_streamed_noise_is_the_whole_ones_each_layer_read_once_for_both_attentions(family, monkeypatch, tmp_path):
    """HF at bf16 streamed from the checkpoint (as above 1 GiB of fp32 weights) measures exactly what it
    measures in memory, both attention implementations (deepseek_v3: its correction bias, which HF keeps in
    fp32, was a bf16 buffer in the streamed model); and the two run one layer at a time in turn (lockstep:
    each layer's blocks, then its stage of the e2e steps layer by layer), so that each decoder layer is read
    from the checkpoint once for both, not once per block kind and per step."""
    from oracle.verdict import noise as N
    from oracle.backend import hf_spec
    from oracle.reference.streaming import READ, forget_reads, tensor_bytes
    from oracle.reference.cached import reference_of
    from oracle.source.sources import model_source, prompt_tokens
    from models.checkpoint import LAYER, tensor_index

    spec = CheckSpec(family=family, backend="hf", precision="bf16", decode_tokens=4)
    src = model_source(spec)
    prompt = prompt_tokens(spec, src.args.vocab_size)
    ref = reference_of(spec, src, prompt)

    def measured(mode):
        monkeypatch.setenv("MOE_ORACLE_REFERENCE", mode)
        monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / mode))  # measured here, not read from a cache
        monkeypatch.setattr(N, "_MEMORY", {})
        forget_reads()
        before = READ["bytes"]
        noise = N.noise_for(ref, src, spec, prompt)
        return noise, READ["bytes"] - before

    (whole, none), (streamed, read) = measured("whole"), measured("streamed")
    assert none == 0
    assert read == sum(tensor_bytes(e) for n, e in tensor_index(src.model_dir).items() if LAYER.search(n))
    assert len(N.attentions(src.family)) == 2 or family == "gpt_oss"
    for a, b in ((whole.logits, streamed.logits), *((whole.outputs[k], streamed.outputs[k]) for k in whole.outputs),
                 *((whole.e2e_scores[k], streamed.e2e_scores[k]) for k in whole.e2e_scores)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            for u, v in zip(x if isinstance(x, tuple) else (x,), y if isinstance(y, tuple) else (y,)):
                assert u.dtype == v.dtype and np.array_equal(u, v)
    assert list(whole.outputs) == list(streamed.outputs)
