"""The on-device sampler and its gate rows (oracle check --sampling)."""

import numpy as np
import pytest
import torch

from models.layers.sampling import Sampler, check_args, gumbel_noise
from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.verdict.sampling import distribution_gate, nucleus, reference_noise, reference_sample

SAMPLING = {"sampling": {"temperature": 0.8, "top_p": 0.9}}


def _gates(r):
    return {g.name: g for g in r.gates if g.name.startswith("sampling_")}


def test_eager_qwen3_5_passes_every_sampling_row():
    r = run_check(CheckSpec(family="qwen3_5_moe", backend="eager", options=SAMPLING))
    gates = _gates(r)
    assert set(gates) == {"sampling_greedy", "sampling_reproducible", "sampling_seed_schedule",
                          "sampling_arguments", "sampling_distribution"}
    assert all(g.status == "pass" for g in gates.values()), gates
    assert r.status == "pass"


def test_epsilon_temperature_fails_the_greedy_row():
    from tests.plugins import EPS_GREEDY

    r = run_check(CheckSpec(family="qwen3_5_moe", backend="eps", options=SAMPLING), EPS_GREEDY)
    gates = _gates(r)
    assert gates["sampling_greedy"].status == "fail" and "near tie" in gates["sampling_greedy"].message
    assert gates["sampling_seed_schedule"].status == "pass"
    assert r.status == "fail"


def test_seed_not_advanced_fails_the_schedule_row():
    from tests.plugins import STUCK_SEED

    r = run_check(CheckSpec(family="olmoe", backend="stuck", options=SAMPLING), STUCK_SEED)
    gates = _gates(r)
    assert gates["sampling_seed_schedule"].status == "fail"
    assert "first difference at step" in gates["sampling_seed_schedule"].message
    assert gates["sampling_greedy"].status == "pass" and gates["sampling_reproducible"].status == "pass"


def test_backend_without_sampler_skips_the_rows():
    r = run_check(CheckSpec(family="olmoe", backend="hf", options=SAMPLING))
    assert {g.status for g in _gates(r).values()} == {"skipped"} and r.status == "pass"


@pytest.mark.parametrize("args,needle", [(["--top-p", "1.5"], "top_p must be in (0, 1]"),
                                         (["--top-p", "0"], "top_p must be in (0, 1]"),
                                         (["--temperature", "-0.1"], "temperature must be >= 0")])
def test_cli_refuses_bad_sampling_arguments(cli, args, needle):
    r = cli("check", "--family", "olmoe", "--backend", "eager", "--sampling", *args)
    assert r.returncode == 2 and needle in r.stderr


def test_noise_matches_the_independent_host_implementation():
    from models.layers.sampling import hash32
    from oracle.verdict.sampling import _hash32

    for seed in (0, 1, 12345, 2**31 + 7, 2**40 + 3):
        x = torch.arange(300, dtype=torch.int64) * 7919 + seed % 1000
        assert hash32(x).tolist() == _hash32(x.numpy()).astype(np.int64).tolist()  # the same bits
        dev = gumbel_noise(torch.tensor(seed), 300).double().numpy()  # float32 logs on the device
        assert np.allclose(dev, reference_noise(seed, 300), rtol=1e-4, atol=1e-4)


def test_sampler_head_matches_reference_sampler():
    g = torch.Generator().manual_seed(0)
    for seed in range(20):
        logits = torch.randn(64, generator=g) * 2
        for t, p in ((0.0, 1.0), (0.7, 0.9), (1.3, 1.0), (1.0, 0.3)):
            tok = int(Sampler()(logits[None], torch.tensor(t), torch.tensor(p), torch.tensor(seed))[0])
            want, margin = reference_sample(logits.numpy(), t, p, seed)
            assert tok == want or margin < 1e-4


def test_check_args():
    check_args(0.0, 1.0)
    for t, p in ((-1.0, 0.5), (1.0, 0.0), (1.0, 1.01), (float("nan"), 0.5)):
        with pytest.raises(ValueError):
            check_args(t, p)


def test_distribution_gate_catches_a_sampler_that_ignores_top_p():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=50) * 2
    p, keep = nucleus(logits, 1.0, 0.5)
    good = rng.choice(50, size=2000, p=np.where(keep, p, 0) / p[keep].sum())
    assert distribution_gate(logits, good, 1.0, 0.5).status == "pass"
    full = rng.choice(50, size=2000, p=p)  # top_p ignored
    row = distribution_gate(logits, full, 1.0, 0.5)
    assert row.status == "fail" and "outside the top-p nucleus" in row.value
    hot = rng.choice(50, size=2000, p=nucleus(logits, 1.5, 1.0)[0])  # wrong temperature
    assert distribution_gate(logits, hot, 1.0, 1.0).status == "fail"
