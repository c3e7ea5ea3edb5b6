"""The `hf` backend's seeded faults (exporters/torch/hf_faults.py) against the production model's forms
(models/faults/): where both exist they are one fault, so the checks fail by the same numbers.
A file of its own so that it runs beside test_selftest.py, not after it."""

from dataclasses import replace

import pytest

from exporters.torch.eager import EagerBackend
from models.faults import catalogue as faults
from oracle.backend import CheckSpec
from oracle.check import run_check


@pytest.mark.parametrize("family", ["olmoe", "llama4", "gpt_oss"])  # rows, columns, interleaved
def test_hf_gate_up_swap_is_the_catalogue_fault(family):
    """expert_gate_up_swapped on HF's fused experts (in the layout models.Family.hf_gate_up states)
    computes what the production model's form does: the two checks fail their rows by the same
    numbers. A wrong layout would also fail the moe row, by other numbers (gpt-oss's torch form had
    SiLU and no bias before 2026-11-26: its moe row was 22.4 against HF's 20.6)."""
    from exporters.torch.hf import HFBackend

    fault = next(f for f in faults.CATALOGUE if f.name == "expert_gate_up_swapped")
    spec = CheckSpec(family=family, backend="hf", seed=0, drill="off")
    hf = run_check(spec, HFBackend().with_fault(fault))
    eager = run_check(replace(spec, backend="eager"), EagerBackend().with_fault(fault))
    rows = [{(b.layer, b.kind): b.metrics["max_abs"] for b in r.blocks if b.status == "fail"} for r in (hf, eager)]
    assert rows[0].keys() == rows[1].keys() and any(kind == "moe" for _, kind in rows[0])
    for k, v in rows[0].items():
        assert v == pytest.approx(rows[1][k], rel=1e-5), k  # fp32 summation order apart
