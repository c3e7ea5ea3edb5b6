"""Python 3.11-3.13: every dependency pyproject.toml pins (==) has a wheel for CPython 3.12
and 3.13 on Linux x86_64, found in the package index without installing anything (pip's
dry-run resolver, binary wheels only, each pin on its own: torch's CUDA packages are the
index's business, not this project's). Needs the package index: skipped when it cannot be
reached, never passed without an answer."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "linux_x86_64"]


# pins published only as a source distribution: pip builds them on any Python (llama-cpp-python: llama.cpp
# with cmake and a C++ compiler, docs/llamacpp.md); test_source_only_pins_have_their_sdist checks they exist
SOURCE_ONLY = {"llama-cpp-python"}


def pins() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    out = []
    for r in reqs:
        req, _, marker = r.partition(";")
        if "==" in req and "darwin" not in marker:  # the Linux pins (mlx's macOS wheel is its own)
            out.append(re.sub(r"\s+", "", req))
    return sorted(set(out))


def test_requires_python_admits_3_12_and_3_13():
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert spec == ">=3.11,<3.14"


@pytest.mark.parametrize("version", ["3.12", "3.13"])
def test_every_pin_has_a_wheel(version, tmp_path):
    want = [p for p in pins() if re.split(r"[\[=]", p)[0].lower() not in SOURCE_ONLY]
    assert {"torch==2.13.0", "executorch==1.5.1", "mlx[cpu]==0.32.4"} <= set(want)
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed",
           "--only-binary=:all:", "--python-version", version, *[a for p in PLATFORMS for a in ("--platform", p)],
           "--target", str(tmp_path / "t"), "--report", str(tmp_path / "r.json"), "-q", *want]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode and re.search(r"connection|NewConnectionError|Temporary failure|Network is unreachable",
                                  p.stderr, re.I):
        pytest.skip(f"the package index cannot be reached: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr[-2000:]
    import json

    got = {i["metadata"]["name"].lower(): i["download_info"]["url"].rsplit("/", 1)[-1]
           for i in json.loads((tmp_path / "r.json").read_text())["install"]}
    for pin in want:
        name = re.split(r"[\[=]", pin)[0].lower()
        assert name in got, (pin, got)
        tag = version.replace(".", "")
        wheel = got[name]
        assert f"cp{tag}" in wheel or "py3-none" in wheel or "abi3" in wheel, wheel


def test_source_only_pins_have_their_sdist(tmp_path):
    """Each source-only pin is in the index as a source distribution (what pip builds for 3.12 and 3.13)."""
    want = [p for p in pins() if re.split(r"[\[=]", p)[0].lower() in SOURCE_ONLY]
    assert want == ["llama-cpp-python==0.3.36"]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary=:all:",
           "-d", str(tmp_path), "-q", *want]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode and re.search(r"connection|NewConnectionError|Temporary failure|Network is unreachable",
                                  p.stderr, re.I):
        pytest.skip(f"the package index cannot be reached: {p.stderr.strip().splitlines()[-1]}")
    assert p.returncode == 0, p.stderr[-2000:]
    assert [f.name for f in tmp_path.iterdir()] == ["llama_cpp_python-0.3.36.tar.gz"]
