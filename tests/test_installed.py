"""The installed package works like the checkout: a wheel built from this tree, installed with
no dependencies (this environment has them) into a temporary directory, and the `oracle` it
installs run from a directory outside the checkout with only that directory importable. Each
command must answer as the checkout's does (exit code and output), and every data file under
the packages must be in the wheel."""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.conftest import ROOT, run_cli

PACKAGES = ("oracle", "models", "exporters", "goldens")
CONFIG = ["--config", "olmoe-1b-7b-0924", "--layers", "1"]  # the smallest published MoE config
# a short check of it (what is tested is that the installed package finds and reads the published config; the
# default 8 + 8 tokens at its real width took 26 s cold, this 14 s, on 2 cores: issue 76's budget)
SHORT = ["--prompt-len", "4", "--decode-tokens", "2"]


def run_installed(target: Path, cwd: Path, *args, program=None):
    """`oracle ...` as installed into `target` (its console script), run in `cwd`; PYTHONPATH is
    the target alone and MOE_ORACLE_GOLDENS is unset, so nothing comes from the checkout. The
    cache (MOE_ORACLE_CACHE, tests/conftest.py) is the suite's: its entries are keyed by content
    (config, seed, code bytes), the same in the wheel, so the installed check reuses the
    checkpoint and reference the checkout's built: what is tested here is the packaging."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MOE_ORACLE_GOLDENS")}
    env["PYTHONPATH"] = str(target)
    argv = [str(target / "bin" / "oracle"), *args] if program is None else [sys.executable, "-c", program]
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(wheel, target, source copy, working directory), built once for this file."""
    tmp = tmp_path_factory.mktemp("installed")
    # built from a copy of the tree, as a clean clone would be: setuptools builds inside the source
    # (build/, *.egg-info), which another test process building a wheel at the same time would race,
    # and a stale build/lib would add files the tree no longer has
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "reports"))
    # no build isolation: offline, with this environment's setuptools (the `test` extra pins it)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next((tmp / "dist").glob("moe_oracle-*.whl"))
    target = tmp / "target"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                        "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    cwd = tmp / "elsewhere"  # outside the checkout: nothing found relative to the working directory
    cwd.mkdir()
    assert ROOT not in cwd.parents and ROOT not in target.parents
    return wheel, target, src, cwd


def test_every_data_file_is_in_the_wheel(installed):
    """Every file under the packages that is not Python source is run-time data (configs, goldens,
    thresholds, ...): pyproject.toml's package-data must ship it."""
    wheel, _, src, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    data = sorted(str(p.relative_to(src)) for pkg in PACKAGES for p in (src / pkg).rglob("*")
                  if p.is_file() and p.suffix not in (".py", ".pyc"))
    assert "models/configs/olmoe-1b-7b-0924.json" in data and "oracle/verdict/thresholds.toml" in data
    assert not set(data) - names, f"not in the wheel: {sorted(set(data) - names)}"


def test_imports_come_from_the_install(installed):
    _, target, _, cwd = installed
    r = run_installed(target, cwd, program=(
        "import json, oracle, models, exporters; from oracle.verdict import goldens, thresholds; "
        "from oracle.source.published import CONFIGS_DIR; "
        "print(json.dumps([oracle.__file__, models.__file__, exporters.__file__, str(goldens.root()), "
        "str(thresholds.DEFAULT_PATH), str(CONFIGS_DIR)]))"))
    assert r.returncode == 0, r.stderr
    for path in json.loads(r.stdout):
        assert Path(path).resolve().is_relative_to(target.resolve()), path


@pytest.mark.parametrize("args", [["--version"], ["families"]], ids=["version", "families"])
def test_same_answer(installed, args):
    _, target, _, cwd = installed
    got, want = run_installed(target, cwd, *args), run_cli(*args)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout) == (0, want.stdout), got.stderr
    if args == ["families"]:
        assert "olmoe-1b-7b-0924" in got.stdout  # the published configs were found


def test_check_on_a_published_config(installed, tmp_path):
    """The issue's command: the published config is read from the installed package."""
    _, target, _, cwd = installed
    want = run_cli("check", *CONFIG, *SHORT, "--backend", "eager", "--json", str(tmp_path / "checkout.json"))
    got = run_installed(target, cwd, "check", *CONFIG, *SHORT, "--backend", "eager", "--json",
                        str(tmp_path / "installed.json"))
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout) == (0, want.stdout), got.stderr[-2000:]
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("checkout.json", "installed.json"))
    for key in ("status", "spec", "blocks", "e2e", "gates"):  # the numbers; not timings, host, paths
        assert a[key] == b[key], key


def test_goldens_check(installed):
    _, target, _, cwd = installed
    args = ("goldens", "check", "--family", "olmoe", "--backend", "eager")
    got, want = run_installed(target, cwd, *args), run_cli(*args)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout) == (0, want.stdout), got.stderr[-2000:]
    assert "golden_tokens pass" in got.stdout  # the goldens were found, not "none applied"


def test_report_diff(installed, tmp_path):
    _, target, _, cwd = installed
    from oracle.reports.summary import SCHEMA

    def summary(name, status, ratio):
        row = {"id": "olmoe__eager__fp32", "family": "olmoe", "backend": "eager", "precision": "fp32",
               "status": status, "reason": None if status == "pass" else "e2e failed",
               "blocks": {"layer 0 moe": ratio}}
        (tmp_path / name).write_text(json.dumps({"schema": SCHEMA, "rows": [row]}))
        return str(tmp_path / name)

    args = ("report", "diff", "--baseline", summary("base.json", "pass", 0.01),
            "--current", summary("cur.json", "fail", 0.5))
    got, want = run_installed(target, cwd, *args), run_cli(*args)
    assert (got.returncode, got.stdout) == (want.returncode, want.stdout) == (1, want.stdout), got.stderr
    assert "regressions" in got.stdout and "layer 0 moe" in got.stdout


def test_missing_configs_say_where_they_were_looked_for(installed, tmp_path):
    """An install without the configs (the defect this file guards against) names the directory
    it searched instead of an empty list."""
    _, target, _, cwd = installed
    broken = tmp_path / "target"
    shutil.copytree(target, broken, ignore=shutil.ignore_patterns("configs"))
    configs = broken / "models" / "configs"
    r = run_installed(broken, cwd, "check", *CONFIG, "--backend", "eager")
    assert r.returncode == 2 and f"known: none (no *.json in {configs})" in r.stderr, r.stderr
    r = run_installed(broken, cwd, "families")
    assert r.returncode == 0 and f"none (no *.json in {configs})" in r.stdout, r.stdout
