"""`oracle reference save` / `oracle check --reference DIR`: a reference captured once, moved to
another directory, gives the same report bytes as the in-process one (bar timings and cache);
a reference that is not this check's is refused before any work."""

import json
import shutil

import pytest

from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.reference.cached import save_reference


def _report(path):
    doc = json.loads(path.read_text())
    doc.pop("timings"), doc.pop("cache")
    return doc


def test_saved_and_moved_reference_gives_the_same_report(cli, tmp_path):
    p = cli("reference", "save", "--family", "mixtral", "--out", str(tmp_path / "ref"))
    assert p.returncode == 0, p.stderr
    shutil.move(tmp_path / "ref", tmp_path / "elsewhere")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    p = cli("check", "--family", "mixtral", "--backend", "eager", "--reference", str(tmp_path / "elsewhere"),
            "--json", str(a))
    assert p.returncode == 0, p.stderr
    assert json.loads(a.read_text())["cache"]["reference"] == str(tmp_path / "elsewhere")
    p = cli("check", "--family", "mixtral", "--backend", "eager", "--json", str(b))
    assert p.returncode == 0, p.stderr
    assert a.read_bytes() != b.read_bytes() and _report(a) == _report(b)


def test_a_reference_that_is_not_this_checks_is_refused(tmp_path):
    save_reference(CheckSpec(family="olmoe", backend="hf"), str(tmp_path / "ref"))
    ref = str(tmp_path / "ref")
    with pytest.raises(InputError, match="captured with seed 0, this check has 1"):
        run_check(CheckSpec(family="olmoe", backend="eager", seed=1, reference=ref))
    with pytest.raises(InputError, match="captured with decode-tokens 8, this check has 4"):
        run_check(CheckSpec(family="olmoe", backend="eager", decode_tokens=4, reference=ref))
    # same family and lengths, another checkpoint: refused by its sha256
    other = tmp_path / "other"
    shutil.copytree(tmp_path / "ref", other)
    meta = json.loads((other / "provenance.json").read_text())
    meta["checkpoint_sha256"] = "0" * 64
    (other / "provenance.json").write_text(json.dumps(meta))
    with pytest.raises(InputError, match="captured from checkpoint sha256 0000000000000000"):
        run_check(CheckSpec(family="olmoe", backend="eager", reference=str(other)))
    (other / "reference.safetensors").unlink()
    with pytest.raises(InputError, match="not a saved reference .missing reference.safetensors"):
        run_check(CheckSpec(family="olmoe", backend="eager", reference=str(other)))


def test_reference_save_does_not_replace_another_directory(cli, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    p = cli("reference", "save", "--family", "olmoe", "--out", str(tmp_path / "mine"))
    assert p.returncode == 2 and "is not a saved reference" in p.stderr
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
