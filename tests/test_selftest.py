"""`oracle selftest`: the fault catalogue through the eager backend (the whole catalogue, once: in
tests/test_faults.py, whose per-fault cases read its rows), and the fixes the oracle needed to catch
faults it first missed (each with why the fix is principled)."""

import json

import pytest
import torch

from exporters.torch.eager import EagerBackend
from models.faults import catalogue as faults
from models import FAMILY_NAMES
from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.source.sources import model_source
from oracle.selftest.result import load_report, render
from oracle.selftest.run import run_selftest


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_selftest_cli_subset(cli, tmp_path, jobs):
    """`-j 2`: the checks run in two worker processes, the rows, their order and the progress lines the same."""
    j = tmp_path / "st.json"
    r = cli("selftest", "--backend", "eager", "--family", "qwen2_moe", "--fault", "rope_theta_wrong",
            "--fault", "shared_expert_missing", "--seeds", "0,1", "--json", str(j), "-j", jobs)
    assert r.returncode == 0, r.stderr
    assert "detected 2/2, localized 2/2, false alarms 0/2" in r.stdout
    doc = json.loads(j.read_text())
    worst = {row["fault"]: row["worst"]["kind"] for row in doc["faults"]}
    assert doc["summary"]["ok"] and worst == {"rope_theta_wrong": "attention", "shared_expert_missing": "moe"}
    assert doc["complete"] is True
    # a line a finished row on stderr (not a terminal here): progress of runs that take hours
    lines = [x for x in r.stderr.splitlines() if x.startswith("selftest eager: ")]
    assert [x.split(": ", 1)[1].rsplit(" (", 1)[0] for x in lines] == [
        "qwen2_moe clean seed 0: pass", "qwen2_moe shared_expert_missing: detected at layer 1 moe",
        "qwen2_moe rope_theta_wrong: detected at layer 1 attention", "qwen2_moe clean seed 1: pass"]


def test_a_cut_selftest_keeps_the_rows_it_finished(tmp_path, monkeypatch, capsys):
    """The --json report is rewritten after each row (`complete: false` until the end): a run cut
    short (a shard's time limit, Ctrl-C) keeps what it finished, never a half-written file."""
    from oracle.selftest import run as selftest
    from oracle.cli import main

    real, calls = selftest.run_check, []

    def run_check(spec, backend=None, **kw):
        calls.append(backend.name)
        if len(calls) == 3:  # the clean seed-0 run and one fault finished: cut at the second fault
            raise KeyboardInterrupt
        return real(spec, backend, **kw)

    monkeypatch.setattr(selftest, "run_check", run_check)
    j = tmp_path / "st.json"
    with pytest.raises(KeyboardInterrupt):
        main(["selftest", "--backend", "eager", "--family", "olmoe", "--seeds", "0", "--json", str(j)])
    doc = json.loads(j.read_text())
    assert doc["complete"] is False and doc["families"] == ["olmoe"]
    assert len(doc["false_alarms"]) == 1 and len(doc["faults"]) == 1 and doc["faults"][0]["detected"]
    assert doc["summary"]["faults"] == 1
    assert not list(tmp_path.glob(".st.json.*"))  # no temp file left beside it


def test_a_cut_selftest_resumes_from_its_report(tmp_path, monkeypatch, capsys):
    """--resume keeps the rows a cut run finished (not run again) and runs the rest; the result is
    the uncut run's; a report of other settings is refused and left as it was."""
    from oracle.selftest import run as selftest
    from oracle.cli import main

    real, calls = selftest.run_check, []

    def run_check(spec, backend=None, **kw):
        calls.append((backend.name, spec.seed))
        if len(calls) == 3:  # the clean seed-0 run and one fault finished: cut at the second fault
            raise KeyboardInterrupt
        return real(spec, backend, **kw)

    args = ["selftest", "--backend", "eager", "--family", "olmoe", "--seeds", "0,1", "--fault", "rope_theta_wrong",
            "--fault", "qk_norm_missing", "--fault", "router_sigmoid"]
    j = tmp_path / "st.json"
    monkeypatch.setattr(selftest, "run_check", run_check)
    with pytest.raises(KeyboardInterrupt):
        main(args + ["--json", str(j)])
    first = json.loads(j.read_text())
    assert first["complete"] is False and len(first["faults"]) == 1
    # other seeds: refused before any work, the report untouched
    calls.clear()
    assert main([*args[:6], "0,2", *args[7:], "--json", str(j), "--resume"]) == 2
    assert "seeds [0, 1] (this run: [0, 2])" in capsys.readouterr().err and not calls
    assert json.loads(j.read_text()) == first
    monkeypatch.setattr(selftest, "run_check", lambda spec, backend=None, **kw: (
        calls.append((backend.name, spec.seed)), real(spec, backend, **kw))[1])
    assert main(args + ["--json", str(j), "--resume"]) == 0
    assert "resuming" in capsys.readouterr().err
    # again: the clean seed 0 (the faults left are judged against it), the two faults left, seed 1
    assert len(calls) == 4 and calls[-1] == ("eager", 1)
    doc = json.loads(j.read_text())
    assert doc["complete"] is True and doc["summary"]["ok"] and len(doc["faults"]) == 3
    assert doc["faults"][0] == first["faults"][0]  # kept as it was, in its place
    # everything finished: nothing runs again
    calls.clear()
    assert main(args + ["--json", str(j), "--resume"]) == 0 and not calls
    assert json.loads(j.read_text()) == doc


def test_resume_refuses_what_is_not_a_selftest_report(tmp_path, capsys):
    from oracle.cli import main

    j = tmp_path / "st.json"
    j.write_text('{"schema": "oracle-check/v1"}')
    assert main(["selftest", "--family", "olmoe", "--json", str(j), "--resume"]) == 2
    assert "not a selftest report" in capsys.readouterr().err
    assert j.read_text() == '{"schema": "oracle-check/v1"}'
    with pytest.raises(SystemExit) as e:
        main(["selftest", "--family", "olmoe", "--resume"])
    assert e.value.code == 2 and "--resume needs --json PATH" in capsys.readouterr().err


def test_a_family_with_a_known_divergence_is_self_tested_too():
    """mlx-lm's ERNIE drops the router's correction bias (goldens/known_divergences.toml): its clean
    run is an expected failure, not a false alarm, and a fault is localised among the rows that
    pass without it (the known divergence's router row says nothing about a rope or norm fault).
    A fault aimed at the router row that already fails is `masked`: stated with whether a row that
    passes without it failed (router_sigmoid: the moe row), not required (one expert fewer changes
    only tokens the failing router row already routes elsewhere: nothing else sees it)."""
    pytest.importorskip("mlx_lm")
    res = run_selftest("mlx", families=["ernie4_5_moe"], seeds=(0,),
                       fault_names=["rope_theta_wrong", "residual_missing", "router_sigmoid", "router_wrong_num_experts",
                                    "router_bias_ignored"])
    # a fault with no form on this family's mlx-lm model: listed with the backend's reason
    assert [(x["fault"], "already ignores the correction bias" in x["why"]) for x in res.not_applicable] == [
        ("router_bias_ignored", True)]
    assert [a.status for a in res.false_alarms] == ["xfail"]
    rows = {r.fault: r for r in res.faults}
    assert rows["rope_theta_wrong"].detected and rows["rope_theta_wrong"].worst["kind"] == "attention"
    assert rows["residual_missing"].detected and rows["residual_missing"].worst["kind"] == "layer"
    assert rows["router_sigmoid"].masked and rows["router_sigmoid"].detected and not rows["router_sigmoid"].required
    assert rows["router_wrong_num_experts"].masked and not rows["router_wrong_num_experts"].detected
    assert not rows["rope_theta_wrong"].masked
    s = res.summary()
    assert (s["detected"], s["localized"], s["false_alarms"], s["masked"], s["masked_detected"]) == (2, 2, 0, 2, 1)
    assert s["ok"] and "2 fault(s) at a block that fails without them" in res.summary_line()
    assert "(m)" in render(res)


def test_selftest_shards_split_the_families(cli, tmp_path):
    """--shard I/N: every N-th family (the nightly's shards); an empty shard is bad input."""
    j = tmp_path / "st.json"
    r = cli("selftest", "--backend", "eager", "--family", "olmoe", "--family", "mixtral", "--family", "qwen2_moe",
            "--shard", "2/2", "--fault", "rope_theta_wrong", "--seeds", "0", "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(j.read_text())["families"] == ["mixtral"]
    r = cli("selftest", "--backend", "eager", "--family", "olmoe", "--shard", "2/2")
    assert r.returncode == 2 and "no family in this shard" in r.stderr


@pytest.mark.parametrize("args, needle", [
    (["--fault", "rope_theta_wrng"], "unknown fault 'rope_theta_wrng' on eager; its catalogue: router_softmax_after_topk"),
    (["--backend", "llamacpp", "--fault", "rope_theta_wrong"], "unknown fault 'rope_theta_wrong' on llamacpp; its "
     "catalogue: gguf_rope_freq_base_wrong"),  # llama.cpp has its own (GGUF) faults
    (["--seeds", "0,,1"], "--seeds expects distinct comma-separated integers, got '0,,1'"),
    (["--seeds", "1,1"], "--seeds expects distinct comma-separated integers"),
])
def test_a_mistyped_fault_or_seed_list_is_refused_before_any_work(cli, args, needle):
    """A typo is not a run that judges nothing and says "detected 0/0"."""
    r = cli("selftest", "--family", "olmoe", *args)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
    assert "clean seed" not in r.stderr  # refused before the first check


def test_a_fault_asked_for_where_it_does_not_apply_is_said_so(cli, tmp_path):
    """MLA's cache fault on OLMoE (no MLA): nothing judged, each not applicable fault listed with
    why, and the run fails (it proved nothing)."""
    j = tmp_path / "st.json"
    r = cli("selftest", "--family", "olmoe", "--fault", "mla_cache_not_carried", "--fault", "rope_theta_wrong",
            "--seeds", "0", "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr  # one of the two applies: judged
    assert json.loads(j.read_text())["not_applicable"] == [
        {"family": "olmoe", "fault": "mla_cache_not_carried",
         "why": "not applicable to olmoe (the model lacks what the fault breaks)"}]
    r = cli("selftest", "--family", "olmoe", "--fault", "mla_cache_not_carried", "--seeds", "0")
    assert r.returncode == 1
    assert "NOT APPLICABLE olmoe mla_cache_not_carried: not applicable to olmoe" in r.stdout
    assert "1 fault(s) not applicable, none judged" in r.stdout


def test_list_says_what_would_run_and_what_not_and_runs_nothing(cli):
    """--list: the faults a family's check would take on the backend, the block each must be found
    at (the same the run expects), those not run with why; nothing is built or checked."""
    r = cli("selftest", "--backend", "mlx", "--family", "qwen2_moe", "--family", "olmoe", "--list",
            "--fault", "rope_theta_wrong", "--fault", "moe_output_upcast", "--fault", "shared_expert_missing")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [x.split()[:4] for x in lines if "layer" in x] == [
        ["qwen2_moe", "shared_expert_missing", "layer", "1"], ["qwen2_moe", "rope_theta_wrong", "layer", "1"],
        ["olmoe", "rope_theta_wrong", "layer", "1"]]  # in the catalogue's order, as the run goes
    assert any(x.startswith("olmoe") and "shared_expert_missing" in x and "not run: not applicable to olmoe" in x
               for x in lines)
    assert sum("moe_output_upcast" in x and "not run: a bf16 dtype fault" in x for x in lines) == 2
    assert lines[-1] == "3 fault check(s) would run" and "clean seed" not in r.stderr
    # a backend without bf16 programs and no reason of its own: the precision it lacks is the reason
    r = cli("selftest", "--backend", "iree-llvm-cpu", "--family", "olmoe", "--list", "--fault", "moe_output_upcast")
    assert "not run: a fault of bf16 programs; backend iree-llvm-cpu runs fp32 only" in r.stdout, r.stdout + r.stderr
    r = cli("selftest", "--backend", "eager", "--family", "olmoe", "--list", "--fault", "nope")
    assert r.returncode == 2 and "unknown fault 'nope'" in r.stderr


def test_noise_ratio_requires_a_fault_where_detection_is_guaranteed():
    """A fault is required at bf16 where its fp32 error, less the clean candidate's own bf16 error on the
    block, exceeds the block's limit: then the faulted error exceeds it whatever the rounding's signs
    (triangle inequality). The numbers are nemotron_h's layer-4 MoE row, seed 0 (measured 2026-12-07):
    the fault alone 1.04x the limit, the candidate's own 0.38x, and the faulted bf16 run 0.87x: missed."""
    from types import SimpleNamespace

    from oracle.reports.result import BlockRow, Status
    from oracle.selftest.judge import noise_ratio

    lim = {"max_abs": 0.04907, "rel_l2": 0.01437}
    run = lambda m, st=Status.PASS: SimpleNamespace(status=st, blocks=[BlockRow(4, "moe", st, "isolated", m, lim, 0.0)])  # noqa: E731
    fault32, faulted, clean = (run({"max_abs": 0.05098, "rel_l2": 0.00731}, Status.FAIL),
                               run({"max_abs": 0.04282, "rel_l2": 0.00887}), run({"max_abs": 0.01885, "rel_l2": 0.00558}))
    where = {"layer": 4, "kind": "moe"}
    assert noise_ratio(fault32, faulted, where) == pytest.approx(0.05098 / 0.04907)  # the fault alone: 1.04
    assert noise_ratio(fault32, faulted, where, clean) == pytest.approx((0.05098 - 0.01885) / 0.04907)  # 0.65
    # a fault of 3x the limit stays required (2.6x after the candidate's own error)
    big = run({"max_abs": 3 * 0.04907, "rel_l2": 0.001}, Status.FAIL)
    assert noise_ratio(big, faulted, where, clean) > 1
    # no comparable row (the fp32 candidate crashed): required
    assert noise_ratio(SimpleNamespace(status=Status.ERROR, blocks=[]), faulted, where, clean) == float("inf")


def test_selftest_at_bf16_states_which_faults_are_above_its_noise(cli, tmp_path):
    """At bf16 each fault's fp32 error on its block, less the clean candidate's own bf16 error there,
    over that block's bf16 limit (HF bf16's own error there), says whether bf16 can see it: a scale error of 1e-3 on expert weights is below
    bf16's rounding (measured 0.38x on olmoe), stated and not required; a wrong rope theta is
    9.6x above it and must be caught and localised; the dtype fault runs at bf16 as always."""
    j = tmp_path / "st.json"
    r = cli("selftest", "--backend", "eager", "--family", "olmoe", "--precision", "bf16", "--seeds", "0",
            "--fault", "expert_weights_off_1e-3", "--fault", "rope_theta_wrong", "--fault", "moe_output_upcast",
            "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(j.read_text())
    rows = {row["fault"]: row for row in doc["faults"]}
    assert doc["precision"] == "bf16" and {row["precision"] for row in doc["faults"]} == {"bf16"}
    below, above, dtype = rows["expert_weights_off_1e-3"], rows["rope_theta_wrong"], rows["moe_output_upcast"]
    assert below["noise_ratio"] < 1 and not below["detected"]
    assert above["noise_ratio"] > 3 and above["detected"] and above["localized"]
    assert dtype["noise_ratio"] is None and dtype["detected"]
    s = doc["summary"]
    assert (s["faults"], s["detected"], s["below_noise"], s["false_alarms"]) == (2, 2, 1, 0) and s["ok"]
    assert "1 fault(s) below bf16's own error, not required" in r.stdout


def test_selftest_fails_when_the_fault_never_reaches_the_candidate(cli, tmp_path):
    """A backend that hides faults (ignores with_fault) computes exactly what the clean one does:
    the fault is "not injected", neither detected nor missed, and the selftest exits 1."""
    j = tmp_path / "st.json"
    r = cli("selftest", "--backend", "tests.plugins:FAULT_BLIND", "--family", "olmoe", "--fault",
            "qk_norm_missing", "--seeds", "0", "--json", str(j))
    assert r.returncode == 1 and "detected 0/0" in r.stdout and "1 not injected" in r.stdout
    row = json.loads(j.read_text())["faults"][0]
    assert row["injected"] is False and row["status"] == "pass" and not row["detected"]


def test_a_crash_is_not_a_detection_and_a_refused_family_does_not_abort(monkeypatch):
    """A faulted candidate that raises is counted `crashed`, not detected; a family the backend
    refuses is reported with the reason while the others run to the end."""
    from oracle.selftest import run as selftest

    real = selftest.run_check

    def run_check(spec, backend=None, **kw):
        if spec.family == "mixtral":
            raise InputError("this backend cannot check mixtral (a test)")
        r = real(spec, backend, **kw)
        if "+" in getattr(backend, "name", ""):  # every faulted run: as if the candidate had raised
            r.status, r.error, r.worst = "error", "load: RuntimeError: boom", None
        return r

    monkeypatch.setattr(selftest, "run_check", run_check)
    res = run_selftest("eager", families=["mixtral", "olmoe"], seeds=(0,), fault_names=["rope_theta_wrong"])
    s = res.summary()
    assert res.refused == [{"family": "mixtral", "why": "this backend cannot check mixtral (a test)"}]
    assert (s["faults"], s["detected"], s["crashed"], s["refused"], s["clean_runs"]) == (1, 0, 1, 1, 1)
    assert not s["ok"] and "1 crashed" in res.summary_line() and "REFUSED mixtral" in render(res)


def test_rows_that_all_raised_are_a_crash_not_a_detection(monkeypatch):
    """A faulted check whose failing rows all raised (status error; the check itself `fail`) measured
    nothing: crashed, not detected (HF's model with its MoE output upcast raised in every row)."""
    from oracle.selftest import run as selftest

    real = selftest.run_check

    def run_check(spec, backend=None, **kw):
        r = real(spec, backend, **kw)
        if "+" in getattr(backend, "name", ""):
            r.status = "fail"
            for row in [*r.blocks, r.e2e]:
                row.status = "error"
        return r

    monkeypatch.setattr(selftest, "run_check", run_check)
    res = run_selftest("eager", families=["olmoe"], seeds=(0,), fault_names=["rope_theta_wrong"])
    (row,) = res.faults
    assert row.status == "fail" and not row.detected and row.crashed
    assert (res.summary()["detected"], res.summary()["crashed"]) == (0, 1)


def test_a_check_failing_by_a_gate_alone_is_not_a_crash(monkeypatch):
    """Measured on executorch-mlx qwen3_5_moe: the delegate's FuseRMSNormPass turns the seeded
    qk_norm_flat_for_per_head back into the per-head norm, so every row measures what the clean
    candidate does and only the structural golden fails. Nothing raised: not injected (the same
    numbers), not crashed; with other numbers and no failing row it is a miss that names the gate."""
    from oracle.selftest import run as selftest
    from oracle.reports.result import GateRow
    from oracle.selftest.result import FaultRow, row_line

    real = selftest.run_check

    def run_check(spec, backend=None, **kw):
        if "+" not in getattr(backend, "name", ""):
            return real(spec, backend, **kw)
        r = real(spec, backend.base if hasattr(backend, "base") else EagerBackend(), **kw)  # the clean numbers
        r.status = "fail"
        r.gates.append(GateRow("structure:ops", "fail", "differs", "identical"))
        return r

    monkeypatch.setattr(selftest, "run_check", run_check)
    res = run_selftest("eager", families=["olmoe"], seeds=(0,), fault_names=["rope_theta_wrong"])
    (row,) = res.faults
    assert (row.status, row.detected, row.injected, row.raised, row.crashed) == ("fail", False, False, False, False)
    assert row.failed_gates == ["structure:ops"] and "not injected" in row_line(row)
    assert res.summary()["crashed"] == 0 and res.summary()["not_injected"] == 1

    miss = FaultRow("olmoe", "f", "", "fp32", {"layer": 1, "kind": "attention"}, "fail", False, False, None, 1.0,
                    raised=False, failed_gates=["structure:ops"])
    assert not miss.crashed and miss.required
    assert "MISSED by every row (failed gate structure:ops only)" in row_line(miss)
    # a report written before the field: as then (a fail with no failing row counted crashed)
    assert FaultRow("olmoe", "f", "", "fp32", {}, "fail", False, False, None, 1.0).crashed


@pytest.mark.parametrize("raised", [False, True])
def test_a_known_divergence_family_detects_by_a_measured_row_only(monkeypatch, raised):
    """A family failing as its known divergence says (every check `xfail`): a fault is detected by a
    row that fails by a measurement and passes without the fault. Where every such row raised, the
    faulted candidate crashed: counted crashed, not detected."""
    from oracle.selftest import run as selftest

    real = selftest.run_check

    def run_check(spec, backend=None, **kw):
        r = real(spec, backend, **kw)
        r.status = "xfail"
        r.blocks[0].status = "fail"  # the known divergence: a row that fails with or without the fault
        if raised and "+" in getattr(backend, "name", ""):
            for row in r.blocks[1:]:
                row.status = "error" if row.status == "fail" else row.status
        return r

    monkeypatch.setattr(selftest, "run_check", run_check)
    res = run_selftest("eager", families=["olmoe"], seeds=(0,), fault_names=["rope_theta_wrong"])
    (row,) = res.faults
    assert row.status == "xfail" and row.worst["kind"] == "attention"  # the new failing row, either way
    assert (row.detected, row.crashed) == ((False, True) if raised else (True, False))
    assert (res.summary()["detected"], res.summary()["crashed"]) == ((0, 1) if raised else (1, 0))


def test_selftest_hf_faults_on_transformers_modules():
    """The `hf` backend's faults are edits of HF's own modules (exporters/torch/hf_faults.py): an attribute
    (the attention's scaling), a weight (one expert's, in HF's fused layout), a submodule's output
    (the shared expert dropped); a fault with no form there is listed with why."""
    res = run_selftest("hf", families=["qwen2_moe"], seeds=(0,),
                       fault_names=["attention_scale_wrong", "expert_weights_off_1e-3", "shared_expert_missing",
                                    "rope_theta_wrong"])
    s = res.summary()
    assert (s["faults"], s["detected"], s["localized"], s["false_alarms"], s["crashed"]) == (3, 3, 3, 0, 0)
    assert {r.fault: (r.worst["layer"], r.worst["kind"]) for r in res.faults} == {
        "attention_scale_wrong": (1, "attention"), "expert_weights_off_1e-3": (1, "moe"),
        "shared_expert_missing": (1, "moe")}
    assert all(r.injected for r in res.faults)
    (na,) = res.not_applicable
    assert na["fault"] == "rope_theta_wrong" and "rotary" in na["why"]


def test_fix_expert_probes():
    """Missed before: `expert_weights_off_1e-3` passed for mixtral seed 0, because the
    8+8-token sequence never routes layer 1 to the faulty expert (the prompt covers 5 of 8
    experts there). No comparison of the sequence can see an expert nobody routes to, so
    the fix is coverage: the router and moe blocks also get one probe token per expert.
    The failing values must come from the probe rows, after the sequence's 16 rows."""
    spec = CheckSpec(family="mixtral", backend="eager", seed=0)
    f = faults.get("expert_weights_off_1e-3")
    r = run_check(spec, EagerBackend().with_fault(f))
    assert r.status == "fail" and (r.worst["layer"], r.worst["kind"]) == (1, "moe")
    assert r.reference["expert_coverage"]["1"]["routed_by_sequence"] < 8
    assert r.worst["metrics"]["first_divergence"]["index"][0] >= 16


def test_fix_output_dtype():
    """Missed before: `moe_output_upcast` (an unconditional float cast in a bf16 model) is
    numerically harmless in isolation, so value metrics alone pass it; the wrong dtype then
    breaks or slows every backend downstream. The fix: each block and the logits must keep
    the model's declared dtype ([<precision>.output] in thresholds.toml)."""
    r = run_check(CheckSpec(family="qwen3_moe", backend="eager", precision="bf16"),
                  EagerBackend().with_fault(faults.get("moe_output_upcast")))
    assert r.worst["kind"] == "moe" and "dtype_mismatch" in r.worst["metrics"]
    r = run_check(CheckSpec(family="qwen3_moe", backend="eager", precision="bf16"),
                  EagerBackend().with_fault(faults.get("logits_cast_to_float")))
    gate = [g for g in r.gates if g.name == "logits_dtype"][0]
    assert gate.status == "fail" and gate.value == "float32" and gate.limit == "bfloat16"


def test_faults_do_not_leak_between_checks():
    """with_fault builds a new model per check: a clean check after a faulty one passes."""
    spec = CheckSpec(family="olmoe", backend="eager")
    assert run_check(spec, EagerBackend().with_fault(faults.get("residual_missing"))).status == "fail"
    assert run_check(spec, EagerBackend()).status == "pass"


def test_every_fault_applies_to_some_family():
    applicable = {f.name for fam in FAMILY_NAMES
                  for f in faults.applicable(model_source(CheckSpec(family=fam, backend="eager")).args)}
    assert applicable == {f.name for f in faults.CATALOGUE}
    assert torch.is_grad_enabled()  # no global state left behind by the checks


def _available(name):
    from oracle.backend import resolve

    return resolve(name).availability()[0]


@pytest.mark.parametrize("backend,family,fault_names", [
    ("mlx", "qwen3_5_moe", ["gdn_state_not_carried", "router_no_renorm", "shared_expert_gate_no_sigmoid",
                            "rope_theta_wrong"]),
    ("iree-llvm-cpu", "qwen2_moe", ["attention_not_causal"]),  # compiled by test_iree already (cached)
])
def test_selftest_subset_on_compiled_backends(backend, family, fault_names):
    """The nightly runs the whole catalogue through these backends; here a subset."""
    if not _available(backend):
        pytest.skip(f"{backend} unavailable")
    res = run_selftest(backend, families=[family], seeds=(0,), fault_names=fault_names)
    s = res.summary()
    assert s["faults"] == len(fault_names) and s["ok"], res.summary_line()


def test_workers_that_outgrow_the_memory_left_are_replaced(monkeypatch):
    """A worker keeps what the libraries it calls never free (ExecuTorch's lowering: ~40 MB a check), so
    `-j` recycles the pool when its workers hold more than the memory left (`outgrown`, told here they
    always do): the next check runs in a fresh worker, with the result it has in place."""
    from oracle.selftest import run as selftest

    held = []  # the workers (pids) whose memory each decision counted
    monkeypatch.setattr(selftest, "outgrown", lambda rss, available: held.append(set(checks.rss)) or rss > 0)
    said = []
    spec = selftest.family_spec("eager", "qwen2_moe", 0, {}, "normal", "fp32", False)
    with selftest.Checks("eager", {}, "normal", "fp32", jobs=2, notice=said.append) as checks:
        clean = checks.run(spec, None)
        faulted = checks.run(spec, None, "rope_theta_wrong")
    assert clean.status.value == "pass"
    assert faulted.status.value == "fail" and (faulted.worst["layer"], faulted.worst["kind"]) == (1, "attention")
    assert len(held) == 2 and held[0].isdisjoint(held[1])  # the second check's worker is not the first's
    assert [m.split(" (")[0] for m in said] == ["worker processes restarted"] * 2
    assert all("GiB" in m for m in said)


def test_a_check_refused_for_memory_fails_the_selftest_and_runs_again_on_resume(tmp_path, monkeypatch):
    """A check the memory here cannot hold was not run: its fault was not tested, so the self-test is not ok
    (it used to list it as `not applicable` and pass), and a resumed run tries it again."""
    from oracle.selftest import run as selftest
    from oracle.backend import MemoryRefusal

    real = selftest.run_check

    def short_of_memory(spec, backend=None, **kw):
        if backend.name != "eager":  # the faulted candidate ("eager+rope_theta_wrong")
            raise MemoryRefusal("the check would need about 9.0 GiB ... and 1.0 GiB is available")
        return real(spec, backend, **kw)

    monkeypatch.setattr(selftest, "run_check", short_of_memory)
    args = dict(families=["qwen2_moe"], seeds=(0,), fault_names=["rope_theta_wrong"])
    res = run_selftest("eager", **args)
    s = res.summary()
    assert (s["ok"], s["faults"], s["unrun"], s["not_applicable"]) == (False, 0, 1, 0)
    assert res.unrun[0]["check"] == "rope_theta_wrong" and "9.0 GiB" in res.unrun[0]["why"]
    assert "NOT RUN qwen2_moe rope_theta_wrong" in render(res) and "1 check(s) not run" in res.summary_line()
    j = tmp_path / "st.json"
    j.write_text(json.dumps(res.to_dict()))
    monkeypatch.setattr(selftest, "run_check", real)
    again = run_selftest("eager", resume=load_report(j), **args)
    assert again.summary()["ok"] and [r.fault for r in again.faults] == ["rope_theta_wrong"] and not again.unrun
