"""The backend contract (issue 31): `oracle.backend.Backend` / `Candidate` declare every member
with its default, the built-ins subclass them, the harness reads members plainly (never probes
with getattr/hasattr), and a plugin written against the older duck-typed contract still checks."""

import ast
from pathlib import Path

import pytest
import torch

from exporters.torch.candidate import TorchCandidate
from oracle.backend import BUILTIN, Backend, BackendError, Candidate, CheckSpec, as_backend, as_candidate, resolve
from oracle.check import run_check

ROOT = Path(__file__).resolve().parents[1]
# the names the harness gives a backend or a candidate
CONTRACT_NAMES = {"backend", "be", "cand", "candidate", "base", "variant"}


def test_the_harness_never_probes_a_backend_or_candidate():
    found = []
    for p in sorted((ROOT / "oracle").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and node.args
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in CONTRACT_NAMES):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "read the member (its default is on oracle.backend.Backend/Candidate):\n" + "\n".join(found)


@pytest.mark.parametrize("name", list(BUILTIN))
def test_builtins_subclass_the_contract(name):
    be = resolve(name)
    assert isinstance(be, Backend) and type(be).__module__.startswith("exporters."), type(be)


def test_builtin_candidates_subclass_the_contract():
    import exporters.torch.candidate
    import exporters.executorch.candidate
    import exporters.executorch.mlx.backend
    import exporters.torch.hf
    import exporters.iree.candidate
    import exporters.mlx.candidate

    for cls in (exporters.torch.candidate.TorchCandidate, exporters.torch.hf.HFCandidate, exporters.iree.candidate.IreeCandidate,
                exporters.mlx.candidate.MLXCandidate, exporters.executorch.candidate.ExecutorchCandidate,
                exporters.executorch.mlx.backend.MlxCandidate):
        assert issubclass(cls, Candidate), cls


# ------------------------------------------------- a plugin written against the duck-typed contract
class OldCandidate:
    """The old docstring's candidate: no base class, a few optional members."""

    block_mode = "isolated"

    def __init__(self, model):
        self.model, self.dtype, self.info = model, torch.float32, {"executor": "torch eager, old-style plugin"}

    # the eager candidate's own three methods, borrowed as plain functions: still no base class
    prefill, decode, run_block = TorchCandidate.prefill, TorchCandidate.decode, TorchCandidate.run_block

    def structures(self):
        return {"note": "old-style\n"}


class OldBackend:
    name = "old-style"
    precisions = ("fp32",)
    memory_per_param = {"fp32": 4.4}

    def availability(self):
        return True, ""

    def load(self, model, spec):
        return OldCandidate(model.build_production(torch.float32))

    def with_fault(self, fault):
        return None if fault.name == "never" else OldBackend()


OLD_STYLE = OldBackend()


def test_an_old_style_plugin_gets_the_defaults():
    be = resolve("tests.test_contract:OLD_STYLE")
    assert isinstance(be, Backend) and type(be.plugin).__name__ == "OldBackend"
    assert be.name == "old-style" and be.precisions == ("fp32",) and be.memory_per_param == {"fp32": 4.4}
    assert be.option_schema == () and be.export is None and be.artifact_suffix is None
    assert be.runs_torch is True and be.loads_directory is False and be.check_options(None) is None
    assert be.fault_not_applicable(None) is None and be.memory_note == ""
    assert isinstance(be.with_fault(type("F", (), {"name": "x"})()), Backend)
    cand = as_candidate(object())
    assert cand.info == {} and cand.block_mode == "isolated" and cand.block_modes == {}
    assert cand.gates() == [] and cand.structures() == {} and cand.sample_prefill is None
    assert cand.sample_logits is None and cand.top_p_after_temperature is True
    assert as_backend(be) is be and as_candidate(cand) is cand


def test_an_old_style_plugin_still_checks():
    r = run_check(CheckSpec(family="olmoe", backend="tests.test_contract:OLD_STYLE", decode_tokens=3))
    assert r.status == "pass", r.error
    assert r.provenance["backend"]["executor"] == "torch eager, old-style plugin"
    assert r.structures == {"note": "old-style\n"}
    assert {g.name for g in r.gates} >= {"logits_dtype"} and all(g.status == "pass" for g in r.gates)


def test_a_plugin_missing_a_required_member_is_refused():
    with pytest.raises(BackendError, match="has no 'load'"):
        resolve("tests.plugins:NO_LOAD")


def test_a_duck_typed_backend_keeps_its_own_code_as_its_cache_key():
    from oracle.backend import implementation

    assert implementation(resolve("tests.test_contract:OLD_STYLE")).__name__ == "OldBackend"
    assert implementation(resolve("eager")).__name__ == "EagerBackend"


def test_statuses_are_compared_as_the_enum():
    """oracle.reports.result.Status is the one list of statuses: the harness compares with its members, not
    with bare strings (a typo in a string compares False silently; a member that does not exist
    fails on import)."""
    from oracle.reports.result import Status

    values = {s.value for s in Status} - {"routing-tie"}  # also a token verdict (match/tie/mismatch/routing-tie)

    def bare(node):
        if isinstance(node, ast.Constant):
            return node.value in values
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(bare(e) for e in node.elts)

    found = []
    for p in sorted((ROOT / "oracle").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Compare) and any(bare(x) for x in [node.left, *node.comparators]):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "compare with oracle.reports.result.Status members:\n" + "\n".join(found)
