"""The command line as a user meets it: exit codes, messages, nothing half-written."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import get_family
from oracle.source.seeded import tiny_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def test_check_writes_reports(cli, tmp_path):
    j, m = tmp_path / "r.json", tmp_path / "r.md"
    r = cli("check", "--family", "olmoe", "--backend", "eager", "--json", str(j), "--markdown", str(m))
    assert r.returncode == 0, r.stderr
    doc = json.loads(j.read_text())
    assert doc["schema"] == "oracle-report/v1" and doc["status"] == "pass"
    for key in ("spec", "provenance", "blocks", "e2e", "timings"):
        assert key in doc
    assert doc["provenance"]["versions"]["torch"] == torch.__version__.split("+")[0] or doc["provenance"][
        "versions"]["torch"].startswith("2.13.0")
    assert "pass" in m.read_text() and "e2e" in m.read_text()
    assert len(m.read_text().splitlines()) < 30  # short enough for a PR comment


def test_families_and_backends(cli):
    r = cli("families")
    assert r.returncode == 0 and "qwen3_5_moe" in r.stdout and "deepseek_v3" in r.stdout
    r = cli("backends")
    assert r.returncode == 0 and "eager" in r.stdout and "available" in r.stdout


@pytest.fixture()
def tiny_copy(tmp_path):
    src = tiny_checkpoint(get_family("olmoe"), 0)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


# bad checkpoints, options, paths and candidates: tests/test_bad_inputs.py
def test_model_dir_ok(cli, tiny_copy, tmp_path):
    r = cli("check", "--family", "olmoe", "--backend", "eager", "--model-dir", str(tiny_copy))
    assert r.returncode == 0, r.stderr


def test_plugin_backend(cli, tmp_path):
    j = tmp_path / "r.json"
    r = cli("check", "--family", "qwen2_moe", "--backend", "examples.fp64_backend:BACKEND", "--json", str(j))
    assert r.returncode == 0, r.stderr
    doc = json.loads(j.read_text())
    assert doc["provenance"]["backend"]["executor"] == "torch eager, float64"
    assert doc["e2e"]["token_exact"]


def test_plugin_from_the_current_directory_through_the_oracle_script():
    """The installed `oracle` script (which, unlike `python -m oracle`, does not put the current
    directory on sys.path) finds a plugin beside the user, as the README says."""
    script = Path(sys.executable).with_name("oracle")
    if not script.is_file():
        pytest.skip("no installed oracle script beside this interpreter")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(script), "check", "--family", "olmoe", "--backend", "examples.fp64_backend:BACKEND",
                        "--validate-only"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    r = subprocess.run([str(script), "check", "--family", "olmoe", "--backend", "nosuch_plugin.mod:X"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "No module named 'nosuch_plugin'" in r.stderr


def test_require_on_unavailable_backend(cli, tmp_path):
    r = cli("check", "--family", "olmoe", "--backend", "tests.plugins:UNAVAILABLE")
    assert r.returncode == 0 and "Skipped: needs a flux capacitor" in r.stdout
    r = cli("check", "--family", "olmoe", "--backend", "tests.plugins:UNAVAILABLE", "--require")
    assert r.returncode == 3


def test_backend_crash_is_error_exit_4(cli, tmp_path):
    j = tmp_path / "r.json"
    r = cli("check", "--family", "olmoe", "--backend", "tests.plugins:CRASHING", "--json", str(j))
    assert r.returncode == 4
    doc = json.loads(j.read_text())
    assert doc["status"] == "error" and "RuntimeError: kernel exploded" in doc["error"]


def test_nan_never_passes(cli, tmp_path):
    j = tmp_path / "r.json"
    r = cli("check", "--family", "mixtral", "--backend", "tests.plugins:NAN_IN_MOE", "--json", str(j))
    assert r.returncode == 1
    doc = json.loads(j.read_text())
    moe = [b for b in doc["blocks"] if b["kind"] == "moe" and b["layer"] == 0][0]
    assert moe["status"] == "fail" and moe["metrics"]["nonfinite"] > 0
    assert doc["e2e"]["status"] == "fail"


def test_json_to_stdout(cli, tmp_path):
    """`--json -`: the JSON report on standard output, and nothing else there (a file named '-'
    is never created)."""
    r = cli("check", "--family", "olmoe", "--backend", "eager", "--json", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["status"] == "pass"
    assert not (tmp_path / "-").exists()


def test_version_and_module_entry_point(tmp_path):
    import subprocess
    import sys

    from tests.conftest import ROOT

    for argv in (["-m", "oracle", "--version"], ["-m", "oracle.cli", "--version"]):
        r = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("moe-oracle "), r.stderr


def test_missing_goldens_refused(cli, tmp_path):
    r = cli("check", "--family", "olmoe", "--backend", "eager", env={"MOE_ORACLE_GOLDENS": str(tmp_path / "none")})
    assert r.returncode == 2 and "goldens directory" in r.stderr and "is missing" in r.stderr

