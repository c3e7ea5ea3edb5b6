"""`iree-llvm-cpu`: real numbers against the HF fp32 reference. Compiled programs are shared
through the artifact cache (conftest.py puts it inside the checkout), so only the first
session compiles; every check here also runs cached in a later session."""

import hashlib
import json
import shutil
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("iree.runtime", reason="iree is not installed (pip install 'moe-oracle[iree]')")
pytest.importorskip("iree.turbine.aot", reason="iree-turbine is not installed (pip install 'moe-oracle[iree]')")

import exporters.iree.backend as iree_backend  # noqa: E402
import exporters.iree.export as iree_export  # noqa: E402
from exporters.iree.program import mlir_ops  # noqa: E402
from exporters.shared.identity import production_structure  # noqa: E402
from exporters.iree.backend import BACKEND, IreeBackend  # noqa: E402
from exporters.iree.export import block_programs  # noqa: E402
from models.faults import catalogue as faults  # noqa: E402
from oracle.backend import CheckSpec  # noqa: E402
from oracle.check import run_check
from oracle.source.sources import model_source

NAME = "iree-llvm-cpu"


def _spec(family):
    return CheckSpec(family=family, backend=NAME)


def _timed_check(spec, backend=BACKEND):
    t = time.perf_counter()
    r = run_check(spec, backend)
    return r, time.perf_counter() - t


@pytest.fixture(scope="session")
def qwen2_runs():
    """The same check twice: (first, its seconds, second, its seconds)."""
    first, t1 = _timed_check(_spec("qwen2_moe"))
    second, t2 = _timed_check(_spec("qwen2_moe"))
    return first, t1, second, t2


def _assert_pass(r):
    assert r.status == "pass", r.error or r.worst
    assert r.blocks and all(b.status == "pass" for b in r.blocks)
    assert r.e2e.token_exact and len(r.e2e.steps) == 9  # prefill + 8 decode steps
    assert max(b.ratio for b in r.blocks) < 0.5  # well inside the fp32 limits, not marginal


def test_available():
    assert BACKEND.availability() == (True, "")


def test_missing_package_is_a_reason_not_a_traceback(monkeypatch):
    monkeypatch.setattr(iree_backend, "versions", lambda *p: {n: None if n == "iree-base-runtime" else "1" for n in p})
    ok, reason = BACKEND.availability()
    assert not ok and "iree-base-runtime not installed" in reason


def test_qwen2_moe_passes_blocks_and_e2e(qwen2_runs):
    first, _, _, _ = qwen2_runs
    _assert_pass(first)
    assert first.e2e.steps[0]["max_abs"] < 1e-5
    assert [a["name"] for a in first.cache["artifacts"]] == ["model.vmfb", "model.irpa"]
    # one program per block kind, run for both layers
    assert first.provenance["backend"]["block_programs"]["moe0"] == ["0.moe", "1.moe"]
    # the goldens: tokens, and the op histogram of the MLIR that went into iree-compile
    gates = {g.name: g.status for g in first.gates}
    assert gates["golden_tokens"] == "pass" and gates["structure:mlir_ops"] == "pass"
    assert "torch.aten.index.Tensor" in first.structures["mlir_ops"]


def test_mlir_ops_counts_ops_not_resource_names():
    text = """module {
  util.global private @__auto.constant_1_4_16_16_torch.float32 = #stream.parameter.named<"model"::"x"> : tensor<1x4x16x16xf32>
  func.func @decode(%arg0: !torch.vtensor<[1,1],si64>) -> !torch.vtensor<[1,1,256],f32> {
    %0 = torch.aten.embedding %w, %arg0, %int-1, %false, %false : !torch.vtensor<[256,64],f32>
    %1 = util.global.load @__auto.constant_1_4_16_16_torch.float32 : tensor<1x4x16x16xf32>
    return %0 : !torch.vtensor<[1,1,256],f32>
  }
}

{-#
  dialect_resources: {
    builtin: {
      torch_tensor_16_torch.int64: "0x0800000000"
    }
  }
#-}
"""
    assert mlir_ops(text) == {"func.func": 1, "torch.aten.embedding": 1, "util.global": 1,
                                           "util.global.load": 1}


def test_an_op_iree_cannot_lower_is_refused_by_name(tmp_path):
    """Inkling's router weights exp(lp - logsumexp(lp)) (HF's): iree-compile 3.13 has no lowering of
    aten.logsumexp and says only that it fails to legalize its constants; the refusal names the op."""
    from iree.turbine import aot

    from oracle.backend import InputError

    class Lse(torch.nn.Module):
        def forward(self, x):
            return torch.exp(x - torch.logsumexp(x, dim=-1, keepdim=True))

    with pytest.raises(InputError, match=r"cannot lower torch\.aten\.logsumexp \(torch\.logsumexp\)"):
        iree_export.compile_to(aot.export(Lse(), args=(torch.zeros(2, 8),)), tmp_path / "m.vmfb")
    # another compile failure is the compiler's error, unchanged (test_compile_failure_is_an_error_...)
    assert iree_export.refuse_unlowered("failed to legalize operation", {"torch.aten.exp": 1}) is None


def test_hyper_connection_layer_programs_take_their_rows_shape():
    """A decoder layer on N residual streams is traced on its rows' input (hyper-connections [1, T*N, H], Qwen4-Exp's
    gated residual [1, T, N*H]) at T positions, where [1, T, H] failed the export (deepseek_v4, hy_v4, qwen4_exp)."""
    from models import get_family
    from models.layers.transformer import Transformer

    for family, shape in (("deepseek_v4", lambda a: (1, 3 * a.hyper.streams, a.hidden_size)),
                          ("qwen4_exp", lambda a: (1, 3, a.gated_residual.streams * a.hidden_size))):
        fam = get_family(family)
        model = Transformer(fam.args(dict(fam.tiny_config, model_type=fam.model_types[0])))
        model.load_state_dict({k: torch.randn_like(t) * 0.1 if t.is_floating_point() else t
                               for k, t in model.state_dict().items()})
        x, pos = iree_export.block_input(model, "layer", 3)
        assert tuple(x.shape) == shape(model.args) and pos.tolist() == [0, 1, 2]
        assert tuple(iree_export.block_input(model, "attention", 3)[0].shape) == (1, 3, model.args.hidden_size)
        if model.args.gated_residual is not None:  # its final norm mixes the streams
            x_norm = iree_export.block_input(model, "final_norm", 3)[0]
            assert model.norm(x_norm).shape == (1, 3, model.args.hidden_size)
        out = model.layers[0](x, pos)  # the layer runs on it (what the export traces)
        assert out.numel() == x.numel()


def test_warm_check_imports_neither_torch_nor_transformers():
    """Its candidate runs no torch (`runs_torch = False`), and a warm check reads the reference
    (numpy), the checkpoint's resolved args, the prompt and the backend's own plan from the caches:
    neither torch nor transformers is imported (issue 17: the warm path of iree-llvm-cpu)."""
    from tests.conftest import warm_check_imports

    assert warm_check_imports('qwen2_moe', 'iree-llvm-cpu', "torch", "transformers") == [False, False]


def test_second_run_is_cached_and_fast(qwen2_runs):
    first, t1, second, t2 = qwen2_runs
    _assert_pass(second)
    assert second.cache["all_cached"]
    assert all(a["build_s"] == 0 for a in second.cache["artifacts"])
    # the same report, cold or warm, apart from the run state (timings, cache)
    same = [{k: v for k, v in r.to_dict().items() if k not in ("timings", "cache")} for r in (first, second)]
    assert json.dumps(same[0], sort_keys=True) == json.dumps(same[1], sort_keys=True)
    if not first.cache["all_cached"]:  # a cold first run: the warm one takes a fraction of it
        assert t2 < t1 / 4, (t1, t2)


def test_qwen3_5_moe_passes():
    """Gated DeltaNet conv and recurrent state: module globals in the model, explicit in blocks."""
    r, _ = _timed_check(_spec("qwen3_5_moe"))
    _assert_pass(r)
    programs = r.provenance["backend"]["block_programs"]
    assert programs["attention0"] == ["0.attention", "1.attention", "2.attention"]  # Gated DeltaNet
    assert programs["attention1"] == ["3.attention"]  # full attention


def test_glm5_shared_dsa_layer_rows_are_na_with_the_reason():
    """GLM-5's shared DSA layer attends to the keys the full layer before it chose: state its isolated block
    program does not hold (measured before: its attention and layer rows at rel_l2 1.5, every other row within
    1e-6). Those two rows are n/a with that reason; the rest pass, and e2e (the whole model's prefill and decode,
    which carry the choice) passes."""
    r, _ = _timed_check(_spec("glm_moe_dsa"))
    assert r.status == "pass", r.status
    na = {(b.layer, b.kind): b.detail for b in r.blocks if b.status == "n/a"}
    assert set(na) == {(1, "attention"), (1, "layer")}
    assert all("shared layer" in why for why in na.values())
    assert r.e2e.status == "pass" and all(b.status == "pass" for b in r.blocks if (b.layer, b.kind) not in na)


def test_prefill_starts_a_new_sequence(qwen2_runs):
    src = model_source(_spec("qwen2_moe"))
    cand = BACKEND.load(src, _spec("qwen2_moe"))  # cached by qwen2_runs
    prompt = list(range(3, 11))
    a = cand.prefill(prompt)
    d1 = [cand.decode(t, 8 + i) for i, t in enumerate((5, 7))]
    b = cand.prefill(prompt)
    d2 = [cand.decode(t, 8 + i) for i, t in enumerate((5, 7))]
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.stack(d1), np.stack(d2))
    eager = src.build_production(torch.float32)
    with torch.no_grad():
        ref = eager(torch.tensor([prompt]), torch.arange(8))[0]
    np.testing.assert_allclose(a, ref.numpy(), atol=1e-5)


def test_faulted_layer_gets_its_own_program():
    src = model_source(_spec("qwen3_5_moe"))
    m = src.build_production(torch.float32)
    faults.get("gdn_state_not_carried").inject(m)  # patches layer 2's Gated DeltaNet
    programs, which = block_programs(m)
    assert which[0, "attention"][0] is which[1, "attention"][0]
    assert which[2, "attention"][0] is not which[0, "attention"][0]
    assert which[2, "layer"][0] is not which[0, "layer"][0]
    assert which[2, "moe"][0] is which[0, "moe"][0]  # untouched blocks still share


def _same_programs(built, bp: dict, structure, sp: dict) -> None:
    """Raise unless a built model has the block programs (names, fingerprints, inputs) and non-state
    buffers of the structure the cache key and the candidate are made from: a transform that behaved
    differently without weights."""
    from models.args import STATE_BUFFERS

    def desc(programs):
        return [(p.name, p.fingerprint, p.weights, p.state) for p in programs.values()]

    if desc(bp) != desc(sp):
        raise RuntimeError("block programs of the built model differ from those of its structure "
                           f"(a transform that depends on weight values?): {desc(bp)} vs {desc(sp)}")
    buffers = dict(structure.named_buffers())
    for name, t in built.named_buffers():
        if name.rsplit(".", 1)[-1] in STATE_BUFFERS:
            continue
        if name not in buffers or not torch.equal(t, buffers[name]):
            raise RuntimeError(f"buffer {name} of the built model differs from its structure's")


def test_programs_come_from_the_structure_without_weights():
    """The block programs (and the cache key) are read from the model's structure, its parameters
    on the meta device, with the fault applied: the same programs and derived buffers as the built
    model's. A fault that reads weight values (it picks the most routed expert) gets the built model."""
    src = model_source(_spec("qwen2_moe"))
    rope = BACKEND.with_fault(faults.get("rope_theta_wrong"))  # changes a buffer: a block input
    structure = rope.model(src)
    assert not iree_export.has_weights(structure)
    built = src.build_production(torch.float32)
    rope.transform(built)
    _same_programs(built, block_programs(built)[0], structure, block_programs(structure)[0])
    i = faults.get("rope_theta_wrong").layer(src.args)
    clean = production_structure(src)
    assert not torch.equal(structure.layers[i].attn.rope.inv_freq, clean.layers[i].attn.rope.inv_freq)
    off = BACKEND.with_fault(faults.get("expert_weights_off_1e-3")).model(src)
    assert iree_export.has_weights(off)
    iree_export.drop_weights(off)
    assert not iree_export.has_weights(off) and all(b.device.type == "cpu" for b in off.buffers())


def test_not_causal_attention_fails_at_that_block():
    """The known IREE trap: a mask that silently stops being causal must fail the check."""
    fault = faults.get("attention_not_causal")
    spec = _spec("qwen2_moe")
    # (the verdict's row is what is tested, not the drill inside it: test_drill.py; its points program is a compile)
    r, _ = _timed_check(replace(spec, drill="off"), BACKEND.with_fault(fault))
    assert r.status == "fail" and r.e2e.status == "fail"
    assert fault.layer(model_source(spec).args) == 1
    assert (r.worst["layer"], r.worst["kind"]) == (1, "attention")
    assert r.worst["ratio"] > 10


def test_faults_survive_export_and_fail_exactly_their_blocks():
    """Four faults in one program (one compile, tests/plugins.py): a patched method in a stateful
    block (the Gated DeltaNet state of layer 2 not carried), a changed buffer (layer 3's RoPE
    inv_freq, a program input), changed weights (an expert of layer 0, layer 1's shared expert).
    Exactly the blocks containing them fail."""
    from tests.plugins import QWEN35_FOUR_FAULTS, qwen35_four_faults

    spec = _spec("qwen3_5_moe")
    r, _ = _timed_check(spec, IreeBackend(transform=qwen35_four_faults, transform_id=QWEN35_FOUR_FAULTS))
    assert r.status == "fail" and r.e2e.status == "fail"
    failed = {(b.layer, b.kind) for b in r.blocks if b.status == "fail"}
    assert failed == {(0, "moe"), (0, "layer"), (1, "moe"), (1, "layer"), (2, "attention"), (2, "layer"),
                      (3, "attention"), (3, "layer")}
    row = next(b for b in r.blocks if (b.layer, b.kind) == (2, "attention"))
    assert row.metrics["first_divergence"]["index"][0] >= 8  # state lost between calls: prefill rows match


def _histc(model):
    """An op IREE cannot legalize (torch.aten.histc) inside the final norm."""
    norm = model.norm
    fwd = type(norm).forward
    norm.forward = lambda x: fwd(norm, x) + 0 * torch.histc(x, bins=4).sum()


HISTC = IreeBackend(name="iree-histc", transform=_histc)  # no transform_id: never cached


def test_compile_failure_is_an_error_with_the_compilers_message(cli, tmp_path):
    out = tmp_path / "r.json"
    p = cli("check", "--family", "qwen2_moe", "--backend", "tests.test_iree:HISTC", "--json", str(out))
    assert p.returncode == 4, p.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc["status"] == "error"
    for text in ("iree-compile", "failed to legalize", "torch.aten.histc"):  # the compiler's own diagnostics
        assert text in doc["error"]


def test_runtime_error_is_an_error(qwen2_runs, tmp_path, monkeypatch):
    """A bad cached program: iree.runtime's message ends up in the result."""
    _, _, second, _ = qwen2_runs
    cache = tmp_path / "cache"
    for a in second.cache["artifacts"]:
        if a["name"] != "model.vmfb":  # the program (its archive, model.irpa, its own entry, is written again here)
            continue
        src_dir = Path(a["path"]).parent
        dst = cache / "artifacts" / "iree" / src_dir.name
        shutil.copytree(src_dir, dst)
        (dst / a["name"]).write_bytes(b"not a vmfb" * 100)
        # a garbage program the cache believes in (its sha256 recorded): a corrupted file whose
        # sha256 no longer matches would be rebuilt instead (test_artifacts)
        (dst / "sha256").write_text(hashlib.sha256(b"not a vmfb" * 100).hexdigest() + "\n")
    ck = Path(second.provenance["checkpoint"]["dir"])  # this check's checkpoint only (not the whole cache's)
    shutil.copytree(ck, cache / "checkpoints" / ck.name)
    monkeypatch.setenv("MOE_ORACLE_CACHE", str(cache))
    r = run_check(_spec("qwen2_moe"))
    assert r.status == "error" and r.error.startswith("load:")
    assert "flatbuffer" in r.error.lower() or "invalid" in r.error.lower(), r.error[:500]


def test_export_writes_vmfb_irpa_and_manifest(cli, tmp_path, qwen2_runs):
    p = cli("export", "--family", "qwen2_moe", "--backend", NAME, "--output-dir", str(tmp_path), "--tiny-test",
            "--max-seq-len", "16", "--prompt-len", "8")  # the check's shapes: the cached program
    assert p.returncode == 0, p.stderr[-2000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["family"] == "qwen2_moe" and set(manifest["files"]) == {"model.vmfb", "model.irpa"}
    vmfb = (tmp_path / "model.vmfb").read_bytes()
    assert manifest["files"]["model.vmfb"]["sha256"] == hashlib.sha256(vmfb).hexdigest()
    # the very program the check ran (and its sha256 in the check's provenance)
    assert manifest["files"]["model.vmfb"]["sha256"] == qwen2_runs[2].provenance["artifacts"][0]["sha256"]
    import iree.runtime as rt

    ctx = rt.SystemContext(config=rt.Config("local-task"))
    index = rt.ParameterIndex()  # the weights: model.irpa, served by an io_parameters module
    index.load(str(tmp_path / "model.irpa"))
    ctx.add_vm_module(rt.create_io_parameters_module(ctx.instance, index.create_provider(scope="model")))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb))
    assert {"prefill", "decode", "block_moe0_t1"} <= set(ctx.modules.module.vm_module.function_names)
