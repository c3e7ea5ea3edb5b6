"""Seeded faults in the eager production model fail the check, and the worst failing
block row names the right layer and block kind."""

import pytest

from exporters.eager import EagerBackend
from models import FAMILY_NAMES, faults
from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.sources import model_source

# The five the spine issue names, with the family where each exists.
NAMED = [
    ("qwen3_moe", "router_no_renorm"),
    ("qwen2_moe", "rope_theta_wrong"),
    ("olmoe", "qk_norm_missing"),
    ("qwen3_5_moe", "gdn_state_not_carried"),
    ("qwen2_moe", "shared_expert_gate_no_sigmoid"),
    ("mixtral", "kv_cache_write_off_by_one"),
]


def _check(family, fault):
    spec = CheckSpec(family=family, backend="eager", precision=fault.precision)
    args = model_source(spec).args
    r = run_check(spec, EagerBackend(transform=fault.inject))
    return r, (fault.layer(args), fault.kind)


@pytest.mark.parametrize("family,name", NAMED)
def test_named_fault_fails_and_localises(family, name):
    r, expected = _check(family, faults.get(name))
    assert r.status == "fail"
    assert (r.worst["layer"], r.worst["kind"]) == expected
    assert r.worst["ratio"] > 10  # far outside the limit, not a marginal miss


def test_gdn_state_fault_shows_in_decode_not_prefill():
    """The recurrent state is only lost between calls: prefill rows match, decode rows do not."""
    r, (layer, kind) = _check("qwen3_5_moe", faults.get("gdn_state_not_carried"))
    fd = r.worst["metrics"]["first_divergence"]
    assert fd["index"][0] >= 8  # the first 8 rows are the prompt (prefill)


def _all_cases():
    for family in FAMILY_NAMES:
        args = model_source(CheckSpec(family=family, backend="eager")).args
        for f in faults.applicable(args):
            yield pytest.param(family, f.name, id=f"{family}-{f.name}")


@pytest.mark.parametrize("family,name", list(_all_cases()))
def test_catalogue(family, name):
    r, expected = _check(family, faults.get(name))
    # moe_output_upcast makes eager torch itself crash downstream (fp32 hidden state into a
    # bf16 lm_head): contained, that is the e2e's error (and the rows that raised), the check
    # fails, and the moe row localises it
    assert r.status == "fail" and r.error is None
    if name == "moe_output_upcast":
        assert r.e2e.status == "error" and "RuntimeError" in r.e2e.error
    assert (r.worst["layer"], r.worst["kind"]) == expected


def test_catalogue_size_and_precisions():
    assert len(faults.CATALOGUE) >= 20
    assert {f.precision for f in faults.CATALOGUE} == {"fp32", "bf16"}
