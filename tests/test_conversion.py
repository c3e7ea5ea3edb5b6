"""The weight check of a shipped file (oracle/verdict/conversion.py, issue 50): a correct quantization by the
format's own quantizer passes, a conversion defect fails naming its tensor.

The quantizers are the formats' own: mlx's `mx.quantize` and llama.cpp's `ggml_quantize_chunk` (what
llama-quantize runs). The blocks are drawn with another seed than the bounds were measured with
(benchmarks/conversion_bounds.py), over the same six shapes."""

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from conversion_bounds import KINDS, draw, source  # noqa: E402

from oracle.verdict.conversion import Chunk, Format, TensorSource, judge  # noqa: E402


def whole(x, deq, fmt) -> TensorSource:
    """One tensor, no experts (rows are rows)."""
    return TensorSource("t", "t", x.shape, fmt, lambda: iter([Chunk(0, x, deq)]))


def _mlx():
    return pytest.importorskip("mlx.core")


def _ggml():
    pytest.importorskip("llama_cpp")
    from exporters.llamacpp.setup import converter_problem

    if converter_problem():
        pytest.skip(converter_problem())
    from exporters.llamacpp import weights as llamacpp_weights

    return llamacpp_weights


def mlx_row(mx, x, bits, g, dtype, edit=None):
    name = {mx.float32: "F32", mx.bfloat16: "BF16", mx.float16: "F16"}[dtype]
    xs = np.array(mx.array(x).astype(dtype).astype(mx.float32))
    w, s, b = mx.quantize(mx.array(xs if edit is None else edit(xs)).astype(dtype), group_size=g, bits=bits)
    deq = np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=bits))
    fmt = Format(f"mlx {bits}-bit", block=g, qmin=0, qmax=2 ** bits - 1, grid_dtype=name, input_dtype=name, clip_steps=1.0)
    return judge(source(xs, deq, np.array(s.astype(mx.float32)), np.array(b.astype(mx.float32)), fmt))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_mlx_quantizer_output_passes(bits, dtype):
    mx = _mlx()
    rng = np.random.default_rng(7)
    for i, kind in enumerate(KINDS * 2):
        row = mlx_row(mx, draw(rng, kind, (16, 256)), bits, (32, 64)[i % 2], getattr(mx, dtype))
        assert row["status"] == "pass", (kind, row)
        assert row["systematic"]["ratio"] < 0.5, (kind, row["systematic"])  # measured: at most 0.43


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_defects_fail(bits):
    """Rows exchanged and a row zeroed fail by their elements; one row 1 % too large fails by the
    systematic fit where the grid is exact (fp32 scales), although every value stays within a q4 step."""
    mx = _mlx()
    rng = np.random.default_rng(8)
    x = draw(rng, "normal", (16, 256))

    def swap(v):
        v = v.copy()
        v[[0, 1]] = v[[1, 0]]
        return v

    def zero(v):
        v = v.copy()
        v[3] = 0
        return v

    def scale(v):
        v = v.copy()
        v[5] *= 1.01
        return v

    for edit in (swap, zero):
        row = mlx_row(mx, x, bits, 32, mx.float32, edit)
        assert row["status"] == "fail" and row["over"] > 0, row
    row = mlx_row(mx, x, bits, 32, mx.float32, scale)
    assert row["status"] == "fail", row
    # all within the grid's own rounding: only the fit sees it
    assert row["max_excess"] is None or row["systematic"]["ratio"] > 1


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("imatrix", [False, True])
def test_llamacpp_quantizer_output_passes_and_the_grid_is_its_dequantizer(qtype, imatrix):
    w = _ggml()
    from exporters.llamacpp.setup import gguf_module

    gguf = gguf_module()
    rng = np.random.default_rng(9)
    for kind in KINDS:
        x = draw(rng, kind, (8, 512))
        raw = w.ggml_quantize(x, qtype, rng.uniform(0.01, 10, 512).astype(np.float32) if imatrix else None)
        # the grid read from the blocks is gguf-py's dequantizer: deq = step * q + offset, q whole and in range
        t = gguf.GGMLQuantizationType[qtype]
        deq = gguf.quants.dequantize(raw, t).reshape(x.shape)
        fmt = w.format_of(qtype, imatrix)
        step, offset, _ = w.grid(qtype, raw, gguf.GGML_QUANT_SIZES[t][1], fmt)
        S, B = np.repeat(step, fmt.block, axis=1), np.repeat(offset, fmt.block, axis=1)
        q = np.divide(deq - B, S, out=np.zeros_like(deq), where=S != 0)
        assert np.abs(q - np.round(q)).max() < 1e-3 and q.min() >= fmt.qmin - 0.5 and q.max() <= fmt.qmax + 0.5
        row = judge(w.block_source("t", x, raw, qtype, imatrix))
        assert row["status"] == "pass", (kind, row)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_llamacpp_defects_fail(qtype):
    w = _ggml()
    rng = np.random.default_rng(10)
    x = draw(rng, "normal", (8, 512))
    swapped, scaled, zeroed = x.copy(), x.copy(), x.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    scaled[2] *= 1.01
    zeroed[3] = 0
    for bad in (swapped, scaled, zeroed):
        row = judge(w.block_source("t", x, w.ggml_quantize(bad, qtype), qtype, unit_rows=1))
        assert row["status"] == "fail", row
    # a scale written for the next block
    raw = w.ggml_quantize(x, qtype)
    size = raw.shape[1] // (512 // (256 if qtype.endswith("K") else 32))
    blocks = raw.reshape(-1, size)
    at = w.D_OFFSET[qtype]
    blocks[:, at:at + 2] = np.roll(blocks[:, at:at + 2].copy(), 1, axis=0)
    assert judge(w.block_source("t", x, raw, qtype))["status"] == "fail"


def test_float_formats_round_to_nearest_and_no_more():
    rng = np.random.default_rng(11)
    x = draw(rng, "t3", (8, 128))
    for dtype, cast in (("F16", np.float16), ("F32", np.float32)):
        fmt = Format(dtype, dtype=dtype)
        assert judge(whole(x, x.astype(cast).astype(np.float32), fmt))["status"] == "pass"
        bad = x.copy()
        bad[1] *= 1.01
        row = judge(whole(x, bad.astype(cast).astype(np.float32), fmt))
        assert row["status"] == "fail" and row["where"] == "row 1", row


# ---------------------------------------------------------------- shipped files, as a user checks them

@pytest.fixture(scope="module")
def mlx_q8(tmp_path_factory, cli):
    _mlx()
    out = tmp_path_factory.mktemp("mlx") / "Q"
    r = cli("export", "--family", "olmoe", "--backend", "mlx", "--precision", "q8", "--output-dir", str(out))
    assert r.returncode == 0, r.stderr
    return out


def test_experts_exchanged_in_an_mlx_directory_fail_naming_the_tensor(mlx_q8, tmp_path, cli):
    """The issue's case: experts 0 and 1 of layer 1's up projection (weight, scales and biases) exchanged in
    a q8 directory passed as "quantization loss"; it now fails the weight check, naming the tensor."""
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "Qbad"
    shutil.copytree(mlx_q8, bad)
    f = next(bad.glob("*.safetensors"))
    t = load_file(f)
    for k in [k for k in t if "layers.1." in k and "switch_mlp.up_proj" in k]:
        t[k] = t[k][[1, 0, *range(2, t[k].shape[0])]]
    save_file(t, str(f), metadata={"format": "mlx"})
    j = tmp_path / "r.json"
    r = cli("check", "--family", "olmoe", "--backend", "mlx", "--candidate-dir", str(bad), "--json", str(j))
    assert r.returncode == 1, r.stdout + r.stderr
    w = json.loads(j.read_text())["quantization"]["weights"]
    assert w["status"] == "fail" and w["failed"] == 1
    assert w["worst"]["name"] == "model.layers.1.mlp.switch_mlp.up_proj.weight"
    assert w["worst"]["label"] == "model.layers.1.mlp.experts.*.up_proj.weight"
    assert w["worst"]["where"].startswith("experts 0, 1")
    assert "conversion defect" in r.stdout and "switch_mlp.up_proj" in r.stdout
    # the unmodified directory: every tensor within its format's rounding
    r = cli("check", "--family", "olmoe", "--backend", "mlx", "--candidate-dir", str(mlx_q8), "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads(j.read_text())["quantization"]["weights"]["status"] == "pass"


@pytest.mark.parametrize("outtype", ["f32", "Q8_0"])
def test_one_expert_scaled_in_a_gguf_fails_naming_the_tensor(outtype, tmp_path, cli):
    """1 % on one expert (stays within a quantization step of every value) in an F32 and a Q8_0 GGUF."""
    _ggml()
    from exporters.llamacpp.setup import gguf_module

    r = cli("export", "--family", "olmoe", "--backend", "llamacpp", "--option", f"outtype={outtype}",
            "--output-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    gguf = gguf_module()
    path = tmp_path / "model.gguf"
    reader = gguf.GGUFReader(str(path), "r+")
    t = next(t for t in reader.tensors if t.name == "blk.1.ffn_down_exps.weight")
    if outtype == "f32":
        t.data[3] *= np.float32(1.01)
    else:  # each block's f16 scale of expert 3 1 % larger
        blocks = t.data[3].reshape(-1, 34)
        d = blocks[:, :2].copy().view(np.float16).astype(np.float32) * 1.01
        blocks[:, :2] = d.astype(np.float16).view(np.uint8)
    reader.data.flush()
    j = tmp_path / "r.json"
    r = cli("check", "--family", "olmoe", "--backend", "llamacpp", "--gguf", str(path), "--json", str(j))
    assert r.returncode == 1, r.stdout + r.stderr
    weights = json.loads(j.read_text())["quantization"]["weights"]
    assert weights["failed"] == 1 and weights["worst"]["name"] == "blk.1.ffn_down_exps.weight"
    assert weights["worst"]["label"] == "model.layers.1.mlp.experts.*.down_proj.weight"
    assert "expert 3" in (weights["worst"]["where"] or weights["worst"]["systematic"]["unit"])


@pytest.mark.parametrize("backend,fmt", [("mlx", "q4 g64"), ("llamacpp", "Q8_0")])
def test_conversion_selftest_on_one_family(backend, fmt, cli, tmp_path):
    """`oracle selftest --conversion` on olmoe: every defect detected and localised, the unmodified file passes."""
    _mlx() if backend == "mlx" else _ggml()
    j = tmp_path / "s.json"
    r = cli("selftest", "--conversion", "--backend", backend, "--family", "olmoe", "--format", fmt, "--json", str(j))
    assert r.returncode == 0, r.stdout + r.stderr
    s = json.loads(j.read_text())["summary"]
    assert s["faults"] >= 5 and s["detected"] == s["faults"] and s["localized"] == s["faults"]
    assert s["false_alarms"] == 0 and s["clean"] == 1


def test_ulp_is_the_exact_spacing_at_every_binade():
    """ulp reads the exponent with frexp: 2^(floor(log2 |v|) - mantissa bits), exact where log2 and exp2
    were not (log2 of the largest double below 2^k rounds to k: twice the spacing there)."""
    from oracle.verdict.conversion import FLOATS, ulp

    k = np.arange(-120, 120)
    below, at = np.nextafter(2.0 ** k, 0), 2.0 ** k
    for dtype, (bits, emin) in FLOATS.items():
        np.testing.assert_array_equal(ulp(at, dtype), 2.0 ** (np.maximum(k, emin) - bits))
        np.testing.assert_array_equal(ulp(-below, dtype), 2.0 ** (np.maximum(k - 1, emin) - bits))
        assert ulp(np.array([0.0]), dtype)[0] == 2.0 ** (emin - bits)  # the subnormal spacing
    assert ulp(np.array([3.0]), "F32")[0] == np.spacing(np.float32(3.0))


def test_a_tensors_verdict_does_not_depend_on_how_its_rows_are_grouped(monkeypatch):
    """The statistics are per row, computed a few rows at a time in threads (cache-sized temporaries):
    one row per group, the default groups and one group for the whole chunk give the same row, number
    for number, on a correct quantization and on a defect."""
    import oracle.verdict.conversion as conversion

    mx = _mlx()
    rng = np.random.default_rng(9)
    x = draw(rng, "normal", (48, 256))
    rows = []
    for elements in (1, conversion.STATS_ROWS_ELEMENTS, 1 << 30):
        monkeypatch.setattr(conversion, "STATS_ROWS_ELEMENTS", elements)
        rows.append([mlx_row(mx, x, 4, 32, mx.float32),
                     mlx_row(mx, x, 4, 32, mx.float32, edit=lambda a: np.concatenate([a[:5], a[5:6] * 1.01, a[6:]]))])
    assert rows[0] == rows[1] == rows[2]
    assert rows[0][0]["status"] == "pass" and rows[0][1]["status"] == "fail"
