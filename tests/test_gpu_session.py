"""benchmarks/gpu_session.py, the one command for a lent GPU machine, on the CPU: its dry run checks
every command against the CLI (options, families, backends, the gpu tests it selects) within the time
budget; the wheels it would install are only those whose version differs; its table reads real matrix
reports; a step cut at its limit is reported so and the next runs."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_session as g  # noqa: E402


def test_dry_run_checks_every_command_within_the_budget():
    got = subprocess.run([sys.executable, "benchmarks/gpu_session.py", "--dry-run"], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    assert "dry run: every command checked" in got.stdout
    assert sum(st.limit_s for st in g.steps()) <= g.BUDGET
    for needed in ("--backends cuda --precisions fp32,bf16", "--weights trained", "--backends eager,hf",
                   "--option device=cuda", "selftest --backend cuda", "pytest -q -m gpu"):
        assert needed in got.stdout, needed


def test_dry_run_catches_a_bad_command():
    assert g.check_command(["oracle", "matrix", "--backends", "eager", "--option", "device=gpu",
                            "--report-dir", "x"]) == ["eager: device=gpu is not one of ('cpu', 'cuda')"]
    assert g.check_command(["oracle", "matrix", "--backends", "cuda", "--option", "device=cuda",
                            "--report-dir", "x"]) == ["cuda has no option device"]
    assert g.check_command(["oracle", "selftest", "--backend", "cuda", "--family", "nosuch"]) == ["unknown family nosuch"]
    assert g.check_command(["pytest", "-q", "-m", "gpu", "-k", "nosuchtest", "tests/test_cuda.py"])


def test_only_wheels_of_another_version_are_installed(tmp_path):
    import importlib.metadata

    have = importlib.metadata.version("numpy")
    (tmp_path / f"numpy-{have}-cp311-cp311-manylinux_2_17_x86_64.whl").touch()  # already there: skipped
    (tmp_path / "transformers-0.0.1-py3-none-any.whl").touch()  # another version: installed
    (tmp_path / "nosuchpackage_x-1.0-py3-none-any.whl").touch()  # missing: installed
    got = {w.name: why for w, why in g.wheels_to_install(tmp_path)}
    assert sorted(got) == ["nosuchpackage_x-1.0-py3-none-any.whl", "transformers-0.0.1-py3-none-any.whl"]
    assert got["nosuchpackage_x-1.0-py3-none-any.whl"] == "nosuchpackage-x missing -> 1.0"


def test_the_table_reads_real_matrix_reports_and_a_cut_step(tmp_path):
    import os

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    got = subprocess.run([sys.executable, "-m", "oracle", "matrix", "--families", "olmoe", "--backends", "eager,hf",
                          "--precisions", "bf16", "--option", "device=cpu", "-j", "1", "--report-dir",
                          str(tmp_path / "controls")], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    rows = g.check_rows(tmp_path / "controls")
    assert sorted((r["backend"], r["status"]) for r in rows) == [("eager", "pass"), ("hf", "pass")]
    assert all(r["options"] == {"device": "cpu"} and r["worst_step_x_hf"] is not None for r in rows)
    (tmp_path / "logs").mkdir()
    cut = g.run_step(g.Step("cut", ["oracle", "matrix", "--families", "olmoe", "--backends", "eager", "--report-dir",
                                    "{out}/cut"], 1), tmp_path, env)
    assert cut["exit"] == "cut at 1 s" and cut["wall_s"] < 20
    machine = {"date": "2026-11-27", "gpu": "no GPU", "cores": 2, "torch": "t", "transformers": "x", "python": "3",
               "commit": "c"}
    md = g.table(tmp_path, {"controls": {"wall_s": 12.0, "exit": 0}, "cut": cut}, machine)
    line = next(x for x in md.splitlines() if x.startswith("| olmoe |"))
    assert "control eager bf16" in md and "control hf bf16" in md
    assert line.count("pass") == 2 and line.count("|") == 4  # family + the two controls (no cuda reports here)
    assert "| controls | 12.0 |" in md and "| cuda | - | 195 | not run |" in md


if __name__ == "__main__":
    pytest.main([__file__])
