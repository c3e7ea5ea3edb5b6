"""The five original families' reports are unchanged by the family abstraction: each check is
run again and compared with its report saved before the change (tests/baselines/), by the rule of
oracle.verdict.portable: host facts, run state and file locations aside, measured errors within a tenth
of their limit (kernels round by the CPU they run on), everything else exact. Here the checks
whose artifacts the rest of the suite builds anyway; `python -m oracle.reports.baseline` runs all 45."""

import pytest

from oracle.reports.baseline import BASELINES, baseline_name, compare
from oracle.backend import CheckSpec
from oracle.check import run_check

FAMILIES = ("qwen3_5_moe", "qwen3_moe", "olmoe", "qwen2_moe", "mixtral")
CHEAP = [(f, b, p) for f in FAMILIES for b, p in (("eager", "fp32"), ("eager", "bf16"), ("hf", "fp32"), ("mlx", "fp32"))]
BUILT_BY_THE_SUITE = [("olmoe", "executorch", "fp32"), ("qwen2_moe", "iree-llvm-cpu", "fp32"),
                      ("qwen3_5_moe", "iree-llvm-cpu", "fp32")]


@pytest.mark.parametrize("family,backend,precision", CHEAP + BUILT_BY_THE_SUITE)
def test_report_is_unchanged(family, backend, precision):
    doc = run_check(CheckSpec(family=family, backend=backend, precision=precision)).to_dict()
    assert compare(BASELINES / baseline_name(family, backend, precision), doc) == []
