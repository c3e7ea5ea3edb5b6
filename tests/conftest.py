import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# tiny checkpoints and compiled artifacts: a cache inside the checkout unless one is given
os.environ.setdefault("MOE_ORACLE_CACHE", str(ROOT / ".cache" / "moe-oracle"))
# Inductor's compiled kernels (the cuda backend's tests on the CPU) beside it, not in the host's /tmp: a
# fresh clone's suite is cold for them too, and a warm one finds them (measured, docs/benchmarks.md)
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(os.environ["MOE_ORACLE_CACHE"]).parent / "torchinductor"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# parallel workers (make test: pytest-xdist) share the cores: idle OpenMP threads sleep instead
# of spinning on a core another worker needs (thread counts, and so the numbers, unchanged;
# OMP_NUM_THREADS=1 would change them)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def run_cli(*args, cwd=ROOT, env=None):
    """`oracle ...` in a process of its own (exit codes and stdout/stderr as a user sees them):
    forked from a warm server that did the imports once (tests/cli_server.py), else a subprocess."""
    from tests import cli_server

    e = {**os.environ, **(env or {})}
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), e.get("PYTHONPATH")]))
    warm = cli_server.run(args, cwd, e, timeout=900)
    if warm is not None:
        return warm
    return subprocess.run([sys.executable, "-m", "oracle.cli", *args], cwd=cwd, env=e,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="session")
def cli():
    return run_cli


# the longest test files, longest first (a fresh clone's `make test`, every cache cold, 2026-11-29:
# docs/benchmarks.md): `make test` hands whole files to its two workers in collection order
# (--dist loadfile --no-loadscope-reorder), so these go first and the short ones fill in at the end
# (longest processing time first), instead of pytest-xdist's order by number of tests per file, which can
# leave a long file of few tests (test_drill.py, test_installed.py) to the end for one worker alone
LONGEST_FIRST = ("test_executorch.py", "test_executorch_mlx.py", "test_cuda.py", "test_drill.py",
                 "test_reference.py", "test_faults.py", "test_matrix.py", "test_baselines.py", "test_selftest.py",
                 "test_conversion.py", "test_given_programs.py", "test_installed.py", "test_llamacpp.py",
                 "test_mlx.py", "test_iree_params.py")


def open_reason(item) -> str | None:
    """Why this case is an open expected failure (tests/depth.py OPEN, keyed file::name[id]), or None."""
    from tests.depth import OPEN

    return OPEN.get(f"{item.path.name}::{item.name}")


def deep_key(item) -> str | None:
    """The key of tests/depth.py's DEEP that names this test: the case (file::name[id]) or the whole test."""
    from tests.depth import DEEP

    case = f"{item.path.name}::{item.name}"
    whole = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
    return case if case in DEEP else whole if whole in DEEP else None


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's order is kept
    for item in items:  # the deep tier (tests/depth.py): `make test` deselects it, `make test-deep` runs it
        if deep_key(item) is not None:
            item.add_marker(pytest.mark.deep)
        if (why := open_reason(item)) is not None:  # (tests/depth.py OPEN)
            item.add_marker(pytest.mark.xfail(reason=f"open: {why}", strict=True))


def warm_check_imports(family: str, backend: str, *modules: str) -> list[bool]:
    """`oracle check` run twice in fresh interpreters (the first fills the caches): whether each
    of `modules` was imported by the second, the warm one (its exit status must be 0)."""
    code = ("import sys; from oracle.cli import main; "
            f"rc = main(['check', '--family', {family!r}, '--backend', {backend!r}]); "
            f"print(rc, *(m in sys.modules for m in {list(modules)!r}))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1].split()
    assert last[0] == "0", r.stdout[-2000:]
    return [v == "True" for v in last[1:]]

# hypothesis: the properties are what is tested, not how fast examples are drawn; on a loaded
# 2-core CI machine (parallel workers, compilers) drawing them can exceed its time health check
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

import logging  # noqa: E402

import torch  # noqa: E402,F401

for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)

