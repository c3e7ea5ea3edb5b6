"""`iree-llvm-cpu` with its weights outside the program, as a real IREE deployment runs:
model.vmfb refers to named parameters (`#flow.parameter.named<"model"::name>`) and model.irpa,
an IREE parameter archive beside it, holds every parameter of the production model.

The qwen2_moe program here is the one tests/test_iree.py's checks build (same spec, same cache
key): nothing is compiled when those ran first. The one compile of its own, the same model with
its parameters inlined (how the program was built before the archive), is cached as well."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("iree.runtime", reason="iree is not installed (pip install 'moe-oracle[iree]')")
pytest.importorskip("iree.turbine.aot", reason="iree-turbine is not installed (pip install 'moe-oracle[iree]')")

import iree.runtime as rt  # noqa: E402

import exporters.iree.candidate as iree_backend  # noqa: E402
import exporters.iree.export as iree_export  # noqa: E402
from exporters.shared.identity import production_structure, program_identity  # noqa: E402
from exporters.iree.backend import BACKEND  # noqa: E402
from exporters.iree.program import PARAM_SCOPE, PARAMS_FILE, PARAMS_INFO
from models.args import STATE_BUFFERS  # noqa: E402
from oracle.verdict import goldens  # noqa: E402
from oracle.cache.artifacts import cached_artifact, sha256_file  # noqa: E402
from oracle.backend import CheckSpec  # noqa: E402
from oracle.source.sources import model_source

NAME = "iree-llvm-cpu"
SPEC = CheckSpec(family="qwen2_moe", backend=NAME)  # test_iree.py's qwen2_moe check: its cached program


@pytest.fixture(scope="module")
def built():
    """(model source, IreeBackend.program's Built, the fp32 production model)."""
    src = model_source(SPEC)
    return src, BACKEND.program(src, SPEC), src.build_production(torch.float32)


def _context(vmfb: bytes, irpa: Path | None):
    """A deployment's context: the archive through an io_parameters module, then the program."""
    config = rt.Config("local-task")
    modules = []
    if irpa is not None:
        index = rt.ParameterIndex()
        index.load(str(irpa))
        modules.append(rt.create_io_parameters_module(config.vm_instance, index.create_provider(scope=PARAM_SCOPE)))
    modules.append(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return rt.SystemContext(vm_modules=modules, config=config).modules.module


class _Calls:
    """prefill/decode of a bare program's context, called as IreeCandidate calls them."""

    def __init__(self, module):
        self.module = module

    def prefill(self, tokens):
        T = len(tokens)
        return _logits(self.module.prefill(np.array([tokens], np.int64), np.arange(T, dtype=np.int64)))[0].copy()

    def decode(self, token, pos):
        return _logits(self.module.decode(np.array([[token]], np.int64), np.array([pos], np.int64)))[0, -1].copy()


def _logits(results):
    """The logits of a prefill/decode call: its first result (each sparse layer's chosen experts follow)."""
    return (results[0] if isinstance(results, (list, tuple)) else results).to_host()


def _greedy(model, prompt, steps):
    """Logits of a prefill and `steps` greedy decodes (what the check's e2e runs), and the tokens."""
    logits = [model.prefill(prompt)]
    tokens = [int(logits[0][-1].argmax())]
    for i in range(steps):
        logits.append(model.decode(tokens[-1], len(prompt) + i))
        tokens.append(int(logits[-1].argmax()))
    return logits, tokens


def test_vmfb_holds_no_weight_data(built):
    _, b, model = built
    vmfb = b.vmfb.read_bytes()
    params = dict(model.named_parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params.values())
    assert len(vmfb) < weight_bytes  # 235 KiB of code for 724 KiB of fp32 weights
    assert b.irpa.stat().st_size >= weight_bytes
    # the first 16 values (64 bytes) of each parameter are nowhere in the program: random values,
    # so unique; a constant-filled one (an all-ones norm) would prove nothing and is skipped
    probes = 0
    for name, p in params.items():
        head = p.detach().reshape(-1)[:16]
        if head.numel() < 16 or len(set(head.tolist())) < 8:
            continue
        assert head.numpy().tobytes() not in vmfb, f"{name}'s values are inlined in model.vmfb"
        probes += 1
    assert probes >= len(params) // 2, probes


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().view(torch.uint8).numpy().tobytes()


def test_archive_holds_every_parameter(built):
    from iree.turbine.aot import ParameterArchive

    _, b, model = built
    irpa = b.irpa
    entries = ParameterArchive(irpa).items()
    names = [k for k, _ in entries]
    params = dict(model.named_parameters())
    assert sorted(names) == sorted(params)  # each once, and no buffer: no state, no derived constant
    assert not [n for n in names if n.rsplit(".", 1)[-1] in STATE_BUFFERS]
    for name, entry in entries:
        got, want = entry.as_tensor(), params[name].detach()
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert _bytes(got) == _bytes(want), name
    info = json.loads(b.irpa.with_name(PARAMS_INFO).read_text())
    assert info["sha256"] == sha256_file(irpa) and info["tensors"] == len(params) and info["scope"] == PARAM_SCOPE


def test_cached_check_reads_no_weights_and_blocks_read_the_archive(built, monkeypatch):
    """A cache hit builds the model's structure only (never build_production: no weight is read)
    and the block programs' parameter inputs are the archive's own mapped bytes: read-only views
    at the very addresses the runtime's index maps, equal to the production model's parameters."""
    src, _, model = built

    def no_weights(*a, **k):
        raise AssertionError("the production model's weights were read on a cache hit")

    monkeypatch.setattr(type(src), "build_production", no_weights)
    b = BACKEND.program(src, SPEC)
    assert b.art.cached
    cand = BACKEND.load(src, SPEC)
    params = dict(model.named_parameters())
    views = {k: rt.parameter_index_entry_as_numpy_ndarray(e) for k, e in cand.index.items()}
    used = set()
    for key, (p, inputs, _) in b.which.items():
        weights = cand.which[key][1]
        assert len(weights) == len(inputs) == len(p.weights), key
        for name, x, w in zip(p.weights, inputs, weights):
            if isinstance(x, str):  # a parameter: its name in the archive
                assert x.endswith(name.removeprefix("m.")), (key, name, x)
                assert w.ctypes.data == views[x].ctypes.data and not w.flags.writeable, (key, x)
                assert w.tobytes() == _bytes(params[x]), (key, x)
                used.add(x)
            else:  # a buffer that is not a parameter (RoPE inv_freq, cache_pos): from the structure
                assert name.rsplit(".", 1)[-1] in ("inv_freq", "cache_pos"), (key, name)
    assert used == set(params) - {"embed_tokens.weight"}  # every block parameter (the embedding is no block)


def test_program_needs_the_archive(built):
    """Without the io_parameters module the program does not load: never run without weights."""
    _, b, _ = built
    with pytest.raises(Exception, match="io_parameters"):
        _context(b.vmfb.read_bytes(), None)


def test_numbers_equal_the_inlined_program(built):
    """The same model with its parameters inlined into the program (how it was built before the
    archive): prefill + 8 greedy decodes give identical logits, and the golden tokens."""
    src, b, _ = built
    m = src.build_production(torch.float32)
    key = {k: v for k, v in BACKEND.key(src, SPEC, {}).items() if k != "parameters"}
    key["weights"] = "inlined, prefill/decode only (tests/test_iree_params.py)"
    key["checkpoint"] = src.checkpoint_sha256  # the program's own key names none: these weights are in it
    inlined = cached_artifact("iree", key, "model.vmfb", lambda path: iree_export.compile_to(
        iree_export.export_program(m, {}, SPEC.prompt_len, external=False), path))
    inlined_vmfb = Path(inlined.path).read_bytes()
    assert len(inlined_vmfb) > b.irpa.stat().st_size  # the weights are in there

    golden = json.loads((goldens.golden_dir(SPEC.family, NAME) / "tokens.json").read_text())
    prompt, steps = golden["prompt"], SPEC.decode_tokens
    before, before_tokens = _greedy(_Calls(_context(inlined_vmfb, None)), prompt, steps)
    after, after_tokens = _greedy(BACKEND.load(src, SPEC), prompt, steps)
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, y)
    assert before_tokens == after_tokens == golden["tokens"]


def test_cached_archive_missing_or_changed_is_written_again(built, tmp_path, monkeypatch):
    """The program and its archive are two cache entries (the program's key names no checkpoint). A
    cached model.irpa that is missing or changed is written again, and the program is not compiled
    again for it (export and compile stubbed here: only the decisions are tested); intact entries are
    used as they are."""
    src, b, _ = built
    cache = tmp_path / "cache"
    program = cache / "artifacts" / "iree" / b.vmfb.parent.name
    archive = cache / "artifacts" / "iree-params" / b.irpa.parent.name
    shutil.copytree(b.vmfb.parent, program)
    shutil.copytree(b.irpa.parent, archive)
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(cache))
    builds = []

    def compile_to(exported, path):
        builds.append(path)
        path.write_bytes(b"stub")

    monkeypatch.setattr(iree_export, "export_program", lambda *a, **k: None)
    monkeypatch.setattr(iree_export, "compile_to", compile_to)

    again = BACKEND.program(src, SPEC)  # intact: cached, nothing built
    assert again.art.cached and again.vmfb == program / "model.vmfb" and again.irpa == archive / PARAMS_FILE
    assert again.params["cached"] and not builds

    (archive / PARAMS_FILE).unlink()  # the program alone: its archive written again, no compile
    rewritten = BACKEND.program(src, SPEC)
    assert rewritten.art.cached and not rewritten.params["cached"] and not builds
    assert rewritten.params == {**iree_backend.checked_parameters(archive / PARAMS_FILE), "cached": False}
    assert (archive / PARAMS_FILE).read_bytes() == b.irpa.read_bytes()

    irpa = archive / PARAMS_FILE  # the same size, other bytes (a newer mtime): rehashed, written again
    data = bytearray(irpa.read_bytes())
    data[-1] ^= 0xFF
    irpa.write_bytes(bytes(data))
    assert not BACKEND.program(src, SPEC).params["cached"] and irpa.read_bytes() == b.irpa.read_bytes()

    shutil.rmtree(program)  # the archive alone: the program compiled, the archive kept
    recompiled = BACKEND.program(src, SPEC)
    assert not recompiled.art.cached and recompiled.params["cached"] and len(builds) == 1


def test_export_writes_vmfb_and_irpa_that_run_as_deployed(cli, tmp_path, built):
    src, b, _ = built
    p = cli("export", "--family", "qwen2_moe", "--backend", NAME, "--output-dir", str(tmp_path), "--tiny-test",
            "--max-seq-len", "16", "--prompt-len", "8")  # the check's shapes: the cached program
    assert p.returncode == 0, p.stderr[-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.vmfb", PARAMS_FILE}
    for name in manifest["files"]:
        data = (tmp_path / name).read_bytes()
        assert data == (b.vmfb if name == "model.vmfb" else b.irpa).read_bytes()  # the very files the check runs
        assert manifest["files"][name]["sha256"] == hashlib.sha256(data).hexdigest()
    # only the two exported files: the program with its weights mapped from the archive
    prompt = list(range(3, 3 + SPEC.prompt_len))
    deployed = _Calls(_context((tmp_path / "model.vmfb").read_bytes(), tmp_path / PARAMS_FILE))
    for x, y in zip(*(_greedy(m, prompt, 2)[0] for m in (deployed, BACKEND.load(src, SPEC)))):
        np.testing.assert_array_equal(x, y)


def test_build_never_holds_the_model(tmp_path, monkeypatch):
    """A cache miss of the untransformed program writes model.irpa a decoder layer at a time and
    traces the program without weights: the production model is never built (what lets a
    real-width checkpoint be compiled with one layer in memory), and the archive has the very
    names, shapes and bytes of the production model's parameters."""
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path / "cache"))
    spec = CheckSpec(family="olmoe", backend=NAME)
    src = model_source(spec)
    model = src.build_production(torch.float32)

    def no_model(*a, **k):
        raise AssertionError("the whole production model was built")

    monkeypatch.setattr(type(src), "build_production", no_model)
    b = BACKEND.program(src, spec)
    assert not b.art.cached
    index = rt.ParameterIndex()
    index.load(str(b.irpa))
    entries = dict(index.items())
    params = dict(model.named_parameters())
    assert sorted(entries) == sorted(params)
    for name, p in params.items():
        got = rt.parameter_index_entry_as_numpy_ndarray(entries[name])
        assert got.tobytes() == _bytes(p), name
    assert not list(tmp_path.glob("cache/artifacts/iree-params/*/.*part*"))  # the per-layer archives are gone
    cand = BACKEND.load(src, spec)
    logits = cand.prefill(list(range(3, 3 + spec.prompt_len)))
    with torch.no_grad():
        want = model(torch.arange(3, 3 + spec.prompt_len)[None], torch.arange(spec.prompt_len))[0]
    np.testing.assert_allclose(logits, want.numpy(), atol=1e-5)  # FINDINGS: IREE fp32 logits within 2.6e-6 of eager


def test_memory_estimate_follows_the_largest_layer(built):
    """The memory guard's estimate (oracle.backend.memory_refusal): one decoder layer's fp32 weights
    twice and the weights outside the layers, not the model's size (no model is held; the archive
    is mapped). Measured at OLMoE's real width, --layers 2: 7.2 GiB peak RSS of which 4.2 GiB the
    mapped archive (docs/benchmarks.md)."""
    src, _, model = built
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.layers]
    outside = sum(p.numel() for p in model.parameters()) - sum(per_layer)
    need, how = BACKEND.memory_estimate(src, SPEC)
    assert need == 8 * max(per_layer) + 4 * outside, how
    from models.faults import catalogue as faults

    faulted, _ = BACKEND.with_fault(faults.applicable(src.args)[0]).memory_estimate(src, SPEC)
    assert faulted == need + 4 * src.parameter_count()  # a fault builds the whole fp32 model


def test_one_program_for_every_seed_and_for_a_fault_in_the_weights_alone(built):
    """Issue 52: the program's key names no checkpoint (its parameters are external), so another
    seed of the family runs the very model.vmfb with its own model.irpa; a seeded fault that changes
    weight values alone (expert_gate_up_swapped: rows exchanged) runs the clean program too, its
    archive carrying the fault; a fault that changes the computation has a program of its own."""
    from dataclasses import replace

    from models.faults import catalogue as faults

    src, b, _ = built
    spec1 = replace(SPEC, seed=1)
    src1 = model_source(spec1)
    b1 = BACKEND.program(src1, spec1)
    assert src1.checkpoint_sha256 != src.checkpoint_sha256
    assert b1.art.cached and b1.vmfb == b.vmfb and b1.irpa != b.irpa  # no compile for another seed

    swapped = BACKEND.with_fault(faults.get("expert_gate_up_swapped"))
    bf = swapped.program(src, SPEC)
    assert bf.art.cached and bf.vmfb == b.vmfb and bf.irpa not in (b.irpa, b1.irpa)
    layer = faults.get("expert_gate_up_swapped").layer(src.args)
    name = f"layers.{layer}.mlp.experts.gate_up_proj"
    clean, faulty = (_tensor(p, name) for p in (b.irpa, bf.irpa))
    gate, up = clean.chunk(2, dim=1)
    assert torch.equal(faulty, torch.cat([up, gate], dim=1)) and not torch.equal(faulty, clean)

    theta = BACKEND.with_fault(faults.get("rope_theta_wrong"))
    model, plan = theta.plan(src)
    assert theta.runs_as(src, model) is theta
    assert theta.key(src, SPEC, iree_backend.parse_plan(plan)[0])["transform_id"] == faults.get("rope_theta_wrong").id


def _tensor(irpa: Path, name: str) -> torch.Tensor:
    index = rt.ParameterIndex()
    index.load(str(irpa))
    return torch.from_numpy(rt.parameter_index_entry_as_numpy_ndarray(dict(index.items())[name]).copy())


def test_the_faults_that_run_the_clean_program_are_those_in_the_weights_alone():
    """runs_as over the catalogue and every family: a built model and the structure have one
    program identity (so a fault that needs weight values, expert_weights_off_1e-3, is judged like one
    that does not), and exactly the faults that edit weight values alone run the clean program;
    every other fault (an attribute, a patched method, a buffer such as rope_theta_wrong's inv_freq)
    compiles its own."""
    from models.faults import catalogue as faults
    from models import FAMILY_NAMES

    weights_alone = {"expert_gate_up_swapped", "expert_weights_off_1e-3",
                     "moe_bias_missing",  # (JetMoE's MoE output bias zeroed: a weight value)
                     "short_conv_taps_reversed",  # (LFM2's conv kernel flipped in place: a weight value)
                     "dsv4_sinks_dropped",  # (DeepSeek-V4's sink logits set to -inf in place: a weight value)
                     "input_residual_dropped",  # (Doge's residual scale set to 1 in place: a weight value)
                     "mlp_global_scale_missing"}  # (Inkling's MLP global scale set to 1 in place: a weight value)
    for family in FAMILY_NAMES:
        spec = CheckSpec(family=family, backend=NAME)
        src = model_source(spec)
        structure = production_structure(src)
        assert program_identity(structure) == program_identity(
            src.build_production(torch.float32)), family
        for fault in faults.applicable(src.args):
            be = BACKEND.with_fault(fault)
            if be is not None:
                clean = be.runs_as(src, be.model(src)) is not be
                assert clean == (fault.name in weights_alone), (family, fault.name)
