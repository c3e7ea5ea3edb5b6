"""The invariance rows (oracle/verdict/invariance.py): the e2e run repeated, the prompt prefilled in chunks and
token by token, and batched with another prompt, each against the same backend's e2e path. A clean olmoe check
carries the three rows on eager and hf (every path run: pass, within the e2e limit); the catalogue's three
invariance faults are each caught by their row, and only there (the single-sequence path sees nothing of two of
them); the pure comparison of two paths names the position and the first routing difference."""

import json

import numpy as np
import pytest

from oracle.backend import CheckSpec
from oracle.check import run_check
from oracle.reports.markdown import markdown
from oracle.reports.result import Status
from oracle.verdict.invariance import Path, chunk_sizes, compare_logits, first_route_difference


class _Ref:  # what compare_logits reads of a reference: the prompt's length and each step's logits rows
    def __init__(self, P, steps, V=5):
        self.prompt_len, self.logits = P, [np.zeros((P, V))] + [np.zeros((1, V)) for _ in range(steps - 1)]


def test_two_paths_compared_name_the_worst_step_and_position():
    ref, lim = _Ref(3, 3), {"atol": 1e-4, "rtol": 1e-3, "rel_l2": 1e-4}
    rows = {p: np.linspace(1, 2, 5) + p for p in range(5)}  # positions 0..2 the prompt, 3 and 4 two decode steps
    base = Path(dict(rows), [None] * 3)
    assert compare_logits(ref, base, Path(dict(rows), [None] * 3), lim)["identical"] is True
    moved = dict(rows)
    moved[3] = rows[3] + np.array([0, 0, 0.5, 0, 0])  # the first decode step's row off by 0.5
    c = compare_logits(ref, base, Path(moved, [None] * 3), lim)
    assert c["status"] == Status.FAIL and c["max_abs"] == pytest.approx(0.5) and c["identical"] is False
    assert c["where"] == {"step": 1, "position": 3}
    assert c["ratio"] >= 0.5 / (1e-4 + 1e-3 * 4.5)  # at least 0.5 against atol + rtol |ref| there (ref 4.5)
    moved[3] = rows[3] * (1 + 1e-7)  # a rounding's difference passes, and is not bit-identical
    c = compare_logits(ref, base, Path(moved, [None] * 3), lim)
    assert c["status"] == Status.PASS and c["identical"] is False and 0 < c["ratio"] < 1e-2


def test_the_first_routing_difference_is_named_by_layer_and_position():
    a = Path({}, [{1: np.array([[0, 1], [2, 3]]), 3: np.array([[4, 5], [6, 7]])}, {1: np.array([[0, 1]])}])
    b = Path({}, [{1: np.array([[1, 0], [2, 3]]), 3: np.array([[4, 5], [6, 1]])}, {1: np.array([[0, 1]])}])
    first, n = first_route_difference(a, b, [np.array([10, 11]), np.array([12])])
    assert n == 1 and first == {"call": 0, "layer": 3, "position": 11, "ordinary": [6, 7], "this": [1, 6]}


def test_the_prompt_is_chunked_a_third_then_the_rest():
    assert chunk_sizes(8) == [3, 5] and chunk_sizes(2) == [1, 1] and chunk_sizes(1) == [1]


@pytest.mark.parametrize("backend", ["eager", "hf"])
def test_a_clean_check_carries_the_three_rows(backend):
    doc = run_check(CheckSpec(family="olmoe", backend=backend)).to_dict()
    rows = {r["name"]: r for r in doc["invariance"]}
    assert doc["status"] == Status.PASS and list(rows) == ["repeat", "chunked", "batched"]
    assert all(r["status"] == Status.PASS for r in rows.values())
    assert rows["repeat"]["identical"] is True and rows["repeat"]["max_abs"] == 0.0  # one process, one CPU
    # chunks 3 + 5 and token by token, each within the e2e limit (fp32 roundings of other matmul shapes)
    assert [r["run"] for r in rows["chunked"]["runs"]] == ["3+5", "1 x 8"]
    for name in ("chunked", "batched"):
        assert rows[name]["ratio"] < 0.1 and rows[name]["max_abs"] < 1e-4 and rows[name]["routing"]["differences"] == 0
    text = markdown(json.loads(json.dumps(doc)))
    assert "Invariance (against this backend's own e2e path)" in text and "| batched | pass |" in text


def test_a_backend_without_a_path_says_why(monkeypatch):
    """A candidate that neither extends a sequence nor batches: the chunked row runs token by token (through
    decode) and names why 3 + 5 is n/a; the batched row is n/a with the candidate's reason."""
    import oracle.check as check
    from exporters.torch.candidate import TorchCandidate

    class OneAtATime(TorchCandidate):
        no_chunks = "test: no chunk after a first"

        def batch(self, prompts):
            return None

    seen, real = {}, check.invariance_rows

    def spy(ref, cand, *a, **k):
        seen["rows"] = real(ref, OneAtATime(cand.model, cand.dtype), *a, **k)
        return seen["rows"]

    monkeypatch.setattr(check, "invariance_rows", spy)
    assert run_check(CheckSpec(family="olmoe", backend="eager")).status == Status.PASS
    rows = {r.name: r for r in seen["rows"]}
    assert rows["chunked"].status == Status.PASS and [r["run"] for r in rows["chunked"].runs] == ["1 x 8"]
    assert "chunks 3+5: n/a (test: no chunk after a first)" in rows["chunked"].detail
    assert rows["batched"].status == Status.NA and rows["batched"].detail == TorchCandidate.no_batch


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_invariance_faults_are_each_caught_by_their_row(precision):
    from oracle.selftest.run import run_selftest

    res = run_selftest("eager", families=["olmoe"], seeds=(0,), precision=precision,
                       fault_names=["chunk_forgets_cache", "capacity_across_batch", "per_run_perturbation"])
    rows = {r.fault: r for r in res.faults}
    assert set(rows) == {"chunk_forgets_cache", "capacity_across_batch", "per_run_perturbation"}
    for name, row in rows.items():
        assert row.detected and row.localized, (name, row)
        assert row.worst["kind"] == {"chunk_forgets_cache": "invariance.chunked", "capacity_across_batch":
                                     "invariance.batched", "per_run_perturbation": "invariance.repeat"}[name]
        assert row.worst["ratio"] > 1
    assert all(a.status == Status.PASS for a in res.false_alarms)


def test_require_deterministic_needs_the_rows(cli):
    r = cli("check", "--family", "olmoe", "--backend", "eager", "--invariance", "off", "--require-deterministic")
    assert r.returncode == 2 and "--require-deterministic needs the invariance rows" in r.stderr
