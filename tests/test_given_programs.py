"""Bring your own program: a .vmfb / .pte written by `oracle export` and given back with
--vmfb / --pte passes; one exported for another sequence length or checkpoint, or without the
production exporter's functions, is bad input naming the fix."""

import os
import platform
import shutil

import pytest

from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.export import run_export


# The programs given back are the ones other test files build anyway (an export is the check's program, served
# from the cache): tiny Qwen2-MoE's IREE program at the check's default lengths (8 + 8: tests/test_iree.py's
# check), tiny Qwen3.5's portable ExecuTorch program at 6 + 4 (tests/test_executorch.py's qwen35_program). An
# OLMoE program of their own cost 53 s of a cold suite on 2 cores (issue 76's budget).
VMFB = dict(family="qwen2_moe")  # the check's default lengths
PTE = dict(family="qwen3_5_moe", prompt_len=6, decode_tokens=4)


def exported(tmp_path_factory, backend: str, runtime: str, name: str, spec: dict, **options):
    """`oracle export` of the program a check of `spec` runs."""
    pytest.importorskip(runtime)
    out = tmp_path_factory.mktemp(backend)
    s = CheckSpec(backend=backend, **spec)
    run_export(CheckSpec(backend=backend, **spec, options={"max_seq_len": s.prompt_len + s.decode_tokens, **options}),
               str(out))
    return out / name


@pytest.fixture(scope="module")
def vmfb(tmp_path_factory):
    return exported(tmp_path_factory, "iree-llvm-cpu", "iree.runtime", "model.vmfb", VMFB)


def test_exported_vmfb_given_back_passes(vmfb):
    r = run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", artifact=str(vmfb)))
    assert r.status == "pass", (r.worst, r.error)
    assert all(b.status == "pass" for b in r.blocks) and r.e2e.token_exact
    assert r.provenance["artifacts"][0]["name"] == "model.vmfb"


def test_vmfb_for_another_check_is_refused(vmfb, tmp_path):
    with pytest.raises(InputError, match="exported for a sequence of 16 tokens .* export with --max-seq-len 20"):
        run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", decode_tokens=12, artifact=str(vmfb)))
    with pytest.raises(InputError, match="exported from checkpoint sha256"):
        run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", seed=1, artifact=str(vmfb)))
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(vmfb, bare / "model.vmfb")  # no manifest, no weights
    with pytest.raises(InputError, match="no model.irpa beside it"):
        run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", artifact=str(bare / "model.vmfb")))
    shutil.copy(vmfb.with_name("model.irpa"), bare / "model.irpa")  # no manifest: the functions say it
    with pytest.raises(InputError, match="missing block_attention0_t6"):
        run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", prompt_len=6, decode_tokens=10,
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
    return exported(tmp_path_factory, "executorch", "executorch.runtime", "model.pte", PTE, partitioner="portable")


def test_exported_pte_given_back_passes_end_to_end(pte):
    r = run_check(CheckSpec(**PTE, backend="executorch", artifact=str(pte)))
    assert r.status == "pass", (r.worst, r.error)
    assert r.e2e.status == "pass" and r.e2e.token_exact
    # a production program has no taps or probes: its blocks are n/a, never pass
    assert r.blocks and all(b.status == "n/a" for b in r.blocks)


def test_pte_without_the_production_methods_is_refused(pte, tmp_path):
    with pytest.raises(InputError, match="exported for a sequence of 10 tokens"):
        run_check(CheckSpec(family="qwen3_5_moe", backend="executorch", prompt_len=6, decode_tokens=8,
                            artifact=str(pte)))
    junk = tmp_path / "junk.pte"
    junk.write_bytes(b"not a program")
    with pytest.raises(InputError, match=r"junk.pte: not an ExecuTorch program \(file identifier b'a pr', expected b'ET12'\)"):
        run_check(CheckSpec(**PTE, backend="executorch", artifact=str(junk)))


# ------------------------------------------------------------------ given programs, validated
def program_copy(src, tmp_path, name: str, data: bytes | None = None, beside=("model.ptd",)):
    """A copy of the program `src` (its `data` instead of its bytes when given) in a directory of
    its own, with the files `beside` it copied (its weights; no manifest unless named)."""
    d = tmp_path / name
    d.mkdir()
    for f in beside:
        shutil.copy(src.with_name(f), d / f)
    (d / src.name).write_bytes(src.read_bytes() if data is None else data)
    return d / src.name


def flipped(data: bytes, start: int, seed: int = 1) -> bytes:
    import random

    rng, out = random.Random(seed), bytearray(data)
    for _ in range(200):
        out[rng.randrange(start, len(out))] = rng.randrange(256)
    return bytes(out)


def test_random_bytes_as_pte_are_refused_not_an_abort(cli, tmp_path):
    """4 KiB of random bytes whose identifier is not UTF-8: the ExecuTorch runtime's log of it
    aborted the process (exit 134); now refused from its bytes, exit 2, the file named."""
    junk = tmp_path / "garbage.pte"
    junk.write_bytes(b"\x10\x00\x00\x00\x86\x87\xff\xfe" + os.urandom(4088))
    p = cli("check", "--family", "olmoe", "--backend", "executorch", "--pte", str(junk))
    assert p.returncode == 2, p.stderr
    assert p.stderr == (f"oracle: error: --pte {junk}: not an ExecuTorch program "
                        "(file identifier b'\\x86\\x87\\xff\\xfe', expected b'ET12')\n")


def test_a_runtime_abort_loading_a_program_is_contained():
    """The same bytes given to the runtime itself (past the byte checks): it aborts, in the
    child process that loads given programs, and that is an InputError naming the file."""
    from exporters.shared import given

    pytest.importorskip("executorch.runtime")
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        junk = Path(d) / "garbage.pte"
        junk.write_bytes(b"\x10\x00\x00\x00\x86\x87\xff\xfe" + bytes(4088))
        with pytest.raises(InputError, match=r"--pte .*garbage.pte: the ExecuTorch runtime crashed loading it "
                                             r"\(killed by SIGABRT.*not a program it can run"):
            given.probe("pte", "--pte", [junk], "the ExecuTorch runtime")


def test_damaged_pte_is_refused(pte, tmp_path):
    data = pte.read_bytes()
    cut = program_copy(pte, tmp_path, "cut", data[: len(data) // 2])
    with pytest.raises(InputError, match=rf"--pte {cut}: truncated or corrupt: its header declares {len(data)} "
                                         rf"bytes, the file has {len(data) // 2}"):
        run_check(CheckSpec(**PTE, backend="executorch", artifact=str(cut)))
    body = program_copy(pte, tmp_path, "body", flipped(data, 64))
    with pytest.raises(InputError, match=r"--pte .*body/model.pte: the ExecuTorch runtime cannot load it "
                                         r"\(\[program.cpp:\d+\] Verification failed"):
        run_check(CheckSpec(**PTE, backend="executorch", artifact=str(body)))
    weights = program_copy(pte, tmp_path, "weights", beside=())
    ptd = pte.with_name("model.ptd").read_bytes()
    weights.with_name("model.ptd").write_bytes(ptd[:1000])
    with pytest.raises(InputError, match=r"model.pte: its weights .*model.ptd: truncated or corrupt"):
        run_check(CheckSpec(**PTE, backend="executorch", artifact=str(weights)))


def test_pte_of_another_family_is_refused(pte, tmp_path):
    # with the manifest `oracle export` wrote beside it: the family it names
    with pytest.raises(InputError, match=r"model.pte was exported for family 'qwen3_5_moe' \(.*manifest.json\), "
                                         r"not 'qwen3_moe': a program of another model"):
        run_check(CheckSpec(family="qwen3_moe", backend="executorch", prompt_len=6, decode_tokens=4, artifact=str(pte)))
    # without: the program's own constant methods (depth, vocabulary)
    bare = program_copy(pte, tmp_path, "bare")
    with pytest.raises(InputError, match=r"was built for a model of 4 decoder layers \(its get_n_layers\); this "
                                         r"check's olmoe model has 2: a program of another model"):
        run_check(CheckSpec(family="olmoe", backend="executorch", prompt_len=6, decode_tokens=4, artifact=str(bare)))


def test_damaged_vmfb_is_refused(vmfb, tmp_path):
    junk = program_copy(vmfb, tmp_path, "junk", os.urandom(4096), beside=("model.irpa",))
    with pytest.raises(InputError, match=rf"--vmfb {junk}: not an IREE module"):
        run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", artifact=str(junk)))
    data = vmfb.read_bytes()
    for name, damaged in (("cut", data[: len(data) // 2]), ("body", flipped(data, 200))):
        bad = program_copy(vmfb, tmp_path, name, damaged, beside=("model.irpa",))
        # the runtime's verifier refuses it, or (a flipped byte inside the llvm-cpu target's record, read
        # before loading) the record is no CPU's: a damaged file named so either way, never "another CPU"
        with pytest.raises(InputError, match=rf"--vmfb {bad}: (the IREE runtime cannot load it \(ValueError: .*"
                                             "INVALID_ARGUMENT|damaged: its llvm-cpu target record)"):
            run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", artifact=str(bad)))
    # one letter of a feature the program enables changed to a name of the same length, as a flipped byte does
    # (seen here: wbnoinvd read as wbnoinv5, which was "features this host's CPU lacks"): no feature LLVM knows
    from exporters.shared import given

    feature = sorted(given.llvm_cpu_targets(data)[0][2])[0]
    at = data.index(b"+" + feature.encode() + b",")
    edited = data[:at + len(feature)] + b"5" + data[at + len(feature) + 1:]
    bad = program_copy(vmfb, tmp_path, "letter", edited, beside=("model.irpa",))
    assert given.cpu_problem(bad).startswith(f"damaged: its llvm-cpu target record names no CPU feature that exists "
                                             f"('{feature[:-1]}5')")


def test_vmfb_compiled_for_another_cpu_is_refused(vmfb, tmp_path):
    """An llvm-cpu program is compiled for a CPU (exporters/iree/: the host's): one compiled
    for another architecture, or with features this CPU lacks, is refused with the reason."""
    from iree.compiler import compile_str

    from exporters.shared import given

    other = "x86_64-unknown-linux-gnu" if platform.machine() in ("aarch64", "arm64") else "aarch64-unknown-linux-gnu"
    module = compile_str(given._TRIVIAL, extra_args=["--iree-hal-target-device=local",
                                                     "--iree-hal-local-target-device-backends=llvm-cpu",
                                                     f"--iree-llvmcpu-target-triple={other}"])
    foreign = program_copy(vmfb, tmp_path, "foreign", module, beside=("model.irpa",))
    with pytest.raises(InputError, match=rf"--vmfb {foreign}: compiled for embedded-elf-\w+ .*, this host runs "
                                         r"embedded-elf-\w+: compile it here"):
        run_check(CheckSpec(**VMFB, backend="iree-llvm-cpu", artifact=str(foreign)))
    # features: the program's against those iree-compile chooses for this host
    fmt, cpu, features, names = given.host_llvm_target(known=True)
    assert features < names  # the host's record names the features it lacks too
    assert given.cpu_problem(vmfb) is None  # exported here: for this host
    fewer = lambda known=False: (fmt, "smallcpu", frozenset(sorted(features)[:3])) + ((names,) if known else ())  # noqa: E731
    import unittest.mock

    with unittest.mock.patch.object(given, "host_llvm_target", fewer):
        problem = given.cpu_problem(vmfb)
    assert problem.startswith(f"compiled for CPU {cpu}, with features this host's CPU (smallcpu) lacks: ")


def _edit_in_file(path, original: "np.ndarray", edited: "np.ndarray") -> None:
    """Overwrite the bytes of `original` where the file holds them with `edited` (a converter's defect)."""
    data = bytearray(path.read_bytes())
    at = data.find(original.tobytes())
    assert at >= 0, "the original tensor's bytes are not in the file"
    data[at:at + original.nbytes] = edited.tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("which", ["vmfb", "pte"])
def test_a_given_programs_weights_file_is_checked_tensor_by_tensor(which, request, tmp_path):
    """The weights a --vmfb's .irpa / a --pte's .ptd carry: every production parameter within half an ulp of
    the original (an fp32 file: exactly); one expert's down projection 1 % off fails naming tensor and expert."""
    import numpy as np

    from oracle.source.sources import model_source

    program = request.getfixturevalue(which)
    backend = {"vmfb": "iree-llvm-cpu", "pte": "executorch"}[which]
    spec = CheckSpec(**{"vmfb": VMFB, "pte": PTE}[which], backend=backend, artifact=str(program))
    w = run_check(spec).quantization["weights"]
    assert w["status"] == "pass" and w["tensors"] >= 20 and w["failed"] == 0, w
    bad = tmp_path / "bad"
    shutil.copytree(program.parent, bad)
    src = model_source(spec)
    name = "layers.1.mlp.experts.down_proj"
    x = next(g[name] for g in src.family.production_tensors(src.model_dir, src.args) if name in g).float().numpy()
    y = x.copy()
    y[2] *= np.float32(1.01)
    _edit_in_file(bad / ("model.irpa" if which == "vmfb" else "model.ptd"), x, y)
    r = run_check(CheckSpec(**{"vmfb": VMFB, "pte": PTE}[which], backend=backend, artifact=str(bad / program.name)))
    w = r.quantization["weights"]
    assert r.status == "fail" and w["failed"] == 1 and w["worst"]["name"] == name, w
    assert w["worst"]["where"].startswith("expert 2")
