"""The spine's acceptance: eager (fp32, bf16) and hf pass for every family."""

import pytest

from models import FAMILY_NAMES
from oracle.backend import CheckSpec
from oracle.check import run_check
from models.args import block_keys
from tests.depth import IN_DEPTH
from oracle.source.sources import model_source


# fp32 for every family; bf16 (judged against HF bf16's own error, with routing replay: 2-4x an fp32
# check's time) for the families checked in depth (tests/depth.py)
@pytest.mark.parametrize("family,precision", [(f, "fp32") for f in FAMILY_NAMES] + [(f, "bf16") for f in IN_DEPTH])
def test_eager_passes(family, precision):
    r = run_check(CheckSpec(family=family, backend="eager", precision=precision, decode_tokens=8))
    assert r.status == "pass", r.worst
    kinds = {(row.layer, row.kind) for row in r.blocks}
    # every layer's blocks: attention, router + moe (or mlp for a dense layer), layer
    assert kinds == set(block_keys(model_source(CheckSpec(family=family, backend="eager")).args))
    assert all(row.status == "pass" and row.mode == "isolated" for row in r.blocks)
    assert len(r.e2e.steps) == 9 and len(r.e2e.reference_tokens) == 9
    if precision == "fp32":
        assert r.e2e.token_exact
        assert r.e2e.candidate_tokens == r.e2e.reference_tokens
        # fp32 production vs HF is summation-order noise: far inside the limits
        assert max(row.metrics["max_abs"] for row in r.blocks if row.kind != "router") < 1e-5
    else:
        # bf16 is looser, but a token may differ only inside a near tie (reported)
        assert all(s["token"] != "mismatch" for s in r.e2e.steps)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_hf_against_itself_is_exact(family):
    r = run_check(CheckSpec(family=family, backend="hf"))
    assert r.status == "pass"
    assert r.e2e.token_exact
    assert all(row.ratio == 0.0 for row in r.blocks)


def test_qwen3_5_has_both_attention_kinds():
    r = run_check(CheckSpec(family="qwen3_5_moe", backend="eager"))
    details = {row.detail for row in r.blocks if row.kind == "attention"}
    assert details == {"linear_attention", "full_attention"}


def test_reference_margins_recorded():
    r = run_check(CheckSpec(family="olmoe", backend="eager"))
    assert r.reference["min_token_margin"] > 0
    assert r.reference["min_router_gap"] > 0
    assert len(r.reference["token_margins"]) == 9
