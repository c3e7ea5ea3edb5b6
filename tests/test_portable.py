"""Nothing host-specific is compared (oracle.portable): a saved report compares equal to the same
report from another machine (another node name, CPU count, IREE target CPU, Python, paths, and
kernels that round differently), and unequal when the check's result changed."""

import copy
import json

import pytest

from oracle.baseline import BASELINES
from oracle.portable import comparable, differences

SAVED = BASELINES / "qwen2_moe__iree-llvm-cpu__fp32.json"


def another_machine(doc: dict) -> dict:
    """The same check as reported on another x86_64 machine."""
    doc = copy.deepcopy(doc)
    prov = doc.setdefault("provenance", {})
    prov["host"] = {"name": "ci-runner-7", "machine": "x86_64", "system": "Linux", "cpus": 64, "torch_threads": 32,
                    "iree_target_cpu": "x86_64-759d86f504e321cc"}  # another CPU's feature hash
    prov["python"] = "3.12.4"
    prov["versions"] = {**prov.get("versions", {}), "numpy": "9.9.9"}
    prov["thresholds_sha256"] = "0" * 64
    prov.setdefault("checkpoint", {})["dir"] = "/home/someone/else/.cache/moe-oracle/tiny/abc"
    for a in prov.get("artifacts", []):
        a["sha256"] = "f" * 64
    doc["timings"] = {"total_s": 123.0}
    doc["cache"] = {"all_cached": False, "artifacts": [{"name": "model.vmfb", "path": "/tmp/x/model.vmfb"}]}
    for row in doc["blocks"]:  # another vector width: the same program, rounded elsewhere
        m, lim = row["metrics"], row["limits"]
        if "max_abs" in m and isinstance(m["max_abs"], float):
            m["max_abs"] += 0.05 * lim["atol"]
            m["rel_l2"] *= 1.7
            row["ratio"] = row["ratio"] * 1.7 if row["ratio"] < 0.1 else row["ratio"]
    return doc


@pytest.fixture(scope="module")
def saved():
    return json.loads(SAVED.read_text())


def test_the_saved_report_holds_no_host_fact(saved):
    assert "host" not in saved["provenance"] and "x86_64-" not in SAVED.read_text()
    assert comparable(saved) == saved  # saved by the rule itself


def test_another_host_compares_equal(saved):
    doc = another_machine({**saved, "provenance": {**saved["provenance"], "host": {"iree_target_cpu": "x86_64-e0d75dc4d8ec9635"}}})
    assert differences(saved, doc) == []
    assert doc["provenance"]["host"]["iree_target_cpu"] != "x86_64-e0d75dc4d8ec9635"


@pytest.mark.parametrize("change,where", [
    (lambda d: d["blocks"][0].update(status="fail"), "blocks[0].status"),
    (lambda d: d["e2e"]["candidate_tokens"].__setitem__(3, 7), "e2e.candidate_tokens[3]"),
    (lambda d: d["blocks"][0]["metrics"].update(max_abs=d["blocks"][0]["limits"]["atol"] * 0.5), "blocks[0].metrics.max_abs"),
    (lambda d: d["blocks"][0].update(ratio=0.6), "blocks[0].ratio"),
    (lambda d: d["blocks"][0]["metrics"].update(ref_rms=d["blocks"][0]["metrics"]["ref_rms"] * 1.01), "blocks[0].metrics.ref_rms"),
    (lambda d: d["blocks"][0]["metrics"].update(nonfinite=1), "blocks[0].metrics.nonfinite"),
    (lambda d: d["blocks"][0]["metrics"].update(max_abs=float("nan")), "blocks[0].metrics.max_abs"),
    (lambda d: d["blocks"].pop(), "blocks"),
])
def test_a_changed_result_differs_on_any_host(saved, change, where):
    doc = another_machine(saved)
    change(doc)
    diffs = differences(saved, doc)
    assert diffs and diffs[0].startswith(where + ":"), diffs
