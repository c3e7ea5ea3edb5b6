"""Shipped mlx-lm directories (--candidate-dir): the format's dequantizer against mlx's own,
the mlx-lm -> HF mapping of every family (names, layouts, the config HF reads), the implementation
rows at fp32 limits for the five families (q4 g32; q8 g64 and mlx-lm's mixed_4_6 recipe for OLMoE
and Qwen3-MoE), the quantization rows apart, two seeded runtime faults, a quantized directory
without its original, and bad input."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch

from models import CORE, FAMILY_NAMES, get_family
from models.checkpoint import CheckpointError, read_config, read_weights
from oracle.source.quantized import dequantize, dequantized_checkpoint
from oracle.verdict import thresholds
from oracle.backend import CheckSpec, InputError
from oracle.check import run_check
from oracle.source.sources import first_difference, model_source
from oracle.source.validation import validate
from oracle.export import run_export

mx = pytest.importorskip("mlx.core")
pytest.importorskip("mlx_lm")

# the directories written by `oracle export --backend mlx` (mlx-lm's quantizer and writers)
RECIPES = {"q4g32": ("q4", {"group_size": 32}), "q8g64": ("q8", {"group_size": 64}),
           "mixed_4_6": ("q4", {"recipe": "mixed_4_6", "group_size": 32})}
# q4 for every family; q8 and the mixed recipe on two (Qwen3.5's quantization rows replay HF's
# Gated DeltaNet per block kind: 30-50 s a check, so its q8/mixed rows are benchmarks/shipped.py's)
# end to end (every family's maps back: below)
CASES = [(f, "q4g32") for f in CORE] + [(f, r) for f in ("olmoe", "qwen3_moe") for r in ("q8g64", "mixed_4_6")]


@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    root = tmp_path_factory.mktemp("shipped")
    made = {}

    def get(family, recipe):
        if (family, recipe) not in made:
            precision, opts = RECIPES[recipe]
            out = root / f"{family}-{recipe}"
            run_export(CheckSpec(family=family, backend="mlx", precision=precision, options=dict(opts)), str(out))
            made[family, recipe] = out
        return made[family, recipe]

    return get


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_dequantize_is_mlx_dequantize(bits, group_size):
    """The format's definition (w = scale * q + bias per group, values packed from the lowest
    bit) read independently of mlx gives mlx's own dequantized weights, 3/5/6 bits included."""
    w = mx.random.normal((3, 5, 128), key=mx.random.key(bits))
    q, s, b = mx.quantize(w, group_size=group_size, bits=bits)
    want = np.array(mx.dequantize(q, s, b, group_size=group_size, bits=bits))
    got = dequantize(torch.from_numpy(np.array(q)), torch.from_numpy(np.array(s)), torch.from_numpy(np.array(b)),
                     bits, group_size).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * float(np.abs(want).max()))


# families whose from_mlx gives back other names than the original checkpoint's: none now (exaone_moe's and laguna's
# routers are named back since 2026-12-02)
MLX_NAMES_OPEN: dict = {}
# families whose tiny checkpoint the mlx backend refuses (what their mlx-lm model cannot do: tests/test_mlx.py's
# REFUSED_TINY): no directory to read back
MLX_REFUSED_TINY = ("glm_moe_dsa", "deepseek_v4", "muse_spark")


@pytest.mark.parametrize("family", [pytest.param(f, marks=pytest.mark.xfail(reason=MLX_NAMES_OPEN[f], strict=True))
                                    if f in MLX_NAMES_OPEN else f
                                    for f in FAMILY_NAMES if get_family(f).mlx is not None and f not in MLX_REFUSED_TINY])
def test_unquantized_directory_maps_back_to_the_original_exactly(family, tmp_path):
    """An fp32 mlx-lm directory (mlx-lm's sanitize: stacked experts, Qwen3.5's 1 + w norms and
    conv1d layout, DeepSeek-V3's split kv_b_proj, gpt-oss's and Llama 4's fused experts) read back
    through the family's from_mlx is the original checkpoint, bit for bit (ERNIE's correction bias,
    which mlx-lm's format drops, from the original); its config.json, which carries the fields
    mlx-lm needs, is the original's architecture to HF (rope_scaling is HF's legacy rope_parameters)."""
    family_ = get_family(family)
    src = model_source(CheckSpec(family=family, backend="mlx"))
    run_export(CheckSpec(family=family, backend="mlx"), str(tmp_path / "d"))
    assert first_difference(src.args, family_.args(read_config(tmp_path / "d"), src.args.max_seq_len)) is None
    deq, summary = dequantized_checkpoint(family_, tmp_path / "d", src.config, original=src.model_dir)
    assert summary["kind"] == "none"
    assert ("from_original" in summary) == bool(family_.mlx.dropped)
    if family_.mlx.dropped:  # the directory alone does not say HF's model: refused, with the reason
        with pytest.raises(CheckpointError, match="mlx-lm's format drops"):
            dequantized_checkpoint(family_, tmp_path / "d", src.config)
    orig, back = read_weights(src.model_dir), read_weights(deq)
    assert set(back) == set(orig)
    offset = getattr(__import__(f"models.{family}", fromlist=["x"]), "OFFSET_NORMS", ())
    for k in orig:
        if k.endswith(offset):  # stored as fl(1 + w) by mlx-lm: back to w within half an ulp of 1
            torch.testing.assert_close(back[k], orig[k].float(), rtol=0, atol=2.0**-24)
        else:
            assert torch.equal(back[k], orig[k].float()), k


@pytest.mark.parametrize("family,recipe", CASES)
def test_implementation_rows_pass_at_fp32_and_quantization_rows_are_apart(shipped, family, recipe):
    d = shipped(family, recipe)
    r = run_check(CheckSpec(family=family, backend="mlx", candidate_dir=str(d)))
    q = r.quantization
    assert r.status == "pass", (r.worst, r.e2e.status, q["rows"].get("worst"))
    # mlx-lm's own predicates: mixed_4_6 adds 6-bit modules; Qwen3.5's keeps its routers at 8 bits
    assert q["format"] == "mlx affine" and min(q["bits"]) == (8 if recipe == "q8g64" else 4)
    assert q["kind"] == ("mixed" if len(q["bits"]) > 1 else RECIPES[recipe][0])
    assert (recipe == "mixed_4_6") == (6 in q["bits"])
    # implementation rows: the fp32 limits (the candidate must compute its own weights' model)
    for row in r.blocks:
        assert row.status == "pass", (row.layer, row.kind, row.metrics)
        base = thresholds.limits("fp32", row.kind, family, "mlx")
        assert row.limits.get("rel_l2") in (None, base.get("rel_l2")), (row.kind, row.limits)
    assert r.e2e.status == "pass" and r.e2e.token_exact and r.e2e.distribution is None
    # quantization rows: HF on the original vs HF on the dequantized weights, at the q4/q8 limits;
    # a real error, far above the implementation's
    rows = q["rows"]
    assert rows["precision"] == ("q8" if recipe == "q8g64" else "q4")
    impl = {(b.layer, b.kind): b.metrics.get("rel_l2") for b in r.blocks}
    for b in rows["blocks"]:
        if b["kind"] in ("moe", "layer") and b["metrics"].get("rel_l2") is not None:
            assert b["metrics"]["rel_l2"] > 100 * impl[b["layer"], b["kind"]], (b["layer"], b["kind"])
    assert rows["e2e"]["distribution"] is not None


@pytest.mark.parametrize("fault", ["dequant_scale_bias_swap", "dequant_group_size_doubled"])
def test_runtime_dequantization_faults_fail_implementation_rows_only(shipped, fault):
    from exporters.mlx.backend import BACKEND as MLX

    d = shipped("olmoe", "q4g32")
    spec = CheckSpec(family="olmoe", backend="mlx", candidate_dir=str(d))
    clean = run_check(spec)
    bad = run_check(spec, MLX.with_quantized_fault(fault, 1))
    assert bad.status == "fail"
    assert (bad.worst["layer"], bad.worst["kind"]) == (1, "moe")  # localised to the faulty layer's experts
    assert all(b.status == "pass" for b in bad.blocks if b.layer == 0)
    assert bad.quantization["rows"] == clean.quantization["rows"]  # the file's weights did not change


def test_quantized_directory_alone_gives_implementation_rows_only(shipped):
    d = shipped("qwen3_5_moe", "q4g32")
    r = run_check(CheckSpec(family="qwen3_5_moe", backend="mlx", model_dir=str(d)))
    assert r.status == "pass"
    assert r.spec["candidate_dir"] == str(d)
    assert "rows" not in r.quantization and "only the implementation rows" in r.quantization["note"]
    assert all(b.status == "pass" for b in r.blocks)


def test_config_fields_mlx_lm_reads_differently_are_named(shipped, tmp_path):
    """What mlx_lm.convert writes from a transformers-5 config (rope_theta only inside
    rope_parameters): mlx-lm computes with its default 1e6, HF with 1e4."""
    d = tmp_path / "trap"
    shutil.copytree(shipped("qwen2_moe", "q4g32"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("rope_theta")
    (d / "config.json").write_text(json.dumps(cfg))
    r = run_check(CheckSpec(family="qwen2_moe", backend="mlx", candidate_dir=str(d)))
    gate = next(g for g in r.gates if g.name == "mlx_config")
    assert r.status == "fail" and gate.status == "fail" and "rope_theta: mlx-lm 1000000" in gate.message
    assert r.worst["kind"] == "attention"
    assert r.quantization["rows"]["status"] == "pass"


def _edited(src, dst, fn):
    shutil.copytree(src, dst)
    fn(dst)
    return dst


def test_mismatched_architecture_is_bad_input(shipped, tmp_path):
    d = shipped("olmoe", "q4g32")

    def more_experts_per_token(p):
        cfg = json.loads((p / "config.json").read_text())
        cfg["num_experts_per_tok"] = 4
        (p / "config.json").write_text(json.dumps(cfg))

    bad = _edited(d, tmp_path / "k4", more_experts_per_token)
    with pytest.raises(InputError, match="num_experts_per_tok: 2 .original. vs 4 .candidate."):
        run_check(CheckSpec(family="olmoe", backend="mlx", candidate_dir=str(bad)))

    def narrower_scales(p):
        from safetensors.torch import load_file, save_file

        f = next(p.glob("*.safetensors"))
        t = load_file(str(f))
        k = "model.layers.1.mlp.switch_mlp.up_proj.scales"
        t[k] = t[k][..., :1].contiguous()
        save_file(t, str(f), metadata={"format": "mlx"})

    bad = _edited(d, tmp_path / "scales", narrower_scales)
    with pytest.raises(InputError, match="model.layers.1.mlp.switch_mlp.up_proj: scales .8, 32, 1."):
        run_check(CheckSpec(family="olmoe", backend="mlx", candidate_dir=str(bad)))


@pytest.mark.parametrize("backend,precision,options,message", [
    ("eager", "fp32", {}, "cannot load a prebuilt directory"),
    ("mlx", "q4", {}, "its own .read from its config.json."),
    ("mlx", "fp32", {"group_size": 32}, "a shipped directory's quantization is its own"),
])
def test_options_that_contradict_a_shipped_directory_are_refused(shipped, backend, precision, options, message):
    spec = CheckSpec(family="olmoe", backend=backend, precision=precision, options=dict(options),
                     candidate_dir=str(shipped("olmoe", "q4g32")))
    with pytest.raises(InputError, match=message):
        validate(replace(spec))


def test_cli_reports_both_rows(shipped, cli, tmp_path):
    d = shipped("mixtral", "q4g32")
    p = cli("check", "--family", "mixtral", "--backend", "mlx", "--candidate-dir", str(d),
            "--json", str(tmp_path / "r.json"))
    assert p.returncode == 0, p.stderr
    assert "**Implementation error**" in p.stdout and "**Quantization error**" in p.stdout
    assert json.loads((tmp_path / "r.json").read_text())["quantization"]["rows"]["status"] == "pass"
    p = cli("check", "--family", "mixtral", "--backend", "eager", "--candidate-dir", str(d))
    assert p.returncode == 2 and "cannot load a prebuilt directory" in p.stderr


def test_export_and_check_a_published_config_as_the_readme_says(cli, tmp_path):
    """`oracle export --config C --layers N --backend mlx --precision q4` then `oracle check
    --config C --layers N --backend mlx --candidate-dir Q` (the family read from the config); a
    config.json path stands in for a published one (tiny shapes)."""
    from oracle.source.seeded import tiny_checkpoint

    cfg = tiny_checkpoint(get_family("qwen2_moe"), 0) / "config.json"
    q = tmp_path / "q4"
    p = cli("export", "--config", str(cfg), "--layers", "1", "--backend", "mlx", "--precision", "q4",
            "--group-size", "32", "--output-dir", str(q))
    assert p.returncode == 0, p.stderr
    p = cli("check", "--config", str(cfg), "--layers", "1", "--backend", "mlx", "--candidate-dir", str(q))
    assert p.returncode == 0, p.stderr
    assert "**Implementation error**" in p.stdout and "**Quantization error**" in p.stdout
    p = cli("export", "--backend", "mlx", "--output-dir", str(tmp_path / "none"))
    assert p.returncode == 2 and "--family is required with the tiny checkpoint" in p.stderr


def test_a_directory_check_is_planned_on_the_original_before_the_directory_is_written(monkeypatch, tmp_path):
    """A q4 check on the directory its backend writes (mlx): --validate-only plans it and writes no directory;
    a check whose memory cannot fit is refused with the sizes before the writer runs (mlx-lm's writer holds
    the model in memory: Qwen3-30B-A3B's was killed by the kernel mid-write before this plan)."""
    from oracle.backend import resolve

    monkeypatch.setenv("MOE_ORACLE_CACHE", str(tmp_path))
    backend = resolve("mlx")
    if not backend.availability_for(CheckSpec(family="olmoe", backend="mlx", precision="q4"))[0]:
        pytest.skip("mlx is not installed here")
    written = []
    monkeypatch.setattr(type(backend), "export", lambda self, *a, **k: written.append(a) or [])
    spec = CheckSpec(family="olmoe", backend="mlx", precision="q4")
    r = run_check(spec, backend, validate_only=True)
    assert r.provenance["checkpoint"] == {"quantized_directory": "planned"} and r.provenance["plan"]["memory_bytes"]
    assert not written and not (tmp_path / "artifacts").exists()
    monkeypatch.setattr("oracle.memory.available_memory", lambda: r.provenance["plan"]["memory_bytes"] - 1)
    with pytest.raises(InputError, match="mlx --precision q4 would need about"):
        run_check(spec, backend)
    assert not written
