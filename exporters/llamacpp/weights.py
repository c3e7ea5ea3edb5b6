"""The weight check of a shipped GGUF (oracle/verdict/conversion.py): each GGUF tensor against the same tensor of
the original's f32 conversion by the same converter (the original in the GGUF's own layout: q/k rows
permuted, experts stacked, values transformed where the converter transforms them), per block of its
type, with the grid each block stores.

The grids, read from the blocks as gguf-py's dequantizer reads them (deq = step * q + offset), and what
llama.cpp's quantizer may do beyond rounding to the nearest grid point (`K_CLIP_RANGE`, `IMATRIX_*`):

| type | block | step, offset | q | grid rounded after q | clip |
|---|---|---|---|---|---|
| Q8_0 | 32 | d, 0 | -127..127 | F16 | 0 |
| Q4_0 / Q5_0 | 32 | d, -8d / -16d | 0..15 / 0..31 | F16 | 1 step (built from the signed extreme) |
| Q4_1 / Q5_1 | 32 | d, m | 0..15 / 0..31 | F16 | 0 |
| Q2_K | 16 | d sc, -dmin m | 0..3 | no: the q are chosen on the stored grid | `K_CLIP_RANGE` |
| Q3_K / Q6_K | 16 | d sc, 0 | -4..3 / -32..31 | no | `K_CLIP_RANGE` |
| Q4_K / Q5_K | 32 | d sc, -dmin m | 0..15 / 0..31 | no | `K_CLIP_RANGE` |

F32, F16 and BF16 tensors are a float format (half an ulp); IQ*, TQ* and MXFP4 tensors are codebook
formats without a bound here (listed, not judged). The grids are tested against gguf-py's own
dequantizer on llama.cpp's own quantizer's output (tests/test_conversion.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from oracle.verdict.conversion import CHUNK_ELEMENTS, Chunk, Format, TensorSource

QK = 256  # a K-quant super-block
# how far beyond its grid's range llama.cpp's K-quant search may leave a value, as a share of that range,
# without an imatrix and with one: the least-squares refit can shrink a sub-block's grid (Q6_K: an extreme
# 7.9 steps of 63 beyond), and an imatrix lets the search give up unimportant values altogether (Q4_K: 14
# steps of 15). Measured on llama.cpp 0.3.36's own quantizer (ggml_quantize_chunk; normal, t(3), t(2),
# outlier, shifted and one-signed blocks over three decades of scale; imatrix weights 0.01-10:
# docs/conversion.md): without an imatrix at most Q2_K 0.33, Q3_K 0.13, Q4_K 0.05, Q5_K 0.10, Q6_K 0.125
# of the range, the bounds about twice that; with one, 4 ranges (a zeroed row still fails: its range is 0)
K_CLIP_RANGE = {"Q2_K": (0.5, 4.0), "Q3_K": (0.25, 4.0), "Q4_K": (0.25, 4.0), "Q5_K": (0.25, 4.0),
                "Q6_K": (0.25, 4.0)}
# the legacy types with an imatrix: llama.cpp searches their scale and min and refits them after choosing
# the q, weighting each value by its importance (make_qx_quants / make_qkx3_quants): an unimportant value
# may land anywhere on the grid (Q5_1: 6.3 steps from its nearest point, 9 beyond the range; measured as
# above). The element bound then holds a value to its block's grid range, and the systematic fit judges
IMATRIX_SEARCH_REL = 1.0
IMATRIX_CLIP = {"Q4_0": 15, "Q5_0": 31, "Q4_1": 15, "Q5_1": 31}  # (Q8_0 ignores an imatrix: llama.cpp's quantize_q8_0)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 6-bit sub-block scales and mins [n, 8] (gguf-py's Q4_K.get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _grid_q8_0(b):
    d = _f16(b[:, :2])
    return d, np.zeros_like(d), None


def _grid_legacy_symmetric(half):
    def grid(b):
        d = _f16(b[:, :2])
        return d, -half * d, None
    return grid


def _grid_legacy_min(b):
    return _f16(b[:, :2]), _f16(b[:, 2:4]), None


def _grid_q2_k(b):
    sc = b[:, :16]
    d, dmin = _f16(b[:, 80:82]), _f16(b[:, 82:84])
    return d * (sc & 0xF).astype(np.float32), -dmin * (sc >> 4).astype(np.float32), _units(d, dmin, 3, 16)


def _units(d, dmin, span: int, sub: int):
    """A K-quant sub-block's units: its step and min are whole multiples of the super-block's d and dmin,
    over `span` q (the stored range may fall short of the chosen one by half a unit of each)."""
    return np.repeat(np.abs(d), sub, axis=1), np.repeat(np.abs(dmin), sub, axis=1), span


def _grid_q3_k(b):
    scales, d = b[:, 96:108], _f16(b[:, 108:110])
    lo = (scales[:, :8].reshape(-1, 1, 8) >> np.array([0, 4], np.uint8).reshape(1, 2, 1)).reshape(-1, 16)
    hi = (scales[:, 8:12].reshape(-1, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)).reshape(-1, 16)
    sc = ((lo & 0x0F) | ((hi & 0x03) << 4)).astype(np.int8) - np.int8(32)
    step = d * sc.astype(np.float32)
    return step, np.zeros_like(step), _units(d, 0 * d, 7, 16)


def _grid_q4_k(b):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    return d * sc, -dmin * mn, _units(d, dmin, 15, 8)


def _grid_q5_k(b):
    step, offset, _ = _grid_q4_k(b)
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    return step, offset, _units(d, dmin, 31, 8)


def _grid_q6_k(b):
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    step = d * sc
    return step, np.zeros_like(step), _units(d, 0 * d, 63, 16)


# type name -> (elements per sub-block, qmin, qmax, grid rounded after q (F16) or on it (None), clip steps,
# clip share of the range, grid fn)
GRIDS = {
    "Q8_0": (32, -127, 127, "F16", 0.0, 0.0, _grid_q8_0),
    "Q4_0": (32, 0, 15, "F16", 1.0, 0.0, _grid_legacy_symmetric(8)),
    "Q5_0": (32, 0, 31, "F16", 1.0, 0.0, _grid_legacy_symmetric(16)),
    "Q4_1": (32, 0, 15, "F16", 0.0, 0.0, _grid_legacy_min),
    "Q5_1": (32, 0, 31, "F16", 0.0, 0.0, _grid_legacy_min),
    "Q2_K": (16, 0, 3, None, 0.0, K_CLIP_RANGE["Q2_K"], _grid_q2_k),
    "Q3_K": (16, -4, 3, None, 0.0, K_CLIP_RANGE["Q3_K"], _grid_q3_k),
    "Q4_K": (32, 0, 15, None, 0.0, K_CLIP_RANGE["Q4_K"], _grid_q4_k),
    "Q5_K": (32, 0, 31, None, 0.0, K_CLIP_RANGE["Q5_K"], _grid_q5_k),
    "Q6_K": (16, -32, 31, None, 0.0, K_CLIP_RANGE["Q6_K"], _grid_q6_k),
}
FLOAT_TYPES = ("F32", "F16", "BF16")


def format_of(type_name: str, imatrix: bool = False) -> Format:
    """The Format of a GGML type; `imatrix`: the file was quantized with an importance matrix (its
    `quantize.imatrix.*` keys), which makes the legacy types search their scale."""
    if type_name in FLOAT_TYPES:
        return Format(type_name, dtype=type_name)
    if type_name in GRIDS:
        block, qmin, qmax, grid_dtype, clip, clip_range, _ = GRIDS[type_name]
        searched = imatrix and type_name in IMATRIX_CLIP
        return Format(type_name + (" (imatrix)" if imatrix else ""), block=block, qmin=qmin, qmax=qmax,
                      grid_dtype=grid_dtype, clip_steps=IMATRIX_CLIP[type_name] if searched else clip,
                      clip_range=clip_range[imatrix] if clip_range else 0.0,
                      search_rel=IMATRIX_SEARCH_REL if searched else 0.0)
    return Format(type_name, bounded=False)


def grid(type_name: str, raw: np.ndarray, type_size: int, fmt: Format):
    """(step, offset, range slack or None) per sub-block of raw blocks [..., row bytes] -> [rows, sub-blocks].
    The range slack of a K-quant sub-block: half a unit of its step (over its span, and what the search may
    clip of a step that rounded down, to 0 included) and of its min."""
    rows = raw.reshape(-1, raw.shape[-1])
    blocks = rows.reshape(-1, type_size)
    step, offset, units = GRIDS[type_name][-1](blocks)
    shape = (len(rows), -1)
    short = None
    if units is not None:
        d, dmin, span = units
        short = (0.5 * d * span * (1 + fmt.clip_range) + 0.5 * dmin).reshape(shape)
    return step.reshape(shape), offset.reshape(shape), short


def gguf_tensor_sources(shipped_path: Path, reference_path: Path, labels=None):
    """A TensorSource per tensor of the shipped GGUF, its original from the reference (the original's f32
    conversion by the same converter: same names, shapes and layout, checked by check_matches). `labels`:
    GGUF name -> the HF tensors it holds (the converter's element map), for the report."""
    from exporters.llamacpp.gguf import reader
    from exporters.llamacpp.setup import gguf_module

    gguf = gguf_module()
    shipped, reference = reader(Path(shipped_path)), reader(Path(reference_path))
    ref = {t.name: t for t in reference.tensors}
    imatrix = any(k.startswith("quantize.imatrix") for k in shipped.fields)
    for t in shipped.tensors:
        qtype = gguf.GGMLQuantizationType(t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape))  # numpy order
        r = ref[t.name]
        unit_rows = shape[1] if len(shape) == 3 and "_exps" in t.name else (1 if len(shape) == 2 and "_exps" in t.name else 0)
        fmt = format_of(qtype.name, imatrix)
        if r.tensor_type == t.tensor_type and qtype.name not in FLOAT_TYPES:
            # packed in the original's own conversion too (a release's MXFP4 experts, which the converter keeps):
            # the shipped values must be the release's, exactly (to the float32 they dequantize to)
            fmt = Format(f"{qtype.name} (kept from the release: its values exactly)", dtype="F32")
        yield TensorSource(t.name, (labels or {}).get(t.name, t.name), shape, fmt,
                           _chunks(gguf, t, r, qtype, shape, fmt), unit_rows)


def _chunks(gguf, t, r, qtype, shape, fmt):
    n = shape[-1]
    rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
    step_rows = max(1, CHUNK_ELEMENTS // n)
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]

    def chunks():
        raw = np.asarray(t.data).reshape(rows, -1)
        rtype = gguf.GGMLQuantizationType(r.tensor_type)
        if rtype.name == "F32":
            orig = np.asarray(r.data, dtype=np.float32).reshape(rows, n)  # the f32 reference conversion
        else:  # a release's packed tensors, which the converter keeps (MXFP4): their values
            orig = gguf.quants.dequantize(np.asarray(r.data), rtype).astype(np.float32).reshape(rows, n)
        for a in range(0, rows, step_rows):
            part = raw[a:a + step_rows]
            if qtype.name == "F32":
                deq = np.asarray(part, np.float32)
            else:
                deq = gguf.quants.dequantize(np.ascontiguousarray(part), qtype).reshape(len(part), n)
            step = offset = short = None
            if qtype.name in GRIDS:
                step, offset, short = grid(qtype.name, np.ascontiguousarray(part), type_size, fmt)
            yield Chunk(a, orig[a:a + step_rows], deq, step, offset, short)

    return chunks


def labels_from_map(emap) -> dict[str, str]:
    """GGUF name -> the HF tensors its elements come from (per-expert names folded to `experts.*`)."""
    import re

    out = {}
    for name in emap.runs:
        hf = sorted({re.sub(r"\.experts\.\d+\.", ".experts.*.", p[2]) for p in emap.sources(name)})
        out[name] = ", ".join(hf[:3]) + (f" (+{len(hf) - 3})" if len(hf) > 3 else "")
    return out


# where each grid type keeps its block scale d (2 bytes, f16) inside a block
D_OFFSET = {"Q8_0": 0, "Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q5_1": 0, "Q2_K": 80, "Q3_K": 108, "Q4_K": 0, "Q5_K": 0,
            "Q6_K": 208}


def scale_other_block(path: Path, layer: int) -> str | None:
    """A file defect: in one quantized tensor of `layer` (its experts' up projection where it is quantized),
    each block's scale d written for the next block (a packer off by one block). Returns the tensor's name;
    None where the layer has no tensor of a grid type (an F32 GGUF)."""
    from exporters.llamacpp.setup import gguf_module

    gguf = gguf_module()
    r = gguf.GGUFReader(str(path), "r+")
    cands = [t for t in r.tensors if t.name.startswith(f"blk.{layer}.")
             and gguf.GGMLQuantizationType(t.tensor_type).name in D_OFFSET]
    t = next((t for t in cands if "ffn_up_exps" in t.name), cands[0] if cands else None)
    if t is None:
        return None
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    blocks = t.data.reshape(-1, size)
    at = D_OFFSET[qtype.name]
    blocks[:, at:at + 2] = np.roll(np.array(blocks[:, at:at + 2]), 1, axis=0)
    r.data.flush()
    return t.name


def ggml_quantize(x: np.ndarray, type_name: str, imatrix: np.ndarray | None = None) -> np.ndarray:
    """Rows of `x` [rows, n] quantized by llama.cpp's own quantizer (ggml_quantize_chunk, as llama-quantize
    runs it; `imatrix`: per-column importances [n]): the raw blocks [rows, row bytes]. For measuring the
    bounds above and testing them (benchmarks/conversion_bounds.py, tests/test_conversion.py)."""
    import ctypes

    import llama_cpp

    from exporters.llamacpp.setup import gguf_module

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    t = int(gguf_module().GGMLQuantizationType[type_name])
    rows, n = x.shape
    lib.ggml_quantize_init(t)
    out = np.zeros((rows, lib.ggml_row_size(t, n)), np.uint8)
    src = np.ascontiguousarray(x, np.float32)
    imx = None if imatrix is None else np.ascontiguousarray(imatrix, np.float32)
    lib.ggml_quantize_chunk(t, src.ctypes.data, out.ctypes.data, 0, rows, n, None if imx is None else imx.ctypes.data)
    return out


def block_source(name: str, x: np.ndarray, raw: np.ndarray, type_name: str, imatrix: bool = False,
                 unit_rows: int = 0) -> TensorSource:
    """A TensorSource of raw blocks of `type_name` (rows of x), as the weight check of a GGUF tensor reads it."""
    from exporters.llamacpp.setup import gguf_module

    gguf = gguf_module()
    qtype = gguf.GGMLQuantizationType[type_name]
    fmt = format_of(type_name, imatrix)

    def chunks():
        deq = gguf.quants.dequantize(raw, qtype).reshape(x.shape)
        step, offset, short = grid(type_name, raw, gguf.GGML_QUANT_SIZES[qtype][1], fmt)
        yield Chunk(0, x, deq, step, offset, short)

    return TensorSource(name, name, x.shape, fmt, chunks, unit_rows)
