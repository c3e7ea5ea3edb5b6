"""Known candidate defects (oracle/verdict/expected.py, goldens/known_divergences.toml): a check that
fails where its entry says is an expected failure; one that passes (a stale entry) or fails
elsewhere is red; an entry for other versions or precisions does not apply; a malformed data
file is refused with its path. The real entry (ERNIE on mlx-lm) runs in tests/test_mlx.py."""

import pytest

from oracle.reports import summary
from oracle.verdict.expected import Divergence, load, judge
from oracle.reports.result import E2E, BlockRow, CheckResult

ENTRY = Divergence(family="ernie4_5_moe", backend="mlx", package="mlx-lm", versions="<=0.32.2",
                   fails=("router", "e2e"), cause="drops the correction bias", reference="upstream")


def result(failing=(), e2e="pass", mlx_lm="0.32.2", precision="fp32"):
    blocks = [BlockRow(layer=0, kind=k, detail="", mode="isolated", status="fail" if k in failing else "pass",
                       metrics={}, limits={}, ratio=2.0 if k in failing else 0.1)
              for k in ("attention", "router", "moe", "layer")]
    e = E2E(status=e2e, token_exact=True, prompt_tokens=[1], reference_tokens=[2], candidate_tokens=[2],
            steps=[], limits={})
    status = "fail" if failing or e2e == "fail" else "pass"
    return CheckResult(spec={"family": "ernie4_5_moe", "backend": "mlx", "precision": precision}, status=status,
                       provenance={"versions": {"mlx-lm": mlx_lm}}, blocks=blocks, e2e=e)


def test_failing_where_the_entry_says_is_an_expected_failure():
    r = result(failing=("router",), e2e="fail")
    judge(r, [ENTRY])
    assert r.status == "xfail" and r.expected["verdict"] == "expected failure: drops the correction bias"
    assert r.expected["failed"] == ["router", "e2e"]


def test_a_release_format_entry_applies_to_such_checkpoints_and_with_the_familys():
    """An entry keyed by `release` applies only to a checkpoint in that format (provenance.checkpoint.release_method);
    where it and the family's both apply, the check is judged against their fails together, each cause told."""
    fp8 = Divergence(family="ernie4_5_moe", backend="mlx", package="mlx-lm", versions="<=0.32.2",
                     fails=("attention", "moe", "layer"), cause="rounds FP8 to bf16", reference="sanitize",
                     release=("fp8",))
    r = result(failing=("attention", "moe", "layer"))
    judge(r, [ENTRY, fp8])  # a plain checkpoint: the release's entry does not apply
    assert r.status == "fail" and r.expected["verdict"].startswith("unexpected: it also fails attention")
    r = result(failing=("router", "attention", "moe", "layer"), e2e="fail")
    r.provenance["checkpoint"] = {"release_method": "fp8"}
    judge(r, [ENTRY, fp8])
    assert r.status == "xfail", r.expected
    assert r.expected["cause"] == "drops the correction bias Also: rounds FP8 to bf16"
    assert set(r.expected["fails"]) == {"router", "e2e", "attention", "moe", "layer"}
    r = result()
    r.provenance["checkpoint"] = {"release_method": "fp8"}
    judge(r, [ENTRY, fp8])  # both apply and neither needs some inputs: a pass is stale
    assert r.status == "fail" and r.expected["verdict"].startswith("stale")


def test_the_kinds_a_known_divergence_fails_are_known_to_the_drill():
    """The drill (oracle/check.py drill_down) prefers a failing block of another kind: a new defect."""
    from oracle.verdict.expected import known_fails

    assert known_fails(result(failing=("router",)), [ENTRY]) == ("router", "e2e")
    assert known_fails(result(failing=("router",), mlx_lm="0.33.0"), [ENTRY]) == ()


def test_a_pass_makes_the_entry_stale_and_red():
    r = result()
    judge(r, [ENTRY])
    assert r.status == "fail" and r.expected["verdict"].startswith("stale: the expected failure did not happen")


def test_a_defect_on_some_inputs_is_not_stale_when_they_are_not_met():
    """mlx-lm's group choice (DeepSeek-V3, GLM-4, dots1) differs from HF's only where a kept group's
    k-th score is negative: a check that passes did not meet such inputs (no verdict, still a pass);
    one that fails where the entry says is an expected failure; anywhere else it is red."""
    entry = Divergence(**{**ENTRY.__dict__, "on_some_inputs": True})
    r = result()
    judge(r, [entry])
    assert r.status == "pass" and r.expected is None
    r = result(failing=("router",))
    judge(r, [entry])
    assert r.status == "xfail"
    r = result(failing=("attention",))
    judge(r, [entry])
    assert r.status == "fail" and "also fails attention" in r.expected["verdict"]
    assert {e.family for e in load() if e.on_some_inputs} >= {"deepseek_v3", "glm4_moe", "dots1"}


def test_failing_elsewhere_is_red():
    r = result(failing=("router", "attention"), e2e="fail")
    judge(r, [ENTRY])
    assert r.status == "fail" and "also fails attention" in r.expected["verdict"]


@pytest.mark.parametrize("kw", [{"mlx_lm": "0.33.0"}, {"precision": "bf16"}])
def test_an_entry_for_other_versions_or_precisions_does_not_apply(kw):
    entry = Divergence(**{**ENTRY.__dict__, "precisions": ("fp32",)})
    r = result(failing=("router",), **kw)
    judge(r, [entry])
    assert r.status == "fail" and r.expected is None


def test_the_shipped_data_file_is_valid():
    entries = load()
    assert any(e.family == "ernie4_5_moe" and e.backend == "mlx" for e in entries)


@pytest.mark.parametrize("text,needle", [
    ("[[divergence]]\nfamily = 'olmoe'\n", "missing"),
    ("[[divergence]]\nfamily='a'\nbackend='b'\npackage='c'\nversions='<=1'\nfails=['router']\ncause='x'\n"
     "reference='y'\ncolour='red'\n", "unknown keys ['colour']"),
    ("[[divergence]]\nfamily='a'\nbackend='b'\npackage='c'\nversions='about one'\nfails=['router']\ncause='x'\n"
     "reference='y'\n", "not a PEP 440 specifier set"),
    ("[[divergence]]\nfamily='a'\nbackend='b'\npackage='c'\nversions='<=1'\nfails=['router']\ncause='x'\n"
     "reference='y'\non_some_inputs='sometimes'\n", "on_some_inputs must be true or false"),
    ("[[divergence]]\nfamily='a'\nbackend='b'\npackage='c'\nversions='<=1'\nfails=['router']\ncause='x'\n"
     "reference='y'\nrelease=['gguf']\n", "release must be a list of release formats"),
    ("[[divergence\n", "known_divergences.toml"),
])
def test_a_malformed_data_file_is_refused_with_its_path(tmp_path, text, needle):
    path = tmp_path / "known_divergences.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="known_divergences.toml") as e:
        load(path)
    assert needle in str(e.value)


def test_the_matrix_counts_xfail_apart_and_it_does_not_gate():
    rows = [summary.synthetic_row("olmoe", "eager", "fp32", "pass", None),
            summary.synthetic_row("ernie4_5_moe", "mlx", "fp32", "xfail", "expected failure: drops the bias")]
    s = summary.summarize(rows)
    assert s["status"] == "pass" and s["counts"]["xfail"] == 1
    assert "1 expected failure(s)" in summary.markdown(s) and 'type="xfail"' in summary.junit(s)


def test_a_failure_at_a_model_level_block_is_named_so_in_the_summaries():
    """The worst block outside the layers (logits, final norm) reads "model", never "layer None"."""
    row = {**summary.synthetic_row("olmoe", "mlx", "bf16", "fail", None),
           "worst": {"layer": None, "kind": "logits", "ratio": 3.5}}
    s = summary.summarize([row])
    assert "worst block: model logits, 3.5x limit" in summary.junit(s)
    assert "| model logits (3.5x limit) |" in summary.markdown(s)
    assert "layer None" not in summary.junit(s) + summary.markdown(s)
