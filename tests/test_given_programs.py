"""Bring your own program: a .vmfb / .pte written by `oracle export` and given back with
--vmfb / --pte passes; one exported for another sequence length or checkpoint, or without the
production exporter's functions, is bad input naming the fix."""

import shutil

import pytest

from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.export import run_export


def exported(tmp_path_factory, backend: str, runtime: str, name: str, **options):
    """`oracle export` of tiny OLMoE for the check's default lengths (8 + 8)."""
    pytest.importorskip(runtime)
    out = tmp_path_factory.mktemp(backend)
    run_export(CheckSpec(family="olmoe", backend=backend, prompt_len=8, decode_tokens=8,
                         options={"max_seq_len": 16, **options}), str(out))
    return out / name


@pytest.fixture(scope="module")
def vmfb(tmp_path_factory):
    return exported(tmp_path_factory, "iree-llvm-cpu", "iree.runtime", "model.vmfb")


def test_exported_vmfb_given_back_passes(vmfb):
    r = run_check(CheckSpec(family="olmoe", backend="iree-llvm-cpu", artifact=str(vmfb)))
    assert r.status == "pass", (r.worst, r.error)
    assert all(b.status == "pass" for b in r.blocks) and r.e2e.token_exact
    assert r.provenance["artifacts"][0]["name"] == "model.vmfb"


def test_vmfb_for_another_check_is_refused(vmfb, tmp_path):
    with pytest.raises(InputError, match="exported for a sequence of 16 tokens .* export with --max-seq-len 20"):
        run_check(CheckSpec(family="olmoe", backend="iree-llvm-cpu", decode_tokens=12, artifact=str(vmfb)))
    with pytest.raises(InputError, match="exported from checkpoint sha256"):
        run_check(CheckSpec(family="olmoe", backend="iree-llvm-cpu", seed=1, artifact=str(vmfb)))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(vmfb, bare / "model.vmfb")  # no manifest, no weights
    with pytest.raises(InputError, match="no model.irpa beside it"):
        run_check(CheckSpec(family="olmoe", backend="iree-llvm-cpu", artifact=str(bare / "model.vmfb")))
    shutil.copy(vmfb.with_name("model.irpa"), bare / "model.irpa")  # no manifest: the functions say it
    with pytest.raises(InputError, match="missing block_attention0_t6"):
        run_check(CheckSpec(family="olmoe", backend="iree-llvm-cpu", prompt_len=6, decode_tokens=10,
                            artifact=str(bare / "model.vmfb")))


def test_a_program_for_the_wrong_backend_is_refused(cli, vmfb):
    p = cli("check", "--family", "olmoe", "--backend", "eager", "--vmfb", str(vmfb))
    assert p.returncode == 2 and "runs no prebuilt program" in p.stderr
    p = cli("check", "--family", "olmoe", "--backend", "iree-llvm-cpu", "--vmfb", str(vmfb) + ".missing")
    assert p.returncode == 2


@pytest.fixture(scope="module")
def pte(tmp_path_factory):
    # portable kernels: lowered in a quarter of XNNPACK's time; what is tested is the --pte path
    # (a given program's methods, manifest and weights), and XNNPACK's lowering has its own tests
    return exported(tmp_path_factory, "executorch", "executorch.runtime", "model.pte", partitioner="portable")


def test_exported_pte_given_back_passes_end_to_end(pte):
    r = run_check(CheckSpec(family="olmoe", backend="executorch", artifact=str(pte)))
    assert r.status == "pass", (r.worst, r.error)
    assert r.e2e.status == "pass" and r.e2e.token_exact
    # a production program has no taps or probes: its blocks are n/a, never pass
    assert r.blocks and all(b.status == "n/a" for b in r.blocks)


def test_pte_without_the_production_methods_is_refused(pte, tmp_path):
    with pytest.raises(InputError, match="exported for a sequence of 16 tokens"):
        run_check(CheckSpec(family="olmoe", backend="executorch", decode_tokens=4, artifact=str(pte)))
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program")
    with pytest.raises(InputError, match="the ExecuTorch runtime cannot load it"):
        run_check(CheckSpec(family="olmoe", backend="executorch", artifact=str(junk)))
