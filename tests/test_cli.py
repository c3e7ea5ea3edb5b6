"""The command line as a user meets it: exit codes, messages, nothing half-written."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from models import get_family
from models.checkpoint import tiny_checkpoint


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


@pytest.mark.parametrize("args,needle", [
    (["--family", "llama"], "unknown family 'llama'; known: qwen3_5_moe"),
    (["--family", "deepseek_v3"], "multi-head latent attention"),
    (["--family", "gpt_oss"], "attention sinks"),
    (["--family", "olmoe", "--prompt-len", "0"], "must be a positive integer"),
    (["--family", "olmoe", "--decode-tokens", "-3"], "must be a positive integer"),
    (["--family", "olmoe", "--backend", "nosuch"], "unknown backend 'nosuch'"),
    (["--family", "olmoe", "--backend", "no_such_pkg.mod:BACKEND"], "cannot import module 'no_such_pkg.mod'"),
    (["--family", "olmoe", "--backend", "examples.fp64_backend:NOPE"], "has no attribute 'NOPE'"),
    (["--family", "olmoe", "--precision", "fp8"], "unknown precision 'fp8'"),
])
def test_bad_input_exit_2(cli, tmp_path, args, needle):
    if "--backend" not in args:
        args = args + ["--backend", "eager"]
    j = tmp_path / "r.json"
    r = cli("check", *args, "--json", str(j))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert needle in r.stderr
    assert not j.exists()  # nothing half-written
    assert "Traceback" not in r.stderr


@pytest.fixture()
def tiny_copy(tmp_path):
    src = tiny_checkpoint(get_family("olmoe"), 0)
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _bad_dir(cli, tmp_path, model_dir, family="olmoe"):
    j = tmp_path / "r.json"
    r = cli("check", "--family", family, "--backend", "eager", "--model-dir", str(model_dir), "--json", str(j))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert not j.exists() and "Traceback" not in r.stderr
    return r.stderr


def test_model_dir_ok(cli, tiny_copy, tmp_path):
    r = cli("check", "--family", "olmoe", "--backend", "eager", "--model-dir", str(tiny_copy))
    assert r.returncode == 0, r.stderr


def test_model_dir_missing_config(cli, tiny_copy, tmp_path):
    (tiny_copy / "config.json").unlink()
    assert "no config.json" in _bad_dir(cli, tmp_path, tiny_copy)


def test_model_dir_other_family(cli, tiny_copy, tmp_path):
    assert "model_type 'olmoe', not a mixtral checkpoint (that is family 'olmoe')" in _bad_dir(
        cli, tmp_path, tiny_copy, family="mixtral")


def test_model_dir_truncated_shard(cli, tiny_copy, tmp_path):
    shard = tiny_copy / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    assert "truncated or corrupt" in _bad_dir(cli, tmp_path, tiny_copy)


def test_model_dir_missing_shard(cli, tiny_copy, tmp_path):
    shard = tiny_copy / "model.safetensors"
    shard.rename(tiny_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                             "b": "model-00002-of-00002.safetensors"}}
    (tiny_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    assert "missing: model-00002-of-00002.safetensors" in _bad_dir(cli, tmp_path, tiny_copy)


def test_model_dir_pickles_refused(cli, tiny_copy, tmp_path):
    (tiny_copy / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, tiny_copy / "pytorch_model.bin")
    assert "refused, safetensors only" in _bad_dir(cli, tmp_path, tiny_copy)


def test_model_dir_missing_tensor_named(cli, tiny_copy, tmp_path):
    from safetensors.torch import load_file

    w = load_file(tiny_copy / "model.safetensors")
    del w["model.layers.1.self_attn.k_norm.weight"]
    save_file(w, tiny_copy / "model.safetensors", metadata={"format": "pt"})
    err = _bad_dir(cli, tmp_path, tiny_copy)
    assert "layers.1.self_attn.k_norm.weight" in err


def test_model_dir_misshaped_tensor_named(cli, tiny_copy, tmp_path):
    from safetensors.torch import load_file

    w = load_file(tiny_copy / "model.safetensors")
    w["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(w, tiny_copy / "model.safetensors", metadata={"format": "pt"})
    err = _bad_dir(cli, tmp_path, tiny_copy)
    assert "o_proj.weight" in err and "(64, 32)" in err


def test_plugin_backend(cli, tmp_path):
    j = tmp_path / "r.json"
    r = cli("check", "--family", "qwen2_moe", "--backend", "examples.fp64_backend:BACKEND", "--json", str(j))
    assert r.returncode == 0, r.stderr
    doc = json.loads(j.read_text())
    assert doc["provenance"]["backend"]["executor"] == "torch eager, float64"
    assert doc["e2e"]["token_exact"]


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
